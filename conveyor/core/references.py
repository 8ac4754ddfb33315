"""The grammar of secret references, ``${env:NAME}`` and ``${file:/absolute/path}``.

Pure: what a reference looks like and whether one is well formed. Reading the secret
behind a reference is ``conveyor.secrets.resolve``'s job, in the run only.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

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
# libpq key/value pair (host=h password=p). Its value must be a whole reference.
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^:@/\s?#]*:(?P<value>[^@/\s?#]*)@")
_CREDENTIAL_KEYS = (
    r"(?:password|passwd|pwd|pass|secret|token|api_key|apikey|access_key|sslpassword)"
)
_QUERY_CREDENTIAL = re.compile(
    rf"[?&;](?P<key>{_CREDENTIAL_KEYS})=(?P<value>[^&#;\s]*)", re.IGNORECASE
)
_KEYVALUE_CREDENTIAL = re.compile(
    rf"(?:^|\s)(?P<key>{_CREDENTIAL_KEYS})\s*=\s*(?P<value>'(?:[^'\\]|\\.)*'|[^\s']*)",
    re.IGNORECASE,
)


def literal_credential_problem(value: str, *, key_value: bool = True) -> str | None:
    """Why a text value holds a credential written literally (a URL's password, a
    ``password=`` query, with ``key_value`` a libpq ``password=`` pair), or None.

    A credential given as one whole reference (``postgresql://app:${env:PG_PW}@db/app``)
    passes: the rule of a Kafka connection's secret fields (``whole_reference_problem``),
    applied inside the string.
    """
    patterns = [(_URL_PASSWORD, "a URL's password"), (_QUERY_CREDENTIAL, "a '{key}=' parameter")]
    if key_value:
        patterns.append((_KEYVALUE_CREDENTIAL, "a '{key}=' setting"))
    for pattern, what in patterns:
        for m in pattern.finditer(value):
            cred = m.group("value").strip("'")
            if not cred or whole_reference_problem(cred) is None:
                continue
            named = what.format(key=m.groupdict().get("key", "").lower())
            return (
                f"holds {named} written literally: write it as a reference, ${{env:NAME}} or "
                "${file:/path} (e.g. postgresql://app:${file:/run/secrets/pg}@db/app); "
                "a literal credential would be stored and shown"
            )
    return None
