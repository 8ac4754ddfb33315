"""The conveyor_scheduler sensor on a real Dagster instance and a real meta store."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import DagsterInstance, DagsterRunStatus, build_sensor_context, instance_for_test
from dagster._core.test_utils import create_run_for_test

from conveyor.core.errors import FencedError
from conveyor.core.model import Broker, ConnectorStatus, DesiredState, TopicPartition
from conveyor.core.planning.state import StateChange
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.sensors.scheduler import run_key, scheduler_sensor
from conveyor.dagster.tags import TAG_BROKER, TAG_CONNECTOR, TAG_GENERATION, job_name
from conveyor.store.meta import MetaStore

pytestmark = pytest.mark.integration


@pytest.fixture
def env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[DagsterInstance, MetaStore, str]]:
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    brokers = tmp_path / "brokers.yaml"
    # Endpoints that accept connections: the sensor probes them (a closed one would count as down).
    import socket

    listeners = []
    entries = []
    for bid in ("b1", "b2"):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        listeners.append(s)
        entries.append(
            {
                "id": bid,
                "capacity": 2,
                "spark_remote": f"sc://127.0.0.1:{s.getsockname()[1]}",
                "run_tags": {"pool": bid},
            }
        )
    brokers.write_text(json.dumps({"brokers": entries}))
    monkeypatch.setenv("CONVEYOR_BROKERS_FILE", str(brokers))
    store = MetaStore(url)
    store.ensure_schema()
    for name in ("alpha", "beta", "gamma"):
        store.sync_spec(
            name, spec_json=json.dumps({"name": name}), spec_hash="h", source="test", error=None
        )
    with instance_for_test() as instance:
        yield instance, store, url
    for s in listeners:
        s.close()


def tick(instance: DagsterInstance, url: str):
    ctx = build_sensor_context(
        instance=instance, resources={"conveyor": ConveyorResource(meta_url=url)}
    )
    return scheduler_sensor(None)(ctx)


def test_launch_assigns_by_least_load_with_run_keys_and_tags(env):
    instance, store, url = env
    result = tick(instance, url)
    reqs = sorted(result.run_requests, key=lambda r: r.run_key)
    assert [r.run_key for r in reqs] == [run_key(store.get(n)) for n in ("alpha", "beta", "gamma")]
    assert reqs[0].run_key.startswith("alpha:1@")
    assert [r.job_name for r in reqs] == [job_name(n) for n in ("alpha", "beta", "gamma")]
    assert [r.tags[TAG_BROKER] for r in reqs] == ["b1", "b2", "b1"]
    assert all(
        r.tags[TAG_CONNECTOR] == r.run_key.split(":")[0] and r.tags[TAG_GENERATION] == "1"
        for r in reqs
    )
    assert reqs[1].tags["pool"] == "b2"
    rows = {r.name: r for r in store.list()}
    assert {n: (r.broker_id, r.generation) for n, r in rows.items()} == {
        "alpha": ("b1", 1),
        "beta": ("b2", 1),
        "gamma": ("b1", 1),
    }
    assert any("assigned to b2" in h.reason for h in store.history("beta"))
    # Next tick: the runs are pending (queued) -> nothing new is launched.
    for r in reqs:
        create_run_for_test(
            instance, job_name=r.job_name, status=DagsterRunStatus.STARTING, tags=r.tags
        )
    assert tick(instance, url).run_requests == []


def test_a_connector_deleted_and_created_again_gets_a_run_key_dagster_has_not_seen(env):
    """Issue 33: the old key 'name:1' made Dagster skip the launch ("already completed with run
    keys") until the launch timeout. Issue 44: a connector created again is a new incarnation
    whose generations start above every one the name had (here the first assignment's 1)."""
    instance, store, url = env
    first = tick(instance, url)
    keys = {r.run_key for r in first.run_requests}
    store.delete("alpha")
    store.sync_spec(
        "alpha", spec_json=json.dumps({"name": "alpha"}), spec_hash="h", source="test", error=None
    )
    again = tick(instance, url)
    [req] = [r for r in again.run_requests if r.tags[TAG_CONNECTOR] == "alpha"]
    assert req.tags[TAG_GENERATION] == "2" and req.run_key not in keys
    assert req.run_key == run_key(store.get("alpha"))


def test_capacity_leaves_the_rest_waiting(env):
    instance, store, url = env
    for n in ("delta", "epsilon"):
        store.sync_spec(
            n, spec_json=json.dumps({"name": n}), spec_hash="h", source="test", error=None
        )
    result = tick(instance, url)
    assert len(result.run_requests) == 4  # 2 brokers x capacity 2
    waiting = [r for r in store.list() if r.broker_id is None]
    assert [r.name for r in waiting] == ["gamma"]  # assigned in name order


def test_stale_heartbeat_is_reset_fenced_and_relaunched_on_a_new_generation(env):
    instance, store, url = env
    tick(instance, url)
    claim = store.claim("alpha", run_id="run-a", expected_generation=1, holder_alive=lambda r: True)
    store.heartbeat("alpha", claim.generation, {})
    store.commit("alpha", claim.generation, {TopicPartition("t", 0): 100})
    old = MetaStore(url, clock=lambda: time.time() - 120)
    old.heartbeat("alpha", claim.generation, {})  # 120 s old
    result = tick(instance, url)
    row = store.get("alpha")
    assert row.generation == claim.generation + 2  # reset (+1) and re-assigned (+1) in one tick
    assert [r.run_key for r in result.run_requests] == [run_key(row)]
    with pytest.raises(FencedError):
        store.commit("alpha", claim.generation, {TopicPartition("t", 0): 200})
    assert store.committed_offsets("alpha") == {TopicPartition("t", 0): 100}
    assert any("heartbeat" in h.reason for h in store.history("alpha"))


def test_desired_stopped_run_is_reclaimed_and_stays_stopped(env):
    instance, store, url = env
    tick(instance, url)
    row = store.get("beta")
    run = create_run_for_test(
        instance,
        job_name=job_name("beta"),
        status=DagsterRunStatus.STARTED,
        tags={
            TAG_CONNECTOR: "beta",
            TAG_GENERATION: str(row.generation),
            TAG_BROKER: row.broker_id,
        },
    )
    store.claim(
        "beta", run_id=run.run_id, expected_generation=row.generation, holder_alive=lambda r: True
    )
    store.heartbeat("beta", row.generation, {})
    store.set_desired("beta", DesiredState.STOPPED, reason="test stop")
    # The run was not launched by this instance's launcher, so terminate() cannot reach it; the
    # decision is still made and the run's own heartbeat sees desired=stopped.
    from conveyor.core.planning import scheduler as core
    from conveyor.dagster.sensors.scheduler import tick as sched_tick

    ctx = build_sensor_context(
        instance=instance, resources={"conveyor": ConveyorResource(meta_url=url)}
    )
    plan, _ = sched_tick(ctx, store)
    assert [(type(d).__name__, d.run_id) for d in plan.of(core.Terminate)] == [
        ("Terminate", run.run_id)
    ]
    # The run ends as the op does on a stop: Stopped, desired stopped.
    store.release("beta", row.generation, ConnectorStatus.STOPPED, "stopped")
    instance.report_run_canceled(instance.get_run_by_id(run.run_id))
    for _ in range(3):
        assert not [r for r in tick(instance, url).run_requests if r.tags[TAG_CONNECTOR] == "beta"]
        assert store.get("beta").status == ConnectorStatus.STOPPED


def test_a_stopped_connectors_run_that_released_it_meanwhile_is_not_terminated(env, monkeypatch):
    # The tick read the connector Running under its run and desired stopped; its loop saw the
    # stop and released it before the terminate: the run ends by itself. A terminate in that
    # moment marked it CANCELING after its end, and its restart queued behind it for a minute.
    from conveyor.core.planning import scheduler as core
    from conveyor.dagster.sensors.scheduler import apply_plan, connector_view, run_views

    instance, store, url = env
    tick(instance, url)
    run, gen = _claimed_run(instance, store, "alpha", DagsterRunStatus.STARTED)
    store.set_desired("alpha", DesiredState.STOPPED, reason="test stop")
    seen = connector_view(store.get("alpha"))
    runs = run_views(instance, [store.get("alpha")], time.time())
    plan = core.plan([seen], core_brokers(store), runs, time.time())
    assert [d.run_id for d in plan.of(core.Terminate)] == [run.run_id]
    store.release("alpha", gen, ConnectorStatus.STOPPED, "stopped: desired state is stopped")
    terminated: list[str] = []
    monkeypatch.setattr(instance.run_launcher, "terminate", terminated.append)
    apply_plan(build_sensor_context(instance=instance), store, plan, {"alpha": seen})
    assert terminated == []
    # The next tick reads it released: no terminate either, and it stays stopped.
    tick(instance, url)
    assert terminated == [] and store.get("alpha").status == ConnectorStatus.STOPPED
    # A run that has not ended within the grace is terminated after all.
    monkeypatch.setenv("CONVEYOR_SCHEDULER_RELEASE_GRACE_S", "0")
    tick(instance, url)
    assert terminated == [run.run_id]


def _claimed_run(instance: DagsterInstance, store: MetaStore, name: str, status: DagsterRunStatus):
    """A run of ``name``'s current assignment that claimed it and heartbeats, in ``status``."""
    row = store.get(name)
    tags = {TAG_CONNECTOR: name, TAG_GENERATION: str(row.generation), TAG_BROKER: row.broker_id}
    run = create_run_for_test(instance, job_name=job_name(name), status=status, tags=tags)
    store.claim(
        name, run_id=run.run_id, expected_generation=row.generation, holder_alive=lambda r: True
    )
    store.heartbeat(name, row.generation, {})
    return run, row.generation


def test_a_run_that_died_under_a_running_connector_is_relaunched_in_one_tick(env):
    instance, store, url = env
    tick(instance, url)
    run, gen = _claimed_run(instance, store, "alpha", DagsterRunStatus.STARTED)
    # kill -9: the code server sees its child die and reports the run failed; the
    # connector still says Running (nobody released it).
    instance.report_run_failed(instance.get_run_by_id(run.run_id), message="exit code -9")
    result = tick(instance, url)
    row = store.get("alpha")
    assert row.status == ConnectorStatus.IDLE and row.restarts == 1
    assert row.generation == gen + 2  # the dead run fenced (+1), re-assigned (+1)
    assert [r.run_key for r in result.run_requests] == [run_key(row)]
    assert any("relaunched at once" in h.reason for h in store.history("alpha"))


def test_a_run_that_released_its_connector_as_error_is_not_taken_for_a_crash(env):
    # The tick read the connector Running, then the run released it as Error and failed
    # before the tick read the run: the decision must not relaunch it (nor hide its error).
    from conveyor.core.planning import scheduler as core
    from conveyor.dagster.sensors.scheduler import apply_plan, connector_view

    instance, store, url = env
    tick(instance, url)
    run, gen = _claimed_run(instance, store, "alpha", DagsterRunStatus.STARTED)
    seen_running = connector_view(store.get("alpha"))
    msg = "data error: message t[0]@7 failed (data): value too long"
    store.release("alpha", gen, ConnectorStatus.ERROR, "the op", error=msg)
    instance.report_run_failed(instance.get_run_by_id(run.run_id))
    failed = core.RunView(run.run_id, "alpha", gen, "FAILURE", "b1")
    plan = core.plan([seen_running], core_brokers(store), [failed], time.time())
    assert [type(d).__name__ for d in plan.decisions] == ["Relaunch", "Assign"]
    ctx = build_sensor_context(instance=instance)
    assert apply_plan(ctx, store, plan, {"alpha": seen_running}) == []
    row = store.get("alpha")
    assert (row.status, row.generation, row.restarts, row.last_error) == (
        ConnectorStatus.ERROR,
        gen,
        0,
        msg,
    )


def test_the_run_failure_sensor_records_a_crash_and_leaves_the_decision_to_the_scheduler(env):
    # Marking the connector Error there would send the crash down the restart backoff
    # meant for failing connectors (seen: kill -9 -> Error -> "restart after 10s backoff").
    from dagster import DagsterEventType, build_run_status_sensor_context

    from conveyor.dagster.sensors.run_status import conveyor_run_failures

    instance, store, url = env
    tick(instance, url)
    run, gen = _claimed_run(instance, store, "alpha", DagsterRunStatus.STARTED)
    instance.report_run_failed(instance.get_run_by_id(run.run_id), message="exit code -9")
    (record,) = instance.get_records_for_run(
        run.run_id, of_type=DagsterEventType.RUN_FAILURE
    ).records
    ctx = build_run_status_sensor_context(
        sensor_name="conveyor_run_failures",
        dagster_event=record.event_log_entry.dagster_event,
        dagster_instance=instance,
        dagster_run=instance.get_run_by_id(run.run_id),
    ).for_run_failure()
    conveyor_run_failures(ctx, conveyor=ConveyorResource(meta_url=url))
    row = store.get("alpha")
    assert (row.status, row.generation) == (ConnectorStatus.RUNNING, gen)
    assert any("exit code -9" in h.reason for h in store.history("alpha"))
    tick(instance, url)  # the scheduler: relaunched at once, not Error
    row = store.get("alpha")
    assert row.status == ConnectorStatus.IDLE and row.broker_id and row.restarts == 1


def core_brokers(store: MetaStore):
    from conveyor.dagster.resources.conveyor import broker_views

    return broker_views(store, check_endpoints=False)


def test_hand_launched_run_is_adopted_and_an_older_generation_run_is_reclaimed(env):
    instance, store, url = env
    tick(instance, url)  # alpha, beta, gamma at generation 1
    store.apply("gamma", None, StateChange.reset(), "test")
    ui = create_run_for_test(
        instance,
        job_name=job_name("gamma"),
        status=DagsterRunStatus.STARTING,
        tags={TAG_CONNECTOR: "gamma"},
    )
    stale = create_run_for_test(
        instance,
        job_name=job_name("alpha"),
        status=DagsterRunStatus.STARTED,
        tags={TAG_CONNECTOR: "alpha", TAG_GENERATION: "0"},
    )
    from conveyor.core.planning import scheduler as core
    from conveyor.dagster.sensors.scheduler import tick as sched_tick

    ctx = build_sensor_context(
        instance=instance, resources={"conveyor": ConveyorResource(meta_url=url)}
    )
    plan, reqs = sched_tick(ctx, store)
    assert "gamma" not in {r.tags[TAG_CONNECTOR] for r in reqs}  # adopted, not launched twice
    assert store.get("gamma").broker_id is None
    assert [d.run_id for d in plan.of(core.Terminate)] == [stale.run_id]
    assert ui.run_id not in {d.run_id for d in plan.of(core.Terminate)}


def test_drain_moves_connectors_and_undrain_takes_new_ones(env):
    instance, store, url = env
    tick(instance, url)
    for r in store.list():
        c = store.claim(
            r.name,
            run_id=f"run-{r.name}",
            expected_generation=r.generation,
            holder_alive=lambda r: True,
        )
        store.heartbeat(r.name, c.generation, {})
    store.set_draining("b1", True)
    tick(instance, url)
    rows = {r.name: r for r in store.list()}
    assert rows["alpha"].broker_id == "b2" or rows["gamma"].broker_id == "b2"
    assert all(r.broker_id != "b1" for r in rows.values())
    assert any("draining" in h.reason for h in store.history("alpha"))


def test_broker_list_in_store_matches_the_yaml(env):
    instance, store, url = env
    tick(instance, url)
    assert [(b.id, b.capacity, b.run_tags) for b in store.list_brokers()] == [
        ("b1", 2, {"pool": "b1"}),
        ("b2", 2, {"pool": "b2"}),
    ]
    assert isinstance(store.list_brokers()[0], Broker)


HOLD_THE_LOCK = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")  # a run's write transaction, as a heartbeat takes it
print("locked", flush=True)
time.sleep(600)
"""


def test_a_hung_zombie_holding_the_store_lock_is_killed_and_stopped_in_one_tick(env, tmp_path):
    """A run process SIGSTOPped in the middle of a meta-store write (CI, 2026-11-23: the
    scheduler e2e's zombie outlived the test). It holds SQLite's write lock, so any write
    of the tick waits for it: the tick must kill it first, then write the Stop."""
    import os
    import signal
    import subprocess
    import sys

    from conveyor.core.host.processes import pid_alive

    instance, store, url = env
    tick(instance, url)
    row = store.get("alpha")
    run = create_run_for_test(
        instance,
        job_name=job_name("alpha"),
        status=DagsterRunStatus.STARTED,
        tags={TAG_CONNECTOR: "alpha", TAG_GENERATION: str(row.generation), TAG_BROKER: "b1"},
    )
    db = url.removeprefix("sqlite:///")
    hung = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, db], stdout=subprocess.PIPE, text=True
    )
    try:
        claim = store.claim(
            "alpha",
            run_id=run.run_id,
            expected_generation=row.generation,
            holder_alive=lambda r: True,
            pid=hung.pid,
        )
        store.heartbeat("alpha", claim.generation, {})
        assert hung.stdout is not None and hung.stdout.readline().strip() == "locked"
        os.kill(hung.pid, signal.SIGSTOP)
        instance.report_run_canceled(instance.get_run_by_id(run.run_id), message="test")
        tick(instance, url)
        hung.wait(10)  # reaped: killed by the tick
        assert not pid_alive(hung.pid)
        after = store.get("alpha")
        assert after.status == ConnectorStatus.STOPPED and after.generation > claim.generation
        assert any("zombie" in h.reason and "killed" in h.reason for h in store.history("alpha"))
    finally:
        if hung.poll() is None:
            hung.kill()
            hung.wait()


def test_a_connector_whose_run_waits_in_the_run_queue_says_why(env, monkeypatch, tmp_path):
    """Issue 47: more connectors than the run queue lets start sat Idle with no reason. Here a
    QueuedRunCoordinator of 2 runs, both taken by a user's runs: each connector's queued run
    is reported with the limit that holds it (last error, history, the tick's log, the has_run
    check), once; the check passes again when the run heartbeats."""
    from dagster import AssetCheckEvaluation
    from dagster._core.remote_origin import (
        RegisteredCodeLocationOrigin,
        RemoteJobOrigin,
        RemoteRepositoryOrigin,
    )

    from conveyor.config.specs import from_mapping
    from conveyor.control.reads import status_of
    from conveyor.dagster.assets.checks import RUN_CHECK_NAME

    _, store, url = env
    monkeypatch.setenv("CONVEYOR_SCHEDULER_RUN_WAIT_S", "0")
    specs = [
        from_mapping(
            {"name": n, "source": {"topics": ["t"]}, "sink": {"type": "localfile", "path": n}},
            source="test",
            fallback_name=n,
        )
        for n in ("alpha", "beta", "gamma")
    ]
    assert all(ls.ok for ls in specs), [ls.error for ls in specs]
    sensor = scheduler_sensor(None, specs)
    queue = {
        "module": "dagster.core.run_coordinator",
        "class": "QueuedRunCoordinator",
        "config": {"max_concurrent_runs": 2},
    }

    def run(instance, cursor=None):
        ctx = build_sensor_context(
            instance=instance,
            cursor=cursor,
            resources={"conveyor": ConveyorResource(meta_url=url)},
        )
        return sensor(ctx)

    with instance_for_test(overrides={"run_coordinator": queue}) as instance:
        for _ in range(2):  # a user's jobs hold both slots
            create_run_for_test(instance, job_name="my_job", status=DagsterRunStatus.STARTED)
        first = run(instance)
        location = RemoteRepositoryOrigin(
            RegisteredCodeLocationOrigin("conveyor"), "__repository__"
        )
        for r in first.run_requests:
            create_run_for_test(
                instance,
                job_name=r.job_name,
                tags=r.tags,
                status=DagsterRunStatus.QUEUED,
                remote_job_origin=RemoteJobOrigin(location, r.job_name),
            )
        time.sleep(0.01)  # the runs' queued time must be past the bound of 0 s
        second = run(instance)
        full = "run queue full: 2 of max_concurrent_runs 2 in progress"
        assert len(f"waiting for a run on b1: run 12345678 queued over 30s, {full}") <= 120
        for n in ("alpha", "beta", "gamma"):
            row = store.get(n)
            assert row.status == ConnectorStatus.IDLE and row.broker_id
            assert row.last_error.startswith(f"waiting for a run on {row.broker_id}: run ")
            assert row.last_error.endswith(full)
            assert status_of(row)["tasks"][0]["trace"] == row.last_error  # connector status
            assert any(h.reason == f"scheduler: {row.last_error}" for h in store.history(n))
        checks = [e for e in second.asset_events if isinstance(e, AssetCheckEvaluation)]
        assert sorted((e.check_name, e.passed, e.metadata["connector"].value) for e in checks) == [
            (RUN_CHECK_NAME, False, n) for n in ("alpha", "beta", "gamma")
        ]
        assert json.loads(second.cursor) == ["alpha", "beta", "gamma"]
        # Said once: the next tick adds no history line and no evaluation.
        lines = len(store.history("alpha"))
        third = run(instance, second.cursor)
        assert len(store.history("alpha")) == lines and not third.asset_events
        # alpha's run starts and heartbeats: its check passes, the others still wait.
        gen = store.get("alpha").generation
        store.claim(
            "alpha", run_id="r-alpha", expected_generation=gen, holder_alive=lambda _: False
        )
        store.heartbeat("alpha", gen, {})
        assert store.get("alpha").last_error is None
        fourth = run(instance, third.cursor)
        assert [(e.metadata["connector"].value, e.passed) for e in fourth.asset_events] == [
            ("alpha", True)
        ]
        assert json.loads(fourth.cursor) == ["beta", "gamma"]
        # The others stop: their checks pass and the cursor empties (not left as it was).
        for n in ("beta", "gamma"):
            store.stop(n, reason="test")
        fifth = run(instance, fourth.cursor)
        assert sorted((e.metadata["connector"].value, e.passed) for e in fifth.asset_events) == [
            ("beta", True),
            ("gamma", True),
        ]
        assert fifth.cursor == "[]"
        assert run(instance, fifth.cursor).asset_events == []
