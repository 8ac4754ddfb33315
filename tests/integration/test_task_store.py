"""Partition tasks in the meta store (SQLite and PostgreSQL): ownership, fenced commits, handover."""

from __future__ import annotations

import pytest

from conveyor.core.errors import FencedError
from conveyor.core.model import TopicPartition
from conveyor.core.planning import tasks as tk
from conveyor.store.tasks import TaskStore
from tests.integration.test_store import add, store  # noqa: F401  (the parametrized fixture)

P = [TopicPartition("orders", i) for i in range(4)]
POLICY = tk.TaskPolicy(min_tasks=1, max_tasks=3, lag_samples=2, min_backlog=10, backlog_s=0.1)
BROKERS = [tk.BrokerSlot("b1", free=5), tk.BrokerSlot("b2", free=5, load=0.5)]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ts(store):  # noqa: F811
    clock = Clock()
    store.clock = clock
    add(store, "c1")
    s = TaskStore(store)
    return s


def plan(ts: TaskStore, brokers=BROKERS):
    group, epoch = ts.load_group("c1", POLICY, P)
    p = tk.plan_tasks([group], brokers, ts.meta.clock())
    ts.apply("c1", p.for_connector("c1"), expected_epoch=epoch, ceiling=p.ceilings.get("c1"))
    return p.for_connector("c1")


def start(ts: TaskStore) -> None:
    (d,) = plan(ts)
    assert isinstance(d, tk.StartTasks)


def split_task0(ts: TaskStore) -> tk.Split:
    ts.heartbeat(
        "c1", 0, 1, tk.TaskSample(ts.meta.clock(), dict.fromkeys(P, 5.0), dict.fromkeys(P, 10))
    )
    ts.meta.clock.now += 5  # type: ignore[attr-defined]
    ts.heartbeat(
        "c1", 0, 1, tk.TaskSample(ts.meta.clock(), dict.fromkeys(P, 5.0), dict.fromkeys(P, 40))
    )
    (d,) = plan(ts)
    assert isinstance(d, tk.Split)
    return d


def test_start_creates_one_task_owning_every_partition(ts):
    start(ts)
    (row,) = ts.tasks("c1")
    assert (row.task_id, row.generation, row.broker_id, row.status) == (0, 1, "b1", "Starting")
    grant = ts.grant("c1", 0, 1)
    assert set(grant.owned) == set(P) and grant.releasing == frozenset()
    assert any("tasks: 1 task(s) for 4 partition(s)" in h.reason for h in ts.meta.history("c1"))


def test_commit_is_fenced_per_partition(ts):
    start(ts)
    g0 = ts.grant("c1", 0, 1)
    res = ts.commit("c1", 0, 1, {P[0]: 10, P[1]: 20}, g0.owned)
    assert res.committed == {P[0]: 10, P[1]: 20} and res.refused == frozenset()
    assert ts.meta.committed_offsets("c1") == {P[0]: 10, P[1]: 20}
    with pytest.raises(FencedError):
        ts.commit("c1", 0, 2, {P[0]: 11}, g0.owned)  # a generation it never had
    with pytest.raises(FencedError):
        ts.commit("c1", 7, 1, {P[0]: 11}, g0.owned)  # no such task


def test_split_hands_over_at_the_batch_boundary_from_exactly_the_committed_offsets(ts):
    start(ts)
    g0 = ts.grant("c1", 0, 1)
    ts.commit("c1", 0, 1, dict.fromkeys(P, 100), g0.owned)
    d = split_task0(ts)
    assert d.new_task_id == 1
    history = [h.reason for h in ts.meta.history("c1")]
    assert any("split task 0: lag grew in 2 samples (40 -> 160)" in r for r in history)

    # the old owner keeps reading the moving partitions while the new owner's run starts
    assert ts.heartbeat("c1", 0, 1).releasing == frozenset()
    g1 = ts.heartbeat("c1", 1, 1)  # its run is up
    assert g1.owned == {}
    # ... then releases them at its next batch boundary
    g0 = ts.heartbeat("c1", 0, 1)
    assert g0.releasing == d.moving and set(g0.owned) == set(P)
    view, _ = ts.load_group("c1", POLICY, P)
    assert view.task(1).partitions == d.moving  # the planner counts them as moved
    assert view.task(0).partitions == frozenset(P) - d.moving

    # its last batch before the boundary is committed with the release, in one transaction
    moving = sorted(d.moving)
    handed = ts.release("c1", 0, 1, {moving[0]: 150}, g0.owned)
    assert handed == {moving[0]: 150, **{tp: 100 for tp in moving[1:]}}
    g1 = ts.heartbeat("c1", 1, 1)
    assert set(g1.owned) == d.moving and g1.releasing == frozenset()
    assert {tp: ts.meta.committed_offsets("c1")[tp] for tp in d.moving} == handed

    # the old owner's late commit for a moved partition is refused; its own go through
    kept = sorted(frozenset(P) - d.moving)
    res = ts.commit("c1", 0, 1, {moving[0]: 999, kept[0]: 120}, g0.owned)
    assert res.committed == {kept[0]: 120} and res.refused == {moving[0]}
    res = ts.commit("c1", 1, 1, {moving[0]: 160}, g1.owned)
    assert res.committed == {moving[0]: 160}
    assert ts.meta.committed_offsets("c1")[moving[0]] == 160
    assert any("task 0 handed over" in h.reason for h in ts.meta.history("c1"))


def test_a_partition_that_moved_away_and_back_refuses_the_old_grant(ts):
    start(ts)
    old = ts.grant("c1", 0, 1).owned
    d = split_task0(ts)
    ts.heartbeat("c1", 1, 1)
    ts.release("c1", 0, 1, {}, old)
    # merge back: task 1 gives its partitions to task 0
    merge = tk.Merge(
        "c1",
        "test merge",
        tk.TaskChange(
            partitions={0: frozenset(P)}, removed=frozenset({1}), counts_for_cooldown=True
        ),
        {},
        task_id=1,
        into_task_id=0,
        moving=d.moving,
    )
    ts.apply("c1", [merge])
    g1 = ts.grant("c1", 1, 1)
    ts.release("c1", 1, 1, {}, g1.owned)
    assert [r.task_id for r in ts.tasks("c1")] == [0], "the merged task's row is gone"
    new = ts.grant("c1", 0, 1).owned
    tp = sorted(d.moving)[0]
    assert new[tp] > old[tp]
    res = ts.commit("c1", 0, 1, {tp: 5}, old)
    assert res.refused == {tp}, "a commit from before the move is stale"
    assert ts.commit("c1", 0, 1, {tp: 5}, new).committed == {tp: 5}
    with pytest.raises(FencedError):
        ts.heartbeat("c1", 1, 1)  # the merged task's run finds itself gone and ends


def test_an_owner_that_never_releases_is_overtaken_after_the_timeout(ts):
    start(ts)
    g0 = ts.grant("c1", 0, 1)
    ts.commit("c1", 0, 1, dict.fromkeys(P, 42), g0.owned)
    d = split_task0(ts)
    assert ts.force_handovers("c1", older_than=ts.meta.clock() - 30) == {}
    ts.meta.clock.now += 31
    ts.heartbeat("c1", 0, 1)  # the owner is alive and the new owner not up: nothing to force
    assert ts.force_handovers("c1", older_than=ts.meta.clock() - 30) == {}
    ts.meta.clock.now += 31  # now the owner is silent
    moved = ts.force_handovers("c1", older_than=ts.meta.clock() - 30, reason="task 0 silent")
    assert moved == dict.fromkeys(d.moving, 42), "from the last committed offsets: nothing lost"
    assert set(ts.grant("c1", 1, 1).owned) == d.moving
    assert any("task 0 silent" in h.reason for h in ts.meta.history("c1"))


def test_a_dead_task_loses_its_partitions_at_once_and_a_lone_one_restarts_fenced(ts):
    start(ts)
    g0 = ts.grant("c1", 0, 1)
    d = split_task0(ts)
    ts.heartbeat("c1", 1, 1)
    ts.release("c1", 0, 1, {}, g0.owned)
    ts.meta.clock.now += 40  # task 1 silent past the 30 s timeout; task 0 alive
    ts.heartbeat("c1", 0, 1)
    (dead,) = plan(ts)
    assert isinstance(dead, tk.ReclaimDead) and dead.task_id == 1
    assert set(ts.grant("c1", 0, 1).owned) == set(P)
    assert [r.task_id for r in ts.tasks("c1")] == [0]

    ts.meta.clock.now += 40  # now task 0 too: restarted in place with a new generation
    (restart,) = plan(ts)
    assert isinstance(restart, tk.RestartTask)
    with pytest.raises(FencedError):
        ts.commit("c1", 0, 1, {P[0]: 1}, g0.owned)
    g = ts.grant("c1", 0, 2)
    assert set(g.owned) == set(P)
    assert d.moving <= set(g.owned)


def test_a_plan_made_on_an_older_epoch_is_refused(ts):
    start(ts)
    group, epoch = ts.load_group("c1", POLICY, P)
    ts.apply("c1", [], ceiling=None)  # nothing
    ts.heartbeat("c1", 0, 1)
    split = tk.Split(
        "c1",
        "x",
        tk.TaskChange(partitions={0: frozenset(P[:2]), 5: frozenset(P[2:])}, brokers={5: "b1"}),
        {},
    )
    ts.apply("c1", [split], expected_epoch=epoch)
    with pytest.raises(FencedError, match="changed since the plan"):
        ts.apply("c1", [split], expected_epoch=epoch)


def test_heartbeat_samples_are_spaced_and_bounded(ts):
    start(ts)
    for i in range(60):
        ts.meta.clock.now += 1
        ts.heartbeat(
            "c1",
            0,
            1,
            tk.TaskSample(ts.meta.clock(), {P[0]: float(i)}, {P[0]: i}),
            run_id="r1",
            sample_interval_s=2.0,
        )
    (row,) = ts.tasks("c1")
    assert len(row.samples) == 20 and row.run_id == "r1" and row.status == "Running"
    assert all(b.at - a.at >= 2 for a, b in zip(row.samples, row.samples[1:], strict=False))
    assert row.latest().rates == {P[0]: 58.0} and row.latest().lags == {P[0]: 58}  # every 2nd


def test_drop_forgets_the_tasks(ts):
    start(ts)
    ts.drop("c1")
    assert ts.tasks("c1") == [] and ts.epoch("c1") == 0
