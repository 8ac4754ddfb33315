"""The replication slot and the publication of the PostgreSQL CDC source: created, checked
at start, advanced without a stream, measured, dropped when the connector is deleted."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from conveyor.core.errors import PermanentSourceError, TransientSourceError
from conveyor.sources.base import State
from conveyor.sources.postgres_cdc_catalog import CDCCatalog, first_line, ident
from conveyor.sources.postgres_cdc_changes import Position, format_lsn, parse_lsn
from conveyor.sources.postgres_cdc_config import PostgresCDCConfig


class CDCSlot:
    """The connector's slot and publication (``config.slot_name``, ``publication_name``)."""

    def __init__(self, config: PostgresCDCConfig, catalog: CDCCatalog):
        self.config = config
        self._catalog = catalog
        self.gauges: dict[str, float] = {}
        self._gauges_at = 0.0

    def prepare(self, state: State | None) -> bool | None:
        """Before a start from ``state``: None when the stored state streams on from the slot;
        else whether a slot is there to stream from (False: one is created, a snapshot read).
        A slot of another plugin, a lost slot under a stored state (unless when_needed) and a
        leftover slot (``leftover``) are refused."""
        slot = self._catalog.run(
            "SELECT plugin, confirmed_flush_lsn::text FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (self.config.slot_name,),
        )
        if slot and slot[0][0] != "pgoutput":
            raise PermanentSourceError(
                f"slot {self.config.slot_name} uses the plugin {slot[0][0]}, not pgoutput"
            )
        if state is not None:
            Position.of(state)  # readable
            if slot:
                return None
            if self.config.snapshot != "when_needed":
                raise PermanentSourceError(
                    f"replication slot {self.config.slot_name} is gone: changes since the stored "
                    "state are lost; set snapshot: when_needed or reset the state"
                )
        elif slot:
            slot = self.leftover()
        return bool(slot)

    def leftover(self) -> list[Any]:
        """No stored state but the slot exists (left by a deleted connector of that name): its
        position is not this connector's. never: stream from it; when_needed: drop it (a new
        one and a snapshot follow); initial: refuse (a snapshot now plus the slot's changes
        since would deliver rows twice)."""
        name = self.config.slot_name
        if self.config.snapshot == "never":
            return [name]
        if self.config.snapshot == "when_needed":
            self.wait_inactive()
            self._catalog.run("SELECT pg_drop_replication_slot(%s)", (name,))
            return []
        raise PermanentSourceError(
            f"replication slot {name} already exists but this connector has no stored state "
            "(a slot left by a deleted connector?); a snapshot now would repeat the changes "
            f"the slot kept. Drop it with `conveyor connector delete NAME --drop-slot` before "
            "re-creating the connector, or set snapshot: never to resume streaming from the "
            "slot without a snapshot, or snapshot: when_needed to drop and recreate it and "
            "take a fresh snapshot"
        )

    def create(self, *, export: bool, use_snapshot: Callable[[str], None]) -> int:
        """CREATE_REPLICATION_SLOT; its LSN. With export, ``use_snapshot`` imports the exported
        snapshot while the replication connection that made it is open."""
        import psycopg2.extras

        repl = self._catalog.connect(
            connection_factory=psycopg2.extras.LogicalReplicationConnection
        )
        try:
            with repl.cursor() as cur:
                how = "EXPORT_SNAPSHOT" if export else "NOEXPORT_SNAPSHOT"
                cur.execute(
                    f'CREATE_REPLICATION_SLOT "{self.config.slot_name}" LOGICAL pgoutput {how}'
                )
                _name, point, snapshot, _plugin = cur.fetchone()
            if export:
                use_snapshot(snapshot)
            return parse_lsn(point)
        except psycopg2.Error as e:
            raise PermanentSourceError(
                f"cannot create slot {self.config.slot_name}: {first_line(e)}"
            ) from None
        finally:
            repl.close()

    def snapshot_tables(self) -> list[str]:
        return list(self.config.tables) if self.config.tables else self.published_tables()

    def published_tables(self) -> list[str]:
        rows = self._catalog.run(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables "
            "WHERE pubname = %s ORDER BY 1",
            (self.config.publication_name,),
        )
        return [r[0] for r in rows]

    def ensure_publication(self) -> None:
        """A given publication must exist; a managed one is created or set to the tables."""
        name = self.config.publication_name
        found = self._catalog.run(
            "SELECT puballtables FROM pg_publication WHERE pubname = %s", (name,)
        )
        if not self.config.managed_publication:
            if not found:
                raise PermanentSourceError(f"publication {name} does not exist")
            return
        from psycopg2 import sql

        tables = sql.SQL(", ").join(ident(t) for t in self.config.tables)
        target = sql.SQL("FOR TABLE {}").format(tables) if self.config.tables else None
        if found and (found[0][0] == (target is None)):
            if target is None or set(self.published_tables()) == set(self.config.tables):
                return
            self._catalog.run(
                sql.SQL("ALTER PUBLICATION {} SET TABLE {}").format(sql.Identifier(name), tables)
            )
            return
        if found:
            self._catalog.run(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(name)))
        self._catalog.run(
            sql.SQL("CREATE PUBLICATION {} {}").format(
                sql.Identifier(name), target or sql.SQL("FOR ALL TABLES")
            )
        )

    def advance(self, safe: int) -> None:
        """Confirm ``safe`` without a stream (``pg_replication_slot_advance``; idempotent)."""
        current = self._catalog.run(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (self.config.slot_name,),
        )
        if not current:
            raise PermanentSourceError(f"replication slot {self.config.slot_name} is gone")
        if current[0][0] and parse_lsn(current[0][0]) >= safe:
            return
        self._catalog.run(
            "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
            (self.config.slot_name, format_lsn(safe)),
        )

    def measure(self, every_s: float = 10.0) -> None:
        """The slot's lag and retained WAL (bytes), on the loop's thread, at most every 10 s; a
        slot not found or without a confirmed position is measured again at the next poll."""
        if time.monotonic() - self._gauges_at < every_s:
            return
        rows = self._catalog.run(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::float8, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::float8 "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (self.config.slot_name,),
        )
        if rows and rows[0][0] is not None:  # else measured again at the next poll
            self.gauges = {"replication_lag_bytes": rows[0][0], "retained_wal_bytes": rows[0][1]}
            self._gauges_at = time.monotonic()

    def release(self) -> None:
        """Drop the slot and the managed publication (the connector is deleted; no stream open)."""
        from psycopg2 import sql

        self.wait_inactive()
        self._catalog.run(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (self.config.slot_name,),
        )
        if self.config.managed_publication:
            self._catalog.run(
                sql.SQL("DROP PUBLICATION IF EXISTS {}").format(
                    sql.Identifier(self.config.publication_name)
                )
            )

    def wait_inactive(self, timeout_s: float = 30.0) -> None:
        """Until no walsender holds the slot (a stream just closed takes a moment to end)."""
        deadline = time.monotonic() + timeout_s
        while self._catalog.run(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
            (self.config.slot_name,),
        ):
            if time.monotonic() > deadline:
                raise TransientSourceError(
                    f"replication slot {self.config.slot_name} is in use by another process"
                )
            time.sleep(0.1)
