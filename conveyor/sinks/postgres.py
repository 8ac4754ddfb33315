"""PostgreSQL sink (psycopg2): COPY or upsert, one transaction per batch (the dialect of
``sinks.sql_sink.SqlSink``).

Identifiers are always quoted with ``psycopg2.sql.Identifier``. A row the server rejects for
its content (SQLSTATE class 22 data exception or 23 integrity violation) is isolated by the
base's savepoint bisection. The COPY text is built by Arrow (``sinks.postgres_copy``). File
parameters of the connection string (``sslrootcert``, ``sslkey``, ``passfile``...) follow
the one path rule (``core.trust.paths``), as every file a spec names.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import pyarrow as pa

from conveyor.core.errors import PermanentSinkError, TransientSinkError
from conveyor.core.sink import ErrorKind, sink_error
from conveyor.sinks.base import RowFailure, secret
from conveyor.sinks.postgres_config import PostgresSinkConfig, libpq_files
from conveyor.sinks.postgres_copy import CopyText, truncate_flags, value_rows
from conveyor.sinks.postgres_copy import copy_column as _copy_column
from conveyor.sinks.postgres_copy import copy_value as _copy_value
from conveyor.sinks.postgres_sql import (
    INSUFFICIENT_PRIVILEGE,
    POSTGRES,
    UNDEFINED_TABLE,
    classify_postgres_error,
    formatted,
    pg_name,
    table_columns,
)
from conveyor.sinks.sql import (
    META_SOURCES,
    OffsetsStatements,
    column_types,
    offsets_statements,
)
from conveyor.sinks.sql_sink import TRUNCATE, Delete, Row, RowWriter, SqlSink

__all__ = [
    "CopyText",
    "PostgresSink",
    "PostgresSinkConfig",
    "_copy_column",
    "_copy_value",
    "classify_postgres_error",
]

log = logging.getLogger("conveyor.sinks.postgres")


class PostgresSink(SqlSink):
    """The PostgreSQL dialect: psycopg2, COPY (or INSERT ... ON CONFLICT), SQLSTATEs."""

    config_class = PostgresSinkConfig
    config: PostgresSinkConfig
    label: ClassVar[str] = "PostgreSQL"
    dialect = POSTGRES

    def _offsets_statements(self) -> OffsetsStatements:
        return offsets_statements(
            pg_name(self.config.schema_, self.config.offsets_table), "postgres"
        )

    # -- the connection and its errors --------------------------------------------------------

    def validate(self) -> None:
        """The connection string's file parameters, once its reference (if any) is resolved."""
        libpq_files(self._dsn(), read_service=False)

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
                **libpq_files(self._dsn()),  # the real paths, checked at the time of use
            )
        except psycopg2.OperationalError as e:
            msg = self._error_text(e) if str(e).strip() else "connection failed"
            if classify_postgres_error(e, connecting=True) is ErrorKind.PERMANENT:
                raise PermanentSinkError(f"PostgreSQL refused the connection: {msg}") from None
            raise TransientSinkError(f"PostgreSQL unreachable: {msg}") from None
        conn.autocommit = False
        return conn

    def _connection_lost(self) -> bool:
        return self._conn is None or bool(self._conn.closed)

    def _classify(self, e: BaseException) -> ErrorKind | None:
        return classify_postgres_error(e)

    def _error_text(self, e: BaseException) -> str:
        text = (getattr(e, "pgerror", None) or str(e)).strip()
        return text.splitlines()[0] if text else type(e).__name__

    def _denied(self, e: BaseException) -> bool:
        return getattr(e, "pgcode", None) == INSUFFICIENT_PRIVILEGE

    def _error(self, e: BaseException, context: str) -> Exception:
        if getattr(e, "pgcode", None) == UNDEFINED_TABLE:
            return PermanentSinkError(f"table {self._name()} is gone: {self._error_text(e)}")
        kind = classify_postgres_error(e) or ErrorKind.PERMANENT
        return sink_error(kind, f"PostgreSQL {context}: {self._error_text(e)}")

    def _ledger_error(self, e: BaseException, what: str) -> Exception | None:
        import psycopg2

        if isinstance(e, psycopg2.errors.UniqueViolation):
            # Another run created the schema or table at the same moment (IF NOT EXISTS
            # races in PostgreSQL's catalog); the retry finds it there.
            return TransientSinkError(f"PostgreSQL {what}: {self._error_text(e)}")
        return super()._ledger_error(e, what)

    # -- the offsets table --------------------------------------------------------------------

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

    # -- the table ----------------------------------------------------------------------------

    def _describe_table(self) -> None:
        with self._conn.cursor() as cur:
            self._table = table_columns(cur, self.config.schema_, self.config.table)
        self._conn.rollback()
        self._types = {name: col.data_type for name, col in self._table.items()}

    def _fq(self) -> Any:
        from psycopg2 import sql

        return sql.Identifier(self.config.schema_, self.config.table)

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
            except psycopg2.Error as e:  # lost, a lock wait over the timeout, refused
                err = self._error(e, f"adding column(s) {', '.join(todo)} to {self._name()}")
                self._rollback()
                if isinstance(err, TransientSinkError):
                    self.cleanup_sink()
                raise err from None
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

    # -- writing ------------------------------------------------------------------------------

    def _rows(self, batch: pa.Table) -> tuple[Sequence[Row], list[RowFailure]]:
        """The batch's COPY text (Arrow's), else its value tuples; truncate rows marked."""
        copy = self._copy_lines(batch)
        if copy is not None:
            rows: Any = copy
        else:
            assert self._columns is not None and self._sources is not None
            rows = value_rows(batch, self._columns, self._sources, self._types)
        return rows, self._truncates(batch, rows)

    def _copy_lines(self, batch: pa.Table) -> CopyText | None:
        """The batch's COPY text built column by column in Arrow, when the write is a plain
        COPY of columns and message fields (None otherwise: ``_rows`` then goes row by row).

        Integers, booleans, floats, strings, dates and timestamps are cast and escaped by
        Arrow; any other type goes through ``copy_value`` value by value."""
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

    def _truncates(self, batch: pa.Table, rows: list[Any]) -> list[RowFailure]:
        """With truncate_enabled, rows whose ``__truncate`` is true become ``TRUNCATE`` (in
        place); without it they are failed rows, never written."""
        failures = []
        for i, flag in enumerate(truncate_flags(batch)):
            if not flag:
                continue
            if self.config.truncate_enabled:
                rows[i] = TRUNCATE
            else:
                failures.append(
                    RowFailure(i, "a truncate row (__truncate true) and truncate_enabled is off")
                )
        return failures

    def _writer(self, batch: pa.Table, rows: Sequence[Row]) -> RowWriter:
        def write(cur: Any, sub: Sequence[int]) -> None:
            if isinstance(rows, CopyText) and len(sub) == len(rows):
                # The whole batch as Arrow built it; a part of it (bisecting) line by line.
                self._insert_rows(cur, rows)  # type: ignore[arg-type]
            else:
                self._execute(cur, [rows[i] for i in sub])

        return write

    def _delete_rows(self, cur: Any, keys: list[Delete]) -> None:
        from psycopg2 import sql
        from psycopg2.extras import execute_batch

        head = formatted(cur, sql.SQL("DELETE FROM {} WHERE ").format(self._fq()))
        where = " AND ".join(
            formatted(cur, sql.Identifier(k)) + " = %s" for k in self.config.upsert_keys
        )
        execute_batch(cur, head + where, [tuple(k) for k in keys], page_size=500)

    def _truncate_table(self, cur: Any) -> None:
        from psycopg2 import sql

        cur.execute(sql.SQL("TRUNCATE {}").format(self._fq()))

    def _insert_rows(self, cur: Any, rows: list[Row]) -> None:
        """COPY the rows (value tuples or COPY lines), or INSERT them (``values``, upserts)."""
        from psycopg2 import sql
        from psycopg2.extras import execute_values

        assert self._columns is not None
        cols = sql.SQL(", ").join(map(sql.Identifier, self._columns))
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
            stmt = formatted(cur, head) + "%s" + formatted(cur, tail)
            execute_values(cur, stmt, list(last.values()), page_size=len(last) or 1)
        elif self.config.write_method == "values":
            head = sql.SQL("INSERT INTO {} ({}) VALUES ").format(self._fq(), cols)
            execute_values(cur, formatted(cur, head) + "%s", rows, page_size=len(rows))
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
