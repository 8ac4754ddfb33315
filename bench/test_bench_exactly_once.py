"""Benchmark: what exactly once costs (issue 37), measured as users run it, side by side.

The same backlog of ``N`` JSON orders (``bench/test_bench_as_users_run_it.py``'s producer) drained
by a connector with default settings, once with ``delivery: at_least_once`` (the Kafka default) and
once with ``delivery: exactly_once``, each into its own target, rounds alternating the order,
under ``dagster dev`` with the scheduler launching the runs (``bench/stack.py``,
``bench/drain.py``). Two targets:

- PostgreSQL, an append-only table (exactly once: rows and offsets in one transaction, an
  offsets table in the target); each table must hold ``N`` distinct ids.
- Kafka, a topic on the source's broker (exactly once: a transactional producer, the consumed
  offsets sent to each transaction); the drain is counted as records land in the topic, and
  each topic must hold ``N`` records, ``N`` distinct ids, read with read_committed's rule
  (tests/kafka_read_committed.py: tansu's own read_committed would count aborted records too).

    .venv/bin/python -m pytest bench/test_bench_exactly_once.py -m bench -s -n 0
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.drain import Pids, Result, drain_connector, sample_until_done
from bench.stack import DevStack, dev_stack, listening_pid
from bench.test_bench_as_users_run_it import create_table, distinct_ids, produce, watch
from bench.test_bench_sinks_as_users_run_it import KafkaTarget
from tests.e2e.conftest import wait_for
from tests.kafka_read_committed import read_topic

pytestmark = [pytest.mark.bench, pytest.mark.timeout(3600)]

N = int(os.environ.get("CONVEYOR_BENCH_EOS_N", "400000"))
ROUNDS = int(os.environ.get("CONVEYOR_BENCH_EOS_ROUNDS", "2"))
MODES = ["at_least_once", "exactly_once"]
ROOT = Path(__file__).resolve().parent.parent


def spec(name: str, sink: dict[str, Any], delivery: str) -> dict[str, Any]:
    return {
        "name": name,
        "desired": "stopped",
        "source": {"topics": [f"t_{name}"]},
        "transform": {
            "decode": "json",
            "schema": "id BIGINT, name STRING, amount DOUBLE, ts BIGINT",
        },
        "sink": {**sink, "delivery": delivery},
    }


def pg_sink(pg_url: str, schema: str, name: str) -> dict[str, Any]:
    return {"type": "postgres", "url": pg_url, "schema": schema, "table": name}


#: Samples one drain (the run's pids given) until all N rows are in.
Watch = Callable[[Result, Pids], object]


def side_by_side(
    stack: DevStack,
    names: dict[tuple[str, int], str],
    jvm: int | None,
    drain: Callable[[str], tuple[Watch, Callable[[], None]]],
    sink: str,
) -> dict[str, list[Result]]:
    """Each round drains one connector per mode, the order alternating between rounds;
    ``drain(name)`` makes the target and the backlog and returns the watcher and the check."""
    results: dict[str, list[Result]] = {m: [] for m in MODES}
    for r in range(ROUNDS):
        for mode in MODES if r % 2 == 0 else list(reversed(MODES)):
            name = names[(mode, r)]
            watcher, check = drain(name)
            res = Result(mode, time.monotonic(), N, sink=sink)
            drain_connector(stack, res, name, jvm, watcher, None)
            check()
            results[mode].append(res)
            print(
                f"round {r + 1} {mode:<14} load {os.getloadavg()} steady "
                f"{res.steady_rate():>9,.0f} rows/s total {res.total_rate():>9,.0f} "
                f"cpu/100K {res.cpu_per_100k()}"
            )
    return results


def report(target: str, results: dict[str, list[Result]]) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(
        f"\n{target}: exactly once vs at least once: {N:,} messages, {ROUNDS} rounds, "
        f"commit {commit}, load {os.getloadavg()}"
    )
    for mode, rs in results.items():
        print(
            f"| {mode} | steady {statistics.median(r.steady_rate() for r in rs):,.0f} rows/s "
            f"({', '.join(f'{r.steady_rate():,.0f}' for r in rs)}) | total "
            f"{statistics.median(r.total_rate() for r in rs):,.0f} "
            f"({', '.join(f'{r.total_rate():,.0f}' for r in rs)}) |"
        )
    pairs = list(zip(results["exactly_once"], results["at_least_once"], strict=True))
    steady = [round(e.steady_rate() / a.steady_rate(), 2) for e, a in pairs]
    total = [round(e.total_rate() / a.total_rate(), 2) for e, a in pairs]
    print(f"ratio exactly_once / at_least_once per round: steady {steady}, total {total}")


def test_exactly_once_against_at_least_once_into_postgres(
    tansu: str, warm_spark_remote: str, pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    names = {(m, r): f"eos_{m[:3]}_{r}_{tag}" for m in MODES for r in range(ROUNDS)}
    specs = [spec(n, pg_sink(pg_url, pg_schema, n), m) for (m, _), n in names.items()]
    jvm = listening_pid(int(warm_spark_remote.rsplit(":", 1)[1]))

    def drain(name: str) -> tuple[Watch, Callable[[], None]]:
        create_table(pg_url, pg_schema, name)
        produce(tansu, f"t_{name}", N)

        def check() -> None:
            assert distinct_ids(pg_url, pg_schema, name) == N

        return lambda x, p: watch(x, pg_url, pg_schema, name, p), check

    with dev_stack(tmp_path / "home", tansu, warm_spark_remote, specs) as stack:
        wait_for(lambda: len(stack.store.list()) == len(specs), 120, "specs synced")
        results = side_by_side(stack, names, jvm, drain, "postgres")
    report("PostgreSQL", results)


def test_exactly_once_against_at_least_once_into_kafka(
    tansu: str, warm_spark_remote: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    names = {(m, r): f"eok_{m[:3]}_{r}_{tag}" for m in MODES for r in range(ROUNDS)}
    targets = {n: KafkaTarget(n, tansu) for n in names.values()}
    sinks = {n: t.sink() for n, t in targets.items()}
    specs = [spec(n, sinks[n], m) for (m, _), n in names.items()]
    jvm = listening_pid(int(warm_spark_remote.rsplit(":", 1)[1]))

    def drain(name: str) -> tuple[Watch, Callable[[], None]]:
        target = targets[name]
        target.create()
        produce(tansu, f"t_{name}", N)

        def check() -> None:
            got = read_topic(tansu, target.topic, 2)
            ids = [json.loads(v or b"null")["id"] for v in got.values()]
            assert (len(ids), len(set(ids)), got.pending) == (N, N, {}), (len(ids), got.pending)
            target.close()

        return lambda x, p: sample_until_done(x, target.count, p), check

    with dev_stack(tmp_path / "home", tansu, warm_spark_remote, specs) as stack:
        wait_for(lambda: len(stack.store.list()) == len(specs), 120, "specs synced")
        results = side_by_side(stack, names, jvm, drain, "kafka")
    report("Kafka", results)
