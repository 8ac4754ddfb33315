"""Benchmark: what exactly once costs (issue 37), measured as users run it, side by side.

The same backlog of ``N`` JSON orders (``bench/test_bench_as_users_run_it.py``'s producer) drained
into an append-only PostgreSQL table by a connector with default settings, once with
``delivery: at_least_once`` (the default) and once with ``delivery: exactly_once`` (rows and
offsets in one transaction, an offsets table in the target), each in its own table, rounds
alternating the order, under ``dagster dev`` with the scheduler launching the runs
(``bench/stack.py``, ``bench/drain.py``). Each table must hold ``N`` distinct ids.

    .venv/bin/python -m pytest bench/test_bench_exactly_once.py -m bench -s -n 0
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from bench.drain import Result, drain_connector
from bench.stack import dev_stack, listening_pid
from bench.test_bench_as_users_run_it import create_table, distinct_ids, produce, watch
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.bench, pytest.mark.timeout(3600)]

N = int(os.environ.get("CONVEYOR_BENCH_EOS_N", "400000"))
ROUNDS = int(os.environ.get("CONVEYOR_BENCH_EOS_ROUNDS", "2"))
MODES = ["at_least_once", "exactly_once"]
ROOT = Path(__file__).resolve().parent.parent


def spec(name: str, pg_url: str, schema: str, delivery: str) -> dict[str, Any]:
    return {
        "name": name,
        "desired": "stopped",
        "source": {"topics": [f"t_{name}"]},
        "transform": {
            "decode": "json",
            "schema": "id BIGINT, name STRING, amount DOUBLE, ts BIGINT",
        },
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": schema,
            "table": name,
            "delivery": delivery,
        },
    }


def test_exactly_once_against_at_least_once_into_postgres(
    tansu: str, warm_spark_remote: str, pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    names = {(m, r): f"eos_{m[:3]}_{r}_{tag}" for m in MODES for r in range(ROUNDS)}
    specs = [spec(n, pg_url, pg_schema, m) for (m, _), n in names.items()]
    jvm = listening_pid(int(warm_spark_remote.rsplit(":", 1)[1]))
    results: dict[str, list[Result]] = {m: [] for m in MODES}
    with dev_stack(tmp_path / "home", tansu, warm_spark_remote, specs) as stack:
        wait_for(lambda: len(stack.store.list()) == len(specs), 120, "specs synced")
        for r in range(ROUNDS):
            for mode in MODES if r % 2 == 0 else list(reversed(MODES)):
                name = names[(mode, r)]
                create_table(pg_url, pg_schema, name)
                produce(tansu, f"t_{name}", N)
                res = Result(mode, time.monotonic(), N)
                drain_connector(
                    stack,
                    res,
                    name,
                    jvm,
                    lambda x, p, n=name: watch(x, pg_url, pg_schema, n, p),
                    None,
                )
                assert distinct_ids(pg_url, pg_schema, name) == N
                results[mode].append(res)
                print(
                    f"round {r + 1} {mode:<14} load {os.getloadavg()} steady "
                    f"{res.steady_rate():>9,.0f} rows/s total {res.total_rate():>9,.0f} "
                    f"cpu/100K {res.cpu_per_100k()}"
                )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(f"\nexactly once vs at least once: {N:,} messages, {ROUNDS} rounds, commit {commit}")
    for mode, rs in results.items():
        print(
            f"| {mode} | steady {statistics.median(r.steady_rate() for r in rs):,.0f} rows/s "
            f"({', '.join(f'{r.steady_rate():,.0f}' for r in rs)}) | total "
            f"{statistics.median(r.total_rate() for r in rs):,.0f} |"
        )
    ratios = [
        e.steady_rate() / a.steady_rate()
        for e, a in zip(results["exactly_once"], results["at_least_once"], strict=True)
    ]
    print(f"steady ratio exactly_once / at_least_once per round: {[round(x, 2) for x in ratios]}")
