"""Benchmark (issue 36): Avro decoding as users run it, against confluent-kafka's own
deserializer loop, into PostgreSQL, side by side.

Issue 18's method (bench/test_bench_as_users_run_it.py), with Avro payloads. Each contender
drains the same backlog (``N`` Avro orders ``id`` long, ``name`` string, ``amount``
decimal(12,2) bytes, ``ts`` timestamp-micros, ``address`` record {city}, written by
confluent-kafka's ``AvroSerializer``, registered once, on 2 partitions of a fresh tansu topic,
produced before the clock starts) into its own PostgreSQL table (the same column types:
bigint, text, numeric(12,2), timestamptz, jsonb):

- **conveyor**: a connector spec with default settings but ``transform: {decode: avro,
  schema_registry: {url}}``, desired stopped, in a ``dagster dev`` stack; ``conveyor
  connector start`` starts the clock, the scheduler sensor launches the run;
- **librdkafka**: bench/contenders/librdkafka_avro_pg.py, the loop a user writes
  (``consume(10000)``, ``AvroDeserializer`` per message, ``COPY``, commit per batch).

The registry is tests/schema_registry_standin.py, a STAND-IN implementing only the documented
REST routes the clients call (one schema lookup per process: both sides cache it). Rows are
counted in the table every 0.2 s; **steady** rows/s is between 20% and 90% of ``N``, **total**
from the start command (the script's start) to the last row; CPU s per 100,000 rows over the
steady window per process (Conveyor's run process and the Spark Connect JVM apart; the
script's process), and over the whole drain (``cpu_whole_per_100k``: the steady window misses
the batches Conveyor's pipeline decoded ahead of it). Rounds alternate the order. Every table is checked: ``N`` rows, ``N``
distinct ids, the amounts' sum and one row's values exact.

    .venv/bin/python -m pytest bench/test_bench_avro.py -m bench -s -n 0
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from bench.drain import Pids, Result, drain_connector
from bench.stack import DevStack, dev_stack, listening_pid
from bench.test_bench_as_users_run_it import distinct_ids, watch
from tests.e2e.conftest import wait_for
from tests.schema_registry_standin import SchemaRegistryStandIn

pytestmark = [pytest.mark.bench, pytest.mark.timeout(7200)]

N = int(os.environ.get("CONVEYOR_BENCH_AVRO_N", "200000"))
ROUNDS = int(os.environ.get("CONVEYOR_BENCH_AVRO_ROUNDS", "2"))
# An unmeasured conveyor drain first: the Spark JVM's JIT warms to the Avro batches' query
# (the session fixture warms it on JSON batches only).
WARMUP_N = int(os.environ.get("CONVEYOR_BENCH_AVRO_WARMUP_N", "100000"))
CONTENDERS = ["conveyor", "librdkafka"]
OUT = os.environ.get("CONVEYOR_BENCH_OUT")  # also write the results as JSON here
PROFILE = os.environ.get("CONVEYOR_BENCH_PROFILE")  # a folder: py-spy on each run process
ROOT = Path(__file__).resolve().parent.parent
UTC = dt.timezone.utc
EPOCH = dt.datetime(2026, 1, 1, tzinfo=UTC)

ORDER = {
    "type": "record",
    "name": "Order",
    "namespace": "bench",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "name", "type": "string"},
        {
            "name": "amount",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2},
        },
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {
            "name": "address",
            "type": {
                "type": "record",
                "name": "Address",
                "fields": [{"name": "city", "type": "string"}],
            },
        },
    ],
}


def order(i: int) -> dict[str, Any]:
    return {
        "id": i,
        "name": f"name {i}",
        "amount": Decimal(i * 101 + 7).scaleb(-2),  # i * 1.01 + 0.07, scale 2
        "ts": EPOCH + dt.timedelta(microseconds=i * 1_000_003),
        "address": {"city": f"city {i % 1000}"},
    }


def amounts_sum(n: int) -> Decimal:
    return sum((order(i)["amount"] for i in range(n)), Decimal(0))


def produce_avro(bootstrap: str, registry: str, topic: str, n: int) -> None:
    """``n`` orders, key = id, round robin over 2 partitions of a new topic, each value
    serialized by ``AvroSerializer`` (the schema registered once)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, 2, 1)]).values():
        f.result(30)
    serialize = AvroSerializer(SchemaRegistryClient({"url": registry}), json.dumps(ORDER))
    ctx = SerializationContext(topic, MessageField.VALUE)
    p = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 5, "queue.buffering.max.messages": 1_000_000}
    )
    for i in range(n):
        value = serialize(order(i), ctx)
        while True:
            try:
                p.produce(topic, key=str(i), value=value, partition=i % 2)
                break
            except BufferError:
                p.poll(0.05)
        if i % 1000 == 0:
            p.poll(0)
    assert p.flush(60) == 0


def create_table(pg_url: str, schema: str, table: str) -> None:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{schema}"."{table}" (id BIGINT, name TEXT, amount NUMERIC(12,2),'
            " ts TIMESTAMPTZ, address JSONB, arrived TIMESTAMPTZ DEFAULT clock_timestamp())"
        )


def check_contents(pg_url: str, schema: str, table: str) -> None:
    """``N`` rows, ``N`` distinct ids, the amounts' exact sum, and one row as written."""
    assert distinct_ids(pg_url, schema, table) == N, table
    probe = N // 2 + 1
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT count(*), sum(amount) FROM "{schema}"."{table}"')
        rows, total = cur.fetchone()
        assert (rows, total) == (N, amounts_sum(N)), table
        cur.execute(
            f'SELECT id, name, amount, ts, address FROM "{schema}"."{table}" WHERE id = %s',
            (probe,),
        )
        assert cur.fetchall() == [tuple(order(probe).values())], table


def spec(name: str, topic: str, registry: str, pg_url: str, schema: str) -> dict[str, Any]:
    """What a user writes: defaults everywhere but the source, the decoding and the sink."""
    return {
        "name": name,
        "desired": "stopped",
        "source": {"topics": [topic]},
        "transform": {"decode": "avro", "schema_registry": {"url": registry}},
        "sink": {"type": "postgres", "url": pg_url, "schema": schema, "table": name},
    }


def run_conveyor(
    stack: DevStack,
    result: Result,
    name: str,
    jvm: int | None,
    pg_url: str,
    schema: str,
    profile: str | None,
) -> Result:
    """Connector ``name`` started by the CLI, its run launched by the scheduler sensor,
    watched until all ``result.n`` rows are in its table, then stopped."""

    def watch_table(r: Result, pids: Pids) -> Result:
        return watch(r, pg_url, schema, name, pids)

    return drain_connector(stack, result, name, jvm, watch_table, profile)


def run_loop(
    bootstrap: str, registry: str, topic: str, pg_url: str, schema: str, table: str, home: Path
) -> Result:
    """The librdkafka loop as its own process, watched until all ``N`` rows are in."""
    result = Result("librdkafka", time.monotonic(), N)
    log_path = home / f"librdkafka-{table}.log"
    args = [
        "--bootstrap", bootstrap, "--topic", topic, "--group", f"g_{uuid.uuid4().hex[:8]}",
        "--registry", registry, "--pg", pg_url, "--table", f'"{schema}"."{table}"', "--n", str(N),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.contenders.librdkafka_avro_pg", *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            watch(result, pg_url, schema, table, lambda: {"process": proc.pid})
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert proc.returncode == 0, log_path.read_text()[-2000:]
    return result


def test_avro_decode_as_users_run_it_vs_the_librdkafka_deserializer_loop(
    tansu: str, warm_spark_remote: str, pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    rounds = [f"r{i}_{tag}" for i in range(ROUNDS)]
    registry = SchemaRegistryStandIn()
    jvm = listening_pid(int(warm_spark_remote.rsplit(":", 1)[1]))
    names = {r: f"avro_conv_{r}" for r in rounds}
    warmup = f"avro_conv_warm_{tag}"
    specs = [spec(n, f"t_{n}", registry.url, pg_url, pg_schema) for n in [warmup, *names.values()]]
    results: dict[str, list[Result]] = {c: [] for c in CONTENDERS}
    loads = [("start", os.getloadavg())]
    try:
        with dev_stack(tmp_path / "home", tansu, warm_spark_remote, specs) as stack:
            wait_for(lambda: len(stack.store.list()) == len(specs), 120, "specs synced")
            if WARMUP_N:
                create_table(pg_url, pg_schema, warmup)
                produce_avro(tansu, registry.url, f"t_{warmup}", WARMUP_N)
                warm = Result("warm-up", time.monotonic(), WARMUP_N)
                run_conveyor(stack, warm, warmup, jvm, pg_url, pg_schema, None)
                print(f"warm-up: {WARMUP_N:,} rows at {warm.total_rate():,.0f} rows/s")
            for i, r in enumerate(rounds):
                sequence = CONTENDERS if i % 2 == 0 else list(reversed(CONTENDERS))
                for contender in sequence:
                    table = names[r] if contender == "conveyor" else f"avro_loop_{r}"
                    topic = f"t_{table}"
                    create_table(pg_url, pg_schema, table)
                    produce_avro(tansu, registry.url, topic, N)
                    if contender == "conveyor":
                        res = Result("conveyor", time.monotonic(), N)
                        run_conveyor(stack, res, table, jvm, pg_url, pg_schema, PROFILE)
                    else:
                        res = run_loop(
                            tansu, registry.url, topic, pg_url, pg_schema, table, tmp_path
                        )
                    check_contents(pg_url, pg_schema, table)
                    results[contender].append(res)
                    loads.append((f"{i + 1} {contender}", os.getloadavg()))
                    print(
                        f"round {i + 1} {contender:<10} load {os.getloadavg()}"
                        f" steady {res.steady_rate():>9,.0f} rows/s"
                        f"  total {res.total_rate():>9,.0f}  cpu/100K {res.cpu_per_100k()}"
                        f"  whole drain {cpu_whole_per_100k(res)}"
                    )
    finally:
        registry.close()
    report(results, loads)


def cpu_whole_per_100k(result: Result) -> dict[str, float]:
    """CPU s per 100,000 rows over the whole drain, per process: from the first sample that
    has the process (Conveyor's run process: once its run has registered its pid, so most of
    its start-up is in) to the last row. With a pipeline the steady window misses the
    batches decoded ahead of it; this figure does not, but it holds start-up work."""
    last = result.samples[-1].cpu
    first = {k: next(s.cpu[k] for s in result.samples if k in s.cpu) for k in last}
    return {k: (last[k] - first[k]) * 100_000 / result.n for k in last}


def report(results: dict[str, list[Result]], loads: list[tuple[str, Any]]) -> None:
    """The table for docs/BENCHMARKS.md (markdown, printed; JSON to $CONVEYOR_BENCH_OUT)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    base = results["librdkafka"]
    lines = [
        f"Avro as users run it: {N:,} messages, {ROUNDS} rounds, commit {commit}, load average"
        f" {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        "",
        "| contender | steady rows/s (median; rounds) | total rows/s (median; rounds)"
        " | CPU s per 100K rows, steady window (median) | CPU s per 100K rows, whole drain"
        " (median) | steady ratio vs librdkafka (rounds) | total ratio (rounds) |",
        "|---|---|---|---|---|---|---|",
    ]
    out: dict[str, Any] = {"n": N, "rounds": ROUNDS, "commit": commit, "loads": loads}
    for c, rs in results.items():
        steady = [r.steady_rate() for r in rs]
        total = [r.total_rate() for r in rs]
        keys = rs[0].cpu_per_100k()
        cpu = {k: statistics.median([r.cpu_per_100k().get(k, 0.0) for r in rs]) for k in keys}
        whole = {
            k: statistics.median([cpu_whole_per_100k(r).get(k, 0.0) for r in rs]) for k in keys
        }
        ratios = [a / b.steady_rate() for a, b in zip(steady, base, strict=True)]
        totals = [a / b.total_rate() for a, b in zip(total, base, strict=True)]
        out[c] = {"steady": steady, "total": total, "cpu_per_100k": cpu, "cpu_whole": whole}
        out[c] |= {"steady_ratio": ratios, "total_ratio": totals}
        lines.append(
            f"| {c} | {statistics.median(steady):,.0f} ({', '.join(f'{x:,.0f}' for x in steady)})"
            f" | {statistics.median(total):,.0f} ({', '.join(f'{x:,.0f}' for x in total)})"
            f" | {', '.join(f'{k} {v:.2f}' for k, v in cpu.items())}"
            f" | {', '.join(f'{k} {v:.2f}' for k, v in whole.items())}"
            f" | {', '.join(f'{x:.2f}' for x in ratios) if c != 'librdkafka' else '-'}"
            f" | {', '.join(f'{x:.2f}' for x in totals) if c != 'librdkafka' else '-'} |"
        )
    print("\n" + "\n".join(lines) + f"\nload averages: {loads}")
    if OUT:
        Path(OUT).write_text(json.dumps(out, indent=2))
