"""Benchmark: the MySQL, Redis and Kafka sinks as users run them, against bare librdkafka loops.

Issue 18's method (bench/test_bench_as_users_run_it.py, PostgreSQL) for the other
sinks. Per sink, two contenders drain the same backlog (``N`` JSON orders ``id``,
``name``, ``amount``, ``ts`` on 2 partitions of a fresh tansu topic, produced before the
clock starts) into a fresh target:

- **conveyor**: a connector spec with default settings (the source, the decoding and the
  sink's required fields only), desired stopped, in a ``dagster dev`` stack;
  ``conveyor connector start`` starts the clock, the scheduler sensor launches the run,
  progress events are on; ``conveyor/dN``: the same with ``transform.pipeline_depth`` N,
  ``conveyor+lever``: with a lever of bench/memprobe (``CONVEYOR_BENCH_MEMPROBE`` set)
  or a librdkafka source option (``+fN``, ``+mN``, ``+qN``, as in
  bench/test_bench_as_users_run_it.py);
- **librdkafka**: bench/contenders/librdkafka_{mysql,redis,kafka}.py, the 30-line
  confluent-kafka loop (``consume(10000)``, ``json.loads``, the sink's writes with its
  default settings, commit per batch, one thread).

The targets: a MySQL table created beforehand (plain INSERT, the sink's default), rows
counted with ``count(*)``; ``HSET <prefix>:<id> name .. amount .. ts ..`` in a Redis
database of its own (counted with ``DBSIZE``); a Kafka topic of 2 partitions, counted by
a consumer reading it from the start, at most four ``consume`` calls of 50,000 per
sample, not decoded (tansu answers ListOffsets from record batches, not records:
docs/DESIGN.md), its ids and the record of id 7 read again afterwards. Every 0.2 s;
**steady** rows/s is between 20% and 90% of ``N``. CPU seconds per 100,000 rows over the
steady window per process (Conveyor's run process and the Spark Connect JVM; the loop's
process); peak RSS. Each round alternates
the order. Afterwards every target must hold exactly ``N`` distinct ids (the benchmark
fails if rows are lost).

    PYTHONPATH=. CONVEYOR_BENCH_OUT=results.json .venv/bin/python -m pytest \
        bench/test_bench_sinks_as_users_run_it.py -m bench -s -n 0
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from bench import memory
from bench.drain import Pids, Result, drain_connector, sample_until_done
from bench.stack import DevStack, dev_stack, listening_pid
from bench.test_bench_as_users_run_it import (
    SCHEMA,
    batch_of,
    depth_of,
    levers_of,
    produce,
    source_options_of,
)
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.bench, pytest.mark.timeout(7200)]

N = int(os.environ.get("CONVEYOR_BENCH_SINKS_N", "200000"))
ROUNDS = int(os.environ.get("CONVEYOR_BENCH_SINKS_ROUNDS", "2"))
SINKS = os.environ.get("CONVEYOR_BENCH_SINKS", "mysql,redis,kafka").split(",")
OUT = os.environ.get("CONVEYOR_BENCH_OUT")
# A directory: py-spy samples each Conveyor run process from 20% of the rows to the end
# (collapsed stacks + a per-thread summary). Figures of a profiled run are not the benchmark's.
PROFILE = os.environ.get("CONVEYOR_BENCH_PROFILE")
MYSQL = {"host": "127.0.0.1", "port": 3306, "user": "root", "database": "test"}
MYSQL_URL = os.environ.get("CONVEYOR_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
ROOT = Path(__file__).resolve().parent.parent
# "conveyor:10000" is the connector with batches of up to 10,000 records (and
# "conveyor:10000:200" closing 200 ms after the first), as in bench_as_users_run_it.
CONTENDERS = tuple(
    os.environ.get("CONVEYOR_BENCH_SINKS_CONTENDERS", "conveyor,librdkafka").split(",")
)
# The Kafka sink's clients to run side by side ("confluent,kafka-python"): one Conveyor
# contender per client, conveyor-<client>, in the same rounds; empty: the default client.
KAFKA_CLIENTS = [c for c in os.environ.get("CONVEYOR_BENCH_KAFKA_CLIENTS", "").split(",") if c]


def contenders(sink: str) -> tuple[str, ...]:
    if sink == "kafka" and KAFKA_CLIENTS:
        return (*(f"conveyor-{c}" for c in KAFKA_CLIENTS), "librdkafka")
    return CONTENDERS


# -- targets ------------------------------------------------------------------------------------


class Target(abc.ABC):
    """One fresh target of a sink: the connector's sink config, the loop's arguments, a row
    counter (polled), the distinct ids written (afterwards), a cleanup."""

    @abc.abstractmethod
    def sink(self) -> dict[str, Any]:
        raise NotImplementedError

    @abc.abstractmethod
    def loop_args(self) -> list[str]:
        raise NotImplementedError

    def create(self) -> None:  # noqa: B027 - optional: most targets need nothing made
        return None

    @abc.abstractmethod
    def count(self) -> int:
        raise NotImplementedError

    @abc.abstractmethod
    def distinct_ids(self) -> tuple[int, int]:
        """(rows, distinct ids) in the target."""
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - optional: most targets hold nothing open
        return None


class MySQLTarget(Target):
    def __init__(self, name: str):
        import pymysql

        self.table = name
        self.conn = pymysql.connect(**MYSQL, autocommit=True)

    def sink(self) -> dict[str, Any]:
        return {"type": "mysql", "url": MYSQL_URL, "table": self.table}

    def loop_args(self) -> list[str]:
        return ["--table", self.table]

    def create(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute(
                f"CREATE TABLE `{self.table}` (id BIGINT, name VARCHAR(255), amount DOUBLE,"
                " ts BIGINT) ENGINE=InnoDB"
            )

    def count(self) -> int:
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT count(*) FROM `{self.table}`")
            return int(cur.fetchone()[0])

    def distinct_ids(self) -> tuple[int, int]:
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT count(*), count(DISTINCT id) FROM `{self.table}`")
            rows, ids = cur.fetchone()
            return int(rows), int(ids)

    def close(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute(f"DROP TABLE IF EXISTS `{self.table}`")
        self.conn.close()


def free_redis_db() -> int:
    """An empty Redis database (15 down to 1): the runs' keys are counted with DBSIZE."""
    import redis

    for db in range(15, 0, -1):
        r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=db)
        try:
            if r.dbsize() == 0:
                return db
        finally:
            r.close()
    raise RuntimeError("no empty Redis database")


class RedisTarget(Target):
    def __init__(self, name: str, db: int):
        import redis

        self.prefix, self.db = name, db
        self.r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=db)

    def sink(self) -> dict[str, Any]:
        return {
            "type": "redis",
            "host": REDIS_HOST,
            "port": REDIS_PORT,
            "db": self.db,
            "commands": [
                f"HSET {self.prefix}:${{payload.id}} name ${{payload.name}}"
                " amount ${payload.amount} ts ${payload.ts}"
            ],
        }

    def loop_args(self) -> list[str]:
        return ["--port", str(REDIS_PORT), "--db", str(self.db), "--prefix", self.prefix]

    def create(self) -> None:
        assert self.r.dbsize() == 0, f"Redis db {self.db} is not empty"

    def count(self) -> int:
        return int(self.r.dbsize())

    def distinct_ids(self) -> tuple[int, int]:
        keys = list(self.r.scan_iter(f"{self.prefix}:*", count=10_000))
        ids = {int(k.rsplit(b":", 1)[1]) for k in keys}
        assert self.r.hmget(f"{self.prefix}:7", "name", "amount") == [b"name 7", b"3.5"]
        return len(keys), len(ids & set(range(N)))

    def close(self) -> None:
        self.r.flushdb()  # its own database (free_redis_db)
        self.r.close()


class KafkaTarget(Target):
    def __init__(self, name: str, bootstrap: str, client: str | None = None):
        self.topic, self.bootstrap, self.client = f"out_{name}", bootstrap, client
        self.rows = 0
        self.consumer: Any = None

    def sink(self) -> dict[str, Any]:
        client = {"client": self.client} if self.client else {}
        return {"type": "kafka", "bootstrap_servers": self.bootstrap, "topic": self.topic, **client}

    def loop_args(self) -> list[str]:
        return ["--target", self.topic]

    def create(self) -> None:
        from confluent_kafka import Consumer, TopicPartition
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for f in admin.create_topics([NewTopic(self.topic, 2, 1)]).values():
            f.result(30)
        self.consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"count_{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 50,
            }
        )
        self.consumer.assign([TopicPartition(self.topic, p, 0) for p in (0, 1)])

    def count(self) -> int:
        """Records read from the topic so far: at most four ``consume`` calls per sample
        (looping until the topic was drained kept the sampler in here for a whole drain
        while it was being written). Not the high watermarks: tansu's ListOffsets answers
        the last batch's first offset (below the end by a batch), partition-EOF events the
        end."""
        for _ in range(4):
            msgs = self.consumer.consume(50_000, timeout=0.05)
            self.rows += sum(1 for m in msgs if m.error() is None)
            if len(msgs) < 50_000:
                break
        return self.rows

    def distinct_ids(self) -> tuple[int, int]:
        """Every record in the topic (read again from the start to both partitions' ends)
        and the ids among them."""
        from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

        reader = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"ids_{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
            }
        )
        reader.assign([TopicPartition(self.topic, p, 0) for p in (0, 1)])
        rows, ids, ends = 0, set(), set()
        seven: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        try:
            while len(ends) < 2 and time.monotonic() < deadline:
                for m in reader.consume(50_000, timeout=1):
                    err = m.error()
                    if err is not None and err.code() == KafkaError._PARTITION_EOF:
                        ends.add(m.partition())
                        continue
                    if err is not None:
                        raise KafkaException(err)
                    rows += 1
                    row = json.loads(m.value())
                    ids.add(row["id"])
                    if row["id"] == 7:
                        seven = row
        finally:
            reader.close()
        assert len(ends) == 2, f"{self.topic}: not read to its end in 120 s"
        assert (seven["name"], seven["amount"]) == ("name 7", 3.5), seven
        return rows, len(ids & set(range(N)))

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()


# -- measuring ----------------------------------------------------------------------------------


#: Servers whose CPU is sampled with each contender's ("broker": tansu; "target": the
#: sink's server, where it is another process): on a 2-vCPU machine what the contender
#: leaves them decides whether the machine, not the contender, is the limit.
SERVERS: dict[str, int] = {}


def watch(result: Result, target: Target, pids: Pids, timeout: float = 900) -> Result:
    """Sample the target's row count, CPU and RSS every 0.2 s until all ``N`` rows are in."""
    return sample_until_done(result, target.count, lambda: {**pids(), **SERVERS}, timeout)


def servers(bootstrap: str, sink: str) -> dict[str, int]:
    """The pids of tansu and of the sink's server (MySQL, Redis) on this machine."""
    ports = {"broker": int(bootstrap.rsplit(":", 1)[1])}
    if sink in ("mysql", "redis"):
        ports["target"] = MYSQL["port"] if sink == "mysql" else REDIS_PORT
    found = {k: listening_pid(port) for k, port in ports.items()}
    return {k: pid for k, pid in found.items() if pid}


def spec(name: str, target: Target, contender: str = "conveyor") -> dict[str, Any]:
    """What a user writes: defaults everywhere but the source, the decoding and the sink."""
    return {
        "name": name,
        "desired": "stopped",
        **batch_of(contender),
        "source": {"topics": [f"t_{name}"], **source_options_of(contender)},
        "transform": {"decode": "json", "schema": SCHEMA, **depth_of(contender)},
        "sink": target.sink(),
    }


def run_conveyor(
    stack: DevStack,
    sink: str,
    name: str,
    target: Target,
    jvm: int | None,
    contender: str = "conveyor",
) -> Result:
    memory.set_levers(levers_of(contender))
    result = Result(contender, time.monotonic(), N, sink=sink)
    return drain_connector(
        stack, result, name, jvm, lambda r, pids: watch(r, target, pids), PROFILE
    )


def run_loop(sink: str, name: str, target: Target, bootstrap: str, home: Path) -> Result:
    result = Result("librdkafka", time.monotonic(), N, sink=sink)
    log_path = home / f"librdkafka-{name}.log"
    args = [
        "--bootstrap", bootstrap, "--topic", f"t_{name}", "--group", f"g_{name}",
        "--n", str(N), *target.loop_args(),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"bench.contenders.librdkafka_{sink}", *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            watch(result, target, lambda: {"process": proc.pid})
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, log_path.read_text()[-2000:]
    return result


def test_sinks_as_users_run_them_vs_librdkafka_loops(
    tansu: str, warm_spark_remote: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    rounds = [f"r{i}_{tag}" for i in range(ROUNDS)]
    db = free_redis_db() if "redis" in SINKS else 0

    def make(sink: str, contender: str, name: str) -> Target:
        if sink == "mysql":
            return MySQLTarget(name)
        if sink == "redis":
            return RedisTarget(name, db)
        client = contender.removeprefix("conveyor-") if contender.startswith("conveyor-") else None
        return KafkaTarget(name, tansu, client)

    names = {
        (
            s,
            c,
            r,
        ): f"{s}_{c.replace('-', '_').replace(':', '_').replace('/', '_').replace('+', '_')}_{r}"
        for s in SINKS
        for c in contenders(s)
        for r in rounds
    }
    targets = {k: make(k[0], k[1], n) for k, n in names.items()}
    specs = [spec(names[k], t, k[1]) for k, t in targets.items() if k[1].startswith("conveyor")]
    jvm = listening_pid(int(warm_spark_remote.rsplit(":", 1)[1]))
    results: dict[str, dict[str, list[Result]]] = {s: {c: [] for c in contenders(s)} for s in SINKS}
    try:
        with dev_stack(tmp_path / "home", tansu, warm_spark_remote, specs) as stack:
            wait_for(lambda: len(stack.store.list()) == len(specs), 120, "specs synced")
            for i, r in enumerate(rounds):
                for sink in SINKS:
                    order = contenders(sink) if i % 2 == 0 else contenders(sink)[::-1]
                    for contender in order:
                        name, target = names[sink, contender, r], targets[sink, contender, r]
                        target.create()
                        produce(tansu, f"t_{name}", N)
                        SERVERS.clear()
                        SERVERS.update(servers(tansu, sink))
                        if contender.startswith("conveyor"):
                            res = run_conveyor(stack, sink, name, target, jvm, contender)
                        else:
                            res = run_loop(sink, name, target, tansu, tmp_path)
                        res.loadavg = os.getloadavg()
                        rows, ids = target.distinct_ids()
                        res.rows = rows
                        target.close()
                        assert ids == N, (sink, contender, r, rows, ids)
                        results[sink][contender].append(res)
                        print(
                            f"round {i + 1} {sink:<5} {contender:<22} steady"
                            f" {res.steady_rate():>9,.0f} rows/s  total {res.total_rate():>9,.0f}"
                            f"  rows {rows:,} ids {ids:,}  cpu/100K"
                            f" { ({k: round(v, 2) for k, v in res.cpu_per_100k().items()}) }"
                            f"  peak RSS MB"
                            f" { ({k: round(v) for k, v in res.peak_rss_mb().items()}) }"
                            f"  load {' '.join(f'{x:.1f}' for x in res.loadavg)}",
                            flush=True,
                        )
    finally:
        for t in targets.values():
            with contextlib.suppress(Exception):  # best effort (a target closed twice)
                t.close()
    report(results)


def report(results: dict[str, dict[str, list[Result]]]) -> None:
    """Per sink and contender: steady rows/s per round, the ratio against the loop of the
    same round, CPU s per 100K rows per process (median), peak RSS, load averages."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    out: dict[str, Any] = {"n": N, "rounds": ROUNDS, "commit": commit, "sinks": {}}
    lines = [
        f"sinks as users run them: {N:,} messages, {ROUNDS} rounds, commit {commit}",
        "",
        "| sink | contender | steady rows/s (rounds) | ratio vs its librdkafka loop (rounds)"
        " | start-up included rows/s (rounds) | CPU s per 100K rows | peak RSS MB"
        " | load average (rounds) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sink, per in results.items():
        base = per["librdkafka"]
        out["sinks"][sink] = {}
        for c, rs in per.items():
            if not rs:
                continue
            steady = [x.steady_rate() for x in rs]
            total = [x.total_rate() for x in rs]
            ratios = (
                [a.steady_rate() / b.steady_rate() for a, b in zip(rs, base, strict=True)]
                if c != "librdkafka"
                else []
            )
            keys = rs[0].cpu_per_100k()
            cpu = {k: statistics.median([x.cpu_per_100k().get(k, 0.0) for x in rs]) for k in keys}
            rss = {k: max(x.peak_rss_mb().get(k, 0.0) for x in rs) for k in rs[0].peak_rss_mb()}
            loads = [x.loadavg[0] for x in rs]
            out["sinks"][sink][c] = {
                "steady": steady,
                "total": total,
                "steady_ratio": ratios,
                "cpu_per_100k": cpu,
                "peak_rss_mb": rss,
                "loadavg": [x.loadavg for x in rs],
                "rows": [x.rows for x in rs],
            }
            lines.append(
                f"| {sink} | {c} | {', '.join(f'{x:,.0f}' for x in steady)}"
                f" | {', '.join(f'{x:.2f}' for x in ratios) or '-'}"
                f" | {', '.join(f'{x:,.0f}' for x in total)}"
                f" | {', '.join(f'{k} {v:.2f}' for k, v in cpu.items())}"
                f" | {', '.join(f'{k} {v:.0f}' for k, v in rss.items())}"
                f" | {', '.join(f'{x:.1f}' for x in loads)} |"
            )
    print("\n" + "\n".join(lines))
    if OUT:
        Path(OUT).write_text(json.dumps(out, indent=2))
