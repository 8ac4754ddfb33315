"""Benchmark: tansu -> connector (Kafka source, Spark Connect, PostgreSQL sink) vs a bare loop.

The connector and the bare loop are described in bench/harness.py. Here the bare
loop writes with PostgreSQL's ``COPY`` (psycopg2 ``copy_expert``, text format built
row by row), as the sink does, one transaction per batch. Throughput is the median
over alternating rounds; latency (produce -> row committed, p50/p99) is measured
with a steady producer at a rate both loops sustain. Run with::

    .venv/bin/python -m pytest bench/test_bench_pipeline.py -m bench -s -n 0

Results go to docs/BENCHMARKS.md by hand, with the command.
"""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from bench import harness as h
from conveyor.spark.session import spark_session

pytestmark = pytest.mark.bench


def create_table(pg_url: str, schema: str, table: str) -> None:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{schema}"."{table}" (id BIGINT, name TEXT, amount DOUBLE PRECISION)'
        )


def ids(pg_url: str, schema: str, table: str) -> set[int]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT id FROM "{schema}"."{table}"')
        return {r[0] for r in cur.fetchall()}


class LatencySink:
    """Wraps a sink and records produce-to-acknowledged latency per row (vectorised, so
    that measuring costs the connector about what it costs the bare loop)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self._chunks: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send_batch(self, batch: Any) -> Any:
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


class BareCopy:
    """The bare loop's writes: COPY of (id, name, amount), one transaction per batch."""

    def __init__(self, pg_url: str, schema: str, table: str):
        self.conn = psycopg2.connect(pg_url)
        self.stmt = f'COPY "{schema}"."{table}" (id, name, amount) FROM STDIN'
        self.latencies: list[float] = []

    def __call__(self, rows: list[dict[str, Any]], records: list[Any]) -> None:
        buf = io.StringIO()
        for d in rows:
            buf.write(f"{d['id']}\t{_text(d['name'])}\t{d['amount']}\n")
        buf.seek(0)
        with self.conn.cursor() as cur:
            cur.copy_expert(self.stmt, buf)
        self.conn.commit()
        now = time.time()
        self.latencies.extend(now - r.timestamp / 1000 for r in records)

    def close(self) -> None:
        self.conn.close()


def _text(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000 if s else float("nan")


def test_throughput_and_latency_vs_bare_loop(
    tansu: str,
    warm_spark_remote: str,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    capsys: Any,
) -> None:
    spark = spark_session(warm_spark_remote)
    state: dict[str, str] = {}

    def sink_config(table: str) -> dict[str, Any]:
        return {"type": "postgres", "url": pg_url, "schema": pg_schema, "table": table}

    def fresh(label: str) -> tuple[str, str]:
        topic, table = h.new_topic(), f"{label}_{h.new_topic()}"
        h.produce(tansu, topic, h.N)
        create_table(pg_url, pg_schema, table)
        state["table"] = table
        return topic, table

    def bare() -> h.Run:
        topic, table = fresh("bare")
        w = BareCopy(pg_url, pg_schema, table)
        try:
            return h.run_bare(tansu, topic, h.N, w)
        finally:
            w.close()

    def connector() -> h.Run:
        topic, table = fresh("conn")
        return h.run_connector(tansu, spark, sink_config(table), topic, h.N, tmp_path)

    def check(label: str) -> None:
        assert ids(pg_url, pg_schema, state["table"]) == set(range(h.N)), label

    result = h.compare("tansu -> PostgreSQL (COPY)", bare, connector, check)

    # Latency: a steady producer at a rate both sustain, for 10 s.
    rate, n_lat = 2_000.0, 20_000
    lat: dict[str, list[float]] = {}
    for label in ("bare", "connector"):
        topic, table = h.new_topic(), f"lat_{label}"
        create_table(pg_url, pg_schema, table)
        h.produce(tansu, topic, 0)  # creates the topic
        t = threading.Thread(
            target=h.produce, args=(tansu, topic, n_lat), kwargs={"rate": rate, "create": False}
        )
        t.start()
        if label == "bare":
            w = BareCopy(pg_url, pg_schema, table)
            h.run_bare(tansu, topic, n_lat, w)
            w.close()
            lat[label] = w.latencies
        else:
            sink = LatencySink(None)

            def wrap(s: Any, sink: LatencySink = sink) -> LatencySink:
                sink.inner = s
                return sink

            h.run_connector(
                tansu, spark, sink_config(table), topic, n_lat, tmp_path, wrap_sink=wrap
            )
            lat[label] = sink.latencies
        t.join()
        assert ids(pg_url, pg_schema, table) == set(range(n_lat))
    with capsys.disabled():
        print("\n" + result.report())
        for label, values in lat.items():
            print(
                f"  latency {label:<9} p50 {pct(values, 0.5):7.1f} ms   p99 {pct(values, 0.99):7.1f} ms"
                f"  (produce -> committed, steady {rate:,.0f} msgs/s)"
            )
