"""The task runs' writes: grant, heartbeat, fenced commits per partition, the handover's release.

A commit writes an offset only for a partition whose owner row still names the task at the
epoch of its grant, in the transaction that checks it; ``release`` commits the releasing
partitions' offsets and gives them to their new owner in one transaction.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from conveyor.core.model import DesiredState, Offsets, TopicPartition
from conveyor.core.planning.tasks import TaskSample
from conveyor.core.positions import PositionScope
from conveyor.store import schema as t
from conveyor.store.task_tables import (
    ENDING,
    SAMPLES_KEPT,
    TaskTables,
    key_partition,
    partition_key,
    samples_from_json,
    samples_to_json,
)


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


class TaskLedger(TaskTables):
    """A task run's writes: its grant, heartbeat and samples, commits, release."""

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
        with self.db.read() as c:
            self._fenced_task(c, connector, task_id, generation)

    def grant(self, connector: str, task_id: int, generation: int) -> Grant:
        with self.db.tx() as c:
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
        now = self.db.clock()
        with self.db.tx() as c:
            group = self._lock_group(c, connector)
            row = self._fenced_task(c, connector, task_id, generation)
            if discovered is not None:
                found = sorted(partition_key(tp) for tp in discovered)
                known = json.loads(group.partitions_json or "[]")
                if found and sorted(set(known) | set(found)) != sorted(known):
                    self._set_partitions(
                        c, connector, [key_partition(k) for k in set(known) | set(found)]
                    )
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
        now = self.db.clock()
        with self.db.tx() as c:
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
            self.offsets.upsert(c, connector, int(group.epoch), ok, now, scope)
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
        now = self.db.clock()
        with self.db.tx() as c:
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
            self.offsets.upsert(c, connector, epoch, ok, now, scope)
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
