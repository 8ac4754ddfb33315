"""What an exception from pymysql means for the MySQL sink (``classify_mysql_error``, by the
server's error number first, as ``core/sink.py`` asks of every sink), and its message.
"""

from __future__ import annotations

from typing import Any

from conveyor.core.sink import ErrorKind

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
