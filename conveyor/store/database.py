"""The meta store's database: the engine, the schema and its migrations, the transactions.

SQLite file by default (zero set-up), PostgreSQL by URL in production
(``CONVEYOR_META_URL``). Every repository of the store (``store/meta.py``) and the task
tables (``store/tasks.py``) work through one ``Database``: its ``tx`` takes the write lock,
its ``read`` none, and its ``clock`` stamps every row.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from conveyor.core.errors import ConveyorError, TransientStoreError
from conveyor.core.host.home import conveyor_home
from conveyor.store import schema as t


class StoreError(ConveyorError):
    """The meta store is unreachable or inconsistent."""


def default_meta_url() -> str:
    url = os.environ.get("CONVEYOR_META_URL")
    if url:
        return url
    home = conveyor_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'meta.db'}"


def redact_url(url: str) -> str:
    return sa.make_url(url).render_as_string(hide_password=True)


class Database:
    """One meta store's engine (SQLite or PostgreSQL); safe for many processes at once."""

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

    def close(self) -> None:
        self.engine.dispose()

    def ensure_schema(self) -> None:
        """Create the tables, or migrate them to SCHEMA_VERSION. Idempotent."""
        if self._schema_ready:
            return
        try:
            # Already current (every process but the first): found by a read, so opening a
            # store takes no write lock.
            with self.read_only() as c:
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
                self._migrate(c)
        except sa.exc.OperationalError as e:
            raise StoreError(f"meta store {redact_url(self.url)} is unreachable: {e.orig}") from e
        self._schema_ready = True

    def _migrate(self, c: sa.Connection) -> None:
        """The version row written, or the steps from the stored version applied (a store
        written by a newer Conveyor is refused)."""
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

    def schema_version(self) -> int:
        with self.read() as c:
            return int(c.execute(sa.select(t.schema_version.c.version)).scalar_one())

    @contextmanager
    def tx(self) -> Iterator[sa.Connection]:
        """A read-write transaction (on SQLite ``BEGIN IMMEDIATE``: it holds the write lock)."""
        self.ensure_schema()
        with self.engine.begin() as c:
            yield c

    @contextmanager
    def read(self) -> Iterator[sa.Connection]:
        """A read-only transaction. On SQLite a deferred ``BEGIN``: in WAL mode it takes no
        write lock, so a reader neither queues behind a writer nor blocks one, and a process
        that hangs while reading (SIGSTOP, a debugger, a paused VM) holds nothing the
        scheduler and the other runs need."""
        self.ensure_schema()
        with self.read_only() as c:
            yield c

    @contextmanager
    def read_only(self) -> Iterator[sa.Connection]:
        """A read-only transaction without the schema check (the check itself reads so)."""
        with self.engine.connect() as c:
            c.execution_options(conveyor_read_only=True)
            with c.begin():
                yield c


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


def _with_driver(url: str) -> str:
    """postgresql:// means psycopg2 (our dependency); SQLAlchemy 2.1 would pick psycopg 3."""
    u = sa.make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg2")
    return u.render_as_string(hide_password=False)


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
