"""The meta store: connectors, brokers, offsets, heartbeats and state history.

SQLite file by default (zero set-up), PostgreSQL by URL in production
(``CONVEYOR_META_URL``). Every offset commit and heartbeat is fenced:
``UPDATE ... WHERE name = :n AND generation = :g``; when no row changes the run
has lost its assignment and gets ``FencedError``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from conveyor.core.errors import (
    AlreadyClaimedError,
    ConfigError,
    ConveyorError,
    FencedError,
    TransientStoreError,
)
from conveyor.core.home import conveyor_home
from conveyor.core.model import (
    Broker,
    ConnectorStatus,
    DesiredState,
    HeartbeatReply,
    Offsets,
    SourceSpec,
    TopicPartition,
    parse_start_timestamp,
)
from conveyor.core.positions import (
    PositionError,
    PositionScope,
    StoredPosition,
    StoredPositions,
    parse_positions,
    topics_read,
)
from conveyor.core.scrubbing import scrub
from conveyor.core.sink import task_writer
from conveyor.core.state import StateChange
from conveyor.store import schema as t


class StoreError(ConveyorError):
    """The meta store is unreachable or inconsistent."""


class UnknownConnectorError(ConveyorError):
    """No connector of that name."""


class NotStoppedError(ConveyorError):
    """The operation needs a stopped connector (offsets are changed only when it is stopped)."""


def offsets_editable(row: ConnectorRow) -> bool:
    """Stopped (or failed) and meant to stay stopped: no run can commit meanwhile."""
    return (
        row.status in (ConnectorStatus.STOPPED, ConnectorStatus.ERROR)
        and row.desired == DesiredState.STOPPED
    )


# Statuses in which a run holds the connector and heartbeats.
LIVE_STATUSES = (ConnectorStatus.RUNNING, ConnectorStatus.DEGRADED, ConnectorStatus.PAUSED)

# PostgreSQL advisory locks on connector names use this first key ("CONV").
NAME_LOCK_KEY = 0x434F4E56


def _require_editable(row: ConnectorRow, what: str) -> None:
    if not offsets_editable(row):
        raise NotStoppedError(
            f"connector {row.name!r} is {row.status.value} (desired {row.desired.value}); "
            f"{what} can be changed only when it is stopped: stop it first"
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


def default_meta_url() -> str:
    url = os.environ.get("CONVEYOR_META_URL")
    if url:
        return url
    home = conveyor_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'meta.db'}"


def redact_url(url: str) -> str:
    return sa.make_url(url).render_as_string(hide_password=True)


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


@dataclass(frozen=True)
class HistoryRow:
    connector: str
    at: float
    from_status: str | None
    to_status: str
    reason: str
    run_id: str | None
    generation: int | None


@dataclass
class Claim:
    """What a run holds after claiming a connector."""

    name: str
    generation: int
    broker_id: str | None
    offsets: Offsets = field(default_factory=dict)
    incarnation: str = ""
    legacy_positions: bool = False


def _row(r: sa.Row[Any]) -> ConnectorRow:
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


class MetaStore:
    """Connector state in SQLite or PostgreSQL; safe for many processes at once."""

    def __init__(
        self,
        url: str | None = None,
        *,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = 30.0,
    ):
        self.url = _with_driver(url or default_meta_url())
        self.clock = clock
        self.dialect = sa.make_url(self.url).get_backend_name()
        if self.dialect == "sqlite":
            # A writer waits up to busy_timeout_s for a lock, then gets "database is locked"
            # (TransientStoreError in the run's writes, retried there).
            self.engine = sa.create_engine(self.url, connect_args={"timeout": busy_timeout_s})
            sa.event.listen(
                self.engine,
                "connect",
                lambda conn, rec: _sqlite_on_connect(conn, rec, busy_timeout_s),
            )
            sa.event.listen(self.engine, "begin", _sqlite_on_begin)
        else:
            self.engine = sa.create_engine(
                self.url,
                pool_pre_ping=True,
                pool_size=2,
                max_overflow=4,
                # Every statement and connection attempt is bounded: a store that hangs
                # is an outage (TransientStoreError), not a stuck run.
                connect_args={
                    "connect_timeout": 10,
                    "options": "-c statement_timeout=30000 -c lock_timeout=30000",
                },
            )
        self._schema_ready = False

    def __repr__(self) -> str:
        return f"MetaStore({redact_url(self.url)})"

    def close(self) -> None:
        self.engine.dispose()

    # -- schema ---------------------------------------------------------------

    def ensure_schema(self) -> None:
        """Create the tables, or migrate them to SCHEMA_VERSION. Idempotent."""
        if self._schema_ready:
            return
        try:
            # Already current (every process but the first): found by a read, so opening a
            # store takes no write lock.
            with self._read_only() as c:
                current = (
                    sa.inspect(c).has_table(t.schema_version.name)
                    and c.execute(
                        sa.select(t.schema_version.c.version).where(t.schema_version.c.id == 1)
                    ).scalar()
                    == t.SCHEMA_VERSION
                )
            if current:
                self._schema_ready = True
                return
            t.metadata.create_all(self.engine, checkfirst=True)
            with self.engine.begin() as c:
                row = c.execute(
                    sa.select(t.schema_version.c.version).where(t.schema_version.c.id == 1)
                ).first()
                if row is None:
                    c.execute(
                        t.schema_version.insert().values(
                            id=1, version=t.SCHEMA_VERSION, migrated_at=self.clock()
                        )
                    )
                elif row.version > t.SCHEMA_VERSION:
                    raise StoreError(
                        f"meta store schema is version {row.version}, newer than this Conveyor "
                        f"({t.SCHEMA_VERSION}); upgrade Conveyor"
                    )
                else:
                    for v in range(row.version, t.SCHEMA_VERSION):
                        t.MIGRATIONS[v](c)
                    c.execute(
                        t.schema_version.update()
                        .where(t.schema_version.c.id == 1)
                        .values(version=t.SCHEMA_VERSION, migrated_at=self.clock())
                    )
        except sa.exc.OperationalError as e:
            raise StoreError(f"meta store {redact_url(self.url)} is unreachable: {e.orig}") from e
        self._schema_ready = True

    def schema_version(self) -> int:
        with self._read() as c:
            return int(c.execute(sa.select(t.schema_version.c.version)).scalar_one())

    @contextmanager
    def _tx(self) -> Iterator[sa.Connection]:
        """A read-write transaction (on SQLite ``BEGIN IMMEDIATE``: it holds the write lock)."""
        self.ensure_schema()
        with self.engine.begin() as c:
            yield c

    @contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        """A read-only transaction. On SQLite a deferred ``BEGIN``: in WAL mode it takes no
        write lock, so a reader neither queues behind a writer nor blocks one, and a process
        that hangs while reading (SIGSTOP, a debugger, a paused VM) holds nothing the
        scheduler and the other runs need."""
        self.ensure_schema()
        with self._read_only() as c:
            yield c

    @contextmanager
    def _read_only(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as c:
            c.execution_options(conveyor_read_only=True)
            with c.begin():
                yield c

    # -- connectors -------------------------------------------------------------

    def sync_spec(
        self,
        name: str,
        *,
        spec_json: str | None,
        spec_hash: str | None,
        source: str,
        error: str | None,
        desired: DesiredState = DesiredState.RUNNING,
    ) -> ConnectorRow:
        """Insert or update a connector's spec; runtime state is kept.

        A spec error puts the connector in Error with the message; fixing the spec
        returns it to Idle so it can be scheduled again. A new row is inserted only while
        its spec file exists, checked under the name's lock that ``delete`` takes too: a
        sync that read the file before a delete cannot bring the connector back
        (``UnknownConnectorError``).
        """
        error = scrub(error) if error is not None else None  # never a resolved secret
        # Unchanged (every tick of the scheduler, for every spec): answered by a read, so the
        # sync takes no write lock when there is nothing to write.
        with self._read() as c:
            cur = c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).first()
        if cur is not None and _spec_unchanged(_row(cur), spec_hash, source, error):
            return _row(cur)
        now = self.clock()
        with self._tx() as c:
            self._lock_name(c, name)
            cur = c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).first()
            if cur is None:
                self._insert_spec(c, name, spec_json, spec_hash, source, error, desired, now)
            else:
                row = _row(cur)
                if _spec_unchanged(row, spec_hash, source, error):
                    return row
                self._update_spec(c, name, row, spec_json, spec_hash, source, error, now)
            return _row(c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).one())

    def _insert_spec(
        self,
        c: sa.Connection,
        name: str,
        spec_json: str | None,
        spec_hash: str | None,
        source: str,
        error: str | None,
        desired: DesiredState,
        now: float,
    ) -> None:
        """Creates the connector's row (Idle, or Error with the spec's error) while its spec
        file still exists, with a ``created`` history entry."""
        if _file_gone(source):
            # Read before a delete that removed the file (and the row) since: the
            # delete stands.
            raise UnknownConnectorError(
                f"connector {name!r} is not created again: its spec file {source} "
                "is gone (deleted meanwhile)"
            )
        status = ConnectorStatus.ERROR if error else ConnectorStatus.IDLE
        # A new incarnation: its generations start above any an earlier connector of this name
        # reached here, so a zombie run of a deleted one matches none of them.
        before = c.execute(
            sa.select(sa.func.max(t.state_history.c.generation)).where(
                t.state_history.c.connector == name
            )
        ).scalar()
        c.execute(
            t.connectors.insert().values(
                name=name,
                incarnation=t.new_incarnation(),
                legacy_positions=False,
                spec_json=spec_json,
                spec_hash=spec_hash,
                spec_source=source,
                spec_error=error,
                desired=desired.value,
                status=status.value,
                status_since=now,
                generation=int(before or 0),
                last_error=error,
                restarts=0,
                created_at=now,
                updated_at=now,
            )
        )
        self._history(c, name, None, status, "created" + (f": {error}" if error else ""), None, 0)

    def _update_spec(
        self,
        c: sa.Connection,
        name: str,
        row: ConnectorRow,
        spec_json: str | None,
        spec_hash: str | None,
        source: str,
        error: str | None,
        now: float,
    ) -> None:
        """Stores a changed spec (a valid one replaces the last valid one; an invalid one only
        its error) and the status change it brings."""
        values: dict[str, Any] = {"spec_source": source, "spec_error": error}
        if error is None:
            values.update(spec_json=spec_json, spec_hash=spec_hash)
        values["updated_at"] = now
        values.update(self._spec_status_change(c, name, row, error, now))
        c.execute(t.connectors.update().where(t.connectors.c.name == name).values(**values))

    def _spec_status_change(
        self, c: sa.Connection, name: str, row: ConnectorRow, error: str | None, now: float
    ) -> dict[str, Any]:
        """The status values a spec change brings, with its history entry: a live run goes on
        with the last valid spec; an idle connector with an invalid spec goes to Error; a
        fixed spec returns a connector in Error to Idle."""
        if error and row.status in LIVE_STATUSES:
            # The run goes on with the last valid spec; the error is shown next to it.
            if row.spec_error != error:
                self._history(
                    c,
                    name,
                    row.status,
                    row.status,
                    f"invalid spec (the run goes on with the last valid one): {error}",
                    row.run_id,
                    row.generation,
                )
            return {}
        if error and row.status != ConnectorStatus.ERROR:
            self._history(
                c,
                name,
                row.status,
                ConnectorStatus.ERROR,
                f"invalid spec: {error}",
                row.run_id,
                row.generation,
            )
            return {"status": ConnectorStatus.ERROR.value, "status_since": now, "last_error": error}
        if not error and row.spec_error and row.status == ConnectorStatus.ERROR:
            self._history(
                c,
                name,
                row.status,
                ConnectorStatus.IDLE,
                "spec fixed",
                row.run_id,
                row.generation,
            )
            return {
                "status": ConnectorStatus.IDLE.value,
                "status_since": now,
                "last_error": None,
                "restarts": 0,
            }
        return {}

    def get(self, name: str) -> ConnectorRow:
        with self._read() as c:
            r = c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).first()
        if r is None:
            raise UnknownConnectorError(f"no connector named {name!r}")
        return _row(r)

    def list(self) -> list[ConnectorRow]:
        with self._read() as c:
            return [
                _row(r) for r in c.execute(sa.select(t.connectors).order_by(t.connectors.c.name))
            ]

    def delete(self, name: str, *, kept: Iterable[str] = ()) -> None:
        """Forget a connector in one transaction: its row, offsets, source state and partition
        tasks. Its runs and tasks are fenced for good (no generation left to match; a connector
        created again under the name starts above every generation it had), so a zombie's
        commit or heartbeat is refused and cannot bring it back; nor can a spec sync that read
        its file before the delete (``sync_spec``). ``kept``: what the delete left elsewhere
        (positions in an unreachable target), for the history. Idempotent."""
        with self._tx() as c:
            row = self._lock_if_any(c, name)
            drop_tasks(c, name)
            c.execute(t.offsets.delete().where(t.offsets.c.connector == name))
            c.execute(t.source_state.delete().where(t.source_state.c.connector == name))
            c.execute(t.connectors.delete().where(t.connectors.c.name == name))
            self._history(
                c,
                name,
                row.status if row else None,
                ConnectorStatus.STOPPED,
                "deleted" + "".join(f"; left: {k}" for k in kept),
                None,
                row.generation if row else None,
            )

    def stop(self, name: str, *, reason: str) -> ConnectorRow:
        """Desired stopped, and the fencing that goes with it, in one transaction.

        A run that holds the connector live (``Running``/``Degraded``/``Paused`` with its
        run id) is left to stop itself at its next heartbeat: it commits the batch in
        flight and releases the connector fenced on its generation. Anything else (no run,
        a run that has claimed but not yet heartbeated, partition tasks) is ``Stopped`` at
        once with the generation bumped; every partition task's generation is bumped in
        both cases. So once the connector shows ``Stopped`` no run of an older generation
        can commit: an offsets reset right after it stands."""
        with self._tx() as c:
            row = self._lock_operator(c, name)
            tasks = fence_tasks(c, name, self.clock())
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
        if self.dialect != "sqlite":
            q, g = q.with_for_update(), g.with_for_update()
        r = c.execute(q).first()
        c.execute(g).first()
        return _row(r) if r is not None else None

    def _lock_name(self, c: sa.Connection, name: str) -> None:
        """Serialise creating and deleting one name (on SQLite ``BEGIN IMMEDIATE`` already
        does; on PostgreSQL there may be no row yet to lock)."""
        if self.dialect == "postgresql":
            c.execute(
                sa.text("SELECT pg_advisory_xact_lock(:k, hashtext(:n))"),
                {"k": NAME_LOCK_KEY, "n": name},
            )

    def _fence(self, c: sa.Connection, row: ConnectorRow) -> int:
        """Bump the connector's generation and every partition task's: whatever ran before
        is refused from now on. Returns the new generation."""
        now = self.clock()
        generation = row.generation + 1
        c.execute(
            t.connectors.update()
            .where(t.connectors.c.name == row.name)
            .values(generation=generation, updated_at=now)
        )
        fence_tasks(c, row.name, now)
        return generation

    def set_desired(self, name: str, desired: DesiredState, *, reason: str = "") -> ConnectorRow:
        now = self.clock()
        with self._tx() as c:
            row = self._get_for_update(c, name)
            values: dict[str, Any] = {"desired": desired.value, "updated_at": now}
            if desired.wants_run and row.status in (
                ConnectorStatus.STOPPED,
                ConnectorStatus.ERROR,
            ):
                # A user start clears the error and the restart budget.
                values.update(
                    status=ConnectorStatus.IDLE.value,
                    status_since=now,
                    restarts=0,
                    next_restart_at=None,
                    broker_id=None,
                )
                self._history(
                    c,
                    name,
                    row.status,
                    ConnectorStatus.IDLE,
                    reason or "started by user",
                    row.run_id,
                    row.generation,
                )
                # Its partition tasks get a launch window from now, not from their last run.
                c.execute(
                    t.tasks.update().where(t.tasks.c.connector == name).values(changed_at=now)
                )
            c.execute(t.connectors.update().where(t.connectors.c.name == name).values(**values))
            return _row(c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).one())

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
        with self._tx() as c:
            row = self._get_for_update(c, name)
            if expected_generation is not None and row.generation != expected_generation:
                return None
            return self._apply_in(c, row, change, reason)

    def _apply_in(
        self, c: sa.Connection, row: ConnectorRow, change: StateChange, reason: str
    ) -> ConnectorRow:
        """``apply``'s write, inside a transaction that already holds the connector's row."""
        name = row.name
        now = self.clock()
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
        return _row(c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).one())

    def assign(
        self, name: str, broker_id: str, *, expected_generation: int, reason: str
    ) -> int | None:
        """Scheduler: bump the generation and place the connector on a broker (compare-and-set)."""
        row = self.apply(name, expected_generation, StateChange.assign(broker_id), reason)
        return row.generation if row is not None else None

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
        now = self.clock()
        pid = pid if pid is not None else os.getpid()
        host = host or socket.gethostname()
        with self._tx() as c:
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
            offs = self._offsets(c, name)
        return Claim(
            name=name,
            generation=generation,
            broker_id=broker,
            offsets=offs,
            incarnation=row.incarnation,
            legacy_positions=row.legacy_positions,
        )

    def _get_for_update(self, c: sa.Connection, name: str) -> ConnectorRow:
        q = sa.select(t.connectors).where(t.connectors.c.name == name)
        if self.dialect != "sqlite":
            q = q.with_for_update()
        r = c.execute(q).first()
        if r is None:
            raise UnknownConnectorError(f"no connector named {name!r}")
        return _row(r)

    # -- the run's fenced writes ------------------------------------------------

    def commit(
        self, name: str, generation: int, offsets: Offsets, scope: PositionScope | None = None
    ) -> None:
        """Write offsets (next offset to read) for this run's generation, atomically fenced,
        with the logs and destination they are positions of (``scope``)."""
        now = self.clock()
        with transient_errors("committing offsets"), self._tx() as c:
            self._fenced_touch(c, name, generation, now, "not committing")
            self._upsert_offsets(c, name, generation, offsets, now, scope)

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
        now = self.clock()
        with transient_errors("heartbeat"), self._tx() as c:
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
        with transient_errors("checking the generation"), self._read() as c:
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

    # -- offsets --------------------------------------------------------------------

    def committed_offsets(self, name: str) -> Offsets:
        with self._read() as c:
            return self._offsets(c, name)

    def stored_positions(self, name: str) -> StoredPositions:
        """The connector's offsets with the log and destination each names (core/positions.py)."""
        with self._read() as c:
            q = sa.select(t.offsets).where(t.offsets.c.connector == name)
            return {
                TopicPartition(r.topic, r.partition): StoredPosition(
                    int(r.next_offset), r.log_id, r.destination
                )
                for r in c.execute(q)
            }

    def record_positions(self, name: str, generation: int, messages: list[str]) -> None:
        """Positions a run did not take as stored (``core.positions.PositionNote``): each in the
        history, the last as the connector's last error (fenced: a stale run records nothing)."""
        if not messages:
            return
        now = self.clock()
        with transient_errors("recording positions"), self._tx() as c:
            row = c.execute(
                sa.select(t.connectors.c.status, t.connectors.c.run_id).where(
                    t.connectors.c.name == name, t.connectors.c.generation == generation
                )
            ).first()
            if row is None:
                return
            status = ConnectorStatus(row.status)
            for m in messages:
                self._history(c, name, status, status, f"position: {m}", row.run_id, generation)
            last = (
                messages[-1]
                if len(messages) == 1
                else f"{messages[-1]} (and {len(messages) - 1} more: see history)"
            )
            c.execute(
                t.connectors.update()
                .where(t.connectors.c.name == name, t.connectors.c.generation == generation)
                .values(last_error=scrub(last), updated_at=now)
            )

    def positions_adopted(self, name: str, generation: int) -> None:
        """A migrated connector's run took what its target kept under the bare writer name:
        later runs look only under its writer id (fenced: a stale run changes nothing)."""
        with transient_errors("recording adopted positions"), self._tx() as c:
            c.execute(
                t.connectors.update()
                .where(t.connectors.c.name == name, t.connectors.c.generation == generation)
                .values(legacy_positions=False)
            )

    def _offsets(self, c: sa.Connection, name: str) -> Offsets:
        q = sa.select(t.offsets).where(t.offsets.c.connector == name)
        return {TopicPartition(r.topic, r.partition): int(r.next_offset) for r in c.execute(q)}

    def reset_offsets(
        self,
        name: str,
        offsets: Offsets,
        *,
        replace: bool = False,
        forget: Iterable[TopicPartition] = (),
        reason: str | None = None,
    ) -> None:
        """Set offsets by hand (CLI, API). Refused unless the connector is stopped.

        ``replace``: every stored offset goes first (the connector starts over from
        ``source.start_from`` where ``offsets`` names no partition); ``forget``: those
        partitions' offsets go (KIP-875's ``"offset": null``).
        """
        now = self.clock()
        forget = list(forget)
        with self._tx() as c:
            row = self._lock_operator(c, name)
            _require_editable(row, "offsets")
            # Fenced in the same transaction: a batch in flight of any older run (a stuck
            # thread, a task that missed the stop) is refused, so the reset stands.
            generation = self._fence(c, row)
            if replace:
                c.execute(t.offsets.delete().where(t.offsets.c.connector == name))
            for tp in forget:
                c.execute(
                    t.offsets.delete().where(
                        t.offsets.c.connector == name,
                        t.offsets.c.topic == tp.topic,
                        t.offsets.c.partition == tp.partition,
                    )
                )
            self._upsert_offsets(c, name, generation, offsets, now)
            what = _fmt_offsets(offsets) or "-"
            if forget:
                what += "; forgotten: " + ", ".join(str(tp) for tp in sorted(forget))
            if replace:
                what = "all cleared" + (f", then {what}" if offsets else "")
            self._history(
                c,
                name,
                row.status,
                row.status,
                f"{reason or 'offsets reset'}: {what}; generation {row.generation} fenced",
                None,
                generation,
            )

    # -- offsets a sink's target keeps (exactly once; issue 37) ----------------------------

    def fence_writers(self, name: str, *, reason: str) -> dict[str, int]:
        """Before an offsets change moves the offsets a connector's target keeps: the
        connector's generation and every partition task's bumped (``_fence``; stopped only),
        and each writer's new generation, by the name its target commits carry (the
        connector's own, ``<connector>.task<N>``). The target's fence is raised to these; every
        later run of a writer gets a generation at least as high (runs claim above the
        connector's, tasks restart above theirs), and no older run holds one."""
        with self._tx() as c:
            row = self._lock_operator(c, name)
            _require_editable(row, "offsets")
            generation = self._fence(c, row)
            writers = {name: generation, **task_writers(c, name)}
            self._history(
                c,
                name,
                row.status,
                row.status,
                f"{reason}: generation {row.generation} fenced for the change in the target",
                None,
                generation,
            )
        return writers

    def _upsert_offsets(
        self,
        c: sa.Connection,
        name: str,
        generation: int,
        offsets: Offsets,
        now: float,
        scope: PositionScope | None = None,
    ) -> None:
        """Offsets set (backwards too), with what they are positions of: a run's commit names
        its logs and destination (``scope``); an operator's offsets name none (NULL: taken for
        the log that is there, after a range check)."""
        if not offsets:
            return
        rows = [
            {
                "connector": name,
                "topic": tp.topic,
                "partition": tp.partition,
                "next_offset": off,
                "generation": generation,
                "committed_at": now,
                "log_id": scope.log_ids.get(tp.topic) if scope else None,
                "destination": scope.destination if scope else None,
            }
            for tp, off in offsets.items()
        ]
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
        stmt = insert(t.offsets).values(rows)
        stmt = stmt.on_conflict_do_update(
            index_elements=["connector", "topic", "partition"],
            set_={
                "next_offset": stmt.excluded.next_offset,
                "generation": stmt.excluded.generation,
                "committed_at": stmt.excluded.committed_at,
                "log_id": stmt.excluded.log_id,
                "destination": stmt.excluded.destination,
            },
        )
        c.execute(stmt)

    # -- brokers --------------------------------------------------------------------

    def upsert_broker(self, broker: Broker, *, keep_draining: bool = True) -> None:
        now = self.clock()
        with self._tx() as c:
            cur = c.execute(sa.select(t.brokers).where(t.brokers.c.id == broker.id)).first()
            values = {
                "capacity": broker.capacity,
                "spark_remote": broker.spark_remote,
                "run_tags_json": json.dumps(broker.run_tags, sort_keys=True),
                "updated_at": now,
                "gone_at": None,  # back in the brokers file
            }
            if cur is None:
                c.execute(
                    t.brokers.insert().values(id=broker.id, draining=broker.draining, **values)
                )
            else:
                if not keep_draining:
                    values["draining"] = broker.draining
                c.execute(t.brokers.update().where(t.brokers.c.id == broker.id).values(**values))

    def list_brokers(self) -> list[Broker]:
        with self._read() as c:
            return [
                Broker(
                    id=r.id,
                    capacity=r.capacity,
                    spark_remote=r.spark_remote,
                    run_tags=json.loads(r.run_tags_json or "{}"),
                    draining=bool(r.draining),
                )
                for r in c.execute(sa.select(t.brokers).order_by(t.brokers.c.id))
            ]

    def get_broker(self, broker_id: str) -> Broker | None:
        return next((b for b in self.list_brokers() if b.id == broker_id), None)

    def gone_brokers(self) -> set[str]:
        """Ids of the brokers marked gone (no longer in the brokers file)."""
        with self._read() as c:
            return set(
                c.execute(
                    sa.select(t.brokers.c.id).where(t.brokers.c.gone_at.is_not(None))
                ).scalars()
            )

    def mark_gone(self, broker_ids: Iterable[str]) -> None:
        """Brokers no longer in the brokers file: kept, marked gone (see scheduler.gone_brokers)."""
        ids = list(broker_ids)
        if not ids:
            return
        now = self.clock()
        with self._tx() as c:
            c.execute(
                t.brokers.update()
                .where(t.brokers.c.id.in_(ids), t.brokers.c.gone_at.is_(None))
                .values(gone_at=now, updated_at=now)
            )

    def set_draining(self, broker_id: str, draining: bool) -> None:
        with self._tx() as c:
            res = c.execute(
                t.brokers.update()
                .where(t.brokers.c.id == broker_id)
                .values(draining=draining, updated_at=self.clock())
            )
            if res.rowcount == 0:
                raise ConveyorError(f"no broker named {broker_id!r}")

    # -- history --------------------------------------------------------------------

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
        c.execute(
            t.state_history.insert().values(
                connector=name,
                at=self.clock(),
                from_status=from_status.value if from_status else None,
                to_status=to_status.value,
                reason=scrub(reason)[:4000],
                run_id=run_id,
                generation=generation,
            )
        )

    def record(self, name: str, reason: str, *, run_id: str | None = None) -> None:
        """A history entry without a status change (a scheduler decision, a replay)."""
        row = self.get(name)
        with self._tx() as c:
            self._history(c, name, row.status, row.status, reason, run_id, row.generation)

    def history(self, name: str | None = None, limit: int = 50) -> list[HistoryRow]:
        q = sa.select(t.state_history).order_by(t.state_history.c.id.desc()).limit(limit)
        if name:
            q = q.where(t.state_history.c.connector == name)
        with self._read() as c:
            return [
                HistoryRow(
                    r.connector, r.at, r.from_status, r.to_status, r.reason, r.run_id, r.generation
                )
                for r in c.execute(q)
            ]

    # -- source connectors' state --------------------------------------------------------

    def save_source_state(
        self,
        name: str,
        generation: int,
        state: dict[str, Any],
        *,
        version: int,
        abandoned: bool = False,
    ) -> None:
        """Store a source connector's state for this generation: one transaction, fenced.

        ``abandoned``: the batch up to ``state`` was skipped on the operator's request
        (clears the request, records ``last_abandon_at``)."""
        now = self.clock()
        with self._tx() as c:
            self._fenced_touch(c, name, generation, now, "state not stored")
            values: dict[str, Any] = {
                "version": version,
                "state_json": json.dumps(state, sort_keys=True),
                "generation": generation,
                "saved_at": now,
            }
            if abandoned:
                values.update(abandon_requested=False, last_abandon_at=now)
                self._history(
                    c,
                    name,
                    None,
                    ConnectorStatus.RUNNING,
                    f"batch abandoned by the operator's request; now at {values['state_json']}",
                    None,
                    generation,
                )
            updated = c.execute(
                t.source_state.update().where(t.source_state.c.connector == name).values(**values)
            )
            if updated.rowcount == 0:
                c.execute(t.source_state.insert().values(connector=name, **values))

    def source_state(self, name: str) -> tuple[int, dict[str, Any]] | None:
        """(version, state) last stored for a source connector, or None (none stored yet)."""
        info = self.source_state_info(name)
        if info is None or info["state"] is None:
            return None
        return int(info["version"]), info["state"]

    def source_state_info(self, name: str) -> dict[str, Any] | None:
        """The stored state row: version, state, generation, saved_at, abandon bookkeeping."""
        with self._read() as c:
            r = c.execute(
                sa.select(t.source_state).where(t.source_state.c.connector == name)
            ).first()
        if r is None:
            return None
        return {
            "version": int(r.version),
            "state": json.loads(r.state_json),
            "generation": r.generation,
            "saved_at": r.saved_at,
            "abandon_requested": bool(r.abandon_requested),
            "last_abandon_at": r.last_abandon_at,
        }

    def request_abandon(self, name: str) -> None:
        """Ask the connector's next run to skip its first batch (a documented data-loss escape)."""
        now = self.clock()
        with self._tx() as c:
            self._get_for_update(c, name)
            updated = c.execute(
                t.source_state.update()
                .where(t.source_state.c.connector == name)
                .values(abandon_requested=True)
            )
            if updated.rowcount == 0:
                c.execute(
                    t.source_state.insert().values(
                        connector=name,
                        version=0,
                        state_json="null",
                        generation=0,
                        saved_at=now,
                        abandon_requested=True,
                    )
                )
            self._history(
                c, name, None, ConnectorStatus.STOPPED, "abandon-batch requested", None, None
            )

    def reset_source_state(self, name: str, *, reason: str = "source state reset") -> bool:
        """Forget a stopped source connector's state (an operator command); True when there
        was one. Checked, written and fenced in one transaction, as ``reset_offsets``."""
        with self._tx() as c:
            row = self._lock_operator(c, name)
            _require_editable(row, "its source state")
            res = c.execute(t.source_state.delete().where(t.source_state.c.connector == name))
            generation = self._fence(c, row)
            self._history(
                c,
                name,
                row.status,
                row.status,
                f"{reason}{'' if res.rowcount else ' (none stored)'}; "
                f"generation {row.generation} fenced",
                None,
                generation,
            )
            return bool(res.rowcount)

    # -- backfill requests (conveyor/control/backfills.py, dagster/sensors/backfills.py) --
    # Module-level pieces of this block (BackfillRequest, parse_backfill_range) follow the class.

    def request_backfill(
        self, connector: str, start: str, end: str, *, requested_by: str
    ) -> BackfillRequest:
        """Store a backfill request (state ``requested``) for the backfills sensor to launch.
        The range is checked here (``parse_backfill_range``, against the topics the connector
        reads): a bad one never becomes a run."""
        now = self.clock()
        with self._tx() as c:
            row = self._get_for_update(c, connector)
            parse_backfill_range(start, end, topics_read(row.spec))
            new_id = c.execute(
                t.backfills.insert()
                .values(
                    connector=connector,
                    range_start=start.strip(),
                    range_end=end.strip(),
                    requested_at=now,
                    requested_by=requested_by[:255],
                    state=BACKFILL_REQUESTED,
                    updated_at=now,
                )
                .returning(t.backfills.c.id)
            ).scalar_one()
            self._history(
                c,
                connector,
                row.status,
                row.status,
                f"backfill {new_id} requested by {requested_by}: {start.strip()} .. {end.strip()}",
                None,
                None,
            )
        return self.backfill(int(new_id))

    def backfill(self, backfill_id: int) -> BackfillRequest:
        with self._read() as c:
            r = c.execute(sa.select(t.backfills).where(t.backfills.c.id == backfill_id)).first()
        if r is None:
            raise UnknownBackfillError(f"no backfill request {backfill_id}")
        return _backfill(r)

    def backfills(
        self,
        connector: str | None = None,
        *,
        states: Iterable[str] | None = None,
        limit: int = 100,
    ) -> list[BackfillRequest]:
        """Backfill requests, newest first."""
        q = sa.select(t.backfills).order_by(t.backfills.c.id.desc()).limit(limit)
        if connector is not None:
            q = q.where(t.backfills.c.connector == connector)
        if states is not None:
            q = q.where(t.backfills.c.state.in_(list(states)))
        with self._read() as c:
            return [_backfill(r) for r in c.execute(q)]

    def update_backfill(
        self,
        backfill_id: int,
        state: str,
        *,
        only_from: Iterable[str] | None = None,
        run_id: str | None = None,
        counts: tuple[int, int, int] | None = None,
        message: str | None = None,
    ) -> bool:
        """Move a request to ``state`` (with its run, counts ``(read, delivered, failed)`` and
        message) if it is in one of ``only_from`` (default: not finished; a finished request
        stays finished). True when it moved."""
        if state not in BACKFILL_STATES:
            raise ValueError(f"unknown backfill state {state!r}")
        values: dict[str, Any] = {"state": state, "updated_at": self.clock()}
        if run_id is not None:
            values["run_id"] = run_id
        if counts is not None:
            values.update(read=counts[0], delivered=counts[1], failed=counts[2])
        if message is not None:
            values["message"] = scrub(message)[:4000]
        with transient_errors("updating a backfill request"), self._tx() as c:
            res = c.execute(
                t.backfills.update()
                .where(
                    t.backfills.c.id == backfill_id,
                    t.backfills.c.state.in_(list(only_from or BACKFILL_OPEN)),
                )
                .values(**values)
            )
            return bool(res.rowcount)


BACKFILL_REQUESTED = "requested"
BACKFILL_LAUNCHED = "launched"
BACKFILL_RUNNING = "running"
BACKFILL_SUCCEEDED = "succeeded"
BACKFILL_FAILED = "failed"
BACKFILL_STATES = (
    BACKFILL_REQUESTED,
    BACKFILL_LAUNCHED,
    BACKFILL_RUNNING,
    BACKFILL_SUCCEEDED,
    BACKFILL_FAILED,
)
BACKFILL_OPEN = (BACKFILL_REQUESTED, BACKFILL_LAUNCHED, BACKFILL_RUNNING)
MAX_POSITION_CHARS = 16_384  # a start or end (a list of partitions' offsets may be long)


class UnknownBackfillError(ConveyorError):
    """No backfill request with that id."""


@dataclass(frozen=True)
class BackfillRequest:
    """A backfill request as the meta store holds it."""

    id: int
    connector: str
    start: str
    end: str
    requested_at: float
    requested_by: str
    state: str
    run_id: str | None
    read: int
    delivered: int
    failed: int
    message: str | None
    updated_at: float

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "connector": self.connector,
            "start": self.start,
            "end": self.end,
            "requested_at": self.requested_at,
            "requested_by": self.requested_by,
            "state": self.state,
            "run_id": self.run_id,
            "read": self.read,
            "delivered": self.delivered,
            "failed": self.failed,
            "message": self.message,
            "updated_at": self.updated_at,
        }


def _backfill(r: sa.Row[Any]) -> BackfillRequest:
    m = r._mapping
    return BackfillRequest(
        id=int(m["id"]),
        connector=m["connector"],
        start=m["range_start"],
        end=m["range_end"],
        requested_at=m["requested_at"],
        requested_by=m["requested_by"],
        state=m["state"],
        run_id=m["run_id"],
        read=int(m["read"]),
        delivered=int(m["delivered"]),
        failed=int(m["failed"]),
        message=m["message"],
        updated_at=m["updated_at"],
    )


Position = str | Offsets  # earliest, latest, an ISO 8601 time (as text), or offsets


def parse_position(text: str, what: str = "backfill", reads: SourceSpec | None = None) -> Position:
    """A backfill's start or end: ``earliest``, ``latest``, an ISO 8601 time (naive = UTC;
    kept as text) or ``TOPIC:PARTITION:OFFSET[,...]`` (``core.positions.parse_positions``, with
    ``reads`` the topics the connector reads). ConfigError naming ``what`` otherwise. The one
    parser of a range: the store, the CLI, the API and the job read it alike."""
    text = text.strip()
    if not text:
        raise ConfigError(
            "empty; expected earliest, latest, an ISO 8601 time or offsets", field=what
        )
    if len(text) > MAX_POSITION_CHARS:
        raise ConfigError(f"longer than {MAX_POSITION_CHARS} characters", field=what)
    if text in ("earliest", "latest"):
        return text
    try:
        parse_start_timestamp(text)
        return text
    except ValueError:
        pass
    if ":" not in text:
        raise ConfigError(
            f"{text[:80]!r} is not earliest, latest, an ISO 8601 time or TOPIC:PARTITION:OFFSET",
            field=what,
        )
    try:
        return parse_positions(text, reads)
    except PositionError as e:
        raise ConfigError(str(e), field=what) from None


def position_ms(position: Position) -> int | None:
    """An ISO 8601 time position in epoch milliseconds; None for the others."""
    if isinstance(position, dict) or position in ("earliest", "latest"):
        return None
    return int(parse_start_timestamp(position).timestamp() * 1000)


def parse_backfill_range(
    start: str, end: str, reads: SourceSpec | None = None
) -> tuple[Position, Position]:
    """``start`` .. ``end`` (end excluded), each checked by ``parse_position`` (``reads``: the
    topics the connector reads), and a range that can hold something: not from latest, not to
    earliest, not backwards."""
    lo, hi = parse_position(start, "start", reads), parse_position(end, "end", reads)
    if lo == "latest":
        raise ConfigError("latest is the end of the log: the range would be empty", field="start")
    if hi == "earliest":
        raise ConfigError("earliest is the start of the log: the range would be empty", field="end")
    lo_ms, hi_ms = position_ms(lo), position_ms(hi)
    if lo_ms is not None and hi_ms is not None and lo_ms >= hi_ms:
        raise ConfigError(f"{end.strip()} is not after the start {start.strip()}", field="end")
    if isinstance(lo, dict) and isinstance(hi, dict):
        behind = [f"{tp}" for tp in sorted(lo) if tp in hi and hi[tp] < lo[tp]]
        if behind:
            raise ConfigError(f"before the start on {', '.join(behind[:5])}", field="end")
    return lo, hi


def _with_driver(url: str) -> str:
    """postgresql:// means psycopg2 (our dependency); SQLAlchemy 2.1 would pick psycopg 3."""
    u = sa.make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg2")
    return u.render_as_string(hide_password=False)


def _file_gone(source: str) -> bool:
    """``source`` names a spec file (an absolute path) that no longer exists."""
    return os.path.isabs(source) and not os.path.exists(source)


def _fmt_offsets(offsets: Offsets) -> str:
    return ", ".join(f"{tp}={off}" for tp, off in sorted(offsets.items()))


@contextmanager
def transient_errors(what: str) -> Iterator[None]:
    """Turn the meta store's transient failures into TransientStoreError (retried by the run).

    Transient: SQLite "database is locked"/"busy", a PostgreSQL connection dropped, refused
    or timed out (a failover, a restart), a statement or lock timeout.
    """
    try:
        yield
    except sa.exc.DBAPIError as e:
        if is_transient(e):
            raise TransientStoreError(f"meta store: {what} failed: {e.orig}") from e
        raise


def is_transient(e: sa.exc.DBAPIError) -> bool:
    if e.connection_invalidated or isinstance(e, (sa.exc.InterfaceError,)):
        return True
    text = str(e.orig).lower()
    return isinstance(e, sa.exc.OperationalError) and any(
        s in text
        for s in (
            "database is locked",
            "database is busy",
            "server closed the connection",
            "connection refused",
            "could not connect",
            "terminating connection",
            "timeout",
            "canceling statement",
            "connection already closed",
            "ssl syscall",
            "the database system is",  # starting up / shutting down / in recovery
        )
    )


def _spec_unchanged(
    row: ConnectorRow, spec_hash: str | None, source: str, error: str | None
) -> bool:
    """``sync_spec`` would write nothing: same source, same error, same spec when valid."""
    return (
        row.spec_error == error
        and (error is not None or row.spec_hash == spec_hash)
        and row.spec_source == source
    )


def _sqlite_on_connect(dbapi_conn: Any, _record: Any, busy_timeout_s: float = 30.0) -> None:
    # Let SQLAlchemy's "begin" event issue BEGIN IMMEDIATE: writers queue on the
    # busy timeout instead of failing with "database is locked" on lock upgrade.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
    cur.close()


def _sqlite_on_begin(conn: sa.Connection) -> None:
    if conn.get_execution_options().get("conveyor_read_only"):
        conn.exec_driver_sql("BEGIN")  # deferred: a reader takes no write lock (WAL)
    else:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def offsets_from_pairs(pairs: Iterable[tuple[str, int, int]]) -> Offsets:
    return {TopicPartition(tp, p): o for tp, p, o in pairs}
