"""Partition tasks in the meta store: who owns each partition, fenced commits, the handover.

Three tables (``store/schema.py``): a group row per connector (an *epoch* that grows at
every ownership change, the next task id, the cool-down and the remembered ceiling),
a row per task (broker, generation, run, heartbeat, its last load samples), and an
owner row per partition (task id, the epoch at which it got the partition, and the task
it is being handed over to, if any).

**Fencing per partition.** A task run holds a *grant*: its generation and, per
partition, the epoch at which it got it. ``commit`` writes an offset only for a
partition whose owner row still names this task at that epoch, in the same transaction
that checks it; a partition that moved away (even one that came back later, at a newer
epoch) is refused and reported. A task whose generation was bumped (restarted) or that
was removed is refused as a whole (``FencedError``). The operator's stop, offsets reset,
state reset and delete bump (or remove) every task's generation in the same transaction as
the connector's (``store/meta.py``): a task run caught mid-batch cannot undo them.

**Handover** (the lightweight-consumer coordinator's protocol). A split or merge does
not take partitions from a live owner: it marks them *releasing* (``pending_task_id``).
The owner learns it in its heartbeat's grant, stops fetching them at its next batch
boundary, and calls ``release`` with their offsets: one transaction commits them and
gives them to the new owner at a new epoch. The new owner's next grant includes them and
it reads from exactly the committed offsets. An owner that does not release within the
heartbeat timeout (it died) is overtaken by ``force_handovers``: the partitions move
with their last committed offsets, so nothing is lost and at most the batch in flight is
read twice. A dead task's partitions move at once (``TaskChange.immediate``).

Every write locks the connector's group row first (``SELECT ... FOR UPDATE`` on
PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` serialises writers), so the scheduler's changes,
commits and releases of one connector never interleave.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from conveyor.core.errors import FencedError
from conveyor.core.model import DesiredState, Offsets, TopicPartition
from conveyor.core.positions import PositionScope
from conveyor.core.scrubbing import scrub
from conveyor.core.tasks import (
    TaskChange,
    TaskDecision,
    TaskGroup,
    TaskPolicy,
    TaskSample,
    TaskView,
)
from conveyor.store import schema as t
from conveyor.store.meta import MetaStore, drop_tasks

ENDING = "Ending"  # merged away: hands over its last partitions, then its row goes
SAMPLES_KEPT = 20


def _key(tp: TopicPartition) -> str:
    return f"{tp.topic}:{tp.partition}"


def _tp(key: str) -> TopicPartition:
    topic, _, p = key.rpartition(":")
    return TopicPartition(topic, int(p))


def samples_to_json(samples: Iterable[TaskSample]) -> str:
    return json.dumps(
        [
            {
                "at": s.at,
                "rates": {_key(tp): r for tp, r in s.rates.items()},
                "lags": {_key(tp): lag for tp, lag in s.lags.items()},
            }
            for s in samples
        ]
    )


def samples_from_json(text: str | None) -> tuple[TaskSample, ...]:
    return tuple(
        TaskSample(
            float(s["at"]),
            {_tp(k): float(v) for k, v in s.get("rates", {}).items()},
            {_tp(k): int(v) for k, v in s.get("lags", {}).items()},
        )
        for s in json.loads(text or "[]")
    )


@dataclass(frozen=True)
class TaskRow:
    """One task as stored, with the partitions it owns and those moving in or out."""

    connector: str
    task_id: int
    broker_id: str | None
    generation: int
    status: str
    run_id: str | None
    run_pid: int | None
    heartbeat_at: float | None
    changed_at: float
    samples: tuple[TaskSample, ...]
    owned: Mapping[TopicPartition, int] = field(default_factory=dict)
    """Partitions it owns -> the epoch at which it got them."""
    releasing: Mapping[TopicPartition, int] = field(default_factory=dict)
    """Owned partitions it must hand over -> to which task."""
    incoming: frozenset[TopicPartition] = frozenset()
    """Partitions being handed over to it."""

    @property
    def partitions(self) -> frozenset[TopicPartition]:
        """What it will own once the handovers are done (the planner's view)."""
        return (frozenset(self.owned) - frozenset(self.releasing)) | self.incoming

    def latest(self) -> TaskSample | None:
        return self.samples[-1] if self.samples else None


@dataclass(frozen=True)
class Grant:
    """What a task run may do: the heartbeat's answer."""

    task_id: int
    generation: int
    owned: Mapping[TopicPartition, int]
    """Partitions it may read and commit -> their epoch (passed back to ``commit``)."""
    releasing: frozenset[TopicPartition]
    """Owned partitions to stop fetching at the next batch boundary and ``release``."""
    desired: DesiredState = DesiredState.RUNNING
    ending: bool = False
    """Merged away and nothing left to hand over: the run ends."""


@dataclass(frozen=True)
class CommitResult:
    committed: Offsets
    refused: frozenset[TopicPartition]
    """Partitions this task no longer owns at the epoch it had: not written."""


class TaskStore:
    """The task tables of one meta store."""

    def __init__(self, meta: MetaStore):
        self.meta = meta

    # -- helpers ------------------------------------------------------------------------

    def _lock_group(self, c: sa.Connection, connector: str) -> sa.Row[Any]:
        q = sa.select(t.task_groups).where(t.task_groups.c.connector == connector)
        if self.meta.dialect != "sqlite":
            q = q.with_for_update()
        row = c.execute(q).first()
        if row is None:
            # A group only for a connector that exists (waiting out a delete under way): a
            # deleted connector's zombie task or a stale scheduler tick brings nothing back.
            exists = sa.select(t.connectors.c.name).where(t.connectors.c.name == connector)
            if self.meta.dialect != "sqlite":
                exists = exists.with_for_update(read=True, key_share=True)
            if c.execute(exists).first() is None:
                raise FencedError(f"connector {connector!r} no longer exists")
            c.execute(
                t.task_groups.insert().values(
                    connector=connector, epoch=0, next_task_id=0, updated_at=self.meta.clock()
                )
            )
            row = c.execute(q).first()
        assert row is not None
        return row

    def _task(self, c: sa.Connection, connector: str, task_id: int) -> sa.Row[Any] | None:
        return c.execute(
            sa.select(t.tasks).where(t.tasks.c.connector == connector, t.tasks.c.task_id == task_id)
        ).first()

    def _fenced_task(
        self, c: sa.Connection, connector: str, task_id: int, generation: int
    ) -> sa.Row[Any]:
        row = self._task(c, connector, task_id)
        if row is None or row.generation != generation:
            raise FencedError(
                f"connector {connector!r} task {task_id}: generation {generation} is no longer "
                "current; not committing"
            )
        return row

    def _owners(self, c: sa.Connection, connector: str) -> list[sa.Row[Any]]:
        return list(
            c.execute(
                sa.select(t.task_partitions).where(t.task_partitions.c.connector == connector)
            )
        )

    def _history(self, c: sa.Connection, connector: str, reason: str) -> None:
        row = c.execute(
            sa.select(t.connectors.c.status, t.connectors.c.generation).where(
                t.connectors.c.name == connector
            )
        ).first()
        if row is None:
            return
        c.execute(
            t.state_history.insert().values(
                connector=connector,
                at=self.meta.clock(),
                from_status=row.status,
                to_status=row.status,
                reason=scrub(reason)[:4000],
                run_id=None,
                generation=row.generation,
            )
        )

    def _bump(self, c: sa.Connection, connector: str, **values: Any) -> int:
        group = self._lock_group(c, connector)
        epoch = int(group.epoch) + 1
        c.execute(
            t.task_groups.update()
            .where(t.task_groups.c.connector == connector)
            .values(epoch=epoch, updated_at=self.meta.clock(), **values)
        )
        return epoch

    def _drop_finished(self, c: sa.Connection, connector: str) -> None:
        """Ending tasks with nothing left to hand over lose their rows."""
        owners = {r.task_id for r in self._owners(c, connector)}
        for r in c.execute(
            sa.select(t.tasks.c.task_id).where(
                t.tasks.c.connector == connector, t.tasks.c.status == ENDING
            )
        ).all():
            if r.task_id not in owners:
                c.execute(
                    t.tasks.delete().where(
                        t.tasks.c.connector == connector, t.tasks.c.task_id == r.task_id
                    )
                )

    # -- reading ------------------------------------------------------------------------

    def tasks(self, connector: str) -> list[TaskRow]:
        with self.meta._read() as c:
            return self._rows(c, connector)

    def _rows(self, c: sa.Connection, connector: str) -> list[TaskRow]:
        owned: dict[int, dict[TopicPartition, int]] = {}
        releasing: dict[int, dict[TopicPartition, int]] = {}
        incoming: dict[int, set[TopicPartition]] = {}
        for r in self._owners(c, connector):
            tp = TopicPartition(r.topic, r.partition)
            owned.setdefault(r.task_id, {})[tp] = r.epoch
            if r.pending_task_id is not None:
                releasing.setdefault(r.task_id, {})[tp] = r.pending_task_id
                incoming.setdefault(r.pending_task_id, set()).add(tp)
        rows = c.execute(
            sa.select(t.tasks).where(t.tasks.c.connector == connector).order_by(t.tasks.c.task_id)
        ).all()
        return [
            TaskRow(
                connector=connector,
                task_id=r.task_id,
                broker_id=r.broker_id,
                generation=r.generation,
                status=r.status,
                run_id=r.run_id,
                run_pid=r.run_pid,
                heartbeat_at=r.heartbeat_at,
                changed_at=r.changed_at,
                samples=samples_from_json(r.samples_json),
                owned=owned.get(r.task_id, {}),
                releasing=releasing.get(r.task_id, {}),
                incoming=frozenset(incoming.get(r.task_id, set())),
            )
            for r in rows
        ]

    def connectors(self) -> list[str]:
        """Connectors that have task rows."""
        with self.meta._read() as c:
            return sorted(
                r.connector for r in c.execute(sa.select(t.task_groups.c.connector)).all()
            )

    def epoch(self, connector: str) -> int:
        with self.meta._read() as c:
            row = c.execute(
                sa.select(t.task_groups.c.epoch).where(t.task_groups.c.connector == connector)
            ).first()
            return int(row.epoch) if row else 0

    def partitions(self, connector: str) -> list[TopicPartition]:
        """Every partition of the connector's topics, as its tasks (or the scheduler) found them."""
        with self.meta._read() as c:
            text = c.execute(
                sa.select(t.task_groups.c.partitions_json).where(
                    t.task_groups.c.connector == connector
                )
            ).scalar()
        return sorted(_tp(k) for k in json.loads(text or "[]"))

    def set_partitions(self, connector: str, partitions: Iterable[TopicPartition]) -> None:
        with self.meta._tx() as c:
            self._lock_group(c, connector)
            self._set_partitions(c, connector, partitions)

    def _set_partitions(
        self, c: sa.Connection, connector: str, partitions: Iterable[TopicPartition]
    ) -> None:
        c.execute(
            t.task_groups.update()
            .where(t.task_groups.c.connector == connector)
            .values(partitions_json=json.dumps(sorted(_key(tp) for tp in partitions)))
        )

    def load_group(
        self, connector: str, policy: TaskPolicy, partitions: Iterable[TopicPartition]
    ) -> tuple[TaskGroup, int]:
        """The planner's view of a connector's tasks and the epoch it was read at."""
        with self.meta._tx() as c:
            g = c.execute(
                sa.select(t.task_groups).where(t.task_groups.c.connector == connector)
            ).first()
            rows = self._rows(c, connector)
        views = tuple(
            TaskView(
                task_id=r.task_id,
                partitions=r.partitions,
                broker_id=r.broker_id,
                generation=r.generation,
                heartbeat_at=r.heartbeat_at,
                changed_at=r.changed_at,
                samples=r.samples,
            )
            for r in rows
            if r.status != ENDING
        )
        group = TaskGroup(
            connector=connector,
            policy=policy,
            partitions=frozenset(partitions),
            tasks=views,
            last_change_at=g.last_change_at if g else None,
            ceiling=g.ceiling if g else None,
            next_task_id=int(g.next_task_id) if g else 0,
        )
        return group, int(g.epoch) if g else 0

    # -- the scheduler's writes -------------------------------------------------------

    def apply(
        self,
        connector: str,
        decisions: Sequence[TaskDecision],
        *,
        expected_epoch: int | None = None,
        ceiling: float | None = None,
    ) -> int:
        """Apply one tick's decisions for a connector in one transaction; returns the new epoch.

        ``expected_epoch`` is the epoch the plan was made on: if anything changed since
        (a release, another tick) nothing is written and ``FencedError`` is raised; the
        next tick plans again.
        """
        now = self.meta.clock()
        with self.meta._tx() as c:
            group = self._lock_group(c, connector)
            if expected_epoch is not None and int(group.epoch) != expected_epoch:
                raise FencedError(
                    f"connector {connector!r}: tasks changed since the plan "
                    f"(epoch {group.epoch}, planned on {expected_epoch})"
                )
            epoch = int(group.epoch)
            next_id = int(group.next_task_id)
            last_change = group.last_change_at
            for d in decisions:
                ch = d.change
                epoch += 1
                next_id = self._apply_change(c, connector, ch, epoch, next_id, now)
                if ch.counts_for_cooldown:
                    last_change = now
                self._check_owned_once(c, connector, ch.removed if ch.immediate else frozenset())
                self._history(c, connector, f"tasks: {d.reason}")
            self._drop_finished(c, connector)
            c.execute(
                t.task_groups.update()
                .where(t.task_groups.c.connector == connector)
                .values(
                    epoch=epoch,
                    next_task_id=next_id,
                    last_change_at=last_change,
                    updated_at=now,
                    **({"ceiling": ceiling} if ceiling is not None else {}),
                )
            )
            return epoch

    def _apply_change(
        self,
        c: sa.Connection,
        connector: str,
        ch: TaskChange,
        epoch: int,
        next_id: int,
        now: float,
    ) -> int:
        """One decision's change at ``epoch``, in this order: restarted tasks, new tasks,
        partitions, removed tasks. Returns the next task id."""
        self._restart_tasks(c, connector, ch, now)
        next_id = self._create_tasks(c, connector, ch, next_id, now)
        self._give_partitions(c, connector, ch, epoch, now)
        self._remove_tasks(c, connector, ch, now)
        return next_id

    def _restart_tasks(self, c: sa.Connection, connector: str, ch: TaskChange, now: float) -> None:
        """Restarted tasks: generation + 1 (fencing the lost run), Starting, samples cleared."""
        for tid in sorted(ch.restarted):
            c.execute(
                t.tasks.update()
                .where(t.tasks.c.connector == connector, t.tasks.c.task_id == tid)
                .values(
                    generation=t.tasks.c.generation + 1,
                    status="Starting",
                    run_id=None,
                    heartbeat_at=None,
                    changed_at=now,
                    samples_json="[]",
                    **({"broker_id": ch.brokers[tid]} if tid in ch.brokers else {}),
                )
            )

    def _create_tasks(
        self, c: sa.Connection, connector: str, ch: TaskChange, next_id: int, now: float
    ) -> int:
        """New tasks get rows at generation 1 on their broker; returns the next task id."""
        for tid, broker in sorted(ch.brokers.items()):
            if tid in ch.restarted:
                continue
            if self._task(c, connector, tid) is None:
                c.execute(
                    t.tasks.insert().values(
                        connector=connector,
                        task_id=tid,
                        broker_id=broker,
                        generation=1,
                        status="Starting",
                        changed_at=now,
                        samples_json="[]",
                        created_at=now,
                    )
                )
            next_id = max(next_id, tid + 1)
        return next_id

    def _give_partitions(
        self, c: sa.Connection, connector: str, ch: TaskChange, epoch: int, now: float
    ) -> None:
        """Each task named in the change gets its new set: at once, or by handover."""
        owners = {(r.topic, r.partition): r for r in self._owners(c, connector)}
        live = {
            r.task_id
            for r in c.execute(
                sa.select(t.tasks.c.task_id).where(
                    t.tasks.c.connector == connector, t.tasks.c.status != ENDING
                )
            )
        }
        for tid, parts in sorted(ch.partitions.items()):
            if tid not in live and tid not in ch.brokers:
                raise ValueError(f"connector {connector!r}: no task {tid} to give partitions")
            for tp in sorted(parts):
                owner = owners.get((tp.topic, tp.partition))
                at_once = ch.immediate or (owner is not None and owner.task_id not in live)
                self._give_partition(c, connector, tp, tid, owner, at_once, epoch, now)
            # Named in the decision, so its set changed: its load is measured anew.
            c.execute(
                t.tasks.update()
                .where(t.tasks.c.connector == connector, t.tasks.c.task_id == tid)
                .values(changed_at=now)
            )

    def _give_partition(
        self,
        c: sa.Connection,
        connector: str,
        tp: TopicPartition,
        tid: int,
        owner: sa.Row[Any] | None,
        at_once: bool,
        epoch: int,
        now: float,
    ) -> None:
        """``tp`` to task ``tid``: a new owner row, a handover cancelled, an immediate move
        (``at_once``: the change is immediate or its owner has ended), or a handover marked."""
        where = (
            t.task_partitions.c.connector == connector,
            t.task_partitions.c.topic == tp.topic,
            t.task_partitions.c.partition == tp.partition,
        )
        if owner is None:
            c.execute(
                t.task_partitions.insert().values(
                    connector=connector,
                    topic=tp.topic,
                    partition=tp.partition,
                    task_id=tid,
                    epoch=epoch,
                )
            )
        elif owner.task_id == tid:
            if owner.pending_task_id is not None:  # moved back before the handover
                c.execute(
                    t.task_partitions.update()
                    .where(*where)
                    .values(pending_task_id=None, pending_since=None)
                )
        elif at_once:
            c.execute(
                t.task_partitions.update()
                .where(*where)
                .values(task_id=tid, epoch=epoch, pending_task_id=None, pending_since=None)
            )
        elif owner.pending_task_id != tid:
            c.execute(
                t.task_partitions.update()
                .where(*where)
                .values(pending_task_id=tid, pending_since=now)
            )

    def _remove_tasks(self, c: sa.Connection, connector: str, ch: TaskChange, now: float) -> None:
        """Removed tasks: their rows go at once (immediate), else they end after handing over."""
        for tid in sorted(ch.removed):
            if ch.immediate:
                c.execute(
                    t.tasks.delete().where(
                        t.tasks.c.connector == connector, t.tasks.c.task_id == tid
                    )
                )
            else:
                c.execute(
                    t.tasks.update()
                    .where(t.tasks.c.connector == connector, t.tasks.c.task_id == tid)
                    .values(status=ENDING, changed_at=now)
                )

    def _check_owned_once(self, c: sa.Connection, connector: str, gone: frozenset[int]) -> None:
        """A removed task keeps no partition (the primary key already forbids two owners)."""
        for r in self._owners(c, connector):
            if r.task_id in gone:
                raise ValueError(
                    f"connector {connector!r}: task {r.task_id} removed while it owns "
                    f"{r.topic}[{r.partition}]"
                )

    def force_handovers(self, connector: str, older_than: float, reason: str = "") -> Offsets:
        """Hand over partitions whose owner did not release them since ``older_than``.

        Their new owner starts from the last committed offsets (at least once)."""
        now = self.meta.clock()
        with self.meta._tx() as c:
            self._lock_group(c, connector)
            beats = {
                r.task_id: r.heartbeat_at
                for r in c.execute(
                    sa.select(t.tasks.c.task_id, t.tasks.c.heartbeat_at).where(
                        t.tasks.c.connector == connector
                    )
                )
            }

            def silent(task_id: int) -> bool:
                at = beats.get(task_id)
                return at is None or at < older_than

            # Forced when the owner went silent, or when the new owner is up and the owner
            # still has not released (a new owner still starting cannot read them either).
            stale = [
                r
                for r in self._owners(c, connector)
                if r.pending_task_id is not None
                and r.pending_since is not None
                and r.pending_since < older_than
                and (silent(r.task_id) or beats.get(r.pending_task_id) is not None)
            ]
            if not stale:
                return {}
            epoch = self._bump(c, connector)
            moved = self._transfer(c, connector, stale, epoch, now)
            self._drop_finished(c, connector)
            self._history(
                c,
                connector,
                f"tasks: {reason or 'handover forced'}: "
                + ", ".join(f"{tp}@{off}" for tp, off in sorted(moved.items())),
            )
            return moved

    def _transfer(
        self, c: sa.Connection, connector: str, rows: Sequence[sa.Row[Any]], epoch: int, now: float
    ) -> Offsets:
        committed = self.meta._offsets(c, connector)
        moved: Offsets = {}
        for r in rows:
            tp = TopicPartition(r.topic, r.partition)
            c.execute(
                t.task_partitions.update()
                .where(
                    t.task_partitions.c.connector == connector,
                    t.task_partitions.c.topic == r.topic,
                    t.task_partitions.c.partition == r.partition,
                )
                .values(
                    task_id=r.pending_task_id, epoch=epoch, pending_task_id=None, pending_since=None
                )
            )
            c.execute(
                t.tasks.update()
                .where(t.tasks.c.connector == connector, t.tasks.c.task_id == r.pending_task_id)
                .values(changed_at=now)
            )
            moved[tp] = committed.get(tp, -1)
        return moved

    def drop(self, connector: str) -> None:
        """Forget a connector's tasks (deleted, or back to one run)."""
        with self.meta._tx() as c:
            drop_tasks(c, connector)

    # -- the task run's writes ----------------------------------------------------------

    def _up(self, c: sa.Connection, connector: str) -> set[int]:
        """Tasks whose run has heartbeated since they were (re)started."""
        return {
            r.task_id
            for r in c.execute(
                sa.select(t.tasks.c.task_id).where(
                    t.tasks.c.connector == connector, t.tasks.c.heartbeat_at.is_not(None)
                )
            )
        }

    def _grant(self, c: sa.Connection, connector: str, row: sa.Row[Any]) -> Grant:
        owned: dict[TopicPartition, int] = {}
        releasing: set[TopicPartition] = set()
        up = self._up(c, connector)
        for r in self._owners(c, connector):
            if r.task_id == row.task_id:
                tp = TopicPartition(r.topic, r.partition)
                owned[tp] = r.epoch
                # Released once the new owner's run is up: no pause while it starts.
                if r.pending_task_id is not None and r.pending_task_id in up:
                    releasing.add(tp)
        desired = c.execute(
            sa.select(t.connectors.c.desired).where(t.connectors.c.name == connector)
        ).scalar()
        return Grant(
            task_id=row.task_id,
            generation=row.generation,
            owned=owned,
            releasing=frozenset(releasing),
            desired=DesiredState(desired) if desired else DesiredState.RUNNING,
            ending=row.status == ENDING and not owned,
        )

    def ensure_current(self, connector: str, task_id: int, generation: int) -> None:
        """Raises FencedError when this task was restarted or removed."""
        with self.meta._read() as c:
            self._fenced_task(c, connector, task_id, generation)

    def grant(self, connector: str, task_id: int, generation: int) -> Grant:
        with self.meta._tx() as c:
            return self._grant(c, connector, self._fenced_task(c, connector, task_id, generation))

    def heartbeat(
        self,
        connector: str,
        task_id: int,
        generation: int,
        sample: TaskSample | None = None,
        *,
        run_id: str | None = None,
        pid: int | None = None,
        sample_interval_s: float = 5.0,
        discovered: Iterable[TopicPartition] | None = None,
    ) -> Grant:
        """Record the task's load (a sample at most every ``sample_interval_s``) and the
        partitions its source found (``discovered``); answer its grant."""
        now = self.meta.clock()
        with self.meta._tx() as c:
            group = self._lock_group(c, connector)
            row = self._fenced_task(c, connector, task_id, generation)
            if discovered is not None:
                found = sorted(_key(tp) for tp in discovered)
                known = json.loads(group.partitions_json or "[]")
                if found and sorted(set(known) | set(found)) != sorted(known):
                    self._set_partitions(c, connector, [_tp(k) for k in set(known) | set(found)])
            values: dict[str, Any] = {"heartbeat_at": now}
            if row.status != ENDING:
                values["status"] = "Running"
            if run_id is not None:
                values["run_id"] = run_id
            if pid is not None:
                values["run_pid"] = pid
            if sample is not None:
                samples = samples_from_json(row.samples_json)
                if not samples or sample.at - samples[-1].at >= sample_interval_s:
                    values["samples_json"] = samples_to_json((*samples, sample)[-SAMPLES_KEPT:])
            c.execute(
                t.tasks.update()
                .where(t.tasks.c.connector == connector, t.tasks.c.task_id == task_id)
                .values(**values)
            )
            return self._grant(c, connector, self._fenced_task(c, connector, task_id, generation))

    def commit(
        self,
        connector: str,
        task_id: int,
        generation: int,
        offsets: Offsets,
        owned: Mapping[TopicPartition, int],
        scope: PositionScope | None = None,
    ) -> CommitResult:
        """Write the offsets of the partitions this task still owns at the epochs of its grant.

        Checked and written in one transaction; the others are refused, not written."""
        now = self.meta.clock()
        with self.meta._tx() as c:
            group = self._lock_group(c, connector)
            self._fenced_task(c, connector, task_id, generation)
            current = {
                TopicPartition(r.topic, r.partition): r.epoch
                for r in self._owners(c, connector)
                if r.task_id == task_id
            }
            ok = {
                tp: off
                for tp, off in offsets.items()
                if tp in current and owned.get(tp) == current[tp]
            }
            self.meta._upsert_offsets(c, connector, int(group.epoch), ok, now, scope)
            return CommitResult(committed=ok, refused=frozenset(offsets) - frozenset(ok))

    def release(
        self,
        connector: str,
        task_id: int,
        generation: int,
        offsets: Offsets,
        owned: Mapping[TopicPartition, int],
        scope: PositionScope | None = None,
    ) -> Offsets:
        """The handover: commit the releasing partitions' offsets and give them to their new owner.

        Call at a batch boundary after the last batch that read them was acknowledged
        (``offsets`` are their next offsets; a partition without new progress keeps its
        committed offset). Returns the offsets the new owners start from."""
        now = self.meta.clock()
        with self.meta._tx() as c:
            self._lock_group(c, connector)
            self._fenced_task(c, connector, task_id, generation)
            up = self._up(c, connector)
            rows = [
                r
                for r in self._owners(c, connector)
                if r.task_id == task_id and r.pending_task_id in up
            ]
            mine = {TopicPartition(r.topic, r.partition): r.epoch for r in rows}
            ok = {
                tp: off for tp, off in offsets.items() if tp in mine and owned.get(tp) == mine[tp]
            }
            epoch = self._bump(c, connector)
            self.meta._upsert_offsets(c, connector, epoch, ok, now, scope)
            moved = self._transfer(c, connector, rows, epoch, now)
            self._drop_finished(c, connector)
            if moved:
                to = {TopicPartition(r.topic, r.partition): r.pending_task_id for r in rows}
                self._history(
                    c,
                    connector,
                    f"tasks: task {task_id} handed over "
                    + ", ".join(
                        f"{tp}@{off} to task {to[tp]}" for tp, off in sorted(moved.items())
                    ),
                )
            return moved
