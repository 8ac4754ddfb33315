"""Partition-task planner cost: split and merge decision time for 1,000 connectors.

Run: python -m pytest bench/test_bench_tasks.py -m bench -s -n 0
Figures are printed and, when $CONVEYOR_BENCH_OUT is set, appended to that JSON-lines file.
Throughput with 1, 2 and 3 tasks is measured end to end by tests/e2e/test_tasks_e2e.py's
setting (see docs/BENCHMARKS.md); this file measures the pure planner only.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

from bench.test_bench_scheduler import record
from conveyor.core import tasks as tk
from conveyor.core.model import TopicPartition

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
