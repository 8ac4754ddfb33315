"""The consistent snapshot of the PostgreSQL CDC source: each table read in key order in one
REPEATABLE READ transaction (the slot's exported snapshot at a first start), a batch at a
time; the state records the tables left and the last key read."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from conveyor.core.errors import PermanentSourceError
from conveyor.sources.base import Polled
from conveyor.sources.postgres_cdc_catalog import CDCCatalog, ident
from conveyor.sources.postgres_cdc_changes import Change, Position, TableInfo
from conveyor.sources.postgres_cdc_config import PostgresCDCConfig
from conveyor.sources.postgres_cdc_messages import CDCMessages


class CDCSnapshot:
    """The snapshot's transaction and its reads; rows become messages through ``messages``."""

    def __init__(self, config: PostgresCDCConfig, catalog: CDCCatalog, messages: CDCMessages):
        self.config = config
        self._catalog = catalog
        self._messages = messages
        self._snap: Any = None  # the snapshot's REPEATABLE READ transaction
        # format debezium: the snapshot transaction's xid and start
        self._xid: int | None = None
        self._us = 0

    def open(self, exported: str | None) -> None:
        """The REPEATABLE READ transaction the snapshot reads in (the exported one, or now)."""
        self.close()
        self._snap = self._catalog.connect()
        self._catalog.run("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY", conn=self._snap)
        if exported:
            self._catalog.run("SET TRANSACTION SNAPSHOT %s", (exported,), conn=self._snap)
        self._us = time.time_ns() // 1000
        if self.config.debezium_values:
            # source.txId of its rows: the snapshot's xmax, the id the next transaction gets.
            # (Debezium's snapshot takes a transaction id, txid_current(): an open transaction
            # with an id holds back the creation of every other slot until it ends.)
            xmax = "SELECT txid_snapshot_xmax(txid_current_snapshot())"
            self._xid = int(self._catalog.run(xmax, conn=self._snap)[0][0])

    def close(self) -> None:
        snap, self._snap = self._snap, None
        if snap is not None:
            with contextlib.suppress(Exception):
                snap.close()

    def poll(self, pos: Position, max_records: int, taken: tuple[str, ...], origin: str) -> Polled:
        """The next rows of the snapshot in key order; the state records the last key read."""
        assert pos.snapshot is not None
        snap = pos.snapshot
        tables, after = list(snap["tables"]), snap.get("after")
        if self._snap is None:
            self.open(None)  # resumed after a restart: a newer snapshot, see CONFIG.md
        info = self._catalog.table(tables[0])
        rows = self._rows(info, after, max_records + 1)
        more = len(rows) > max_records  # one row past the batch: is this the table's last?
        rows = rows[:max_records]
        markers = self._markers(snap, tables, len(rows), more)
        messages = [
            m
            for row, marker in zip(rows, markers, strict=True)
            for m in self._messages.of(self._change(info, row, pos, marker))
        ]
        done = _int_or(snap.get("done"), 1)
        if not more:
            tables, after, done = tables[1:], None, done + 1
        else:
            after = [rows[-1][_column_index(info, k)] for k in info.key]
        if tables:
            state: dict[str, Any] | None = {"tables": tables, "after": after, "done": done}
        else:
            state = None  # its transaction stays open until the stream starts (a failed batch)
        out = Position(pos.lsn, pos.index, pos.safe, state, pos.last_commit).state(taken)
        return Polled(messages, out, origin=origin)

    def _markers(self, snap: dict[str, Any], tables: list[str], n: int, more: bool) -> list[str]:
        """Debezium's ``source.snapshot`` of the batch's ``n`` rows: first (the snapshot's
        first row), last (its last), first/last_in_data_collection (a table's), else true."""
        from conveyor.sources.debezium import snapshot_marker

        if not self.config.debezium_values or n == 0:
            return ["true"] * n
        first_table = _int_or(snap.get("done"), 1) == 0
        fresh = snap.get("after") is None
        last = not more and not any(self._has_rows(t) for t in tables[1:])
        return [
            snapshot_marker(
                first=fresh and i == 0 and first_table,
                last=last and i == n - 1,
                first_in_table=fresh and i == 0,
                last_in_table=not more and i == n - 1,
            )
            for i in range(n)
        ]

    def _has_rows(self, table: str) -> bool:
        from psycopg2 import sql

        query = sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(ident(table))
        return bool(self._catalog.run(query, conn=self._snap)[0][0])

    def _rows(self, info: TableInfo, after: list[Any] | None, limit: int) -> list[Any]:
        from psycopg2 import sql

        if not info.key:
            raise PermanentSourceError(f"table {info.name}: a snapshot needs key columns")
        types = dict((c[0], c[2]) for c in info.columns)
        # Qualified: a bare name in ORDER BY would mean the output column (the text cast).
        schema, _, table = info.name.partition(".")
        keys = sql.SQL(", ").join(sql.Identifier(schema, table, k) for k in info.key)
        where = sql.SQL("")
        args: tuple[Any, ...] = ()
        if after is not None:
            bounds = sql.SQL(", ").join(
                sql.SQL("%s::{}").format(sql.SQL(types[k])) for k in info.key
            )
            where = sql.SQL("WHERE ({}) > ({})").format(keys, bounds)
            args = tuple(after)
        query = sql.SQL("SELECT {} FROM {} {} ORDER BY {} LIMIT {}").format(
            sql.SQL(", ").join(sql.Identifier(c[0]) for c in info.columns),
            ident(info.name),
            where,
            keys,
            sql.Literal(limit),
        )
        self._raw_text(info)
        return self._catalog.run(query, args, conn=self._snap)

    def _raw_text(self, info: TableInfo) -> None:
        """The snapshot's values as their output text, as pgoutput sends them (a ``::text``
        cast is not that: booleans, char(n), inet)."""
        import psycopg2.extensions as ext

        oids = tuple({c[1] for c in info.columns})
        ext.register_type(ext.new_type(oids, "conveyor_raw", lambda v, _cur: v), self._snap)

    def _change(self, info: TableInfo, row: Any, pos: Position, marker: str) -> Change:
        dec = self._catalog.decoder()
        after = {
            c[0]: None if v is None else dec.value(c[1], str(v).encode())
            for c, v in zip(info.columns, row, strict=True)
        }
        return Change(
            "r",
            info.name,
            None,
            after,
            {k: after[k] for k in info.key},
            pos.lsn,
            pos.lsn,
            -1,
            self._xid,
            self._us,
            marker=marker,
        )


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _column_index(info: TableInfo, column: str) -> int:
    return [c[0] for c in info.columns].index(column)
