"""Failure policies on real servers: tansu -> Spark Connect -> PostgreSQL, the real loop.

One message in the middle of a 1,000-message batch violates a CHECK constraint. Under
``discard`` and ``discard_after_retry`` the other 999 rows are delivered, the bad one
is counted, and the offsets cover all 1,000. When every message is bad, the
dead-letter limit stops the connector before anything is dead-lettered or committed.
(``dead_letter`` itself, with replay, is in tests/e2e/test_errors_e2e.py.)
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import psycopg2
import pytest

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, run_loop
from conveyor.core.errors import DeadLetterLimitError
from conveyor.core.model import ConnectorSpec, Counters
from conveyor.dagster.jobs.committer import StoreCommitter
from conveyor.sinks import build_sink
from conveyor.spark.deadletters import dead_letter_writer
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer
from conveyor.store.meta import MetaStore
from tests.e2e.conftest import produce

pytestmark = pytest.mark.integration

N = 1_000
POISON = 500


def rows(pg_url: str, schema: str) -> list[int]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT id FROM "{schema}".orders ORDER BY id')
        return [r[0] for r in cur.fetchall()]


def run_connector(
    tmp_path: Path,
    tansu: str,
    spark_remote: str,
    pg_url: str,
    schema: str,
    topic: str,
    failure: dict,
) -> tuple[Counters | Exception, MetaStore, str]:
    name = f"fp_{uuid.uuid4().hex[:6]}"
    spec = ConnectorSpec.model_validate(
        {
            "name": name,
            "source": {"topics": [topic], "bootstrap_servers": tansu},
            "batch": {"max_records": N, "max_wait_ms": 500},
            "transform": {"decode": "json", "schema": "id BIGINT, name STRING, amount DOUBLE"},
            "sink": {"type": "postgres", "url": pg_url, "schema": schema, "table": "orders"},
            "failure": failure,
        }
    )
    store = MetaStore(f"sqlite:///{tmp_path / f'{name}.db'}")
    store.sync_spec(
        name, spec_json=spec.model_dump_json(), spec_hash="x", source="test", error=None
    )
    claim = store.claim(name, run_id="test", expected_generation=None, holder_alive=lambda r: False)
    spark = spark_session(spark_remote)
    source = KafkaSource(spec.source, group_id=name)
    dead = (
        dead_letter_writer(spec, claim.generation, spark=lambda: spark, connection=spec.source)
        if spec.failure.policy.value == "dead_letter"
        else None
    )
    loop = ConnectorLoop(
        LoopConfig(name=name, batch=spec.batch, retry=spec.retry, failure=spec.failure),
        source=source,
        transform=SparkTransformer(spec.transform, lambda: spark),
        sink=build_sink(spec.sink.model_dump()),
        committer=StoreCommitter(store, name, claim.generation, source),
        committed={},
        dead_letters=dead,
        stop_requested=lambda: sum(loop.committed.values()) >= N,
    )
    try:
        return run_loop(loop), store, name
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return e, store, name


@pytest.fixture
def orders(pg_url: str, pg_schema: str) -> str:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{pg_schema}".orders (id BIGINT PRIMARY KEY, name TEXT, '
            "amount DOUBLE PRECISION CONSTRAINT amount_not_negative CHECK (amount >= 0))"
        )
    return pg_schema


def poisoned(i: int) -> bytes:
    return json.dumps({"id": i, "name": f"n{i}", "amount": -1 if i == POISON else 1.0}).encode()


@pytest.mark.parametrize(
    "failure",
    [{"policy": "discard"}, {"policy": "discard_after_retry", "retries": 2}],
    ids=["discard", "discard_after_retry"],
)
def test_poison_message_is_discarded_the_rest_delivered_offsets_advance(
    failure, tmp_path, tansu, spark_remote, pg_url, orders, topic_name
):
    produce(tansu, topic_name, N, partitions=1, payload=poisoned)
    result, store, name = run_connector(
        tmp_path, tansu, spark_remote, pg_url, orders, topic_name, failure
    )
    assert isinstance(result, Counters), result
    assert rows(pg_url, orders) == [i for i in range(N) if i != POISON]
    assert result.discarded == 1 and result.dead_lettered == 0
    assert result.messages_out == N - 1
    assert sum(store.committed_offsets(name).values()) == N
    if failure["policy"] == "discard_after_retry":
        assert result.retries >= 2  # the bad row was re-sent twice before it was discarded


def test_dead_letter_limit_stops_before_draining_the_topic(
    tmp_path, file_root, tansu, spark_remote, pg_url, orders, topic_name
):
    produce(
        tansu,
        topic_name,
        N,
        partitions=1,
        payload=lambda i: json.dumps({"id": i, "name": "n", "amount": -1}).encode(),
    )
    dl_dir = tmp_path / "dl"
    result, store, name = run_connector(
        tmp_path,
        tansu,
        spark_remote,
        pg_url,
        orders,
        topic_name,
        {
            "policy": "dead_letter",
            "retries": 0,
            "dead_letter": {"path": str(dl_dir), "max_ratio": 0.5},
        },
    )
    assert isinstance(result, DeadLetterLimitError), result
    m = re.search(r"(\d+) of (\d+) messages in one batch failed", str(result))
    assert m and m.group(1) == m.group(2), str(result)  # the whole (first) batch failed
    assert rows(pg_url, orders) == []
    assert store.committed_offsets(name) == {}  # nothing committed: the messages stay in the topic
    assert not dl_dir.exists() or not any(dl_dir.rglob("*.parquet"))
