"""Strict JSON for what senders push: RFC 8259 only, so what is passed on stays JSON.

Python's ``json.loads`` accepts ``NaN``, ``Infinity`` and numbers beyond a double's range
(read as ``inf``) and ``json.dumps`` writes them back as ``NaN`` / ``Infinity``, which no
other JSON reader accepts; a document nested deeply enough raises RecursionError.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:20]} is out of a double's range")
    return value


def loads(data: bytes | str) -> Any:
    """The JSON value of ``data``; ValueError with a short reason (at most ~100 characters)."""
    try:
        return json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at char {e.pos}") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    except ValueError as e:
        raise ValueError(str(e)[:80]) from None
