"""What the meta store's repositories share: the connector row, its locks, its fence, its history.

Every fenced write starts here: a run's write touches the connector's row only at its
generation (``_fenced_touch``); an operator's command takes the connector's name, its row
and its partition-task group, in that order (``_lock_operator``), and bumps the generations
that fence every older run and task (``_fence``), in the transaction that checks and writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from conveyor.core.errors import ConveyorError, FencedError
from conveyor.core.model import ConnectorStatus, DesiredState, Offsets
from conveyor.core.sink import task_writer
from conveyor.core.trust.scrubbing import scrub
from conveyor.store import schema as t
from conveyor.store.database import Database


class UnknownConnectorError(ConveyorError):
    """No connector of that name."""


class NotStoppedError(ConveyorError):
    """The operation needs a stopped connector (offsets are changed only when it is stopped)."""


# Statuses in which a run holds the connector and heartbeats.
LIVE_STATUSES = (ConnectorStatus.RUNNING, ConnectorStatus.DEGRADED, ConnectorStatus.PAUSED)

# PostgreSQL advisory locks on connector names use this first key ("CONV").
NAME_LOCK_KEY = 0x434F4E56


@dataclass(frozen=True)
class ConnectorRow:
    """A connector as the meta store holds it."""

    name: str
    spec_json: str | None
    spec_hash: str | None
    spec_source: str | None
    spec_error: str | None
    desired: DesiredState
    status: ConnectorStatus
    status_since: float
    broker_id: str | None
    generation: int
    run_id: str | None
    run_pid: int | None
    run_host: str | None
    heartbeat_at: float | None
    counters: dict[str, Any]
    last_error: str | None
    restarts: int
    next_restart_at: float | None
    last_moved_at: float | None
    created_at: float
    updated_at: float
    # core/positions.py: the id a target keeps this connector's positions under, and whether
    # it predates it (its target's positions under the bare name are its own).
    incarnation: str = ""
    legacy_positions: bool = False

    @property
    def spec(self) -> dict[str, Any] | None:
        return json.loads(self.spec_json) if self.spec_json else None

    def heartbeat_fresh(self, now: float, timeout_s: float) -> bool:
        return self.heartbeat_at is not None and now - self.heartbeat_at < timeout_s


@dataclass
class Claim:
    """What a run holds after claiming a connector."""

    name: str
    generation: int
    broker_id: str | None
    offsets: Offsets = field(default_factory=dict)
    incarnation: str = ""
    legacy_positions: bool = False


def connector_row(r: sa.Row[Any]) -> ConnectorRow:
    """A ``conveyor_connectors`` row as a ``ConnectorRow``."""
    m = r._mapping
    return ConnectorRow(
        name=m["name"],
        spec_json=m["spec_json"],
        spec_hash=m["spec_hash"],
        spec_source=m["spec_source"],
        spec_error=m["spec_error"],
        desired=DesiredState(m["desired"]),
        status=ConnectorStatus(m["status"]),
        status_since=m["status_since"],
        broker_id=m["broker_id"],
        generation=m["generation"],
        run_id=m["run_id"],
        run_pid=m["run_pid"],
        run_host=m["run_host"],
        heartbeat_at=m["heartbeat_at"],
        counters=json.loads(m["counters_json"]) if m["counters_json"] else {},
        last_error=m["last_error"],
        restarts=m["restarts"],
        next_restart_at=m["next_restart_at"],
        last_moved_at=m["last_moved_at"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        incarnation=m["incarnation"] or "",
        legacy_positions=bool(m["legacy_positions"]),
    )


def offsets_editable(row: ConnectorRow) -> bool:
    """Stopped (or failed) and meant to stay stopped: no run can commit meanwhile."""
    return (
        row.status in (ConnectorStatus.STOPPED, ConnectorStatus.ERROR)
        and row.desired == DesiredState.STOPPED
    )


def require_editable(row: ConnectorRow, what: str) -> None:
    """NotStoppedError unless ``offsets_editable``: ``what`` (offsets, a source state) waits."""
    if not offsets_editable(row):
        raise NotStoppedError(
            f"connector {row.name!r} is {row.status.value} (desired {row.desired.value}); "
            f"{what} can be changed only when it is stopped: stop it first"
        )


def write_history(
    c: sa.Connection,
    name: str,
    at: float,
    from_status: ConnectorStatus | None,
    to_status: ConnectorStatus,
    reason: str,
    run_id: str | None,
    generation: int | None,
) -> None:
    """A line of the connector's state history (its reason scrubbed of secrets)."""
    c.execute(
        t.state_history.insert().values(
            connector=name,
            at=at,
            from_status=from_status.value if from_status else None,
            to_status=to_status.value,
            reason=scrub(reason)[:4000],
            run_id=run_id,
            generation=generation,
        )
    )


def fence_tasks(c: sa.Connection, connector: str, now: float) -> int:
    """Bump the generation of every partition task of ``connector`` (their runs' commits
    and heartbeats are refused; the scheduler launches fresh runs when it runs again).
    Returns how many there were. Call with the task group locked."""
    res = c.execute(
        t.tasks.update()
        .where(t.tasks.c.connector == connector)
        .values(
            generation=t.tasks.c.generation + 1,
            run_id=None,
            run_pid=None,
            heartbeat_at=None,
            changed_at=now,
        )
    )
    return int(res.rowcount or 0)


def drop_tasks(c: sa.Connection, connector: str) -> None:
    """Forget a connector's partition tasks: owners, tasks and group."""
    for table in (t.task_partitions, t.tasks, t.task_groups):
        c.execute(table.delete().where(table.c.connector == connector))


def task_writers(c: sa.Connection, connector: str) -> dict[str, int]:
    """Each partition task's writer name (``core.sink.task_writer``) -> its generation."""
    rows = c.execute(
        sa.select(t.tasks.c.task_id, t.tasks.c.generation).where(t.tasks.c.connector == connector)
    )
    return {task_writer(connector, int(tid)): int(g) for tid, g in rows}


class Repository:
    """A repository of the meta store: one concern's reads and writes over ``db``."""

    def __init__(self, db: Database):
        self.db = db

    def _history(
        self,
        c: sa.Connection,
        name: str,
        from_status: ConnectorStatus | None,
        to_status: ConnectorStatus,
        reason: str,
        run_id: str | None,
        generation: int | None,
    ) -> None:
        write_history(c, name, self.db.clock(), from_status, to_status, reason, run_id, generation)

    def _get_for_update(self, c: sa.Connection, name: str) -> ConnectorRow:
        q = sa.select(t.connectors).where(t.connectors.c.name == name)
        if self.db.dialect != "sqlite":
            q = q.with_for_update()
        r = c.execute(q).first()
        if r is None:
            raise UnknownConnectorError(f"no connector named {name!r}")
        return connector_row(r)

    def _lock_operator(self, c: sa.Connection, name: str) -> ConnectorRow:
        row = self._lock_if_any(c, name)
        if row is None:
            raise UnknownConnectorError(f"no connector named {name!r}")
        return row

    def _lock_if_any(self, c: sa.Connection, name: str) -> ConnectorRow | None:
        """An operator's change holds the connector's name, its row and its task group, in
        that order (the runs' commits take the row or the group: they wait, then find their
        generation gone)."""
        self._lock_name(c, name)
        q = sa.select(t.connectors).where(t.connectors.c.name == name)
        g = sa.select(t.task_groups.c.connector).where(t.task_groups.c.connector == name)
        if self.db.dialect != "sqlite":
            q, g = q.with_for_update(), g.with_for_update()
        r = c.execute(q).first()
        c.execute(g).first()
        return connector_row(r) if r is not None else None

    def _lock_name(self, c: sa.Connection, name: str) -> None:
        """Serialise creating and deleting one name (on SQLite ``BEGIN IMMEDIATE`` already
        does; on PostgreSQL there may be no row yet to lock)."""
        if self.db.dialect == "postgresql":
            c.execute(
                sa.text("SELECT pg_advisory_xact_lock(:k, hashtext(:n))"),
                {"k": NAME_LOCK_KEY, "n": name},
            )

    def _fence(self, c: sa.Connection, row: ConnectorRow) -> int:
        """Bump the connector's generation and every partition task's: whatever ran before
        is refused from now on. Returns the new generation."""
        now = self.db.clock()
        generation = row.generation + 1
        c.execute(
            t.connectors.update()
            .where(t.connectors.c.name == row.name)
            .values(generation=generation, updated_at=now)
        )
        fence_tasks(c, row.name, now)
        return generation

    def _fenced_touch(
        self, c: sa.Connection, name: str, generation: int, now: float, not_done: str
    ) -> None:
        """The fencing UPDATE a run's write starts with: it touches the connector's row only
        at ``generation``, and takes the row lock that serialises against a bump. FencedError
        (ending in ``not_done``) when the generation is no longer current."""
        res = c.execute(
            t.connectors.update()
            .where(t.connectors.c.name == name, t.connectors.c.generation == generation)
            .values(updated_at=now)
        )
        if res.rowcount == 0:
            raise FencedError(
                f"connector {name!r}: generation {generation} is no longer current; {not_done}"
            )
