"""The partition-task planner (conveyor/core/planning/tasks.py): split, merge, dead tasks, bounds.

A small simulated world drives it tick by tick: partitions receive messages at a set
rate, each task reads at most ``capacity`` messages/s (spread over its partitions in
proportion to what they hold), and reports per-partition rate and lag like a heartbeat.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from conveyor.core.model import ConnectorSpec, TasksSpec, TopicPartition
from conveyor.core.planning import tasks as tk

TP = TopicPartition
DT = 5.0


def parts(n: int, topic: str = "t") -> list[TopicPartition]:
    return [TP(topic, i) for i in range(n)]


def policy(**kw) -> tk.TaskPolicy:
    base = dict(
        min_tasks=1,
        max_tasks=3,
        cooldown_s=10.0,
        lag_samples=3,
        min_backlog=100,
        backlog_s=1.0,
        heartbeat_timeout_s=30.0,
        launch_timeout_s=60.0,
    )
    base.update(kw)
    return tk.TaskPolicy(**base)


BROKERS = [tk.BrokerSlot("b1", free=10, load=0.0), tk.BrokerSlot("b2", free=10, load=0.5)]


class World:
    def __init__(self, n: int, capacity: float, pol: tk.TaskPolicy, incoming: float = 0.0):
        self.parts = parts(n)
        self.capacity = capacity
        self.incoming = {tp: incoming / n for tp in self.parts}
        self.lag = {tp: 0.0 for tp in self.parts}
        self.now = 1_000.0
        self.group = tk.TaskGroup("c", pol, frozenset(self.parts))
        self.history: list[tk.TaskDecision] = []
        self.silent: set[int] = set()  # tasks whose run died: no heartbeat, no reading

    def set_total(self, total: float) -> None:
        self.incoming = {tp: total / len(self.parts) for tp in self.parts}

    def tick(self) -> list[tk.TaskDecision]:
        for tp in self.parts:
            self.lag[tp] += self.incoming[tp] * DT
        tasks = []
        for t in self.group.tasks:
            if t.task_id in self.silent:
                tasks.append(t)
                continue
            held = {tp: self.lag[tp] for tp in t.partitions}
            total = sum(held.values())
            frac = min(1.0, self.capacity * DT / total) if total else 0.0
            rates, lags = {}, {}
            for tp, h in held.items():
                read = h * frac
                self.lag[tp] = h - read
                rates[tp] = read / DT
                lags[tp] = int(self.lag[tp])
            sample = tk.TaskSample(self.now, rates, lags)
            tasks.append(replace(t, heartbeat_at=self.now, samples=(*t.samples, sample)[-20:]))
        self.group = replace(self.group, tasks=tuple(tasks))
        self.now += DT
        plan = tk.plan_tasks([self.group], BROKERS, self.now)
        self.group = plan.groups["c"]
        owned = [tp for t in self.group.tasks for tp in t.partitions]
        assert sorted(owned) == sorted(self.parts), "every partition owned exactly once"
        self.history += plan.decisions
        for d in plan.decisions:
            if isinstance(d, tk.RestartTask):
                self.silent.discard(d.task_id)  # a new run
        return plan.decisions

    def run(self, ticks: int) -> list[tk.TaskDecision]:
        out: list[tk.TaskDecision] = []
        for _ in range(ticks):
            out += self.tick()
        return out

    @property
    def n_tasks(self) -> int:
        return len(self.group.tasks)


# -- the spec --------------------------------------------------------------------------


def test_spec_defaults_keep_one_task():
    spec = ConnectorSpec.model_validate(
        {"name": "c", "source": {"topics": ["t"]}, "sink": {"type": "localfile"}}
    )
    assert (spec.tasks.min, spec.tasks.max) == (1, 1)
    pol = tk.TaskPolicy.from_spec(spec.tasks, heartbeat_timeout_s=spec.heartbeat_timeout_s)
    assert (pol.min_tasks, pol.max_tasks, pol.heartbeat_timeout_s) == (1, 1, 30.0)


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"min": 3, "max": 2}, "above tasks.max"),
        ({"max": 3, "merge_below": 0.9, "split_at": 0.8}, "merged back"),
        ({"max": 0}, "greater than or equal to 1"),
    ],
)
def test_spec_refuses_bad_bounds(bad, words):
    with pytest.raises(ValidationError, match=words):
        TasksSpec.model_validate(bad)


# -- single rules ----------------------------------------------------------------------


def test_start_deals_partitions_round_robin_on_least_loaded_brokers():
    g = tk.TaskGroup("c", policy(min_tasks=3), frozenset(parts(6)))
    plan = tk.plan_tasks([g], BROKERS, 0.0)
    (d,) = plan.decisions
    assert isinstance(d, tk.StartTasks)
    after = plan.groups["c"]
    assert [len(t.partitions) for t in after.tasks] == [2, 2, 2]
    assert sorted(t.broker_id for t in after.tasks) == ["b1", "b1", "b2"]


def test_start_waits_until_partitions_are_known():
    g = tk.TaskGroup("c", policy(), frozenset())
    assert tk.plan_tasks([g], BROKERS, 0.0).decisions == []


def test_halve_by_load_not_by_count():
    loads = {TP("t", 0): 100.0, TP("t", 1): 10.0, TP("t", 2): 10.0, TP("t", 3): 10.0}
    kept, moving = tk.halve_by_load(loads)
    assert {kept, moving} == {
        frozenset({TP("t", 0)}),
        frozenset({TP("t", 1), TP("t", 2), TP("t", 3)}),
    }
    kept, moving = tk.halve_by_load(dict.fromkeys(parts(4), 0.0))
    assert len(kept) == len(moving) == 2
    with pytest.raises(ValueError):
        tk.halve_by_load({TP("t", 0): 1.0})


def _task(tid, ps, samples=(), hb=100.0, changed=0.0, broker="b1"):
    return tk.TaskView(
        tid, frozenset(ps), broker, 1, heartbeat_at=hb, changed_at=changed, samples=tuple(samples)
    )


def _samples(ps, rates, lags, start=50.0):
    return [
        tk.TaskSample(
            start + i * DT,
            {tp: r / len(ps) for tp in ps},
            {tp: lg // len(ps) for tp in ps},
        )
        for i, (r, lg) in enumerate(zip(rates, lags, strict=True))
    ]


def test_split_on_growing_lag_carries_its_figures():
    ps = parts(4)
    t0 = _task(0, ps, _samples(ps, [100, 100, 100], [400, 800, 1200]))
    g = tk.TaskGroup("c", policy(), frozenset(ps), (t0,), next_task_id=1)
    plan = tk.plan_tasks([g], BROKERS, 100.0)
    (d,) = plan.decisions
    assert isinstance(d, tk.Split)
    assert (d.task_id, d.new_task_id, d.broker_id, len(d.moving)) == (0, 1, "b1", 2)
    assert d.figures["lag_first"] == 400 and d.figures["lag_last"] == 1200
    assert "lag grew in 3 samples (400 -> 1200)" in d.reason
    after = plan.groups["c"]
    assert after.task(1).partitions == d.moving
    assert after.task(0).partitions == frozenset(ps) - d.moving
    assert after.last_change_at == 100.0


def test_split_at_the_configured_ceiling():
    ps = parts(2)
    t0 = _task(0, ps, _samples(ps, [950, 950], [0, 0]))
    g = tk.TaskGroup("c", policy(ceiling_msgs_per_s=1000.0), frozenset(ps), (t0,))
    (d,) = tk.plan_tasks([g], BROKERS, 100.0).decisions
    assert isinstance(d, tk.Split)
    assert d.figures["ceiling"] == 1000.0 and d.figures["rate"] == 950.0


def test_no_split_within_cooldown_nor_beyond_max():
    ps = parts(4)
    growing = _samples(ps, [100, 100, 100], [400, 800, 1200])
    g = tk.TaskGroup("c", policy(), frozenset(ps), (_task(0, ps, growing),), last_change_at=95.0)
    assert tk.plan_tasks([g], BROKERS, 100.0).decisions == []
    g = replace(g, last_change_at=None, policy=policy(max_tasks=1))
    assert tk.plan_tasks([g], BROKERS, 100.0).decisions == []


def test_lag_measured_before_the_last_change_does_not_split_again():
    ps = parts(4)
    growing = _samples(ps, [100, 100, 100], [400, 800, 1200])
    g = tk.TaskGroup("c", policy(), frozenset(ps), (_task(0, ps, growing, changed=62.0),))
    assert tk.plan_tasks([g], BROKERS, 100.0).decisions == []


def test_no_split_without_broker_room():
    ps = parts(4)
    g = tk.TaskGroup(
        "c", policy(), frozenset(ps), (_task(0, ps, _samples(ps, [1] * 3, [400, 800, 1200])),)
    )
    full = [tk.BrokerSlot("b1", free=0), tk.BrokerSlot("b2", free=5, healthy=False)]
    assert tk.plan_tasks([g], full, 100.0).decisions == []


def test_merge_two_cold_tasks_below_the_ceiling():
    a, b, c = parts(3)
    tasks = (
        _task(0, [a], _samples([a], [100, 100], [0, 0])),
        _task(1, [b], _samples([b], [50, 50], [0, 0])),
        _task(2, [c], _samples([c], [600, 600], [0, 0])),
    )
    g = tk.TaskGroup("c", policy(), frozenset([a, b, c]), tasks, ceiling=1000.0)
    plan = tk.plan_tasks([g], BROKERS, 100.0)
    (d,) = plan.decisions
    assert isinstance(d, tk.Merge)
    assert (d.task_id, d.into_task_id, d.moving) == (1, 0, frozenset([b]))
    assert d.figures["combined_rate"] == 150.0 and d.figures["ceiling"] == 1000.0
    assert [t.task_id for t in plan.groups["c"].tasks] == [0, 2]


def test_no_merge_below_min_or_without_a_ceiling():
    a, b = parts(2)
    tasks = (
        _task(0, [a], _samples([a], [10, 10], [0, 0])),
        _task(1, [b], _samples([b], [10, 10], [0, 0])),
    )
    g = tk.TaskGroup("c", policy(), frozenset([a, b]), tasks)
    assert tk.plan_tasks([g], BROKERS, 100.0).decisions == []  # never saturated: no ceiling
    g = replace(g, ceiling=1000.0, policy=policy(min_tasks=2))
    assert tk.plan_tasks([g], BROKERS, 100.0).decisions == []


def test_bounds_apply_without_cooldown():
    a, b, c, d = parts(4)
    g = tk.TaskGroup(
        "c",
        policy(min_tasks=2),
        frozenset([a, b, c, d]),
        (_task(0, [a, b, c, d]),),
        last_change_at=99.0,
    )
    (dec,) = tk.plan_tasks([g], BROKERS, 100.0).decisions
    assert isinstance(dec, tk.Split) and "below tasks.min" in dec.reason
    tasks = tuple(_task(i, [tp]) for i, tp in enumerate([a, b, c, d]))
    g = tk.TaskGroup("c", policy(max_tasks=3), frozenset([a, b, c, d]), tasks, last_change_at=99.0)
    (dec,) = tk.plan_tasks([g], BROKERS, 100.0).decisions
    assert isinstance(dec, tk.Merge) and "above tasks.max" in dec.reason


def test_dead_task_loses_its_partitions_to_the_live_ones():
    a, b, c, d = parts(4)
    tasks = (
        _task(0, [a, b], hb=100.0),
        _task(1, [c], hb=60.0),  # 40 s silent
        _task(2, [d], hb=100.0),
    )
    g = tk.TaskGroup("c", policy(), frozenset([a, b, c, d]), tasks)
    plan = tk.plan_tasks([g], BROKERS, 100.0)
    (dec,) = plan.decisions
    assert isinstance(dec, tk.ReclaimDead) and dec.task_id == 1
    assert dec.figures["heartbeat_age_s"] == 40.0
    after = plan.groups["c"]
    assert [t.task_id for t in after.tasks] == [0, 2]
    assert after.task(2).partitions == frozenset([c, d])


def test_only_task_dead_is_restarted_with_a_new_generation():
    ps = parts(2)
    g = tk.TaskGroup("c", policy(), frozenset(ps), (_task(0, ps, hb=10.0),))
    plan = tk.plan_tasks([g], BROKERS, 100.0)
    (dec,) = plan.decisions
    assert isinstance(dec, tk.RestartTask) and dec.broker_id == "b1"
    t = plan.groups["c"].task(0)
    assert (t.generation, t.heartbeat_at, t.partitions) == (2, None, frozenset(ps))


def test_a_new_task_gets_the_launch_timeout():
    ps = parts(2)
    g = tk.TaskGroup("c", policy(), frozenset(ps), (_task(0, ps, hb=None, changed=50.0),))
    assert tk.plan_tasks([g], BROKERS, 100.0).decisions == []
    (dec,) = tk.plan_tasks([g], BROKERS, 111.0).decisions
    assert isinstance(dec, tk.RestartTask)


def test_new_partitions_are_adopted_by_the_lightest_task():
    a, b, c = parts(3)
    tasks = (
        _task(0, [a], _samples([a], [500, 500], [0, 0])),
        _task(1, [b], _samples([b], [5, 5], [0, 0])),
    )
    g = tk.TaskGroup("c", policy(min_tasks=2), frozenset([a, b, c]), tasks)
    (dec,) = tk.plan_tasks([g], BROKERS, 100.0).decisions
    assert isinstance(dec, tk.Adopt) and dec.task_id == 1
    assert dec.change.partitions == {1: frozenset([b, c])}


def test_task_ids_are_never_reused():
    a, b = parts(2)
    g = tk.TaskGroup(
        "c", policy(min_tasks=2), frozenset([a, b]), (_task(0, [a, b]),), next_task_id=7
    )
    (dec,) = tk.plan_tasks([g], BROKERS, 100.0).decisions
    assert isinstance(dec, tk.Split) and dec.new_task_id == 7


def test_brokers_room_is_shared_across_connectors():
    groups = [tk.TaskGroup(f"c{i}", policy(), frozenset(parts(2))) for i in range(3)]
    plan = tk.plan_tasks(groups, [tk.BrokerSlot("b1", free=2)], 0.0)
    assert [d.connector for d in plan.decisions] == ["c0", "c1"]


# -- the simulated ramp ------------------------------------------------------------------


def test_ramp_up_then_down_goes_one_three_one():
    w = World(6, capacity=1000.0, pol=policy(min_tasks=1, max_tasks=3))
    w.set_total(300.0)
    w.run(10)
    assert w.n_tasks == 1
    w.set_total(2600.0)  # needs three tasks
    w.run(40)
    assert w.n_tasks == 3
    assert [type(d).__name__ for d in w.history] == ["StartTasks", "Split", "Split"], w.history
    quiet = w.run(20)
    assert quiet == [], "a stable load makes no decision once settled"
    w.set_total(200.0)
    w.run(60)
    assert w.n_tasks == 1
    merges = [d for d in w.history if isinstance(d, tk.Merge)]
    assert len(merges) == 2 and all(d.figures["combined_rate"] < 500 for d in merges)
    assert sum(w.lag.values()) < 200 * DT, "the backlog was read"


# -- properties -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8),
    lo=st.integers(1, 3),
    extra=st.integers(0, 3),
    total=st.floats(0, 5000),
    capacity=st.floats(200, 2000),
)
def test_property_stable_load_settles_within_bounds_without_flapping(n, lo, extra, total, capacity):
    pol = policy(min_tasks=lo, max_tasks=lo + extra)
    w = World(n, capacity=capacity, pol=pol)
    w.set_total(total)
    w.run(80)
    assert min(lo, n) <= w.n_tasks <= lo + extra
    assert w.run(20) == [], "a stable load makes no decision after the cool-down"
    # a split's two halves are never merged back together under the same load
    splits = [
        frozenset(d.change.partitions[d.task_id] | d.moving)
        for d in w.history
        if isinstance(d, tk.Split)
    ]
    for d in w.history:
        if isinstance(d, tk.Merge):
            merged = d.change.partitions[d.into_task_id]
            assert merged not in splits
    kinds = [type(d).__name__ for d in w.history if isinstance(d, (tk.Split, tk.Merge))]
    assert not ("Split" in kinds and "Merge" in kinds), kinds


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 10),
    loads=st.lists(st.floats(0, 3000), min_size=1, max_size=12),
    deaths=st.lists(st.integers(0, 30), max_size=3),
)
def test_property_partitions_owned_exactly_once_through_load_changes_and_deaths(n, loads, deaths):
    w = World(n, capacity=1000.0, pol=policy(min_tasks=1, max_tasks=4))
    for i, total in enumerate(loads):
        w.set_total(total)
        for _ in range(8):
            w.tick()  # asserts exactly-once ownership after every tick
            if w.group.tasks and i in deaths and not w.silent:
                w.silent.add(w.group.tasks[0].task_id)  # its run is killed
    for _ in range(20):
        w.tick()
    assert not w.silent & {t.task_id for t in w.group.tasks}, "a dead task was replaced"
    assert 1 <= w.n_tasks <= 4


@settings(max_examples=60, deadline=None)
@given(
    n_groups=st.integers(1, 6),
    free=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    min_tasks=st.integers(1, 4),
)
def test_property_new_tasks_never_exceed_a_brokers_room(n_groups, free, min_tasks):
    brokers = [tk.BrokerSlot(f"b{i}", free=f, load=float(i)) for i, f in enumerate(free)]
    groups = [
        tk.TaskGroup(f"c{i}", policy(min_tasks=min_tasks, max_tasks=4), frozenset(parts(6)))
        for i in range(n_groups)
    ]
    plan = tk.plan_tasks(groups, brokers, 0.0)
    placed: dict[str, int] = {}
    for d in plan.decisions:
        for b in d.change.brokers.values():
            placed[b] = placed.get(b, 0) + 1
    room = {b.id: b.free for b in brokers}
    assert all(n <= room[b] for b, n in placed.items()), (placed, room)
    assert sum(placed.values()) == min(sum(free), sum(len(g.tasks) for g in plan.groups.values()))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 8),
    total=st.floats(50, 4000),
    seed=st.integers(0, 10_000),
)
def test_property_a_noisy_stable_load_never_splits_and_merges_back(n, total, seed):
    """±10% noise on a steady load: tasks are added while needed, and none is merged back."""
    import random

    rnd = random.Random(seed)
    w = World(n, capacity=1000.0, pol=policy(min_tasks=1, max_tasks=4))
    for _ in range(120):
        w.set_total(total * rnd.uniform(0.9, 1.1))
        w.tick()
    splits = [d for d in w.history if isinstance(d, tk.Split)]
    merges = [d for d in w.history if isinstance(d, tk.Merge)]
    assert merges == [] or splits == [], [d.reason for d in splits + merges]
    assert len(splits) <= 3
