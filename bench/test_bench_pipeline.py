"""Benchmark: tansu -> connector (Kafka source, Spark Connect, PostgreSQL sink) vs a bare loop.

The bare loop is what a hand-written consumer does: kafka-python poll, json.loads,
psycopg2 ``execute_values``, commit. Both are measured in the same run on the same
servers, and reported as a ratio. Run with::

    .venv/bin/python -m pytest bench/test_bench_pipeline.py -m bench -s -n 0

Results go to docs/BENCHMARKS.md by hand, with the command.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import psycopg2
import psycopg2.extras
import pytest

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.loop import ConnectorLoop, LoopConfig, run_loop
from conveyor.core.model import BatchPolicy, SourceSpec, TransformSpec
from conveyor.jobs.connector import StoreCommitter
from conveyor.sinks import build_sink
from conveyor.spark.transform import SparkTransformer, spark_session
from conveyor.store.meta import MetaStore

pytestmark = pytest.mark.bench

N = int(os.environ.get("CONVEYOR_BENCH_MESSAGES", "100000"))
BATCH = int(os.environ.get("CONVEYOR_BENCH_BATCH", "10000"))
SCHEMA = "id BIGINT, name STRING, amount DOUBLE"


def produce(
    bootstrap: str, topic: str, n: int, partitions: int = 2, rate: float | None = None
) -> None:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, partitions, 1)])
    admin.close()
    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=256 * 1024)
    start = time.monotonic()
    for i in range(n):
        p.send(
            topic,
            key=str(i).encode(),
            value=json.dumps({"id": i, "name": f"name {i}", "amount": i * 0.5}).encode(),
            partition=i % partitions,
        )
        if rate:
            due = start + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    p.flush()
    p.close()


def create_table(pg_url: str, schema: str, table: str) -> None:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{schema}"."{table}" (id BIGINT, name TEXT, amount DOUBLE PRECISION)'
        )


def count(pg_url: str, schema: str, table: str) -> int:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT count(*) FROM "{schema}"."{table}"')
        return cur.fetchone()[0]


class LatencySink:
    """Wraps a sink and records produce-to-acknowledged latency per row (vectorised, so
    that measuring costs the connector about what it costs the bare loop)."""

    def __init__(self, inner):
        self.inner = inner
        self._chunks: list = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send_batch(self, batch):
        import pyarrow as pa
        import pyarrow.compute as pc

        result = self.inner.send_batch(batch)
        now_ms = time.time() * 1000
        ts = batch.column("__timestamp").cast(pa.timestamp("ms", tz="UTC")).cast(pa.int64())
        self._chunks.append(pc.subtract(now_ms, pc.cast(ts, pa.float64())))
        return result

    @property
    def latencies(self) -> list[float]:
        return [ms / 1000 for c in self._chunks for ms in c.to_pylist() if ms is not None]


def run_connector(
    bootstrap, spark, pg_url, schema, table, topic, expect, tmp_path: Path
) -> tuple[float, list[float]]:
    store = MetaStore(f"sqlite:///{tmp_path / f'meta-{uuid.uuid4().hex[:6]}.db'}")
    name = f"bench_{uuid.uuid4().hex[:6]}"
    store.sync_spec(name, spec_json="{}", spec_hash="x", source="bench", error=None)
    claim = store.claim(
        name, run_id="bench", expected_generation=None, holder_alive=lambda r: False
    )
    source = KafkaSource(SourceSpec(topics=[topic], bootstrap_servers=bootstrap), group_id=name)
    sink = LatencySink(
        build_sink({"type": "postgres", "url": pg_url, "schema": schema, "table": table})
    )
    loop = ConnectorLoop(
        LoopConfig(
            name=name,
            batch=BatchPolicy(max_records=BATCH, max_wait_ms=200),
            progress_interval_s=3600,
        ),
        source=source,
        transform=SparkTransformer(TransformSpec(decode="json", schema=SCHEMA), lambda: spark),
        sink=sink,
        committer=StoreCommitter(store, name, claim.generation, source),
        committed={},
        stop_requested=lambda: sum(loop.committed.values()) >= expect,
    )
    start = time.monotonic()
    run_loop(loop)
    return time.monotonic() - start, sink.latencies


def run_bare(bootstrap, pg_url, schema, table, topic, expect) -> tuple[float, list[float]]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"bare_{uuid.uuid4().hex[:6]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=6000,
        max_poll_records=BATCH,
        fetch_max_bytes=64 << 20,
        max_partition_fetch_bytes=16 << 20,
    )
    conn = psycopg2.connect(pg_url)
    latencies: list[float] = []
    done = 0
    start = time.monotonic()
    while done < expect:
        polled = consumer.poll(timeout_ms=200, max_records=BATCH)
        records = [r for rs in polled.values() for r in rs]
        if not records:
            continue
        rows = []
        for r in records:
            d = json.loads(r.value)
            rows.append((d["id"], d["name"], d["amount"]))
        with conn.cursor() as cur:
            psycopg2.extras.execute_values(
                cur,
                f'INSERT INTO "{schema}"."{table}" (id, name, amount) VALUES %s',
                rows,
                page_size=BATCH,
            )
        conn.commit()
        now = time.time()
        latencies.extend(now - r.timestamp / 1000 for r in records)
        consumer.commit()
        done += len(records)
    elapsed = time.monotonic() - start
    consumer.close()
    conn.close()
    return elapsed, latencies


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000 if s else float("nan")


def test_throughput_and_latency_vs_bare_loop(
    tansu, spark_remote, pg_url, pg_schema, tmp_path, capsys
):
    spark = spark_session(spark_remote)
    results = {}
    # Throughput: drain a backlog of N messages.
    for label in ("bare", "connector"):
        topic = f"bench_{label}_{uuid.uuid4().hex[:6]}"
        table = f"{label}_drain"
        produce(tansu, topic, N)
        create_table(pg_url, pg_schema, table)
        if label == "bare":
            elapsed, _ = run_bare(tansu, pg_url, pg_schema, table, topic, N)
        else:
            elapsed, _ = run_connector(tansu, spark, pg_url, pg_schema, table, topic, N, tmp_path)
        assert count(pg_url, pg_schema, table) >= N
        results[label] = {"msgs_per_s": N / elapsed}
    # Latency: a steady producer at a rate both can sustain.
    rate, n_lat = 2_000.0, 20_000
    for label in ("bare", "connector"):
        topic = f"lat_{label}_{uuid.uuid4().hex[:6]}"
        table = f"{label}_lat"
        create_table(pg_url, pg_schema, table)
        from kafka.admin import KafkaAdminClient, NewTopic

        a = KafkaAdminClient(bootstrap_servers=tansu)
        a.create_topics([NewTopic(topic, 2, 1)])
        a.close()
        t = threading.Thread(target=_produce_existing, args=(tansu, topic, n_lat, rate))
        t.start()
        if label == "bare":
            _, lat = run_bare(tansu, pg_url, pg_schema, table, topic, n_lat)
        else:
            _, lat = run_connector(tansu, spark, pg_url, pg_schema, table, topic, n_lat, tmp_path)
        t.join()
        results[label].update(p50_ms=pct(lat, 0.5), p99_ms=pct(lat, 0.99))
    ratio = results["connector"]["msgs_per_s"] / results["bare"]["msgs_per_s"]
    with capsys.disabled():
        print(f"\n{N} messages, batches of {BATCH}, 2 partitions")
        for label, r in results.items():
            print(
                f"  {label:9s} {r['msgs_per_s']:9.0f} msgs/s   p50 {r['p50_ms']:7.1f} ms   p99 {r['p99_ms']:7.1f} ms (at {rate:.0f} msgs/s)"
            )
        print(f"  ratio connector/bare throughput: {ratio:.2f}")
    assert results["connector"]["msgs_per_s"] > 0


def _produce_existing(bootstrap: str, topic: str, n: int, rate: float) -> None:
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=1)
    start = time.monotonic()
    for i in range(n):
        p.send(
            topic,
            key=str(i).encode(),
            value=json.dumps({"id": i, "name": f"name {i}", "amount": 1.0}).encode(),
            partition=i % 2,
        )
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    p.flush()
    p.close()
