"""JSON that stays what it was: exact numbers, and strict JSON for what senders push.

One place for both directions of the sources' JSON:

- ``EXACT_DECODER`` / ``dumps``: a number Python's int or float would not write back as
  written (``1.10``, ``1e5``, ``-0``, 12345678901234567.89) is a ``JsonNumber`` that ``dumps``
  writes back byte for byte, so a price posted to a webhook or held in a jsonb column reaches
  the topic as it was written (``json.loads`` would round it to a double).
- ``loads``: RFC 8259 only, for bodies pushed at us. Python's ``json.loads`` accepts
  ``NaN``, ``Infinity`` and numbers beyond a double's range and would pass them on as JSON
  no other reader accepts; a ``\\ud800`` escape without its pair decodes to a lone
  surrogate that is no Unicode text (no UTF-8 encoder writes it, so the message would be
  accepted, then fail downstream); a document nested deeply enough raises RecursionError.
  Each is refused with a short reason.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Any, Final


class JsonNumber(Decimal):
    """A JSON number Python's float or int would not write back as written (1.10, 1e5, -0):
    its value as a Decimal, ``str()`` the literal, written raw by ``dumps``."""

    literal: str

    def __new__(cls, literal: str) -> JsonNumber:
        self = super().__new__(cls, literal)
        self.literal = literal
        return self

    def __str__(self) -> str:
        return self.literal

    def __repr__(self) -> str:
        return f"JsonNumber({self.literal!r})"


_INT_DIGITS_MAX: Final = 4000  # below Python's int <-> str conversion limit (4300)


def _json_int(literal: str) -> int | JsonNumber:
    if literal == "-0" or len(literal) > _INT_DIGITS_MAX:
        return JsonNumber(literal)
    return int(literal)


def _json_float(literal: str) -> float | JsonNumber:
    f = float(literal)
    return f if repr(f) == literal else JsonNumber(literal)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


EXACT_DECODER: Final = json.JSONDecoder(
    parse_int=_json_int, parse_float=_json_float, parse_constant=_no_constant
)
"""Numbers kept exact (``JsonNumber`` where int/float would not write them back as written);
NaN and Infinity refused."""


class _NeedsExact(Exception):
    """A JsonNumber met by the C encoder: ``dumps`` takes its exact path."""


def _plain_default(o: Any) -> Any:
    if isinstance(o, JsonNumber):
        raise _NeedsExact
    return str(o)


_PLAIN = json.JSONEncoder(separators=(",", ":"), default=str)
_FAST = json.JSONEncoder(separators=(",", ":"), default=_plain_default)


class _Token(str):
    """Punctuation already encoded, on ``dumps``'s work stack."""


def dumps(value: Any) -> str:
    """``json.dumps(value, separators=(",", ":"), default=str)``, except that a JsonNumber is
    written as its literal (so a json/jsonb column comes out byte-exact in its numbers)."""
    try:
        return _FAST.encode(value)
    except _NeedsExact:
        pass
    out: list[str] = []
    todo: list[Any] = [value]
    while todo:  # iterative: as deep as json.loads could parse, without recursion
        o = todo.pop()
        if isinstance(o, _Token):
            out.append(o)
        elif isinstance(o, JsonNumber):
            out.append(o.literal)
        elif isinstance(o, dict):
            todo.append(_Token("}"))
            for i, (k, v) in reversed(list(enumerate(o.items()))):
                todo.extend((v, _Token(("," if i else "") + _PLAIN.encode(str(k)) + ":")))
            todo.append(_Token("{"))
        elif isinstance(o, (list, tuple)):
            todo.append(_Token("]"))
            for i, v in reversed(list(enumerate(o))):
                todo.extend((v, _Token("," if i else "")))
            todo.append(_Token("["))
        else:
            out.append(_PLAIN.encode(o))
    return "".join(out)


def _finite(literal: str) -> float | JsonNumber:
    if math.isinf(float(literal)):
        raise ValueError(f"{literal[:20]} is out of a double's range")
    return _json_float(literal)


_STRICT_DECODER: Final = json.JSONDecoder(
    parse_int=_json_int, parse_float=_finite, parse_constant=_no_constant
)
# A \uD800-\uDFFF escape: the only way a lone surrogate gets into decoded UTF-8 text.
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _no_lone_surrogates(value: Any) -> None:
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start : e.end].encode("utf-8", "backslashreplace").decode()
        raise ValueError(f"{bad} is a lone surrogate, not Unicode text") from None


def loads(data: bytes | str) -> Any:
    """The JSON value of ``data``, numbers exact; ValueError with a short reason (~100 chars)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = _STRICT_DECODER.decode(text)
        if _SURROGATE_ESCAPE.search(text):
            _no_lone_surrogates(value)
        return value
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at char {e.pos}") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    except ValueError as e:
        raise ValueError(str(e)[:80]) from None
