"""Secrets by reference: ``${env:NAME}`` and ``${file:PATH}`` (Kafka Connect's KIP-297).

A spec holds references, never the secrets behind them. A reference may stand
anywhere in a text value, whole (``url: ${env:PG_URL}``) or inside it
(``url: postgresql://app:${file:/run/secrets/pg}@db:5432/app``); ``$${`` writes a
literal ``${``.

- ``${env:NAME}``: the environment variable NAME (set, possibly empty).
- ``${file:PATH}``: the content of the file at the absolute PATH, without its
  trailing newline (Kubernetes and Docker secret mounts).

Bounded (Kafka Connect's KIP-993 ``allowed.paths``): a reference may stand only in a field
declared secret (``check_placement``; a name, table, topic or template could carry the
secret into data or an error), and reads only what the operator allows (``SecretPolicy``):
files under ``$CONVEYOR_SECRET_FILES`` (comma-separated directories; default
``$CONVEYOR_HOME/secrets``), the path resolved (symlinks, no ``..``) before the check;
variables whose names match ``$CONVEYOR_SECRET_ENV`` (comma-separated patterns; default
``CONVEYOR_*``), never Conveyor's own credentials and settings (``DENIED_ENV``).

Contract: references are resolved by ``resolve`` only in the process that runs
the data path (the connector op, a dead-letter replay, an offsets reset that asks
Kafka), right before the config is validated for use. Everything else (the meta
store, the Dagster UI and asset metadata, the CLI, the REST API, logs) sees the
spec as written with ``redact``: references shown as they are, secrets written
literally replaced by ``MASK``. Error messages name the field and the reference,
never the value.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from conveyor.core.errors import ConfigError
from conveyor.core.references import (
    REFERENCE,
    UNTERMINATED,
    argument_problem,
    literal_credential_problem,
)
from conveyor.store.meta import DEFAULT_HOME

MASK = "**********"
SECRET_FILES_ENV = "CONVEYOR_SECRET_FILES"
SECRET_ENV_ENV = "CONVEYOR_SECRET_ENV"
DEFAULT_ENV_PATTERNS = ("CONVEYOR_*",)
# Conveyor's own credentials and the policy itself: never readable by a spec, whatever the
# patterns say (a sink URL of the caller's server would carry them there).
DENIED_ENV = ("CONVEYOR_META_URL", "CONVEYOR_API_*", SECRET_FILES_ENV, SECRET_ENV_ENV)


@dataclass(frozen=True)
class SecretPolicy:
    """What a reference may read: files under ``file_prefixes`` (real paths), variables
    matching ``env_patterns`` and none of ``DENIED_ENV``."""

    file_prefixes: tuple[str, ...]
    env_patterns: tuple[str, ...] = DEFAULT_ENV_PATTERNS

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SecretPolicy:
        """The operator's policy (``$CONVEYOR_SECRET_FILES``, ``$CONVEYOR_SECRET_ENV``)."""
        env = os.environ if environ is None else environ
        raw_files = env.get(SECRET_FILES_ENV, "").strip()
        if raw_files:
            dirs = [d.strip() for d in raw_files.split(",") if d.strip()]
        else:
            home = Path(env.get("CONVEYOR_HOME") or DEFAULT_HOME).absolute()
            dirs = [str(home / "secrets")]
        for d in dirs:
            if not PurePosixPath(d).is_absolute():
                raise ConfigError(f"{d!r} is not an absolute directory", field=SECRET_FILES_ENV)
        raw_env = env.get(SECRET_ENV_ENV, "").strip()
        patterns = tuple(p.strip() for p in raw_env.split(",") if p.strip())
        return cls(
            file_prefixes=tuple(os.path.realpath(d) for d in dirs),
            env_patterns=patterns or DEFAULT_ENV_PATTERNS,
        )

    def env_allowed(self, name: str) -> bool:
        if any(fnmatch.fnmatchcase(name, p) for p in DENIED_ENV):
            return False
        return any(fnmatch.fnmatchcase(name, p) for p in self.env_patterns)

    def file_allowed(self, path: str) -> str | None:
        """The real path to read, or None when ``path`` is outside the allowed directories."""
        if ".." in PurePosixPath(path).parts:
            return None
        real = os.path.realpath(path)
        for prefix in self.file_prefixes:
            if os.path.commonpath([real, prefix]) == prefix and real != prefix:
                return real
        return None


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
    policy: SecretPolicy | None = None,
) -> Any:
    """``value`` with every reference replaced by its secret; mappings and lists deeply.

    ``keep(field)`` leaves a text field's value as written (a field that is not secret; a
    Kafka connection's secrets, which its client resolves at every connection so that a
    rotated file is read again). ``policy`` (default: the operator's, from ``environ``)
    bounds what is read. Raises ConfigError naming the field and the reference (an unset
    or refused variable, an unreadable, relative or refused file), never the value. The
    returned structure holds secrets: hand it to validation and the client, never to a log
    or the store.
    """
    env = os.environ if environ is None else environ
    pol = SecretPolicy.from_environ(env) if policy is None else policy
    if isinstance(value, str):
        if keep is not None and keep(field):
            return value
        return _resolve_str(value, field, env, pol)
    if isinstance(value, Mapping):
        return {
            k: resolve(v, field=_join(field, k), environ=env, keep=keep, policy=pol)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [
            resolve(v, field=f"{field}[{i}]", environ=env, keep=keep, policy=pol)
            for i, v in enumerate(value)
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


def check_placement(value: Any, secret_paths: Collection[str], *, field: str = "") -> None:
    """Raise ConfigError naming the field for a reference outside a secret field, a credential
    written literally in a connection string, or the mask sent back as a value.

    Runs on a spec as written (the run's resolved copy holds the secrets themselves).
    """

    def check(s: str, f: str) -> None:
        secret = f in secret_paths
        if not secret and has_reference(s):
            allowed = ", ".join(sorted(secret_paths)) or "none in this spec"
            raise ConfigError(
                "holds a ${env:...} / ${file:...} reference, which is resolved only in a "
                f"secret field (here: {allowed}); write the value itself",
                field=f or None,
            )
        problem = literal_credential_problem(s, key_value=secret)
        if problem:
            raise ConfigError(problem, field=f or None)
        if MASK in s:
            raise ConfigError(
                f"holds the mask {MASK!r} shown in place of a secret: send the secret (a "
                "reference) or, to keep the stored one, PUT the config back over the "
                "connector that has it",
                field=f or None,
            )

    _walk(value, check, field)


def keep_stored_secrets(
    config: Mapping[str, Any], stored: Mapping[str, Any] | None, secret_paths: Collection[str]
) -> dict[str, Any]:
    """``config`` with each secret field sent back as exactly ``MASK`` replaced by the stored
    value (the usual GET, edit, PUT round trip); a mask where nothing is stored is refused."""
    out: dict[str, Any] = _copy_dicts(config)
    for path in secret_paths:
        keys = path.split(".")
        parent = _lookup(out, keys[:-1])
        if not isinstance(parent, dict) or parent.get(keys[-1]) != MASK:
            continue
        old = _lookup(stored, keys)
        if not isinstance(old, str) or old == MASK:
            raise ConfigError(
                f"is the mask {MASK!r}, and the connector has no stored secret here to keep: "
                "send the secret as a reference, ${env:NAME} or ${file:/path}",
                field=path,
            )
        parent[keys[-1]] = old
    return out


def scrub(message: str, written: Any, resolved: Any) -> str:
    """``message`` with every value a reference in ``written`` resolved to (in ``resolved``,
    the same structure) masked: an error raised while validating resolved values never
    carries them, whatever a validator wrote."""
    values: set[str] = set()

    def collect(before: Any, after: Any) -> None:
        if isinstance(before, str) and isinstance(after, str) and before != after:
            values.update(_reference_values(before, after))
        elif isinstance(before, Mapping) and isinstance(after, Mapping):
            for k, v in before.items():
                collect(v, after.get(k))
        elif isinstance(before, (list, tuple)) and isinstance(after, (list, tuple)):
            for b, a in zip(before, after, strict=False):
                collect(b, a)

    collect(written, resolved)
    for value in sorted(values, key=len, reverse=True):
        if len(value) >= 4:  # shorter ones cannot be told from the message's own words
            message = message.replace(value, MASK)
    return message


def _reference_values(before: str, after: str) -> list[str]:
    """What each reference of ``before`` became in ``after`` (the text around them is kept)."""
    pattern, last = "", 0
    for m in _REF.finditer(before):
        pattern += re.escape(before[last : m.start()])
        pattern += re.escape(m.group(0)[1:]) if m.group(1) else "(.*?)"
        last = m.end()
    pattern += re.escape(before[last:])
    m = re.fullmatch(pattern, after, re.DOTALL)
    return [g for g in m.groups() if g] if m else [after]


def mask_url_passwords(text: str) -> str:
    """``text`` with the password of every URL in it masked (error and status messages)."""
    return _mask_url_passwords(text)


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


def _copy_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy_dicts(v) for k, v in value.items()}
    return value


def _lookup(data: Any, keys: list[str]) -> Any:
    for k in keys:
        if not isinstance(data, Mapping):
            return None
        data = data.get(k)
    return data


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


def _resolve_str(s: str, field: str, env: Mapping[str, str], policy: SecretPolicy) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1):  # $${...}: a literal ${...}
            return m.group(0)[1:]
        provider, arg = m.group(2), m.group(3)
        _check_ref(provider, arg, field)
        ref = m.group(0)
        if provider == "env":
            if not policy.env_allowed(arg):
                raise ConfigError(
                    f"{ref}: variable {arg} may not be referenced (allowed: names matching "
                    f"{SECRET_ENV_ENV}, default {','.join(DEFAULT_ENV_PATTERNS)}; never "
                    f"{', '.join(DENIED_ENV)})",
                    field=field or None,
                )
            if arg not in env:
                raise ConfigError(
                    f"{ref}: environment variable {arg} is not set", field=field or None
                )
            return env[arg]
        real = policy.file_allowed(arg)
        if real is None:
            raise ConfigError(
                f"{ref}: the file is outside the directories secrets may be read from "
                f"({SECRET_FILES_ENV}, default $CONVEYOR_HOME/secrets)",
                field=field or None,
            )
        try:
            text = Path(real).read_text()
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
