"""The messages of the PostgreSQL CDC source's changes: ``format: conveyor`` (compact),
``format: debezium`` with Conveyor's values, or Debezium's own encodings and schema part
(``conveyor.sources.debezium``: a codec per table from the stream's Relation or the catalog)."""

from __future__ import annotations

import time
from typing import Any

from conveyor import __version__
from conveyor.core.errors import PermanentSourceError
from conveyor.sources.base import SourceMessage
from conveyor.sources.postgres_cdc_catalog import CDCCatalog, parts
from conveyor.sources.postgres_cdc_changes import Change, format_lsn
from conveyor.sources.postgres_cdc_config import PostgresCDCConfig

_OPS = {"c": "insert", "u": "update", "d": "delete", "r": "read", "t": "truncate"}


class CDCMessages:
    """A change's messages; ``stream_keys``: the stream's key columns by relation oid (shared,
    the stream fills and clears it)."""

    def __init__(
        self, config: PostgresCDCConfig, catalog: CDCCatalog, stream_keys: dict[int, list[str]]
    ):
        self.config = config
        self._catalog = catalog
        self._keys = stream_keys
        self._codecs: dict[str, Any] = {}  # schema.table -> its debezium.TableCodec
        self._types: dict[tuple[int, int], Any] = {}  # (oid, typmod) -> debezium.ColumnType
        self._envelope: Any = None

    def of(self, c: Change) -> list[SourceMessage]:
        dest = self.config.destinations.get(c.table)
        if self.config.debezium_values:
            return self._debezium_messages(c, dest)
        key = None if c.key is None else json_bytes(c.key)
        ts = c.ts_ms
        if self.config.format == "debezium":  # value_encoding: conveyor
            out = [
                SourceMessage(json_bytes(self._conveyor_envelope(c)), dest, key, timestamp_ms=ts)
            ]
            if c.op == "d" and self.config.tombstones_on_delete:
                out.append(SourceMessage(None, dest, key, timestamp_ms=ts))
            return out
        return [SourceMessage(json_bytes(conveyor_value(c)), dest, key, timestamp_ms=ts)]

    def _conveyor_envelope(self, c: Change) -> dict[str, Any]:
        """format debezium, value_encoding conveyor: the envelope, Conveyor's values."""
        schema, _, table = c.table.partition(".")
        return {
            "before": c.before,
            "after": c.after,
            "op": c.op,
            "source": {
                "version": __version__,
                "connector": "postgresql",
                "name": self.config.server_name or self.config.slot,
                "ts_ms": c.ts_ms,
                "snapshot": "true" if c.op == "r" else "false",
                "db": self._catalog.database(),
                "schema": schema,
                "table": table,
                "txId": c.xid,
                "lsn": c.lsn,
                **({"unchanged_toast": list(c.unchanged)} if c.unchanged else {}),
            },
            "ts_ms": int(time.time() * 1000),
        }

    def _debezium_messages(self, c: Change, dest: str | None) -> list[SourceMessage]:
        """Debezium's event (and tombstone), the key-change headers on both as Debezium's."""
        from conveyor.sources import debezium as dbz

        tc, env = self._codec(c), self.envelope()
        key = None if c.key is None else env.key(tc, tc.key_of(c.key))
        headers: tuple[tuple[str, bytes], ...] = ()
        if c.peer_key is not None:
            name = dbz.NEW_KEY_HEADER if c.op == "d" else dbz.OLD_KEY_HEADER
            peer = env.key(tc, tc.key_of(c.peer_key))
            headers = ((name, peer),) if peer is not None else ()
        source = env.source(
            c.table,
            db=self._catalog.database(),
            ts_us=c.ts_us,
            snapshot=c.marker,
            last_commit=c.last_commit,
            lsn=c.lsn,
            txid=c.xid,
            origin=c.origin,
        )
        try:
            before, after = tc.row(c.before), tc.row(c.after, c.unchanged)
        except ValueError as e:
            raise PermanentSourceError(
                f"{c.table}: a value Debezium's encoding cannot take: {e}"
            ) from None
        value = env.value(tc, c.op, before, after, source, time.time_ns())
        ts = c.ts_ms
        out = [SourceMessage(value, dest, key, headers=headers, timestamp_ms=ts)]
        if c.op == "d" and self.config.tombstones_on_delete:
            out.append(SourceMessage(None, dest, key, headers=headers, timestamp_ms=ts))
        return out

    def envelope(self) -> Any:
        from conveyor.sources.debezium import Envelope

        if self._envelope is None:
            server = self.config.server_name or self.config.slot_name
            self._envelope = Envelope(server, __version__, self.config.schemas_enable)
        return self._envelope

    def _codec(self, c: Change) -> Any:
        """The table's Debezium codec: its columns as the stream's Relation message (or, for
        snapshot rows, the catalog) has them, NOT NULL and defaults from the catalog."""
        from conveyor.sources import debezium as dbz

        tc = self._codecs.get(c.table)
        if tc is not None:
            return tc
        if c.columns is not None:
            cols = [(col.name, col.type_oid, col.type_modifier) for col in c.columns.columns]
            key = self._keys.get(c.columns.oid) or self._catalog.table(c.table).key
        else:
            info = self._catalog.table(c.table)
            cols, key = [(n, oid, mod) for n, oid, _, mod in info.columns], info.key
        facts = {
            r[0]: (bool(r[1]), r[2]) for r in self._catalog.run(dbz.COLUMNS_QUERY, parts(c.table))
        }
        columns = []
        for name, oid, mod in cols:
            not_null, default = facts.get(name, (False, None))
            columns.append(dbz.Column(name, self._column_type(oid, mod), not not_null, default))
        modes = dbz.Modes(
            decimal=self.config.decimal_handling_mode,
            time=self.config.time_precision_mode,
            binary=self.config.binary_handling_mode,
            interval=self.config.interval_handling_mode,
            placeholder=self.config.unavailable_value_placeholder,
        )
        dec = self._catalog.decoder()
        server = self.envelope().server
        tc = dbz.TableCodec(
            server, c.table, columns, key, modes, lambda t, v: dec.value(t.oid, v.encode())
        )
        self._codecs[c.table] = tc
        return tc

    def _column_type(self, oid: int, typmod: int, depth: int = 0) -> Any:
        """A column type with domains resolved, arrays' elements and enums' labels (cached)."""
        from conveyor.sources import debezium as dbz
        from conveyor.sources.pgoutput import BUILTIN_ARRAYS, BUILTIN_MAX_OID

        known = self._types.get((oid, typmod))
        if known is not None:
            return known
        if depth > 32:
            raise PermanentSourceError(f"type {oid}: domains or arrays nested too deep")
        element = BUILTIN_ARRAYS.get(oid)
        t = dbz.ColumnType(oid, typmod)
        if element is not None:
            t = dbz.ColumnType(oid, typmod, element=self._column_type(element, typmod, depth + 1))
        elif oid >= BUILTIN_MAX_OID:
            rows = self._catalog.run(dbz.TYPE_QUERY, (oid,))
            if rows:
                name, typtype, category, elem, base, base_mod, labels = rows[0]
                if typtype == "d" and base:
                    t = self._column_type(base, typmod if typmod >= 0 else base_mod, depth + 1)
                elif typtype == "e":
                    t = dbz.ColumnType(oid, typmod, name, labels=tuple(labels))
                elif category == "A" and elem:
                    inner = self._column_type(elem, typmod, depth + 1)
                    t = dbz.ColumnType(oid, typmod, name, element=inner)
                else:
                    t = dbz.ColumnType(oid, typmod, name)
        self._types[(oid, typmod)] = t
        return t

    def forget(self, table: str) -> None:
        """A new Relation message of ``table``: its columns may have changed."""
        self._codecs.pop(table, None)


def conveyor_value(c: Change) -> dict[str, Any]:
    """The compact format: table, op, data (the row after; the key for a delete), old."""
    out: dict[str, Any] = {"table": c.table, "op": _OPS[c.op]}
    if c.op == "d":
        out["data"] = c.before
    elif c.op == "t":
        out["data"] = None
        out.update(c.extra)
    else:
        out["data"] = c.after
    if c.op == "u" and c.before is not None:
        out["old"] = c.before
    if c.unchanged:
        out["unchanged"] = list(c.unchanged)
    out.update(
        lsn=format_lsn(c.lsn),
        commit_lsn=format_lsn(c.final_lsn),
        index=c.index,
        xid=c.xid,
        ts_ms=c.ts_ms,
    )
    return out


def json_bytes(value: Any) -> bytes:
    from conveyor.sources.strict_json import dumps

    return dumps(value).encode()
