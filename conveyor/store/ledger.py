"""The run ledger: who runs each connector at which generation, and the run's fenced writes.

The scheduler assigns (a generation bump on a broker), a run claims, heartbeats, commits
and releases; the operator stops. Every offset commit and heartbeat is fenced:
``UPDATE ... WHERE name = :n AND generation = :g``; when no row changes the run has lost
its assignment and gets ``FencedError``. A ``StateChange`` becomes an UPDATE in one place,
``apply``.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from conveyor.core.errors import AlreadyClaimedError, FencedError
from conveyor.core.model import ConnectorStatus, DesiredState, HeartbeatReply, Offsets
from conveyor.core.planning.state import StateChange
from conveyor.core.positions import PositionScope
from conveyor.core.trust.scrubbing import scrub
from conveyor.store import schema as t
from conveyor.store.database import Database, transient_errors
from conveyor.store.offsets import OffsetRepository
from conveyor.store.repository import (
    LIVE_STATUSES,
    Claim,
    ConnectorRow,
    Repository,
    UnknownConnectorError,
    connector_row,
    fence_tasks,
)


class RunLedger(Repository):
    """Connector runs: state transitions, assignment, claim, heartbeat, commit, release, stop."""

    def __init__(self, db: Database, offsets: OffsetRepository):
        super().__init__(db)
        self.offsets = offsets

    def apply(
        self,
        name: str,
        expected_generation: int | None,
        change: StateChange,
        reason: str,
    ) -> ConnectorRow | None:
        """Write one state transition, fenced on ``expected_generation`` (None: unfenced).

        The one place where a ``StateChange`` becomes an UPDATE. Records a history line
        when the status, the generation or the restart budget changes. Returns the new
        row, or None when the generation no longer matches (someone else moved it on).
        """
        with self.db.tx() as c:
            row = self._get_for_update(c, name)
            if expected_generation is not None and row.generation != expected_generation:
                return None
            return self._apply_in(c, row, change, reason)

    def _apply_in(
        self, c: sa.Connection, row: ConnectorRow, change: StateChange, reason: str
    ) -> ConnectorRow:
        """``apply``'s write, inside a transaction that already holds the connector's row."""
        name = row.name
        now = self.db.clock()
        values: dict[str, Any] = {"updated_at": now}
        status = change.status if change.status is not None else row.status
        if status != row.status:
            values.update(status=status.value, status_since=now)
        if change.error is not None:
            values["last_error"] = scrub(change.error)
        elif status in (ConnectorStatus.RUNNING, ConnectorStatus.IDLE) and status != row.status:
            values["last_error"] = None
        if change.desired is not None:
            values["desired"] = change.desired.value
        if change.bump_generation:
            values["generation"] = row.generation + 1
        if change.clear_broker:
            values["broker_id"] = None
        if change.broker_id is not None:
            values["broker_id"] = change.broker_id
        if change.clear_run:
            values.update(run_id=None, run_pid=None, heartbeat_at=None)
        if change.clear_pid:
            values["run_pid"] = None
        if change.restarts is not None:
            values.update(restarts=change.restarts, next_restart_at=None)
        if change.moved_at is not None:
            values["last_moved_at"] = change.moved_at
        if change.counters is not None:
            values["counters_json"] = json.dumps(change.counters)
        c.execute(t.connectors.update().where(t.connectors.c.name == name).values(**values))
        if change.is_recorded(row.status):
            self._history(
                c,
                name,
                row.status,
                status,
                reason,
                None if change.clear_run else row.run_id,
                values.get("generation", row.generation),
            )
        return connector_row(
            c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).one()
        )

    def assign(
        self, name: str, broker_id: str, *, expected_generation: int, reason: str
    ) -> int | None:
        """Scheduler: bump the generation and place the connector on a broker (compare-and-set)."""
        row = self.apply(name, expected_generation, StateChange.assign(broker_id), reason)
        return row.generation if row is not None else None

    def stop(self, name: str, *, reason: str) -> ConnectorRow:
        """Desired stopped, and the fencing that goes with it, in one transaction.

        A run that holds the connector live (``Running``/``Degraded``/``Paused`` with its
        run id) is left to stop itself at its next heartbeat: it commits the batch in
        flight and releases the connector fenced on its generation. Anything else (no run,
        a run that has claimed but not yet heartbeated, partition tasks) is ``Stopped`` at
        once with the generation bumped; every partition task's generation is bumped in
        both cases. So once the connector shows ``Stopped`` no run of an older generation
        can commit: an offsets reset right after it stands."""
        with self.db.tx() as c:
            row = self._lock_operator(c, name)
            tasks = fence_tasks(c, name, self.db.clock())
            if row.run_id is not None and row.status in LIVE_STATUSES and not tasks:
                self._history(
                    c,
                    name,
                    row.status,
                    row.status,
                    f"{reason}: run {row.run_id} stops itself at its next heartbeat",
                    row.run_id,
                    row.generation,
                )
                return self._apply_in(c, row, StateChange(desired=DesiredState.STOPPED), reason)
            fenced = f"{reason} (generation {row.generation} fenced"
            fenced += f", {tasks} partition task(s) fenced)" if tasks else ")"
            return self._apply_in(c, row, StateChange.stop(), fenced)

    def claim(
        self,
        name: str,
        *,
        run_id: str,
        expected_generation: int | None,
        holder_alive: Callable[[ConnectorRow], bool],
        broker_id: str | None = None,
        pid: int | None = None,
        host: str | None = None,
    ) -> Claim:
        """A run takes the connector.

        Launched by the scheduler (``expected_generation`` from the run's tag): the
        run adopts that generation, or is refused when it is stale. Launched by hand:
        the generation is bumped, which fences any older run, unless a live run holds
        the connector, in which case ``AlreadyClaimedError`` explains who.
        """
        now = self.db.clock()
        pid = pid if pid is not None else os.getpid()
        host = host or socket.gethostname()
        with self.db.tx() as c:
            row = self._get_for_update(c, name)
            if row.spec_error:
                raise AlreadyClaimedError(
                    f"connector {name!r} has an invalid spec: {row.spec_error}"
                )
            if expected_generation is not None:
                if row.generation != expected_generation:
                    raise FencedError(
                        f"run launched for generation {expected_generation} of {name!r}, "
                        f"but the connector is at generation {row.generation}: superseded"
                    )
                generation = row.generation
                broker = row.broker_id or broker_id
            else:
                if row.run_id and row.run_id != run_id and holder_alive(row):
                    raise AlreadyClaimedError(
                        f"connector {name!r} is already running in run {row.run_id} "
                        f"(pid {row.run_pid} on {row.run_host}, last heartbeat "
                        f"{now - (row.heartbeat_at or now):.1f}s ago); stop that run first"
                    )
                generation = row.generation + 1
                broker = broker_id or row.broker_id
            c.execute(
                t.connectors.update()
                .where(t.connectors.c.name == name)
                .values(
                    generation=generation,
                    broker_id=broker,
                    run_id=run_id,
                    run_pid=pid,
                    run_host=host,
                    # A scheduled run of a paused connector keeps it paused; a launch by
                    # hand (the UI) means "run it".
                    desired=(
                        row.desired.value
                        if expected_generation is not None and row.desired.wants_run
                        else DesiredState.RUNNING.value
                    ),
                    heartbeat_at=None,
                    updated_at=now,
                )
            )
            self._history(
                c, name, row.status, row.status, f"claimed by run {run_id}", run_id, generation
            )
            offs = self.offsets.read(c, name)
        return Claim(
            name=name,
            generation=generation,
            broker_id=broker,
            offsets=offs,
            incarnation=row.incarnation,
            legacy_positions=row.legacy_positions,
        )

    # -- the run's fenced writes ------------------------------------------------

    def commit(
        self, name: str, generation: int, offsets: Offsets, scope: PositionScope | None = None
    ) -> None:
        """Write offsets (next offset to read) for this run's generation, atomically fenced,
        with the logs and destination they are positions of (``scope``)."""
        now = self.db.clock()
        with transient_errors("committing offsets"), self.db.tx() as c:
            self._fenced_touch(c, name, generation, now, "not committing")
            self.offsets.upsert(c, name, generation, offsets, now, scope)

    def heartbeat(
        self,
        name: str,
        generation: int,
        counters: dict[str, Any],
        *,
        status: ConnectorStatus = ConnectorStatus.RUNNING,
        reason: str | None = None,
        error: str | None = None,
    ) -> HeartbeatReply:
        """Record liveness and counters; moves Idle -> Running on the first one. Fenced.

        Returns the desired state and the stored spec's hash, so a run notices a stop, a
        pause or a changed spec without waiting for the scheduler.
        """
        now = self.db.clock()
        with transient_errors("heartbeat"), self.db.tx() as c:
            cur = c.execute(
                sa.select(
                    t.connectors.c.status,
                    t.connectors.c.run_id,
                    t.connectors.c.desired,
                    t.connectors.c.spec_hash,
                ).where(t.connectors.c.name == name, t.connectors.c.generation == generation)
            ).first()
            if cur is None:
                raise FencedError(
                    f"connector {name!r}: generation {generation} is no longer current"
                )
            values: dict[str, Any] = {
                "heartbeat_at": now,
                "counters_json": json.dumps(counters),
                "updated_at": now,
            }
            if cur.status != status.value or reason is not None:
                # A status change, or a reason the run wants recorded (a stuck stage, the
                # meta store's trouble): both land in the history.
                if cur.status != status.value:
                    values.update(status=status.value, status_since=now)
                if status == ConnectorStatus.RUNNING and cur.status != status.value:
                    values["last_error"] = None
                if status == ConnectorStatus.DEGRADED and reason:
                    values["last_error"] = scrub(reason)
                self._history(
                    c,
                    name,
                    ConnectorStatus(cur.status),
                    status,
                    reason or "heartbeat",
                    cur.run_id,
                    generation,
                )
            if error is not None:
                values["last_error"] = scrub(error)
            c.execute(
                t.connectors.update()
                .where(t.connectors.c.name == name, t.connectors.c.generation == generation)
                .values(**values)
            )
            return HeartbeatReply(DesiredState(cur.desired), cur.spec_hash)

    def ensure_current(self, name: str, generation: int) -> None:
        """Raise FencedError unless ``generation`` is still the connector's (read only)."""
        with transient_errors("checking the generation"), self.db.read() as c:
            current = c.execute(
                sa.select(t.connectors.c.generation).where(t.connectors.c.name == name)
            ).scalar()
        if current != generation:
            raise FencedError(
                f"connector {name!r}: generation {generation} is no longer current "
                f"(now {current}); not sending"
            )

    def release(
        self,
        name: str,
        generation: int,
        status: ConnectorStatus,
        reason: str,
        *,
        error: str | None = None,
        counters: dict[str, Any] | None = None,
    ) -> bool:
        """The run ends: final status (and counters) for its generation. False if already fenced."""
        change = StateChange.release(status, error=error, counters=counters)
        try:
            return self.apply(name, generation, change, reason) is not None
        except UnknownConnectorError:
            return False  # deleted meanwhile: it stays deleted
