"""How deep, how large and how tangled a record or a registry schema may be before a decoder
refuses it, instead of recursing until Python gives up.

Records come from the topic and schemas from the registry: both are input, and either could
be built to exhaust the decoder (a JSON record nested 200,000 deep, an Avro schema nested
1,500 deep, two subjects referencing each other). Without a bound each raised
``RecursionError`` out of ``decode``, which failed the batch whatever the failure policy said.
With them:

- a record beyond ``MAX_RECORD_NESTING`` is one failed message (the record's fault: the
  failure policy decides, a dead letter by default under ``dead_letter``);
- a schema beyond ``MAX_SCHEMA_BYTES``, ``MAX_SCHEMA_NESTING`` or ``MAX_TYPE_DEPTH``, or one
  that pulls in more than ``MAX_REFERENCES`` references or a reference cycle, is a
  ``ConfigError`` naming the schema (id, subject and version; ``schema_error``): the
  operator's to look at, as no retry fixes it. A library that still recurses too deep on a
  schema (``RecursionError``) is reported the same way, and on a record as its failure.

The limits sit far above real schemas (types 64 deep, a megabyte of schema text) and within
what the libraries can walk on Python's default recursion limit (``jsonschema`` validates
about 250 levels; the decoders run a few dozen frames deep).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

from conveyor.core.errors import ConfigError

MAX_RECORD_NESTING = 100  # arrays and objects inside each other in one JSON record
MAX_SCHEMA_BYTES = 1 << 20  # the text of one schema (each reference counted on its own)
MAX_SCHEMA_NESTING = 256  # arrays and objects inside each other in a schema's JSON text
MAX_TYPE_DEPTH = 64  # records / messages / objects, arrays and maps inside each other
MAX_REFERENCES = 100  # distinct schemas one schema pulls in through its references

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the brackets
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_nesting(text: bytes | str) -> int:
    """How deep arrays and objects nest in a JSON text, read without recursion (and without
    parsing it: brackets inside strings are not counted; malformed text gets a number too,
    and its parser will refuse it)."""
    data = text.encode() if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= 1:
        return data.count(b"[") + data.count(b"{")
    brackets = _STRING.sub(b"", data).translate(None, _BRACKETS)
    return max(accumulate(_STEP[b] for b in brackets), default=0)


def record_nesting_problem(payload: bytes) -> str | None:
    """Why a JSON record may not be decoded (too deeply nested), or None."""
    if payload.count(b"[") + payload.count(b"{") <= MAX_RECORD_NESTING:
        return None  # the common case, at C speed
    depth = json_nesting(payload)
    if depth > MAX_RECORD_NESTING:
        return f"nested deeper than {MAX_RECORD_NESTING} levels ({depth}): not decoded"
    return None


@dataclass(frozen=True)
class SchemaName:
    """How errors name a schema: its id (a writer's) and the subject versions it is."""

    schema_id: int | None = None
    versions: tuple[tuple[str, int], ...] = ()

    def __str__(self) -> str:
        parts = [f"schema id {self.schema_id}"] if self.schema_id is not None else []
        parts += [f"subject {s!r} version {v}" for s, v in self.versions]
        return ", ".join(parts) or "the schema"


class SchemaLimit(Exception):  # noqa: N818 - not an error of the record: see schema_error
    """A schema beyond a limit of this module; ``schema_error`` makes it the ConfigError that
    names the schema. Not a ValueError: the decoders turn those into failed records."""


def schema_error(name: SchemaName | str, problem: BaseException, *, field: str) -> ConfigError:
    """The ConfigError of a schema beyond the limits (``problem``: a SchemaLimit, or the
    RecursionError a library raised on a schema nested too deeply for it)."""
    why = (
        str(problem) if isinstance(problem, SchemaLimit) else "nested deeper than the decoder reads"
    )
    return ConfigError(f"{name}: {why}", field=field)


def check_schema_text(text: str, *, json_text: bool) -> None:
    """SchemaLimit when a schema's text is too large or (JSON) too deeply nested."""
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        raise SchemaLimit(f"the schema is larger than {MAX_SCHEMA_BYTES} bytes ({size})")
    if json_text:
        depth = json_nesting(text)
        if depth > MAX_SCHEMA_NESTING:
            raise SchemaLimit(
                f"the schema's JSON is nested deeper than {MAX_SCHEMA_NESTING} levels ({depth})"
            )


def type_depth_limit(depth: int) -> SchemaLimit:
    return SchemaLimit(
        f"types nested deeper than {MAX_TYPE_DEPTH} levels ({depth}, counting the types "
        "its references define)"
    )


@dataclass
class ReferenceWalk:
    """The references one schema pulls in, walked depth first: each (subject, version) once;
    a cycle and more than ``MAX_REFERENCES`` are a SchemaLimit naming them."""

    seen: set[tuple[str, int]] = field(default_factory=set)
    path: list[tuple[str, int]] = field(default_factory=list)

    @contextlib.contextmanager
    def enter(self, subject: str, version: int) -> Iterator[bool]:
        """Yields False when this reference was walked already (skip it), else True while
        its own references are walked."""
        key = (subject, int(version))
        if key in self.path:
            chain = " -> ".join(f"subject {s!r} version {v}" for s, v in [*self.path, key])
            raise SchemaLimit(f"a reference cycle: {chain}")
        if key in self.seen:
            yield False
            return
        self.seen.add(key)
        if len(self.seen) > MAX_REFERENCES:
            raise SchemaLimit(f"more than {MAX_REFERENCES} references")
        self.path.append(key)
        try:
            yield True
        finally:
            self.path.pop()
