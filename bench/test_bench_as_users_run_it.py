"""Benchmark: the connector as users run it, against what they would write or install instead.

Issue 18's method. Each contender drains the same backlog (``N`` JSON orders ``id``,
``name``, ``amount``, ``ts`` on 2 partitions of a fresh tansu topic, produced before
the clock starts) into its own PostgreSQL table:

- **conveyor**: a connector spec with default settings, desired stopped, in a
  ``dagster dev`` stack (webserver, daemon, code server); ``conveyor connector start``
  starts the clock, the scheduler sensor launches the run, progress events are on;
- **librdkafka**: bench/contenders/librdkafka_pg.py, the 30-line confluent-kafka loop
  (``consume(10000)``, ``json.loads``, ``COPY``, commit per batch);
- **quixstreams**: bench/contenders/quix_pg.py, ``Application`` + ``PostgreSQLSink``,
  defaults.

Rows are counted in the table every 0.2 s. **steady** rows/s is between 20% and 90% of
``N``; **total** includes start-up (from the start command to the last row). CPU is
sampled per process (for Conveyor its run process, plus the Spark Connect JVM,
reported on its own) and given per 100,000 rows over the steady window; RSS is the
peak. Rounds alternate the contenders' order. Latency: a producer at a steady
``LATENCY_RATE`` msgs/s into a running contender; per row, the table's
``clock_timestamp()`` at insert minus the producer's send time.

    .venv/bin/python -m pytest bench/test_bench_as_users_run_it.py -m bench -s -n 0

Conveyor's runs are forked from the warm run server, as ``conveyor dev`` launches them
(``bench/stack.py`` starts it; ``CONVEYOR_RUN_LAUNCHER=default``: spawned by Dagster's own
launcher); CPU is also given from each
process's start to the last row (start-up included: a spawned run's imports are in it, a
forked run's were paid once by its server).

Results go to docs/BENCHMARKS.md by hand, with the command and the commit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import psycopg2
import pytest

from bench import memory
from bench.drain import Pids, Result, drain_connector, sample_until_done
from bench.stack import DevStack, dev_stack, listening_pid
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.bench, pytest.mark.timeout(7200)]

N = int(os.environ.get("CONVEYOR_BENCH_USERS_N", "400000"))
ROUNDS = int(os.environ.get("CONVEYOR_BENCH_USERS_ROUNDS", "2"))
LATENCY_RATE = int(os.environ.get("CONVEYOR_BENCH_LATENCY_RATE", "10000"))
LATENCY_S = float(os.environ.get("CONVEYOR_BENCH_LATENCY_S", "30"))
# Latency measurements per contender, one after another (each its own connector and table).
LATENCY_REPEATS = int(os.environ.get("CONVEYOR_BENCH_LATENCY_REPEATS", "1"))
# conveyor-<client>: the connector with that source.client (conveyor: the default client).
CONTENDERS = os.environ.get(
    "CONVEYOR_BENCH_CONTENDERS", "conveyor-confluent,conveyor-kafka-python,librdkafka,quixstreams"
).split(",")
OUT = os.environ.get("CONVEYOR_BENCH_OUT")  # also write the results as JSON here
# A directory: py-spy samples each Conveyor run process (collapsed stacks + a summary).
# Profiling costs CPU: figures of a profiled run are not the benchmark's.
PROFILE = os.environ.get("CONVEYOR_BENCH_PROFILE")
SCHEMA = "id BIGINT, name STRING, amount DOUBLE, ts BIGINT"
ROOT = Path(__file__).resolve().parent.parent


def produce(bootstrap: str, topic: str, n: int, *, rate: float | None = None) -> None:
    """``n`` orders with key = id, round robin over 2 partitions; ``ts`` = send time (ms)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, 2, 1)])
    for f in futures.values():
        f.result(30)
    p = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 5, "queue.buffering.max.messages": 1_000_000}
    )
    start = time.monotonic()
    for i in range(n):
        value = json.dumps(
            {"id": i, "name": f"name {i}", "amount": i * 0.5, "ts": int(time.time() * 1000)}
        )
        while True:
            try:
                p.produce(topic, key=str(i), value=value, partition=i % 2)
                break
            except BufferError:
                p.poll(0.05)
        if i % 1000 == 0:
            p.poll(0)
            if rate:
                delay = start + i / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
    assert p.flush(60) == 0


def create_table(pg_url: str, schema: str, table: str) -> None:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{schema}"."{table}" (id BIGINT, name TEXT, amount DOUBLE PRECISION,'
            " ts BIGINT, arrived TIMESTAMPTZ DEFAULT clock_timestamp())"
        )


def count(cur: Any, schema: str, table: str) -> int:
    cur.execute("SELECT to_regclass(%s)", (f'"{schema}"."{table}"',))
    if cur.fetchone()[0] is None:  # quixstreams creates its table on its first write
        return 0
    cur.execute(f'SELECT count(*) FROM "{schema}"."{table}"')
    return int(cur.fetchone()[0])


def watch(
    result: Result,
    pg_url: str,
    schema: str,
    table: str,
    pids: Pids,
    timeout: float = 900,
) -> Result:
    """Sample the table's row count, CPU and RSS every 0.2 s until all ``N`` rows are in."""
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            return sample_until_done(result, lambda: count(cur, schema, table), pids, timeout)
    finally:
        conn.close()


def client_of(contender: str) -> str | None:
    """The source client a Conveyor contender runs with (None: the default), or "" for others.

    ``conveyor-confluent:50000:200`` is that client with batches of up to 50,000 records
    closing 200 ms after their first record (for measuring batch policies); without
    ``:`` the connector's default batch policy."""
    if not contender.startswith("conveyor"):
        return ""
    contender = contender.partition("+")[0]
    return contender.partition("/")[0].partition(":")[0].partition("-")[2] or None


def depth_of(contender: str) -> dict[str, Any]:
    """``conveyor-confluent/d1``: that contender with ``transform.pipeline_depth`` 1."""
    depth = contender.partition("+")[0].partition("/")[2].removeprefix("d")
    return {"pipeline_depth": int(depth)} if depth else {}


def batch_of(contender: str) -> dict[str, Any]:
    records, _, wait = (
        contender.partition("+")[0].partition("/")[0].partition(":")[2].partition(":")
    )
    policy = {
        **({"max_records": int(records)} if records else {}),
        **({"max_wait_ms": int(wait)} if wait else {}),
    }
    return {"batch": policy} if policy else {}


def label_of(contender: str) -> str:
    """A contender as part of a table name."""
    contender, *levers = contender.split("+")
    base, _, depth = contender.partition("/")
    return (
        (client_of(contender) or "default").replace("-", "_")
        + ("_b" + base.partition(":")[2].replace(":", "_") if ":" in base else "")
        + (f"_{depth}" if depth else "")
        + "".join(f"_{lever}" for lever in levers)
    )


def levers_of(contender: str) -> list[str]:
    """``conveyor-confluent+arena2+q16384``: that contender with the memory levers of
    bench/memprobe (with ``CONVEYOR_BENCH_MEMPROBE`` set), ``qN``: librdkafka's
    ``queued.max.messages.kbytes`` N, ``mN``: its ``queued.min.messages`` N and ``fN``: its
    ``max.partition.fetch.bytes`` N KiB (through the spec's ``source.client_options``)."""
    return contender.split("+")[1:]


def source_options_of(contender: str) -> dict[str, Any]:
    names = {"q": "queued.max.messages.kbytes", "m": "queued.min.messages"}
    names["f"] = "max.partition.fetch.bytes"
    options = {
        names[lever[0]]: int(lever[1:]) * (1024 if lever[0] == "f" else 1)
        for lever in levers_of(contender)
        if lever[:1] in names and lever[1:].isdigit()
    }
    return {"client_options": options} if options else {}


def spec(
    name: str, topic: str, pg_url: str, schema: str, contender: str = "conveyor"
) -> dict[str, Any]:
    """What a user writes: defaults everywhere but the source, the decoding and the sink."""
    client = client_of(contender)
    return {
        "name": name,
        "desired": "stopped",
        **batch_of(contender),
        "source": {
            "topics": [topic],
            **({"client": client} if client else {}),
            **source_options_of(contender),
        },
        "transform": {"decode": "json", "schema": SCHEMA, **depth_of(contender)},
        "sink": {"type": "postgres", "url": pg_url, "schema": schema, "table": name},
    }


def run_conveyor(
    stack: DevStack, contender: str, name: str, pg_url: str, schema: str, jvm: int | None
) -> Result:
    memory.set_levers(levers_of(contender))
    result = Result(contender, time.monotonic(), N)
    return drain_connector(
        stack, result, name, jvm, lambda r, pids: watch(r, pg_url, schema, name, pids), PROFILE
    )


def run_script(
    contender: str, args: list[str], pg_url: str, schema: str, table: str, home: Path
) -> Result:
    script = {"librdkafka": "librdkafka_pg", "quixstreams": "quix_pg"}[contender]
    result = Result(contender, time.monotonic(), N)
    log = open(home / f"{contender}-{table}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", f"bench.contenders.{script}", *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        watch(result, pg_url, schema, table, lambda: {"process": proc.pid})
        if contender == "quixstreams":  # it runs until stopped
            proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert proc.returncode == 0, (home / f"{contender}-{table}.log").read_text()[-2000:]
    return result


def contender_args(
    contender: str, bootstrap: str, topic: str, pg_url: str, schema: str, table: str
) -> list[str]:
    group = f"g_{uuid.uuid4().hex[:8]}"
    if contender == "librdkafka":
        return [
            "--bootstrap", bootstrap, "--topic", topic, "--group", group, "--pg", pg_url,
            "--table", f'"{schema}"."{table}"', "--n", str(N),
        ]  # fmt: skip
    return [
        "--bootstrap", bootstrap, "--topic", topic, "--group", group, "--schema", schema,
        "--table", table,
    ]  # fmt: skip


def distinct_ids(pg_url: str, schema: str, table: str) -> int:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT count(DISTINCT id) FROM "{schema}"."{table}"')
        return int(cur.fetchone()[0])


def latencies_ms(pg_url: str, schema: str, table: str) -> tuple[float, float, int]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY l),"
            " percentile_cont(0.99) WITHIN GROUP (ORDER BY l), count(*) FROM"
            f' (SELECT extract(epoch FROM arrived) * 1000 - ts AS l FROM "{schema}"."{table}") x'
        )
        p50, p99, n = cur.fetchone()
        return float(p50), float(p99), int(n)


def test_connector_as_users_run_it_vs_librdkafka_and_quixstreams(
    tansu: str, warm_spark_remote: str, pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    rounds = [f"r{i}_{tag}" for i in range(ROUNDS)]
    conveyors = [c for c in CONTENDERS if client_of(c) != ""]
    table_of = {(c, r): f"conv_{label_of(c)}_{r}" for c in conveyors for r in rounds}
    latency_names = {
        (c, k): f"lat_{label_of(c)}_{tag}_{k}"
        for c in conveyors
        for k in range(LATENCY_REPEATS)
        if LATENCY_S > 0
    }
    specs = [spec(n, f"t_{n}", pg_url, pg_schema, c) for (c, _), n in table_of.items()] + [
        spec(n, f"t_{n}", pg_url, pg_schema, c) for (c, _), n in latency_names.items()
    ]
    jvm = listening_pid(int(warm_spark_remote.rsplit(":", 1)[1]))
    results: dict[str, list[Result]] = {c: [] for c in CONTENDERS}
    loads: list[tuple[int, str, tuple[float, float, float]]] = []  # after each drain
    memory.probe_env()
    with dev_stack(tmp_path / "home", tansu, warm_spark_remote, specs) as stack:
        wait_for(lambda: len(stack.store.list()) == len(specs), 120, "specs synced")
        for i, r in enumerate(rounds):
            order = CONTENDERS if i % 2 == 0 else list(reversed(CONTENDERS))
            for contender in order:
                table = table_of.get((contender, r), f"{contender}_{r}")
                topic = f"t_{table}"
                if contender != "quixstreams":  # it creates its own, with its columns
                    create_table(pg_url, pg_schema, table)
                produce(tansu, topic, N)
                if contender in conveyors:
                    res = run_conveyor(stack, contender, table, pg_url, pg_schema, jvm)
                else:
                    args = contender_args(contender, tansu, topic, pg_url, pg_schema, table)
                    res = run_script(contender, args, pg_url, pg_schema, table, tmp_path)
                assert distinct_ids(pg_url, pg_schema, table) == N, (contender, r)
                results[contender].append(res)
                loads.append((i + 1, contender, os.getloadavg()))
                print(
                    f"round {i + 1} {contender:<11} load {os.getloadavg()} steady {res.steady_rate():>9,.0f} rows/s"
                    f"  total {res.total_rate():>9,.0f}  cpu/100K {res.cpu_per_100k()}"
                    f"  with start-up {res.cpu_per_100k_total()}"
                    f"  peak RSS MB {res.peak_rss_mb()}"
                )
                if memory.PROBE:
                    res.memory = memory.summary(res.run_pid)
                    print(memory.describe(res.memory))
        latency: dict[str, list[tuple[float, float, int, float]]] = {}
        for k in range(LATENCY_REPEATS if LATENCY_S > 0 else 0):
            for c in conveyors:
                measured = conveyor_latency(
                    stack, latency_names[c, k], tansu, pg_url, pg_schema, jvm
                )
                latency.setdefault(c, []).append(measured)
            if "librdkafka" in CONTENDERS:
                measured = script_latency(tansu, pg_url, pg_schema, tmp_path)
                latency.setdefault("librdkafka", []).append(measured)
    report(results, latency, loads)


def conveyor_latency(
    stack: DevStack, name: str, bootstrap: str, pg_url: str, schema: str, jvm: int | None
) -> tuple[float, float, int, float]:
    """p50, p99 (ms), rows, and the run process's peak RSS (MB) at a steady rate."""
    create_table(pg_url, schema, name)
    produce(bootstrap, f"t_{name}", 1)  # the topic exists before the connector starts
    stack.cli("connector", "start", name)
    wait_for(
        lambda: (
            stack.store.get(name).status.value == "Running"
            and distinct_ids(pg_url, schema, name) == 1
        ),
        180,
        "latency connector running",
    )
    run = psutil.Process(stack.store.get(name).run_pid)
    peak = [0]

    def sample() -> None:
        while not done.is_set():
            with contextlib.suppress(psutil.Error):
                peak[0] = max(peak[0], run.memory_info().rss)
            done.wait(0.2)

    done = threading.Event()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        steady_produce(bootstrap, f"t_{name}")
        n = 1 + int(LATENCY_RATE * LATENCY_S)
        wait_for(lambda: distinct_ids(pg_url, schema, name) >= n, 120, "latency rows")
    finally:
        done.set()
        sampler.join()
    stack.cli("connector", "stop", name)
    return (*latencies_ms(pg_url, schema, name), peak[0] / 2**20)


def steady_produce(bootstrap: str, topic: str) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    n = int(LATENCY_RATE * LATENCY_S)
    start = time.monotonic()
    for i in range(1, n + 1):
        value = json.dumps(
            {"id": i, "name": f"name {i}", "amount": i * 0.5, "ts": int(time.time() * 1000)}
        )
        p.produce(topic, key=str(i), value=value, partition=i % 2)
        if i % 100 == 0:
            p.poll(0)
            delay = start + i / LATENCY_RATE - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    assert p.flush(60) == 0


def script_latency(
    bootstrap: str, pg_url: str, schema: str, home: Path
) -> tuple[float, float, int, float]:
    table = f"lat_librdkafka_{uuid.uuid4().hex[:6]}"
    topic = f"t_{table}"
    create_table(pg_url, schema, table)
    produce(bootstrap, topic, 1)
    n = 1 + int(LATENCY_RATE * LATENCY_S)
    args = contender_args("librdkafka", bootstrap, topic, pg_url, schema, table)
    args[args.index("--n") + 1] = str(n)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.contenders.librdkafka_pg", *args], cwd=ROOT
    )
    peak = 0
    try:
        wait_for(lambda: distinct_ids(pg_url, schema, table) == 1, 120, "librdkafka loop joined")
        steady_produce(bootstrap, topic)
        with contextlib.suppress(psutil.Error):
            peak = psutil.Process(proc.pid).memory_info().rss
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return (*latencies_ms(pg_url, schema, table), peak / 2**20)


def report(
    results: dict[str, list[Result]],
    latency: dict[str, list[tuple[float, float, int, float]]],
    loads: list[tuple[int, str, tuple[float, float, float]]] | None = None,
) -> None:
    """The issue's table (markdown, printed; JSON to $CONVEYOR_BENCH_OUT): per contender the
    median and every round of steady and start-up-included rows/s, CPU s per 100K rows per
    process (over the steady window, and start-up included: ``drain.Result.cpu_per_100k_total``), peak RSS per process, p50/p99 latency at a steady rate (each measurement), every round's ratio
    against the librdkafka loop."""

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    base = results.get("librdkafka")
    out: dict[str, Any] = {
        "n": N,
        "rounds": ROUNDS,
        "commit": commit,
        "loadavg": os.getloadavg(),
        "loadavg_per_drain": loads or [],
        "latency_rate": LATENCY_RATE,
        "contenders": {},
    }
    lines = [
        f"as users run it: {N:,} messages, {ROUNDS} rounds, commit {commit},"
        f" load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        "",
        "| contender | steady rows/s (median; rounds) | start-up included rows/s | CPU s per 100K rows"
        " | the same, start-up included | peak RSS MB | latency p50 / p99 ms | steady ratio vs"
        " librdkafka (rounds) | start-up included ratio | CPU per row, start-up and JVM included,"
        " vs librdkafka (rounds) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, rs in results.items():
        steady = [r.steady_rate() for r in rs]
        total = [r.total_rate() for r in rs]
        cpu = {k: med([r.cpu_per_100k().get(k, 0.0) for r in rs]) for k in rs[0].cpu_per_100k()}
        cpu_all = {
            k: med([r.cpu_per_100k_total().get(k, 0.0) for r in rs])
            for k in rs[0].cpu_per_100k_total()
        }
        rss = {k: max(r.peak_rss_mb().get(k, 0.0) for r in rs) for k in rs[0].peak_rss_mb()}
        ratios = totals = cpus = []
        if base and c != "librdkafka":
            ratios = [a.steady_rate() / b.steady_rate() for a, b in zip(rs, base, strict=True)]
            totals = [a.total_rate() / b.total_rate() for a, b in zip(rs, base, strict=True)]
            cpus = [a.cpu_total() / b.cpu_total() for a, b in zip(rs, base, strict=True)]
        lat = latency.get(c)
        out["contenders"][c] = {
            "steady": steady,
            "total": total,
            "cpu_per_100k": cpu,
            "cpu_per_100k_with_start_up": cpu_all,
            "peak_rss_mb": rss,
            "latency_p50_p99_rows_rssmb": lat,
            "steady_ratio": ratios,
            "total_ratio": totals,
            "cpu_total_ratio": cpus,
            "memory": [r.memory for r in rs],
        }
        lines.append(
            f"| {c} | {med(steady):,.0f} ({', '.join(f'{x:,.0f}' for x in steady)})"
            f" | {med(total):,.0f} ({', '.join(f'{x:,.0f}' for x in total)})"
            f" | {', '.join(f'{k} {v:.2f}' for k, v in cpu.items())}"
            f" | {', '.join(f'{k} {v:.2f}' for k, v in cpu_all.items())}"
            f" | {', '.join(f'{k} {v:.0f}' for k, v in rss.items())}"
            f" | {'; '.join(f'{x[0]:.0f} / {x[1]:.0f}' for x in lat) if lat else '-'}"
            f" | {', '.join(f'{x:.2f}' for x in ratios) or '-'}"
            f" | {', '.join(f'{x:.2f}' for x in totals) or '-'}"
            f" | {', '.join(f'{x:.2f}' for x in cpus) or '-'} |"
        )
    print("\n" + "\n".join(lines))
    if OUT:
        Path(OUT).write_text(json.dumps(out, indent=2))
