"""Shared parts of the whole-connector benchmarks: a backlog, the two loops, the figures.

Both loops drain the same kind of backlog (N JSON messages on 2 partitions of a fresh
tansu topic, produced before the clock starts) in batches of ``BATCH``:

- the **connector**: the real loop (``core/engine/loop.py``) with the Kafka source, the Spark
  Connect transform (``decode: json`` with the schema), the sink under test, and the
  fenced commit in a SQLite meta store;
- the **bare loop**: what a hand-written consumer does. kafka-python ``poll`` on the
  topic's partitions (assigned by hand, like the connector), ``json.loads`` of each
  value, the same writes with the same client library, then ``consumer.commit()``
  to its consumer group.

Each records the time of every commit and the messages acknowledged so far. Two figures
come out of that:

- **steady** msgs/s: from the first commit at or past ``WARMUP`` of the backlog to the
  last, i.e. without start-up (group join, Spark session, sink connections), which a
  long-running connector pays once;
- **total** msgs/s: N over the whole run, start-up included.

The Spark Connect server is warmed up first (``warm_spark``: the transform on a
synthetic 10,000-message batch for ``SPARK_WARMUP_S`` seconds, once per session).
A server in production runs for days and its JIT has long compiled the hot paths; a
fresh JVM here needs about a minute of work before a batch costs what it will cost
(docs/BENCHMARKS.md gives both figures). Then each benchmark runs one round of both
loops that is not counted (imports, connections), then ``ROUNDS`` rounds
alternating which loop goes first, each run on a fresh topic and target, and reports
the median of the per-round ratios with every round's ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

N = int(os.environ.get("CONVEYOR_BENCH_MESSAGES", "200000"))
BATCH = int(os.environ.get("CONVEYOR_BENCH_BATCH", "10000"))
ROUNDS = int(os.environ.get("CONVEYOR_BENCH_ROUNDS", "3"))
WARMUP = float(os.environ.get("CONVEYOR_BENCH_WARMUP", "0.2"))  # share of the backlog
SCHEMA = "id BIGINT, name STRING, amount DOUBLE"
PARTITIONS = 2
SPARK_WARMUP_S = float(os.environ.get("CONVEYOR_BENCH_SPARK_WARMUP_S", "60"))


def order(i: int) -> dict[str, Any]:
    return {"id": i, "name": f"name {i}", "amount": i * 0.5}


def produce(
    bootstrap: str, topic: str, n: int, *, rate: float | None = None, create: bool = True
) -> None:
    """``n`` JSON orders (key = id) round-robin over the topic's partitions."""
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    if create:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
        admin.close()
    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=256 * 1024)
    start = time.monotonic()
    for i in range(n):
        p.send(
            topic,
            key=str(i).encode(),
            value=json.dumps(order(i)).encode(),
            partition=i % PARTITIONS,
        )
        if rate:
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    p.flush()
    p.close()


def synthetic_batch(
    n: int, topic: str = "warm", payload: Callable[[int], dict[str, Any]] = order
) -> Any:
    """``n`` JSON messages ``payload(i)`` on ``PARTITIONS`` partitions, as the source hands
    a batch to the transform (``records_to_table``)."""
    from conveyor.brokers.kafka import records_to_table

    return records_to_table(
        [
            SimpleNamespace(
                topic=topic,
                partition=i % PARTITIONS,
                offset=i,
                timestamp=1_700_000_000_000,
                key=str(i).encode(),
                headers=[],
                value=json.dumps(payload(i)).encode(),
            )
            for i in range(n)
        ]
    )


def warm_spark(spark: Any, seconds: float = SPARK_WARMUP_S) -> tuple[int, float, float]:
    """Run the benchmark's transform on synthetic batches for ``seconds``, in turn one of
    ``BATCH`` messages and one of the default batch's size (``batch.max_records``): from
    ``ONE_ROW_FROM`` rows a batch crosses to Spark as one row, a query of its own to warm.

    Returns (queries, first query ms, median ms of the last 50 ``BATCH``-message ones)."""
    from conveyor.core.model import BatchPolicy, TransformSpec
    from conveyor.spark.transform import SparkTransformer

    batches = [synthetic_batch(BATCH), synthetic_batch(BatchPolicy().max_records)]
    transform = SparkTransformer(TransformSpec(decode="json", schema=SCHEMA), spark)
    transform.prepare()
    times: list[float] = []
    queries = 0
    deadline = time.monotonic() + seconds
    while not times or time.monotonic() < deadline:
        for batch in batches:
            t = time.monotonic()
            assert transform(batch).table.num_rows == batch.num_rows
            queries += 1
            if batch is batches[0]:
                times.append((time.monotonic() - t) * 1000)
    return queries, times[0], statistics.median(times[-50:])


def new_topic() -> str:
    return f"bench_{uuid.uuid4().hex[:8]}"


@dataclass
class Run:
    """Commit times of one loop's run and the messages acknowledged at each."""

    n: int
    started: float = field(default_factory=time.monotonic)
    marks: list[tuple[float, int]] = field(default_factory=list)

    def mark(self, acked: int) -> None:
        self.marks.append((time.monotonic(), acked))

    @property
    def done(self) -> bool:
        return bool(self.marks) and self.marks[-1][1] >= self.n

    def total_rate(self) -> float:
        return self.marks[-1][1] / (self.marks[-1][0] - self.started)

    def steady_rate(self) -> float:
        t0, n0 = next(m for m in self.marks if m[1] >= WARMUP * self.n)
        t1, n1 = self.marks[-1]
        if n1 == n0:
            raise AssertionError("the backlog went through in one commit: raise N")
        return (n1 - n0) / (t1 - t0)


def run_bare(
    bootstrap: str, topic: str, n: int, write: Callable[[list[dict[str, Any]], list[Any]], None]
) -> Run:
    """kafka-python -> ``json.loads`` -> ``write(rows, records)`` -> commit to its group.

    Partitions are assigned by hand, as the connector does (a group join would add
    seconds of start-up that are not the loop's cost)."""
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KTP

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=f"bare_{uuid.uuid4().hex[:6]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=BATCH,
        fetch_max_bytes=64 << 20,
        max_partition_fetch_bytes=16 << 20,
    )
    parts = [KTP(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
    assert parts, f"topic {topic} has no partitions"
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    run = Run(n)
    done = 0
    try:
        while done < n:
            polled = consumer.poll(timeout_ms=200, max_records=BATCH)
            records = [r for rs in polled.values() for r in rs]
            if not records:
                continue
            write([json.loads(r.value) for r in records], records)
            consumer.commit()
            done += len(records)
            run.mark(done)
    finally:
        consumer.close()
    return run


def run_connector(
    bootstrap: str,
    spark: Any,
    sink_config: dict[str, Any],
    topic: str,
    n: int,
    tmp_path: Path,
    *,
    wrap_sink: Callable[[Any], Any] = lambda s: s,
    max_wait_ms: int = 200,
) -> Run:
    """The real connector loop on ``topic`` into ``sink_config`` until ``n`` are committed."""
    from conveyor.brokers.kafka import KafkaSource
    from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, run_loop
    from conveyor.core.model import BatchPolicy, SourceSpec, TransformSpec
    from conveyor.dagster.jobs.committer import StoreCommitter
    from conveyor.sinks import build_sink
    from conveyor.spark.transform import SparkTransformer
    from conveyor.store.meta import MetaStore

    name = f"bench_{uuid.uuid4().hex[:6]}"
    store = MetaStore(f"sqlite:///{tmp_path / f'meta-{name}.db'}")
    store.sync_spec(name, spec_json="{}", spec_hash="x", source="bench", error=None)
    claim = store.claim(
        name, run_id="bench", expected_generation=None, holder_alive=lambda r: False
    )
    source = KafkaSource(SourceSpec(topics=[topic], bootstrap_servers=bootstrap), group_id=name)
    run = Run(n)

    class Committer(StoreCommitter):
        def commit(self, offsets):  # type: ignore[no-untyped-def]
            super().commit(offsets)
            run.mark(sum({**loop.committed, **offsets}.values()))  # offsets from 0: a count

    committer = Committer(store, name, claim.generation, source)
    loop = ConnectorLoop(
        LoopConfig(
            name=name,
            batch=BatchPolicy(max_records=BATCH, max_wait_ms=max_wait_ms),
            progress_interval_s=3600,
        ),
        source=source,
        transform=SparkTransformer(TransformSpec(decode="json", schema=SCHEMA), spark),
        sink=wrap_sink(build_sink(sink_config)),
        committer=committer,
        committed={},
        stop_requested=lambda: run.done,
    )
    run.started = time.monotonic()
    run_loop(loop)
    return run


@dataclass
class Comparison:
    """Per-round figures of the two loops; the median ratio is the headline."""

    title: str
    rounds: list[dict[str, Run]] = field(default_factory=list)

    def ratios(self, kind: str) -> list[float]:
        rate = Run.steady_rate if kind == "steady" else Run.total_rate
        return [rate(r["connector"]) / rate(r["bare"]) for r in self.rounds]

    def median(self, label: str, kind: str) -> float:
        rate = Run.steady_rate if kind == "steady" else Run.total_rate
        return statistics.median(rate(r[label]) for r in self.rounds)

    def report(self) -> str:
        lines = [f"{self.title}: {N:,} messages, batches of {BATCH:,}, {len(self.rounds)} rounds"]
        for label in ("bare", "connector"):
            lines.append(
                f"  {label:<9} steady {self.median(label, 'steady'):>9,.0f} msgs/s"
                f"   total {self.median(label, 'total'):>9,.0f} msgs/s (start-up included)"
            )
        for kind in ("steady", "total"):
            rs = self.ratios(kind)
            lines.append(
                f"  connector / bare, {kind:<6}: median {statistics.median(rs):.2f}"
                f"  (rounds: {', '.join(f'{r:.2f}' for r in rs)})"
            )
        return "\n".join(lines)


def compare(
    title: str,
    bare: Callable[[], Run],
    connector: Callable[[], Run],
    check: Callable[[str], None],
) -> Comparison:
    """A warm-up round, then ``ROUNDS`` alternating ones; ``check(label)`` asserts the
    target after each run (the warm-up's too)."""
    for label, run in (("bare", bare), ("connector", connector)):
        run()
        check(label)
    result = Comparison(title)
    for i in range(ROUNDS):
        runs: dict[str, Run] = {}
        order = ("bare", "connector") if i % 2 == 0 else ("connector", "bare")
        for label in order:
            runs[label] = bare() if label == "bare" else connector()
            check(label)
        result.rounds.append(runs)
    return result
