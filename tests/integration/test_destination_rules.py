"""A sink that routes rows (`__destination`) under the connector's destination rules, on real
servers: tansu -> Spark Connect -> the Kafka sink into a topic per row, the real loop. Rows to a
denied destination are failed messages for the failure policy; the others arrive."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, run_loop
from conveyor.core.model import ConnectorSpec
from conveyor.dagster.jobs.committer import StoreCommitter
from conveyor.sinks import build_sink
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer
from conveyor.store.meta import MetaStore
from tests.e2e.conftest import produce
from tests.sinks.test_kafka import consume_all

pytestmark = pytest.mark.integration

N = 90
REGIONS = ("eu", "us", "blocked")


def test_a_denied_destination_is_refused_and_the_others_arrive(
    tmp_path: Path, tansu: str, spark_remote: str, topic_name: str
) -> None:
    run = uuid.uuid4().hex[:6]
    produce(
        tansu,
        topic_name,
        N,
        partitions=1,
        payload=lambda i: json.dumps({"id": i, "region": REGIONS[i % 3]}).encode(),
    )
    name = f"dr_{run}"
    spec = ConnectorSpec.model_validate(
        {
            "name": name,
            "source": {"topics": [topic_name], "bootstrap_servers": tansu},
            "batch": {"max_records": 30, "max_wait_ms": 500},
            "transform": {
                "decode": "json",
                "schema": "id BIGINT, region STRING",
                "select": ["id", f"concat('dr_{run}_', region) AS __destination"],
            },
            "sink": {"type": "kafka", "bootstrap_servers": tansu, "topic": f"dr_{run}_fallback"},
            "destinations": {"admission": {"mode": "denylist", "patterns": [f"dr_{run}_blocked"]}},
            "failure": {"policy": "discard"},
        }
    )
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    store.sync_spec(
        name, spec_json=spec.model_dump_json(), spec_hash="x", source="test", error=None
    )
    claim = store.claim(name, run_id="test", expected_generation=None, holder_alive=lambda r: False)
    spark = spark_session(spark_remote)
    source = KafkaSource(spec.source, group_id=name)
    loop = ConnectorLoop(
        LoopConfig(
            name=name,
            batch=spec.batch,
            retry=spec.retry,
            failure=spec.failure,
            destinations=spec.destinations,
        ),
        source=source,
        transform=SparkTransformer(spec.transform, lambda: spark),
        sink=build_sink(spec.sink.model_dump()),
        committer=StoreCommitter(store, name, claim.generation, source),
        committed={},
        stop_requested=lambda: sum(loop.committed.values()) >= N,
    )
    counters = run_loop(loop)

    def ids(topic: str) -> list[int]:
        return sorted(json.loads(r.value)["id"] for r in consume_all(tansu, topic, timeout_s=10))

    assert ids(f"dr_{run}_eu") == [i for i in range(N) if i % 3 == 0]
    assert ids(f"dr_{run}_us") == [i for i in range(N) if i % 3 == 1]
    assert counters.discarded == N // 3 and counters.messages_out == N - N // 3
    assert sum(store.committed_offsets(name).values()) == N
