"""What information_schema says of the MySQL sink's table: its columns (``TableColumn``), its
engine and whether that engine is transactional, the server's ``max_allowed_packet``, and the
table's unique indexes (``unique_indexes``: what ON DUPLICATE KEY fires on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.sinks.sql import TableColumn


@dataclass(frozen=True)
class TableFacts:
    """The table as described on the sink's connection (``describe_table``)."""

    columns: dict[str, TableColumn]
    engine: str | None  # None: there is no such table
    transactional: bool  # its engine's (True for a table yet to be created: InnoDB)
    max_packet: int  # the server's max_allowed_packet


def describe_table(cur: Any, table: str) -> TableFacts:
    """The table ``table`` of the connection's database, read on ``cur``."""
    cur.execute(
        "SELECT COLUMN_NAME, DATA_TYPE, IS_NULLABLE, COLUMN_DEFAULT, EXTRA, COLUMN_TYPE, NUMERIC_PRECISION, "
        "NUMERIC_SCALE, DATETIME_PRECISION FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() "
        "AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
        (table,),
    )
    columns = {row[0]: table_column(*row) for row in cur.fetchall()}
    cur.execute(
        "SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
        (table,),
    )
    row = cur.fetchone()
    cur.execute("SELECT ENGINE, TRANSACTIONS FROM information_schema.ENGINES")
    engines = {str(e).upper(): t == "YES" for e, t in cur.fetchall()}
    cur.execute("SELECT @@max_allowed_packet")
    max_packet = int(cur.fetchone()[0])
    engine = None if row is None else str(row[0])
    transactional = engine is None or engines.get(engine.upper(), True)
    return TableFacts(columns, engine, transactional, max_packet)


def unique_indexes(cur: Any, table: str) -> dict[str, list[str]]:
    """The table's PRIMARY KEY and UNIQUE indexes: name -> its columns, in order."""
    cur.execute(
        "SELECT INDEX_NAME, COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s "
        "AND NON_UNIQUE = 0 ORDER BY INDEX_NAME, SEQ_IN_INDEX",
        (table,),
    )
    unique: dict[str, list[str]] = {}
    for index, col in cur.fetchall():
        unique.setdefault(index, []).append(col)
    return unique


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
