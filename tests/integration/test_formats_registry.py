"""conveyor.formats against a schema registry: records written by confluent-kafka's own serializers.

The registry is the stand-in of ``tests/schema_registry_standin.py`` (only the documented REST
routes those clients call), or a real one with ``CONVEYOR_TEST_SCHEMA_REGISTRY_URL`` (the tests
that switch the stand-in's outage, credentials or request counts skip then). Every payload is
produced by ``AvroSerializer`` / ``ProtobufSerializer`` / ``JSONSerializer``; what the decoders
return is compared value for value (decimals as ``Decimal``, timestamps to the microsecond).
"""

from __future__ import annotations

import datetime as dt
import json
import socket
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, timestamp_pb2
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass

from conveyor.core.errors import ConfigError, TransientSinkError
from conveyor.core.schema_registry import SchemaRegistrySpec
from conveyor.core.trust import scrubbing
from conveyor.formats import payload_decoder
from conveyor.formats.encoding import payload_encoder
from tests import schema_registry_standin as standin_module
from tests.schema_registry_standin import require_standin

pytestmark = pytest.mark.integration

UTC = dt.timezone.utc
schema_registry = standin_module.schema_registry  # the fixture: the stand-in or a real registry


@pytest.fixture
def topic() -> str:
    return f"t_{uuid.uuid4().hex[:10]}"


def client(registry: Any) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": registry.url})


def ctx(topic: str) -> SerializationContext:
    return SerializationContext(topic, MessageField.VALUE)


def avro_produce(registry: Any, topic: str, schema: dict[str, Any], rows: list[Any]) -> list[bytes]:
    ser = AvroSerializer(client(registry), json.dumps(schema))
    return [ser(r, ctx(topic)) for r in rows]


def binary(values: list[bytes]) -> pa.Array:
    return pa.array(values, pa.binary())


ORDER = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {
            "name": "amount",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2},
        },
        {
            "name": "rate",
            "type": {
                "type": "fixed",
                "name": "Rate",
                "size": 8,
                "logicalType": "decimal",
                "precision": 18,
                "scale": 6,
            },
        },
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "at_ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "at_us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "local_us", "type": {"type": "long", "logicalType": "local-timestamp-micros"}},
        {"name": "t_ms", "type": {"type": "int", "logicalType": "time-millis"}},
        {"name": "t_us", "type": {"type": "long", "logicalType": "time-micros"}},
        {"name": "uid", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["NEW", "PAID"]}},
        {"name": "digest", "type": {"type": "fixed", "name": "Digest", "size": 4}},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "attrs", "type": {"type": "map", "values": "long"}},
        {
            "name": "customer",
            "type": [
                "null",
                {
                    "type": "record",
                    "name": "Customer",
                    "fields": [
                        {"name": "name", "type": "string"},
                        {"name": "vip", "type": "boolean"},
                        {"name": "since", "type": ["null", {"type": "int", "logicalType": "date"}]},
                    ],
                },
            ],
            "default": None,
        },
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "either", "type": ["null", "int", "string", "Status"], "default": None},
    ],
}


def order_rows() -> list[dict[str, Any]]:
    u1, u2 = uuid.UUID(int=1), uuid.UUID(int=2)
    return [
        {
            "id": 1,
            "amount": Decimal("1234567890.12"),
            "rate": Decimal("0.000001"),
            "day": dt.date(2024, 2, 29),
            "at_ms": dt.datetime(2024, 1, 1, 1, 2, 3, 4000, tzinfo=UTC),
            "at_us": dt.datetime(2024, 1, 1, 1, 2, 3, 4567, tzinfo=UTC),
            "local_us": dt.datetime(2024, 6, 1, 12, 0, 0, 1),
            "t_ms": dt.time(23, 59, 59, 999000),
            "t_us": dt.time(0, 0, 0, 1),
            "uid": u1,
            "status": "PAID",
            "digest": b"\x00\x01\x02\x03",
            "tags": ["a", "b"],
            "attrs": {"x": 1, "y": -2},
            "customer": {"name": "Ann", "vip": True, "since": dt.date(2000, 1, 1)},
            "note": "first",
            "either": ("shop.Status", "NEW"),
        },
        {
            "id": 2,
            "amount": Decimal("-0.01"),
            "rate": Decimal("-999999999999.999999"),
            "day": dt.date(1970, 1, 1),
            "at_ms": dt.datetime(1969, 12, 31, 23, 59, 59, 999000, tzinfo=UTC),
            "at_us": dt.datetime(1970, 1, 1, tzinfo=UTC),
            "local_us": dt.datetime(1999, 12, 31, 23, 59, 59, 999999),
            "t_ms": dt.time(0, 0),
            "t_us": dt.time(12, 30, 15, 123456),
            "uid": u2,
            "status": "NEW",
            "digest": b"\xff\xff\xff\xff",
            "tags": [],
            "attrs": {},
            "customer": None,
            "note": None,
            "either": 7,
        },
    ]


def expected_orders() -> list[dict[str, Any]]:
    out = []
    for r in order_rows():
        e = dict(r)
        e["uid"] = str(r["uid"])
        for k in ("t_ms", "t_us"):
            t = r[k]
            e[k] = ((t.hour * 60 + t.minute) * 60 + t.second) * 1_000_000 + t.microsecond
        e["attrs"] = list(r["attrs"].items())
        either = r["either"]
        e["either"] = {
            "int": either if isinstance(either, int) else None,
            "string": None,
            "Status": either[1] if isinstance(either, tuple) else None,
        }
        out.append(e)
    return out


def spec_of(registry: Any, **kw: Any) -> SchemaRegistrySpec:
    return SchemaRegistrySpec(url=registry.url, **kw)


def test_avro_logical_types_decode_exactly(schema_registry: Any, topic: str) -> None:
    values = avro_produce(schema_registry, topic, ORDER, order_rows())
    decoder = payload_decoder("avro", spec_of(schema_registry), None, None, None)
    got = decoder.decode(binary(values))
    assert got.failed == {}
    types = {f.name: f.type for f in got.table.schema}
    assert types["amount"] == pa.decimal128(12, 2)
    assert types["rate"] == pa.decimal128(18, 6)
    assert types["day"] == pa.date32()
    assert types["at_ms"] == pa.timestamp("ms", tz="UTC")
    assert types["at_us"] == pa.timestamp("us", tz="UTC")
    assert types["local_us"] == pa.timestamp("us")
    assert types["t_ms"] == pa.int64() and types["t_us"] == pa.int64()  # micros of day
    assert types["uid"] == pa.string() and types["status"] == pa.string()
    assert types["digest"] == pa.binary(4)
    assert types["tags"] == pa.list_(pa.field("item", pa.string(), False))
    assert pa.types.is_map(types["attrs"]) and types["attrs"].item_type == pa.int64()
    assert types["customer"].field("since").type == pa.date32()
    assert types["note"] == pa.string()
    assert [f.name for f in types["either"]] == ["int", "string", "Status"]
    rows = got.table.to_pylist()
    want = expected_orders()
    for r, w in zip(rows, want, strict=True):
        for k in ("at_ms", "at_us"):  # Arrow hands back its UTC zone; same instants
            assert r[k] == w[k]
        assert r == w
    assert isinstance(rows[0]["amount"], Decimal) and str(rows[0]["amount"]) == "1234567890.12"
    assert str(rows[1]["rate"]) == "-999999999999.999999"


V1 = {
    "type": "record",
    "name": "User",
    "namespace": "crm",
    "fields": [{"name": "id", "type": "long"}, {"name": "name", "type": "string"}],
}
V2 = {
    **V1,
    "fields": [*V1["fields"], {"name": "email", "type": "string", "default": "unknown"}],
}


def test_two_writer_versions_decode_into_one_reader_shape(schema_registry: Any, topic: str) -> None:
    first = avro_produce(schema_registry, topic, V1, [{"id": 1, "name": "a"}])
    second = avro_produce(schema_registry, topic, V2, [{"id": 2, "name": "b", "email": "b@x"}])
    batch = binary([first[0], second[0], first[0]])
    for reader in (json.dumps(V2), None):
        got = payload_decoder("avro", spec_of(schema_registry), reader, None, None).decode(batch)
        assert got.failed == {}
        assert got.table.column_names == ["id", "name", "email"]
        assert got.table.to_pylist() == [
            {"id": 1, "name": "a", "email": "unknown"},
            {"id": 2, "name": "b", "email": "b@x"},
            {"id": 1, "name": "a", "email": "unknown"},
        ]
    # A reader that needs a field the writer lacks, without a default: those rows fail.
    strict = {**V1, "fields": [*V1["fields"], {"name": "age", "type": "int"}]}
    got = payload_decoder("avro", spec_of(schema_registry), json.dumps(strict), None, None).decode(
        batch
    )
    assert set(got.failed) == {0, 1, 2}
    assert "not readable with the reader schema" in got.failed[0] and "age" in got.failed[0]


def test_latest_picks_up_a_version_registered_between_batches(
    schema_registry: Any, topic: str
) -> None:
    subject = f"{topic}-value"
    first = avro_produce(schema_registry, topic, V1, [{"id": 1, "name": "a"}])
    decoder = payload_decoder("avro", spec_of(schema_registry), "latest", subject, None)
    got = decoder.decode(binary(first))
    assert got.table.column_names == ["id", "name"]
    second = avro_produce(schema_registry, topic, V2, [{"id": 2, "name": "b", "email": "e"}])
    got = decoder.decode(binary([first[0], second[0]]))
    assert got.failed == {}
    assert got.table.to_pylist() == [
        {"id": 1, "name": "a", "email": "unknown"},
        {"id": 2, "name": "b", "email": "e"},
    ]


def test_unknown_ids_and_corrupt_frames_fail_alone(schema_registry: Any, topic: str) -> None:
    good = avro_produce(
        schema_registry, topic, V1, [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
    )
    body = good[0][5:]
    batch = [
        good[0],
        b"\x00" + (999999).to_bytes(4, "big") + body,  # an id the registry never gave
        b"\x01" + good[0][1:],  # magic byte 1
        good[1][:3],  # truncated inside the header
        good[1][:-1],  # truncated inside the record
        good[1],
    ]
    got = payload_decoder("avro", spec_of(schema_registry), None, None, None).decode(binary(batch))
    assert got.table.to_pylist() == [
        {"id": 1, "name": "a"},
        {"id": None, "name": None},
        {"id": None, "name": None},
        {"id": None, "name": None},
        {"id": None, "name": None},
        {"id": 2, "name": "b"},
    ]
    assert "unknown schema id" in got.failed[1] and "999999" in got.failed[1]
    assert "magic byte 1" in got.failed[2]
    assert "corrupt frame" in got.failed[3]
    assert "not Avro of its writer schema" in got.failed[4]
    assert set(got.failed) == {1, 2, 3, 4}


def test_registry_outage_and_closed_port_are_transient(schema_registry: Any, topic: str) -> None:
    standin = require_standin(schema_registry)
    values = avro_produce(standin, topic, V1, [{"id": 1, "name": "a"}])
    decoder = payload_decoder("avro", spec_of(standin, timeout_s=2), None, None, None)
    standin.outage = True
    with pytest.raises(TransientSinkError, match="HTTP 503"):
        decoder.decode(binary(values))
    standin.outage = False  # the same decoder recovers once the registry is back
    assert decoder.decode(binary(values)).table.to_pylist() == [{"id": 1, "name": "a"}]

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    closed = SchemaRegistrySpec(url=f"http://127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(TransientSinkError, match="unreachable"):
        payload_decoder("avro", closed, None, None, None).decode(binary(values))


@pytest.fixture
def secrets_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "secrets"
    d.mkdir()
    monkeypatch.setenv("CONVEYOR_SECRET_FILES", str(d))
    yield d
    scrubbing.forget_all()


def test_basic_auth_and_bearer_by_reference(
    schema_registry: Any, topic: str, secrets_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin = require_standin(schema_registry)
    values = avro_produce(standin, topic, V1, [{"id": 1, "name": "a"}])
    standin.basic_auth = ("svc", "s3cret-pw-123")
    monkeypatch.setenv("CONVEYOR_TEST_SR_PASSWORD", "s3cret-pw-123")
    basic = spec_of(
        standin, basic_auth_user="svc", basic_auth_password="${env:CONVEYOR_TEST_SR_PASSWORD}"
    )
    got = payload_decoder("avro", basic, None, None, None).decode(binary(values))
    assert got.table.to_pylist() == [{"id": 1, "name": "a"}]

    monkeypatch.setenv("CONVEYOR_TEST_SR_PASSWORD", "wrong-pw-456789")
    with pytest.raises(ConfigError) as refused:
        payload_decoder("avro", basic, None, None, None, prefix="transform").decode(binary(values))
    assert "transform.schema_registry.basic_auth_user" in str(refused.value)
    assert "HTTP 401" in str(refused.value)
    assert "wrong-pw-456789" not in str(refused.value)

    standin.basic_auth, standin.bearer_token = None, "tok-abcdef-789"
    (secrets_dir / "sr-token").write_text("tok-abcdef-789\n")
    bearer = spec_of(standin, bearer_token=f"${{file:{secrets_dir / 'sr-token'}}}")
    decoder = payload_decoder("avro", bearer, None, None, None)
    assert decoder.decode(binary(values)).table.to_pylist() == [{"id": 1, "name": "a"}]
    (secrets_dir / "sr-token").write_text("rotated-but-wrong")  # read again per request
    standin.state.schemas.clear()  # nothing cached in the stand-in helps; a new decoder asks
    with pytest.raises(ConfigError, match="bearer_token") as refused:
        payload_decoder("avro", bearer, None, None, None).decode(binary(values))
    assert "rotated-but-wrong" not in str(refused.value)


def test_one_lookup_per_schema_id(schema_registry: Any, topic: str) -> None:
    standin = require_standin(schema_registry)
    values = avro_produce(standin, topic, V1, [{"id": i, "name": f"n{i}"} for i in range(100)])
    before = standin.requests["GET /schemas/ids/{id}"]
    decoder = payload_decoder("avro", spec_of(standin), None, None, None)
    for _ in range(3):
        got = decoder.decode(binary(values))
        assert got.failed == {} and got.table.num_rows == 100
    assert standin.requests["GET /schemas/ids/{id}"] - before == 1


# -- Protobuf: message types built from descriptors (what protoc would generate) -------------


def _proto_classes() -> dict[str, type[Any]]:
    pool = DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    common = descriptor_pb2.FileDescriptorProto(
        name="shop/common.proto", package="shop", syntax="proto3"
    )
    addr = common.message_type.add(name="Address")
    addr.field.add(name="city", number=1, type=9, label=1)
    addr.field.add(name="zip", number=2, type=9, label=1)
    pool.Add(common)
    f = descriptor_pb2.FileDescriptorProto(name="shop/order.proto", package="shop", syntax="proto3")
    f.dependency.extend(["shop/common.proto", "google/protobuf/timestamp.proto"])
    status = f.enum_type.add(name="Status")
    status.value.add(name="NEW", number=0)
    status.value.add(name="PAID", number=1)
    other = f.message_type.add(name="Other")  # index 0: the order is not the first message
    other.field.add(name="x", number=1, type=5, label=1)
    order = f.message_type.add(name="Order")  # index 1
    line = order.nested_type.add(name="Line")  # index [1, 0]
    line.field.add(name="sku", number=1, type=9, label=1)
    line.field.add(name="qty", number=2, type=5, label=1)
    entry = order.nested_type.add(name="AttrsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=9, label=1)
    entry.field.add(name="value", number=2, type=3, label=1)
    fields = [
        ("id", 1, 3, 1, None),  # int64
        ("big", 2, 4, 1, None),  # uint64
        ("status", 3, 14, 1, ".shop.Status"),
        ("lines", 4, 11, 3, ".shop.Order.Line"),
        ("at", 5, 11, 1, ".google.protobuf.Timestamp"),
        ("ship_to", 6, 11, 1, ".shop.Address"),
        ("attrs", 7, 11, 3, ".shop.Order.AttrsEntry"),
        ("blob", 8, 12, 1, None),
        ("tags", 9, 9, 3, None),
        ("price", 10, 1, 1, None),
    ]
    for name, number, ftype, label, type_name in fields:
        fd = order.field.add(name=name, number=number, type=ftype, label=label)
        if type_name:
            fd.type_name = type_name
    pool.Add(f)
    return {
        "Order": GetMessageClass(pool.FindMessageTypeByName("shop.Order")),
        "Line": GetMessageClass(pool.FindMessageTypeByName("shop.Order.Line")),
    }


def test_protobuf_nested_repeated_maps_and_timestamps(schema_registry: Any, topic: str) -> None:
    classes = _proto_classes()
    order_cls, line_cls = classes["Order"], classes["Line"]
    conf = {"use.deprecated.format": False}
    ser = ProtobufSerializer(order_cls, client(schema_registry), conf)
    o = order_cls(id=2**40, big=2**64 - 1, status=1, blob=b"\x00\xff", tags=["x", "y"], price=9.5)
    o.lines.add(sku="A", qty=2)
    o.lines.add(sku="B", qty=-1)
    o.at.FromDatetime(dt.datetime(2024, 5, 6, 7, 8, 9, 123456))
    o.ship_to.city = "Oslo"
    o.attrs["k"] = 5
    empty = order_cls()  # proto3 defaults; unset message fields are null
    line_ser = ProtobufSerializer(line_cls, client(schema_registry), conf)
    values = [ser(o, ctx(topic)), ser(empty, ctx(topic)), b"\x00\x00\x00"]
    got = payload_decoder("protobuf", spec_of(schema_registry), None, None, None).decode(
        binary(values)
    )
    assert got.failed.keys() == {2}
    types = {fl.name: fl.type for fl in got.table.schema}
    assert types["at"] == pa.timestamp("us", tz="UTC") and types["id"] == pa.int64()
    assert types["big"] == pa.decimal128(20, 0) and types["blob"] == pa.binary()
    rows = got.table.to_pylist()
    assert rows[0] == {
        "id": 2**40,
        "big": Decimal(2**64 - 1),
        "status": "PAID",
        "lines": [{"sku": "A", "qty": 2}, {"sku": "B", "qty": -1}],
        "at": dt.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC),
        "ship_to": {"city": "Oslo", "zip": ""},
        "attrs": [("k", 5)],
        "blob": b"\x00\xff",
        "tags": ["x", "y"],
        "price": 9.5,
    }
    assert rows[1] == {
        "id": 0,
        "big": Decimal(0),
        "status": "NEW",
        "lines": [],
        "at": None,
        "ship_to": None,
        "attrs": [],
        "blob": b"",
        "tags": [],
        "price": 0.0,
    }
    # The nested message type, selected by the frame's message indexes [1, 0].
    line_topic = f"{topic}_lines"
    got = payload_decoder("protobuf", spec_of(schema_registry), None, None, None).decode(
        binary([line_ser(line_cls(sku="Z", qty=3), ctx(line_topic))])
    )
    assert got.table.to_pylist() == [{"sku": "Z", "qty": 3}]


# -- JSON Schema --------------------------------------------------------------------------------

EVENT = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "Event",
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "at": {"type": "string", "format": "date-time"},
        "day": {"type": ["string", "null"], "format": "date"},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 0}},
                "required": ["sku", "qty"],
            },
        },
        "meta": {"type": "object", "additionalProperties": {"type": "string"}},
        "who": {"$ref": "#/definitions/Person"},
    },
    "required": ["id", "at"],
    "definitions": {
        "Person": {"type": "object", "properties": {"name": {"type": "string"}}},
    },
}


def test_json_schema_nested_arrays_timestamps_and_validation(
    schema_registry: Any, topic: str
) -> None:
    ser = JSONSerializer(json.dumps(EVENT), client(schema_registry))
    good = {
        "id": 7,
        "at": "2024-03-04T05:06:07.123456Z",
        "day": "2024-03-04",
        "score": 1.5,
        "ok": True,
        "items": [{"sku": "A", "qty": 1}],
        "meta": {"k": "v"},
        "who": {"name": "Ann"},
    }
    minimal = {"id": 8, "at": "2024-03-04T05:06:07+02:00"}
    values = [ser(good, ctx(topic)), ser(minimal, ctx(topic))]
    bad_doc = {"id": 9, "at": "2024-03-04T05:06:07Z", "items": [{"sku": "B", "qty": -1}]}
    header = values[0][:5]
    values.append(header + json.dumps(bad_doc).encode())  # framed, but not valid for the schema
    got = payload_decoder("json_schema", spec_of(schema_registry), None, None, None).decode(
        binary(values)
    )
    assert got.failed.keys() == {2}
    assert "$.items[0].qty" in got.failed[2] and "minimum" in got.failed[2]
    types = {f.name: f.type for f in got.table.schema}
    assert types["at"] == pa.timestamp("us", tz="UTC") and types["day"] == pa.date32()
    assert types["id"] == pa.int64() and types["score"] == pa.float64()
    rows = got.table.to_pylist()
    assert rows[0] == {
        "id": 7,
        "at": dt.datetime(2024, 3, 4, 5, 6, 7, 123456, tzinfo=UTC),
        "day": dt.date(2024, 3, 4),
        "score": 1.5,
        "ok": True,
        "items": [{"sku": "A", "qty": 1}],
        "meta": [("k", "v")],
        "who": {"name": "Ann"},
    }
    assert rows[1]["at"] == dt.datetime(2024, 3, 4, 3, 6, 7, tzinfo=UTC)
    assert rows[1]["items"] is None and rows[1]["who"] is None


# -- Encoding -----------------------------------------------------------------------------------


def arrow_rows() -> pa.Table:
    return pa.table(
        {
            "id": pa.array([1, 2], pa.int64()),
            "amount": pa.array([Decimal("12345.678"), None], pa.decimal128(9, 3)),
            "at": pa.array(
                [dt.datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=UTC), None],
                pa.timestamp("us", tz="UTC"),
            ),
            "day": pa.array([dt.date(2024, 1, 2), None], pa.date32()),
            "attrs": pa.array([{"a": 1}, None], pa.map_(pa.string(), pa.int64())),
            "who": pa.array(
                [{"name": "Ann", "tags": ["x"]}, None],
                pa.struct([("name", pa.string()), ("tags", pa.list_(pa.string()))]),
            ),
        }
    )


def test_avro_encoder_output_reads_back_with_avro_deserializer(
    schema_registry: Any, topic: str
) -> None:
    table = arrow_rows()
    encoder = payload_encoder("avro", spec_of(schema_registry), "topic", True, False, None)
    payloads = encoder.encode(table, topic)
    de = AvroDeserializer(client(schema_registry))
    got = [de(p, ctx(topic)) for p in payloads]
    want = table.to_pylist()
    want[0]["attrs"] = dict(want[0]["attrs"])
    assert got == want
    # Registered under the topic strategy's subject; decoded by conveyor too, the same rows.
    assert client(schema_registry).get_latest_version(f"{topic}-value").schema_id is not None
    back = payload_decoder("avro", spec_of(schema_registry), None, None, None).decode(
        binary(payloads)
    )
    assert back.table.to_pylist() == table.to_pylist()


def test_avro_encoder_subject_strategies_and_latest_version(
    schema_registry: Any, topic: str
) -> None:
    table = pa.table({"id": pa.array([5], pa.int64())})
    for strategy, subject in [
        ("record", f"conveyor.{topic}"),
        ("topic_record", f"{topic}-conveyor.{topic}"),
    ]:
        encoder = payload_encoder("avro", spec_of(schema_registry), strategy, True, False, None)
        encoder.encode(table, topic)
        assert client(schema_registry).get_latest_version(subject).version == 1
    # use_latest_version: the subject's registered schema writes the rows (nothing registered).
    subject = f"{topic}-value"
    given = {"type": "record", "name": "Row", "fields": [{"name": "id", "type": "long"}]}
    client(schema_registry).register_schema(subject, Schema(json.dumps(given), "AVRO"))
    encoder = payload_encoder("avro", spec_of(schema_registry), "topic", False, True, None)
    payload = encoder.encode(table, topic)[0]
    assert AvroDeserializer(client(schema_registry))(payload, ctx(topic)) == {"id": 5}


def test_json_schema_encoder_output_reads_back_with_json_deserializer(
    schema_registry: Any, topic: str
) -> None:
    table = arrow_rows()
    encoder = payload_encoder("json_schema", spec_of(schema_registry), "topic", True, False, None)
    payloads = encoder.encode(table, topic)
    de = JSONDeserializer(None, schema_registry_client=client(schema_registry))
    got = [de(p, ctx(topic)) for p in payloads]
    assert got == [
        {
            "id": 1,
            "amount": "12345.678",
            "at": "2024-01-02T03:04:05.678901+00:00",
            "day": "2024-01-02",
            "attrs": {"a": 1},
            "who": {"name": "Ann", "tags": ["x"]},
        },
        {"id": 2, "amount": None, "at": None, "day": None, "attrs": None, "who": None},
    ]
    back = payload_decoder("json_schema", spec_of(schema_registry), None, None, None).decode(
        binary(payloads)
    )
    assert back.failed == {}
    assert back.table.column("at").to_pylist() == table.column("at").to_pylist()
    assert back.table.column("day").to_pylist() == table.column("day").to_pylist()


# -- Spark: the decoded tables cross into a Spark Connect session ------------------------------


def test_decoded_tables_cross_spark_connect(
    schema_registry: Any, topic: str, spark_remote: str
) -> None:
    from conveyor.spark.session import spark_session

    spark = spark_session(spark_remote)
    avro = payload_decoder("avro", spec_of(schema_registry), None, None, None).decode(
        binary(avro_produce(schema_registry, topic, ORDER, order_rows()))
    )
    classes = _proto_classes()
    o = classes["Order"](id=1, status=1)
    o.at.FromDatetime(dt.datetime(2024, 5, 6, 7, 8, 9, 123456))
    proto_values = [
        ProtobufSerializer(classes["Order"], client(schema_registry), {})(o, ctx(topic + "p"))
    ]
    proto = payload_decoder("protobuf", spec_of(schema_registry), None, None, None).decode(
        binary(proto_values)
    )
    ser = JSONSerializer(json.dumps(EVENT), client(schema_registry))
    js = payload_decoder("json_schema", spec_of(schema_registry), None, None, None).decode(
        binary([ser({"id": 1, "at": "2024-03-04T05:06:07Z", "items": []}, ctx(topic + "j"))])
    )
    for decoded in (avro, proto, js):
        table = decoded.table
        back = spark.createDataFrame(table).toArrow()
        assert back.num_rows == table.num_rows
        for name in table.column_names:
            got, want = back.column(name).to_pylist(), table.column(name).to_pylist()
            if table.schema.field(name).type == pa.timestamp("us"):
                # Spark's default spark.sql.timestampType (TIMESTAMP_LTZ) makes a timestamp
                # without zone a zoned one; the session's zone is UTC, so the wall clock stays.
                got = [None if v is None else v.replace(tzinfo=None) for v in got]
            assert got == want, name
