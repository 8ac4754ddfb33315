"""PostgreSQL's side of the SQL sink besides the connection and the rows: what an exception from
psycopg2 means (``classify_postgres_error``, by SQLSTATE, as ``core/sink.py`` asks of every
sink), the column type of each Arrow type (``POSTGRES``, the dialect's type map), quoted names,
and the table's columns as information_schema describes them (``table_columns``).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from conveyor.core.sink import ErrorKind
from conveyor.sinks.sql import SqlDialect, TableColumn, percent_escaped

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
# The server going away or refusing more work: admin shutdown, crash shutdown, cannot
# connect now, too many connections.
_UNAVAILABLE = frozenset({"57P01", "57P02", "57P03", "53300"})
INSUFFICIENT_PRIVILEGE = "42501"
UNDEFINED_TABLE = "42P01"


def classify_postgres_error(exc: BaseException, *, connecting: bool = False) -> ErrorKind | None:
    """What an exception from psycopg2 means for the row / batch (by SQLSTATE first); None
    for an exception that is not psycopg2's. ``connecting``: raised by ``psycopg2.connect``."""
    if isinstance(exc, ValueError) and "NUL" in str(exc):
        # psycopg2 refuses a NUL character in a literal before sending anything (COPY
        # sends it and the server answers 22021): the row's content.
        return ErrorKind.DATA
    import psycopg2

    if not isinstance(exc, psycopg2.Error):
        return None
    code = getattr(exc, "pgcode", None) or ""
    if connecting and isinstance(exc, psycopg2.OperationalError):
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if any(p in text for p in _PERMANENT_CONNECT_ERRORS):
            return ErrorKind.PERMANENT
        return ErrorKind.TRANSIENT
    if code == "55000":
        # object not in prerequisite state (ON CONFLICT on a deferrable unique constraint):
        # psycopg2 files it as an OperationalError, but no retry changes the table.
        return ErrorKind.PERMANENT
    if code[:2] in ("22", "23"):
        return ErrorKind.DATA
    if code in _UNAVAILABLE or isinstance(
        exc, (psycopg2.OperationalError, psycopg2.InterfaceError)
    ):
        return ErrorKind.TRANSIENT
    return ErrorKind.PERMANENT


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


def formatted(cur: Any, part: Any) -> str:
    """A ``psycopg2.sql`` part (identifiers, keywords; no placeholder) as text for a statement
    psycopg2 %-formats (``execute_values``, ``execute_batch``): its ``%`` doubled."""
    return percent_escaped(part.as_string(cur))


def pg_name(schema: str, table: str) -> str:
    """``"schema"."table"``, quoted as ``psycopg2.sql.Identifier`` quotes it (without a connection)."""
    return ".".join('"' + part.replace('"', '""') + '"' for part in (schema, table))


POSTGRES = SqlDialect("postgres", lambda t, key: _pg_type(t), "jsonb", frozenset({"$payload"}))


def table_columns(cur: Any, schema: str, table: str) -> dict[str, TableColumn]:
    """The columns of ``schema.table`` (none when there is no such table), read on ``cur``."""
    cur.execute(
        "SELECT column_name, data_type, is_nullable, column_default, is_identity, is_generated, "
        "numeric_precision, numeric_scale, datetime_precision FROM information_schema.columns "
        "WHERE table_schema = %s AND table_name = %s ORDER BY ordinal_position",
        (schema, table),
    )
    return {
        name: TableColumn(
            name,
            str(typ).lower(),
            nullable=nullable == "YES",
            has_default=default is not None or identity == "YES" or generated == "ALWAYS",
            precision=precision if str(typ) == "numeric" else None,
            scale=scale if str(typ) == "numeric" else None,
            fraction_digits=fraction,
        )
        for name, typ, nullable, default, identity, generated, precision, scale, fraction in (
            cur.fetchall()
        )
    }
