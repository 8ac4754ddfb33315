"""A hostile-payload corpus: values real targets refuse, in the contract's batch shape.

Each entry is ``(what, name, amount)``: a message whose ``name`` (string) or ``amount``
(double) is something a target may reject. Whatever a target does with each one, the
runtime's promise is the same: every row is either written or reported as a row
failure with its index (a dead letter), never a connector error; and under ``fail``
nothing after the first failed row is written.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from tests.sinks.contract import make_batch

NESTED_DEPTH = 2_000

HOSTILE: list[tuple[str, Any, Any]] = [
    ("NUL character", "nul \x00 inside", 1.0),
    ("only NUL", "\x00", 1.0),
    ("NaN", "nan", float("nan")),
    ("+Infinity", "inf", float("inf")),
    ("-Infinity", "-inf", float("-inf")),
    ("huge double", "huge", 1.7976931348623157e308),
    ("tiny double", "tiny", 5e-324),
    ("4-byte UTF-8 (emoji)", "emoji \U0001f4a5", 1.0),
    ("control characters", "bell\x07 esc\x1b del\x7f", 1.0),
    ("line breaks and tabs", "a\nb\rc\td\\e", 1.0),
    ("quotes and braces", "'\"`${destination}{}[]%s%n", 1.0),
    ("empty string", "", 1.0),
    ("null name", None, 1.0),
    ("long string (1 MiB)", "x" * (1 << 20), 1.0),
    ("deeply nested JSON text", "[" * NESTED_DEPTH + "]" * NESTED_DEPTH, 1.0),
    ("right-to-left and BOM", "\u202e\ufeffrtl", 1.0),
]


def hostile_batch(good_before: int = 20, good_after: int = 20) -> tuple[pa.Table, list[str]]:
    """Good rows, then one row per corpus entry, then good rows; ids 0..n-1 in order.
    Returns the batch and, per row, what it holds ("good" or the corpus entry)."""
    n = good_before + len(HOSTILE) + good_after
    names: dict[int, Any] = {}
    amounts: dict[int, Any] = {}
    what = ["good"] * n
    for j, (label, name, amount) in enumerate(HOSTILE):
        i = good_before + j
        names[i], amounts[i], what[i] = name, amount, label
    return make_batch(n, names=names, amounts=amounts), what
