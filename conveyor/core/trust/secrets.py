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
``CONVEYOR_*``), never Conveyor's own credentials and settings (``DENIED_ENV`` and every
variable of the documented Environment table, ``SETTINGS_ENV``).

Contract: references are resolved by ``resolve`` only in the process that runs
the data path (the connector op, a dead-letter replay, an offsets reset that asks
Kafka), right before the config is validated for use. Everything else (the meta
store, the Dagster UI and asset metadata, the CLI, the REST API, logs) sees the
spec as written with ``redact``: references shown as they are, secrets written
literally replaced by ``MASK``. Error messages name the field and the reference,
never the value: ``resolve`` remembers every value it returns (``core.trust.scrubbing``), and
the run scrubs them out of the errors, history and logs it writes and the exceptions it
raises.
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
from conveyor.core.host.home import DEFAULT_HOME
from conveyor.core.trust import scrubbing
from conveyor.core.trust.references import (
    REFERENCE,
    UNTERMINATED,
    argument_problem,
    literal_credential_message,
    literal_credential_problem,
    whole_reference_problem,
    with_placeholders,
)

MASK = "**********"
SECRET_FILES_ENV = "CONVEYOR_SECRET_FILES"
SECRET_ENV_ENV = "CONVEYOR_SECRET_ENV"
DEFAULT_ENV_PATTERNS = ("CONVEYOR_*",)
# Conveyor's own credentials and the policy itself: never readable by a spec, whatever the
# patterns say (a sink URL of the caller's server would carry them there). So is every other
# variable Conveyor reads as a setting (``SETTINGS_ENV``: the documented environment).
DENIED_ENV = ("CONVEYOR_META_URL", "CONVEYOR_API_*", SECRET_FILES_ENV, SECRET_ENV_ENV)
# A section's fields that say where its secrets are sent (and whether the server is
# verified): a mask sent back keeps the stored secret only while these are unchanged.
DESTINATION_FIELDS = frozenset(
    [
        "url",
        "url_env",
        "urls",
        "uri",
        "host",
        "hosts",
        "port",
        "bootstrap_servers",
        "service_url",
        "startup_nodes",
        "endpoint",
        "vhost",
        "server_name",
        "database",
        "db",
        "security_protocol",
        "sasl_mechanism",
        "tls",
        "verify_tls",
        "verify_certs",
        "ssl_check_hostname",
        "tls_check_hostname",
        "tls_validate_hostname",
        "tls_allow_insecure_connection",
        "tls_insecure_skip_hostname_check",
        "ssl_cafile",
        "tls_ca_file",
        "ca_certs",
        "tls_trust_certs_file_path",
    ]
)
_DESTINATION_NAME = re.compile(r"(^|_)(urls?|uri|hosts?|port|servers|nodes|endpoint)$")


def is_destination_field(name: str) -> bool:
    """Whether a config field says where a section's secrets go (``DESTINATION_FIELDS``, or a
    name ending like one: ``..._url``, ``..._host``, ``..._port``)."""
    return name in DESTINATION_FIELDS or bool(_DESTINATION_NAME.search(name))


# Every variable Conveyor reads as a setting: the names of docs/CONFIG.md's Environment table
# (tests/unit/test_secret_scrubbing.py fails for a documented setting missing here).
SETTINGS_ENV = frozenset(
    [
        "CONVEYOR_API_ALLOWED_HOSTS",
        "CONVEYOR_API_ALLOWED_ORIGINS",
        "CONVEYOR_API_MAX_BODY_BYTES",
        "CONVEYOR_API_READONLY_TOKEN",
        "CONVEYOR_API_READONLY_TOKEN_FILE",
        "CONVEYOR_API_TOKEN",
        "CONVEYOR_API_TOKEN_FILE",
        "CONVEYOR_ARROW_MEMORY_POOL",
        "CONVEYOR_BROKERS_FILE",
        "CONVEYOR_BROKER_CAPACITY",
        "CONVEYOR_CONNECTORS_DIR",
        "CONVEYOR_DAGSTER_URL",
        "CONVEYOR_DEBUG",
        "CONVEYOR_DEMO_LAKE",
        "CONVEYOR_DEMO_PG_URL",
        "CONVEYOR_DEMO_START",
        "CONVEYOR_FILE_ROOTS",
        "CONVEYOR_HOME",
        "CONVEYOR_KAFKA_BOOTSTRAP",
        "CONVEYOR_LAG_CHECK_MINUTES",
        "CONVEYOR_MALLOC_MMAP_THRESHOLD_KIB",
        "CONVEYOR_META_URL",
        "CONVEYOR_RELOAD_GRACE_S",
        "CONVEYOR_RUNSERVER_CODE_LOCATION",
        "CONVEYOR_RUNSERVER_PRELOAD",
        "CONVEYOR_RUN_LAUNCHER",
        "CONVEYOR_SCHEDULER_CANCEL_GRACE_S",
        "CONVEYOR_SCHEDULER_HEALTHY_RESET_S",
        "CONVEYOR_SCHEDULER_LAUNCH_TIMEOUT_S",
        "CONVEYOR_SCHEDULER_RATE_UNIT",
        "CONVEYOR_SCHEDULER_REBALANCE_COOLDOWN_S",
        "CONVEYOR_SCHEDULER_RELEASE_GRACE_S",
        "CONVEYOR_SCHEDULER_REBALANCE_THRESHOLD",
        "CONVEYOR_SCHEDULER_RESTART_BACKOFF_MAX_S",
        "CONVEYOR_SCHEDULER_RESTART_BACKOFF_S",
        "CONVEYOR_SCHEDULER_RUN_WAIT_S",
        "CONVEYOR_SECRET_ENV",
        "CONVEYOR_SECRET_FILES",
        "CONVEYOR_SPARK_REMOTE",
    ]
)


def settings_env() -> frozenset[str]:
    """Every variable Conveyor reads as a setting (the documented environment)."""
    return SETTINGS_ENV


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
        if any(fnmatch.fnmatchcase(name, p) for p in DENIED_ENV) or name in settings_env():
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
        problem = literal_credential_problem(s, key_value=secret) or libpq_credential_problem(
            s, key_value=secret
        )
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
    value (the usual GET, edit, PUT round trip; a secret field that is also a destination,
    a connection ``url``, included: its mask keeps the stored URL). Refused: a mask where
    nothing is stored, and a mask in a section whose destination changed
    (``is_destination_field``: the stored secret would be sent to a server the caller
    chose)."""
    out: dict[str, Any] = _copy_dicts(config)
    kept: list[str] = []
    for path in sorted(secret_paths):
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
        kept.append(path)
    # Compared once every mask stands for what it keeps: a secret that is also a destination
    # (a connection URL) sent back as the mask is the stored one, so it changed nothing.
    for path in kept:
        keys = path.split(".")
        changed = _changed_destination(_lookup(out, keys[:-1]), _lookup(stored, keys[:-1]))
        if changed:
            raise ConfigError(
                f"re-enter {path}: the destination changed ({changed}), so the stored secret "
                f"is not kept for it; send the secret (a reference) in place of {MASK!r}",
                field=path,
            )
    return out


def _changed_destination(section: Mapping[str, Any], stored: Any) -> str | None:
    """The first destination field that differs between a section sent and the stored one."""
    before = stored if isinstance(stored, Mapping) else {}
    for key in sorted({*section, *before}, key=str):
        if is_destination_field(str(key)) and section.get(key) != before.get(key):
            return str(key)
    return None


def libpq_credential_problem(value: str, *, key_value: bool = True) -> str | None:
    """Why a PostgreSQL connection string holds a password written literally, as libpq reads
    it (``parse_dsn``: percent-decoded URI parts and query keys, key/value pairs after a
    quote), or None. URIs always; with ``key_value`` (a secret field) key/value strings too."""
    text, placeholders = with_placeholders(value)
    is_uri = re.match(r"\s*postgres(ql)?://", text, re.IGNORECASE) is not None
    if not is_uri and not (key_value and "=" in text):
        return None
    from psycopg2 import ProgrammingError
    from psycopg2.extensions import parse_dsn

    try:
        parsed = parse_dsn(text)
    except ProgrammingError:
        return None  # not a connection string libpq would take: nothing it would send
    for key in ("password", "sslpassword"):
        cred = parsed.get(key)
        if cred and cred not in placeholders:
            return literal_credential_message(f"a '{key}' (as libpq reads the string)")
    return None


def mask_url_passwords(text: str) -> str:
    """``text`` with the password of every URL in it masked (error and status messages)."""
    return _mask_url_passwords(text)


def mask_literal(value: str) -> str:
    """A secret field's value as shown: exactly one reference, or a URL whose credentials are
    all references, is shown as written; anything else is masked (a literal secret, and a
    reference with literal text around it, ``${env:X}suffix``, which may be half a secret).

    ``${env:PG_URL}`` and ``postgresql://app:${env:PG_PW}@db/app`` are shown as written.
    """
    if whole_reference_problem(value) is None:
        return value
    text, _ = with_placeholders(value)
    if text == value or not re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text):
        return MASK
    if literal_credential_problem(value) or libpq_credential_problem(value):
        return MASK
    if _url_password(_REF.sub("", value)):
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
            scrubbing.remember(env[arg], ref)
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
        secret = text.rstrip("\r\n")
        scrubbing.remember(secret, ref)
        return secret

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
