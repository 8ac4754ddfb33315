"""The run queue sized to the fleet (``conveyor.dagster.run_queue``) and the instance
``conveyor dev`` writes from it."""

from __future__ import annotations

import yaml
from dagster import DagsterInstance

from conveyor.control.devserver import dagster_yaml
from conveyor.dagster.run_queue import (
    OneOffRoom,
    instance_queue_limits,
    queue_blocker,
    run_queue_config,
)
from conveyor.dagster.tags import TAG_BACKFILL, TAG_BROKER, TAG_MAINTENANCE, TAG_REPLAY


def test_the_limits_follow_the_brokers_capacity_plus_room_for_one_off_jobs() -> None:
    room = OneOffRoom(backfill=2, replay=2, maintenance=1, other=3)
    cfg = run_queue_config([("spark-a", 8), ("spark-b", 12)], room)
    assert cfg["max_concurrent_runs"] == 8 + 12 + 8
    assert cfg["tag_concurrency_limits"] == [
        {"key": TAG_BROKER, "value": "spark-a", "limit": 8},
        {"key": TAG_BROKER, "value": "spark-b", "limit": 12},
        {"key": TAG_BACKFILL, "limit": 2},
        {"key": TAG_REPLAY, "limit": 2},
        {"key": TAG_MAINTENANCE, "limit": 1},
    ]


def test_n_brokers_of_capacity_c() -> None:
    for n, c in [(1, 8), (1, 20), (3, 8), (5, 50)]:
        cfg = run_queue_config([(f"b{i}", c) for i in range(n)])
        assert cfg["max_concurrent_runs"] == n * c + OneOffRoom().total
        # The connectors' limits add up to the fleet's capacity: the rest is the one-offs'.
        brokers = [x for x in cfg["tag_concurrency_limits"] if x["key"] == TAG_BROKER]
        assert sum(x["limit"] for x in brokers) == n * c


def test_conveyor_dev_writes_an_instance_dagster_accepts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "dagster.yaml").write_text(dagster_yaml([("local", 20)]))
    written = yaml.safe_load((tmp_path / "dagster.yaml").read_text())
    assert written["run_coordinator"]["config"]["max_concurrent_runs"] == 20 + OneOffRoom().total
    instance = DagsterInstance.from_config(str(tmp_path))
    try:
        limits = instance_queue_limits(instance)
        assert limits is not None
        max_runs, tag_limits = limits
        assert max_runs == 28
        assert {"key": TAG_BROKER, "value": "local", "limit": 20} in tag_limits
    finally:
        instance.dispose()


def connector(broker: str) -> dict[str, str]:
    return {TAG_BROKER: broker, "conveyor/connector": "c"}


def test_the_blocker_names_the_limit_that_holds_a_run() -> None:
    cfg = run_queue_config([("a", 2), ("b", 2)], OneOffRoom(1, 1, 1, 1))
    max_runs, limits = cfg["max_concurrent_runs"], cfg["tag_concurrency_limits"]
    assert queue_blocker(max_runs, limits, connector("a"), []) is None
    held = queue_blocker(max_runs, limits, connector("a"), [connector("a"), connector("a")])
    assert held == f"tag limit {TAG_BROKER}=a: 2 of 2 in progress"
    assert queue_blocker(max_runs, limits, connector("b"), [connector("a")] * 2) is None
    # A one-off kind's limit counts every connector's runs of that kind.
    backfills = [{TAG_BACKFILL: "x"}]
    assert queue_blocker(max_runs, limits, {TAG_BACKFILL: "y"}, backfills) == (
        f"tag limit {TAG_BACKFILL}: 1 of 1 in progress"
    )
    # Dagster's default of 10 with more connectors than that: the total holds them.
    assert queue_blocker(10, [], connector("a"), [{}] * 10) == (
        "run queue full: 10 of max_concurrent_runs 10 in progress"
    )
    assert queue_blocker(-1, [], connector("a"), [{}] * 100) is None  # -1: no limit


def test_a_per_value_limit_counts_the_runs_own_value() -> None:
    limits = [{"key": "team", "value": {"applyLimitPerUniqueValue": True}, "limit": 1}]
    assert queue_blocker(10, limits, {"team": "x"}, [{"team": "y"}]) is None
    assert queue_blocker(10, limits, {"team": "x"}, [{"team": "x"}]) == (
        "tag limit team=x: 1 of 1 in progress"
    )


def test_the_deployed_instance_is_sized_for_the_deployed_brokers() -> None:
    from pathlib import Path

    deploy = Path(__file__).resolve().parents[2] / "deploy"
    brokers = yaml.safe_load((deploy / "brokers.yaml").read_text())["brokers"]
    expected = run_queue_config([(b["id"], b["capacity"]) for b in brokers])
    config = yaml.safe_load((deploy / "dagster.yaml").read_text())["run_coordinator"]["config"]
    assert config["max_concurrent_runs"] == expected["max_concurrent_runs"]
    assert config["tag_concurrency_limits"] == expected["tag_concurrency_limits"]


# -- the has_run asset check -------------------------------------------------------------------


def row(name: str, status: str = "Idle", last_error: str | None = None, desired: str = "running"):  # type: ignore[no-untyped-def]
    from conveyor.core.model import ConnectorStatus, DesiredState
    from conveyor.store.meta import ConnectorRow

    return ConnectorRow(
        name=name, spec_json=None, spec_hash=None, spec_source=None, spec_error=None,
        desired=DesiredState(desired), status=ConnectorStatus(status), status_since=0.0,
        broker_id="b1", generation=1, run_id=None, run_pid=None, run_host=None,
        heartbeat_at=None, counters={}, last_error=last_error, restarts=0,
        next_restart_at=None, last_moved_at=None, created_at=0.0, updated_at=0.0,
    )  # fmt: skip


def test_has_run_fails_while_a_connector_waits_and_passes_once_it_runs() -> None:
    from dagster import AssetCheckSeverity, AssetKey

    from conveyor.dagster.assets.checks import RUN_CHECK_NAME, run_check_events, run_verdict

    why = "waiting for a run on b1: run q queued over 30s, run queue full"
    assert run_verdict([row("a", last_error=why), row("b", "Running")]) == (False, f"a: {why}")
    assert run_verdict([row("a", "Running"), row("b", last_error="boom")]) == (
        True,
        "a: Running, b: Idle",
    )
    assets = {"a": AssetKey(["pg", "t"]), "b": AssetKey(["pg", "u"])}
    # The tick that finds "a" waiting reports it failed and remembers it.
    events, still = run_check_events(assets, {"a": why}, [], set())
    [e] = events
    assert (e.asset_key, e.check_name, e.passed) == (assets["a"], RUN_CHECK_NAME, False)
    assert e.severity == AssetCheckSeverity.WARN and e.description == f"a: {why}"
    assert still == {"a"}
    # Still waiting: nothing new; running: passed, forgotten.
    assert run_check_events(assets, {}, [row("a", last_error=why)], {"a"}) == ([], {"a"})
    events, still = run_check_events(assets, {}, [row("a", "Running")], {"a"})
    assert [(e.passed, e.description) for e in events] == [(True, "a: Running")]
    assert still == set()
    # Deleted meanwhile: passed too (nothing waits any more).
    events, still = run_check_events(assets, {}, [], {"a"})
    assert [(e.passed, e.description) for e in events] == [(True, "a: deleted")]


def test_conveyor_dev_sizes_its_instance_from_the_capacity_or_the_brokers_file(
    tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from conveyor.control.devserver import write_instance

    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    monkeypatch.delenv("CONVEYOR_BROKERS_FILE", raising=False)
    monkeypatch.setenv("CONVEYOR_BROKER_CAPACITY", "20")  # the 20 connectors

    def queue() -> dict:  # type: ignore[type-arg]
        write_instance(tmp_path)
        return yaml.safe_load((tmp_path / "dagster.yaml").read_text())["run_coordinator"]["config"]

    assert queue()["max_concurrent_runs"] == 20 + OneOffRoom().total
    brokers = tmp_path / "brokers.yaml"
    brokers.write_text(
        yaml.safe_dump(
            {
                "brokers": [
                    {"id": "a", "capacity": 10, "spark_remote": "sc://a:15002"},
                    {"id": "b", "capacity": 5, "spark_remote": "sc://b:15002"},
                ]
            }
        )
    )
    config = queue()
    assert config["max_concurrent_runs"] == 15 + OneOffRoom().total
    assert config["tag_concurrency_limits"][:2] == [
        {"key": TAG_BROKER, "value": "a", "limit": 10},
        {"key": TAG_BROKER, "value": "b", "limit": 5},
    ]
