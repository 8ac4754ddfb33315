"""``landed_through`` and the ``complete_through`` check on a real Dagster instance: the sink
asset's materializations and observations carry the metadata the connector's reports write
(``jobs.progress.watermark_metadata``), and the sensor is evaluated tick by tick."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from dagster import (
    AssetCheckKey,
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    AssetSelection,
    AssetSpec,
    DagsterInstance,
    Definitions,
    SensorResult,
    TimeWindowPartitionsDefinition,
    asset,
    build_sensor_context,
    define_asset_job,
    instance_for_test,
)

from conveyor.core.engine.watermarks import Watermark
from conveyor.dagster.assets import checks
from conveyor.dagster.jobs.progress import watermark_metadata
from conveyor.dagster.landed import TAG_LANDED, complete_through_check, landed_through
from conveyor.dagster.tags import TAG_CONNECTOR

pytestmark = pytest.mark.integration

SINK = AssetKey(["postgres", "public", "orders"])
START = datetime(2025, 3, 1, 10, 0, tzinfo=timezone.utc)
MINUTES = TimeWindowPartitionsDefinition(
    start=START, cron_schedule="* * * * *", fmt="%Y-%m-%d-%H:%M", timezone="UTC"
)


@asset(partitions_def=MINUTES, deps=[SINK])
def orders_per_minute() -> None:
    """Counts the sink's rows of one minute (not run here: the sensor's requests are checked)."""


def at(minute: int, second: float = 0) -> float:
    return (START + timedelta(minutes=minute, seconds=second)).timestamp()


def key(minute: int) -> str:
    return (START + timedelta(minutes=minute)).strftime("%Y-%m-%d-%H:%M")


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with instance_for_test() as i:
        yield i


def report(
    instance: DagsterInstance,
    low: float | None,
    *,
    late: tuple[tuple[float, float], ...] = (),
    connector: str = "orders_pg",
    observation: bool = False,
) -> None:
    """A sink materialization as the connector's progress report writes it (``observation``:
    the observation its watermark report writes between them)."""
    wm = Watermark(low=low, by_partition={"orders[0]": low} if low else {}, late=late)
    kind = AssetObservation if observation else AssetMaterialization
    instance.report_runless_asset_event(
        kind(asset_key=SINK, metadata=watermark_metadata(wm), tags={TAG_CONNECTOR: connector})
    )


class Ticks:
    """Evaluates one sensor tick after another, carrying its cursor as the daemon does."""

    def __init__(self, instance: DagsterInstance, **kw: Any) -> None:
        self.instance = instance
        self.sensor = landed_through(SINK, MINUTES, target=orders_per_minute, **kw)
        self.cursor: str | None = None
        self.run_keys: list[str] = []

    def tick(self) -> list[tuple[str, str]]:
        """(partition key, why) of each run requested by one tick."""
        result = self.sensor(build_sensor_context(instance=self.instance, cursor=self.cursor))
        assert isinstance(result, SensorResult)
        self.cursor = result.cursor
        requests = list(result.run_requests or [])
        self.run_keys += [r.run_key for r in requests]
        assert len(self.run_keys) == len(set(self.run_keys)), "a run key twice"
        return [(r.partition_key, r.tags[TAG_LANDED]) for r in requests]


def test_each_partition_runs_once_after_the_watermark_passes_its_end(instance):
    t = Ticks(instance, start=START)
    assert t.tick() == []  # nothing reported yet
    report(instance, None)  # a report before the watermark is known
    assert t.tick() == []
    report(instance, at(1, 30))  # minute 0 complete, minute 1 not yet
    assert t.tick() == [(key(0), "watermark")]
    assert t.tick() == []  # the same materialization seen again: nothing
    report(instance, at(2, 0))  # exactly the end of minute 1: complete
    report(instance, at(3, 59.5))
    assert t.tick() == [(key(1), "watermark"), (key(2), "watermark")]
    # A new run rebuilds its watermark from lower: nothing runs again, nothing is skipped.
    report(instance, at(1, 0))
    assert t.tick() == []
    report(instance, at(4, 0))
    assert t.tick() == [(key(3), "watermark")]


def test_late_data_re_runs_only_the_partitions_already_run_that_it_falls_in(instance):
    t = Ticks(instance, start=START)
    report(instance, at(3, 10))
    assert t.tick() == [(key(0), "watermark"), (key(1), "watermark"), (key(2), "watermark")]
    # Late events at 01:20 and 01:40, and 02:59..03:05 (minute 3 has not run: it will see them).
    report(instance, at(3, 20), late=((at(1, 20), at(1, 40)), (at(2, 59), at(3, 5))))
    assert t.tick() == [(key(1), "late data"), (key(2), "late data")]
    assert t.tick() == []
    # Late data in the same report that lets its partition run the first time: one run.
    report(instance, at(5, 1), late=((at(4, 30), at(4, 31)),))
    assert t.tick() == [(key(3), "watermark"), (key(4), "watermark")]
    # The same partition late twice: each time a run (each its own run key).
    report(instance, at(5, 2), late=((at(1, 50), at(1, 51)),))
    assert t.tick() == [(key(1), "late data")]


def test_lateness_is_the_connectors_alone(instance):
    """One lateness: the connector's watermark already waits out allowed_lateness_s; the
    sensor's own setting is refused with the way to set it."""
    with pytest.raises(ValueError, match=r"watermark\.allowed_lateness_s .*30"):
        landed_through(SINK, MINUTES, target=orders_per_minute, lateness_s=30)


def test_several_connectors_on_one_sink_the_slowest_decides(instance):
    t = Ticks(instance, start=START)
    report(instance, at(3, 0), connector="a")
    report(instance, at(1, 0), connector="b")
    assert t.tick() == [(key(0), "watermark")]
    report(instance, at(5, 0), connector="b")
    assert t.tick() == [(key(1), "watermark"), (key(2), "watermark")]


def test_a_long_way_behind_it_catches_up_a_bounded_number_per_tick(instance):
    t = Ticks(instance, start=START, max_partitions_per_tick=4)
    report(instance, at(10, 0))
    assert [k for k, _ in t.tick()] == [key(m) for m in range(4)]
    assert [k for k, _ in t.tick()] == [key(m) for m in range(4, 8)]
    assert [k for k, _ in t.tick()] == [key(8), key(9)]
    assert t.tick() == []


def test_first_use_begins_at_the_first_watermark_it_sees_not_the_definitions_start(instance):
    """No flood: a definition that starts long ago, a first watermark at minute 600 (ten hours
    of minutes complete): the sensor begins with the partition holding that watermark."""
    t = Ticks(instance)
    assert t.tick() == []  # nothing reported: nothing decided
    report(instance, at(600, 30))
    assert t.tick() == []  # minute 600 is not complete; nothing before it is requested
    report(instance, at(601, 0))
    assert t.tick() == [(key(600), "watermark")]
    # Late data before where it began: not its partitions (they never ran under it).
    report(instance, at(601, 5), late=((at(10, 0), at(10, 5)), (at(600, 1), at(600, 2))))
    assert t.tick() == [(key(600), "late data")]


def test_a_declared_start_catches_up_at_a_bounded_rate_oldest_first_late_runs_first(instance):
    t = Ticks(instance, start=(START + timedelta(minutes=10)).isoformat())
    report(instance, at(23, 0))  # 13 minutes complete since the declared start
    assert [k for k, _ in t.tick()] == [key(m) for m in range(10, 15)]  # 5 a tick (default)
    report(instance, at(23, 1), late=((at(11, 0), at(12, 30)),))
    assert t.tick() == [
        (key(11), "late data"),
        (key(12), "late data"),
        *((key(m), "watermark") for m in range(15, 18)),
    ]
    assert [k for k, _ in t.tick()] == [key(m) for m in range(18, 23)]
    assert t.tick() == []


def test_late_runs_held_back_by_the_bound_wait_in_the_cursor(instance):
    t = Ticks(instance, start=START, max_partitions_per_tick=2)
    report(instance, at(4, 0))
    assert [k for k, _ in t.tick()] == [key(0), key(1)]
    report(instance, at(4, 1), late=((at(0, 10), at(1, 50)),))
    assert t.tick() == [(key(0), "late data"), (key(1), "late data")]
    report(instance, at(4, 2), late=((at(0, 5), at(1, 5)), (at(1, 30), at(1, 31))))
    assert t.tick() == [(key(0), "late data"), (key(1), "late data")]
    assert [k for k, _ in t.tick()] == [key(2), key(3)]
    assert t.tick() == []


def test_the_watermark_observations_between_materializations_count(instance):
    """A run reports its watermark as an observation as soon as it crosses a minute: the
    sensor reads those as it reads the materializations."""
    t = Ticks(instance, start=START)
    report(instance, at(0, 30))  # a materialization (progress)
    assert t.tick() == []
    report(instance, at(1, 0), observation=True)
    report(instance, at(2, 0), observation=True, late=((at(0, 40), at(0, 41)),))
    assert t.tick() == [(key(0), "watermark"), (key(1), "watermark")]
    report(instance, at(2, 5), observation=True, late=((at(0, 40), at(0, 41)),))
    assert t.tick() == [(key(0), "late data")]


def test_a_cursor_of_the_previous_release_goes_on_where_it_was(instance):
    """A cursor without ``begin`` (the previous release's): it goes on from its end, and late
    data re-runs any partition it requested, as before."""
    from conveyor.dagster.landed import LandedCursor

    t = Ticks(instance)
    report(instance, at(0, 0))
    t.tick()
    old = json.loads(t.cursor or "{}")
    t.cursor = json.dumps({"after": old["after"], "marks": {}, "end": at(3, 0)})
    report(instance, at(5, 0), late=((at(1, 10), at(1, 20)),))
    assert t.tick() == [
        (key(1), "late data"),
        (key(3), "watermark"),
        (key(4), "watermark"),
    ]
    assert LandedCursor.parse(t.cursor).begin == float("-inf")


def run_check(instance: DagsterInstance, **kw: float) -> tuple[bool, str, dict]:
    check = complete_through_check(SINK, **kw)
    job = define_asset_job("c", selection=AssetSelection.checks(check))
    defs = Definitions(assets=[AssetSpec(SINK)], asset_checks=[check], jobs=[job])
    result = defs.resolve_job_def("c").execute_in_process(instance=instance)
    [evaluation] = result.get_asset_check_evaluations()
    assert evaluation.asset_check_key == AssetCheckKey(SINK, "complete_through")
    return (
        evaluation.passed,
        evaluation.description or "",
        {k: v.value for k, v in evaluation.metadata.items()},
    )


def test_the_complete_through_check_reports_t_the_watermark(instance, monkeypatch):
    monkeypatch.setattr(checks, "clock", lambda: at(10, 0))
    passed, why, _ = run_check(instance)
    assert not passed and "no watermark" in why
    report(instance, at(2, 0), connector="a")
    report(instance, at(7, 0), connector="b")
    passed, why, meta = run_check(instance)
    assert passed and why == "complete through 2025-03-01T10:02:00Z (480 s behind)"
    assert meta["complete_through"] == at(2, 0) and meta["lag_seconds"] == 480
    passed, why, _ = run_check(instance, max_lag_s=300)
    assert not passed and "480 s behind" in why
    report(instance, at(6, 0), connector="a")
    passed, why, _ = run_check(instance, max_lag_s=300)
    assert passed and "10:06:00Z" in why
