"""Record templates: the one ``${...}`` syntax every sink uses for topics, keys, indexes and commands.

A template is literal text with placeholders:

- ``${topic}``, ``${partition}``, ``${offset}``, ``${key}``, ``${destination}`` (the row's
  ``__destination``), ``${timestamp}`` (epoch milliseconds) and ``${timestamp:<strftime>}``
  (the message time in UTC, e.g. ``${timestamp:%Y.%m.%d}``);
- ``${payload}`` and ``${payload.<field>[.<field>...]}`` (a dotted path into the JSON payload);
- ``${headers}`` (JSON) and ``${headers.<name>}``.

Each sink says which of them it allows. A template that cannot be parsed is a config error
(:class:`TemplateSyntaxError`, found at validation); a row that cannot fill it (no key, a missing
field) is a data error for that row (:class:`TemplateError`), handled by the failure policy.

Sinks that used ``{topic}`` / ``{destination}`` / ``{%Y.%m.%d}`` (Elasticsearch, Pulsar and
GreptimeDB) still accept that form: :func:`upgrade_legacy` rewrites it with a warning.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import re
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.sinks.base import Record

PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_LEGACY_PLACEHOLDER = re.compile(r"(?<!\$)\{([^{}]*)\}")

#: Every placeholder root; a sink allows a subset.
FIELDS = ("topic", "partition", "offset", "key", "destination", "timestamp", "headers", "payload")
#: Roots that take a dotted path after them.
PATH_FIELDS = ("payload", "headers")


class TemplateSyntaxError(ValueError):
    """A template that cannot be parsed or uses a placeholder the setting does not allow (config)."""


class TemplateError(ValueError):
    """A row cannot fill a template (missing field, no key...): a data error for that row."""


@dataclasses.dataclass(frozen=True)
class Placeholder:
    """``${name}`` or ``${name:format}``; ``path`` is the dotted part after payload./headers."""

    name: str
    format: str | None = None

    @property
    def root(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.name.split(".")[1:])

    @property
    def rest(self) -> str:
        return self.name.partition(".")[2]

    def __str__(self) -> str:
        return "${" + self.name + ("" if self.format is None else ":" + self.format) + "}"


Part = str | Placeholder


def _describe(allowed: Iterable[str], formats: Iterable[str]) -> str:
    out = []
    for f in allowed:
        if f == "payload":
            out += ["${payload}", "${payload.<field>}"]
        elif f == "headers":
            out += ["${headers}", "${headers.<name>}"]
        else:
            out.append("${" + f + "}")
        if f in formats:
            out.append("${" + f + ":<format>}")
    return ", ".join(out)


def parse_placeholder(
    inner: str, allowed: Iterable[str] = FIELDS, formats: Iterable[str] = ()
) -> Placeholder:
    """The placeholder ``${inner}``; TemplateSyntaxError when the setting does not allow it."""
    allowed, formats = tuple(allowed), tuple(formats)
    text = inner.strip()
    name, colon, fmt = text.partition(":")
    root, dot, rest = name.partition(".")
    if root not in allowed:
        raise TemplateSyntaxError(
            f"unknown placeholder ${{{inner}}}; use one of {_describe(allowed, formats)}"
        )
    if colon:
        if root not in formats or dot:
            raise TemplateSyntaxError(
                f"${{{inner}}}: only {_describe(formats, formats) or 'none'} take a format"
            )
        if not fmt:
            raise TemplateSyntaxError(f"${{{inner}}}: empty format")
    if dot:
        if root not in PATH_FIELDS:
            raise TemplateSyntaxError(f"${{{inner}}}: only payload and headers have fields")
        # A header name may contain dots; a payload path is split on them.
        if not rest if root == "headers" else not all(rest.split(".")):
            raise TemplateSyntaxError(f"${{{inner}}}: empty field name")
    return Placeholder(name, fmt if colon else None)


def parse(
    template: str, allowed: Iterable[str] = FIELDS, formats: Iterable[str] = ()
) -> tuple[Part, ...]:
    """Literal text and placeholders of ``template``; TemplateSyntaxError when it is not usable."""
    allowed, formats = tuple(allowed), tuple(formats)
    parts: list[Part] = []
    pos = 0
    for m in PLACEHOLDER.finditer(template):
        if m.start() > pos:
            parts.append(template[pos : m.start()])
        parts.append(parse_placeholder(m.group(1), allowed, formats))
        pos = m.end()
    if pos < len(template):
        parts.append(template[pos:])
    if any(isinstance(p, str) and "${" in p for p in parts):
        raise TemplateSyntaxError(f"unclosed '${{' in {template!r}")
    return tuple(parts)


def problems(
    template: str, allowed: Iterable[str] = FIELDS, formats: Iterable[str] = ()
) -> list[str]:
    """What is wrong with ``template`` (empty when it is usable): every problem, for validation."""
    allowed, formats = tuple(allowed), tuple(formats)
    out = []
    if not template.strip():
        out.append("must not be empty")
    for m in PLACEHOLDER.finditer(template):
        try:
            parse_placeholder(m.group(1), allowed, formats)
        except TemplateSyntaxError as e:
            out.append(str(e))
    if "${" in PLACEHOLDER.sub("", template):
        out.append("unclosed '${'")
    return out


def is_static(template: str) -> bool:
    """Whether ``template`` has no placeholder (the same value for every row)."""
    return PLACEHOLDER.search(template) is None


def static_text(template: str, fill: str = "") -> str:
    """``template`` with every placeholder replaced by ``fill`` (for names and asset keys)."""
    return PLACEHOLDER.sub(fill, template)


def upgrade_legacy(template: str, setting: str) -> str:
    """``{topic}``, ``{destination}`` and ``{%...}`` rewritten as ``${...}``, with a warning.

    The old single-brace form of the Elasticsearch, Pulsar and GreptimeDB sinks.
    """
    if not isinstance(template, str) or not _LEGACY_PLACEHOLDER.search(template):
        return template

    def sub(m: re.Match[str]) -> str:
        inner = m.group(1)
        return "${timestamp:" + inner + "}" if inner.startswith("%") else "${" + inner + "}"

    new = _LEGACY_PLACEHOLDER.sub(sub, template)
    warnings.warn(
        f"{setting}: the {{...}} template form is deprecated; write {new!r} instead of {template!r}",
        FutureWarning,
        stacklevel=2,
    )
    return new


def text_of_value(value: Any) -> str:
    """A substituted value as text: JSON for objects and arrays, true/false for booleans."""
    from conveyor.sinks.base import json_default

    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=json_default, separators=(",", ":"))
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _utc(ts: dt.datetime) -> dt.datetime:
    return (
        ts.replace(tzinfo=dt.timezone.utc) if ts.tzinfo is None else ts.astimezone(dt.timezone.utc)
    )


def record_value(ph: Placeholder, record: Record) -> Any:
    """The value of ``ph`` for one row; TemplateError when the row lacks it."""
    name, root = ph.name, ph.root
    if name == "topic":
        return record.topic
    if name == "partition":
        return record.partition
    if name == "offset":
        return record.offset
    if name == "key":
        if record.key is None:
            raise TemplateError(f"message has no key ({ph} in the template)")
        return record.key
    if name == "destination":
        if not record.destination:
            raise TemplateError(f"message has no destination ({ph} in the template)")
        return record.destination
    if name == "timestamp":
        if record.timestamp is None:
            raise TemplateError(f"message has no timestamp ({ph} in the template)")
        ts = _utc(record.timestamp)
        return ts.strftime(ph.format) if ph.format else int(ts.timestamp() * 1000)
    if name == "headers":
        return {
            k: (v.decode(errors="replace") if v is not None else None) for k, v in record.headers
        }
    if root == "headers":
        found = None
        for k, v in record.headers:
            if k == ph.rest:
                found = v  # the last header of that name wins
        if found is None:
            raise TemplateError(f"message has no header {ph.rest!r} ({ph} in the template)")
        return found
    value: Any = record.payload_json()
    if name == "payload":
        if value is None:
            raise TemplateError(f"payload is null ({ph} in the template)")
        return value
    dotted = ".".join(ph.path)
    for part in ph.path:
        if not isinstance(value, dict) or part not in value:
            raise TemplateError(f"payload has no field {dotted!r} ({ph} in the template)")
        value = value[part]
    if value is None:
        raise TemplateError(f"payload field {dotted!r} is null ({ph} in the template)")
    return value


@functools.lru_cache(maxsize=512)
def _parsed(template: str) -> tuple[Part, ...]:
    # Settings were checked against their sink's subset at validation; here every field is known.
    return parse(template, FIELDS, formats=("timestamp",))


def render(
    template: str | tuple[Part, ...],
    record: Record,
    *,
    text: Callable[[Any], str] = text_of_value,
) -> str:
    """Fill ``template`` (text or parsed parts) from one row; TemplateError when the row lacks a value."""
    parts = _parsed(template) if isinstance(template, str) else template
    return "".join(p if isinstance(p, str) else text(record_value(p, record)) for p in parts)
