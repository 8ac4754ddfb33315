"""Partition-task planner cost: split and merge decision time for 1,000 connectors.

Run: python -m pytest bench/test_bench_tasks.py -m bench -s -n 0
Figures are printed and, when $CONVEYOR_BENCH_OUT is set, appended to that JSON-lines file.
Throughput with 1, 2 and 3 tasks is measured end to end by tests/e2e/test_tasks_e2e.py's
setting (see docs/BENCHMARKS.md); this file measures the pure planner only.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import pytest

from bench.test_bench_scheduler import record
from conveyor.core.model import TopicPartition
from conveyor.core.planning import tasks as tk

pytestmark = pytest.mark.bench

NOW = 1_000_000.0


def groups(n: int, seed: int = 11) -> list[tk.TaskGroup]:
    """``n`` connectors of 12 partitions and 1 to 4 tasks with 10 samples each: a third
    with a growing lag (split), a third cold (merge), a third steady (nothing)."""
    rnd = random.Random(seed)
    policy = tk.TaskPolicy(min_tasks=1, max_tasks=6, lag_samples=5, cooldown_s=60)
    out = []
    for i in range(n):
        parts = [TopicPartition(f"t{i}", p) for p in range(12)]
        k = rnd.randint(1, 4)
        kind = i % 3
        tasks = []
        for tid in range(k):
            mine = parts[tid::k]
            samples = []
            for s in range(10):
                rate = {0: 900.0, 1: 5.0, 2: 300.0}[kind] / len(mine)
                lag = {0: 2_000 + 500 * s, 1: 0, 2: 50}[kind]
                samples.append(
                    tk.TaskSample(
                        NOW - 50 + 5 * s,
                        dict.fromkeys(mine, rate),
                        dict.fromkeys(mine, lag // len(mine)),
                    )
                )
            tasks.append(
                tk.TaskView(
                    tid,
                    frozenset(mine),
                    f"b{rnd.randrange(20)}",
                    heartbeat_at=NOW - 1,
                    changed_at=NOW - 100,
                    samples=tuple(samples),
                )
            )
        out.append(
            tk.TaskGroup(f"c{i:04d}", policy, frozenset(parts), tuple(tasks), ceiling=1_000.0)
        )
    return out


def test_split_and_merge_decisions_for_1000_connectors():
    gs = groups(1_000)
    brokers = [tk.BrokerSlot(f"b{i}", free=10_000) for i in range(20)]
    times = []
    plan = None
    for _ in range(7):
        t0 = time.perf_counter()
        plan = tk.plan_tasks(gs, brokers, NOW)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    kinds = {k: sum(type(d).__name__ == k for d in plan.decisions) for k in ("Split", "Merge")}
    assert kinds["Split"] > 0 and kinds["Merge"] > 0
    record(
        "tasks_plan_1000_connectors",
        median_ms=round(statistics.median(times) * 1000, 1),
        max_ms=round(max(times) * 1000, 1),
        splits=kinds["Split"],
        merges=kinds["Merge"],
        tasks=sum(len(g.tasks) for g in gs),
    )


# -- throughput with 1, 2 and 3 tasks ------------------------------------------------------

TASK_PARTITIONS = 6
TASK_MESSAGES = 60_000


def _task_process(args: tuple) -> tuple[int, float, float]:  # pragma: no cover - child process
    """One task: the real loop over ``parts`` of ``topic`` into PostgreSQL, until drained.

    Returns (messages, wall seconds, CPU seconds of this process)."""
    import resource
    import uuid as _uuid

    from bench.harness import BATCH, SCHEMA
    from conveyor.brokers.kafka import KafkaSource
    from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, run_loop
    from conveyor.core.model import BatchPolicy, SourceSpec, TransformSpec
    from conveyor.sinks import build_sink
    from conveyor.spark.session import spark_session
    from conveyor.spark.transform import SparkTransformer

    bootstrap, remote, topic, parts, expected, sink_config = args
    mine = [TopicPartition(topic, p) for p in parts]
    source = KafkaSource(
        SourceSpec(topics=[topic], bootstrap_servers=bootstrap),
        group_id=f"bench_{_uuid.uuid4().hex[:6]}",
        only=mine,
    )
    done: dict = {}

    class Committer:
        def commit(self, offsets):  # type: ignore[no-untyped-def]
            done.update(offsets)

        def heartbeat(self, counters, status, reason):  # type: ignore[no-untyped-def]
            return None

    loop = ConnectorLoop(
        LoopConfig(name="bench", batch=BatchPolicy(max_records=BATCH, max_wait_ms=200)),
        source=source,
        transform=SparkTransformer(
            TransformSpec(decode="json", schema=SCHEMA), lambda: spark_session(remote)
        ),
        sink=build_sink(sink_config),
        committer=Committer(),
        committed={},
        stop_requested=lambda: sum(done.values()) >= expected,
    )
    t0 = time.monotonic()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    run_loop(loop)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return sum(done.values()), time.monotonic() - t0, cpu


@pytest.mark.parametrize("n_tasks", [1, 2, 3])
def test_throughput_of_one_connector_with_1_2_3_tasks(
    n_tasks, tansu, warm_spark_remote, pg_url, pg_schema
):
    """The backlog of one 6-partition topic drained by ``n_tasks`` task processes, each with
    its share of the partitions (as the scheduler deals them). 2 vCPUs bound the gain."""
    import multiprocessing as mp

    import psycopg2
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from bench.harness import new_topic, order

    topic = new_topic()
    admin = KafkaAdminClient(bootstrap_servers=tansu)
    admin.create_topics([NewTopic(topic, TASK_PARTITIONS, 1)])
    admin.close()
    p = KafkaProducer(bootstrap_servers=tansu, linger_ms=5, batch_size=256 * 1024)
    for i in range(TASK_MESSAGES):
        p.send(topic, value=json.dumps(order(i)).encode(), partition=i % TASK_PARTITIONS)
    p.flush()
    p.close()
    table = f"tasks_{n_tasks}_{topic}"
    sink = {
        "type": "postgres",
        "url": pg_url,
        "schema": pg_schema,
        "table": table,
        "create_table": True,
    }
    per = TASK_MESSAGES // TASK_PARTITIONS
    shares = [list(range(TASK_PARTITIONS))[i::n_tasks] for i in range(n_tasks)]
    args = [(tansu, warm_spark_remote, topic, s, per * len(s), sink) for s in shares]
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(n_tasks) as pool:
        results = pool.map(_task_process, args)
    wall = time.monotonic() - t0
    assert sum(r[0] for r in results) == TASK_MESSAGES
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT count(DISTINCT id) FROM "{pg_schema}"."{table}"')
        assert cur.fetchone()[0] == TASK_MESSAGES
    cpu = sum(r[2] for r in results)
    record(
        "tasks_throughput",
        tasks=n_tasks,
        msgs_per_s=round(TASK_MESSAGES / wall),
        loop_msgs_per_s=round(TASK_MESSAGES / max(r[1] for r in results)),
        client_cpu_us_per_msg=round(cpu / TASK_MESSAGES * 1e6, 1),
    )
