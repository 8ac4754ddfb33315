"""The partition tasks' tables in the meta store: their rows, locks, reads and shared moves.

The task group row is locked first by every write (``_lock_group``); a task run's write is
fenced on its task's generation (``_fenced_task``). ``store/tasks.py`` says how the
scheduler's changes (``store/task_assignments.py``) and the task runs' writes
(``store/task_ledger.py``) use them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from conveyor.core.errors import FencedError
from conveyor.core.model import ConnectorStatus, Offsets, TopicPartition
from conveyor.core.planning.tasks import TaskGroup, TaskPolicy, TaskSample, TaskView
from conveyor.store import schema as t
from conveyor.store.database import Database
from conveyor.store.offsets import OffsetRepository
from conveyor.store.repository import write_history

ENDING = "Ending"  # merged away: hands over its last partitions, then its row goes
SAMPLES_KEPT = 20


def partition_key(tp: TopicPartition) -> str:
    return f"{tp.topic}:{tp.partition}"


def key_partition(key: str) -> TopicPartition:
    topic, _, p = key.rpartition(":")
    return TopicPartition(topic, int(p))


def samples_to_json(samples: Iterable[TaskSample]) -> str:
    return json.dumps(
        [
            {
                "at": s.at,
                "rates": {partition_key(tp): r for tp, r in s.rates.items()},
                "lags": {partition_key(tp): lag for tp, lag in s.lags.items()},
            }
            for s in samples
        ]
    )


def samples_from_json(text: str | None) -> tuple[TaskSample, ...]:
    return tuple(
        TaskSample(
            float(s["at"]),
            {key_partition(k): float(v) for k, v in s.get("rates", {}).items()},
            {key_partition(k): int(v) for k, v in s.get("lags", {}).items()},
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


class TaskTables:
    """The task tables of one meta store: locks, reads, and the moves its writes share."""

    def __init__(self, db: Database, offsets: OffsetRepository):
        self.db = db
        self.offsets = offsets

    # -- helpers ------------------------------------------------------------------------

    def _lock_group(self, c: sa.Connection, connector: str) -> sa.Row[Any]:
        q = sa.select(t.task_groups).where(t.task_groups.c.connector == connector)
        if self.db.dialect != "sqlite":
            q = q.with_for_update()
        row = c.execute(q).first()
        if row is None:
            # A group only for a connector that exists (waiting out a delete under way): a
            # deleted connector's zombie task or a stale scheduler tick brings nothing back.
            exists = sa.select(t.connectors.c.name).where(t.connectors.c.name == connector)
            if self.db.dialect != "sqlite":
                exists = exists.with_for_update(read=True, key_share=True)
            if c.execute(exists).first() is None:
                raise FencedError(f"connector {connector!r} no longer exists")
            c.execute(
                t.task_groups.insert().values(
                    connector=connector, epoch=0, next_task_id=0, updated_at=self.db.clock()
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
        """A line in the connector's history (at its status and generation), if it exists."""
        row = c.execute(
            sa.select(t.connectors.c.status, t.connectors.c.generation).where(
                t.connectors.c.name == connector
            )
        ).first()
        if row is None:
            return
        status = ConnectorStatus(row.status)
        write_history(c, connector, self.db.clock(), status, status, reason, None, row.generation)

    def _bump(self, c: sa.Connection, connector: str, **values: Any) -> int:
        group = self._lock_group(c, connector)
        epoch = int(group.epoch) + 1
        c.execute(
            t.task_groups.update()
            .where(t.task_groups.c.connector == connector)
            .values(epoch=epoch, updated_at=self.db.clock(), **values)
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

    def _transfer(
        self, c: sa.Connection, connector: str, rows: Sequence[sa.Row[Any]], epoch: int, now: float
    ) -> Offsets:
        """The handed-over ``rows`` to their new owners at ``epoch``; returns each partition's
        committed offset (-1: none), which its new owner starts from."""
        committed = self.offsets.read(c, connector)
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

    # -- reading ------------------------------------------------------------------------

    def tasks(self, connector: str) -> list[TaskRow]:
        with self.db.read() as c:
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
        with self.db.read() as c:
            return sorted(
                r.connector for r in c.execute(sa.select(t.task_groups.c.connector)).all()
            )

    def epoch(self, connector: str) -> int:
        with self.db.read() as c:
            row = c.execute(
                sa.select(t.task_groups.c.epoch).where(t.task_groups.c.connector == connector)
            ).first()
            return int(row.epoch) if row else 0

    def partitions(self, connector: str) -> list[TopicPartition]:
        """Every partition of the connector's topics, as its tasks (or the scheduler) found them."""
        with self.db.read() as c:
            text = c.execute(
                sa.select(t.task_groups.c.partitions_json).where(
                    t.task_groups.c.connector == connector
                )
            ).scalar()
        return sorted(key_partition(k) for k in json.loads(text or "[]"))

    def set_partitions(self, connector: str, partitions: Iterable[TopicPartition]) -> None:
        with self.db.tx() as c:
            self._lock_group(c, connector)
            self._set_partitions(c, connector, partitions)

    def _set_partitions(
        self, c: sa.Connection, connector: str, partitions: Iterable[TopicPartition]
    ) -> None:
        c.execute(
            t.task_groups.update()
            .where(t.task_groups.c.connector == connector)
            .values(partitions_json=json.dumps(sorted(partition_key(tp) for tp in partitions)))
        )

    def load_group(
        self, connector: str, policy: TaskPolicy, partitions: Iterable[TopicPartition]
    ) -> tuple[TaskGroup, int]:
        """The planner's view of a connector's tasks and the epoch it was read at."""
        with self.db.tx() as c:
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
