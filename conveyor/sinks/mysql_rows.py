"""The rows the MySQL sink sends: a batch's columns as values pymysql escapes
(``batch_values``: the rows MySQL cannot hold, or too large for its packet, failed before
sending), or as the literals pymysql's escaping would write, built by Arrow column by column
(``batch_literals``, ``row_literals``) and cut into statements as pymysql's ``executemany``
cuts them (``literal_statements``).
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from conveyor.core.model import HEADERS_COL
from conveyor.core.sink import RowFailure
from conveyor.sinks.base import iter_records, json_default, payload_columns
from conveyor.sinks.sql import (
    META_SOURCES,
    concat_text,
    json_values,
    text_offsets,
    text_scalar,
)

PACKET_MARGIN = 4096  # room for the statement's text around a row's values


def column_values(col: pa.ChunkedArray | pa.Array) -> tuple[list[Any], dict[int, str]]:
    """A column as values pymysql can escape, and the rows whose value MySQL cannot hold.

    Aware timestamps become their naive UTC wall time (the session's time zone is UTC);
    nested values become JSON text; NaN and infinities have no MySQL representation.
    """
    t = col.type
    bad: dict[int, str] = {}
    if pa.types.is_timestamp(t):
        if t.tz is not None or t.unit == "ns":
            col = col.cast(pa.timestamp("us" if t.unit == "ns" else t.unit), safe=False)
        return col.to_pylist(), bad
    if pa.types.is_floating(t):
        values = col.to_pylist()
        if len(col) and pc.any(pc.invert(pc.is_finite(col))).as_py():
            for i, v in enumerate(values):
                if v is not None and not math.isfinite(v):
                    bad[i] = f"{v!r} cannot be stored in MySQL"
        return values, bad
    if pa.types.is_nested(t):
        return [
            None if v is None else json.dumps(v, default=json_default) for v in json_values(col)
        ], bad
    return col.to_pylist(), bad


def headers_json(col: pa.ChunkedArray | pa.Array) -> list[str]:
    """The __headers column as JSON objects of text values (the last of a repeated name wins)."""
    out = []
    for hs in col.to_pylist():
        out.append(
            json.dumps(
                {
                    h["key"]: (
                        h["value"].decode(errors="replace") if h["value"] is not None else None
                    )
                    for h in hs or ()
                }
            )
        )
    return out


#: pymysql's string escaping (``converters._escape_table``), the backslash first.
_STRING_ESCAPES = (
    ("\\", "\\\\"),
    ("\0", "\\0"),
    ("\n", "\\n"),
    ("\r", "\\r"),
    ("\032", "\\Z"),
    ('"', '\\"'),
    ("'", "\\'"),
)


def literal_column(col: pa.ChunkedArray | pa.Array) -> Any:
    """A column as MySQL literals built by Arrow, exactly as pymysql's escaping writes each
    value (``NULL``, numbers, quoted and escaped text, dates and times), or None for a type
    left to pymysql value by value. The session has no NO_BACKSLASH_ESCAPES (``SQL_MODE``).

    Floats are written as pymysql does (``repr``, then ``e0`` unless it has an exponent: a
    DOUBLE literal); NaN and infinities never get here (``column_values`` fails their
    rows). Timestamps are the naive UTC wall time, as ``column_values`` gives pymysql."""
    t = col.type
    if pa.types.is_integer(t):
        text = pc.cast(col, pa.large_string())
    elif pa.types.is_boolean(t):
        text = pc.if_else(col, text_scalar("1"), text_scalar("0"))
    elif pa.types.is_floating(t):
        text = pc.cast(pc.cast(col, pa.float64()), pa.large_string())
        text = pc.if_else(pc.match_substring(text, "e"), text, concat_text(text, text_scalar("e0")))
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        text = pc.cast(col, pa.large_string())
        for old, new in _STRING_ESCAPES:
            text = pc.replace_substring(text, old, new)
        text = concat_text(text_scalar("'"), text, text_scalar("'"))
    elif pa.types.is_timestamp(t) or pa.types.is_date(t):
        if pa.types.is_timestamp(t) and (t.tz is not None or t.unit == "ns"):
            col = col.cast(pa.timestamp("us" if t.unit == "ns" else t.unit), safe=False)
        text = concat_text(text_scalar("'"), pc.cast(col, pa.large_string()), text_scalar("'"))
    else:
        return None
    return pc.fill_null(text, text_scalar("NULL"))


def row_literals(columns: list[Any]) -> pa.LargeStringArray:
    """Each row's ``(v1,v2,...),`` from its columns' literals."""
    row = pc.binary_join_element_wise(*columns, text_scalar(","))
    out = concat_text(text_scalar("("), row, text_scalar("),"))
    return out.combine_chunks() if isinstance(out, pa.ChunkedArray) else out


def literal_statements(
    rows: pa.LargeStringArray, prefix: bytes, postfix: bytes, max_length: int
) -> Iterator[bytes]:
    """The INSERT statements of ``rows`` (``row_literals``), as pymysql's ``executemany``
    splits them: as many rows per statement as ``max_length`` bytes hold, at least one."""
    import numpy as np

    if not len(rows):
        return
    offsets, view = text_offsets(rows)
    # A statement of rows [a, b) holds offsets[b] - offsets[a] - 1 bytes of values (no
    # trailing comma).
    room = max_length - len(prefix) - len(postfix) + 1
    a = 0
    while a < len(rows):
        b = int(np.searchsorted(offsets, offsets[a] + room, side="right")) - 1
        b = min(max(b, a + 1), len(rows))
        yield prefix + view[offsets[a] : offsets[b] - 1].tobytes() + postfix
        a = b


def payload_json(batch: pa.Table) -> list[str]:
    """Each row's payload as JSON text: decoded columns as an object, a JSON `value` parsed."""
    pcols = payload_columns(batch)
    if pcols == ["value"]:
        return [
            json.dumps(r.payload_json(), default=json_default)
            for r in iter_records(batch.select(["value"]))
        ]
    return [json.dumps(row, default=json_default) for row in batch.select(pcols).to_pylist()]


def batch_values(
    batch: pa.Table, sources: list[str], max_packet: int, literal: Callable[[Any], str]
) -> tuple[list[tuple[Any, ...] | None], list[RowFailure]]:
    """The batch as parameter tuples (``sources`` order); rows with values MySQL cannot hold,
    or whose INSERT alone exceeds ``max_packet``, become failures (and None). ``literal``:
    pymysql's literal of a value (the connection's)."""
    cols: dict[str, list[Any]] = {}
    bad: dict[int, str] = {}
    text_bytes = 0  # bytes of text and binary values, for the max_allowed_packet check
    for src in dict.fromkeys(sources):
        if src in ("$payload", "$headers"):
            cols[src] = (
                payload_json(batch)
                if src == "$payload"
                else headers_json(batch.column(HEADERS_COL))
            )
            text_bytes += 4 * sum(map(len, cols[src]))
            continue
        col = batch.column(META_SOURCES.get(src, src))
        values, col_bad = column_values(col)
        cols[src] = values
        for i, msg in col_bad.items():
            bad.setdefault(i, msg)
        if (
            pa.types.is_string(col.type)
            or pa.types.is_large_string(col.type)
            or pa.types.is_binary(col.type)
            or pa.types.is_large_binary(col.type)
        ):
            text_bytes += pc.sum(pc.binary_length(col)).as_py() or 0
        elif pa.types.is_nested(col.type):
            text_bytes += 4 * sum(len(v) for v in values if v is not None)
    rows: list[tuple[Any, ...] | None] = list(zip(*(cols[src] for src in sources), strict=True))
    for i in bad:
        rows[i] = None
    failures = [RowFailure(i, msg) for i, msg in sorted(bad.items())]
    # Escaping at most doubles a value; other values are short. Only a batch that could
    # hold a row above the limit is checked row by row.
    if 2 * text_bytes + 64 * len(sources) * batch.num_rows > max_packet - PACKET_MARGIN:
        failures = sorted(
            failures + oversized_rows(rows, max_packet, literal), key=lambda f: f.index
        )
    return rows, failures


def oversized_rows(
    rows: list[tuple[Any, ...] | None], max_packet: int, literal: Callable[[Any], str]
) -> list[RowFailure]:
    """Rows whose INSERT alone would exceed max_allowed_packet (sets them to None)."""
    limit = max_packet - PACKET_MARGIN
    out = []
    for i, row in enumerate(rows):
        if row is None:
            continue
        # A cheap upper bound first (escaping at most doubles a value, UTF-8 takes at most 4 bytes a character).
        bound = sum(
            8 * len(v) if isinstance(v, str) else 2 * len(v) if isinstance(v, bytes) else 64
            for v in row
        )
        if bound <= limit:
            continue
        size = sum(len(literal(v).encode(errors="surrogateescape")) + 2 for v in row)
        if size > limit:
            rows[i] = None
            out.append(
                RowFailure(
                    i,
                    f"row of {size} bytes exceeds the server's max_allowed_packet ({max_packet} bytes)",
                )
            )
    return out


def batch_literals(batch: pa.Table, sources: list[str], conn: Any) -> pa.LargeStringArray | None:
    """The batch's rows as MySQL literals built by Arrow (``row_literals``), or None to
    let pymysql escape them value by value: JSON built from the whole message, binary
    values, a connection (pymysql's) that is not UTF-8 or escapes without backslashes."""
    from pymysql.constants import SERVER_STATUS

    if codecs.lookup(conn.encoding).name != "utf-8" or (
        conn.server_status & SERVER_STATUS.SERVER_STATUS_NO_BACKSLASH_ESCAPES
    ):
        return None
    columns = []
    for src in sources:
        if src in ("$payload", "$headers"):
            return None
        col = batch.column(META_SOURCES.get(src, src))
        literals = literal_column(col)
        if literals is None:
            if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
                return None  # pymysql's bytes literals are not UTF-8 text
            try:  # any other type: pymysql's literal of the value it would be given
                values, _ = column_values(col)
                literals = pa.array([conn.literal(v) for v in values], pa.large_string())
            except (UnicodeError, pa.ArrowException):
                return None
        columns.append(literals)
    return row_literals(columns)
