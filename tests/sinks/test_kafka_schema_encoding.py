"""The Kafka sink writing Confluent-framed Avro and JSON Schema (``value_format``): what it
writes is read back by confluent-kafka's own ``AvroDeserializer`` / ``JSONDeserializer`` from a
real tansu topic, equal to the rows sent; a row its schema does not allow is a failed message
while the rest go; tombstones stay null. The registry is ``tests/schema_registry_standin.py``, a
STAND-IN implementing only the documented routes (or a real one with
``CONVEYOR_TEST_SCHEMA_REGISTRY_URL``)."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest

from tests import schema_registry_standin as registry_standin
from tests.sinks.contract import unique
from tests.sinks.test_kafka import _sink, consume_all, create_topic, delete_topics

schema_registry = registry_standin.schema_registry  # the fixture

pytestmark = pytest.mark.integration

UTC = dt.timezone.utc


def rows_table() -> pa.Table:
    return pa.table(
        {
            "__key": pa.array([b"1", b"2", b"3"], pa.binary()),
            "id": pa.array([1, 2, 3], pa.int64()),
            "amount": pa.array([Decimal("1.50"), Decimal("-2.25"), None], pa.decimal128(9, 2)),
            "at": pa.array(
                [dt.datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)] * 3,
                pa.timestamp("us", tz="UTC"),
            ),
            "address": pa.array(
                [{"city": "a"}, {"city": "b"}, None], pa.struct([("city", pa.string())])
            ),
        }
    )


def deserialized(tansu: str, topic: str, url: str, fmt: str) -> list[Any]:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.schema_registry.json_schema import JSONDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    client = SchemaRegistryClient({"url": url})
    de = (
        AvroDeserializer(client)
        if fmt == "avro"
        else JSONDeserializer(None, schema_registry_client=client)
    )
    ctx = SerializationContext(topic, MessageField.VALUE)
    return [None if r.value is None else de(r.value, ctx) for r in consume_all(tansu, topic)]


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_avro_written_is_what_confluents_deserializer_reads(tansu, schema_registry, client):
    topic = unique("avro_out")
    create_topic(tansu, topic)
    s = _sink(
        client=client,
        bootstrap_servers=tansu,
        topic=topic,
        value_format="avro",
        schema_registry={"url": schema_registry.url},
    )
    try:
        assert s.send_batch(rows_table()).failed == ()
    finally:
        s.cleanup_sink()
    got = deserialized(tansu, topic, schema_registry.url, "avro")
    delete_topics(tansu, topic)
    assert [g["id"] for g in got] == [1, 2, 3]
    assert [g["amount"] for g in got] == [Decimal("1.50"), Decimal("-2.25"), None]
    assert got[0]["at"] == dt.datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)
    assert [g["address"] for g in got] == [{"city": "a"}, {"city": "b"}, None]


def test_json_schema_written_is_what_confluents_deserializer_reads(tansu, schema_registry):
    topic = unique("js_out")
    create_topic(tansu, topic)
    s = _sink(
        bootstrap_servers=tansu,
        topic=topic,
        value_format="json_schema",
        schema_registry={"url": schema_registry.url},
    )
    try:
        assert s.send_batch(rows_table().drop_columns(["amount", "at"])).failed == ()
    finally:
        s.cleanup_sink()
    got = deserialized(tansu, topic, schema_registry.url, "json_schema")
    delete_topics(tansu, topic)
    assert got == [
        {"id": 1, "address": {"city": "a"}},
        {"id": 2, "address": {"city": "b"}},
        {"id": 3, "address": None},
    ]


def test_a_row_the_schema_refuses_is_a_failed_message_and_tombstones_stay_null(
    tansu, schema_registry
):
    topic = unique("avro_bad")
    create_topic(tansu, topic)
    schema = {
        "type": "record",
        "name": "R",
        "fields": [{"name": "id", "type": "long"}, {"name": "name", "type": "string"}],
    }
    s = _sink(
        bootstrap_servers=tansu,
        topic=topic,
        value_format="avro",
        value_schema=json.dumps(schema),
        schema_registry={"url": schema_registry.url},
    )
    batch = pa.table(
        {
            "__key": pa.array([b"1", b"2", b"3", b"4"], pa.binary()),
            "__tombstone": pa.array([False, False, True, False]),
            "id": pa.array([1, 2, None, 4], pa.int64()),
            "name": pa.array(["a", None, None, "d"], pa.string()),  # row 1: null for a string
        }
    )
    try:
        res = s.send_batch(batch)
    finally:
        s.cleanup_sink()
    assert [f.index for f in res.failed] == [1]
    assert "avro" in res.failed[0].message
    recs = consume_all(tansu, topic)
    delete_topics(tansu, topic)
    assert [r.key for r in recs] == [b"1", b"3", b"4"]
    assert recs[1].value is None


def test_the_schema_settings_go_with_their_format():
    from conveyor.sinks.kafka_config import KafkaSinkConfig

    for bad, field in [
        ({"value_format": "avro"}, "schema_registry"),
        ({"value_schema": "{}"}, "value_schema"),
        (
            {
                "value_format": "avro",
                "schema_registry": {"url": "http://127.0.0.1:1"},
                "use_latest_version": True,
            },
            "use_latest_version",
        ),
    ]:
        with pytest.raises(Exception, match=field):
            KafkaSinkConfig.model_validate(
                {"type": "kafka", "topic": "t", "bootstrap_servers": "127.0.0.1:9", **bad}
            )


def test_protobuf_written_with_the_latest_registered_schema_is_what_confluent_reads(
    tansu, schema_registry
):
    """Protobuf schemas are registered by their owners (here: confluent-kafka's serializer,
    once); the sink writes with the subject's latest version, the message named."""
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from tests.integration.test_formats_registry import _proto_classes

    topic = unique("pb_out")
    create_topic(tansu, topic)
    order_cls = _proto_classes()["Order"]
    client = SchemaRegistryClient({"url": schema_registry.url})
    ctx = SerializationContext(topic, MessageField.VALUE)
    ProtobufSerializer(order_cls, client, {"use.deprecated.format": False})(order_cls(id=0), ctx)
    s = _sink(
        bootstrap_servers=tansu,
        topic=topic,
        value_format="protobuf",
        value_message="shop.Order",
        auto_register=False,
        use_latest_version=True,
        schema_registry={"url": schema_registry.url},
    )
    table = pa.table(
        {
            "__key": pa.array([b"1", b"2", b"3"], pa.binary()),
            "id": pa.array([1, 2, 3], pa.int64()),
            "big": pa.array([Decimal(2**64 - 1), Decimal(5), Decimal(6)], pa.decimal128(20, 0)),
            "status": pa.array(["PAID", "NEW", "PAID"]),
            "tags": pa.array([["a", "b"], [], ["c"]], pa.list_(pa.string())),
            "at": pa.array(
                [dt.datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)] * 3,
                pa.timestamp("us", tz="UTC"),
            ),
            "ship_to": pa.array(
                [{"city": "Oslo"}, {"city": "Rome"}, {"city": "Lima"}],
                pa.struct([("city", pa.string())]),
            ),
            "nope": pa.array([None, None, 7], pa.int64()),  # row 2: a field Order lacks
        }
    )
    try:
        res = s.send_batch(table)
    finally:
        s.cleanup_sink()
    assert [f.index for f in res.failed] == [2] and "nope" in res.failed[0].message
    de = ProtobufDeserializer(order_cls, {"use.deprecated.format": False})
    got = [de(r.value, ctx) for r in consume_all(tansu, topic)]
    delete_topics(tansu, topic)
    assert [(m.id, m.big, m.status, list(m.tags), m.ship_to.city) for m in got] == [
        (1, 2**64 - 1, 1, ["a", "b"], "Oslo"),
        (2, 5, 0, [], "Rome"),
    ]
    assert got[0].at.ToDatetime(tzinfo=UTC) == dt.datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)
