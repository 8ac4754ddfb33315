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
