"""Partition tasks of one connector: the pure split and merge planner.

A connector with ``tasks.max > 1`` runs as one or more *tasks*, each a run reading an
explicit set of partitions. ``plan_tasks(groups, brokers, now) -> TaskPlan`` looks at
one snapshot (each connector's tasks, their partitions and the per-partition rate and
lag samples their heartbeats reported, the broker executors' load) and returns
decisions. Like ``core/planning/scheduler.py`` it performs no I/O and reads no clock; every
decision carries the ownership change it makes (``.change``, a ``TaskChange`` the
store applies atomically with per-partition fencing) and the figures that caused it
(``.figures``, written to ``connector history``).

Per connector, each tick, in this order:

1. **dead**: a task whose heartbeat is older than ``heartbeat_timeout_s`` (or that
   never heartbeated within ``launch_timeout_s`` of getting its partitions) gives its
   partitions to the live tasks, heaviest partition to the lightest task; with no live
   task left it is restarted in place (generation + 1, which fences the lost run).
2. **start**: a connector without tasks gets ``min`` tasks, its partitions dealt round
   robin, each task on the least-loaded broker with room.
3. **adopt**: partitions no task owns (discovered since) go to the lightest live task.
4. **bounds**: fewer live tasks than ``min``: the heaviest task is split; more than
   ``max``: the two lightest are merged. Cool-down does not apply.
5. **split** (after ``cooldown_s``): a task whose lag grew in ``lag_samples``
   consecutive samples taken since its partitions last changed, or whose rate reached
   ``split_at`` x the ceiling (a measured ceiling: while it had a backlog it is not
   catching up on), gives half of its *load* (not half
   of its partitions) to a new task on the least-loaded broker with room.
6. **merge** (after ``cooldown_s``, at most one split or merge per tick): the two
   lightest tasks whose combined rate is below ``merge_below`` x the ceiling, neither
   with a backlog or a growing lag, become one (the lighter gives its partitions to the
   heavier and ends).

The **ceiling** is the rate one task can carry: ``ceiling_msgs_per_s`` when set, else
measured, the highest rate a task sustained while it had a backlog (lag of at least
``min_backlog`` records and of ``backlog_s`` seconds of its rate), remembered across
ticks (``TaskPlan.ceilings``). Without a known ceiling nothing is merged and only lag
growth splits.

**No flapping.** A split by rate leaves two tasks whose combined rate is the rate that
reached ``split_at`` x ceiling, above ``merge_below`` x ceiling (``merge_below <
split_at``), so they are not merged back while the load stays; a merged pair's rate is
below ``merge_below`` x ceiling, under the split threshold. Lag growth is judged only on
samples taken after the task's partitions last changed, so a split is measured before
the next one, and the cool-down spaces decisions out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from conveyor.core.model import TasksSpec, TopicPartition

TP = TopicPartition


# -- inputs ------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskPolicy:
    """The thresholds of one connector's tasks (from its spec's ``tasks`` section)."""

    min_tasks: int = 1
    max_tasks: int = 1
    cooldown_s: float = 60.0
    lag_samples: int = 5
    ceiling_msgs_per_s: float | None = None
    split_at: float = 0.9
    merge_below: float = 0.5
    heartbeat_timeout_s: float = 30.0
    launch_timeout_s: float = 60.0
    min_backlog: int = 1_000
    """A sample has a backlog when its lag is at least this many records ..."""
    backlog_s: float = 5.0
    """... and at least this many seconds of the task's rate."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_tasks <= self.max_tasks:
            raise ValueError(f"tasks: need 1 <= min ({self.min_tasks}) <= max ({self.max_tasks})")
        if not 0 < self.merge_below < self.split_at <= 1:
            raise ValueError("tasks: need 0 < merge_below < split_at <= 1")
        if self.lag_samples < 2:
            raise ValueError("tasks: lag_samples must be at least 2")

    @classmethod
    def from_spec(
        cls,
        spec: TasksSpec,
        *,
        heartbeat_timeout_s: float = 30.0,
        launch_timeout_s: float = 60.0,
    ) -> TaskPolicy:
        return cls(
            min_tasks=spec.min,
            max_tasks=spec.max,
            cooldown_s=spec.cooldown_s,
            lag_samples=spec.lag_samples,
            ceiling_msgs_per_s=spec.ceiling_msgs_per_s,
            split_at=spec.split_at,
            merge_below=spec.merge_below,
            heartbeat_timeout_s=heartbeat_timeout_s,
            launch_timeout_s=launch_timeout_s,
        )


@dataclass(frozen=True)
class TaskSample:
    """One heartbeat's figures: messages/s and lag (records) per partition."""

    at: float
    rates: Mapping[TopicPartition, float] = field(default_factory=dict)
    lags: Mapping[TopicPartition, int] = field(default_factory=dict)

    @cached_property
    def rate(self) -> float:
        return float(sum(self.rates.values()))

    @cached_property
    def lag(self) -> int:
        return int(sum(self.lags.values()))

    def has_backlog(self, policy: TaskPolicy) -> bool:
        return self.lag >= max(policy.min_backlog, self.rate * policy.backlog_s)


@dataclass(frozen=True)
class TaskView:
    """One task as the store holds it."""

    task_id: int
    partitions: frozenset[TopicPartition]
    broker_id: str | None = None
    generation: int = 1
    heartbeat_at: float | None = None
    changed_at: float = 0.0
    """When its partitions last changed (or it was created or restarted)."""
    samples: tuple[TaskSample, ...] = ()
    """Oldest first; the store keeps the last few."""

    def recent(self) -> tuple[TaskSample, ...]:
        """The samples taken since its partitions last changed: the only ones that measure this set."""
        return self._recent

    @cached_property
    def _recent(self) -> tuple[TaskSample, ...]:
        return tuple(s for s in self.samples if s.at >= self.changed_at)

    def is_dead(self, now: float, policy: TaskPolicy) -> bool:
        """Silent past the heartbeat timeout, or never heard from within the launch timeout."""
        if self.heartbeat_at is None:  # new or restarted: waits for its run's first heartbeat
            return now - self.changed_at > policy.launch_timeout_s
        return now - self.heartbeat_at > policy.heartbeat_timeout_s


@dataclass(frozen=True)
class TaskGroup:
    """One connector's tasks."""

    connector: str
    policy: TaskPolicy
    partitions: frozenset[TopicPartition]
    """Every partition of the connector's topics, as far as known."""
    tasks: tuple[TaskView, ...] = ()
    last_change_at: float | None = None
    """When the last split or merge was made (cool-down)."""
    ceiling: float | None = None
    """The measured ceiling remembered from earlier ticks."""
    next_task_id: int = 0
    """Task ids are never reused, so a run's tags name one task only."""

    def task(self, task_id: int) -> TaskView:
        for t in self.tasks:
            if t.task_id == task_id:
                return t
        raise KeyError(task_id)

    def owner(self) -> dict[TopicPartition, int]:
        return {tp: t.task_id for t in self.tasks for tp in t.partitions}

    def new_task_id(self) -> int:
        return max([self.next_task_id, *(t.task_id + 1 for t in self.tasks)])


@dataclass(frozen=True)
class BrokerSlot:
    """A broker executor's room for one more task run."""

    id: str
    free: int
    load: float = 0.0
    healthy: bool = True


# -- the change a decision makes -----------------------------------------------------


@dataclass(frozen=True)
class TaskChange:
    """New ownership for some tasks of one connector; tasks not named keep theirs.

    The store applies it in one transaction: each moved partition's owner row changes
    (and its epoch grows, so the old owner's commits for it are refused), new tasks get
    rows at generation 1, removed tasks lose theirs, restarted ones get generation + 1.
    """

    partitions: Mapping[int, frozenset[TopicPartition]] = field(default_factory=dict)
    """task id -> its whole new set (new tasks included)."""
    brokers: Mapping[int, str] = field(default_factory=dict)
    """new task id -> its broker."""
    removed: frozenset[int] = frozenset()
    restarted: frozenset[int] = frozenset()
    counts_for_cooldown: bool = False
    """A split or a merge: starts the cool-down."""
    immediate: bool = False
    """Moved partitions change owner at once (their owner is dead); otherwise the owner
    hands them over at a batch boundary (``TaskStore.release``)."""

    def applied_to(self, group: TaskGroup, now: float) -> TaskGroup:
        tasks: list[TaskView] = []
        for t in group.tasks:
            if t.task_id in self.removed:
                continue
            if t.task_id in self.restarted:
                t = replace(
                    t,
                    generation=t.generation + 1,
                    heartbeat_at=None,
                    changed_at=now,
                    samples=(),
                    broker_id=self.brokers.get(t.task_id, t.broker_id),
                )
            if t.task_id in self.partitions and self.partitions[t.task_id] != t.partitions:
                t = replace(t, partitions=self.partitions[t.task_id], changed_at=now)
            tasks.append(t)
        known = {t.task_id for t in tasks}
        for task_id, parts in sorted(self.partitions.items()):
            if task_id not in known and task_id not in self.removed:
                tasks.append(
                    TaskView(
                        task_id=task_id,
                        partitions=parts,
                        broker_id=self.brokers.get(task_id),
                        changed_at=now,
                    )
                )
        new_ids = [t.task_id + 1 for t in tasks]
        return replace(
            group,
            tasks=tuple(sorted(tasks, key=lambda t: t.task_id)),
            last_change_at=now if self.counts_for_cooldown else group.last_change_at,
            next_task_id=max([group.new_task_id(), *new_ids]),
        )


# -- decisions -----------------------------------------------------------------------


@dataclass(frozen=True)
class _TaskDecision:
    connector: str
    reason: str
    change: TaskChange
    figures: Mapping[str, float]


@dataclass(frozen=True)
class StartTasks(_TaskDecision):
    """A connector without tasks gets its first ones."""


@dataclass(frozen=True)
class Adopt(_TaskDecision):
    """Partitions nobody owns go to a live task."""

    task_id: int = -1


@dataclass(frozen=True)
class Split(_TaskDecision):
    """Half of a task's load moves to a new task."""

    task_id: int = -1
    new_task_id: int = -1
    moving: frozenset[TopicPartition] = frozenset()
    broker_id: str = ""


@dataclass(frozen=True)
class Merge(_TaskDecision):
    """A task gives all its partitions to another and ends."""

    task_id: int = -1
    into_task_id: int = -1
    moving: frozenset[TopicPartition] = frozenset()


@dataclass(frozen=True)
class ReclaimDead(_TaskDecision):
    """A dead task's partitions go to the live tasks."""

    task_id: int = -1


@dataclass(frozen=True)
class RestartTask(_TaskDecision):
    """A dead task with nobody to take over is relaunched with a new generation."""

    task_id: int = -1
    broker_id: str | None = None


TaskDecision = StartTasks | Adopt | Split | Merge | ReclaimDead | RestartTask


@dataclass
class TaskPlan:
    decisions: list[TaskDecision] = field(default_factory=list)
    ceilings: dict[str, float] = field(default_factory=dict)
    """Each connector's measured ceiling after this tick (to remember)."""
    groups: dict[str, TaskGroup] = field(default_factory=dict)
    """Each connector's tasks as they are after the decisions."""

    def for_connector(self, name: str) -> list[TaskDecision]:
        return [d for d in self.decisions if d.connector == name]


# -- measuring -----------------------------------------------------------------------


def partition_loads(task: TaskView) -> dict[TopicPartition, float]:
    """Each partition's incoming rate: its read rate plus the growth of its lag (msgs/s).

    Measured on the samples since the task's partitions last changed (all of them when
    there are none), so a partition that falls behind weighs what it receives, not what
    the task manages to read.
    """
    cached: dict[TopicPartition, float] | None = task.__dict__.get("_loads")
    if cached is not None:  # a TaskView never changes: its loads are computed once
        return dict(cached)
    window = task.recent() or task.samples
    loads = dict.fromkeys(task.partitions, 0.0)
    if not window:
        object.__setattr__(task, "_loads", loads)
        return dict(loads)
    sums = dict.fromkeys(task.partitions, 0.0)
    seen = dict.fromkeys(task.partitions, 0)
    for sample in window:
        for tp, r in sample.rates.items():
            if tp in sums:
                sums[tp] += r
                seen[tp] += 1
    first, last = window[0], window[-1]
    span = last.at - first.at
    for tp in loads:
        rate = sums[tp] / seen[tp] if seen[tp] else 0.0
        growth = 0.0
        if span > 0 and tp in first.lags and tp in last.lags:
            growth = max(0.0, (last.lags[tp] - first.lags[tp]) / span)
        loads[tp] = max(0.0, rate + growth)
    object.__setattr__(task, "_loads", loads)
    return dict(loads)


def task_load(task: TaskView) -> float:
    return sum(partition_loads(task).values())


def measured_ceiling(samples: Iterable[TaskSample], policy: TaskPolicy) -> float | None:
    """The highest rate sustained with a backlog (None: never saturated)."""
    rates = [s.rate for s in samples if s.has_backlog(policy) and s.rate > 0]
    return max(rates) if rates else None


def lag_growing(task: TaskView, policy: TaskPolicy) -> tuple[int, ...] | None:
    """The last ``lag_samples`` lag totals when each grew and the last is a backlog, else None."""
    recent = task.recent()
    if len(recent) < policy.lag_samples:
        return None
    lags = tuple(s.lag for s in recent[-policy.lag_samples :])
    if all(b > a for a, b in zip(lags, lags[1:], strict=False)) and lags[-1] >= policy.min_backlog:
        return lags
    return None


def halve_by_load(
    loads: Mapping[TopicPartition, float],
) -> tuple[frozenset[TopicPartition], frozenset[TopicPartition]]:
    """(kept, moving): two non-empty halves of near-equal load (heaviest first, to the lighter side).

    Partitions without measured load count one unit each (dealt by count)."""
    if len(loads) < 2:
        raise ValueError("a task with one partition cannot be split")
    weighted = any(v > 0 for v in loads.values())
    items = sorted(loads.items(), key=lambda kv: (-(kv[1] if weighted else 1.0), kv[0]))
    sides: list[list[TopicPartition]] = [[], []]
    weight = [0.0, 0.0]
    for tp, load in items:
        i = 0 if (weight[0], len(sides[0])) <= (weight[1], len(sides[1])) else 1
        sides[i].append(tp)
        weight[i] += load if weighted else 1.0
    if not sides[1]:  # every load on one partition: still move one
        sides[1].append(sides[0].pop())
    return frozenset(sides[0]), frozenset(sides[1])


# -- planning ------------------------------------------------------------------------


def plan_tasks(groups: Sequence[TaskGroup], brokers: Sequence[BrokerSlot], now: float) -> TaskPlan:
    """Decisions for every connector's tasks; brokers' room is shared across connectors."""
    plan = TaskPlan()
    slots = {b.id: b for b in brokers}
    for group in sorted(groups, key=lambda g: g.connector):
        group = _plan_group(group, slots, now, plan)
        plan.groups[group.connector] = group
    return plan


def _least_loaded(slots: dict[str, BrokerSlot], prefer: str | None = None) -> str | None:
    room = [b for b in slots.values() if b.healthy and b.free > 0]
    if not room:
        return None
    return min(room, key=lambda b: (b.load, b.id != prefer, -b.free, b.id)).id


def _take_slot(slots: dict[str, BrokerSlot], broker_id: str) -> None:
    b = slots[broker_id]
    slots[broker_id] = replace(b, free=b.free - 1, load=b.load + 1.0)


def _free_slot(slots: dict[str, BrokerSlot], broker_id: str | None) -> None:
    if broker_id is not None and broker_id in slots:
        b = slots[broker_id]
        slots[b.id] = replace(b, free=b.free + 1, load=max(0.0, b.load - 1.0))


def _fmt(figures: Mapping[str, float]) -> str:
    return ", ".join(
        f"{k}={v:.1f}" if isinstance(v, float) and not v.is_integer() else f"{k}={int(v)}"
        for k, v in figures.items()
    )


@dataclass
class _Planning:
    """One connector's planning under way: its tasks as the decisions so far left them.

    ``slots`` is shared with the other connectors of the tick (brokers' room)."""

    group: TaskGroup
    slots: dict[str, BrokerSlot]
    now: float
    plan: TaskPlan
    live: list[TaskView] = field(default_factory=list)
    """The live tasks, as the step that last looked left them (from the live step on)."""
    ceiling: float | None = None
    """The ceiling this tick (from the ceiling step on)."""

    @property
    def policy(self) -> TaskPolicy:
        return self.group.policy

    def do(self, decision: TaskDecision) -> None:
        """Record a decision, free its removed tasks' slots, and apply it to the group."""
        self.plan.decisions.append(decision)
        for tid in decision.change.removed:
            _free_slot(self.slots, self.group.task(tid).broker_id)
        self.group = decision.change.applied_to(self.group, self.now)

    def live_tasks(self) -> list[TaskView]:
        """The group's tasks that are not dead now."""
        return [t for t in self.group.tasks if not t.is_dead(self.now, self.policy)]


Step = Callable[[_Planning], bool]
"""One step of a connector's planning; True: its planning ends here."""


def _reclaim_dead(p: _Planning) -> bool:
    """1. dead: each dead task's partitions go to the live tasks, or it restarts in place."""
    for task in list(p.group.tasks):
        if not task.is_dead(p.now, p.policy):
            continue
        live = [
            t for t in p.group.tasks if t.task_id != task.task_id and not t.is_dead(p.now, p.policy)
        ]
        age = p.now - (task.heartbeat_at if task.heartbeat_at is not None else task.changed_at)
        figures = {"heartbeat_age_s": float(age), "partitions": float(len(task.partitions))}
        if live:
            _reclaim_into(p, task, live, age, figures)
        else:
            _restart_in_place(p, task, age, figures)
    return False


def _reclaim_into(
    p: _Planning,
    task: TaskView,
    live: Sequence[TaskView],
    age: float,
    figures: Mapping[str, float],
) -> None:
    """The dead ``task``'s partitions are dealt to the ``live`` tasks at once."""
    moves = _deal(partition_loads(task), live)
    p.do(
        ReclaimDead(
            p.group.connector,
            f"task {task.task_id} silent for {age:.0f} s: its "
            f"{len(task.partitions)} partition(s) go to task(s) "
            f"{', '.join(str(t) for t in sorted(moves))}",
            TaskChange(partitions=moves, removed=frozenset({task.task_id}), immediate=True),
            figures,
            task_id=task.task_id,
        )
    )


def _restart_in_place(
    p: _Planning, task: TaskView, age: float, figures: Mapping[str, float]
) -> None:
    """The dead ``task`` is relaunched (on another broker when its own has gone or is unhealthy)."""
    broker = task.broker_id
    if broker not in p.slots or not p.slots[broker].healthy:
        _free_slot(p.slots, broker)
        broker = _least_loaded(p.slots)
        if broker is None:
            return
        _take_slot(p.slots, broker)
    p.do(
        RestartTask(
            p.group.connector,
            f"task {task.task_id} silent for {age:.0f} s and no live task to take over: "
            f"relaunched on {broker}",
            TaskChange(
                restarted=frozenset({task.task_id}),
                brokers={task.task_id: broker} if broker else {},
            ),
            figures,
            task_id=task.task_id,
            broker_id=broker,
        )
    )


def _start(p: _Planning) -> bool:
    """2. start: a connector without tasks gets ``min`` of them (planning ends there)."""
    group = p.group
    if group.tasks:
        return False
    if not group.partitions:
        return True
    parts = sorted(group.partitions)
    placed = _place_new_tasks(p.slots, group.new_task_id(), min(p.policy.min_tasks, len(parts)))
    if not placed:
        return True
    ids = sorted(placed)
    sets: dict[int, frozenset[TopicPartition]] = {}
    for i, tp in enumerate(parts):  # dealt round robin
        tid = ids[i % len(ids)]
        sets[tid] = sets.get(tid, frozenset()) | {tp}
    p.do(
        StartTasks(
            group.connector,
            f"{len(ids)} task(s) for {len(parts)} partition(s)",
            TaskChange(partitions=sets, brokers=placed),
            {"tasks": float(len(ids)), "partitions": float(len(parts))},
        )
    )
    return True


def _place_new_tasks(slots: dict[str, BrokerSlot], first: int, n: int) -> dict[int, str]:
    """Up to ``n`` new task ids from ``first`` -> the least-loaded broker with room, taken."""
    placed: dict[int, str] = {}
    for i in range(n):
        broker = _least_loaded(slots)
        if broker is None:
            break
        _take_slot(slots, broker)
        placed[first + i] = broker
    return placed


def _find_live(p: _Planning) -> bool:
    """The live tasks; with none (all dead and waiting for room) planning ends."""
    p.live = p.live_tasks()
    return not p.live


def _adopt(p: _Planning) -> bool:
    """3. adopt: partitions no task owns go to the lightest live task."""
    orphans = p.group.partitions - set(p.group.owner())
    if orphans:
        lightest = min(p.live, key=lambda t: (task_load(t), len(t.partitions), t.task_id))
        p.do(
            Adopt(
                p.group.connector,
                f"{len(orphans)} new partition(s) to task {lightest.task_id}",
                TaskChange(partitions={lightest.task_id: lightest.partitions | orphans}),
                {"partitions": float(len(orphans))},
                task_id=lightest.task_id,
            )
        )
        p.live = p.live_tasks()
    return False


def _find_ceiling(p: _Planning) -> bool:
    """The ceiling: the user's figure, else the highest measured (remembered across ticks)."""
    policy, group = p.policy, p.group
    measured = [c for c in (measured_ceiling(t.recent(), policy) for t in p.live) if c is not None]
    ceiling = policy.ceiling_msgs_per_s or max([group.ceiling or 0.0, *measured]) or None
    p.ceiling = ceiling
    if ceiling:
        p.plan.ceilings[group.connector] = ceiling
        p.group = replace(
            group, ceiling=ceiling if policy.ceiling_msgs_per_s is None else group.ceiling
        )
    return False


def _bounds(p: _Planning) -> bool:
    """4. bounds: below ``min`` the heaviest task splits, above ``max`` the two lightest merge
    (no cool-down); either way planning ends."""
    policy, live = p.policy, p.live
    if len(live) < policy.min_tasks:
        task = max(live, key=lambda t: (task_load(t), len(t.partitions), -t.task_id))
        if len(task.partitions) >= 2:
            _split(
                p,
                task,
                f"below tasks.min ({policy.min_tasks})",
                {"tasks": float(len(live)), "min": float(policy.min_tasks)},
            )
        return True
    if len(live) > policy.max_tasks:
        a, b = sorted(live, key=lambda t: (task_load(t), t.task_id))[:2]
        _merge(
            p,
            a,
            b,
            f"above tasks.max ({policy.max_tasks})",
            {"tasks": float(len(live)), "max": float(policy.max_tasks)},
        )
        return True
    return False


def _cooling_down(p: _Planning) -> bool:
    """No split or merge within ``cooldown_s`` of the last one."""
    last = p.group.last_change_at
    return last is not None and p.now - last < p.policy.cooldown_s


def _split_hot(p: _Planning) -> bool:
    """5. split: the heaviest task whose lag grows or whose rate is at the ceiling splits."""
    if len(p.live) >= p.policy.max_tasks:
        return False
    for task in sorted(p.live, key=lambda t: (-task_load(t), t.task_id)):
        if len(task.partitions) < 2:
            continue
        reason = _split_reason(task, p.policy, p.ceiling)
        if reason is None:
            continue
        why, figures = reason
        if _split(p, task, why, figures):
            return True
    return False


def _split_reason(
    task: TaskView, policy: TaskPolicy, ceiling: float | None
) -> tuple[str, dict[str, float]] | None:
    """Why ``task`` should split (its lag grew, or its rate reached the ceiling) and the
    figures that show it; None: it should not."""
    recent = task.recent()
    growing = lag_growing(task, policy)
    if growing is not None:
        figures = {
            "rate": recent[-1].rate,
            "lag_first": float(growing[0]),
            "lag_last": float(growing[-1]),
            "samples": float(len(growing)),
        }
        return f"lag grew in {len(growing)} samples ({growing[0]} -> {growing[-1]})", figures
    if (
        ceiling
        and recent
        and recent[-1].rate >= policy.split_at * ceiling
        and (
            policy.ceiling_msgs_per_s is not None  # the user's figure: at capacity
            or (
                recent[-1].has_backlog(policy)  # measured: saturated, not catching up
                and (len(recent) < 2 or recent[-1].lag >= recent[-2].lag)
            )
        )
    ):
        figures = {
            "rate": recent[-1].rate,
            "ceiling": float(ceiling),
            "lag": float(recent[-1].lag),
        }
        why = f"rate {recent[-1].rate:.0f}/s reached {policy.split_at:g} x ceiling {ceiling:.0f}/s"
        return why, figures
    return None


def _merge_calm(p: _Planning) -> bool:
    """6. merge: the two lightest calm tasks become one when their combined rate is below
    ``merge_below`` x the ceiling."""
    policy, ceiling = p.policy, p.ceiling
    if not ceiling or len(p.live) <= policy.min_tasks:
        return False
    calm = [
        t
        for t in p.live
        if len(t.recent()) >= 2
        and not t.recent()[-1].has_backlog(policy)
        and lag_growing(t, policy) is None
    ]
    ordered = sorted(calm, key=lambda t: (task_load(t), t.task_id))
    if len(ordered) < 2:
        return False
    a, b = ordered[0], ordered[1]
    combined = task_load(a) + task_load(b)
    if combined >= policy.merge_below * ceiling:
        return False
    _merge(
        p,
        a,
        b,
        f"combined rate {combined:.0f}/s below {policy.merge_below:g} x ceiling {ceiling:.0f}/s",
        {"combined_rate": combined, "ceiling": float(ceiling)},
    )
    return True


STEPS: tuple[Step, ...] = (
    _reclaim_dead,
    _start,
    _find_live,
    _adopt,
    _find_ceiling,
    _bounds,
    _cooling_down,
    _split_hot,
    _merge_calm,
)


def _plan_group(
    group: TaskGroup, slots: dict[str, BrokerSlot], now: float, plan: TaskPlan
) -> TaskGroup:
    """One connector's decisions: the STEPS in order until one ends its planning.

    Returns its tasks as the decisions leave them; ``slots`` and ``plan`` are updated."""
    p = _Planning(group, slots, now, plan)
    for step in STEPS:
        if step(p):
            break
    return p.group


def _deal(
    loads: Mapping[TopicPartition, float], takers: Sequence[TaskView]
) -> dict[int, frozenset[TopicPartition]]:
    """Heaviest partition first to the task with the lightest load so far."""
    weight = {t.task_id: task_load(t) for t in takers}
    sets = {t.task_id: t.partitions for t in takers}
    for tp, load in sorted(loads.items(), key=lambda kv: (-kv[1], kv[0])):
        tid = min(weight, key=lambda i: (weight[i], len(sets[i]), i))
        sets[tid] = sets[tid] | {tp}
        weight[tid] += load
    return {
        tid: parts
        for tid, parts in sets.items()
        if parts != next(t.partitions for t in takers if t.task_id == tid)
    }


def _split(
    p: _Planning,
    task: TaskView,
    why: str,
    figures: Mapping[str, float],
) -> bool:
    """Half of ``task``'s load moves to a new task on the least-loaded broker (False: no room)."""
    slots, group = p.slots, p.group
    broker = _least_loaded(slots)
    if broker is None:
        return False
    loads = partition_loads(task)
    kept, moving = halve_by_load(loads)
    new_id = group.new_task_id()
    _take_slot(slots, broker)
    moved_load = sum(loads[tp] for tp in moving)
    kept_load = sum(loads[tp] for tp in kept)
    figures = {**figures, "moved_load": moved_load, "kept_load": kept_load}
    p.do(
        Split(
            group.connector,
            f"split task {task.task_id}: {why}; {len(moving)} partition(s) "
            f"({moved_load:.0f}/s) to new task {new_id} on {broker} ({_fmt(figures)})",
            TaskChange(
                partitions={task.task_id: kept, new_id: moving},
                brokers={new_id: broker},
                counts_for_cooldown=True,
            ),
            figures,
            task_id=task.task_id,
            new_task_id=new_id,
            moving=moving,
            broker_id=broker,
        )
    )
    return True


def _merge(
    p: _Planning,
    a: TaskView,
    b: TaskView,
    why: str,
    figures: Mapping[str, float],
) -> None:
    """The lighter ``a`` gives its partitions to ``b``."""
    figures = {**figures, "moved_load": task_load(a), "into_load": task_load(b)}
    p.do(
        Merge(
            p.group.connector,
            f"merge task {a.task_id} into task {b.task_id}: {why} ({_fmt(figures)})",
            TaskChange(
                partitions={b.task_id: b.partitions | a.partitions},
                removed=frozenset({a.task_id}),
                counts_for_cooldown=True,
            ),
            figures,
            task_id=a.task_id,
            into_task_id=b.task_id,
            moving=a.partitions,
        )
    )
