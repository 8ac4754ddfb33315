"""The grammar of secret references, ``${env:NAME}`` and ``${file:/absolute/path}``.

Pure: what a reference looks like and whether one is well formed. Reading the secret
behind a reference is ``conveyor.core.trust.secrets.resolve``'s job, in the run only.
"""

from __future__ import annotations

import re
import secrets
from pathlib import PurePosixPath
from urllib.parse import unquote

PROVIDERS = ("env", "file")
# ${env:NAME} / ${file:PATH}; `$${` escapes. The argument runs to the first `}`. Any other
# ${...} is left as written (as Kafka Connect does with unknown providers): sinks' own
# templates such as ${payload.id} or ${topic} use the same brackets.
REFERENCE = re.compile(r"\$(\$?)\{(env|file):([^}]*)\}")
UNTERMINATED = re.compile(r"(?<!\$)\$\{(env|file):[^}]*$")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def argument_problem(provider: str, arg: str) -> str | None:
    """Why ``${provider:arg}`` cannot be resolved whatever the environment, or None."""
    if provider == "env" and not _ENV_NAME.fullmatch(arg):
        return f"{arg!r} is not an environment variable name"
    if provider == "file" and not PurePosixPath(arg).is_absolute():
        return "the path must be absolute"
    return None


def whole_reference_problem(value: str) -> str | None:
    """Why ``value`` is not exactly one well-formed reference (a secret field's rule), or None."""
    m = REFERENCE.fullmatch(value.strip())
    if m is None or m.group(1):
        return (
            "must be a reference, ${env:NAME} or ${file:/path}: a literal secret would be "
            "stored in the meta store"
        )
    problem = argument_problem(m.group(2), m.group(3))
    return f"{m.group(0)}: {problem}" if problem else None


def known_now(value: str | None) -> bool:
    """Whether a text value is what it says already: it holds no reference, which only the run
    resolves. A config model's rule on a value's content skips a reference; the run validates the
    model again with the value it resolved."""
    return value is None or not any(not m.group(1) for m in REFERENCE.finditer(value))


# A credential written into a connection string: the password of a URL's user info
# (postgresql://u:p@h, redis://:p@h, amqp://u:p@h), a query parameter (?password=...), or a
# libpq key/value pair (host=h password=p). Its value must be a whole reference. Found as
# the clients find it, not as a well-behaved URL looks: urllib's netloc (up to the first /?#,
# user info up to its last '@'), SQLAlchemy's and libpq's user info (any character but '@'
# after the first ':'), query keys percent-decoded, a key/value pair right after a quote.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_LOOSE_USERINFO = re.compile(r"[^:@/]*:(?P<value>[^@]*)@")
_CREDENTIAL_KEYS = frozenset(
    [
        "password",
        "passwd",
        "pwd",
        "pass",
        "secret",
        "token",
        "api_key",
        "apikey",
        "access_key",
        "sslpassword",
    ]
)
_QUERY_PAIR = re.compile(r"[?&;](?P<key>[^=&;#?\s]+)=(?P<value>[^&#;\s]*)")
_KEYVALUE_PAIR = re.compile(
    r"(?:^|(?<=[\s']))(?P<key>[A-Za-z_]+)\s*=\s*(?P<value>'(?:[^'\\]|\\.)*'|[^\s']*)"
)


def url_passwords(value: str, *, spaces: bool = True) -> list[str]:
    """Every text a client may take as the password of a URL in ``value``, as written.

    ``spaces=False`` (a text that is not a connection string: a description, a template)
    ends a URL at whitespace and reads no ``/`` into a password, so prose and paths after it
    (``http://h:8080/page@anchor``, ``... contact ops@example.com``) are not user info."""
    out = []
    for m in _SCHEME.finditer(value):
        rest = value[m.end() :]
        if not spaces:
            rest = re.split(r"\s", rest, maxsplit=1)[0]
        netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
        if "@" in netloc:
            out.append(netloc.rsplit("@", 1)[0].partition(":")[2])
        loose = _LOOSE_USERINFO.match(rest)
        if loose and (spaces or "/" not in loose.group("value")):
            out.append(loose.group("value"))
    return [p for p in out if p]


def _credentials(value: str, *, key_value: bool) -> list[tuple[str, str]]:
    """(what, value) of each credential written in ``value``."""
    found = [("a URL's password", p) for p in url_passwords(value, spaces=key_value)]
    for m in _QUERY_PAIR.finditer(value):
        key = unquote(m.group("key")).strip().lower()
        if key in _CREDENTIAL_KEYS:
            found.append((f"a '{key}=' parameter", m.group("value")))
    if key_value:
        for m in _KEYVALUE_PAIR.finditer(value):
            key = m.group("key").lower()
            if key in _CREDENTIAL_KEYS:
                found.append((f"a '{key}=' setting", m.group("value").strip("'")))
    return found


def with_placeholders(value: str) -> tuple[str, frozenset[str]]:
    """``value`` with each reference replaced by a unique placeholder (letters and digits,
    which no parser splits or decodes), and the placeholders: a credential in a connection
    string is then a reference only if it is exactly a placeholder."""
    nonce = secrets.token_hex(4)
    used: list[str] = []

    def one(m: re.Match[str]) -> str:
        if m.group(1):
            return m.group(0)
        used.append(f"CONVEYORREF{len(used)}X{nonce}")
        return used[-1]

    return REFERENCE.sub(one, value), frozenset(used)


def literal_credential_problem(value: str, *, key_value: bool = True) -> str | None:
    """Why a text value holds a credential written literally (a URL's password, a
    ``password=`` query, with ``key_value`` a libpq ``password=`` pair), or None.

    A credential given as one whole reference (``postgresql://app:${env:PG_PW}@db/app``)
    passes: the rule of a Kafka connection's secret fields (``whole_reference_problem``),
    applied inside the string.
    """
    text, placeholders = with_placeholders(value)
    for what, cred in _credentials(text, key_value=key_value):
        if cred and cred not in placeholders:
            return literal_credential_message(what)
    return None


def literal_credential_message(what: str) -> str:
    return (
        f"holds {what} written literally: write it as a reference, ${{env:NAME}} or "
        "${file:/path} (e.g. postgresql://app:${file:/run/secrets/pg}@db/app); "
        "a literal credential would be stored and shown"
    )
