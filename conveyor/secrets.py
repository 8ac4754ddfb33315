"""Secrets by reference: ``${env:NAME}`` and ``${file:PATH}`` (Kafka Connect's KIP-297).

A spec holds references, never the secrets behind them. A reference may stand
anywhere in a text value, whole (``url: ${env:PG_URL}``) or inside it
(``url: postgresql://app:${file:/run/secrets/pg}@db:5432/app``); ``$${`` writes a
literal ``${``.

- ``${env:NAME}``: the environment variable NAME (set, possibly empty).
- ``${file:PATH}``: the content of the file at the absolute PATH, without its
  trailing newline (Kubernetes and Docker secret mounts).

Contract: references are resolved by ``resolve`` only in the process that runs
the data path (the connector op, a dead-letter replay, an offsets reset that asks
Kafka), right before the config is validated for use. Everything else (the meta
store, the Dagster UI and asset metadata, the CLI, the REST API, logs) sees the
spec as written with ``redact``: references shown as they are, secrets written
literally replaced by ``MASK``. Error messages name the field and the reference,
never the value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from conveyor.core.errors import ConfigError
from conveyor.core.references import REFERENCE, UNTERMINATED, argument_problem

MASK = "**********"

_REF = REFERENCE
_UNTERMINATED = UNTERMINATED


def references(value: Any) -> list[str]:
    """Every reference in a value (strings inside mappings and lists too), as written."""
    out: list[str] = []
    _walk(value, lambda s, _f: out.extend(m.group(0) for m in _REF.finditer(s) if not m.group(1)))
    return out


def has_reference(value: Any) -> bool:
    return bool(references(value))


def resolve(
    value: Any,
    *,
    field: str = "",
    environ: Mapping[str, str] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Any:
    """``value`` with every reference replaced by its secret; mappings and lists deeply.

    ``keep(field)`` leaves a field's value as written (a Kafka connection's secrets, which
    its client resolves at every connection so that a rotated file is read again).
    Raises ConfigError naming the field and the reference (an unset variable, an
    unreadable or relative file, an unknown provider). The returned structure holds
    secrets: hand it to validation and the client, never to a log or the store.
    """
    env = os.environ if environ is None else environ
    if keep is not None and keep(field):
        return value
    if isinstance(value, str):
        return _resolve_str(value, field, env)
    if isinstance(value, Mapping):
        return {
            k: resolve(v, field=_join(field, k), environ=env, keep=keep) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [
            resolve(v, field=f"{field}[{i}]", environ=env, keep=keep) for i, v in enumerate(value)
        ]
    return value


def check_syntax(value: Any, *, field: str = "") -> None:
    """Raise ConfigError for an unterminated reference or an unusable argument.

    Runs where specs are loaded (no secret is read): a typo is reported when the spec is
    written, not when the connector starts.
    """

    def check(s: str, f: str) -> None:
        for m in _REF.finditer(s):
            if not m.group(1):
                _check_ref(m.group(2), m.group(3), f)
        if _UNTERMINATED.search(s):
            raise ConfigError(
                "has an unterminated reference: write ${env:NAME} or ${file:/absolute/path} "
                "(or '$${' for a literal '${')",
                field=f or None,
            )

    _walk(value, check, field)


def mask_literal(value: str) -> str:
    """A secret field's value as shown: kept when its secret parts are references, else masked.

    ``${env:PG_URL}`` and ``postgresql://app:${env:PG_PW}@db/app`` are shown as written;
    a value with no reference, or a URL whose password is written literally, is masked.
    """
    if not has_reference(value):
        return MASK
    stripped = _REF.sub("", value)
    if _url_password(stripped):
        return MASK
    return value


def redact(data: Any, secret_fields: Callable[[str], bool], *, field: str = "") -> Any:
    """A copy of a spec mapping for display and storage.

    ``secret_fields(path)`` says whether the dotted field path (``sink.url``) holds a
    secret; those values go through ``mask_literal``. Any other text that contains a
    URL with a literal password has that password masked too.
    """
    if isinstance(data, Mapping):
        return {k: redact(v, secret_fields, field=_join(field, k)) for k, v in data.items()}
    if isinstance(data, list):
        return [redact(v, secret_fields, field=field) for v in data]
    if isinstance(data, str):
        if secret_fields(field):
            return mask_literal(data)
        return _mask_url_passwords(data)
    return data


# -- internals ----------------------------------------------------------------------------


def _join(field: str, key: Any) -> str:
    return f"{field}.{key}" if field else str(key)


def _walk(value: Any, fn: Callable[[str, str], None], field: str = "") -> None:
    if isinstance(value, str):
        fn(value, field)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _walk(v, fn, _join(field, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _walk(v, fn, f"{field}[{i}]")


def _check_ref(provider: str, arg: str, field: str) -> None:
    problem = argument_problem(provider, arg)
    if problem:
        raise ConfigError(f"${{{provider}:{arg}}}: {problem}", field=field or None)


def _resolve_str(s: str, field: str, env: Mapping[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1):  # $${...}: a literal ${...}
            return m.group(0)[1:]
        provider, arg = m.group(2), m.group(3)
        _check_ref(provider, arg, field)
        ref = m.group(0)
        if provider == "env":
            if arg not in env:
                raise ConfigError(
                    f"{ref}: environment variable {arg} is not set", field=field or None
                )
            return env[arg]
        try:
            text = Path(arg).read_text()
        except OSError as e:
            raise ConfigError(f"{ref}: cannot read: {e.strerror}", field=field or None) from None
        except UnicodeDecodeError:
            raise ConfigError(f"{ref}: the file is not UTF-8 text", field=field or None) from None
        return text.rstrip("\r\n")

    return _REF.sub(one, s)


_URL_USERINFO = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:@/\s]*):(?P<pw>[^@/\s]+)@"
)


def _url_password(s: str) -> bool:
    return any(m.group("pw") for m in _URL_USERINFO.finditer(s))


def _mask_url_passwords(s: str) -> str:
    def one(m: re.Match[str]) -> str:
        pw = m.group("pw")
        if _REF.fullmatch(pw):
            return m.group(0)
        return f"{m.group('scheme')}{m.group('user')}:{MASK}@"

    return _URL_USERINFO.sub(one, s)
