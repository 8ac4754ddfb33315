"""MySQL / MariaDB sink (pymysql): multi-row INSERT or upsert, one transaction per batch (the
dialect of ``sinks.sql_sink.SqlSink``).

Identifiers are backtick-quoted with embedded backticks doubled (``quote_identifier``);
values are written as the literals pymysql's escaping makes, built column by column by
Arrow where the type allows (``literal_column``), else by pymysql's parameter escaping
(``cursor.executemany`` with ``%s`` placeholders), in multi-row INSERT statements of
``rows_per_statement`` rows, each behind the base's savepoint. The session runs with
``STRICT_ALL_TABLES`` so a bad value is an error, never a warning and a silently truncated
row, and with ``time_zone = '+00:00'``. With ``delivery: exactly_once`` the offsets table
needs a transactional (InnoDB) table. The statements are ``sinks.mysql_sql``, the rows and
their literals ``sinks.mysql_rows``, the error classification ``sinks.mysql_errors``, the
table's description ``sinks.mysql_table``, the config ``sinks.mysql_config``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import pyarrow as pa

from conveyor.core.errors import ConfigError, PermanentSinkError
from conveyor.core.sink import ErrorKind, sink_error
from conveyor.sinks.base import RowFailure, require, secret
from conveyor.sinks.mysql_config import (
    MySQLSinkConfig,
    address,
    check_url,
    connect_kwargs,
    tls_options,
)
from conveyor.sinks.mysql_errors import (
    DATA_ERRORS,
    PERMANENT_ERRORS,
    TRANSIENT_ERRORS,
    classify_mysql_error,
    error_code,
    error_text,
)
from conveyor.sinks.mysql_rows import (
    PACKET_MARGIN,
    batch_literals,
    batch_values,
    column_values,
    headers_json,
    literal_statements,
    payload_json,
    row_literals,
)
from conveyor.sinks.mysql_sql import (
    INTEGER_TYPES,
    MYSQL,
    NUMERIC_TYPES,
    add_column_statement,
    create_table_statement,
    identifier_problem,
    insert_parts,
    insert_statement,
    mysql_type,
    percent_quoted,
    quote_identifier,
)
from conveyor.sinks.mysql_table import describe_table, unique_indexes
from conveyor.sinks.sql import OffsetsStatements, column_types, offsets_statements
from conveyor.sinks.sql_sink import Delete, Row, RowWriter, SqlSink
from conveyor.sinks.tombstones import DeleteKeyError

__all__ = [  # what tests and other modules import from here
    "DATA_ERRORS",
    "PERMANENT_ERRORS",
    "TRANSIENT_ERRORS",
    "MySQLSink",
    "MySQLSinkConfig",
    "classify_mysql_error",
    "column_values",
    "create_table_statement",
    "error_text",
    "headers_json",
    "identifier_problem",
    "insert_statement",
    "literal_statements",
    "mysql_type",
    "payload_json",
    "quote_identifier",
    "row_literals",
]

log = logging.getLogger("conveyor.sinks.mysql")

#: Access denied: a command on a table (1142), a database (1044).
_DENIED = (1142, 1044)


class MySQLSink(SqlSink):
    """The MySQL dialect: pymysql, multi-row INSERT statements, server error numbers."""

    config_class = MySQLSinkConfig
    config: MySQLSinkConfig
    label: ClassVar[str] = "MySQL"
    dialect = MYSQL
    release_savepoints: ClassVar[bool] = False  # setting the one name again moves it
    wrap_unisolated: ClassVar[bool] = True

    def __init__(self, config: MySQLSinkConfig):
        super().__init__(config)
        self._exists = False
        self._stmt: str | None = None
        self._insert: tuple[str, str] | None = None  # the INSERT's text around its values
        self._max_packet = 16 << 20  # the server's max_allowed_packet, read at start

    def _offsets_statements(self) -> OffsetsStatements:
        return offsets_statements(quote_identifier(self.config.offsets_table), "mysql")

    # -- the connection and its errors --------------------------------------------------------

    def validate(self) -> None:
        """The URL's parts, once its reference (if any) is resolved; the TLS files."""
        if self.config.host is None:
            check_url(secret(self.config.url) or "")
        tls_options(self.config)

    def connect_kwargs(self) -> dict[str, Any]:
        """pymysql.connect keyword arguments (includes the password: never log it)."""
        return connect_kwargs(self.config)

    def endpoint(self) -> str:
        kw = address(self.config)
        return f"{kw['host']}:{kw['port']}/{kw['database']}"

    def describe(self) -> str:
        return f"mysql {self.endpoint()} table {self.config.table}"

    def _connect(self) -> Any:
        import pymysql

        try:
            return pymysql.connect(**self.connect_kwargs())
        except (pymysql.err.MySQLError, OSError) as e:
            raise self._error(e, f"connecting to {self.endpoint()}") from None

    def _error(self, e: BaseException, context: str) -> Exception:
        """The sink error for a non-data exception."""
        kind = classify_mysql_error(e)
        code = error_code(e)
        if code == 1146:
            return PermanentSinkError(
                f"table {quote_identifier(self.config.table)} in database {self.config.database_name()!r} does not exist: {error_text(e)}"
            )
        return sink_error(kind, f"MySQL {context}: {error_text(e)}", data=ErrorKind.TRANSIENT)

    def _connection_lost(self) -> bool:
        return self._conn is None or not self._conn.open

    def _classify(self, e: BaseException) -> ErrorKind | None:
        import pymysql

        if not isinstance(e, (pymysql.err.MySQLError, OSError)):
            return None
        return classify_mysql_error(e)

    def _error_text(self, e: BaseException) -> str:
        return error_text(e)

    def _denied(self, e: BaseException) -> bool:
        return error_code(e) in _DENIED

    def _ledger_exists(self, cur: Any) -> bool:
        cur.execute(
            "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() "
            "AND TABLE_NAME = %s",
            (self.config.offsets_table,),
        )
        return cur.fetchone() is not None

    # -- the table ----------------------------------------------------------------------------

    def _check_table(self) -> None:
        """The table exists (or create_table), its upsert keys are a unique index, and it is
        transactional for exactly once."""
        c = self.config
        if not self._exists and not c.create_table:
            self.cleanup_sink()
            raise PermanentSinkError(
                f"table {quote_identifier(c.table)} does not exist in database {c.database_name()!r} (set create_table: true to create it)"
            )
        if self._exists:
            self._check_upsert_keys()
        not_transactional = f"table {quote_identifier(c.table)} is not transactional"
        if (
            self._exactly_once()
            and self._exists
            and not self._transactional
            and not self._downgrade(not_transactional)
        ):
            self.cleanup_sink()
            raise PermanentSinkError(
                f"{not_transactional}: delivery exactly_once needs a transactional engine (InnoDB); convert the table, or set delivery: "
                "at_least_once (delivery: auto, the default, does that by itself)"
            )

    def _table_exists(self) -> bool:
        return self._exists

    def _name(self) -> str:
        return quote_identifier(self.config.table)

    def _describe_table(self) -> None:
        with self._conn.cursor() as cur:
            facts = describe_table(cur, self.config.table)
        self._conn.rollback()
        self._table = facts.columns
        self._types = {name: col.data_type for name, col in self._table.items()}
        self._exists = facts.engine is not None
        self._transactional = facts.transactional
        self._max_packet = facts.max_packet
        if self._exists and not self._transactional:
            log.warning(
                "table %s uses the non-transactional engine %s: rows are written one per statement so that a bad row "
                "never takes good ones with it; use InnoDB for batches",
                self.config.table,
                facts.engine,
            )

    def _check_upsert_keys(self) -> None:
        """ON DUPLICATE KEY fires on any unique index: the keys must be one, or replays duplicate."""
        keys = self.config.upsert_keys
        if not keys:
            return
        missing = [k for k in keys if k not in self._types]
        if missing:
            raise PermanentSinkError(
                f"table {quote_identifier(self.config.table)} has no column(s) {', '.join(missing)} (upsert_keys)"
            )
        with self._conn.cursor() as cur:
            unique = unique_indexes(cur, self.config.table)
        self._conn.rollback()
        if not any(sorted(cols) == sorted(keys) for cols in unique.values()):
            have = "; ".join(f"{i}({', '.join(c)})" for i, c in unique.items()) or "none"
            raise PermanentSinkError(
                f"upsert_keys ({', '.join(keys)}) are not the PRIMARY KEY or a UNIQUE index of table {quote_identifier(self.config.table)} "
                f"(unique indexes: {have}); ON DUPLICATE KEY UPDATE needs one"
            )

    def _check_mapping(self, mapping: dict[str, str]) -> None:
        """Payload columns that become MySQL columns, and the upsert keys among them."""
        for target in mapping:
            problem = identifier_problem(target)
            if problem:
                raise ConfigError(
                    f"payload column {target!r} cannot be a MySQL column: {problem}; map it with columns",
                    field="sink.columns",
                )
        for k in self.config.upsert_keys:
            require(
                k in mapping,
                f"upsert key {k!r} is not a payload column ({', '.join(mapping)})",
                field="sink.upsert_keys",
            )

    def _resolved(self) -> None:
        assert self._columns is not None
        c = self.config
        self._stmt = insert_statement(c.table, self._columns, c.upsert_keys)
        self._insert = insert_parts(c.table, self._columns, c.upsert_keys)

    def _add_columns(self, added: dict[str, str]) -> None:
        """ALTER TABLE ... ADD COLUMN each of ``added`` (name -> type) the table still lacks
        (MySQL has no ADD COLUMN IF NOT EXISTS: the description just read is the check), as
        nullable columns, then describe the table again. A column another sink added between
        that check and this statement (duplicate column, 1060) is done, not an error; any
        other error goes to ``send_batch``'s mapping."""
        import pymysql

        with self._conn.cursor() as cur:
            for name, sql_type in added.items():
                try:
                    cur.execute(add_column_statement(self.config.table, name, sql_type))
                except pymysql.err.MySQLError as e:
                    if error_code(e) != 1060:
                        raise
                else:
                    log.info("table %s: added column %s", quote_identifier(self.config.table), name)
        self._describe_table()
        missing = [n for n in added if n not in self._table]
        if missing:
            raise PermanentSinkError(
                f"table {quote_identifier(self.config.table)}: column(s) {', '.join(missing)} were not added"
            )

    def _create_table(self, batch: pa.Table, mapping: dict[str, str]) -> None:
        types = column_types(mapping, batch, MYSQL, self.config.upsert_keys)
        with self._conn.cursor() as cur:
            cur.execute(create_table_statement(self.config.table, types, self.config.upsert_keys))
        self._conn.commit()
        self._describe_table()
        if not self._exists:
            raise PermanentSinkError(f"table {quote_identifier(self.config.table)} was not created")
        self._check_upsert_keys()
        log.info("created table %s", quote_identifier(self.config.table))

    # -- writing ------------------------------------------------------------------------------

    def _prepare_cursor(self, cur: Any) -> None:
        # A statement above max_allowed_packet makes the server drop the connection.
        cur.max_stmt_length = min(self.config.max_statement_bytes, self._max_packet - PACKET_MARGIN)

    def _statements(self, todo: list[int]) -> list[list[int]]:
        step = self.config.rows_per_statement if self._transactional else 1
        return [todo[start : start + step] for start in range(0, len(todo), step)]

    def _rows(self, batch: pa.Table) -> tuple[list[tuple[Any, ...] | None], list[RowFailure]]:
        """The batch as parameter tuples; rows with values MySQL cannot hold become failures."""
        assert self._sources is not None
        return batch_values(batch, self._sources, self._max_packet, self._conn.literal)

    def _typed_key(self, column: str, value: Any) -> Any:
        """A key value from a message key, as the column's type: MySQL would compare a text
        that is not a number with a numeric column as 0 (and delete row 0)."""
        typ = self._types.get(column, "").lower()
        if not isinstance(value, str) or typ not in NUMERIC_TYPES:
            return value
        try:
            return int(value) if typ in INTEGER_TYPES else float(value)
        except ValueError:
            raise DeleteKeyError(
                f"tombstone key {value[:60]!r} is not a number for {typ} column {column}"
            ) from None

    def _writer(self, batch: pa.Table, rows: Sequence[Row]) -> RowWriter:
        literals = None if any(isinstance(r, Delete) for r in rows) else self._literals(batch)

        def write(cur: Any, sub: Sequence[int]) -> None:
            if literals is not None:
                self._execute_literals(cur, literals.take(pa.array(sub, pa.int64())))
            else:
                self._execute(cur, [rows[i] for i in sub])

        return write

    def _insert_rows(self, cur: Any, rows: list[Row]) -> None:
        cur.executemany(self._stmt, rows)

    def _delete_rows(self, cur: Any, keys: list[Delete]) -> None:
        where = " AND ".join(f"{percent_quoted(k)} = %s" for k in self.config.upsert_keys)
        cur.executemany(
            f"DELETE FROM {percent_quoted(self.config.table)} WHERE {where}",
            [tuple(k) for k in keys],
        )

    def _literals(self, batch: pa.Table) -> pa.LargeStringArray | None:
        """The batch's rows as MySQL literals built by Arrow, or None (``batch_literals``)."""
        assert self._sources is not None
        return batch_literals(batch, self._sources, self._conn)

    def _execute_literals(self, cur: Any, rows: pa.LargeStringArray) -> None:
        """Write ``rows`` (``row_literals``) with the INSERT statement, split as pymysql's
        ``executemany`` splits it."""
        assert self._insert is not None
        prefix, postfix = (part.encode() for part in self._insert)
        for stmt in literal_statements(rows, prefix, postfix, cur.max_stmt_length):
            cur.execute(stmt)
