"""Where a spec's files may be: the one rule for every path a connector spec names.

A spec names files the run reads (an Avro schema file, TLS certificates and keys) and places
it writes (a LocalFile directory, a lakehouse warehouse or table, an Iceberg SQLite catalog,
dead letters). Whoever may write a spec (the API's admin token, the connectors directory)
must not reach the rest of the host through them, so each path resolves under a declared
root: ``$CONVEYOR_HOME``, and the directories listed in ``$CONVEYOR_FILE_ROOTS``
(comma-separated, absolute; Kafka Connect's ``allowed.paths``, as the secrets allowlist).

- A relative path is taken from ``$CONVEYOR_HOME`` (never the process's working directory).
- ``..`` is refused; symbolic links are resolved before the check, so a link inside a root
  that points out of it is refused; a root itself is refused (a spec names a place in it).
- Never under the secrets directories (``$CONVEYOR_SECRET_FILES``, what ``${file:...}``
  references read), nor in Conveyor's own files (``OWN_ENTRIES`` of the home: the meta store,
  the API tokens, the connectors directory, the brokers file, Dagster's and the logs'
  directories; their settings when they are elsewhere).
- ``$CONVEYOR_HOME/dead_letters`` holds each connector's dead letters in a directory named
  after it: only a connector's own dead-letter setting may name its own place there.
- A location that may be a URL (``location``): another scheme's URL (``s3://``, ``hdfs://``)
  is passed as written; a ``file://`` URL is its path.

Contract: a config model's validator calls ``problem`` / ``location_problem`` (a
``FieldRuleError`` naming the field), and the code that opens the file or place calls
``resolve`` / ``resolve_location`` again right before opening it and opens the real path it
returns (the check at the time of use). Errors name the field, the path as written and the
roots; nothing here reads a file, so no error can quote one's content.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlparse

from conveyor.core.errors import ConfigError
from conveyor.core.host.home import DEFAULT_HOME
from conveyor.core.trust.secrets import SECRET_FILES_ENV, SecretPolicy

ROOTS_ENV = "CONVEYOR_FILE_ROOTS"
DEAD_LETTERS_DIR = "dead_letters"
# Conveyor's own entries in $CONVEYOR_HOME (the meta store and its journal files, the API
# tokens, the dev server's workspace, the brokers file, the connectors directory, Dagster's
# home, logs, the Spark server's work directory, the topics baselines): no spec path names them.
OWN_ENTRIES = (
    "meta.db",
    "meta.db-wal",
    "meta.db-shm",
    "meta.db-journal",
    "api-token",
    "api-token-readonly",
    "workspace.yaml",
    "brokers.yaml",
    "connectors",
    "dagster",
    "logs",
    "spark",
    "active-topics",
)
# Settings naming Conveyor's own files elsewhere than the home.
OWN_ENV = (
    "CONVEYOR_CONNECTORS_DIR",
    "CONVEYOR_BROKERS_FILE",
    "CONVEYOR_API_TOKEN_FILE",
    "CONVEYOR_API_READONLY_TOKEN_FILE",
    "DAGSTER_HOME",
)

# The fields of sink and source configs that name a certificate or key file their client
# reads, by name across every config (as ``secrets.DESTINATION_FIELDS``): the config base
# classes check them (``certificate_problem``), the code building the client resolves them.
CERTIFICATE_FIELDS = (
    "ca_certs",
    "ssl_cafile",
    "ssl_certfile",
    "ssl_keyfile",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "tls_trust_certs_file_path",
)

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SQLITE_META = re.compile(r"^sqlite(\+\w+)?:///(?P<path>[^?]+)")


@dataclass(frozen=True)
class PathRoots:
    """Where spec paths may lie (``roots``, real paths, the home first), and what they may
    never name (``secrets``: the secrets directories; ``own``: Conveyor's files)."""

    home: str
    roots: tuple[str, ...]
    secrets: tuple[str, ...]
    own: tuple[str, ...]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> PathRoots:
        """The operator's roots (``$CONVEYOR_HOME``, ``$CONVEYOR_FILE_ROOTS``)."""
        env = os.environ if environ is None else environ
        home = os.path.realpath(env.get("CONVEYOR_HOME") or DEFAULT_HOME)
        extra = [d.strip() for d in env.get(ROOTS_ENV, "").split(",") if d.strip()]
        for d in extra:
            if not os.path.isabs(d):
                raise ConfigError(f"{d!r} is not an absolute directory", field=ROOTS_ENV)
        roots = tuple(dict.fromkeys([home, *(os.path.realpath(d) for d in extra)]))
        secrets = SecretPolicy.from_environ(env).file_prefixes
        own = [os.path.join(home, e) for e in OWN_ENTRIES]
        own += [env[k] for k in OWN_ENV if env.get(k) and os.path.isabs(env[k])]
        meta = _SQLITE_META.match(env.get("CONVEYOR_META_URL", ""))
        if meta:
            db = meta.group("path")
            own += [db, f"{db}-wal", f"{db}-shm", f"{db}-journal"]
        real_own = (os.path.realpath(p) for p in own)
        # An own directory that holds a root (a connectors directory set to the home) would
        # refuse every path: the operator chose to mix them.
        return cls(home, roots, secrets, tuple(p for p in real_own if not _holds_root(p, roots)))

    def describe(self) -> str:
        """The roots as an error shows them."""
        extra = [r for r in self.roots if r != self.home]
        text = f"$CONVEYOR_HOME ({self.home})"
        return text + (f" and {ROOTS_ENV} ({', '.join(extra)})" if extra else "")

    def problem(self, value: str, *, owner: str | None = None) -> str | None:
        """Why the path ``value`` is refused, or None. ``owner``: the connector whose own
        dead-letter place (``$CONVEYOR_HOME/dead_letters/<owner>``) the path may name."""
        if not value.strip():
            return "must not be empty"
        if "\0" in value:
            return "holds a NUL character"
        if ".." in PurePosixPath(value).parts:
            return f"{value!r}: '..' is not allowed"
        full = os.path.normpath(value if os.path.isabs(value) else os.path.join(self.home, value))
        real = os.path.realpath(full)
        if not any(_under(real, r) and real != r for r in self.roots):
            how = " (through a symbolic link)" if real != full else ""
            return (
                f"{value!r} resolves{how} to {real}, outside the roots a spec's paths may name: "
                f"{self.describe()} ({ROOTS_ENV} adds directories)"
            )
        if any(_under(real, s) for s in self.secrets):
            return (
                f"{value!r} is in the secrets directory ({SECRET_FILES_ENV}), which only "
                f"${{file:...}} references read; name a file elsewhere under {self.describe()}"
            )
        if any(_under(real, o) for o in self.own):
            return f"{value!r} is one of Conveyor's own files or directories ({real})"
        return self._dead_letters_problem(value, real, owner)

    def _dead_letters_problem(self, value: str, real: str, owner: str | None) -> str | None:
        base = os.path.join(self.home, DEAD_LETTERS_DIR)
        if not _under(real, base):
            return None
        if owner is not None and _under(real, os.path.join(base, owner)):
            return None
        mine = f" (this connector's is {DEAD_LETTERS_DIR}/{owner})" if owner else ""
        return (
            f"{value!r} is in $CONVEYOR_HOME/{DEAD_LETTERS_DIR}, where each connector's dead "
            f"letters live in a directory named after it{mine}"
        )

    def resolve(self, value: str, *, field: str, owner: str | None = None) -> str:
        """The real path of ``value``; ConfigError naming ``field`` when it is refused."""
        problem = self.problem(value, owner=owner)
        if problem is not None:
            raise ConfigError(problem, field=field)
        full = value if os.path.isabs(value) else os.path.join(self.home, value)
        return os.path.realpath(full)


def roots(environ: Mapping[str, str] | None = None) -> PathRoots:
    """The roots as the process's environment declares them now."""
    return PathRoots.from_environ(environ)


def problem(value: str, *, owner: str | None = None) -> str | None:
    """Why the path ``value`` is refused (``PathRoots.problem``), or None."""
    return roots().problem(value, owner=owner)


def resolve(value: str, *, field: str, owner: str | None = None) -> str:
    """The real path to open for ``value`` (``PathRoots.resolve``); ConfigError naming ``field``."""
    return roots().resolve(value, field=field, owner=owner)


def certificate_problem(model: object) -> tuple[str, str] | None:
    """The first ``CERTIFICATE_FIELDS`` field of a config model whose path is refused, as
    (field, why); None when every one it has is a root's."""
    for name in CERTIFICATE_FIELDS:
        value = getattr(model, name, None)
        why = problem(value) if isinstance(value, str) else None
        if why:
            return name, why
    return None


def resolve_file(value: str | None, *, field: str) -> str | None:
    """``resolve`` for an optional file setting (None stays None)."""
    return None if value is None else resolve(value, field=field)


def is_url(value: str) -> bool:
    """Whether ``value`` is a URL of a scheme other than ``file`` (passed as written)."""
    return bool(_SCHEME.match(value)) and not value.lower().startswith("file://")


def local_part(value: str) -> str:
    """The path of a location that is not another scheme's URL: a ``file://`` URL's path
    (percent-decoded; a host other than ``localhost`` is refused as ``\\0``), else ``value``."""
    if not value.lower().startswith("file://"):
        return value
    url = urlparse(value)
    if url.netloc not in ("", "localhost"):
        return "\0"  # file://host/...: a path on another machine, refused by the rule
    return unquote(url.path)


def location_problem(value: str, *, owner: str | None = None) -> str | None:
    """Why a location is refused, or None: a URL of another scheme (``s3://``, ``gs://``,
    ``hdfs://``) passes as written; a path or ``file://`` URL follows ``problem``."""
    if not value.strip():
        return "must not be empty"
    if is_url(value):
        return None
    part = local_part(value)
    if part == "\0":
        return f"{value!r}: a file:// URL names a path on this host (file:///path)"
    return problem(part, owner=owner)


def resolve_location(value: str, *, field: str, owner: str | None = None) -> str:
    """A location as the writers take it: another scheme's URL as written, else the real
    local path (``resolve``); ConfigError naming ``field`` when refused."""
    why = location_problem(value, owner=owner)
    if why is not None:
        raise ConfigError(why, field=field)
    if is_url(value):
        return value
    return resolve(local_part(value), field=field, owner=owner)


def component_problem(name: str) -> str | None:
    """Why ``name``, which becomes one component of a path (an Iceberg namespace or table
    name, a file name prefix), is refused, or None."""
    if not name.strip():
        return "must not be empty"
    if name in (".", "..") or any(c in name for c in "/\\\0"):
        return f"{name!r} becomes a directory or file name: no '/', '\\', NUL, '.' or '..'"
    return None


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _holds_root(path: str, roots: tuple[str, ...]) -> bool:
    return any(_under(r, path) for r in roots)
