"""The watermark rule (core/engine/watermarks.py) on Arrow batches with a fake clock, and the loop
carrying it into its progress reports (high marks of committed batches only, late ranges)."""

from __future__ import annotations

import json
from datetime import date, datetime, timezone

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.brokers.kafka import SOURCE_SCHEMA
from conveyor.core.engine.loop import (
    ConnectorLoop,
    LoopConfig,
    Progress,
    SourceBatch,
    next_offsets_of,
)
from conveyor.core.engine.watermarks import WatermarkTracker, event_seconds, merge_ranges
from conveyor.core.errors import ConfigError, DataPolicyError
from conveyor.core.model import (
    BatchPolicy,
    ConnectorSpec,
    FailurePolicyName,
    FailureSpec,
    WatermarkSpec,
)
from tests.unit.test_loop import Events, FakeCommitter, FakeSink, FakeSource, json_transform

T0 = 1_700_000_000.0  # event times are offsets from here, in seconds


def rows(*events: tuple[int, float | None], topic: str = "t") -> pa.Table:
    """``(partition, event second)`` pairs as delivered rows with a record timestamp."""
    return pa.table(
        {
            "__topic": pa.array([topic] * len(events), pa.string()),
            "__partition": pa.array([p for p, _ in events], pa.int32()),
            "__timestamp": pa.array(
                [None if s is None else int((T0 + s) * 1000) for _, s in events],
                pa.timestamp("ms", tz="UTC"),
            ),
        }
    )


def tracker(**rule: float | str) -> WatermarkTracker:
    return WatermarkTracker(WatermarkSpec(**rule), started=T0)  # type: ignore[arg-type]


def test_high_marks_per_partition_and_the_low_watermark_is_the_smallest_minus_lateness():
    w = tracker(allowed_lateness_s=5)
    w.observe(rows((0, 10), (0, 30), (0, 20), (1, 12)), T0 + 40, {"t[0]": 0, "t[1]": 3})
    now = w.current(T0 + 41, {"t[0]": 0, "t[1]": 3})
    assert now.by_partition == {"t[0]": T0 + 30, "t[1]": T0 + 12}
    assert now.low == T0 + 12 - 5
    assert now.lag_seconds == pytest.approx(41 - 7)
    assert now.idle == ()
    # High marks only move forward: an older event does not pull a partition back.
    w.observe(rows((1, 2)), T0 + 42, {"t[1]": 0})
    assert w.current(T0 + 42, {}).by_partition["t[1]"] == T0 + 12


def test_an_idle_caught_up_partition_stops_holding_the_watermark_back():
    w = tracker(idle_after_s=60)
    w.observe(rows((0, 100), (1, 5)), T0 + 100, {"t[0]": 0, "t[1]": 0})
    assert w.current(T0 + 159, {"t[0]": 0, "t[1]": 0}).low == T0 + 5  # not idle yet
    w.observe(rows((0, 170)), T0 + 170, {"t[0]": 0, "t[1]": 0})
    later = w.current(T0 + 170, {"t[0]": 0, "t[1]": 0})
    assert later.idle == ("t[1]",) and later.low == T0 + 170
    # With lag it is not idle, however long it has been quiet: its backlog may be older. It
    # holds the watermark where it is (reported already: it never goes back).
    behind = w.current(T0 + 170, {"t[0]": 0, "t[1]": 7})
    assert behind.idle == () and behind.low == T0 + 170
    # It delivers again, older events: they are late (below what was reported), and the
    # partition holds the watermark until its events pass it.
    w.take_late()
    w.observe(rows((1, 120)), T0 + 171, {"t[0]": 0, "t[1]": 0})
    assert w.current(T0 + 171, {"t[0]": 0, "t[1]": 0}).low == T0 + 170
    assert w.take_late() == ((T0 + 120, T0 + 120),)
    w.observe(rows((1, 180), (0, 185)), T0 + 185, {"t[0]": 0, "t[1]": 0})
    assert w.current(T0 + 185, {"t[0]": 0, "t[1]": 0}).low == T0 + 180


def test_all_partitions_idle_without_a_quiet_read_the_greatest_high_mark_minus_lateness():
    w = tracker(idle_after_s=10, allowed_lateness_s=2)
    w.observe(rows((0, 50), (1, 40)), T0 + 50, {"t[0]": 0, "t[1]": 0})
    wm = w.current(T0 + 61, {"t[0]": 0, "t[1]": 0})
    assert set(wm.idle) == {"t[0]", "t[1]"} and wm.low == T0 + 50 - 2


def test_a_stream_that_stops_is_complete_through_the_last_quiet_read_minus_lateness():
    """Idle means complete: everything in the log when a read last found nothing has been
    delivered, so the watermark follows those reads (minus the lateness) past the minute the
    stream stopped in, and on."""
    w = tracker(idle_after_s=10, allowed_lateness_s=2)
    lags = {"t[0]": 0, "t[1]": 0}
    w.observe(rows((0, 95), (1, 97)), T0 + 98, lags)  # the stream's last events, minute 1
    # Quiet reads, but not idle yet: the smallest high mark minus the lateness.
    assert w.current(T0 + 100, lags, quiet_at=T0 + 99.5).low == T0 + 95 - 2
    # Idle (10 s without a delivery): through the last quiet read, minus the lateness.
    wm = w.current(T0 + 108, lags, quiet_at=T0 + 107.5)
    assert set(wm.idle) == {"t[0]", "t[1]"} and wm.low == T0 + 105.5
    assert w.current(T0 + 125, lags, quiet_at=T0 + 124.9).low == pytest.approx(T0 + 122.9)
    # A partition with lag is not idle: the clock no longer counts, the watermark stays.
    assert w.current(T0 + 130, {"t[0]": 3, "t[1]": 0}, quiet_at=T0 + 129).low == pytest.approx(
        T0 + 122.9
    )
    # New events arrive: they are on time (after the watermark), active again.
    w.observe(rows((0, 131), (1, 131)), T0 + 131, lags, quiet_at=T0 + 130)
    # (the first batch came with no watermark before it: possibly late, one range a partition)
    assert w.take_late() == ((T0 + 95, T0 + 95), (T0 + 97, T0 + 97))
    assert w.current(T0 + 131, lags).low == T0 + 129


def test_report_due_when_late_ranges_wait_or_the_watermark_crosses_a_minute():
    from conveyor.core.engine.watermarks import Watermark, report_due

    minute = 60 * 28_333_333.0  # a whole minute
    assert report_due(None, Watermark(low=minute + 5, by_partition={}))  # known the first time
    assert not report_due(None, Watermark(low=None, by_partition={}))
    assert not report_due(minute + 5, Watermark(low=minute + 59.9, by_partition={}))
    assert report_due(minute + 5, Watermark(low=minute + 60, by_partition={}))
    assert report_due(minute + 5, Watermark(low=minute + 6, by_partition={}, late=((1.0, 2.0),)))


def test_a_partition_that_delivered_nothing_leaves_the_watermark_unknown_until_idle():
    w = tracker(idle_after_s=60)
    w.observe(rows((0, 10)), T0 + 10, {"t[0]": 0, "t[1]": 0})
    assert w.current(T0 + 30, {"t[0]": 0, "t[1]": 0}).low is None
    assert w.current(T0 + 30, {"t[0]": 0, "t[1]": 0}).lag_seconds is None
    # Empty since the run started 60 s ago (and caught up): idle.
    assert w.current(T0 + 60, {"t[0]": 0, "t[1]": 0}).low == T0 + 10
    # A partition with a backlog the run has not reached holds it back (where it was).
    assert w.current(T0 + 600, {"t[0]": 0, "t[1]": 4}).low == T0 + 10


def test_events_below_the_watermark_before_their_batch_are_late_ranges_reported_once():
    w = tracker(allowed_lateness_s=10)
    w.observe(rows((0, 100), (1, 100)), T0 + 100, {})
    assert w.current(T0 + 100, {}).low == T0 + 90
    w.take_late()  # the first batch's times: no watermark before it
    # 95 is within the lateness (not late); 50 and 60 on partition 0, 80 on 1 are late.
    w.observe(rows((0, 60), (0, 95), (0, 50), (1, 80), (1, None)), T0 + 101, {})
    assert w.current(T0 + 101, {}).late == ((T0 + 50, T0 + 60), (T0 + 80, T0 + 80))
    assert w.take_late() == ((T0 + 50, T0 + 60), (T0 + 80, T0 + 80))
    assert w.take_late() == () and w.current(T0 + 102, {}).late == ()


def test_while_the_watermark_is_unknown_every_event_time_may_be_late():
    """A new run does not know what an earlier run reported: its first batches' times go
    out as ranges, for a reader that acted on the earlier watermark to judge."""
    w = tracker()
    w.observe(rows((0, 30), (0, 10), (1, 20)), T0 + 1, {"t[0]": 0, "t[1]": 0, "t[2]": 0})
    assert w.current(T0 + 1, {"t[2]": 0}).low is None
    assert w.take_late() == ((T0 + 10, T0 + 30),)


def test_the_event_time_column_of_the_transform_timestamps_naive_or_dates():
    table = rows((0, 1)).append_column(
        "ts", pa.array([datetime(2025, 1, 2, 3, 4, 5)], pa.timestamp("us"))
    )
    expected = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc).timestamp()
    assert event_seconds(table, "ts").to_pylist() == [expected]
    days = rows((0, 1)).append_column("d", pa.array([date(2025, 1, 2)], pa.date32()))
    assert event_seconds(days, "d").to_pylist() == [
        datetime(2025, 1, 2, tzinfo=timezone.utc).timestamp()
    ]
    w = tracker(column="ts")
    w.observe(table, T0, {})
    assert w.current(T0, {}).low == expected


def test_a_missing_or_untimely_column_is_a_config_error_naming_the_field():
    table = rows((0, 1)).append_column("amount", pa.array([1.5]))
    with pytest.raises(ConfigError, match=r"watermark\.column.*no column 'ts'.*amount"):
        event_seconds(table, "ts")
    with pytest.raises(ConfigError, match=r"watermark\.column: column 'amount' is double"):
        event_seconds(table, "amount")


def test_the_spec_section_defaults_and_refusals():
    spec = ConnectorSpec.model_validate(
        {"name": "c", "source": {"topics": ["t"]}, "sink": {"type": "localfile"}}
    )
    assert spec.watermark == WatermarkSpec(column=None, allowed_lateness_s=0, idle_after_s=60)
    with pytest.raises(ValueError, match="idle_after_s"):
        WatermarkSpec(idle_after_s=0)
    with pytest.raises(ValueError, match="allowed_lateness_s"):
        WatermarkSpec(allowed_lateness_s=-1)


@given(
    st.lists(
        st.tuples(st.floats(0, 1e6), st.floats(0, 1e3)).map(lambda p: (p[0], p[0] + p[1])),
        max_size=40,
    ),
    st.integers(1, 8),
)
def test_merged_ranges_are_sorted_disjoint_bounded_and_cover_every_input(ranges, limit):
    out = merge_ranges(ranges, limit)
    assert len(out) <= limit
    assert all(a[1] < b[0] for a, b in zip(out, out[1:], strict=False))
    assert all(any(lo <= a and b <= hi for lo, hi in out) for a, b in ranges)


# -- the loop carries it -----------------------------------------------------------------


def timed_batch(start: int, seconds: list[float], bad: set[int] = frozenset()) -> SourceBatch:
    table = pa.Table.from_pylist(
        [
            {
                "__topic": "t",
                "__partition": 0,
                "__offset": start + i,
                "__timestamp": datetime.fromtimestamp(T0 + s, timezone.utc),
                "__key": None,
                "__headers": [],
                "__destination": None,
                "__value": b"nope" if start + i in bad else json.dumps({"id": start + i}).encode(),
            }
            for i, s in enumerate(seconds)
        ],
        schema=SOURCE_SCHEMA,
    )
    return SourceBatch(table=table, next_offsets=next_offsets_of(table))


def run_loop_over(batches: list[SourceBatch], policy: FailurePolicyName) -> list[Progress]:
    events = Events()
    source, committer = FakeSource(batches, events), FakeCommitter(events)
    reports: list[Progress] = []
    now = [T0 + 500]

    def clock() -> float:  # each look at the clock is 2 s later: every batch heartbeats
        now[0] += 2
        return now[0]

    loop = ConnectorLoop(
        LoopConfig(
            name="c",
            batch=BatchPolicy(max_wait_ms=10),
            failure=FailureSpec(policy=policy),
            prefetch=False,
            progress_interval_s=0,
        ),
        source=source,
        transform=json_transform,
        sink=FakeSink(events),
        committer=committer,
        committed={},
        stop_requested=lambda: not source.batches,
        on_progress=reports.append,
        clock=clock,
    )
    if policy == FailurePolicyName.FAIL:
        with pytest.raises(DataPolicyError):
            loop.run()
    else:
        loop.run()
    return reports


def test_the_loops_progress_carries_the_watermark_of_committed_batches_and_late_ranges():
    reports = run_loop_over(
        [timed_batch(0, [10, 40, 30]), timed_batch(3, [50, 20, 60])], FailurePolicyName.DISCARD
    )
    final = reports[-1]
    assert final.final and final.watermark is not None
    assert final.watermark.by_partition == {"t[0]": T0 + 60}
    assert final.watermark.low == T0 + 60
    assert final.watermark.lag_seconds is not None and final.watermark.lag_seconds > 440
    # 20 came after 40 had been committed: late, reported once (the first batch's times
    # were reported as possibly late while the run had no watermark yet).
    late = [r.watermark.late for r in reports if r.watermark and r.watermark.late]
    assert late == [((T0 + 10, T0 + 40),), ((T0 + 20, T0 + 20),)]


def test_under_the_fail_policy_only_the_committed_rows_before_the_failure_move_it():
    reports = run_loop_over([timed_batch(0, [10, 70, 90], bad={2})], FailurePolicyName.FAIL)
    assert reports[-1].watermark is not None
    assert reports[-1].watermark.by_partition == {"t[0]": T0 + 70}
