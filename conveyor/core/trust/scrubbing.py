"""The secrets this process resolved, and the one function that scrubs them out of a text.

Every value a ``${env:...}`` / ``${file:...}`` reference resolves to in this process is
remembered here (``remember``, called by ``secrets.resolve``), with its URL-encoded forms.
``scrub`` replaces each of them in a text by the reference it came from (or ``***``): it
runs wherever error text leaves a run (the meta store's error, reason and history writes,
the log records of the process, the exception an op raises to Dagster). A client's error
may quote any part of its connection string (libpq's ``role "<user>" does not exist``),
so no rule about what a message may contain is relied on.

Values shorter than ``MIN_LENGTH`` are not remembered: they cannot be told from a
message's own words. Pure Python (``logging`` only), process-wide, thread-safe.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from urllib.parse import parse_qsl, quote, quote_plus, unquote, urlsplit

MIN_LENGTH = 4
HIDDEN = "***"

_lock = threading.Lock()
_values: dict[str, str] = {}  # a secret's text (or an encoded form) -> what it is shown as
_pattern: re.Pattern[str] | None = None
_factory_installed = False


def remember(value: str, reference: str = "") -> None:
    """Remember ``value`` (resolved from ``reference``) and its encoded forms as secret; a
    connection string's password too (``${env:PG_URL}`` holding ``postgresql://u:pw@h``)."""
    global _pattern
    if len(value) < MIN_LENGTH:
        return
    shown = reference if reference and value not in reference else HIDDEN
    found = {form: shown for form in _forms(value)}
    for password in _passwords(value):
        found.update((form, HIDDEN) for form in _forms(password) if form not in found)
    with _lock:
        added = False
        for form, as_shown in found.items():
            if len(form) >= MIN_LENGTH and form not in _values:
                _values[form] = as_shown
                added = True
        if added:
            longest_first = sorted(_values, key=len, reverse=True)
            _pattern = re.compile("|".join(re.escape(v) for v in longest_first))
    install_log_scrubbing()


def _forms(value: str) -> set[str]:
    """A value as text may carry it: as it is, URL-encoded, quoted in JSON or a repr."""
    forms = {value, quote(value, safe=""), quote(value), quote_plus(value), quote_plus(value, "/")}
    forms.add(json.dumps(value)[1:-1])
    forms.add(repr(value)[1:-1])
    return forms


_KEYVALUE_PASSWORD = re.compile(r"(?:^|(?<=[\s']))(?:ssl)?password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)")


def _passwords(value: str) -> list[str]:
    """The passwords of a connection string (URL user info or query, libpq key/value)."""
    found = [m.group(1).strip("'") for m in _KEYVALUE_PASSWORD.finditer(value)]
    if "://" in value:
        try:
            url = urlsplit(value.strip())
            found.append(url.password or "")
            found += [v for k, v in parse_qsl(url.query) if k.lower().endswith("password")]
        except ValueError:
            pass
    return [unquote(p) for p in found if len(p) >= MIN_LENGTH]


def scrub(text: str) -> str:
    """``text`` with every remembered secret replaced by its reference (or ``***``)."""
    pattern = _pattern
    if pattern is None or not text:
        return text
    return pattern.sub(lambda m: _values.get(m.group(0), HIDDEN), text)


def holds_secret(text: str) -> bool:
    pattern = _pattern
    return pattern is not None and pattern.search(text) is not None


def forget_all() -> None:
    """Forget every remembered value (tests)."""
    global _pattern
    with _lock:
        _values.clear()
        _pattern = None


def exception_text(error: BaseException) -> str:
    """An exception's message and those of its causes and contexts, as one line each."""
    lines: list[str] = []
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        lines.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return "\n".join(lines)


def chain_holds_secret(error: BaseException) -> bool:
    """Whether the exception, its causes or contexts (messages or arguments) quote a secret."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if holds_secret(str(e)) or holds_secret(repr(e.args)):
            return True
        e = e.__cause__ or e.__context__
    return False


class ScrubbedError(Exception):
    """An error whose message quoted a secret, rebuilt without it (no cause chain)."""


def scrubbed_exception(error: BaseException) -> BaseException:
    """A new exception of ``error``'s type (else ``ScrubbedError``) whose message is the
    scrubbed text of ``error`` and its causes; raise it ``from None``, outside the
    ``except`` block that caught ``error``, so that no chain keeps the original."""
    text = scrub(exception_text(error))
    message = text.split(": ", 1)[1] if ": " in text.splitlines()[0] else text
    try:
        new = type(error)(message)
    except Exception:  # noqa: BLE001 - a type whose constructor wants more
        return ScrubbedError(text)
    if str(new) != message or holds_secret(repr(new.args)):
        return ScrubbedError(text)
    return new


class ScrubFilter(logging.Filter):
    """Scrubs a log record's message, arguments, traceback and stack text of every secret."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _pattern is None:
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string is the logger's own problem
            message = str(record.msg)
        record.msg, record.args = scrub(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


def install_log_scrubbing() -> None:
    """Scrub every log record made in this process from now on (idempotent).

    Done where records are made (the record factory), not on some loggers or handlers:
    Dagster's log managers and the handlers it adds while a step runs see scrubbed records.
    """
    global _factory_installed
    with _lock:
        if _factory_installed:
            return
        _factory_installed = True
        previous = logging.getLogRecordFactory()
        scrubber = ScrubFilter()

        def factory(*args: object, **kwargs: object) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            scrubber.filter(record)
            return record

        logging.setLogRecordFactory(factory)
    for logger in (logging.getLogger(), logging.getLogger("conveyor")):
        if not any(isinstance(f, ScrubFilter) for f in logger.filters):
            logger.addFilter(scrubber)
