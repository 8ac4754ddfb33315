"""Backfills through the connector (issue 38 point 3): a range of the topic read again through
the connector's transform into its sink, under the backfill's own consumer group; exactly the
range arrives again (an append-only PostgreSQL table shows those rows twice and no other), the
connector's own offsets in the meta store are untouched, and a range is given as offsets or as
earliest/latest; the job loads in the code location with its run config. A range in time is
found by reading the records' timestamps (tansu's ListOffsets by time answers offset 0 for
any time), and a run serving a request reports its state and counts to it."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from typing import Any

import psycopg2
import pyarrow as pa
import pytest
import yaml
from dagster import DagsterInstance

from conveyor.config.specs import load_source, resolved
from conveyor.core.model import TopicPartition
from conveyor.dagster.jobs.backfill import (
    BackfillResult,
    TimeBounds,
    backfill_job,
    backfill_range,
    backfill_writer,
    parse_position,
)
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.spark.session import spark_session
from conveyor.store.meta import MetaStore
from tests.e2e.conftest import SETTLE_S, produce

pytestmark = pytest.mark.integration


def spec(name: str, topic: str, tansu: str, pg_url: str, schema: str) -> dict[str, Any]:
    return {
        "name": name,
        "source": {"topics": [topic], "bootstrap_servers": tansu},
        "batch": {"max_records": 100, "max_wait_ms": 200},
        "transform": {"decode": "json", "schema": "id BIGINT, name STRING, amount DOUBLE"},
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": schema,
            "table": name,
            "create_table": True,
            "delivery": "at_least_once",
        },
    }


def ids(pg_url: str, schema: str, table: str) -> list[int]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT id FROM "{schema}"."{table}" ORDER BY id')
        return [r[0] for r in cur.fetchall()]


def test_exactly_the_range_arrives_again(tansu, spark_remote, pg_url, pg_schema, tmp_path):
    name = f"bf_{uuid.uuid4().hex[:6]}"
    topic = f"t_{name}"
    produce(tansu, topic, 300)  # ids i on partition i % 2, at offset i // 2
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec(name, topic, tansu, pg_url, pg_schema)))
    loaded = load_source(name, str(path))
    assert loaded.ok, loaded.error
    live = resolved(loaded)
    spark = lambda: spark_session(spark_remote)  # noqa: E731
    # Explicit ends: tansu answers ListOffsets for "latest" with a record batch's base offset
    # (docs/DESIGN.md section 7), so "latest" would stop short here; exact on Kafka.
    first = backfill_range(
        live, spark, start="earliest", end=f"{topic}:0:150,{topic}:1:150", request="r1"
    )
    assert first.delivered == 300 and first.failed == 0
    assert ids(pg_url, pg_schema, name) == list(range(300))
    # Offsets 25..74 of both partitions: ids 50..149.
    again = backfill_range(
        live,
        spark,
        start=f"{topic}:0:25,{topic}:1:25",
        end=f"{topic}:0:75,{topic}:1:75",
        request="r2",
    )
    assert again.delivered == 100 and again.read == 100
    assert again.ranges == {f"{topic}/0": [25, 75], f"{topic}/1": [25, 75]}
    got = ids(pg_url, pg_schema, name)
    assert len(got) == 400
    assert sorted(set(got)) == list(range(300))
    assert [i for i in range(300) if got.count(i) == 2] == list(range(50, 150))


def test_a_range_is_given_as_offsets_or_ends():
    assert parse_position("earliest") == "earliest"
    assert parse_position("2026-11-27T10:00:00Z") == "2026-11-27T10:00:00Z"
    assert parse_position("orders:0:5, orders:1:7") == {
        TopicPartition("orders", 0): 5,
        TopicPartition("orders", 1): 7,
    }
    with pytest.raises(Exception, match="'orders:x:5': partition: 'x' is not a partition number"):
        parse_position("orders:x:5")
    # A writer per request: the same range requested again is delivered again.
    assert backfill_writer("c", "r1") != backfill_writer("c", "r2")
    assert backfill_writer("c", "r1") == "c.backfill-r1"


def test_the_job_refuses_a_range_of_a_topic_the_connector_does_not_read() -> None:
    """Launched by hand (the launchpad: no request checked at the door), the job checks the
    range against the topics the connector reads before it connects to anything."""
    from conveyor.config.specs import LoadedSpec, parse_spec
    from conveyor.core.errors import ConfigError

    data = spec("bf_other", "orders", "127.0.0.1:9", "postgresql://u@127.0.0.1:9/x", "s")
    connector, sink = parse_spec(data)
    ls = LoadedSpec("bf_other", "test", spec=connector, sink=sink)
    for start, end, message in [
        ("other_topic:0:5", "latest", "start: 'other_topic:0:5': topic: the connector does not"),
        ("earliest", f"orders:0:{2**63}", f"end: 'orders:0:{2**63}': offset: {2**63} is out"),
    ]:
        with pytest.raises(ConfigError) as e:
            backfill_range(ls, lambda: None, start=start, end=end, request="r1")
        assert str(e.value).startswith(message), str(e.value)


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


def produce_stamped(bootstrap: str, topic: str, events: list[tuple[int, float]]) -> None:
    """``(id, time)`` messages, record timestamp = time, ids alternating two partitions."""
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=10)
    sent = [
        p.send(
            topic,
            value=json.dumps({"id": i, "name": f"n{i}", "amount": 1.0}).encode(),
            partition=i % 2,
            timestamp_ms=int(t * 1000),
        )
        for i, t in events
    ]
    p.flush()
    for future in sent:
        future.get(timeout=SETTLE_S)
    p.close()


def test_a_time_range_is_found_by_reading_and_its_request_gets_the_counts(
    tansu, spark_remote, pg_url, pg_schema, tmp_path
):
    """Ids 0..199 stamped a second apart (an hour ago), then ids 200..219 in batches of their
    own; the range [50 s, 150 s) is ids 50..149, written once into an exactly-once table; the
    request run again (a retry after a crash: its writer's offsets cover the range) writes
    nothing more; the same range requested again (a writer of its own) delivers it again."""
    name = f"bft_{uuid.uuid4().hex[:6]}"
    topic = f"t_{name}"
    produce(tansu, topic, 0)  # the topic, two partitions
    base = float(int(time.time()) // 60 * 60 - 3600)
    produce_stamped(tansu, topic, [(i, base + i) for i in range(200)])
    for k in range(2):  # later batches: each partition's end ("latest") lies past the range
        produce_stamped(tansu, topic, [(i, base + i) for i in range(200 + 10 * k, 210 + 10 * k)])
    s = spec(name, topic, tansu, pg_url, pg_schema)
    s["sink"]["delivery"] = "exactly_once"
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(s))
    loaded = load_source(name, str(path))
    assert loaded.ok, loaded.error
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    store.sync_spec(name, spec_json=json.dumps(s), spec_hash="h", source=str(path), error=None)
    resources = {
        "conveyor": ConveyorResource(
            meta_url=store.url, kafka_bootstrap=tansu, spark_remote=spark_remote
        )
    }
    start, end = iso(base + 50), iso(base + 150)
    first = store.request_backfill(name, start, end, requested_by="test")
    again = store.request_backfill(name, start, end, requested_by="test")

    # (request, rows it delivers, how often each id of the range is in the table after it)
    def run(request_id: int) -> str:
        with DagsterInstance.ephemeral() as instance:
            result = backfill_job(loaded).execute_in_process(
                run_config={
                    "ops": {
                        f"backfill_range__{name}": {
                            "config": {"start": start, "end": end, "request_id": request_id}
                        }
                    }
                },
                resources=resources,
                instance=instance,
            )
        assert result.success
        return result.run_id

    def counts(request_id: int) -> tuple[Any, ...]:
        got = store.backfill(request_id)
        return (got.state, got.run_id, got.read, got.delivered, got.failed)

    run_id = run(first.id)
    assert counts(first.id) == ("succeeded", run_id, 100, 100, 0)
    assert ids(pg_url, pg_schema, name) == list(range(50, 150))
    # The request's run executed again (a re-execution after a crash): its writer's offsets
    # cover the range, nothing is written twice; the request keeps its first outcome.
    run(first.id)
    assert counts(first.id) == ("succeeded", run_id, 100, 100, 0)
    assert ids(pg_url, pg_schema, name) == list(range(50, 150))
    # The same range requested again: a writer of its own, the range delivered again.
    run_id = run(again.id)
    assert counts(again.id) == ("succeeded", run_id, 100, 100, 0)
    assert ids(pg_url, pg_schema, name) == sorted(list(range(50, 150)) * 2)
    assert store.committed_offsets(name) == {}  # the connector's own offsets: untouched


def batch(rows: list[tuple[int, int, int | None]]) -> pa.Table:
    """(partition, offset, timestamp ms) rows of topic o."""
    return pa.table(
        {
            "__topic": pa.array(["o"] * len(rows)),
            "__partition": pa.array([r[0] for r in rows], pa.int32()),
            "__offset": pa.array([r[1] for r in rows], pa.int64()),
            "__timestamp": pa.array([r[2] for r in rows], pa.timestamp("ms", tz="UTC")),
        }
    )


def test_a_time_range_starts_and_ends_at_each_partitions_first_record_past_it():
    """As Kafka's ListOffsets by time: a partition's range starts at its first record stamped
    at or after the start (an older-stamped record after it is inside) and ends before its
    first stamped at or after the end; found across batches, partition by partition."""
    p0, p1 = TopicPartition("o", 0), TopicPartition("o", 1)
    hi = {p0: 100, p1: 100}
    result = BackfillResult(ranges={"o/0": [0, 100], "o/1": [0, 100]})
    b = TimeBounds(start_ms=1000, end_ms=2000)
    first = b.keep(batch([(0, 0, 900), (0, 1, 1000), (0, 2, 950), (1, 0, 500)]), hi, result)
    assert first.column("__offset").to_pylist() == [1, 2]
    assert b.started == {p0}
    # Partition 1 starts on a null-free later batch; partition 0 ends at its offset 4.
    second = b.keep(batch([(1, 1, 1500), (0, 3, 1999), (0, 4, 2000), (0, 5, 1500)]), hi, result)
    assert second.column("__offset").to_pylist() == [1, 3]
    assert hi == {p0: 4, p1: 100}
    assert result.ranges == {"o/0": [1, 4], "o/1": [1, 100]}
    # In the middle of the range every row stays (the batch is taken whole).
    middle = batch([(1, 2, 1600), (1, 3, 1700)])
    assert b.keep(middle, hi, result) is middle
    last = b.keep(batch([(1, 4, 2500), (1, 5, 1800), (0, 6, 1000)]), hi, result)
    assert last.num_rows == 0 and hi == {p0: 4, p1: 4}
