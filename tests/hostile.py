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


# -- invalid UTF-8 ------------------------------------------------------------------------------

#: Raw payloads (an opaque ``value`` column) whose bytes are not UTF-8: ``%d`` is the row id.
HOSTILE_BYTES: list[tuple[str, bytes, int]] = [
    # (what, payload, byte offset of the first invalid byte once %d is 1000 + j)
    ("invalid start byte", b'{"id":%d,"name":"a\xffb"}', 20),
    ("truncated sequence at the end", b'{"id":%d,"name":"\xc3', 19),
    ("overlong encoding", b'{"id":%d,"name":"\xc0\xaf"}', 19),
    ("UTF-16 surrogate encoded in UTF-8", b'{"id":%d,"name":"\xed\xa0\x80"}', 19),
    ("Latin-1 text", b'{"id":%d,"name":"caf\xe9"}', 22),
]


def hostile_bytes_batch(good_before: int = 5, good_after: int = 5) -> tuple[pa.Table, list[str]]:
    """An opaque batch (one binary ``value`` column): valid JSON rows around one row per
    HOSTILE_BYTES entry. Row ids are 0..n-1, a hostile row's id is ``1000 + its entry``."""
    values: list[bytes] = []
    what: list[str] = []
    for i in range(good_before):
        values.append(b'{"id":%d,"name":"good"}' % i)
        what.append("good")
    for j, (label, payload, _offset) in enumerate(HOSTILE_BYTES):
        values.append(payload % (1000 + j))
        what.append(label)
    for i in range(good_after):
        values.append(b'{"id":%d,"name":"good"}' % (good_before + len(HOSTILE_BYTES) + i))
        what.append("good")
    return pa.table({"value": pa.array(values, pa.binary())}), what


def with_invalid_utf8(batch: pa.Table, column: str, rows: set[int]) -> pa.Table:
    """``batch`` with a 0xff byte inside the ``column`` string of ``rows``. pyarrow refuses
    such a string from Python, but a string column built from buffers (Spark casting bytes
    to a string) is not checked: the reader then meets it."""
    strings = batch.column(column).to_pylist()
    data = bytearray()
    offsets = [0]
    for i, s in enumerate(strings):
        raw = (s or "").encode()
        if i in rows:
            raw = raw[:2] + b"\xff" + raw[2:]
        data += raw
        offsets.append(len(data))
    broken = pa.Array.from_buffers(
        pa.string(),
        len(strings),
        [None, pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]), pa.py_buffer(bytes(data))],
    )
    return batch.set_column(batch.schema.get_field_index(column), column, broken)
