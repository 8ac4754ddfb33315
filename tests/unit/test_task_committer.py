"""A task run's committer (conveyor/dagster/jobs/tasks.py): per-partition samples and directives."""

from __future__ import annotations

from types import SimpleNamespace

from conveyor.core.engine.stopping import Directive
from conveyor.core.model import ConnectorStatus, Counters, DesiredState, TopicPartition
from conveyor.dagster.jobs.tasks import TaskCommitter
from conveyor.store.tasks import CommitResult, Grant

A, B, C = (TopicPartition("t", i) for i in range(3))


class FakeTasks:
    def __init__(self, grant: Grant):
        self.grant = grant
        self.samples: list = []
        self.commits: list = []
        self.meta = SimpleNamespace(get=lambda name: SimpleNamespace(spec_hash="h1"))

    def heartbeat(self, name, task_id, generation, sample=None, **kw):  # type: ignore[no-untyped-def]
        self.samples.append(sample)
        return self.grant

    def commit(self, name, task_id, generation, offsets, owned, scope=None):  # type: ignore[no-untyped-def]
        self.commits.append((dict(offsets), dict(owned)))
        ok = {tp: o for tp, o in offsets.items() if tp in self.grant.owned}
        return CommitResult(ok, frozenset(offsets) - frozenset(ok))


class FakeSource:
    discovered = [A, B, C]

    def __init__(self) -> None:
        self.mirrored: list = []

    def highwaters(self):  # type: ignore[no-untyped-def]
        return {A: 150, B: 400}

    def mirror_commit(self, offsets):  # type: ignore[no-untyped-def]
        self.mirrored.append(offsets)


def committer(grant: Grant, clock: list[float]) -> tuple[TaskCommitter, FakeTasks, FakeSource]:
    tasks, source = FakeTasks(grant), FakeSource()
    c = TaskCommitter(
        tasks,  # type: ignore[arg-type]
        "c",
        0,
        1,
        source,  # type: ignore[arg-type]
        grant,
        spec_hash="h1",
        run_id="r",
        sample_interval_s=5.0,
        committed={A: 100, B: 300},
        clock=lambda: clock[0],
    )
    return c, tasks, source


def beat(c: TaskCommitter) -> Directive:
    return c.heartbeat(Counters(), ConnectorStatus.RUNNING, None)


def test_samples_rate_and_lag_per_partition_at_the_interval():
    clock = [0.0]
    grant = Grant(0, 1, {A: 1, B: 1}, frozenset())
    c, tasks, source = committer(grant, clock)
    c.commit({A: 120, B: 300})
    clock[0] = 2.0
    assert beat(c) == Directive.RUN and tasks.samples == [None], "not yet a sample"
    clock[0] = 10.0
    c.commit({A: 150})
    assert beat(c) == Directive.RUN
    sample = tasks.samples[-1]
    assert sample.rates == {A: 5.0, B: 0.0} and sample.lags == {A: 0, B: 100}
    assert tasks.commits[0][1] == {A: 1, B: 1}, "commits carry the grant's epochs"
    assert source.mirrored[-1] == {A: 150}


def test_a_changed_grant_reconfigures_and_a_stop_stops():
    clock = [0.0]
    c, tasks, _ = committer(Grant(0, 1, {A: 1, B: 1}, frozenset()), clock)
    tasks.grant = Grant(0, 1, {A: 1, B: 1}, frozenset({B}))  # B to hand over
    assert beat(c) == Directive.RECONFIGURE
    tasks.grant = Grant(0, 1, {A: 1, B: 1, C: 4}, frozenset())  # C handed to it
    assert beat(c) == Directive.RECONFIGURE
    tasks.grant = Grant(0, 1, {A: 1, B: 1}, frozenset(), desired=DesiredState.PAUSED)
    assert beat(c) == Directive.PAUSE
    tasks.grant = Grant(0, 1, {A: 1, B: 1}, frozenset(), desired=DesiredState.STOPPED)
    assert beat(c) == Directive.STOP


def test_a_refused_commit_ends_the_loop_at_the_next_heartbeat():
    clock = [0.0]
    c, tasks, _ = committer(Grant(0, 1, {A: 1, B: 1}, frozenset()), clock)
    tasks.grant = Grant(0, 1, {A: 1}, frozenset())  # B was taken (forced handover)
    c.commit({A: 110, B: 310})
    assert c.committed[B] == 300 and c.refused == {B}
    assert beat(c) == Directive.RECONFIGURE
