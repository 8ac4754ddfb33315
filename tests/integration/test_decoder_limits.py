"""Decoders that cannot be crashed (issue 45): a record nested deeper than the limit is one
failed message, a registry schema nested too deep, too large or with a reference cycle is a
ConfigError naming its subject and version, for Avro, JSON Schema and Protobuf alike. Before,
each raised RecursionError out of ``decode``: the batch failed, the run ended, and the same
batch came back on restart whatever ``failure.policy`` said.

The registry is the stand-in of ``tests/schema_registry_standin.py``; the schemas are
registered through its documented REST route, references and all.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2

from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, run_loop
from conveyor.core.errors import ConfigError
from conveyor.core.model import ConnectorSpec, Counters
from conveyor.core.schema_registry import SchemaRegistrySpec
from conveyor.formats import payload_decoder
from conveyor.formats.limits import (
    MAX_RECORD_NESTING,
    MAX_REFERENCES,
    MAX_SCHEMA_BYTES,
    MAX_TYPE_DEPTH,
)
from conveyor.store.meta import MetaStore
from tests import schema_registry_standin as standin_module
from tests.e2e.conftest import produce

pytestmark = pytest.mark.integration

schema_registry = standin_module.schema_registry  # the fixture: the stand-in or a real registry

DEEP = 1_500
OPEN_RECORD = {"type": "object", "properties": {"id": {"type": "integer"}, "doc": {}}}


def register(
    registry: Any,
    subject: str,
    schema: str,
    schema_type: str = "AVRO",
    references: list[dict[str, Any]] | None = None,
) -> int:
    """Register through the REST route (the client's ``register_schema`` would parse it)."""
    import httpx

    body: dict[str, Any] = {"schema": schema, "schemaType": schema_type}
    if references:
        body["references"] = references
    r = httpx.post(f"{registry.url}/subjects/{subject}/versions", json=body, timeout=10)
    r.raise_for_status()
    return int(r.json()["id"])


def framed(schema_id: int, payload: bytes, *, protobuf: bool = False) -> bytes:
    return b"\x00" + schema_id.to_bytes(4, "big") + (b"\x00" if protobuf else b"") + payload


def decoder(registry: Any, fmt: str, **kw: Any) -> Any:
    spec = SchemaRegistrySpec(url=registry.url)
    return payload_decoder(fmt, spec, kw.get("reader"), kw.get("subject"), None)  # type: ignore[arg-type]


def nested_json(depth: int) -> bytes:
    return b'{"id": 1, "doc": ' + b"[" * depth + b"]" * depth + b"}"


def deep_avro(depth: int) -> str:
    """Records R0..R(depth) each inside the one before (built as text: json.dumps recurses)."""
    opening = "".join(
        f'{{"type": "record", "name": "R{i}", "fields": [{{"name": "f", "type": '
        for i in range(depth)
    )
    inner = f'{{"type": "record", "name": "R{depth}", "fields": []}}'
    return opening + inner + "}]}" * depth


def deep_json_schema(depth: int) -> str:
    opening = '{"type": "object", "properties": {"f": ' * depth
    return opening + '{"type": "integer"}' + "}}" * depth


def proto_file(name: str, messages: int, deps: list[str] | None = None) -> str:
    """A file of messages M0..M(n-1), each Mi holding a field of type Mi+1: n levels deep."""
    fd = descriptor_pb2.FileDescriptorProto(name=name, package="deep", syntax="proto3")
    fd.dependency.extend(deps or [])
    for i in range(messages):
        m = fd.message_type.add(name=f"M{i}")
        m.field.add(name="id", number=1, type=3, label=1)
        if i + 1 < messages:
            f = m.field.add(name="next", number=2, type=11, label=1)
            f.type_name = f".deep.M{i + 1}"
    return base64.standard_b64encode(fd.SerializeToString()).decode()


def test_a_json_record_nested_200000_deep_is_one_failed_message(
    schema_registry: Any,
) -> None:
    topic = f"t_{uuid.uuid4().hex[:8]}"
    client = SchemaRegistryClient({"url": schema_registry.url})
    ser = JSONSerializer(json.dumps(OPEN_RECORD), client)
    ctx = SerializationContext(topic, MessageField.VALUE)
    good = [ser({"id": i, "doc": [i]}, ctx) for i in range(3)]
    header = good[0][:5]
    almost = header + nested_json(MAX_RECORD_NESTING - 2)  # the record and doc levels count
    batch = [good[0], header + nested_json(200_000), good[1], almost, good[2]]
    got = decoder(schema_registry, "json_schema").decode(pa.array(batch, pa.binary()))
    assert set(got.failed) == {1}
    assert f"nested deeper than {MAX_RECORD_NESTING} levels" in got.failed[1]
    assert [r["id"] for r in got.table.to_pylist()] == [0, None, 1, 1, 2]


def test_a_deep_record_under_a_recursive_schema_fails_alone(schema_registry: Any) -> None:
    tree = {
        "definitions": {"n": {"type": "object", "properties": {"c": {"$ref": "#/definitions/n"}}}},
        "type": "object",
        "properties": {"id": {"type": "integer"}, "c": {"$ref": "#/definitions/n"}},
    }
    sid = register(schema_registry, f"tree-{uuid.uuid4().hex[:6]}", json.dumps(tree), "JSON")
    doc: dict[str, Any] = {}
    for _ in range(MAX_RECORD_NESTING + 5):
        doc = {"c": doc}
    ok = {"id": 1, "c": {"c": {}}}
    batch = [
        framed(sid, json.dumps(ok).encode()),
        framed(sid, json.dumps({"id": 2, **doc}).encode()),
    ]
    got = decoder(schema_registry, "json_schema").decode(pa.array(batch, pa.binary()))
    assert set(got.failed) == {1} and "nested deeper than" in got.failed[1]
    assert got.table.column("id").to_pylist() == [1, None]


@pytest.mark.parametrize("fmt", ["avro", "json_schema", "protobuf"])
def test_a_writer_schema_nested_1500_deep_is_a_config_error_naming_subject_and_version(
    schema_registry: Any, fmt: str
) -> None:
    subject = f"deep-{fmt}-{uuid.uuid4().hex[:6]}"
    if fmt == "avro":
        sid = register(schema_registry, subject, deep_avro(DEEP))
        value = framed(sid, b"")
    elif fmt == "json_schema":
        sid = register(schema_registry, subject, deep_json_schema(DEEP), "JSON")
        value = framed(sid, b"{}")
    else:
        sid = register(schema_registry, subject, proto_file("deep.proto", DEEP), "PROTOBUF")
        value = framed(sid, b"", protobuf=True)
    with pytest.raises(ConfigError) as e:
        decoder(schema_registry, fmt).decode(pa.array([value], pa.binary()))
    assert f"schema id {sid}" in str(e.value) and f"subject {subject!r} version 1" in str(e.value)
    assert "deeper than" in str(e.value) and e.value.field == "transform.schema_registry"


@pytest.mark.parametrize("fmt", ["avro", "json_schema", "protobuf"])
def test_a_reference_cycle_is_a_config_error_naming_it(schema_registry: Any, fmt: str) -> None:
    a, b = (f"cyc-{fmt}-{x}-{uuid.uuid4().hex[:6]}" for x in "ab")
    if fmt == "avro":
        text_a = json.dumps({"type": "record", "name": "A", "fields": [{"name": "b", "type": "B"}]})
        text_b = json.dumps({"type": "record", "name": "B", "fields": [{"name": "a", "type": "A"}]})
        kind, names, value = "AVRO", ("B", "A"), b""
    elif fmt == "json_schema":
        text_a = json.dumps({"type": "object", "properties": {"b": {"$ref": "b.json"}}})
        text_b = json.dumps({"type": "object", "properties": {"a": {"$ref": "a.json"}}})
        kind, names, value = "JSON", ("b.json", "a.json"), b"{}"
    else:
        text_a = proto_file("a.proto", 1, ["b.proto"])
        text_b = proto_file("b.proto", 1, ["a.proto"])
        kind, names, value = "PROTOBUF", ("b.proto", "a.proto"), b""
    sid = register(
        schema_registry, a, text_a, kind, [{"name": names[0], "subject": b, "version": 1}]
    )
    register(schema_registry, b, text_b, kind, [{"name": names[1], "subject": a, "version": 1}])
    with pytest.raises(ConfigError) as e:
        decoder(schema_registry, fmt).decode(
            pa.array([framed(sid, value, protobuf=fmt == "protobuf")], pa.binary())
        )
    message = str(e.value)
    assert "reference cycle" in message, message
    assert f"subject {b!r} version 1" in message and f"subject {a!r} version 1" in message


def test_a_schema_too_large_or_with_too_many_references_is_a_config_error(
    schema_registry: Any,
) -> None:
    big = json.dumps(
        {
            "type": "record",
            "name": "Big",
            "fields": [{"name": "f", "type": "string", "doc": "x" * MAX_SCHEMA_BYTES}],
        }
    )
    subject = f"big-{uuid.uuid4().hex[:6]}"
    sid = register(schema_registry, subject, big)
    with pytest.raises(ConfigError, match=f"subject '{subject}' version 1.*larger than"):
        decoder(schema_registry, "avro").decode(pa.array([framed(sid, b"")], pa.binary()))
    refs = []
    for i in range(MAX_REFERENCES + 1):
        name = f"T{i}"
        text = json.dumps({"type": "record", "name": name, "fields": []})
        ref_subject = f"ref-{i}-{uuid.uuid4().hex[:6]}"
        register(schema_registry, ref_subject, text)
        refs.append({"name": name, "subject": ref_subject, "version": 1})
    fields = [{"name": f"f{i}", "type": f"T{i}"} for i in range(len(refs))]
    fan = f"fan-{uuid.uuid4().hex[:6]}"
    sid = register(
        schema_registry,
        fan,
        json.dumps({"type": "record", "name": "Fan", "fields": fields}),
        "AVRO",
        refs,
    )
    with pytest.raises(ConfigError, match=f"more than {MAX_REFERENCES} references"):
        decoder(schema_registry, "avro").decode(pa.array([framed(sid, b"")], pa.binary()))


def test_a_reader_schema_latest_too_deep_is_a_config_error_naming_the_subject(
    schema_registry: Any,
) -> None:
    subject = f"latest-{uuid.uuid4().hex[:6]}"
    ok = json.dumps({"type": "record", "name": "R0", "fields": [{"name": "id", "type": "long"}]})
    sid = register(schema_registry, subject, ok)
    register(schema_registry, subject, deep_avro(MAX_TYPE_DEPTH + 1))
    value = framed(sid, b"\x02")  # id 1
    with pytest.raises(ConfigError) as e:
        decoder(schema_registry, "avro", reader="latest", subject=subject).decode(
            pa.array([value], pa.binary())
        )
    assert f"subject {subject!r} version 2" in str(e.value) and "deeper than" in str(e.value)
    assert e.value.field == "transform.reader_schema"


def test_schemas_at_the_limits_still_decode(schema_registry: Any) -> None:
    subject = f"limit-{uuid.uuid4().hex[:6]}"
    sid = register(schema_registry, subject, deep_avro(MAX_TYPE_DEPTH - 1))
    got = decoder(schema_registry, "avro").decode(pa.array([framed(sid, b"")], pa.binary()))
    assert not got.failed and got.table.num_rows == 1


# -- End to end: the real loop, tansu -> Spark Connect -> PostgreSQL, dead letters ---------------

N = 60
POISON = 31


def test_a_poison_record_goes_to_the_dead_letters_and_the_others_land(
    schema_registry: Any,
    file_root: Path,
    tmp_path: Path,
    tansu: str,
    spark_remote: str,
    pg_url: str,
    pg_schema: str,
) -> None:
    topic = f"t_{uuid.uuid4().hex[:8]}"
    ser = JSONSerializer(
        json.dumps(OPEN_RECORD), SchemaRegistryClient({"url": schema_registry.url})
    )
    ctx = SerializationContext(topic, MessageField.VALUE)
    header = ser({"id": 0, "doc": 0}, ctx)[:5]

    def payload(i: int) -> bytes:
        return header + nested_json(200_000) if i == POISON else ser({"id": i, "doc": [i]}, ctx)

    produce(tansu, topic, N, partitions=1, payload=payload)
    dl_dir = tmp_path / "dl"
    counters, store, name = run_sink_connector(
        tmp_path,
        spark_remote,
        {
            "source": {"topics": [topic], "bootstrap_servers": tansu},
            "batch": {"max_records": N, "max_wait_ms": 500},
            "transform": {
                "decode": "json_schema",
                "schema_registry": {"url": schema_registry.url},
                "select": ["id"],
            },
            "sink": {
                "type": "postgres",
                "url": pg_url,
                "schema": pg_schema,
                "table": "landed",
                "create_table": True,
            },
            "failure": {"policy": "dead_letter", "dead_letter": {"path": str(dl_dir)}},
        },
        stop_when=lambda committed: sum(committed.values()) >= N,
    )
    assert counters.dead_lettered == 1 and counters.messages_out == N - 1, counters
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT id FROM "{pg_schema}".landed ORDER BY id')
        assert [r[0] for r in cur.fetchall()] == [i for i in range(N) if i != POISON]
    letters = pq.read_table(dl_dir / "letters").to_pylist()
    assert [(r["offset"], r["value"][:5]) for r in letters] == [(POISON, header)]
    assert f"nested deeper than {MAX_RECORD_NESTING} levels" in letters[0]["error"]
    assert sum(store.committed_offsets(name).values()) == N


def run_sink_connector(
    tmp_path: Path,
    spark_remote: str,
    config: dict[str, Any],
    stop_when: Callable[[dict[Any, int]], bool],
) -> tuple[Counters, MetaStore, str]:
    """The connector's real loop (as its Dagster op builds it) until ``stop_when(committed)``."""
    from conveyor.brokers.kafka import KafkaSource
    from conveyor.dagster.jobs.committer import StoreCommitter
    from conveyor.sinks import build_sink
    from conveyor.spark.deadletters import dead_letter_writer
    from conveyor.spark.session import spark_session
    from conveyor.spark.transform import SparkTransformer

    name = f"dl_{uuid.uuid4().hex[:6]}"
    spec = ConnectorSpec.model_validate({"name": name, **config})
    store = MetaStore(f"sqlite:///{tmp_path / f'{name}.db'}")
    store.sync_spec(name, spec_json=spec.model_dump_json(), spec_hash="x", source="t", error=None)
    claim = store.claim(name, run_id="t", expected_generation=None, holder_alive=lambda r: False)
    spark = spark_session(spark_remote)
    source = KafkaSource(spec.source, group_id=name)
    loop = ConnectorLoop(
        LoopConfig(name=name, batch=spec.batch, retry=spec.retry, failure=spec.failure),
        source=source,
        transform=SparkTransformer(spec.transform, lambda: spark),
        sink=build_sink(spec.sink.model_dump()),
        committer=StoreCommitter(store, name, claim.generation, source),
        committed={},
        dead_letters=dead_letter_writer(
            spec, claim.generation, spark=lambda: spark, connection=spec.source
        ),
        stop_requested=lambda: stop_when(loop.committed),
    )
    return run_loop(loop), store, name
