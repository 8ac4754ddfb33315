"""Issue 36 under a running stack: records written by confluent-kafka's own serializers, with
their schemas in a schema registry, arrive in PostgreSQL column for column.

``conveyor dev`` runs the scheduler sensor: nobody launches a run; a connector file is written and
the stack loads and launches it. The registry is ``tests/schema_registry_standin.py``, a STAND-IN
that implements only the documented REST routes the clients call (or a real registry with
``CONVEYOR_TEST_SCHEMA_REGISTRY_URL``).

- Avro: decimals (precision and scale exact), timestamp-micros and -millis, date, a nested
  record, an array, an enum and a uuid, written with two schema versions into one topic; a
  field added to the writer schema mid-stream becomes a column of the running connector's table
  (``auto_evolve``) without a restart.
- Protobuf and JSON Schema topics likewise (nested, repeated, timestamps).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from decimal import Decimal
from typing import Any

import psycopg2
import pytest
import yaml

from tests import schema_registry_standin as registry_standin
from tests.e2e.conftest import wait_for
from tests.e2e.test_api_e2e import Stack, stack  # noqa: F401 - the stack fixture, this module's own
from tests.sources.producers import Msg, create_topic, produce

schema_registry = registry_standin.schema_registry  # the fixture

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

UTC = dt.timezone.utc

ORDER_V1 = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {
            "name": "amount",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 3},
        },
        {"name": "placed_at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {
            "name": "shipped_at",
            "type": ["null", {"type": "long", "logicalType": "timestamp-millis"}],
            "default": None,
        },
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {
            "name": "status",
            "type": {"type": "enum", "name": "Status", "symbols": ["NEW", "PAID", "SHIPPED"]},
        },
        {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
        {
            "name": "address",
            "type": {
                "type": "record",
                "name": "Address",
                "fields": [
                    {"name": "city", "type": "string"},
                    {"name": "zip", "type": ["null", "string"], "default": None},
                ],
            },
        },
        {"name": "tags", "type": {"type": "array", "items": "string"}},
    ],
}
# Version 2 adds a field (with a default: backward compatible).
ORDER_V2 = {
    **ORDER_V1,
    "fields": [*ORDER_V1["fields"], {"name": "email", "type": ["null", "string"], "default": None}],
}


def order(i: int, v2: bool = False) -> dict[str, Any]:
    o = {
        "id": i,
        "amount": Decimal(f"{i * 1000 + 7}.{i % 1000:03d}").scaleb(0),
        "placed_at": dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC) + dt.timedelta(seconds=i),
        "shipped_at": None if i % 2 else dt.datetime(2026, 2, 1, 0, 0, 0, 250000, tzinfo=UTC),
        "day": dt.date(2026, 3, 1) + dt.timedelta(days=i % 30),
        "status": ["NEW", "PAID", "SHIPPED"][i % 3],
        "ref": str(uuid.UUID(int=i + 1)),
        "address": {"city": f"city {i}", "zip": None if i % 5 == 0 else f"{10000 + i}"},
        "tags": [f"t{j}" for j in range(i % 3)],
    }
    if v2:
        o["email"] = f"user{i}@example.com"
    return o


def avro_messages(registry_url: str, topic: str, schema: dict, orders: list[dict]) -> list[Msg]:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    client = SchemaRegistryClient({"url": registry_url})
    ser = AvroSerializer(client, json.dumps(schema))
    ctx = SerializationContext(topic, MessageField.VALUE)
    return [Msg(ser(o, ctx), key=str(o["id"]).encode()) for o in orders]


def connector(
    name: str, topic: str, registry_url: str, pg_url: str, schema: str, **transform
) -> dict:
    return {
        "name": name,
        "source": {"topics": [topic]},
        "batch": {"max_records": 100, "max_wait_ms": 200},
        "transform": {"schema_registry": {"url": registry_url}, **transform},
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": schema,
            "table": name,
            "create_table": True,
            "auto_evolve": True,
            "upsert_keys": ["id"],
        },
    }


def rows(pg_url: str, schema: str, table: str, columns: str) -> list[tuple[Any, ...]]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{schema}"."{table}"',))
        if cur.fetchone()[0] is None:
            return []
        cur.execute(f'SELECT {columns} FROM "{schema}"."{table}" ORDER BY id')
        return cur.fetchall()


def column_types(pg_url: str, schema: str, table: str) -> dict[str, str]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            "SELECT column_name, format_type(a.atttypid, a.atttypmod) FROM information_schema.columns ic "
            "JOIN pg_attribute a ON a.attrelid = to_regclass(%s) AND a.attname = ic.column_name "
            "WHERE table_schema = %s AND table_name = %s",
            (f'"{schema}"."{table}"', schema, table),
        )
        return dict(cur.fetchall())


def test_avro_of_two_versions_arrives_column_for_column_and_a_new_field_adds_a_column(
    stack: Stack,  # noqa: F811
    schema_registry,
    tansu: str,
    pg_url: str,
    pg_schema: str,
) -> None:
    s = stack
    name = f"avro_{uuid.uuid4().hex[:6]}"
    topic = f"t_{name}"
    create_topic(tansu, topic, 2)
    first = [order(i) for i in range(150)]
    produce(tansu, topic, avro_messages(schema_registry.url, topic, ORDER_V1, first))
    (s.connectors / f"{name}.yaml").write_text(
        yaml.safe_dump(
            connector(name, topic, schema_registry.url, pg_url, pg_schema, decode="avro")
        )
    )
    cols = "id, amount, placed_at, shipped_at, day, status, ref, address, tags"
    wait_for(lambda: len(rows(pg_url, pg_schema, name, "id")) == 150, 240, f"150 rows\n{s.log()}")
    types = column_types(pg_url, pg_schema, name)
    assert types["amount"] == "numeric(12,3)"
    assert types["placed_at"] == "timestamp with time zone"
    assert types["day"] == "date"
    got = rows(pg_url, pg_schema, name, cols)
    for o, r in zip(first, got, strict=True):
        assert r[0] == o["id"]
        assert r[1] == o["amount"] and str(r[1]) == str(o["amount"])  # scale kept
        assert r[2] == o["placed_at"]  # microseconds exact
        assert r[3] == o["shipped_at"]
        assert r[4] == o["day"]
        assert r[5] == o["status"]
        assert str(r[6]) == o["ref"]
        assert r[7] == o["address"]
        assert r[8] == o["tags"]
    assert "email" not in types
    # Mid-stream: the writer schema gains a field; the running connector's table gains a column.
    run_ids = {r.run_id for r in [s.store.get(name)]}
    second = [order(i, v2=True) for i in range(150, 300)]
    produce(tansu, topic, avro_messages(schema_registry.url, topic, ORDER_V2, second))
    wait_for(lambda: len(rows(pg_url, pg_schema, name, "id")) == 300, 240, f"300 rows\n{s.log()}")
    emails = dict(rows(pg_url, pg_schema, name, "id, email"))
    assert all(emails[i] is None for i in range(150))
    assert all(emails[i] == f"user{i}@example.com" for i in range(150, 300))
    assert {s.store.get(name).run_id} == run_ids, "the column was added without a restart"
    assert s.state(name) == "RUNNING"


def test_protobuf_and_json_schema_topics_arrive_column_for_column(
    stack: Stack,  # noqa: F811
    schema_registry,
    tansu: str,
    pg_url: str,
    pg_schema: str,
) -> None:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.json_schema import JSONSerializer
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from tests.integration.test_formats_registry import EVENT, _proto_classes

    s = stack
    client = SchemaRegistryClient({"url": schema_registry.url})
    pb, js = f"pb_{uuid.uuid4().hex[:6]}", f"js_{uuid.uuid4().hex[:6]}"
    order_cls = _proto_classes()["Order"]
    ser = ProtobufSerializer(order_cls, client, {"use.deprecated.format": False})
    ctx = SerializationContext(f"t_{pb}", MessageField.VALUE)
    msgs = []
    for i in range(40):
        o = order_cls(id=i, big=2**63 + i, status=i % 2, tags=[f"x{i}"], price=i / 4)
        o.lines.add(sku=f"s{i}", qty=i)
        o.at.FromDatetime(dt.datetime(2024, 5, 6, 7, 8, 9, 123456) + dt.timedelta(minutes=i))
        o.ship_to.city = f"c{i}"
        msgs.append(Msg(ser(o, ctx), key=str(i).encode()))
    create_topic(tansu, f"t_{pb}", 2)
    produce(tansu, f"t_{pb}", msgs)
    jser = JSONSerializer(json.dumps(EVENT), client)
    jctx = SerializationContext(f"t_{js}", MessageField.VALUE)
    events = [
        {
            "id": i,
            "at": f"2024-03-04T05:06:{i:02d}.5Z",
            "score": i / 2,
            "items": [{"sku": "A", "qty": i}],
        }
        for i in range(40)
    ]
    create_topic(tansu, f"t_{js}", 2)
    produce(tansu, f"t_{js}", [Msg(jser(e, jctx), key=str(e["id"]).encode()) for e in events])
    for name, fmt in ((pb, "protobuf"), (js, "json_schema")):
        spec = connector(name, f"t_{name}", schema_registry.url, pg_url, pg_schema, decode=fmt)
        (s.connectors / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    wait_for(
        lambda: (
            len(rows(pg_url, pg_schema, pb, "id")) == 40
            and len(rows(pg_url, pg_schema, js, "id")) == 40
        ),
        300,
        f"40 rows in each table\n{s.log()}",
    )
    got = rows(pg_url, pg_schema, pb, "id, big, status, tags, price, at, ship_to, lines")
    for i, r in enumerate(got):
        assert r[0] == i and r[1] == Decimal(2**63 + i)
        assert r[2] == ["NEW", "PAID"][i % 2] and r[3] == [f"x{i}"] and r[4] == i / 4
        assert r[5] == dt.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC) + dt.timedelta(
            minutes=i
        )
        assert r[6]["city"] == f"c{i}" and r[7] == [{"sku": f"s{i}", "qty": i}]
    got = rows(pg_url, pg_schema, js, "id, at, score, items")
    for i, r in enumerate(got):
        assert r[0] == i and r[2] == i / 2 and r[3] == [{"sku": "A", "qty": i}]
        assert r[1] == dt.datetime(2024, 3, 4, 5, 6, i, 500000, tzinfo=UTC)


def test_a_kafka_to_kafka_connector_re_encodes_to_avro_confluent_reads(
    stack: Stack,  # noqa: F811
    schema_registry,
    tansu: str,
) -> None:
    """JSON in, Avro out: the Avro is read by confluent-kafka's AvroDeserializer."""
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from tests.sinks.test_kafka import consume_all

    s = stack
    name = f"k2k_{uuid.uuid4().hex[:6]}"
    src, dst = f"t_{name}", f"out_{name}"
    create_topic(tansu, src, 2)
    create_topic(tansu, dst, 1)
    docs = [{"id": i, "amount": f"{i}.25", "name": f"n{i}"} for i in range(60)]
    produce(tansu, src, [Msg(json.dumps(d).encode(), key=str(d["id"]).encode()) for d in docs])
    spec = {
        "name": name,
        "source": {"topics": [src]},
        "batch": {"max_records": 100, "max_wait_ms": 200},
        "transform": {
            "decode": "json",
            "schema": "id BIGINT, amount STRING, name STRING",
            "select": ["id", "CAST(amount AS DECIMAL(10,2)) AS amount", "name"],
        },
        "sink": {
            "type": "kafka",
            "bootstrap_servers": tansu,
            "topic": dst,
            "value_format": "avro",
            "schema_registry": {"url": schema_registry.url},
        },
    }
    (s.connectors / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    wait_for(lambda: len(consume_all(tansu, dst, 5)) >= 60, 240, f"60 records in {dst}\n{s.log()}")
    de = AvroDeserializer(SchemaRegistryClient({"url": schema_registry.url}))
    ctx = SerializationContext(dst, MessageField.VALUE)
    got = sorted((de(r.value, ctx) for r in consume_all(tansu, dst, 5)), key=lambda d: d["id"])
    assert got == [{"id": i, "amount": Decimal(f"{i}.25"), "name": f"n{i}"} for i in range(60)]
