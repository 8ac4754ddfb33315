"""Debezium envelopes unwrapped in Arrow (``unwrap_debezium``): events written as Avro by
fastavro's ``schemaless_writer`` under a Debezium-shaped schema (before/after unions
[null, Value], op, source, ts_ms), read back by ``schemaless_reader`` (as confluent's
AvroDeserializer does), made an Arrow table, and unwrapped: rows, ops, deletes, truncates
and the failed rows with why."""

from __future__ import annotations

import datetime as dt
import io
from decimal import Decimal
from typing import Any

import fastavro
import pyarrow as pa
import pytest

from conveyor.spark.envelopes import unwrap_debezium

VALUE = {
    "type": "record",
    "name": "Value",
    "namespace": "dbserver1.public.items",
    "fields": [
        {"name": "id", "type": "int"},
        {"name": "name", "type": ["null", "string"], "default": None},
        {
            "name": "price",
            "type": [
                "null",
                {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2},
            ],
            "default": None,
        },
        {
            "name": "at",
            "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}],
            "default": None,
        },
    ],
}
ENVELOPE = fastavro.parse_schema(
    {
        "type": "record",
        "name": "Envelope",
        "namespace": "dbserver1.public.items",
        "fields": [
            {"name": "before", "type": ["null", VALUE], "default": None},
            {"name": "after", "type": ["null", "dbserver1.public.items.Value"], "default": None},
            {
                "name": "source",
                "type": {
                    "type": "record",
                    "name": "Source",
                    "namespace": "io.debezium.connector.postgresql",
                    "fields": [
                        {"name": "connector", "type": "string"},
                        {"name": "table", "type": "string"},
                        {"name": "lsn", "type": ["null", "long"], "default": None},
                    ],
                },
            },
            {"name": "op", "type": "string"},
            {"name": "ts_ms", "type": ["null", "long"], "default": None},
        ],
    }
)
# The Arrow shape of a decoded event: before/after nullable structs of the row.
ROW = pa.struct(
    [
        pa.field("id", pa.int32(), nullable=False),
        ("name", pa.string()),
        ("price", pa.decimal128(10, 2)),
        ("at", pa.timestamp("us", tz="UTC")),
    ]
)
EVENT = pa.schema(
    [
        ("before", ROW),
        ("after", ROW),
        (
            "source",
            pa.struct([("connector", pa.string()), ("table", pa.string()), ("lsn", pa.int64())]),
        ),
        ("op", pa.string()),
        ("ts_ms", pa.int64()),
    ]
)
AT = dt.datetime(2024, 1, 31, 10, 0, 0, 500_000, tzinfo=dt.timezone.utc)


def row(i: int, name: str | None = "n", price: str | None = "1.10") -> dict[str, Any]:
    return {"id": i, "name": name, "price": None if price is None else Decimal(price), "at": AT}


def event(op: str, before: dict | None = None, after: dict | None = None) -> dict[str, Any]:
    source = {"connector": "postgresql", "table": "items", "lsn": 42}
    return {"before": before, "after": after, "source": source, "op": op, "ts_ms": 1}


def decoded(events: list[dict[str, Any]]) -> pa.Table:
    """Each event through Avro binary and back, as a registry deserializer hands it over."""
    records = []
    for e in events:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, ENVELOPE, e)
        buf.seek(0)
        records.append(fastavro.schemaless_reader(buf, ENVELOPE, ENVELOPE))
    return pa.Table.from_pylist(records, schema=EVENT)


def test_creates_reads_updates_become_after_and_deletes_before() -> None:
    table = decoded(
        [
            event("r", after=row(1)),
            event("c", after=row(2, name=None)),
            event("u", before=row(2, name=None), after=row(2, name="two", price="99999999.99")),
            event("d", before={"id": 1, "name": None, "price": None, "at": None}),
            event("t"),
        ]
    )
    # Two chunks per column, as a batch of two decoded parts.
    out, failed = unwrap_debezium(pa.concat_tables([table.slice(0, 3), table.slice(3)]))
    assert failed == {}
    assert out.column_names == ["id", "name", "price", "at", "__op", "__tombstone", "__truncate"]
    assert out.schema.field("price").type == pa.decimal128(10, 2)
    assert out.schema.field("at").type == pa.timestamp("us", tz="UTC")
    rows = out.to_pylist()
    assert rows[0] == {
        "id": 1, "name": "n", "price": Decimal("1.10"), "at": AT,
        "__op": "r", "__tombstone": False, "__truncate": False,
    }  # fmt: skip
    assert (rows[1]["id"], rows[1]["name"], rows[1]["__op"]) == (2, None, "c")
    # An update is the row after, exact to the cent.
    assert (rows[2]["name"], rows[2]["price"], rows[2]["__op"]) == (
        "two",
        Decimal("99999999.99"),
        "u",
    )
    # A delete: the key from before, a tombstone for delete_enabled.
    assert rows[3] == {
        "id": 1, "name": None, "price": None, "at": None,
        "__op": "d", "__tombstone": True, "__truncate": False,
    }  # fmt: skip
    # A truncate: no row, the flag.
    assert rows[4] == {
        "id": None, "name": None, "price": None, "at": None,
        "__op": "t", "__tombstone": False, "__truncate": True,
    }  # fmt: skip


def test_unknown_ops_and_missing_images_are_failed_rows_all_null() -> None:
    table = decoded(
        [
            event("c", after=row(1)),
            event("m"),  # a logical decoding message: no row change
            event("d"),  # a delete without before
            event("u", before=row(2)),  # an update without after
            event("x" * 100, after=row(3)),
            event("c", after=row(4)),
        ]
    )
    out, failed = unwrap_debezium(table)
    assert failed == {
        1: 'debezium envelope: unknown op "m" (c, r, u, d or t)',
        2: "debezium envelope: op d without before (the row to delete)",
        3: "debezium envelope: op u without after",
        4: f'debezium envelope: unknown op "{"x" * 40}" (c, r, u, d or t)',
    }
    assert out.column("id").to_pylist() == [1, None, None, None, None, 4]
    assert out.column("__tombstone").to_pylist() == [False] * 6
    assert out.column("__truncate").to_pylist() == [False] * 6


def test_a_row_without_payload_is_a_tombstone_and_a_null_op_with_a_row_fails() -> None:
    """Rows of messages without a payload (all null: null_values pass) are tombstones; an op
    missing beside a row is no Debezium event."""
    table = decoded([event("c", after=row(1)), event("c", after=row(5))])
    nulls = pa.Table.from_pylist([{}], schema=EVENT)
    no_op = table.slice(1).set_column(3, "op", pa.nulls(1, pa.string()))
    out, failed = unwrap_debezium(pa.concat_tables([table.slice(0, 1), nulls, no_op]))
    assert failed == {2: "debezium envelope: no op (not a Debezium change event)"}
    assert out.column("__tombstone").to_pylist() == [False, True, False]
    assert out.column("id").to_pylist() == [1, None, None]


def test_child_values_under_a_null_struct_never_leak() -> None:
    """Arrow may keep values in a struct's children where the struct itself is null: a delete
    must not take after's, nor an upsert before's."""
    children = [pa.array([7, 8], pa.int32())]
    before = pa.StructArray.from_arrays(children, names=["id"], mask=pa.array([True, False]))
    after = pa.StructArray.from_arrays(children, names=["id"], mask=pa.array([False, True]))
    table = pa.table({"before": before, "after": after, "op": ["c", "d"]})
    out, failed = unwrap_debezium(table)
    assert failed == {} and out.column("id").to_pylist() == [7, 8]
    table = pa.table({"before": before, "after": after, "op": ["d", "c"]})
    out, failed = unwrap_debezium(table)
    assert sorted(failed) == [0, 1] and out.column("id").to_pylist() == [None, None]


@pytest.mark.parametrize("drop", [["op"], ["before", "after"]])
def test_a_record_that_is_no_debezium_event_fails_every_row(drop: list[str]) -> None:
    table = decoded([event("c", after=row(1)), event("d", before=row(1))]).drop_columns(drop)
    out, failed = unwrap_debezium(table)
    missing = "op" if drop == ["op"] else "before and after"
    assert failed == {
        i: f"debezium envelope: the record has no {missing} (not a Debezium change event)"
        for i in (0, 1)
    }
    assert out.num_rows == 2 and out.column("__tombstone").to_pylist() == [False, False]


def test_a_record_with_only_after_reads_deletes_as_failed() -> None:
    table = decoded([event("c", after=row(1)), event("d", before=row(1))]).drop_columns(["before"])
    out, failed = unwrap_debezium(table)
    assert failed == {1: "debezium envelope: op d without before (the row to delete)"}
    assert out.column("id").to_pylist() == [1, None]
