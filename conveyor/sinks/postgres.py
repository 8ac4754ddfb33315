"""PostgreSQL sink (psycopg2): COPY or upsert, one transaction per batch.

Identifiers are always quoted with ``psycopg2.sql.Identifier``. A batch is one
transaction, committed before ``send_batch`` returns (that is the
acknowledgement). A row the server rejects for its content (SQLSTATE class 22
data exception or 23 integrity violation) is isolated by bisecting the batch
inside savepoints, so the good rows of the batch still go through. With
``delivery: exactly_once`` the same transaction raises the batch's offsets in the
offsets table (``sinks.sql.OffsetsLedger``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import itertools
import json
import logging
from collections.abc import Sequence
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field, SecretStr, model_validator

from conveyor.core.errors import (
    FencedError,
    PermanentSinkError,
    TransientSinkError,
    rule,
)
from conveyor.core.model import TRUNCATE_COL
from conveyor.core.positions import StoredPositions
from conveyor.core.sink import first_failure_only, isolate_rows
from conveyor.sinks.base import (
    RowFailure,
    SendResult,
    Sink,
    iter_records,
    json_default,
    secret,
)
from conveyor.sinks.sql import (
    META_SOURCES,
    AutoEvolve,
    ConnectTimeoutS,
    DeleteEnabled,
    Delivery,
    LedgerSink,
    OffsetsLedger,
    OffsetsTableName,
    SqlColumns,
    SqlDialect,
    SqlSinkConfig,
    TableColumn,
    check_columns,
    column_mapping,
    column_types,
    concat_text,
    evolution,
    json_values,
    ledger_denied,
    offsets_statements,
    percent_escaped,
    text_offsets,
    text_scalar,
)
from conveyor.sinks.tombstones import (
    DeleteKeyError,
    delete_key,
    has_tombstones,
    message_keys,
    tombstone_flags,
)

log = logging.getLogger("conveyor.sinks.postgres")


class PostgresSinkConfig(SqlSinkConfig):
    """Rows into a PostgreSQL table."""

    type: Literal["postgres"] = "postgres"
    url: SecretStr | None = Field(
        default=None,
        description="libpq URL, e.g. postgresql://user:${file:/run/secrets/pg}@127.0.0.1:5432/db (secret; a password in it must be a reference).",
    )
    schema_: str = Field(default="public", alias="schema", description="Target schema.")
    table: str = Field(description="Target table.")
    columns: SqlColumns = None
    upsert_keys: list[str] = Field(
        default_factory=list,
        description="Key columns: INSERT ... ON CONFLICT (keys) DO UPDATE (idempotent replays).",
    )
    create_table: bool = Field(
        default=False,
        description="Create the table from the first batch's schema when it does not exist.",
    )
    auto_evolve: AutoEvolve = False
    delete_enabled: DeleteEnabled = False
    truncate_enabled: bool = Field(
        default=False,
        description="A row whose __truncate column (a boolean the transform's select sets, e.g. "
        "op = 't' AS __truncate for Debezium changes) is true truncates the table at its place in the "
        "batch, in the batch's transaction (Debezium JDBC sink's truncate.enabled); its other columns "
        "are ignored. Off: such a row is a failed row (failure.policy), never written.",
    )
    write_method: Literal["copy", "values"] = Field(
        default="copy",
        description="COPY (fast) or multi-row INSERT; upserts always go through a COPY into a temporary table.",
    )
    connect_timeout_s: ConnectTimeoutS = 10
    statement_timeout_ms: int = Field(
        default=60_000, ge=0, description="Statement timeout (0 = none)."
    )
    delivery: Delivery
    offsets_table: OffsetsTableName = "conveyor_offsets"

    def key_namespace(self) -> str:
        return self.schema_

    def kind(self) -> str:
        return "postgres"

    @model_validator(mode="after")
    def _rules(self) -> PostgresSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        rule(bool(self.url), "is required (a libpq URL, or ${env:NAME})", field="url")
        rule(bool(self.table.strip()), "must not be empty", field="table")
        self.check_mapping()
        return self


# Connection failures no retry can fix; anything else (refused, timeout, too many
# connections, the server starting up or shutting down) is an outage.
_PERMANENT_CONNECT_ERRORS = (
    "password authentication failed",
    "no pg_hba.conf entry",
    "does not exist",  # database or role
    "permission denied for database",
    "is not permitted to log in",
    "invalid dsn",
    "invalid connection option",
)


_INSUFFICIENT_PRIVILEGE = "42501"


def _is_row_error(e: Exception) -> bool:
    """A row's content was refused: a data error from the server, or psycopg2 refusing a
    value before sending it (a NUL character in a string literal)."""
    return _is_data_error(e) or (isinstance(e, ValueError) and "NUL" in str(e))


def _is_data_error(e: Exception) -> bool:
    code = getattr(e, "pgcode", None) or ""
    return code[:2] in ("22", "23")


class PostgresSink(LedgerSink, Sink):
    """Writes each batch in one transaction; bad rows are isolated with savepoints."""

    config_class = PostgresSinkConfig
    config: PostgresSinkConfig

    def __init__(self, config: PostgresSinkConfig):
        super().__init__(config)
        self._conn: Any = None
        self._columns: list[str] | None = None  # target columns, in order
        self._sources: list[str] | None = None  # their source columns / $payload
        self._types: dict[str, str] = {}  # existing columns -> data type
        self._table: dict[str, TableColumn] = {}  # existing columns, described
        self._schema: pa.Schema | None = None  # the schema of the batch last resolved
        self._ledger = OffsetsLedger(
            offsets_statements(pg_name(config.schema_, config.offsets_table), "postgres")
        )

    # -- exactly once -------------------------------------------------------------

    def target_offsets(self) -> StoredPositions | None:
        """The positions the offsets table holds for this writer; None when it holds none (or
        with ``at_least_once``)."""
        if not self._exactly_once():
            return None
        import psycopg2

        conn = self._connect()
        try:
            with conn.cursor() as cur:
                return self._ledger.read(cur) if self._ledger_exists(cur) else None
        except psycopg2.Error as e:
            if getattr(e, "pgcode", None) == _INSUFFICIENT_PRIVILEGE:
                if self.config.delivery == "auto":
                    return None  # not this user's to keep: init_sink goes at least once
                raise ledger_denied(self._ledger.sql.table, e.pgerror or str(e)) from None
            raise TransientSinkError(
                f"PostgreSQL: reading {self._ledger.sql.table}: {e.pgerror or e}"
            ) from None
        finally:
            conn.close()

    def _ledger_exists(self, cur: Any) -> bool:
        cur.execute("SELECT to_regclass(%s)", (self._ledger.sql.table,))
        row = cur.fetchone()
        return bool(row and row[0])

    def _create_ledger(self, cur: Any) -> None:
        """The offsets table, and its schema with ``create_table``, if missing."""
        from psycopg2 import sql

        if self.config.create_table:
            cur.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                    sql.Identifier(self.config.schema_)
                )
            )
        self._ledger.create(cur)

    def _ledger_error(self, e: Exception, what: str) -> Exception | None:
        import psycopg2

        if isinstance(e, psycopg2.OperationalError):
            return TransientSinkError(f"PostgreSQL: {what}: {e}")
        if getattr(e, "pgcode", None) == _INSUFFICIENT_PRIVILEGE:
            return ledger_denied(self._ledger.sql.table, e.pgerror or str(e))
        if isinstance(e, psycopg2.Error):
            return PermanentSinkError(f"PostgreSQL: {what}: {e.pgerror or e}")
        return None

    def _claim(self) -> None:
        """The offsets table (created if missing) and this generation's claim, committed."""
        import psycopg2

        try:
            with self._conn.cursor() as cur:
                self._create_ledger(cur)
                self._ledger.claim(cur)
            self._conn.commit()
        except FencedError:
            self._rollback()
            raise
        except (psycopg2.OperationalError, psycopg2.errors.UniqueViolation) as e:
            # A UniqueViolation: another run created the schema or table at the same moment
            # (IF NOT EXISTS races in PostgreSQL's catalog); the retry finds it there.
            self.cleanup_sink()
            raise TransientSinkError(f"PostgreSQL: claiming the offsets table: {e}") from None
        except psycopg2.Error as e:
            self._rollback()
            if getattr(e, "pgcode", None) == _INSUFFICIENT_PRIVILEGE:
                detail = (e.pgerror or str(e)).strip()
                if self._downgrade(f"this user may not keep {self._ledger.sql.table}: {detail}"):
                    return
                raise ledger_denied(self._ledger.sql.table, detail) from None
            raise PermanentSinkError(
                f"offsets table {self._ledger.sql.table} (delivery exactly_once): {e.pgerror or e}"
            ) from None

    # -- lifecycle ----------------------------------------------------------------

    def _dsn(self) -> str:
        return secret(self.config.url) or ""

    def _connect(self) -> Any:
        import psycopg2

        opts = f"-c statement_timeout={self.config.statement_timeout_ms}"
        try:
            conn = psycopg2.connect(
                self._dsn(),
                connect_timeout=self.config.connect_timeout_s,
                options=opts,
                # "conveyor" unless the URL names the application (?application_name=...).
                fallback_application_name="conveyor",
            )
        except psycopg2.OperationalError as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else "connection failed"
            if any(p in msg for p in _PERMANENT_CONNECT_ERRORS):
                raise PermanentSinkError(f"PostgreSQL refused the connection: {msg}") from None
            raise TransientSinkError(f"PostgreSQL unreachable: {msg}") from None
        conn.autocommit = False
        return conn

    def init_sink(self) -> None:
        import psycopg2

        self._conn = self._connect()
        try:
            self._describe_table()
        except psycopg2.OperationalError as e:
            # The server went away between the connect and the describe (a restart): an
            # outage the loop retries, not a failed run.
            self.cleanup_sink()
            raise TransientSinkError(f"PostgreSQL: reading the table's columns: {e}") from None
        if self._exactly_once():
            self._claim()

    def _describe_table(self) -> None:
        with self._conn.cursor() as cur:
            cur.execute(
                "SELECT column_name, data_type, is_nullable, column_default, is_identity, is_generated, "
                "numeric_precision, numeric_scale, datetime_precision FROM information_schema.columns "
                "WHERE table_schema = %s AND table_name = %s ORDER BY ordinal_position",
                (self.config.schema_, self.config.table),
            )
            rows = cur.fetchall()
        self._conn.rollback()
        self._table = {
            name: TableColumn(
                name,
                str(typ).lower(),
                nullable=nullable == "YES",
                has_default=default is not None or identity == "YES" or generated == "ALWAYS",
                precision=precision if str(typ) == "numeric" else None,
                scale=scale if str(typ) == "numeric" else None,
                fraction_digits=fraction,
            )
            for name, typ, nullable, default, identity, generated, precision, scale, fraction in rows
        }
        self._types = {name: col.data_type for name, col in self._table.items()}

    def _fq(self) -> Any:
        from psycopg2 import sql

        return sql.Identifier(self.config.schema_, self.config.table)

    def _resolve(self, batch: pa.Table) -> None:
        """Pick target and source columns on the first batch (with auto_evolve, again on
        each batch of another schema, adding the columns the table lacks); check them
        against the table."""
        c = self.config
        mapping = column_mapping(c.columns, batch)
        if c.auto_evolve and self._columns is not None:
            self._describe_table()  # another sink may have changed the table since
        if not self._types:
            if not c.create_table:
                raise PermanentSinkError(
                    f'table "{c.schema_}"."{c.table}" does not exist (set create_table: true to create it)'
                )
            self._create_table(batch, mapping)
        if c.auto_evolve:
            added = evolution(self._name(), mapping, batch, POSTGRES, self._table, c.upsert_keys)
            if added:
                self._add_columns(added)
        check_columns(self._name(), mapping, list(self._types))
        self._columns = list(mapping)
        self._sources = [mapping[t] for t in self._columns]
        self._schema = batch.schema

    def _evolves(self, batch: pa.Table) -> bool:
        """With auto_evolve: whether ``batch``'s schema is not the one last resolved."""
        return self.config.auto_evolve and not batch.schema.equals(self._schema)

    def _name(self) -> str:
        """The table's name in messages."""
        return f'"{self.config.schema_}"."{self.config.table}"'

    def _add_columns(self, added: dict[str, str]) -> None:
        """ALTER TABLE ... ADD COLUMN IF NOT EXISTS each of ``added`` (name -> type) as a
        nullable column, then describe the table again. A column another sink added first
        is done, not an error (IF NOT EXISTS, or its duplicate-column error when both
        statements passed the check at once)."""
        import psycopg2
        from psycopg2 import sql

        for _ in range(3):  # a duplicate undoes the whole statement: the others again
            todo = {n: t for n, t in added.items() if n not in self._table}
            if not todo:
                break
            clauses = sql.SQL(", ").join(
                sql.SQL("ADD COLUMN IF NOT EXISTS {} {} NULL").format(sql.Identifier(n), sql.SQL(t))
                for n, t in todo.items()
            )
            try:
                with self._conn.cursor() as cur:
                    cur.execute(sql.SQL("ALTER TABLE {} ").format(self._fq()) + clauses)
                self._conn.commit()
            except (psycopg2.errors.DuplicateColumn, psycopg2.errors.UniqueViolation):
                self._conn.rollback()
            except psycopg2.OperationalError as e:  # lost, or a lock wait over the timeout
                self.cleanup_sink()
                raise TransientSinkError(
                    f"PostgreSQL: adding column(s) to {self._name()}: {e}"
                ) from None
            except psycopg2.Error as e:
                self._rollback()
                raise PermanentSinkError(
                    f"table {self._name()}: cannot add column(s) {', '.join(todo)}: {e.pgerror or e}"
                ) from None
            else:
                log.info("table %s: added column(s) %s", self._name(), ", ".join(todo))
            self._describe_table()
        missing = [n for n in added if n not in self._table]
        if missing:
            raise PermanentSinkError(
                f"table {self._name()}: column(s) {', '.join(missing)} were not added"
            )

    def _create_table(self, batch: pa.Table, mapping: dict[str, str]) -> None:
        from psycopg2 import sql

        defs = [
            sql.SQL("{} {}").format(sql.Identifier(target), sql.SQL(pg))
            for target, pg in column_types(mapping, batch, POSTGRES).items()
        ]
        if self.config.upsert_keys:
            defs.append(
                sql.SQL("PRIMARY KEY ({})").format(
                    sql.SQL(", ").join(map(sql.Identifier, self.config.upsert_keys))
                )
            )
        stmt = sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            self._fq(), sql.SQL(", ").join(defs)
        )
        with self._conn.cursor() as cur:
            cur.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                    sql.Identifier(self.config.schema_)
                )
            )
            cur.execute(stmt)
        self._conn.commit()
        self._describe_table()
        log.info('created table "%s"."%s"', self.config.schema_, self.config.table)

    def cleanup_sink(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                self._conn.close()
            self._conn = None

    # -- writing --------------------------------------------------------------------

    def _copy_lines(self, batch: pa.Table) -> CopyText | None:
        """The batch's COPY text built column by column in Arrow, when the write is a plain
        COPY of columns and message fields (None otherwise: ``_rows`` then goes row by row).

        Integers, booleans, floats, strings, dates and timestamps are cast and escaped by
        Arrow; any other type goes through ``_copy_value`` value by value."""
        assert self._sources is not None
        if self.config.upsert_keys or self.config.write_method != "copy":
            return None
        if any(truncate_flags(batch)):
            return None  # the row path marks them (``_truncates``)
        if "$payload" in self._sources or "$headers" in self._sources:
            return None
        columns: list[pa.Array | pa.ChunkedArray] = []
        for src in self._sources:
            name = META_SOURCES.get(src, src) if src.startswith("$") else src
            if name not in batch.schema.names:
                return None
            column = batch.column(name)
            if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                try:  # Arrow does not check buffers it did not build (Spark's strings)
                    column.validate(full=True)
                except pa.ArrowInvalid:
                    return None  # the row path names the column and the byte (issue 15)
            columns.append(_copy_column(column))
        return CopyText.of(columns)

    def _rows(self, batch: pa.Table) -> list[tuple[Any, ...]]:
        assert self._sources is not None
        out = []
        need_records = "$payload" in self._sources or "$headers" in self._sources
        records = list(iter_records(batch)) if need_records else None
        json_sources = {  # nested values into a JSON column go as JSON text (maps as objects)
            src
            for target, src in zip(self._columns or [], self._sources, strict=True)
            if self._types.get(target) in ("json", "jsonb")
            and src in batch.schema.names
            and pa.types.is_nested(batch.schema.field(src).type)
        }
        cols = {
            name: [
                None if v is None else json.dumps(v, default=json_default)
                for v in json_values(batch.column(name))
            ]
            if name in json_sources
            else batch.column(name).to_pylist()
            for name in set(self._sources)
            if not name.startswith("$")
        }
        meta = {
            src: batch.column(col).to_pylist()
            for src, col in META_SOURCES.items()
            if src in self._sources and col in batch.schema.names and src != "$headers"
        }
        for i in range(batch.num_rows):
            row: list[Any] = []
            for src in self._sources:
                if src == "$payload":
                    assert records is not None
                    row.append(json.dumps(records[i].payload_json(), default=json_default))
                elif src == "$headers":
                    assert records is not None
                    row.append(
                        json.dumps({k: v.decode(errors="replace") for k, v in records[i].headers})
                    )
                elif src.startswith("$"):
                    row.append(meta[src][i])
                else:
                    row.append(cols[src][i])
            out.append(tuple(row))
        return out

    def send_batch(self, batch: pa.Table) -> SendResult:
        import psycopg2

        if batch.num_rows == 0:
            return SendResult(rows=0)
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
            self._describe_table()
        if self._columns is None or self._evolves(batch):
            self._resolve(batch)
        try:
            if self._exactly_once():
                with self._conn.cursor() as cur:
                    failures = self._ledger.send(
                        cur, batch, self._write_batch, fail_fast=self.fail_fast
                    )
            else:
                failures = self._write_batch(batch)
            self._conn.commit()
        except FencedError:
            self._rollback()
            raise
        except psycopg2.errors.ObjectNotInPrerequisiteState as e:
            # 55000 (e.g. ON CONFLICT on a deferrable unique constraint): psycopg2 files it as
            # an OperationalError, but no retry changes the table's definition.
            self._rollback()
            raise PermanentSinkError(
                f"PostgreSQL refused the statement: {e.pgerror or e}"
            ) from None
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
            self.cleanup_sink()
            raise TransientSinkError(
                f"PostgreSQL connection lost: {str(e).strip().splitlines()[0] if str(e).strip() else e}"
            ) from None
        except psycopg2.errors.UndefinedTable as e:
            self._rollback()
            raise PermanentSinkError(
                f'table "{self.config.schema_}"."{self.config.table}" is gone: {e.pgerror or e}'
            ) from None
        except psycopg2.errors.InsufficientPrivilege as e:
            self._rollback()
            raise PermanentSinkError(f"permission denied: {e.pgerror or e}") from None
        except psycopg2.Error as e:
            self._rollback()
            if getattr(e, "pgcode", "") in ("57P01", "57P02", "57P03", "53300"):
                self.cleanup_sink()
                raise TransientSinkError(f"PostgreSQL unavailable: {e.pgerror or e}") from None
            raise
        except BaseException:
            self._rollback()  # nothing of the batch (nor its offsets) stays
            raise
        return SendResult(rows=batch.num_rows, failed=tuple(failures))

    def _write_batch(self, batch: pa.Table) -> list[RowFailure]:
        """Write ``batch`` in the open transaction (not committed); its failed rows."""
        copy = self._copy_lines(batch)
        rows: Any = copy if copy is not None else self._rows(batch)
        failures = self._truncates(batch, rows)
        failures += self._deletes(batch, rows, skip={f.index for f in failures})
        bad = {f.index for f in failures}
        todo = [i for i in range(len(rows)) if i not in bad]
        if self.fail_fast:
            failures, todo = first_failure_only(failures, todo)
        failures += self._write_isolating(rows, todo)
        failures.sort(key=lambda f: f.index)
        return failures[:1] if self.fail_fast else failures

    def _truncates(self, batch: pa.Table, rows: list[Any]) -> list[RowFailure]:
        """With truncate_enabled, rows whose ``__truncate`` is true become ``_TRUNCATE`` (in
        place); without it they are failed rows, never written."""
        failures = []
        for i, flag in enumerate(truncate_flags(batch)):
            if not flag:
                continue
            if self.config.truncate_enabled:
                rows[i] = _TRUNCATE
            else:
                failures.append(
                    RowFailure(i, "a truncate row (__truncate true) and truncate_enabled is off")
                )
        return failures

    def _deletes(self, batch: pa.Table, rows: list[Any], skip: set[int]) -> list[RowFailure]:
        """With delete_enabled, tombstone rows become ``_Delete`` keys (in place), but for
        truncates and the ``skip`` rows; returns the rows whose key cannot be found."""
        if not self.config.delete_enabled or not has_tombstones(batch):
            return []
        assert self._columns is not None
        keys = self.config.upsert_keys
        failures = []
        for i, (tomb, key) in enumerate(
            zip(tombstone_flags(batch), message_keys(batch), strict=True)
        ):
            if tomb and i not in skip and rows[i] is not _TRUNCATE:
                try:
                    rows[i] = _Delete(
                        delete_key(keys, dict(zip(self._columns, rows[i], strict=True)), key)
                    )
                except DeleteKeyError as e:
                    failures.append(RowFailure(i, str(e)))
        return failures

    def _rollback(self) -> None:
        try:
            self._conn.rollback()
        except Exception:  # noqa: BLE001
            self.cleanup_sink()

    def _write_isolating(self, rows: list[tuple[Any, ...]], idx: list[int]) -> list[RowFailure]:
        """Write rows inside a savepoint; on a data error, bisect to the guilty rows."""
        import psycopg2

        def attempt(sub: Sequence[int]) -> list[RowFailure]:
            with self._conn.cursor() as cur:
                cur.execute("SAVEPOINT conveyor_sp")
                try:
                    # The whole batch as Arrow built it; a part of it (bisecting) line by line.
                    whole = isinstance(rows, CopyText) and len(sub) == len(rows)
                    self._write(cur, rows if whole else [rows[i] for i in sub])
                except (psycopg2.Error, ValueError) as e:
                    # psycopg2 refuses a NUL character in a literal with ValueError before
                    # sending anything (COPY sends it and the server answers 22021).
                    if _is_row_error(e):
                        cur.execute("ROLLBACK TO SAVEPOINT conveyor_sp")
                        cur.execute("RELEASE SAVEPOINT conveyor_sp")
                    raise
                cur.execute("RELEASE SAVEPOINT conveyor_sp")
                return []

        def rejection(e: Exception) -> str | None:
            if not _is_row_error(e):
                return None
            return (getattr(e, "pgerror", None) or str(e)).strip().splitlines()[0]

        return isolate_rows(idx, attempt, rejection, fail_fast=self.fail_fast)

    def _delete(self, cur: Any, keys: list[tuple[Any, ...]]) -> None:
        from psycopg2 import sql
        from psycopg2.extras import execute_batch

        head = _formatted(cur, sql.SQL("DELETE FROM {} WHERE ").format(self._fq()))
        where = " AND ".join(
            _formatted(cur, sql.Identifier(k)) + " = %s" for k in self.config.upsert_keys
        )
        execute_batch(cur, head + where, [tuple(k) for k in keys], page_size=500)

    def _write(self, cur: Any, rows: list[tuple[Any, ...]]) -> None:
        from psycopg2 import sql
        from psycopg2.extras import execute_values

        assert self._columns is not None
        cols = sql.SQL(", ").join(map(sql.Identifier, self._columns))
        marked = not isinstance(rows, CopyText)  # Arrow's COPY text holds writes only
        if marked and any(isinstance(r, _Delete) or r is _TRUNCATE for r in rows):
            # In order, run by run: a delete then a write of one key leaves the new row; the
            # rows before a truncate are written first (and removed by it), those after it kept.
            for kind, run in itertools.groupby(rows, key=_row_kind):
                part = list(run)
                if kind == "delete":
                    self._delete(cur, part)
                elif kind == "truncate":
                    cur.execute(sql.SQL("TRUNCATE {}").format(self._fq()))
                else:
                    self._write(cur, part)
            return
        if self.config.upsert_keys:
            keys = sql.SQL(", ").join(map(sql.Identifier, self.config.upsert_keys))
            others = [c for c in self._columns if c not in self.config.upsert_keys]
            action = (
                sql.SQL("DO UPDATE SET ")
                + sql.SQL(", ").join(
                    sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in others
                )
                if others
                else sql.SQL("DO NOTHING")
            )
            # Later rows of a batch win: keep the last occurrence of each key (ON CONFLICT
            # cannot touch one row twice in a statement).
            key_pos = [self._columns.index(k) for k in self.config.upsert_keys]
            last: dict[tuple[Any, ...], tuple[Any, ...]] = {}
            for r in rows:
                last[tuple(r[p] for p in key_pos)] = r
            head = sql.SQL("INSERT INTO {} ({}) VALUES ").format(self._fq(), cols)
            tail = sql.SQL(" ON CONFLICT ({}) ").format(keys) + action
            stmt = _formatted(cur, head) + "%s" + _formatted(cur, tail)
            execute_values(cur, stmt, list(last.values()), page_size=len(last) or 1)
        elif self.config.write_method == "values":
            head = sql.SQL("INSERT INTO {} ({}) VALUES ").format(self._fq(), cols)
            execute_values(cur, _formatted(cur, head) + "%s", rows, page_size=len(rows))
        else:
            if isinstance(rows, CopyText):
                data: io.IOBase = rows.reader()
            else:
                data = io.StringIO()
                for r in rows:
                    data.write(r if isinstance(r, str) else "\t".join(_copy_value(v) for v in r))
                    data.write("\n")
                data.seek(0)
            stmt = sql.SQL("COPY {} ({}) FROM STDIN").format(self._fq(), cols)
            cur.copy_expert(stmt.as_string(cur), data)


class _Delete(tuple):  # type: ignore[type-arg]
    """A tombstone's key values (upsert_keys order): a DELETE, not a write."""


class _Truncate:
    """A truncate row: a TRUNCATE of the table, not a write."""


_TRUNCATE = _Truncate()


def _row_kind(row: Any) -> str:
    """How ``_write`` applies a row: a delete, a truncate or a write."""
    if row is _TRUNCATE:
        return "truncate"
    return "delete" if isinstance(row, _Delete) else "write"


def truncate_flags(batch: pa.Table) -> list[bool]:
    """Per row: is it a truncate (``__truncate`` true; all False without the column).

    PermanentSinkError when the column is not boolean: a string "false" must not truncate."""
    if TRUNCATE_COL not in batch.schema.names:
        return [False] * batch.num_rows
    column = batch.column(TRUNCATE_COL)
    if not (pa.types.is_boolean(column.type) or pa.types.is_null(column.type)):
        raise PermanentSinkError(
            f"{TRUNCATE_COL} must be a boolean column (the transform's select), not {column.type}"
        )
    return [v is True for v in column.to_pylist()]


_UTC_ZONES = frozenset({"UTC", "Etc/UTC", "+00:00", "Z", "GMT", "Etc/GMT", "UCT", "Etc/UCT"})
_COPY_ESCAPES = (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r"))


def _copy_column(column: pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """A column's values in COPY's text format (``\\N`` for null), like ``_copy_value``,
    as Arrow large strings."""
    import pyarrow.compute as pc

    t = column.type
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        text = pc.cast(column, pa.large_string())
    elif pa.types.is_boolean(t):
        text = pc.if_else(column, "t", "f")
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        text = column
        for old, new in _COPY_ESCAPES:
            text = pc.replace_substring(text, old, new)
    elif pa.types.is_date(t):
        text = pc.cast(column, pa.string())
    elif pa.types.is_timestamp(t) and (t.tz is None or t.tz in _UTC_ZONES):
        # ISO 8601 (with the offset when the column has a zone): the instant and the wall
        # time ``isoformat()`` gave. Arrow holds UTC: without the zone, the cast is cheap.
        text = pc.cast(column.cast(pa.timestamp(t.unit)), pa.string())
        if t.tz is not None:
            utc = pa.scalar("+00:00", pa.string())
            text = pc.binary_join_element_wise(text, utc, pa.scalar("", pa.string()))
    elif pa.types.is_timestamp(t):
        # Another zone: the wall time there, with its offset, as ``isoformat()`` wrote it.
        try:
            text = pc.strftime(column, format="%Y-%m-%dT%H:%M:%S%z")
        except pa.ArrowException:  # a zone Arrow cannot find here: Python's conversion
            return pa.array([_copy_value(v) for v in column.to_pylist()], pa.large_string())
    elif pa.types.is_nested(t):  # JSON, maps as objects
        return pa.array([_copy_value(v) for v in json_values(column)], pa.large_string())
    else:
        return pa.array([_copy_value(v) for v in column.to_pylist()], pa.large_string())
    return pc.cast(pc.fill_null(text, "\\N"), pa.large_string())


class CopyText(Sequence[str]):
    """A batch's rows in COPY's text format, built by Arrow without a Python object per
    row: the whole batch is one buffer for ``copy_expert``; a row (``text[i]``, when
    bisecting to the rows the server refused) is a line without its newline."""

    def __init__(self, lines: pa.Array):
        self._lines = lines  # large strings, no nulls, each ending in a newline
        self._rows: list[str] | None = None

    @classmethod
    def of(cls, columns: list[pa.Array | pa.ChunkedArray]) -> CopyText:
        """The lines of ``columns`` (COPY text, no nulls), tab-separated, in row order."""
        import pyarrow.compute as pc

        lines = pc.binary_join_element_wise(*columns, text_scalar("\t"))
        lines = concat_text(lines, text_scalar("\n"))
        if isinstance(lines, pa.ChunkedArray):
            lines = lines.combine_chunks()
        return cls(lines)

    def __len__(self) -> int:
        return len(self._lines)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if self._rows is None:
            self._rows = [line[:-1] for line in self._lines.to_pylist()]
        return self._rows[i]

    def reader(self) -> io.BytesIO:
        """All lines, as one UTF-8 buffer."""
        if not len(self._lines):
            return io.BytesIO(b"")
        offsets, data = text_offsets(self._lines)
        return io.BytesIO(data[offsets[0] : offsets[-1]])


def _copy_value(v: Any) -> str:
    """A value in COPY's text format."""
    if v is None:
        return "\\N"
    if isinstance(v, bool):
        return "t" if v else "f"
    if isinstance(v, bytes):
        return "\\\\x" + v.hex()
    if isinstance(v, (dict, list)):
        v = json.dumps(v, default=json_default)
    elif isinstance(v, dt.datetime):
        v = v.isoformat()
    s = str(v)
    return s.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _pg_type(t: pa.DataType) -> str:
    """The PostgreSQL column type for an Arrow type (create_table and auto_evolve)."""
    if pa.types.is_dictionary(t):
        return _pg_type(t.value_type)
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_int8(t) or pa.types.is_int16(t):
        return "smallint"
    if pa.types.is_int32(t):
        return "integer"
    if pa.types.is_uint64(t):
        return "numeric(20,0)"  # above bigint's range
    if pa.types.is_integer(t):
        return "bigint"
    if pa.types.is_float32(t):
        return "real"
    if pa.types.is_floating(t):
        return "double precision"
    if pa.types.is_decimal(t):
        return f"numeric({t.precision},{t.scale})"
    if pa.types.is_timestamp(t):
        return "timestamptz" if t.tz else "timestamp"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_time(t):
        return "time"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "bytea"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    return "jsonb"


def _formatted(cur: Any, part: Any) -> str:
    """A ``psycopg2.sql`` part (identifiers, keywords; no placeholder) as text for a statement
    psycopg2 %-formats (``execute_values``, ``execute_batch``): its ``%`` doubled."""
    return percent_escaped(part.as_string(cur))


def pg_name(schema: str, table: str) -> str:
    """``"schema"."table"``, quoted as ``psycopg2.sql.Identifier`` quotes it (without a connection)."""
    return ".".join('"' + part.replace('"', '""') + '"' for part in (schema, table))


POSTGRES = SqlDialect("postgres", lambda t, key: _pg_type(t), "jsonb", frozenset({"$payload"}))
