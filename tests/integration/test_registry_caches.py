"""Schema lookups that a topic cannot blow up (issue 45): an id the registry does not know is
asked once per ``unknown_id_ttl_s``, not once per record, and the schemas kept by id (the
registry client's, the decoders' parsed writers) stay within ``cache_capacity``. Counted on
the stand-in's request log (tests/schema_registry_standin.py); what the lookups cost reaches
``conveyor metrics serve``."""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from conveyor.core.schema_registry import SchemaRegistrySpec
from conveyor.formats import payload_decoder, registry_metrics
from tests import schema_registry_standin as standin_module
from tests.integration.test_decoder_limits import framed, register
from tests.schema_registry_standin import require_standin

pytestmark = pytest.mark.integration

schema_registry = standin_module.schema_registry
BY_ID = "GET /schemas/ids/{id}"


def decoder(registry: Any, fmt: str, **spec: Any) -> Any:
    return payload_decoder(fmt, SchemaRegistrySpec(url=registry.url, **spec), None, None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["avro", "json_schema", "protobuf"])
def test_a_topic_of_random_unknown_ids_costs_one_request_per_id_not_per_record(
    schema_registry: Any, fmt: str
) -> None:
    standin = require_standin(schema_registry)
    rng = random.Random(45)
    ids = rng.sample(range(10_000, 2_000_000), 200)
    dec = decoder(standin, fmt, unknown_id_ttl_s=3600)
    first = [framed(i, b"{}", protobuf=fmt == "protobuf") for i in ids]
    got = dec.decode(pa.array(first, pa.binary()))
    assert len(got.failed) == 200 and "unknown schema id" in got.failed[0]
    assert standin.requests[BY_ID] == 200
    # The same ids again, in five more batches: all failed messages, no request.
    distinct = 0
    for _ in range(5):
        again = [first[rng.randrange(200)] for _ in range(300)]
        distinct += len(set(again))
        got = dec.decode(pa.array(again, pa.binary()))
        assert len(got.failed) == 300 and all("unknown schema id" in w for w in got.failed.values())
    assert standin.requests[BY_ID] == 200
    metrics = registry_metrics([dec])
    assert metrics is not None
    assert metrics["requests"] == 200 and metrics["unknown_cached"] == 200
    # Each batch asks the registry's client once per id (repeats within a batch are known).
    assert metrics["lookups_unknown_cached"] == distinct


def test_an_id_registered_after_it_was_unknown_is_found_once_the_ttl_passed(
    schema_registry: Any,
) -> None:
    standin = require_standin(schema_registry)
    dec = decoder(standin, "avro", unknown_id_ttl_s=60)
    now = [0.0]
    dec.registry._unknown.clock = lambda: now[0]  # the TTL's clock, moved by hand
    schema = json.dumps({"type": "record", "name": "A", "fields": [{"name": "id", "type": "long"}]})
    next_id = max(standin.state.schemas, default=0) + 1
    value = framed(next_id, b"\x02")
    assert dec.decode(pa.array([value], pa.binary())).failed
    assert register(standin, f"late-{uuid.uuid4().hex[:6]}", schema) == next_id
    assert dec.decode(pa.array([value], pa.binary())).failed  # still remembered as unknown
    assert standin.requests[BY_ID] == 1
    now[0] += 61
    got = dec.decode(pa.array([value], pa.binary()))
    assert not got.failed and got.table.to_pylist() == [{"id": 1}]
    assert standin.requests[BY_ID] == 2


def test_schemas_kept_by_id_stay_within_the_capacity(schema_registry: Any) -> None:
    standin = require_standin(schema_registry)
    topic = f"t_{uuid.uuid4().hex[:8]}"
    client = SchemaRegistryClient({"url": standin.url})
    ctx = SerializationContext(topic, MessageField.VALUE)
    values = []
    for i in range(40):  # 40 writer schemas, one record each
        schema = {
            "type": "record",
            "name": "V",
            "doc": f"v{i}",
            "fields": [{"name": "id", "type": "long"}],
        }
        values.append(AvroSerializer(client, json.dumps(schema))({"id": i}, ctx))
    dec = decoder(standin, "avro", cache_capacity=8)
    before = standin.requests[BY_ID]
    for chunk in range(0, 40, 10):
        got = dec.decode(pa.array(values[chunk : chunk + 10], pa.binary()))
        assert not got.failed
    assert standin.requests[BY_ID] - before == 40
    registry = dec.registry
    assert len(registry._schemas) <= 8 and len(dec._writers) <= 8
    held = sum(len(v) for v in registry.client._cache.schema_id_index.values())
    assert held <= 8  # the client's own (unbounded) cache is emptied as ours drops entries
    metrics = registry.metrics()
    assert metrics["evictions"] >= 32 and metrics["schemas_cached"] <= 8
    # The most recent writers are still in memory: reading them again asks nothing.
    got = dec.decode(pa.array(values[-5:], pa.binary()))
    assert not got.failed and standin.requests[BY_ID] - before == 40
