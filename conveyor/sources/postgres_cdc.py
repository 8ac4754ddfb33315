"""PostgreSQL CDC source: ``pgoutput`` over the streaming replication protocol, keyed changes,
a consistent initial snapshot, an owned slot advanced only in commit.

A change's position is ``(final LSN of its transaction, index in the transaction)``: known at
the transaction's Begin, so a batch may end inside a transaction and a batch holds at most
``max_records`` messages however large the transaction. ``poll`` reads the stream without
confirming anything; polled again from an older state (a failed batch) it restarts the stream
from the slot and skips what the state covers. ``commit`` confirms (standby feedback, or
``pg_replication_slot_advance`` when no stream is open) the end of the last transaction the
state covers completely. While no change of ours is pending, keepalives move the state to the
server's WAL end (at most every ``heartbeat_interval_s``), so an idle table on a busy database
does not hold WAL. Values are decoded by ``conveyor.sources.pgoutput``; ``format: debezium``
messages are put together by ``conveyor.sources.debezium`` (Debezium's encodings, the schema
part, the ``source`` block: its ``sequence`` needs the end of the last transaction read, kept
in the state as ``last_commit_lsn``; its snapshot markers need a snapshot's progress, kept as
``snapshot.done``, the tables finished).
Needs ``wal_level = logical`` and a role with REPLICATION (or superuser).

This module is the stream; beside it: the config (``postgres_cdc_config``), the connection
and catalog (``postgres_cdc_catalog``), positions and changes (``postgres_cdc_changes``), the
slot and publication (``postgres_cdc_slot``), the snapshot (``postgres_cdc_snapshot``) and
the messages (``postgres_cdc_messages``).
"""

from __future__ import annotations

import contextlib
import select
import time
from typing import Any, ClassVar

from conveyor.core.engine.routing import SourceMode
from conveyor.core.errors import ConfigError, PermanentSourceError, TransientSourceError
from conveyor.sources.base import Polled, Source, SourceConfig, SourceMessage, State
from conveyor.sources.postgres_cdc_catalog import SESSION_OPTIONS, CDCCatalog, first_line
from conveyor.sources.postgres_cdc_changes import (
    Change,
    Position,
    Txn,
    format_lsn,
    parse_lsn,
)

# The config and the parts of the source; their public names stay importable from here.
from conveyor.sources.postgres_cdc_config import (  # noqa: F401 - re-exported
    CDC_NOTES,
    DEBEZIUM_ENCODING,
    DEBEZIUM_SETTINGS,
    PostgresCDCConfig,
    default_slot,
)
from conveyor.sources.postgres_cdc_messages import CDCMessages
from conveyor.sources.postgres_cdc_slot import CDCSlot
from conveyor.sources.postgres_cdc_snapshot import CDCSnapshot

__all__ = [
    "SESSION_OPTIONS",
    "PostgresCDCConfig",
    "PostgresCDCSource",
    "default_slot",
    "format_lsn",
    "parse_lsn",
]


class PostgresCDCSource(Source):
    """Streams pgoutput from an owned slot; confirms in commit, never in poll."""

    config_class = PostgresCDCConfig
    mode: ClassVar[SourceMode] = SourceMode.CDC
    # 2: pgoutput positions (final LSN, index), snapshot progress; test_decoding states refused.
    state_version: ClassVar[int] = 2
    config: PostgresCDCConfig

    def __init__(self, config: SourceConfig):
        super().__init__(config)
        self._catalog = CDCCatalog(self.config, on_broken=self.close)
        self._slot = CDCSlot(self.config, self._catalog)
        self._repl: Any = None  # replication connection
        self._cur: Any = None  # its replication cursor, streaming
        self._relations: dict[int, Any] = {}
        self._keys: dict[int, list[str]] = {}  # shared with the messages (never rebound)
        self._messages = CDCMessages(self.config, self._catalog, self._keys)
        self._snapshot = CDCSnapshot(self.config, self._catalog, self._messages)
        self._txn: Txn | None = None
        self._pos = Position()
        self._expected: State | None = None  # the state the open stream continues from
        self._start: tuple[State | None, State] | None = None  # (given, replaced by) at init
        self._last_state_at = 0.0
        self._skip: tuple[int, int] = (-1, -1)  # positions the state covers (skipped as read)
        self._owed = False  # a transaction a returned state ends inside has committed
        self._carry: tuple[list[SourceMessage], Position] | None = None
        self._done: tuple[str, ...] = ()  # re-snapshot requests taken on (in the state)

    @property
    def column_routing(self) -> bool:
        return bool(self.config.destinations)

    def validate(self) -> None:
        if self.config.destinations and self.config.tables:
            unknown = sorted(set(self.config.destinations) - set(self.config.tables))
            if unknown:
                raise ConfigError(f"{unknown} not among the tables", field="destinations")

    # -- init: checks, publication, slot, snapshot ----------------------------------------

    def init(self, state: State | None) -> None:
        level = self._catalog.run("SHOW wal_level")[0][0]
        if level != "logical":
            raise PermanentSourceError(
                f"PostgreSQL has wal_level={level}; CDC needs wal_level=logical"
            )
        self._slot.ensure_publication()
        for table in self._slot.snapshot_tables():
            self._catalog.table(table)  # refuses a table without a key early
        found = self._slot.prepare(state)
        if found is None:
            return
        self._start = (state, self._first_state(created=not found))

    def _first_state(self, *, created: bool) -> State:
        """The state a first start polls from: the snapshot to read, then the stream."""
        want = self.config.snapshot != "never"
        # An existing slot: the stream starts at its confirmed position.
        point = self._slot.create(export=want, use_snapshot=self._snapshot.open) if created else 0
        tables = self._slot.snapshot_tables() if want else []
        snap = {"tables": tables, "after": None, "done": 0} if tables else None
        # The initial snapshot reads every table: the re-snapshots asked so far are done.
        return Position(point, -1, None, snap).state(tuple(self._requests()))

    # -- poll -----------------------------------------------------------------------------

    def poll(self, state: State | None, max_records: int, max_wait_s: float) -> Polled | None:
        self._slot.measure()
        if state is None and self._start is not None:
            # A first start: its plan (the slot just created, the snapshot to read) is stored
            # before any row, so a crash from here on resumes it instead of finding a slot
            # and no state (which a later start must refuse: whose slot would it be?).
            return Polled([], self._start[1])
        if self._start is not None and (state is None or state == self._start[0]):
            state = self._start[1]
        if state is None:
            raise PermanentSourceError("poll before init")
        pos = Position.of(state)
        self._done = tuple(str(d) for d in state.get("resnapshots") or ())
        todo = [r for r in self._requests() if r not in self._done]
        if todo and not pos.snapshot:  # a re-snapshot on request, then the stream goes on
            pos.snapshot = {
                "tables": [r.rpartition("=")[0] for r in todo],
                "after": None,
                "done": 0,
            }
            self._done += tuple(todo)
            self._snapshot.close()  # read in a snapshot of now
        if pos.snapshot:
            polled = self._snapshot.poll(pos, max_records, self._done, self.origin())
            self._expected = None
            return polled
        if self._cur is None or state != self._expected:
            self._restart(pos)
        return self._poll_stream(pos, max_records, max_wait_s)

    def metrics(self) -> dict[str, float]:
        return dict(self._slot.gauges)

    def _requests(self) -> list[str]:
        return [f"{t}={i}" for t, i in sorted(self.config.resnapshot.items())]

    def origin(self) -> str:
        return self.config.slot or "cdc"

    # -- stream ---------------------------------------------------------------------------

    def _restart(self, pos: Position) -> None:
        """(Re)open the stream at the slot; changes the state covers are skipped as read."""
        import psycopg2
        import psycopg2.extras

        self._close_stream()
        self._snapshot.close()  # polled from a stream state: the snapshot's last batch is stored
        repl = self._catalog.connect(
            connection_factory=psycopg2.extras.LogicalReplicationConnection
        )
        cur = repl.cursor()
        deadline = time.monotonic() + 30
        while True:
            try:
                cur.start_replication(
                    slot_name=self.config.slot_name,
                    decode=False,
                    options={
                        "proto_version": "1",
                        "publication_names": self.config.publication_name,
                    },
                )
                break
            except psycopg2.Error as e:
                # The previous stream's walsender may still hold the slot for a moment.
                if "is active for PID" not in str(e) or time.monotonic() > deadline:
                    repl.close()
                    raise TransientSourceError(f"cannot stream slot: {first_line(e)}") from None
                time.sleep(0.2)
        self._repl, self._cur = repl, cur
        self._relations.clear()
        self._keys.clear()
        self._txn = None
        self._pos = Position(pos.lsn, pos.index, pos.safe, None, pos.last_commit)
        self._skip = (pos.lsn, pos.index)
        self._expected, self._owed, self._carry = pos.state(self._done), False, None

    def _poll_stream(self, pos: Position, max_records: int, max_wait_s: float) -> Polled | None:
        deadline = time.monotonic() + max_wait_s
        messages: list[SourceMessage] = []
        while len(messages) < max_records:
            if self._carry is not None:  # the change the last batch had no room for
                carried, self._carry = self._carry, None
                messages.extend(carried[0])
                self._pos = carried[1]
                continue
            msg = self._read()
            if msg is not None:
                before = self._pos
                out = self._consumed(msg)
                if messages and len(messages) + len(out) > max_records:
                    # No room for all of one change's messages (a key change, a tombstone):
                    # the batch ends before it, the next poll starts with it.
                    self._carry, self._pos = (out, self._pos), before
                    break
                messages.extend(out)
                continue
            if self._txn is None and not messages and self._heartbeat_due():
                self._heartbeat()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(InterruptedError, ValueError):
                select.select([self._cur], [], [], min(left, 1.0))
        state = self._pos.state(self._done)
        if not messages and (state == self._expected or not (self._owed or self._heartbeat_due())):
            return None
        self._expected, self._owed = state, False
        self._last_state_at = time.monotonic()
        return Polled(messages, state, origin=self.origin())

    def _consumed(self, msg: Any) -> list[SourceMessage]:
        try:
            return self._consume(msg.payload, msg.data_start)
        except ValueError as e:  # pgoutput's ProtocolError, ValueDecodeError
            raise PermanentSourceError(f"at {format_lsn(msg.data_start)}: {e}") from None

    def _heartbeat(self) -> None:
        """Nothing of ours pending: the position follows the server's WAL end (keepalives)."""
        wal_end = int(self._cur.wal_end)
        if wal_end > (self._pos.safe or 0) and wal_end > self._pos.lsn:
            self._pos = Position(wal_end, -1, wal_end, None, self._pos.last_commit)

    def _inside(self, final_lsn: int) -> bool:
        return self._expected is not None and parse_lsn(self._expected["lsn"]) == final_lsn

    def _heartbeat_due(self) -> bool:
        return time.monotonic() - self._last_state_at >= self.config.heartbeat_interval_s

    def _read(self) -> Any:
        import psycopg2

        try:
            return self._cur.read_message()
        except psycopg2.Error as e:
            self._close_stream()
            raise TransientSourceError(f"replication stream: {first_line(e)}") from None

    def _consume(self, data: bytes, lsn: int) -> list[SourceMessage]:
        """One pgoutput message: the position moves; a change not yet covered becomes messages."""
        from conveyor.sources import pgoutput as pg

        msg = pg.parse_message(data)
        if isinstance(msg, pg.Begin):
            self._txn = Txn(msg.final_lsn, msg.xid, msg.commit_time_us, self._pos.last_commit)
        elif isinstance(msg, pg.Commit):
            if self._txn is not None:
                end = msg.end_lsn
                self._pos = Position(self._txn.final_lsn, self._txn.next_index - 1, end, None, end)
                # A returned state inside this transaction: its confirmation is owed now.
                self._owed = self._owed or self._inside(self._txn.final_lsn)
            self._txn = None
        elif isinstance(msg, pg.Origin):
            if self._txn is not None:
                self._txn.origin = (msg.name, msg.commit_lsn)
        elif isinstance(msg, pg.Relation):
            self._relations[msg.oid] = msg
            self._keys.pop(msg.oid, None)
            self._messages.forget(msg.qualified)  # its columns may have changed
        elif isinstance(msg, pg.Insert | pg.Update | pg.Delete | pg.Truncate):
            txn = self._txn
            if txn is None:
                raise PermanentSourceError("pgoutput: a change outside a transaction")
            index, txn.next_index = txn.next_index, txn.next_index + 1
            self._pos = Position(txn.final_lsn, index, self._pos.safe, None, self._pos.last_commit)
            if (txn.final_lsn, index) <= self._skip:
                return []
            changes = [
                c for c in self._changes(msg, txn, index, lsn) if c.op not in self.config.skipped
            ]
            return [m for c in changes for m in self._messages.of(c)]
        return []

    def _changes(self, msg: Any, txn: Txn, index: int, lsn: int) -> list[Change]:
        from conveyor.sources import pgoutput as pg

        common = {
            "lsn": lsn,
            "final_lsn": txn.final_lsn,
            "index": index,
            "xid": txn.xid,
            "ts_us": txn.ts_us,
            "last_commit": txn.last_commit,
            "origin": txn.origin,
        }
        if isinstance(msg, pg.Truncate):
            return self._truncates(msg, common)
        rel = self._relation(msg.relation_oid)
        if not self._wanted(rel.qualified):
            return []
        before, after, unchanged = self._images(rel, msg)
        op = "c" if isinstance(msg, pg.Insert) else "u" if isinstance(msg, pg.Update) else "d"
        key = self._key(rel, after if after is not None else before, before)
        common.update(columns=rel)
        if op == "u" and before is not None:
            old_key = self._key(rel, before, None)
            if old_key != key:  # as Debezium: a delete under the old key, a create under the new
                return [
                    Change("d", rel.qualified, before, None, old_key, peer_key=key, **common),
                    Change(
                        "c",
                        rel.qualified,
                        None,
                        after,
                        key,
                        unchanged=unchanged,
                        peer_key=old_key,
                        **common,
                    ),
                ]
        return [Change(op, rel.qualified, before, after, key, unchanged=unchanged, **common)]

    def _images(self, rel: Any, msg: Any) -> tuple[Any, Any, tuple[str, ...]]:
        """(before, after, unchanged-TOAST columns) of a row change, decoded."""
        dec = self._catalog.decoder()
        before = after = None
        unchanged: tuple[str, ...] = ()
        if getattr(msg, "new", None) is not None:
            after, unchanged = dec.row(rel, msg.new)
        if getattr(msg, "old", None) is not None:
            before, _ = dec.row(rel, msg.old)
            if msg.old_is_key:  # the other columns are NULL placeholders, not values
                before = {k: before.get(k) for k in rel.key_columns}
            elif unchanged and after is not None:  # FULL: the before image has them
                after = {
                    c.name: after[c.name] if c.name in after else before.get(c.name)
                    for c in rel.columns
                    if c.name in after or c.name in before
                }
                unchanged = tuple(c for c in unchanged if c not in before)
        return before, after, unchanged

    def _truncates(self, msg: Any, common: dict[str, Any]) -> list[Change]:
        """One change per captured table truncated (no key: a table has no row key)."""
        extra = {"cascade": msg.cascade, "restart_identity": msg.restart_identity}
        tables = [self._relation(oid) for oid in msg.relation_oids]
        return [
            Change("t", r.qualified, None, None, None, extra=extra, columns=r, **common)
            for r in tables
            if self._wanted(r.qualified)
        ]

    def _relation(self, oid: int) -> Any:
        rel = self._relations.get(oid)
        if rel is None:
            raise PermanentSourceError(f"pgoutput: a change of relation {oid} before its Relation")
        return rel

    def _wanted(self, table: str) -> bool:
        return not self.config.tables or table in self.config.tables

    def _key(self, rel: Any, row: dict[str, Any] | None, old: dict[str, Any] | None) -> Any:
        cols = self._keys.get(rel.oid)
        if cols is None:
            cols = self._catalog.table(rel.qualified).key or list(rel.key_columns)
            if not cols:
                raise PermanentSourceError(f"table {rel.qualified}: no key columns")
            self._keys[rel.oid] = cols
        row = row or {}
        old = old or {}
        return {c: row[c] if c in row else old.get(c) for c in cols}

    # -- commit, release, close -----------------------------------------------------------

    def commit(self, state: State) -> None:
        """Confirm the end of the last transaction the state covers completely (idempotent)."""
        pos = Position.of(state)
        if pos.safe is None:
            return
        if self._cur is not None:
            import psycopg2

            try:
                self._cur.send_feedback(flush_lsn=pos.safe, force=True)
                return
            except psycopg2.Error as e:
                self._close_stream()
                raise TransientSourceError(f"feedback: {first_line(e)}") from None
        self._slot.advance(pos.safe)

    def release(self) -> None:
        """Drop the slot and the managed publication (the connector is deleted)."""
        self._close_stream()
        self._snapshot.close()
        self._slot.release()

    def _close_stream(self) -> None:
        repl, self._repl, self._cur = self._repl, None, None
        self._expected = None
        if repl is not None:
            with contextlib.suppress(Exception):
                repl.close()

    def close(self) -> None:
        self._close_stream()
        self._snapshot.close()
        self._catalog.close()
