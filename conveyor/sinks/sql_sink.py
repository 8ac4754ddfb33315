"""The SQL sink (as meltano's ``SQLSink`` over its ``SQLConnector``): what a batch's way into a
SQL table is, whatever the database. ``SqlSink`` owns ``send_batch`` (one transaction per
batch, committed before it returns), the columns it resolves against the table (with
``auto_evolve``, again on each batch of another schema), tombstones that become deletes, the
savepoint around each statement that isolates a row the server refuses for its content, and
``delivery: exactly_once``: the offsets ledger (``sinks.sql.OffsetsLedger``), its claim on
start, and the operator's moves and retirements of its rows.

Each database is a dialect, a subclass (``sinks.postgres``, ``sinks.mysql``) supplying what
differs: the connection, the classification of its client's exceptions (a ``classify_*``
function, as ``core/sink.py`` asks), the table's description, DDL and column types, and the
write path (PostgreSQL's COPY, MySQL's multi-row INSERT statements).
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

import pyarrow as pa

from conveyor.core.errors import FencedError, PermanentSinkError, TransientSinkError
from conveyor.core.model import Offsets, TopicPartition
from conveyor.core.positions import StoredPositions, TargetBinding
from conveyor.core.sink import ErrorKind, first_failure_only, isolate_rows, sink_error
from conveyor.sinks.base import RowFailure, SendResult, Sink
from conveyor.sinks.sql import (
    LedgerDeniedError,
    OffsetsLedger,
    OffsetsStatements,
    SqlDialect,
    TableColumn,
    check_columns,
    column_mapping,
    evolution,
    ledger_denied,
)
from conveyor.sinks.tombstones import (
    DeleteKeyError,
    delete_key,
    has_tombstones,
    message_keys,
    tombstone_flags,
)

#: A row's values in target column order (``None``: failed before it was sent).
Row = Any
#: Writes the rows of the given indexes in the open transaction, raising on a refusal.
RowWriter = Callable[[Any, Sequence[int]], None]


class Delete(tuple):  # type: ignore[type-arg]
    """A tombstone's key values (upsert_keys order): a DELETE, not a write."""


class Truncate:
    """A truncate row: a TRUNCATE of the table, not a write."""


TRUNCATE = Truncate()


def row_kind(row: Any) -> str:
    """How a row is applied: a delete, a truncate or a write."""
    if row is TRUNCATE:
        return "truncate"
    return "delete" if isinstance(row, Delete) else "write"


class LedgerSink(Sink):
    """A SQL sink's connection and its ``delivery: exactly_once``: the offsets ledger bound to a
    run, its claim on start, the operator's moves and retirements of its rows. What each
    database supplies for it is declared here (abstract): its connection, what its client's
    exceptions mean, and its offsets table's statements."""

    label: ClassVar[str]  # the database in messages: "PostgreSQL", "MySQL"

    def __init__(self, config: Any):
        super().__init__(config)
        self._conn: Any = None
        self._downgraded: str | None = None  # why delivery auto writes at least once
        self._ledger = OffsetsLedger(self._offsets_statements())

    # -- what a database supplies ---------------------------------------------------------------

    @abc.abstractmethod
    def _offsets_statements(self) -> OffsetsStatements:
        """The offsets table's statements in this database's SQL."""

    @abc.abstractmethod
    def _connect(self) -> Any:
        """A new connection, not autocommitting; a sink error when it cannot be made."""

    @abc.abstractmethod
    def _classify(self, e: BaseException) -> ErrorKind | None:
        """What a client exception means (its ``classify_*`` function); None: not the client's."""

    @abc.abstractmethod
    def _error_text(self, e: BaseException) -> str:
        """A client exception's message, one line."""

    @abc.abstractmethod
    def _denied(self, e: BaseException) -> bool:
        """Whether the exception is the user's lack of a privilege."""

    @abc.abstractmethod
    def _ledger_exists(self, cur: Any) -> bool:
        """Whether the offsets table exists (on an open cursor)."""

    def _error(self, e: BaseException, context: str) -> Exception:
        """The sink error for a client exception that is not one row's."""
        kind = self._classify(e) or ErrorKind.PERMANENT
        return sink_error(kind, f"{self.label} {context}: {self._error_text(e)}")

    def _create_ledger(self, cur: Any) -> None:
        """The offsets table (and what holds it), if missing."""
        self._ledger.create(cur)

    # -- the connection -------------------------------------------------------------------------

    def cleanup_sink(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                self._conn.close()
            self._conn = None

    def _rollback(self) -> None:
        try:
            if self._conn is not None:
                self._conn.rollback()
        except Exception:  # noqa: BLE001 - the connection is dropped instead
            self.cleanup_sink()

    # -- exactly once ---------------------------------------------------------------------------

    def _exactly_once(self) -> bool:
        """Whether batches go with their offsets: ``exactly_once`` (or ``auto`` where the target
        allows it) and bound to a run (a dead-letter replay, unbound, writes at least once)."""
        return bool(
            self.config.delivery != "at_least_once"
            and self._ledger.bound
            and self._downgraded is None
        )

    def _downgrade(self, reason: str) -> bool:
        """With ``delivery: auto``: at least once from now on in this run, for ``reason``, said
        in the log and the sink's ``delivery_in_effect``; False with ``exactly_once``."""
        if self.config.delivery != "auto":
            return False
        self._downgraded = reason
        logging.getLogger("conveyor.sinks.sql").warning(
            "delivery auto: at least once into %s: %s (set delivery: exactly_once to make this an "
            "error, or at_least_once to say so)",
            self.describe(),
            reason,
        )
        return True

    def delivery_in_effect(self) -> str:
        """The delivery this run writes with (the sink asset's ``delivery`` metadata)."""
        if self._exactly_once():
            return "exactly_once"
        if self._downgraded is not None:
            return f"at_least_once (delivery auto: {self._downgraded})"
        return "at_least_once"

    def bind(self, binding: TargetBinding) -> None:
        """The writer id, generation and scope this sink commits offsets for (before
        ``init_sink``)."""
        self._ledger.bind(binding)

    def _ledger_error(self, e: BaseException, what: str) -> Exception | None:
        """The sink error for a client exception while doing ``what`` with the offsets table
        (None: not the client's)."""
        if self._classify(e) is None:
            return None
        if self._denied(e):
            return ledger_denied(self._ledger.sql.table, self._error_text(e))
        return self._error(e, what)

    def target_offsets(self) -> StoredPositions | None:
        """The positions the offsets table holds for this writer; None when it holds none (or
        with ``at_least_once``)."""
        if not self._exactly_once():
            return None
        conn = self._connect()
        try:
            with conn.cursor() as cur:
                return self._ledger.read(cur) if self._ledger_exists(cur) else None
        except Exception as e:
            if self._classify(e) is not None and self._denied(e) and self.config.delivery == "auto":
                return None  # not this user's to keep: init_sink goes at least once
            err = self._ledger_error(e, f"reading {self._ledger.sql.table}")
            if err is None:
                raise
            raise err from None
        finally:
            conn.close()

    def _claim(self) -> None:
        """The offsets table (created if missing) and this generation's claim, committed."""
        try:
            with self._conn.cursor() as cur:
                self._create_ledger(cur)
                self._ledger.claim(cur)
            self._conn.commit()
        except FencedError:
            self._rollback()
            raise
        except Exception as e:
            err = self._ledger_error(e, f"claiming the offsets table {self._ledger.sql.table}")
            self._rollback()
            if err is None:
                raise
            if isinstance(err, LedgerDeniedError):
                why = f"this user may not keep {self._ledger.sql.table}: {self._error_text(e)}"
                if self._downgrade(why):
                    return
            self.cleanup_sink()
            raise err from None

    def retire_target_offsets(self, connector: str) -> str | None:
        """A deleted connector's rows, every writer's, in one transaction (``OffsetsLedger.retire``);
        what could not be removed, or None."""
        if self.config.delivery == "at_least_once":
            return None
        conn = None
        try:
            conn = self._connect()
            with conn.cursor() as cur:
                if self._ledger_exists(cur):
                    self._ledger.retire(cur, connector)
            conn.commit()
            return None
        except Exception as e:  # noqa: BLE001 - reported to the operator, never raised
            mapped = self._ledger_error(e, f"removing its rows from {self._ledger.sql.table}")
            return str(mapped or e)
        finally:
            if conn is not None:
                conn.close()

    def move_target_offsets(
        self,
        connector: str,
        generations: Mapping[str, int],
        offsets: Offsets,
        *,
        forget: Collection[TopicPartition] = (),
        replace: bool = False,
    ) -> None:
        """An operator's offsets change in the offsets table, in one transaction of its own
        (``OffsetsLedger.move``; the table created if missing)."""
        conn = self._connect()
        try:
            with conn.cursor() as cur:
                self._create_ledger(cur)
                self._ledger.move(
                    cur, connector, generations, offsets, forget=forget, replace=replace
                )
            conn.commit()
        except FencedError:
            conn.rollback()
            raise
        except Exception as e:
            mapped = self._ledger_error(e, f"moving the offsets in {self._ledger.sql.table}")
            if mapped is None:
                raise
            if isinstance(mapped, LedgerDeniedError) and self.config.delivery == "auto":
                return  # no offsets table this user may keep: the target holds no offsets
            raise mapped from None
        finally:
            conn.close()


class SqlSink(LedgerSink):
    """Writes each batch in one transaction; bad rows are isolated by savepoint bisection.

    A dialect sets ``dialect`` and ``label`` and implements the abstract methods; ``_classify``
    maps its client's exceptions (None: not the client's, raised as they are)."""

    dialect: ClassVar[SqlDialect]
    release_savepoints: ClassVar[bool] = True  # MySQL moves its one savepoint instead
    # A row's content error outside the savepoints (a deferred constraint at COMMIT): raised
    # as the client raised it (PostgreSQL), or as the dialect's ``_error`` makes it (MySQL).
    wrap_unisolated: ClassVar[bool] = False

    def __init__(self, config: Any):
        super().__init__(config)
        self._columns: list[str] | None = None  # target columns, in order
        self._sources: list[str] | None = None  # their source columns / $payload
        self._types: dict[str, str] = {}  # existing columns -> data type
        self._table: dict[str, TableColumn] = {}  # existing columns, described
        self._schema: pa.Schema | None = None  # the schema of the batch last resolved
        self._transactional = True  # statements behind savepoints, many rows each

    # -- what a dialect supplies ----------------------------------------------------------------

    @abc.abstractmethod
    def _connection_lost(self) -> bool:
        """Whether ``self._conn`` is missing or closed."""

    @abc.abstractmethod
    def _describe_table(self) -> None:
        """Read the table's columns into ``_table`` and ``_types`` (and the dialect's facts)."""

    @abc.abstractmethod
    def _name(self) -> str:
        """The table's quoted name, in messages."""

    @abc.abstractmethod
    def _create_table(self, batch: pa.Table, mapping: dict[str, str]) -> None:
        """CREATE the table from the first batch's columns (create_table), then describe it."""

    @abc.abstractmethod
    def _add_columns(self, added: dict[str, str]) -> None:
        """ADD the columns auto_evolve found missing (name -> type), then describe the table."""

    @abc.abstractmethod
    def _rows(self, batch: pa.Table) -> tuple[Sequence[Row], list[RowFailure]]:
        """The batch's rows to write (a row that fails before sending is None or a failure)."""

    @abc.abstractmethod
    def _writer(self, batch: pa.Table, rows: Sequence[Row]) -> RowWriter:
        """How the rows of ``batch`` go out: (cursor, indexes) -> None."""

    @abc.abstractmethod
    def _insert_rows(self, cur: Any, rows: list[Row]) -> None:
        """Write rows (value tuples) in the open transaction."""

    @abc.abstractmethod
    def _delete_rows(self, cur: Any, keys: list[Delete]) -> None:
        """DELETE the rows with these upsert_keys values."""

    def _truncate_table(self, cur: Any) -> None:
        """TRUNCATE the table (a dialect that writes truncate rows)."""
        raise NotImplementedError

    def _check_table(self) -> None:
        """What ``init_sink`` checks of the table once described (the dialect's rules)."""

    def _check_mapping(self, mapping: dict[str, str]) -> None:
        """What the dialect checks of a mapping taken from the batch (columns unset)."""

    def _resolved(self) -> None:
        """The columns are (re)resolved: the dialect prepares its statements."""

    def _table_exists(self) -> bool:
        return bool(self._table)

    def _prepare_cursor(self, cur: Any) -> None:
        """Set what the batch's statements need on the cursor."""

    def _typed_key(self, column: str, value: Any) -> Any:
        """A delete's key value from a message key, as the column wants it."""
        return value

    # -- lifecycle ------------------------------------------------------------------------------

    def init_sink(self) -> None:
        self._conn = self._connect()
        try:
            self._describe_table()
        except Exception as e:
            if self._classify(e) is None:
                raise
            # The server may have gone away between the connect and the describe (a
            # restart): an outage the loop retries, not a failed run.
            self.cleanup_sink()
            raise self._error(e, "reading the table's columns") from None
        self._check_table()
        if self._exactly_once():
            self._claim()

    # -- columns --------------------------------------------------------------------------------

    def _resolve(self, batch: pa.Table) -> None:
        """Pick target and source columns on the first batch (with auto_evolve, again on
        each batch of another schema, adding the columns the table lacks); check them
        against the table."""
        c = self.config
        mapping = column_mapping(c.columns, batch)
        if c.columns is None:
            self._check_mapping(mapping)
        if c.auto_evolve and self._columns is not None:
            self._describe_table()  # another sink may have changed the table since
        if not self._table_exists():
            if not c.create_table:
                raise PermanentSinkError(
                    f"table {self._name()} does not exist (set create_table: true to create it)"
                )
            self._create_table(batch, mapping)
        if c.auto_evolve:
            added = evolution(
                self._name(), mapping, batch, self.dialect, self._table, c.upsert_keys
            )
            if added:
                self._add_columns(added)
        check_columns(self._name(), mapping, list(self._types))
        self._columns = list(mapping)
        self._sources = [mapping[t] for t in self._columns]
        self._resolved()
        self._schema = batch.schema

    def _evolves(self, batch: pa.Table) -> bool:
        """With auto_evolve: whether ``batch``'s schema is not the one last resolved."""
        return self.config.auto_evolve and not batch.schema.equals(self._schema)

    # -- writing --------------------------------------------------------------------------------

    def send_batch(self, batch: pa.Table) -> SendResult:
        if batch.num_rows == 0:
            return SendResult(rows=0)
        try:
            if self._connection_lost():
                self.cleanup_sink()
                self._conn = self._connect()
                self._describe_table()
            if self._columns is None or self._evolves(batch):
                self._resolve(batch)
            with self._conn.cursor() as cur:
                self._prepare_cursor(cur)
                if self._exactly_once():
                    failures = self._ledger.send(
                        cur,
                        batch,
                        lambda part: self._write_batch(cur, part),
                        fail_fast=self.fail_fast,
                    )
                else:
                    failures = self._write_batch(cur, batch)
            self._conn.commit()
        except FencedError:
            self._rollback()
            raise
        except Exception as e:
            kind = self._classify(e)
            self._rollback()  # nothing of the batch (nor its offsets) stays
            if kind is None or (kind is ErrorKind.DATA and not self.wrap_unisolated):
                raise
            what = (
                "write failed"
                if kind is not ErrorKind.DATA
                else "write failed on a row the sink could not isolate"
            )
            err = self._error(e, what)
            if isinstance(err, TransientSinkError):
                self.cleanup_sink()
            raise err from None
        except BaseException:
            self._rollback()
            raise
        return SendResult(
            rows=batch.num_rows, failed=tuple(sorted(failures, key=lambda f: f.index))
        )

    def _write_batch(self, cur: Any, batch: pa.Table) -> list[RowFailure]:
        """Write ``batch`` in the open transaction (not committed); its failed rows."""
        rows, failures = self._rows(batch)
        failures += self._deletes(batch, rows, skip={f.index for f in failures})
        bad = {f.index for f in failures}
        todo = [i for i in range(len(rows)) if i not in bad and rows[i] is not None]
        if self.fail_fast:
            failures, todo = first_failure_only(failures, todo)
        write = self._writer(batch, rows)
        refused: list[RowFailure] = []
        for part in self._statements(todo):
            if refused and self.fail_fast:
                break  # nothing after the first refused row is written
            refused += self._write_isolating(cur, part, write)
        failures += refused
        failures.sort(key=lambda f: f.index)
        return failures[:1] if self.fail_fast else failures

    def _statements(self, todo: list[int]) -> list[list[int]]:
        """The rows, in the parts each written behind one savepoint (default: all at once)."""
        return [todo]

    def _deletes(self, batch: pa.Table, rows: Sequence[Row], skip: set[int]) -> list[RowFailure]:
        """With delete_enabled, tombstone rows become ``Delete`` keys (in place), but for
        truncates, failed and ``skip`` rows; the rows whose key cannot be found fail."""
        if not self.config.delete_enabled or not has_tombstones(batch):
            return []
        assert self._columns is not None
        keys = self.config.upsert_keys
        failures = []
        flags = zip(tombstone_flags(batch), message_keys(batch), strict=True)
        for i, (tomb, key) in enumerate(flags):
            row = rows[i]
            if not tomb or i in skip or not isinstance(row, tuple):
                continue
            try:
                found = delete_key(keys, dict(zip(self._columns, row, strict=True)), key)
                rows[i] = Delete(  # type: ignore[index]
                    self._typed_key(k, v) for k, v in zip(keys, found, strict=True)
                )
            except DeleteKeyError as e:
                failures.append(RowFailure(i, str(e)))
        return failures

    def _execute(self, cur: Any, rows: list[Row]) -> None:
        """The rows' statements in order, run by run: a delete then a write of one key leaves
        the new row; the rows before a truncate are written first (and removed by it)."""
        for kind, run in itertools.groupby(rows, key=row_kind):
            part = list(run)
            if kind == "delete":
                self._delete_rows(cur, part)
            elif kind == "truncate":
                self._truncate_table(cur)
            else:
                self._insert_rows(cur, part)

    def _write_isolating(self, cur: Any, idx: list[int], write: RowWriter) -> list[RowFailure]:
        """Write rows behind a savepoint; on a row's refusal roll back to it and bisect."""
        savepoint = self._transactional

        def attempt(sub: Sequence[int]) -> list[RowFailure]:
            # One savepoint name: it always marks the start of the current attempt, after
            # every row already written in this transaction.
            if savepoint:
                cur.execute("SAVEPOINT conveyor_sp")
            try:
                write(cur, sub)
            except Exception as e:
                if savepoint and self._rejection(e) is not None:
                    cur.execute("ROLLBACK TO SAVEPOINT conveyor_sp")
                    if self.release_savepoints:
                        cur.execute("RELEASE SAVEPOINT conveyor_sp")
                raise
            if savepoint and self.release_savepoints:
                cur.execute("RELEASE SAVEPOINT conveyor_sp")
            return []

        return isolate_rows(idx, attempt, self._rejection, fail_fast=self.fail_fast)

    def _rejection(self, e: Exception) -> str | None:
        """The message of a refusal of a row's content, or None."""
        if self._classify(e) is not ErrorKind.DATA:
            return None
        return self._error_text(e)
