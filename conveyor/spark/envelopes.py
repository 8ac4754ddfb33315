"""Debezium change events as rows (``transform.envelope: debezium``), on both decoding paths.

A Debezium event is ``{before, after, op, source, ts_ms}``; Kafka Connect's JsonConverter may
wrap it as ``{schema, payload: {..the event..}}``. Unwrapped, an event becomes the row it
describes and three columns saying what to do with it:

| op | row fields | ``__op`` | ``__tombstone`` | ``__truncate`` |
|---|---|---|---|---|
| c, r, u (create, snapshot read, update) | ``after``'s | the op | false | false |
| d (delete) | ``before``'s (at least the key) | d | true | false |
| t (truncate) | all null | t | false | true |
| no payload (a tombstone message) | all null | null | true | false |

An upsert writes ``after`` (``upsert_keys``); a sink with ``delete_enabled`` deletes the row
``before``'s key columns name (``sinks/tombstones.py``: they come from the row first); the
postgres sink with ``truncate_enabled`` truncates. An event with another op (or none), a
delete without ``before`` and a c/r/u without ``after`` are failed messages, with why.

JSON is unwrapped by Spark SQL over ``from_json`` with one schema that reads both shapes
(``debezium_json_schema``, ``debezium_json_columns``); records decoded in the run process
(Avro, Protobuf, JSON Schema) are unwrapped in Arrow, column by column
(``unwrap_debezium``).

Both encodings are read: Conveyor's plain values (``format: conveyor``'s, and
``postgres_cdc``'s ``value_encoding: conveyor``) go through as they are; a JSON event in
Debezium's encodings with JsonConverter's schema part (Debezium's default; Conveyor's
``format: debezium`` default) first has its ``before`` and ``after`` turned into plain
values by that schema (``plain_payloads``, in the run process, before the trip: a Decimal's
bytes and scale become ``"12.500"``, days a date, microseconds a timestamp ...; the table
in ``conveyor.formats.debezium``), so the row's DDL names the column's own type (DECIMAL,
DATE, TIMESTAMP) or STRING. Without the schema part a Decimal's bytes cannot be read (their
scale is in the schema): use Debezium's string modes then. Records decoded in the run process
(Avro ...) keep the values their decoder gives: Kafka Connect's Decimal as a decimal, Debezium's
``io.debezium.time`` types as their numbers (days, µs), to be cast in the select.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from conveyor.core.model import TOMBSTONE_COL, TRUNCATE_COL
from conveyor.formats.debezium import needs_plain, plain_event

OP_COL = "__op"  # the event's op; the filter and select may use it
UPSERT_OPS = ("c", "r", "u")
OPS = (*UPSERT_OPS, "d", "t")
_WHY = "debezium envelope: "


@dataclass(frozen=True)
class EnvelopeColumns:
    """Spark SQL select expressions over a decoded event: ``columns`` (the row fields,
    ``__op``, ``__tombstone``, ``__truncate``) and ``why``, NULL or why the event is a
    failed message (unaliased: the transformer folds it into its ``__bad``)."""

    columns: list[str]
    why: str


def debezium_json_schema(row_ddl: str) -> str:
    """The Spark DDL that decodes a Debezium event whose before/after rows have ``row_ddl``,
    bare or inside JsonConverter's ``payload`` (its ``schema`` member is not read)."""
    row = f"STRUCT<{row_ddl}>"
    event = f"op STRING, `before` {row}, `after` {row}"
    return f"{event}, payload STRUCT<{event}>"


def debezium_row_fields(event_type: Any) -> list[str]:
    """The row's field names, from the analysed type of a column decoded with
    ``debezium_json_schema`` (a pyspark StructType: ``df.schema[col].dataType``)."""
    return [f.name for f in event_type["after"].dataType.fields]


def debezium_json_columns(decoded: str, row_fields: list[str]) -> EnvelopeColumns:
    """Select expressions over the struct column ``decoded`` (decoded with
    ``debezium_json_schema``) that unwrap the event (see the module's table)."""
    d = _ident(decoded)
    # The wrapped event when there is one, else the bare one: both have one type.
    env = (
        f"coalesce({d}.payload, named_struct('op', {d}.op, 'before', {d}.`before`, "
        f"'after', {d}.`after`))"
    )
    op = f"{env}.op"
    fields = [
        f"CASE {op} WHEN 'd' THEN {env}.`before`.{_ident(f)} WHEN 't' THEN NULL "
        f"ELSE {env}.`after`.{_ident(f)} END AS {_ident(f)}"
        for f in row_fields
    ]
    upserts = ", ".join(f"'{o}'" for o in UPSERT_OPS)
    known = ", ".join(f"'{o}'" for o in OPS)
    why = (
        f"CASE WHEN {d} IS NULL THEN NULL "
        f"WHEN {op} IS NULL THEN '{_WHY}no op (not a Debezium change event)' "
        f"WHEN {op} NOT IN ({known}) THEN "
        f"concat('{_WHY}unknown op \"', left({op}, 40), '\" (c, r, u, d or t)') "
        f"WHEN {op} = 'd' AND {env}.`before` IS NULL THEN "
        f"'{_WHY}op d without before (the row to delete)' "
        f"WHEN {op} IN ({upserts}) AND {env}.`after` IS NULL THEN "
        f"concat('{_WHY}op ', {op}, ' without after') END"
    )
    return EnvelopeColumns(
        columns=[
            *fields,
            f"{op} AS {OP_COL}",
            f"({d} IS NULL OR coalesce({op} = 'd', false)) AS {TOMBSTONE_COL}",
            f"coalesce({op} = 't', false) AS {TRUNCATE_COL}",
        ],
        why=why,
    )


def unwrap_debezium(table: pa.Table) -> tuple[pa.Table, dict[int, str]]:
    """Decoded Debezium events (struct columns ``before`` and ``after``, string ``op``) as
    rows: the row fields as columns, then ``__op``, ``__tombstone``, ``__truncate`` (the
    module's table); other columns (``source``, ``ts_ms``) are dropped. One output row per
    input row; a failed one is all null (flags false) and in the returned index -> why."""
    n = table.num_rows
    names = table.column_names
    if "op" not in names or ("before" not in names and "after" not in names):
        missing = "op" if "op" not in names else "before and after"
        why = f"{_WHY}the record has no {missing} (not a Debezium change event)"
        flags = pa.array([False] * n, pa.bool_())
        out = pa.table(
            {OP_COL: pa.nulls(n, pa.string()), TOMBSTONE_COL: flags, TRUNCATE_COL: flags}
        )
        return out, dict.fromkeys(range(n), why)
    op = _column(table, "op")
    op = op if pa.types.is_string(op.type) else op.cast(pa.string())
    row_type = _row_type(table)
    before = _column(table, "before", row_type)
    after = _column(table, "after", row_type)
    masks = _masks(op, before, after)
    failed = _failures(op, masks)
    ok = pc.invert(masks["failed"])
    take_before = pc.and_(ok, masks["d"])
    take_after = pc.and_(ok, masks["upsert"])
    columns: dict[str, pa.Array] = {}
    for field in row_type:
        from_before = _field(before, field)
        from_after = _field(after, field)
        nulls = pa.nulls(n, field.type)
        columns[field.name] = pc.if_else(
            take_before, from_before, pc.if_else(take_after, from_after, nulls)
        )
    columns[OP_COL] = op
    columns[TOMBSTONE_COL] = pc.and_(ok, pc.or_(masks["d"], masks["empty"]))
    columns[TRUNCATE_COL] = pc.and_(ok, masks["t"])
    return pa.table(columns), failed


def _column(table: pa.Table, name: str, row_type: pa.StructType | None = None) -> pa.Array:
    """One column as one array; a missing before/after is all null, of the row's type."""
    if name not in table.column_names:
        assert row_type is not None
        return pa.nulls(table.num_rows, row_type)
    return table.column(name).combine_chunks()


def _row_type(table: pa.Table) -> pa.StructType:
    """The row's type: after's (before's when the record has no after)."""
    t = table.schema.field("after" if "after" in table.column_names else "before").type
    if not pa.types.is_struct(t):
        raise TypeError(f"a Debezium event's before/after must be records, not {t}")
    return t


def _field(rows: pa.Array, field: pa.Field) -> pa.Array:
    """Field ``field`` of the struct array ``rows`` (null where a row is null), of its type
    in the row: before's field is cast when before's record differs from after's."""
    if field.name not in rows.type.names:
        return pa.nulls(len(rows), field.type)
    values = pc.struct_field(rows, field.name)
    values = pc.if_else(pc.is_valid(rows), values, pa.nulls(len(rows), values.type))
    return values if values.type == field.type else values.cast(field.type)


def _masks(op: pa.Array, before: pa.Array, after: pa.Array) -> dict[str, pa.Array]:
    """Per row: which op, whether the record is empty (a tombstone), whether it failed."""
    no_op = pc.is_null(op)
    has_before, has_after = pc.is_valid(before), pc.is_valid(after)
    empty = pc.and_(no_op, pc.invert(pc.or_(has_before, has_after)))
    d = pc.fill_null(pc.equal(op, "d"), False)
    upsert = pc.fill_null(pc.is_in(op, pa.array(UPSERT_OPS)), False)
    t = pc.fill_null(pc.equal(op, "t"), False)
    unknown = pc.and_(pc.invert(no_op), pc.invert(pc.is_in(op, pa.array(OPS))))
    failed = pc.or_(
        pc.or_(pc.and_(no_op, pc.invert(empty)), unknown),
        pc.or_(pc.and_(d, pc.invert(has_before)), pc.and_(upsert, pc.invert(has_after))),
    )
    return {"empty": empty, "d": d, "upsert": upsert, "t": t, "failed": failed}


def _failures(op: pa.Array, masks: dict[str, pa.Array]) -> dict[int, str]:
    """Why each failed row failed (only failed rows are looked at one by one)."""
    out: dict[int, str] = {}
    for i in pc.indices_nonzero(masks["failed"]).to_pylist():
        o = op[i].as_py()
        if o is None:
            out[i] = f"{_WHY}no op (not a Debezium change event)"
        elif o not in OPS:
            out[i] = f'{_WHY}unknown op "{o[:40]}" (c, r, u, d or t)'
        elif o == "d":
            out[i] = f"{_WHY}op d without before (the row to delete)"
        else:
            out[i] = f"{_WHY}op {o} without after"
    return out


def _ident(name: str) -> str:
    """A column or field name quoted for Spark SQL."""
    return "`" + name.replace("`", "``") + "`"


def plain_payloads(values: pa.Array) -> tuple[pa.Array, dict[int, str]]:
    """JSON payloads (binary) of Debezium events in Debezium's encodings, with their schema
    part, as the bare events in plain values (the module's docstring); other payloads as
    they are. Returns the payloads and, by index, why one could not be read (a value that
    does not fit its schema). A payload that is not JSON is left for the decoding to flag."""
    rows = values.to_pylist()
    changed: dict[int, bytes] = {}
    failed: dict[int, str] = {}
    for i, raw in enumerate(rows):
        if raw is None or not needs_plain(raw):
            continue
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        try:
            event = plain_event(doc)
        except ValueError as e:
            failed[i] = f"{_WHY}{str(e)[:300]}"
            continue
        except RecursionError:
            failed[i] = f"{_WHY}nested too deep"
            continue
        if event is not doc:
            changed[i] = json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()
    if not changed:
        return values, failed
    return pa.array([changed.get(i, raw) for i, raw in enumerate(rows)], values.type), failed
