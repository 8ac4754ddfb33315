"""MySQL's SQL text for the MySQL sink, pure functions without a connection: identifiers
(backtick-quoted, embedded backticks doubled), the INSERT / upsert, CREATE and ALTER
statements, the column type of each Arrow type (``MYSQL``, the dialect's type map), and the
values and literals of a batch's columns built by Arrow exactly as pymysql's escaping writes
them (``literal_column``, ``row_literals``, ``literal_statements``).
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from conveyor.sinks.sql import (
    SqlDialect,
    percent_escaped,
)

#: The session's sql_mode, set in full: strict for every engine, and without
#: NO_BACKSLASH_ESCAPES / ANSI_QUOTES, which pymysql's escaping and our backticks rely on.
SQL_MODE = "STRICT_ALL_TABLES,NO_ZERO_IN_DATE,NO_ZERO_DATE,ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION"

MAX_IDENTIFIER = 64


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


def percent_quoted(name: str) -> str:
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


INTEGER_TYPES = frozenset({"tinyint", "smallint", "mediumint", "int", "integer", "bigint"})
NUMERIC_TYPES = INTEGER_TYPES | {"decimal", "numeric", "float", "double", "real"}
