"""Liveness from stage deadlines, a supervisor's heartbeats, and the loop's infrastructure retries."""

from __future__ import annotations

import threading

import pytest

from conveyor.core.engine.liveness import Stage, StageClock, Supervisor, verdict
from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, run_loop
from conveyor.core.errors import FencedError, TransientSourceError, TransientStoreError
from conveyor.core.model import BatchPolicy, ConnectorStatus, LivenessSpec, RetrySpec
from tests.unit.test_loop import (
    TP0,
    Events,
    FakeCommitter,
    FakeSink,
    FakeSource,
    json_transform,
    make_loop,
    source_batch,
)

SPEC = LivenessSpec()  # defaults: Degraded after 30 s, restart after 300 s


# -- the pure verdict ------------------------------------------------------------------


def test_nothing_under_way_is_healthy():
    assert not verdict([], 1000.0, SPEC).stuck


def test_a_send_past_its_deadline_is_stuck_and_named():
    v = verdict([(Stage.SEND, 1000.0)], 1031.0, SPEC)
    assert v.stuck and v.stage == Stage.SEND and not v.restart
    assert "stage send" in v.reason() and "30s deadline" in v.reason()
    assert not verdict([(Stage.SEND, 1000.0)], 1029.0, SPEC).stuck


def test_a_read_may_also_wait_for_records():
    assert not verdict([(Stage.READ, 1000.0)], 1031.0, SPEC, read_wait_s=5).stuck
    assert verdict([(Stage.READ, 1000.0)], 1036.0, SPEC, read_wait_s=5).stage == Stage.READ


def test_past_the_second_limit_the_run_restarts():
    v = verdict([(Stage.READ, 1000.0), (Stage.TRANSFORM, 1000.0)], 1300.0, SPEC, read_wait_s=5)
    assert v.restart and v.stage == Stage.TRANSFORM and "restarts itself" in v.reason()


def test_the_most_overdue_stage_is_reported():
    v = verdict([(Stage.SEND, 1000.0), (Stage.TRANSFORM, 990.0)], 1040.0, SPEC)
    assert v.stage == Stage.TRANSFORM


def test_restart_limit_must_exceed_the_deadline():
    with pytest.raises(ValueError, match="restart_after_s"):
        LivenessSpec(stage_deadline_s=60, restart_after_s=30)


def test_stage_clock_tracks_concurrent_stages():
    now = [0.0]
    sc = StageClock(lambda: now[0])
    with sc.stage(Stage.SEND):
        now[0] = 1.0
        with sc.stage(Stage.READ):
            assert sc.active() == [(Stage.SEND, 0.0), (Stage.READ, 1.0)]
        assert sc.active() == [(Stage.SEND, 0.0)]
    assert sc.active() == []


# -- the supervisor ----------------------------------------------------------------------


class FakeSupervised:
    def __init__(self, clock):
        self.stages = StageClock(clock)
        self.status = ConnectorStatus.RUNNING
        self.beat_requested = threading.Event()
        self.beats: list = []
        self.reports: list = []
        self.fail_beats = 0

    def beat(self, override=None):
        if self.fail_beats:
            self.fail_beats -= 1
            raise TransientStoreError("meta store: heartbeat failed: database is locked")
        self.beats.append(override)

    def report(self, status, reason):
        self.reports.append((status, reason))


def test_supervisor_heartbeats_steadily_and_reports_a_stuck_stage_once():
    now = [0.0]
    loop = FakeSupervised(lambda: now[0])
    sup = Supervisor(loop, SPEC, interval_s=1.0, clock=lambda: now[0])
    sup.tick()
    assert loop.beats == [None]
    with loop.stages.stage(Stage.SEND):
        # A send of 90 s: heartbeats go on every second, Degraded from 30 s, no restart.
        for _ in range(360):
            now[0] += 0.25
            assert not sup.tick().restart
        assert len(loop.beats) >= 85
        degraded = [r for r in loop.reports if r[0] == ConnectorStatus.DEGRADED]
        assert len(degraded) == 1 and "stage send" in degraded[0][1]
        assert loop.beats[-1] == ConnectorStatus.DEGRADED
    now[0] += 0.25
    sup.tick()
    assert loop.reports[-1] == (ConnectorStatus.RUNNING, loop.reports[-1][1])
    assert "send finished" in loop.reports[-1][1]
    assert loop.beats[-1] is None


def test_supervisor_asks_for_a_restart_past_the_second_limit():
    now = [0.0]
    loop = FakeSupervised(lambda: now[0])
    sup = Supervisor(
        loop, LivenessSpec(stage_deadline_s=5, restart_after_s=20), clock=lambda: now[0]
    )
    with loop.stages.stage(Stage.TRANSFORM):
        verdicts = []
        for _ in range(100):
            now[0] += 0.25
            verdicts.append(sup.tick())
    stuck = [v for v in verdicts if v.stuck]
    assert stuck[0].stage == Stage.TRANSFORM and not stuck[0].restart
    assert verdicts[-1].restart


def test_supervisor_reports_meta_store_trouble_and_goes_on():
    now = [0.0]
    loop = FakeSupervised(lambda: now[0])
    sup = Supervisor(loop, SPEC, interval_s=1.0, clock=lambda: now[0])
    loop.fail_beats = 3
    for _ in range(30):
        now[0] += 0.25
        sup.tick()
    reasons = [r[1] for r in loop.reports]
    assert sum("meta store unavailable" in r for r in reasons) == 1
    assert reasons[-1] == "meta store reachable again"
    assert loop.beats  # heartbeats resumed


# -- the loop: retries of infrastructure errors, fencing before a send ---------------------


def test_a_supervised_loop_leaves_heartbeats_to_the_supervisor_and_never_waits_in_a_stage():
    """A 60 s wait between outage retries is no stage: nothing is overdue while it lasts."""
    events = Events()
    sink = FakeSink(events, transient_failures=3)
    loop, _, sink, committer, events, sleeps = make_loop(
        [source_batch(0, 10)], sink=sink, events=events, retry=RetrySpec(delay=60, jitter="none")
    )
    loop.supervised = True
    waits = []
    inner = loop._sleep

    def sleep(s):
        waits.append(list(loop.stages.active()))
        inner(s)

    loop._sleep = sleep
    run_loop(loop)
    assert sink.rows == list(range(10)) and committer.offsets == {TP0: 10}
    assert waits == [[], [], []] and committer.heartbeats == []
    loop.beat()
    statuses = [h[0] for h in committer.heartbeats]
    assert ConnectorStatus.DEGRADED in statuses and statuses[-1] == ConnectorStatus.RUNNING


class StoreTroubleCommitter(FakeCommitter):
    def __init__(self, events, *, locked_commits=0, fenced_before_send=False):
        super().__init__(events)
        self.locked_commits = locked_commits
        self.fenced_before_send = fenced_before_send

    def commit(self, offsets):
        if self.locked_commits:
            self.locked_commits -= 1
            raise TransientStoreError("meta store: committing offsets failed: database is locked")
        super().commit(offsets)

    def ensure_current(self):
        if self.fenced_before_send:
            raise FencedError("generation 3 is no longer current (now 4); not sending")


def test_a_locked_meta_store_is_retried_as_an_outage_and_shown_degraded():
    events = Events()
    committer = StoreTroubleCommitter(events, locked_commits=2)
    loop, _, sink, committer, _, sleeps = make_loop(
        [source_batch(0, 10), source_batch(10, 10)], committer=committer, events=events
    )
    run_loop(loop)
    assert sink.rows == list(range(20)) and committer.offsets == {TP0: 20}
    assert len(sleeps) == 2
    degraded = [h for h in committer.heartbeats if h[0] == ConnectorStatus.DEGRADED]
    assert degraded and "commit failed" in degraded[0][1] and "database is locked" in degraded[0][1]
    assert committer.heartbeats[-1][0] == ConnectorStatus.RUNNING


def test_a_fenced_run_sends_nothing_more():
    events = Events()
    committer = StoreTroubleCommitter(events, fenced_before_send=True)
    loop, _, sink, committer, _, _ = make_loop(
        [source_batch(0, 10)], committer=committer, events=events
    )
    with pytest.raises(FencedError):
        run_loop(loop)
    assert sink.rows == [] and committer.offsets == {}


def test_a_fence_seen_by_a_heartbeat_stops_the_loop_before_its_next_send():
    events = Events()
    loop, _, sink, committer, _, _ = make_loop([source_batch(0, 10)], events=events)
    loop.fence(FencedError("generation 3 is no longer current"))
    with pytest.raises(FencedError):
        run_loop(loop)
    assert sink.rows == []


class FlakySource(FakeSource):
    """A broker that goes away for two reads and comes back."""

    def __init__(self, batches, events, failures=2):
        super().__init__(batches, events)
        self.failures = failures

    def read(self, policy):
        if self.failures:
            self.failures -= 1
            raise TransientSourceError("reading from 127.0.0.1:9092 failed: NoBrokersAvailable")
        return super().read(policy)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_transient_read_error_is_retried_not_fatal(prefetch):
    events = Events()
    batches = [source_batch(0, 10), source_batch(10, 10)]
    source = FlakySource(batches, events)
    sink = FakeSink(events)
    committer = FakeCommitter(events)
    done = threading.Event()

    def stop():
        if committer.offsets == {TP0: 20}:
            done.set()
        return done.is_set()

    loop = ConnectorLoop(
        LoopConfig(
            name="c",
            batch=BatchPolicy(max_wait_ms=10),
            retry=RetrySpec(delay=0.01, jitter="none"),
            prefetch=prefetch,
        ),
        source=source,
        transform=json_transform,
        sink=sink,
        committer=committer,
        committed={},
        stop_requested=stop,
    )
    run_loop(loop)
    assert sink.rows == list(range(20)) and committer.offsets == {TP0: 20}
    assert loop.counters.retries == 2
    assert any(
        h[0] == ConnectorStatus.DEGRADED and "read failed" in (h[1] or "")
        for h in committer.heartbeats
    )
