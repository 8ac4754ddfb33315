"""The rows the PostgreSQL sink sends: a batch in COPY's text format, built column by column
by Arrow (``copy_column``, ``CopyText``) or value by value (``copy_value``); the batch as value
tuples (``value_rows``: upserts, ``values``, JSON sources); the truncate rows a batch may hold
(``truncate_flags``).
"""

from __future__ import annotations

import datetime as dt
import io
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from conveyor.core.errors import PermanentSinkError
from conveyor.core.model import TRUNCATE_COL
from conveyor.sinks.base import iter_records, json_default
from conveyor.sinks.sql import META_SOURCES, concat_text, json_values, text_offsets, text_scalar


def truncate_flags(batch: pa.Table) -> list[bool]:
    """Per row: is it a truncate (``__truncate`` true; all False without the column).

    PermanentSinkError when the column is not boolean: a string "false" must not truncate."""
    if TRUNCATE_COL not in batch.schema.names:
        return [False] * batch.num_rows
    column = batch.column(TRUNCATE_COL)
    if not (pa.types.is_boolean(column.type) or pa.types.is_null(column.type)):
        raise PermanentSinkError(
            f"{TRUNCATE_COL} must be a boolean column (the transform's select), not {column.type}"
        )
    return [v is True for v in column.to_pylist()]


_UTC_ZONES = frozenset({"UTC", "Etc/UTC", "+00:00", "Z", "GMT", "Etc/GMT", "UCT", "Etc/UCT"})
_COPY_ESCAPES = (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r"))


def copy_column(column: pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """A column's values in COPY's text format (``\\N`` for null), like ``copy_value``,
    as Arrow large strings."""
    import pyarrow.compute as pc

    t = column.type
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        text = pc.cast(column, pa.large_string())
    elif pa.types.is_boolean(t):
        text = pc.if_else(column, "t", "f")
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        text = column
        for old, new in _COPY_ESCAPES:
            text = pc.replace_substring(text, old, new)
    elif pa.types.is_date(t):
        text = pc.cast(column, pa.string())
    elif pa.types.is_timestamp(t) and (t.tz is None or t.tz in _UTC_ZONES):
        # ISO 8601 (with the offset when the column has a zone): the instant and the wall
        # time ``isoformat()`` gave. Arrow holds UTC: without the zone, the cast is cheap.
        text = pc.cast(column.cast(pa.timestamp(t.unit)), pa.string())
        if t.tz is not None:
            utc = pa.scalar("+00:00", pa.string())
            text = pc.binary_join_element_wise(text, utc, pa.scalar("", pa.string()))
    elif pa.types.is_timestamp(t):
        # Another zone: the wall time there, with its offset, as ``isoformat()`` wrote it.
        try:
            text = pc.strftime(column, format="%Y-%m-%dT%H:%M:%S%z")
        except pa.ArrowException:  # a zone Arrow cannot find here: Python's conversion
            return pa.array([copy_value(v) for v in column.to_pylist()], pa.large_string())
    elif pa.types.is_nested(t):  # JSON, maps as objects
        return pa.array([copy_value(v) for v in json_values(column)], pa.large_string())
    else:
        return pa.array([copy_value(v) for v in column.to_pylist()], pa.large_string())
    return pc.cast(pc.fill_null(text, "\\N"), pa.large_string())


class CopyText(Sequence[str]):
    """A batch's rows in COPY's text format, built by Arrow without a Python object per
    row: the whole batch is one buffer for ``copy_expert``; a row (``text[i]``, when
    bisecting to the rows the server refused) is a line without its newline."""

    def __init__(self, lines: pa.Array):
        self._lines = lines  # large strings, no nulls, each ending in a newline
        self._rows: list[str] | None = None

    @classmethod
    def of(cls, columns: list[pa.Array | pa.ChunkedArray]) -> CopyText:
        """The lines of ``columns`` (COPY text, no nulls), tab-separated, in row order."""
        import pyarrow.compute as pc

        lines = pc.binary_join_element_wise(*columns, text_scalar("\t"))
        lines = concat_text(lines, text_scalar("\n"))
        if isinstance(lines, pa.ChunkedArray):
            lines = lines.combine_chunks()
        return cls(lines)

    def __len__(self) -> int:
        return len(self._lines)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if self._rows is None:
            self._rows = [line[:-1] for line in self._lines.to_pylist()]
        return self._rows[i]

    def reader(self) -> io.BytesIO:
        """All lines, as one UTF-8 buffer."""
        if not len(self._lines):
            return io.BytesIO(b"")
        offsets, data = text_offsets(self._lines)
        return io.BytesIO(data[offsets[0] : offsets[-1]])


def copy_value(v: Any) -> str:
    """A value in COPY's text format."""
    if v is None:
        return "\\N"
    if isinstance(v, bool):
        return "t" if v else "f"
    if isinstance(v, bytes):
        return "\\\\x" + v.hex()
    if isinstance(v, (dict, list)):
        v = json.dumps(v, default=json_default)
    elif isinstance(v, dt.datetime):
        v = v.isoformat()
    s = str(v)
    return s.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def value_rows(
    batch: pa.Table, columns: list[str], sources: list[str], types: dict[str, str]
) -> list[tuple[Any, ...]]:
    """The batch's rows as value tuples: ``columns`` (target order) from their ``sources``; a
    nested value into a JSON column (``types``: the table's) as JSON text."""
    out = []
    need_records = "$payload" in sources or "$headers" in sources
    records = list(iter_records(batch)) if need_records else None
    json_sources = {  # nested values into a JSON column go as JSON text (maps as objects)
        src
        for target, src in zip(columns, sources, strict=True)
        if types.get(target) in ("json", "jsonb")
        and src in batch.schema.names
        and pa.types.is_nested(batch.schema.field(src).type)
    }
    cols = {
        name: [
            None if v is None else json.dumps(v, default=json_default)
            for v in json_values(batch.column(name))
        ]
        if name in json_sources
        else batch.column(name).to_pylist()
        for name in set(sources)
        if not name.startswith("$")
    }
    meta = {
        src: batch.column(col).to_pylist()
        for src, col in META_SOURCES.items()
        if src in sources and col in batch.schema.names and src != "$headers"
    }
    for i in range(batch.num_rows):
        row: list[Any] = []
        for src in sources:
            if src == "$payload":
                assert records is not None
                row.append(json.dumps(records[i].payload_json(), default=json_default))
            elif src == "$headers":
                assert records is not None
                row.append(
                    json.dumps({k: v.decode(errors="replace") for k, v in records[i].headers})
                )
            elif src.startswith("$"):
                row.append(meta[src][i])
            else:
                row.append(cols[src][i])
        out.append(tuple(row))
    return out
