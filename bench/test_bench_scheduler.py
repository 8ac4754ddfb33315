"""Scheduler cost: pure-core decision time (1,000 connectors, 50 brokers) and a real sensor tick (100 connectors).

Run: python -m pytest bench/test_bench_scheduler.py -m bench -s -n 0
Figures are printed and, when $CONVEYOR_BENCH_OUT is set, appended to that JSON-lines file.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

import pytest

from conveyor.core.model import ConnectorStatus
from conveyor.core.planning import scheduler as s

pytestmark = pytest.mark.bench

NOW = 1_000_000.0


def record(name: str, **figures: float) -> None:
    line = {"bench": name, **figures}
    print(json.dumps(line))
    out = os.environ.get("CONVEYOR_BENCH_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")


def cluster(n_conn: int, n_brokers: int, seed: int = 7):
    rnd = random.Random(seed)
    brokers = [s.BrokerView(f"b{i:02d}", capacity=40, draining=(i == 0)) for i in range(n_brokers)]
    conns, runs = [], []
    for i in range(n_conn):
        kind = rnd.random()
        name = f"c{i:04d}"
        if kind < 0.7:  # running, a few with stale heartbeats
            b = brokers[rnd.randrange(n_brokers)].id
            c = s.ConnectorView(
                name,
                status=ConnectorStatus.RUNNING,
                broker_id=b,
                generation=3,
                run_id=f"r{i}",
                heartbeat_at=NOW - (60 if rnd.random() < 0.02 else 1),
                msgs_per_s=rnd.uniform(0, 20_000),
                status_since=NOW - 100,
                updated_at=NOW - 1,
            )
            runs.append(s.RunView(f"r{i}", name, generation=3, status="STARTED", broker_id=b))
        elif kind < 0.9:
            c = s.ConnectorView(
                name,
                status=ConnectorStatus.IDLE,
                generation=1,
                status_since=NOW - 10,
                updated_at=NOW - 10,
            )
        else:
            c = s.ConnectorView(
                name,
                status=ConnectorStatus.ERROR,
                generation=2,
                restarts=rnd.randrange(6),
                status_since=NOW - 50,
                updated_at=NOW - 50,
            )
        conns.append(c)
    return conns, brokers, runs


def test_bench_pure_scheduler_1000_connectors_50_brokers():
    conns, brokers, runs = cluster(1_000, 50)
    baseline_conns, baseline_brokers, baseline_runs = cluster(10, 50)
    s.plan(conns, brokers, runs, NOW)  # warm up
    times, base = [], []
    for _ in range(30):
        t = time.perf_counter()
        p = s.plan(conns, brokers, runs, NOW)
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        s.plan(baseline_conns, baseline_brokers, baseline_runs, NOW)
        base.append(time.perf_counter() - t)
    assert p.of(s.Assign) and not any(a.broker_id == "b00" for a in p.of(s.Assign))
    med = statistics.median(times) * 1000
    record(
        "scheduler_plan_1000x50",
        median_ms=round(med, 2),
        p90_ms=round(sorted(times)[26] * 1000, 2),
        decisions=len(p.decisions),
        ratio_vs_10_connectors=round(med / (statistics.median(base) * 1000), 1),
    )


def test_bench_sensor_tick_100_connectors(tmp_path, monkeypatch):
    from dagster import build_sensor_context, instance_for_test

    from conveyor.dagster.resources.conveyor import ConveyorResource
    from conveyor.dagster.sensors.scheduler import scheduler_sensor
    from conveyor.store.meta import MetaStore

    url = f"sqlite:///{tmp_path / 'meta.db'}"
    monkeypatch.setenv("CONVEYOR_BROKERS_FILE", str(tmp_path / "none.yaml"))
    store = MetaStore(url)
    store.ensure_schema()
    for i in range(100):
        store.sync_spec(
            f"c{i:03d}",
            spec_json=json.dumps({"name": f"c{i:03d}"}),
            spec_hash="h",
            source="bench",
            error=None,
        )
    sensor = scheduler_sensor(None)
    with instance_for_test() as instance:
        ticks = []
        for _ in range(10):
            ctx = build_sensor_context(
                instance=instance, resources={"conveyor": ConveyorResource(meta_url=url)}
            )
            t = time.perf_counter()
            sensor(ctx)
            ticks.append(time.perf_counter() - t)
    first, steady = ticks[0] * 1000, statistics.median(ticks[1:]) * 1000
    record(
        "sensor_tick_100_connectors", first_tick_ms=round(first, 1), steady_tick_ms=round(steady, 1)
    )
