"""MySQL / MariaDB sink (pymysql): multi-row INSERT or upsert, one transaction per batch.

Identifiers are backtick-quoted with embedded backticks doubled (``quote_identifier``);
values are written as the literals pymysql's escaping makes, built column by column by
Arrow where the type allows (``literal_column``), else by pymysql's parameter escaping
(``cursor.executemany`` with ``%s`` placeholders), in multi-row INSERT statements. The
session runs with ``STRICT_ALL_TABLES`` so a bad value is an error, never a warning
and a silently truncated row, and with ``time_zone = '+00:00'``.

A batch is one transaction, committed before ``send_batch`` returns (that is the
acknowledgement). Rows go out in statements of ``rows_per_statement`` rows, each
behind a savepoint: a statement the server rejects for a row's content (NOT NULL,
CHECK, out of range, too long, duplicate key, foreign key...) is rolled back to its
savepoint and bisected until the guilty rows are found; the good rows are kept.
With ``delivery: exactly_once`` the same transaction raises the batch's offsets in
the offsets table (``sinks.sql.OffsetsLedger``); it needs a transactional (InnoDB)
table.
"""

from __future__ import annotations

import codecs
import contextlib
import itertools
import json
import logging
import math
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, SecretStr, model_validator

from conveyor.core.errors import (
    ConfigError,
    FencedError,
    PermanentSinkError,
    TransientSinkError,
    rule,
)
from conveyor.core.model import (
    HEADERS_COL,
)
from conveyor.core.positions import StoredPositions
from conveyor.core.references import known_now
from conveyor.core.sink import ErrorKind, first_failure_only, isolate_rows, sink_error
from conveyor.sinks.base import (
    RowFailure,
    SendResult,
    Sink,
    iter_records,
    json_default,
    payload_columns,
    require,
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
from conveyor.sinks.tombstones import (  # noqa: E402 - after the sink base imports
    DeleteKeyError,
    delete_key,
    has_tombstones,
    message_keys,
    tombstone_flags,
)

log = logging.getLogger("conveyor.sinks.mysql")


#: The session's sql_mode, set in full: strict for every engine, and without
#: NO_BACKSLASH_ESCAPES / ANSI_QUOTES, which pymysql's escaping and our backticks rely on.
SQL_MODE = "STRICT_ALL_TABLES,NO_ZERO_IN_DATE,NO_ZERO_DATE,ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION"

MAX_IDENTIFIER = 64
PACKET_MARGIN = 4096  # room for the statement's text around a row's values


class MySQLSinkConfig(SqlSinkConfig):
    """Rows into a MySQL or MariaDB table."""

    type: Literal["mysql"] = "mysql"
    url: SecretStr | None = Field(
        default=None,
        description="mysql://user:${file:/run/secrets/mysql}@host:3306/db (secret; a password in it must be a reference; the user percent-encoded). One of url, url_env or host.",
    )
    host: str | None = Field(
        default=None,
        description="Server host, with port/user/password/database (instead of a URL).",
    )
    port: int = Field(default=3306, ge=1, le=65535, description="Server port (with host).")
    user: str | None = Field(default=None, description="User name (with host); default root.")
    password: SecretStr | None = Field(default=None, description="Password (with host; secret).")
    database: str | None = Field(
        default=None, description="Database (with host; with a URL the database is the URL's path)."
    )
    table: str = Field(
        description="Target table (one identifier; quoted, so any character but NUL is allowed)."
    )
    columns: SqlColumns = None
    upsert_keys: list[str] = Field(
        default_factory=list,
        description="Columns of the table's PRIMARY KEY or a UNIQUE index: INSERT ... ON DUPLICATE KEY UPDATE the other columns "
        "(idempotent replays). Empty: plain INSERT.",
    )
    create_table: bool = Field(
        default=False,
        description="Create the table (InnoDB, upsert_keys as PRIMARY KEY) from the first batch's schema when it does not exist.",
    )
    auto_evolve: AutoEvolve = False
    delete_enabled: DeleteEnabled = False
    rows_per_statement: int = Field(
        default=1000, ge=1, le=100_000, description="Rows per multi-row INSERT statement."
    )
    max_statement_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        le=1 << 30,
        description="pymysql splits a statement longer than this; keep it under the server's max_allowed_packet.",
    )
    connect_timeout_s: ConnectTimeoutS = 10
    read_timeout_s: int = Field(
        default=60,
        ge=1,
        le=86_400,
        description="Socket read timeout: how long one statement may take.",
    )
    write_timeout_s: int = Field(default=60, ge=1, le=86_400, description="Socket write timeout.")
    lock_wait_timeout_s: int | None = Field(
        default=None,
        ge=1,
        le=86_400,
        description="Session innodb_lock_wait_timeout (default: the server's, usually 50 s).",
    )
    tls_ca_file: str | None = Field(
        default=None,
        description="CA bundle (PEM): connect with TLS and verify the server against it.",
    )
    charset: str = Field(default="utf8mb4", description="Connection character set.")
    delivery: Delivery
    offsets_table: OffsetsTableName = "conveyor_offsets"

    def database_name(self) -> str | None:
        """The database, from `database` or the URL's path when the URL writes it out.

        A URL given by reference (``${env:MYSQL_URL}``) is not read here: outside the run
        its database is unknown (the asset key says ``default``).
        """
        if self.database:
            return self.database
        url = secret(self.url)
        if not url or url.startswith("${"):
            return None
        path = urllib.parse.urlsplit(url).path.lstrip("/")
        if "${" in path:
            return None
        return urllib.parse.unquote(path) or None

    def key_namespace(self) -> str:
        return self.database_name() or "default"

    def kind(self) -> str:
        return "mysql"

    @model_validator(mode="after")
    def _rules(self) -> MySQLSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        schemes = [n for n, v in (("url", self.url), ("host", self.host)) if v]
        rule(
            len(schemes) == 1,
            f"give exactly one of url (or url_env) and host (got {', '.join(schemes) or 'none'})",
            field="url",
        )
        if self.host is not None:
            rule(bool(self.host.strip()), "must not be empty", field="host")
            rule(
                bool(self.database and self.database.strip()),
                "a database is required with host",
                field="database",
            )
        else:
            for name in ("user", "password", "database"):
                rule(
                    getattr(self, name) is None,
                    f"{name} goes into the URL when url (or url_env) is used",
                    field=name,
                )
            rule(
                "port" not in self.model_fields_set,
                "port goes into the URL when url (or url_env) is used",
                field="port",
            )
        problem = identifier_problem(self.table) if known_now(self.table) else None
        rule(problem is None, f"{self.table!r}: {problem}", field="table")
        problem = identifier_problem(self.offsets_table)
        rule(problem is None, f"{self.offsets_table!r}: {problem}", field="offsets_table")
        self.check_mapping(column_problem=identifier_problem)
        rule(
            len(set(self.upsert_keys)) == len(self.upsert_keys),
            "duplicate column",
            field="upsert_keys",
        )
        rule(
            not known_now(self.charset)
            or (bool(self.charset.strip()) and self.charset.replace("_", "").isalnum()),
            f"{self.charset!r} is not a character set name",
            field="charset",
        )
        return self


# -- pure helpers -------------------------------------------------------------------------------


def identifier_problem(name: str) -> str | None:
    """Why ``name`` cannot be a MySQL identifier, or None."""
    if not name or not name.strip():
        return "must not be empty"
    if "\x00" in name:
        return "must not contain NUL"
    if len(name) > MAX_IDENTIFIER:
        return f"longer than {MAX_IDENTIFIER} characters"
    if name != name.rstrip(" "):
        return "must not end with a space"
    return None


def quote_identifier(name: str) -> str:
    """A backtick-quoted MySQL identifier, embedded backticks doubled."""
    if "\x00" in name:
        raise ValueError("identifier contains NUL")
    return "`" + name.replace("`", "``") + "`"


def _q(name: str) -> str:
    """A quoted identifier inside a statement that pymysql %-formats: '%' doubled."""
    return percent_escaped(quote_identifier(name))


def insert_parts(
    table: str, columns: Sequence[str], upsert_keys: Sequence[str] = ()
) -> tuple[str, str]:
    """The INSERT (or upsert) around its rows of values: the text before them and after."""
    q = quote_identifier
    prefix = f"INSERT INTO {q(table)} ({', '.join(q(c) for c in columns)}) VALUES "
    if not upsert_keys:
        return prefix, ""
    others = [c for c in columns if c not in upsert_keys]
    # VALUES(col) works on MariaDB and MySQL (MySQL 8.0.20+ deprecates it for an alias,
    # which MariaDB does not have). A key-only table updates nothing: k = k.
    sets = (
        ", ".join(f"{q(c)} = VALUES({q(c)})" for c in others)
        or f"{q(upsert_keys[0])} = {q(upsert_keys[0])}"
    )
    return prefix, f" ON DUPLICATE KEY UPDATE {sets}"


def insert_statement(table: str, columns: Sequence[str], upsert_keys: Sequence[str] = ()) -> str:
    """The parameterized INSERT (or upsert) of one row, for ``cursor.executemany``: the
    identifiers' '%' doubled (pymysql %-formats the statement)."""
    prefix, postfix = insert_parts(table, columns, upsert_keys)
    values = f"({', '.join(['%s'] * len(columns))})"
    return percent_escaped(prefix) + values + percent_escaped(postfix)


def add_column_statement(table: str, column: str, sql_type: str) -> str:
    """ALTER TABLE ... ADD COLUMN of one nullable column (executed without parameters)."""
    q = quote_identifier
    return f"ALTER TABLE {q(table)} ADD COLUMN {q(column)} {sql_type} NULL"


def create_table_statement(table: str, columns: dict[str, str], upsert_keys: Sequence[str]) -> str:
    """CREATE TABLE IF NOT EXISTS from target column -> SQL type (executed without parameters)."""
    q = quote_identifier
    defs = [f"{q(c)} {t}" for c, t in columns.items()]
    if upsert_keys:
        defs.append(f"PRIMARY KEY ({', '.join(q(k) for k in upsert_keys)})")
    return f"CREATE TABLE IF NOT EXISTS {q(table)} ({', '.join(defs)}) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"


def mysql_type(t: pa.DataType, *, key: bool = False) -> str:
    """The MySQL column type for an Arrow type (key columns get indexable types)."""
    if pa.types.is_dictionary(t):
        return mysql_type(t.value_type, key=key)
    if pa.types.is_boolean(t):
        return "BOOLEAN"
    if pa.types.is_integer(t):
        base = {8: "TINYINT", 16: "SMALLINT", 32: "INT", 64: "BIGINT"}[t.bit_width]
        return base + (" UNSIGNED" if pa.types.is_unsigned_integer(t) else "")
    if pa.types.is_float16(t) or pa.types.is_float32(t):
        return "FLOAT"
    if pa.types.is_floating(t):
        return "DOUBLE"
    if pa.types.is_decimal(t):
        return f"DECIMAL({min(t.precision, 65)},{min(t.scale, 30)})"
    if pa.types.is_timestamp(t) or pa.types.is_time(t):
        base = "DATETIME" if pa.types.is_timestamp(t) else "TIME"
        return base + {"s": "", "ms": "(3)"}.get(t.unit, "(6)")
    if pa.types.is_date(t):
        return "DATE"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "VARBINARY(255)" if key else "LONGBLOB"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "VARCHAR(255)" if key else "LONGTEXT"
    return "JSON"


MYSQL = SqlDialect(
    "mysql", lambda t, key: mysql_type(t, key=key), "JSON", frozenset({"$payload", "$headers"})
)


def column_values(col: pa.ChunkedArray | pa.Array) -> tuple[list[Any], dict[int, str]]:
    """A column as values pymysql can escape, and the rows whose value MySQL cannot hold.

    Aware timestamps become their naive UTC wall time (the session's time zone is UTC);
    nested values become JSON text; NaN and infinities have no MySQL representation.
    """
    t = col.type
    bad: dict[int, str] = {}
    if pa.types.is_timestamp(t):
        if t.tz is not None or t.unit == "ns":
            col = col.cast(pa.timestamp("us" if t.unit == "ns" else t.unit), safe=False)
        return col.to_pylist(), bad
    if pa.types.is_floating(t):
        values = col.to_pylist()
        if len(col) and pc.any(pc.invert(pc.is_finite(col))).as_py():
            for i, v in enumerate(values):
                if v is not None and not math.isfinite(v):
                    bad[i] = f"{v!r} cannot be stored in MySQL"
        return values, bad
    if pa.types.is_nested(t):
        return [
            None if v is None else json.dumps(v, default=json_default) for v in json_values(col)
        ], bad
    return col.to_pylist(), bad


def headers_json(col: pa.ChunkedArray | pa.Array) -> list[str]:
    """The __headers column as JSON objects of text values (the last of a repeated name wins)."""
    out = []
    for hs in col.to_pylist():
        out.append(
            json.dumps(
                {
                    h["key"]: (
                        h["value"].decode(errors="replace") if h["value"] is not None else None
                    )
                    for h in hs or ()
                }
            )
        )
    return out


#: pymysql's string escaping (``converters._escape_table``), the backslash first.
_STRING_ESCAPES = (
    ("\\", "\\\\"),
    ("\0", "\\0"),
    ("\n", "\\n"),
    ("\r", "\\r"),
    ("\032", "\\Z"),
    ('"', '\\"'),
    ("'", "\\'"),
)


def literal_column(col: pa.ChunkedArray | pa.Array) -> Any:
    """A column as MySQL literals built by Arrow, exactly as pymysql's escaping writes each
    value (``NULL``, numbers, quoted and escaped text, dates and times), or None for a type
    left to pymysql value by value. The session has no NO_BACKSLASH_ESCAPES (``SQL_MODE``).

    Floats are written as pymysql does (``repr``, then ``e0`` unless it has an exponent: a
    DOUBLE literal); NaN and infinities never get here (``column_values`` fails their
    rows). Timestamps are the naive UTC wall time, as ``column_values`` gives pymysql."""
    t = col.type
    if pa.types.is_integer(t):
        text = pc.cast(col, pa.large_string())
    elif pa.types.is_boolean(t):
        text = pc.if_else(col, text_scalar("1"), text_scalar("0"))
    elif pa.types.is_floating(t):
        text = pc.cast(pc.cast(col, pa.float64()), pa.large_string())
        text = pc.if_else(pc.match_substring(text, "e"), text, concat_text(text, text_scalar("e0")))
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        text = pc.cast(col, pa.large_string())
        for old, new in _STRING_ESCAPES:
            text = pc.replace_substring(text, old, new)
        text = concat_text(text_scalar("'"), text, text_scalar("'"))
    elif pa.types.is_timestamp(t) or pa.types.is_date(t):
        if pa.types.is_timestamp(t) and (t.tz is not None or t.unit == "ns"):
            col = col.cast(pa.timestamp("us" if t.unit == "ns" else t.unit), safe=False)
        text = concat_text(text_scalar("'"), pc.cast(col, pa.large_string()), text_scalar("'"))
    else:
        return None
    return pc.fill_null(text, text_scalar("NULL"))


def row_literals(columns: list[Any]) -> pa.LargeStringArray:
    """Each row's ``(v1,v2,...),`` from its columns' literals."""
    row = pc.binary_join_element_wise(*columns, text_scalar(","))
    out = concat_text(text_scalar("("), row, text_scalar("),"))
    return out.combine_chunks() if isinstance(out, pa.ChunkedArray) else out


def literal_statements(
    rows: pa.LargeStringArray, prefix: bytes, postfix: bytes, max_length: int
) -> Iterator[bytes]:
    """The INSERT statements of ``rows`` (``row_literals``), as pymysql's ``executemany``
    splits them: as many rows per statement as ``max_length`` bytes hold, at least one."""
    import numpy as np

    if not len(rows):
        return
    offsets, view = text_offsets(rows)
    # A statement of rows [a, b) holds offsets[b] - offsets[a] - 1 bytes of values (no
    # trailing comma).
    room = max_length - len(prefix) - len(postfix) + 1
    a = 0
    while a < len(rows):
        b = int(np.searchsorted(offsets, offsets[a] + room, side="right")) - 1
        b = min(max(b, a + 1), len(rows))
        yield prefix + view[offsets[a] : offsets[b] - 1].tobytes() + postfix
        a = b


def payload_json(batch: pa.Table) -> list[str]:
    """Each row's payload as JSON text: decoded columns as an object, a JSON `value` parsed."""
    pcols = payload_columns(batch)
    if pcols == ["value"]:
        return [
            json.dumps(r.payload_json(), default=json_default)
            for r in iter_records(batch.select(["value"]))
        ]
    return [json.dumps(row, default=json_default) for row in batch.select(pcols).to_pylist()]


# -- error classification -------------------------------------------------------------------------

#: Server errors caused by one row's content: isolated and reported per row.
DATA_ERRORS = {
    1048: "column cannot be null",
    1062: "duplicate entry",
    1169: "duplicate entry (unique constraint)",
    1216: "foreign key: no parent row",
    1264: "out of range",
    1265: "data truncated",
    1292: "incorrect value (truncated)",
    1300: "invalid character string",
    1366: "incorrect value",
    1367: "illegal value",
    1406: "data too long",
    1411: "incorrect value for function",
    1452: "foreign key: no parent row",
    1586: "duplicate entry",
    1690: "value out of range",
    1859: "duplicate entry",
    3140: "invalid JSON text",
    3819: "check constraint violated",
    4025: "constraint failed (MariaDB CHECK)",
}

#: Outages: connection lost or refused, timeouts, lock waits, deadlocks, overload, failover.
TRANSIENT_ERRORS = {
    1021: "disk full",
    1037: "out of memory",
    1038: "out of sort memory",
    1040: "too many connections",
    1053: "server shutdown in progress",
    1114: "table is full",
    1152: "aborted connection",
    1158: "network read error",
    1159: "network read timeout",
    1160: "network write error",
    1161: "network write timeout",
    1180: "error during commit",
    1181: "error during rollback",
    1203: "max user connections",
    1205: "lock wait timeout",
    1213: "deadlock",
    1226: "user resource limit",
    1290: "read-only server (--read-only)",
    1317: "query interrupted",
    1836: "read-only mode",
    1927: "connection killed",
    1969: "statement timeout",
    2002: "cannot connect (socket)",
    2003: "cannot connect",
    2006: "server has gone away",
    2013: "lost connection",
    2014: "commands out of sync",
    2055: "lost connection (system error)",
    3024: "statement timeout",
}

#: No retry fixes these: credentials, privileges, a missing database/table/column, our SQL.
PERMANENT_ERRORS = {
    1036: "table is read only",
    1044: "access denied to database",
    1045: "access denied",
    1049: "unknown database",
    1051: "unknown table",
    1054: "unknown column",
    1064: "syntax error",
    1130: "host not allowed",
    1142: "command denied (privilege)",
    1143: "column access denied",
    1146: "table does not exist",
    1153: "packet larger than max_allowed_packet (rows that large are caught before sending)",
    1227: "privilege required",
    1251: "authentication protocol not supported",
    1364: "a NOT NULL column without default is not mapped",
    1698: "access denied",
    2059: "authentication plugin cannot be loaded",
}


def error_code(exc: BaseException) -> int | None:
    """The MySQL error number pymysql puts first in ``args``."""
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    return args[0] if args and isinstance(args[0], int) else None


def error_text(exc: BaseException) -> str:
    """``(code) message`` for server errors, ``Class: message`` for the rest."""
    code = error_code(exc)
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    msg = str(args[1]) if code is not None and len(args) > 1 else str(exc)
    return f"({code}) {msg}" if code is not None else f"{type(exc).__name__}: {msg or 'no message'}"


def classify_mysql_error(exc: BaseException) -> ErrorKind:
    """What an exception from pymysql means for the row / batch (by error code first)."""
    code = error_code(exc)
    if code in DATA_ERRORS:
        return ErrorKind.DATA
    if code in TRANSIENT_ERRORS:
        return ErrorKind.TRANSIENT
    if code in PERMANENT_ERRORS:
        return ErrorKind.PERMANENT
    try:
        import pymysql
    except ImportError:  # pragma: no cover - the sink needs pymysql anyway
        pymysql = None
    if pymysql is not None:
        if isinstance(exc, (pymysql.err.IntegrityError, pymysql.err.DataError)):
            return ErrorKind.DATA
        if isinstance(exc, (pymysql.err.ProgrammingError, pymysql.err.NotSupportedError)):
            return ErrorKind.PERMANENT
        if isinstance(exc, pymysql.err.InterfaceError):  # (0, '') when the connection is closed
            return ErrorKind.TRANSIENT
    # Socket errors and timeouts, OperationalError / InternalError with an unknown code.
    return ErrorKind.TRANSIENT


# -- the sink -----------------------------------------------------------------------------------


class _Delete(tuple):  # type: ignore[type-arg]
    """A tombstone's key values (upsert_keys order): a DELETE, not a write."""


def table_column(
    name: str,
    data_type: str,
    nullable: str,
    default: str | None,
    extra: str | None,
    column_type: str,
    precision: int | None,
    scale: int | None,
    fraction: int | None,
) -> TableColumn:
    """A column from its row of information_schema.COLUMNS (``_describe_table``'s query)."""
    kind = str(data_type).lower()
    extra = str(extra or "").lower()
    return TableColumn(
        name,
        kind,
        nullable=nullable == "YES",
        has_default=default is not None or "auto_increment" in extra or "generated" in extra,
        precision=int(precision)
        if kind in ("decimal", "numeric") and precision is not None
        else None,
        scale=int(scale) if kind in ("decimal", "numeric") and scale is not None else None,
        fraction_digits=int(fraction) if fraction is not None else None,
        unsigned="unsigned" in str(column_type).lower(),
    )


_INTEGER_TYPES = frozenset({"tinyint", "smallint", "mediumint", "int", "integer", "bigint"})
_NUMERIC_TYPES = _INTEGER_TYPES | {"decimal", "numeric", "float", "double", "real"}


#: Access denied: a command on a table (1142), a database (1044).
_DENIED = (1142, 1044)


class MySQLSink(LedgerSink, Sink):
    """Writes each batch in one transaction; bad rows are isolated by savepoint bisection."""

    config_class = MySQLSinkConfig
    config: MySQLSinkConfig

    def __init__(self, config: MySQLSinkConfig):
        super().__init__(config)
        self._conn: Any = None
        self._types: dict[str, str] = {}  # existing columns -> data type
        self._table: dict[str, TableColumn] = {}  # existing columns, described
        self._schema: pa.Schema | None = None  # the schema of the batch last resolved
        self._exists = False
        self._transactional = True
        self._columns: list[str] | None = None  # target columns, in order
        self._sources: list[str] | None = None  # their sources
        self._stmt: str | None = None
        self._insert: tuple[str, str] | None = None  # the INSERT's text around its values
        self._max_packet = 16 << 20  # the server's max_allowed_packet, read at start
        self._ledger = OffsetsLedger(
            offsets_statements(quote_identifier(config.offsets_table), "mysql")
        )

    # -- exactly once -----------------------------------------------------------------------

    def target_offsets(self) -> StoredPositions | None:
        """The positions the offsets table holds for this writer; None when it holds none (or
        with ``at_least_once``)."""
        if not self._exactly_once():
            return None
        import pymysql

        conn = self._connect()
        try:
            with conn.cursor() as cur:
                return self._ledger.read(cur) if self._ledger_exists(cur) else None
        except (pymysql.err.MySQLError, OSError) as e:
            if error_code(e) in _DENIED and self.config.delivery == "auto":
                return None  # not this user's to keep: init_sink goes at least once
            raise self._error(e, f"reading {self._ledger.sql.table}") from None
        finally:
            conn.close()

    def _ledger_exists(self, cur: Any) -> bool:
        cur.execute(
            "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() "
            "AND TABLE_NAME = %s",
            (self.config.offsets_table,),
        )
        return cur.fetchone() is not None

    def _claim(self) -> None:
        """The offsets table (created if missing) and this generation's claim, committed."""
        import pymysql

        try:
            with self._conn.cursor() as cur:
                self._ledger.create(cur)
                self._ledger.claim(cur)
            self._conn.commit()
        except FencedError:
            self._rollback()
            raise
        except (pymysql.err.MySQLError, OSError) as e:
            self._rollback()
            if error_code(e) in _DENIED:
                why = f"this user may not keep {self._ledger.sql.table}: {error_text(e)}"
                if self._downgrade(why):
                    return
                self.cleanup_sink()
                raise ledger_denied(self._ledger.sql.table, error_text(e)) from None
            self.cleanup_sink()
            raise self._error(e, f"claiming the offsets table {self._ledger.sql.table}") from None

    def _ledger_error(self, e: Exception, what: str) -> Exception | None:
        import pymysql

        if error_code(e) in _DENIED:
            return ledger_denied(self._ledger.sql.table, error_text(e))
        return self._error(e, what) if isinstance(e, (pymysql.err.MySQLError, OSError)) else None

    # -- config -----------------------------------------------------------------------------

    def validate(self) -> None:
        """The URL's parts, once its reference (if any) is resolved."""
        if self.config.host is None:
            self._check_url(self._url())

    def _url(self) -> str:
        return secret(self.config.url) or ""

    @staticmethod
    def _check_url(url: str) -> None:
        field = "sink.url"
        u = urllib.parse.urlsplit(url)
        require(
            u.scheme in ("mysql", "mariadb"),
            "must start with mysql:// (or mariadb://)",
            field=field,
        )
        require(bool(u.hostname), "has no host", field=field)
        try:
            u.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ConfigError("has a bad port", field=field) from None
        require(
            bool(u.path.lstrip("/")),
            "has no database (mysql://user:pw@host:3306/<database>)",
            field=field,
        )

    def connect_kwargs(self) -> dict[str, Any]:
        """pymysql.connect keyword arguments (includes the password: never log it)."""
        c = self.config
        if c.host is not None:
            kw: dict[str, Any] = {
                "host": c.host,
                "port": c.port,
                "user": c.user or "root",
                "password": secret(c.password) or "",
                "database": c.database,
            }
        else:
            u = urllib.parse.urlsplit(self._url())
            kw = {
                "host": u.hostname,
                "port": u.port or 3306,
                "user": urllib.parse.unquote(u.username or "root"),
                "password": urllib.parse.unquote(u.password or ""),
                "database": urllib.parse.unquote(u.path.lstrip("/")),
            }
        init = [f"sql_mode = '{SQL_MODE}'", "time_zone = '+00:00'"]
        if c.lock_wait_timeout_s is not None:
            init.append(f"innodb_lock_wait_timeout = {int(c.lock_wait_timeout_s)}")
        kw.update(
            charset=c.charset,
            connect_timeout=c.connect_timeout_s,
            read_timeout=c.read_timeout_s,
            write_timeout=c.write_timeout_s,
            autocommit=False,
            init_command="SET SESSION " + ", ".join(init),
            program_name="conveyor",
        )
        if c.tls_ca_file:
            kw["ssl"] = {"ca": c.tls_ca_file}
            kw["ssl_verify_cert"] = True
        return kw

    def endpoint(self) -> str:
        kw = self.connect_kwargs()
        return f"{kw['host']}:{kw['port']}/{kw['database']}"

    def describe(self) -> str:
        return f"mysql {self.endpoint()} table {self.config.table}"

    # -- lifecycle --------------------------------------------------------------------------

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

    def init_sink(self) -> None:
        self._conn = self._connect()
        try:
            self._describe_table()
        except Exception as e:
            import pymysql

            if isinstance(e, (pymysql.err.MySQLError, OSError)):
                self.cleanup_sink()
                raise self._error(e, "reading the table's columns") from None
            raise
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
        if self._exactly_once():
            self._claim()

    def _describe_table(self) -> None:
        with self._conn.cursor() as cur:
            cur.execute(
                "SELECT COLUMN_NAME, DATA_TYPE, IS_NULLABLE, COLUMN_DEFAULT, EXTRA, COLUMN_TYPE, NUMERIC_PRECISION, "
                "NUMERIC_SCALE, DATETIME_PRECISION FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() "
                "AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
                (self.config.table,),
            )
            self._table = {row[0]: table_column(*row) for row in cur.fetchall()}
            self._types = {name: col.data_type for name, col in self._table.items()}
            cur.execute(
                "SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
                (self.config.table,),
            )
            row = cur.fetchone()
            self._exists = row is not None
            cur.execute("SELECT ENGINE, TRANSACTIONS FROM information_schema.ENGINES")
            engines = {str(e).upper(): t == "YES" for e, t in cur.fetchall()}
            cur.execute("SELECT @@max_allowed_packet")
            self._max_packet = int(cur.fetchone()[0])
        self._conn.rollback()
        self._transactional = row is None or engines.get(str(row[0]).upper(), True)
        if self._exists and not self._transactional:
            log.warning(
                "table %s uses the non-transactional engine %s: rows are written one per statement so that a bad row "
                "never takes good ones with it; use InnoDB for batches",
                self.config.table,
                row[0] if row else "?",
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
            cur.execute(
                "SELECT INDEX_NAME, COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s "
                "AND NON_UNIQUE = 0 ORDER BY INDEX_NAME, SEQ_IN_INDEX",
                (self.config.table,),
            )
            unique: dict[str, list[str]] = {}
            for index, col in cur.fetchall():
                unique.setdefault(index, []).append(col)
        self._conn.rollback()
        if not any(sorted(cols) == sorted(keys) for cols in unique.values()):
            have = "; ".join(f"{i}({', '.join(c)})" for i, c in unique.items()) or "none"
            raise PermanentSinkError(
                f"upsert_keys ({', '.join(keys)}) are not the PRIMARY KEY or a UNIQUE index of table {quote_identifier(self.config.table)} "
                f"(unique indexes: {have}); ON DUPLICATE KEY UPDATE needs one"
            )

    def cleanup_sink(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                self._conn.close()
            self._conn = None

    # -- columns ----------------------------------------------------------------------------

    def _resolve(self, batch: pa.Table) -> None:
        """Pick target and source columns on the first batch (with auto_evolve, again on
        each batch of another schema, adding the columns the table lacks); check them
        against the table."""
        c = self.config
        mapping = column_mapping(c.columns, batch)
        if c.columns is None:
            for target in mapping:
                problem = identifier_problem(target)
                if problem:
                    raise ConfigError(
                        f"payload column {target!r} cannot be a MySQL column: {problem}; map it with columns",
                        field="sink.columns",
                    )
            for k in c.upsert_keys:
                require(
                    k in mapping,
                    f"upsert key {k!r} is not a payload column ({', '.join(mapping)})",
                    field="sink.upsert_keys",
                )
        if c.auto_evolve and self._columns is not None:
            self._describe_table()  # another sink may have changed the table since
        if not self._exists:
            self._create_table(batch, mapping)
        if c.auto_evolve:
            added = evolution(
                quote_identifier(c.table), mapping, batch, MYSQL, self._table, c.upsert_keys
            )
            if added:
                self._add_columns(added)
        check_columns(quote_identifier(c.table), mapping, list(self._types))
        self._columns = list(mapping)
        self._sources = [mapping[t] for t in self._columns]
        self._stmt = insert_statement(c.table, self._columns, c.upsert_keys)
        self._insert = insert_parts(c.table, self._columns, c.upsert_keys)
        self._schema = batch.schema

    def _evolves(self, batch: pa.Table) -> bool:
        """With auto_evolve: whether ``batch``'s schema is not the one last resolved."""
        return self.config.auto_evolve and not batch.schema.equals(self._schema)

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

    # -- writing ----------------------------------------------------------------------------

    def _rows(self, batch: pa.Table) -> tuple[list[tuple[Any, ...] | None], list[RowFailure]]:
        """The batch as parameter tuples; rows with values MySQL cannot hold become failures."""
        assert self._sources is not None
        cols: dict[str, list[Any]] = {}
        bad: dict[int, str] = {}
        text_bytes = 0  # bytes of text and binary values, for the max_allowed_packet check
        for src in dict.fromkeys(self._sources):
            if src in ("$payload", "$headers"):
                cols[src] = (
                    payload_json(batch)
                    if src == "$payload"
                    else headers_json(batch.column(HEADERS_COL))
                )
                text_bytes += 4 * sum(map(len, cols[src]))
            else:
                col = batch.column(META_SOURCES.get(src, src))
                values, col_bad = column_values(col)
                cols[src] = values
                for i, msg in col_bad.items():
                    bad.setdefault(i, msg)
                if (
                    pa.types.is_string(col.type)
                    or pa.types.is_large_string(col.type)
                    or pa.types.is_binary(col.type)
                    or pa.types.is_large_binary(col.type)
                ):
                    text_bytes += pc.sum(pc.binary_length(col)).as_py() or 0
                elif pa.types.is_nested(col.type):
                    text_bytes += 4 * sum(len(v) for v in values if v is not None)
        rows: list[tuple[Any, ...] | None] = list(
            zip(*(cols[src] for src in self._sources), strict=True)
        )
        for i in bad:
            rows[i] = None
        failures = [RowFailure(i, msg) for i, msg in sorted(bad.items())]
        # Escaping at most doubles a value; other values are short. Only a batch that could
        # hold a row above the limit is checked row by row.
        if (
            2 * text_bytes + 64 * len(self._sources) * batch.num_rows
            > self._max_packet - PACKET_MARGIN
        ):
            failures = sorted(failures + self._oversized(rows), key=lambda f: f.index)
        return rows, failures

    def send_batch(self, batch: pa.Table) -> SendResult:
        import pymysql

        if batch.num_rows == 0:
            return SendResult(rows=0)
        try:
            if self._conn is None or not self._conn.open:
                self.cleanup_sink()
                self._conn = self._connect()
                self._describe_table()
            if self._columns is None or self._evolves(batch):
                self._resolve(batch)
            with self._conn.cursor() as cur:
                # A statement above max_allowed_packet makes the server drop the connection.
                cur.max_stmt_length = min(
                    self.config.max_statement_bytes, self._max_packet - PACKET_MARGIN
                )
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
        except (pymysql.err.MySQLError, OSError) as e:
            kind = classify_mysql_error(e)
            err = self._error(
                e,
                "write failed"
                if kind is not ErrorKind.DATA
                else "write failed on a row the sink could not isolate",
            )
            self._rollback()
            if isinstance(err, TransientSinkError):
                self.cleanup_sink()
            raise err from None
        except BaseException:
            self._rollback()  # nothing of the batch (nor its offsets) stays
            raise
        return SendResult(
            rows=batch.num_rows, failed=tuple(sorted(failures, key=lambda f: f.index))
        )

    def _write_batch(self, cur: Any, batch: pa.Table) -> list[RowFailure]:
        """Write ``batch`` in the open transaction (not committed); its failed rows."""
        rows, failures = self._rows(batch)
        failures += self._deletes(batch, rows)
        literals = None if any(isinstance(r, _Delete) for r in rows) else self._literals(batch)
        good = [i for i, r in enumerate(rows) if r is not None]
        if self.fail_fast:
            failures, good = first_failure_only(failures, good)
        step = self.config.rows_per_statement if self._transactional else 1
        for start in range(0, len(good), step):
            if failures and self.fail_fast:
                break  # nothing after the first failed row is written
            failures += self._write_isolating(cur, rows, good[start : start + step], literals)
        return sorted(failures, key=lambda f: f.index)

    def _oversized(self, rows: list[tuple[Any, ...] | None]) -> list[RowFailure]:
        """Rows whose INSERT alone would exceed max_allowed_packet (sets them to None)."""
        limit = self._max_packet - PACKET_MARGIN
        out = []
        for i, row in enumerate(rows):
            if row is None:
                continue
            # A cheap upper bound first (escaping at most doubles a value, UTF-8 takes at most 4 bytes a character).
            bound = sum(
                8 * len(v) if isinstance(v, str) else 2 * len(v) if isinstance(v, bytes) else 64
                for v in row
            )
            if bound <= limit:
                continue
            size = sum(len(self._conn.literal(v).encode(errors="surrogateescape")) + 2 for v in row)
            if size > limit:
                rows[i] = None
                out.append(
                    RowFailure(
                        i,
                        f"row of {size} bytes exceeds the server's max_allowed_packet ({self._max_packet} bytes)",
                    )
                )
        return out

    def _deletes(self, batch: pa.Table, rows: list[tuple[Any, ...] | None]) -> list[RowFailure]:
        """With delete_enabled, tombstone rows become ``_Delete`` keys (in place); the rows
        whose key cannot be found become failures (and None)."""
        if not self.config.delete_enabled or not has_tombstones(batch):
            return []
        assert self._columns is not None
        failures = []
        for i, (tomb, key) in enumerate(
            zip(tombstone_flags(batch), message_keys(batch), strict=True)
        ):
            row = rows[i]
            if not tomb or row is None:
                continue
            try:
                values = dict(zip(self._columns, row, strict=True))
                found = delete_key(self.config.upsert_keys, values, key)
                rows[i] = _Delete(
                    self._typed_key(k, v)
                    for k, v in zip(self.config.upsert_keys, found, strict=True)
                )
            except DeleteKeyError as e:
                rows[i] = None
                failures.append(RowFailure(i, str(e)))
        return failures

    def _typed_key(self, column: str, value: Any) -> Any:
        """A key value from a message key, as the column's type: MySQL would compare a text
        that is not a number with a numeric column as 0 (and delete row 0)."""
        typ = self._types.get(column, "").lower()
        if not isinstance(value, str) or typ not in _NUMERIC_TYPES:
            return value
        try:
            return int(value) if typ in _INTEGER_TYPES else float(value)
        except ValueError:
            raise DeleteKeyError(
                f"tombstone key {value[:60]!r} is not a number for {typ} column {column}"
            ) from None

    def _execute(self, cur: Any, rows: list[Any]) -> None:
        """The rows' statements in order: runs of writes (one executemany) and of deletes."""
        for is_delete, run in itertools.groupby(rows, key=lambda r: isinstance(r, _Delete)):
            part = list(run)
            if is_delete:
                where = " AND ".join(f"{_q(k)} = %s" for k in self.config.upsert_keys)
                cur.executemany(
                    f"DELETE FROM {_q(self.config.table)} WHERE {where}", [tuple(k) for k in part]
                )
            else:
                cur.executemany(self._stmt, part)

    def _literals(self, batch: pa.Table) -> pa.LargeStringArray | None:
        """The batch's rows as MySQL literals built by Arrow (``row_literals``), or None to
        let pymysql escape them value by value: JSON built from the whole message, binary
        values, a connection that is not UTF-8 or escapes without backslashes."""
        from pymysql.constants import SERVER_STATUS

        assert self._sources is not None
        conn = self._conn
        if codecs.lookup(conn.encoding).name != "utf-8" or (
            conn.server_status & SERVER_STATUS.SERVER_STATUS_NO_BACKSLASH_ESCAPES
        ):
            return None
        columns = []
        for src in self._sources:
            if src in ("$payload", "$headers"):
                return None
            col = batch.column(META_SOURCES.get(src, src))
            literals = literal_column(col)
            if literals is None:
                if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
                    return None  # pymysql's bytes literals are not UTF-8 text
                try:  # any other type: pymysql's literal of the value it would be given
                    values, _ = column_values(col)
                    literals = pa.array([conn.literal(v) for v in values], pa.large_string())
                except (UnicodeError, pa.ArrowException):
                    return None
            columns.append(literals)
        return row_literals(columns)

    def _execute_literals(self, cur: Any, rows: pa.LargeStringArray) -> None:
        """Write ``rows`` (``row_literals``) with the INSERT statement, split as pymysql's
        ``executemany`` splits it."""
        assert self._insert is not None
        prefix, postfix = (part.encode() for part in self._insert)
        for stmt in literal_statements(rows, prefix, postfix, cur.max_stmt_length):
            cur.execute(stmt)

    def _rollback(self) -> None:
        try:
            if self._conn is not None:
                self._conn.rollback()
        except Exception:  # noqa: BLE001 - the connection is dropped instead
            self.cleanup_sink()

    def _write_isolating(
        self,
        cur: Any,
        rows: list[tuple[Any, ...] | None],
        idx: list[int],
        literals: pa.LargeStringArray | None = None,
    ) -> list[RowFailure]:
        """Write rows behind a savepoint; on a data error roll back to it and bisect."""
        import pymysql

        def attempt(sub: Sequence[int]) -> list[RowFailure]:
            # One savepoint name: setting it again moves it, so it always marks the start of
            # the current attempt, after every row already written in this transaction.
            if self._transactional:
                cur.execute("SAVEPOINT conveyor_sp")
            try:
                if literals is not None:
                    self._execute_literals(cur, literals.take(pa.array(sub, pa.int64())))
                else:
                    self._execute(cur, [rows[i] for i in sub])
            except pymysql.err.MySQLError as e:
                if self._transactional and classify_mysql_error(e) is ErrorKind.DATA:
                    cur.execute("ROLLBACK TO SAVEPOINT conveyor_sp")
                raise
            return []

        def rejection(e: Exception) -> str | None:
            if isinstance(e, pymysql.err.MySQLError) and classify_mysql_error(e) is ErrorKind.DATA:
                return error_text(e)
            return None

        return isolate_rows(idx, attempt, rejection, fail_fast=self.fail_fast)
