"""The scheduler's writes to the partition tasks: a tick's splits, merges and moves, handovers.

A tick's decisions are applied in one transaction, fenced on the epoch the plan was made
on; a partition leaves a live owner only by handover (``store/tasks.py``), forced when the
owner stays silent past the heartbeat timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from conveyor.core.errors import FencedError
from conveyor.core.model import Offsets, TopicPartition
from conveyor.core.planning.tasks import TaskChange, TaskDecision
from conveyor.store import schema as t
from conveyor.store.repository import drop_tasks
from conveyor.store.task_tables import ENDING, TaskTables


class TaskAssignments(TaskTables):
    """Which task owns which partition: the scheduler's decisions applied, handovers forced."""

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
        now = self.db.clock()
        with self.db.tx() as c:
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
        now = self.db.clock()
        with self.db.tx() as c:
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

    def drop(self, connector: str) -> None:
        """Forget a connector's tasks (deleted, or back to one run)."""
        with self.db.tx() as c:
            drop_tasks(c, connector)
