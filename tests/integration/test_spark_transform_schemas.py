"""decode avro / protobuf / json_schema in the Spark transform: records written by
confluent-kafka's serializers (against ``tests/schema_registry_standin.py``, a stand-in
implementing only the documented registry routes) decode in the run process into typed
columns, then filter and select run in Spark on those columns. A record with an unknown schema
id or a corrupt frame is a failed message while the rest go on; a registry outage is an outage
(TransientSinkError, the batch retried); a writer shape that changes between batches changes
the output's columns; an expression naming a field the records lack is a ConfigError at the
first batch."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest

from conveyor.brokers.kafka import SOURCE_SCHEMA
from conveyor.core.errors import ConfigError, TransientSinkError
from conveyor.core.model import TransformSpec
from conveyor.spark import transform as transform_module
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer
from tests import schema_registry_standin as registry_standin
from tests.schema_registry_standin import require_standin

schema_registry = registry_standin.schema_registry  # the fixture

pytestmark = pytest.mark.integration

UTC = dt.timezone.utc
V1 = {
    "type": "record",
    "name": "Order",
    "fields": [
        {"name": "id", "type": "long"},
        {
            "name": "amount",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2},
        },
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {
            "name": "address",
            "type": {"type": "record", "name": "A", "fields": [{"name": "city", "type": "string"}]},
        },
    ],
}
V2 = {
    **V1,
    "fields": [*V1["fields"], {"name": "email", "type": ["null", "string"], "default": None}],
}


@pytest.fixture(scope="module")
def spark(spark_remote: str) -> Any:
    return spark_session(spark_remote)


@pytest.fixture(autouse=True, params=["rows", "one_row"])
def crossing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(
        transform_module, "ONE_ROW_FROM", 1 if request.param == "one_row" else 1 << 62
    )
    return str(request.param)


def batch(values: list[bytes | None], topic: str = "orders") -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "__topic": topic,
                "__partition": 0,
                "__offset": 10 + i,
                "__timestamp": dt.datetime(2026, 11, 27, tzinfo=UTC),
                "__key": str(i).encode(),
                "__headers": [],
                "__destination": None,
                "__value": v,
            }
            for i, v in enumerate(values)
        ],
        schema=SOURCE_SCHEMA,
    )


def avro(url: str, schema: dict, records: list[dict], topic: str = "orders") -> list[bytes]:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    ser = AvroSerializer(SchemaRegistryClient({"url": url}), json.dumps(schema))
    ctx = SerializationContext(topic, MessageField.VALUE)
    return [ser(r, ctx) for r in records]


def rec(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "id": i,
        "amount": Decimal(f"{i}.{i % 100:02d}"),
        "at": dt.datetime(2026, 1, 1, 0, 0, i, 123456, tzinfo=UTC),
        "address": {"city": f"c{i}"},
        **extra,
    }


def transformer(spark: Any, url: str, **spec: Any) -> SparkTransformer:
    t = SparkTransformer(
        TransformSpec.model_validate({"decode": "avro", "schema_registry": {"url": url}, **spec}),
        spark,
    )
    t.prepare()
    return t


def test_avro_decodes_into_typed_columns_that_filter_and_select_see(spark, schema_registry):
    t = transformer(
        spark,
        schema_registry.url,
        filter="amount > 2.5",
        select=["id", "amount", "at", "address.city AS city", "__key"],
    )
    out = t(batch(avro(schema_registry.url, V1, [rec(i) for i in range(6)])))
    assert out.rejected == () and out.filtered == 3
    got = out.table.select(["id", "amount", "at", "city"]).to_pylist()
    assert [r["id"] for r in got] == [3, 4, 5]
    assert got[0]["amount"] == Decimal("3.03") and out.table.schema.field(
        "amount"
    ).type == pa.decimal128(10, 2)
    assert got[0]["at"] == dt.datetime(2026, 1, 1, 0, 0, 3, 123456, tzinfo=UTC)
    assert got[2]["city"] == "c5"
    assert out.table.column("__offset").to_pylist() == [13, 14, 15]


def test_an_unknown_id_and_a_corrupt_frame_are_failed_messages_the_rest_go_on(
    spark, schema_registry
):
    good = avro(schema_registry.url, V1, [rec(i) for i in range(3)])
    unknown = b"\x00" + (999_999).to_bytes(4, "big") + good[0][5:]
    values = [good[0], unknown, b"\x01garbage", good[1], b"\x00\x00", good[2]]
    out = transformer(spark, schema_registry.url)(batch(values))
    assert out.table.column("id").to_pylist() == [0, 1, 2]
    assert out.table.column("__offset").to_pylist() == [10, 13, 15]
    why = {r.index: r.message for r in out.rejected}
    assert sorted(why) == [1, 2, 4]
    assert "999999" in why[1]


def test_a_writer_shape_that_grows_between_batches_grows_the_output(spark, schema_registry):
    t = transformer(spark, schema_registry.url)
    one = t(batch(avro(schema_registry.url, V1, [rec(1)])))
    assert "email" not in one.table.column_names
    two = t(batch(avro(schema_registry.url, V2, [rec(2, email="a@b.c")])))
    assert two.table.column("email").to_pylist() == ["a@b.c"]
    assert two.table.column("amount").to_pylist() == [Decimal("2.02")]


def test_a_registry_outage_is_an_outage_and_the_batch_decodes_after_it(spark, schema_registry):
    standin = require_standin(schema_registry)
    values = avro(standin.url, V1, [rec(i) for i in range(2)])
    t = transformer(spark, standin.url)
    standin.outage = True
    with pytest.raises(TransientSinkError):
        t(batch(values))
    standin.outage = False
    assert t(batch(values)).table.column("id").to_pylist() == [0, 1]


def test_an_expression_on_a_field_the_records_lack_is_a_config_error(spark, schema_registry):
    t = transformer(spark, schema_registry.url, select=["id", "no_such_field"])
    with pytest.raises(ConfigError, match="Spark rejected the transform"):
        t(batch(avro(schema_registry.url, V1, [rec(1)])))


def test_tombstones_pass_with_null_payload_columns(spark, schema_registry):
    values = avro(schema_registry.url, V1, [rec(i) for i in range(2)])
    t = transformer(spark, schema_registry.url, null_values="pass")
    out = t(batch([values[0], None, values[1]]))
    assert out.table.column("id").to_pylist() == [0, None, 1]
    assert out.table.column("__tombstone").to_pylist() == [False, True, False]


VALUE = {
    "type": "record",
    "name": "Value",
    "namespace": "dbserver1.inventory.items",
    "fields": [
        {"name": "id", "type": "long"},
        {
            "name": "price",
            "type": [
                "null",
                {"type": "bytes", "logicalType": "decimal", "precision": 8, "scale": 2},
            ],
            "default": None,
        },
    ],
}
ENVELOPE = {
    "type": "record",
    "name": "Envelope",
    "namespace": "dbserver1.inventory.items",
    "fields": [
        {"name": "before", "type": ["null", VALUE], "default": None},
        {"name": "after", "type": ["null", "Value"], "default": None},
        {"name": "op", "type": "string"},
        {"name": "ts_ms", "type": ["null", "long"], "default": None},
    ],
}


def test_debezium_avro_events_become_upserts_deletes_and_truncates(spark, schema_registry):
    """Debezium's Avro envelope (as its AvroConverter writes it) with envelope: debezium."""
    row = lambda i, p: {"id": i, "price": Decimal(p)}  # noqa: E731
    events = [
        {"before": None, "after": row(1, "1.50"), "op": "r"},
        {"before": None, "after": row(2, "2.50"), "op": "c"},
        {"before": row(2, "2.50"), "after": row(2, "3.00"), "op": "u"},
        {"before": row(1, "1.50"), "after": None, "op": "d"},
        {"before": None, "after": None, "op": "t"},
        {"before": None, "after": row(9, "9.99"), "op": "x"},  # an op Debezium never writes
    ]
    values = avro(schema_registry.url, ENVELOPE, events)
    t = transformer(spark, schema_registry.url, envelope="debezium")
    out = t(batch([*values, None]))  # and the tombstone after the delete: skipped by default
    table = out.table
    assert table.column("id").to_pylist() == [1, 2, 2, 1, None]
    assert table.column("price").to_pylist() == [
        Decimal("1.50"),
        Decimal("2.50"),
        Decimal("3.00"),
        Decimal("1.50"),
        None,
    ]
    assert table.column("__tombstone").to_pylist() == [False, False, False, True, False]
    assert table.column("__truncate").to_pylist() == [False, False, False, False, True]
    assert "__op" not in table.column_names and "before" not in table.column_names
    assert [r.index for r in out.rejected] == [5] and "op" in out.rejected[0].message
    assert out.filtered == 1
