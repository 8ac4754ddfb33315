"""Identifiers holding ``%`` and quotes in the SQL sinks, against the machine's PostgreSQL and
MariaDB (issue 45): schema, table, columns and ``offsets_table`` are quoted everywhere, and a
``%`` in them is doubled in every statement the driver %-formats (psycopg2 and pymysql read
``%`` as a placeholder in any statement executed with parameters), in both delivery modes and on
each write path (COPY, multi-row VALUES, upsert, delete of tombstones)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from conveyor.core.model import TopicPartition
from conveyor.core.positions import TargetBinding
from conveyor.sinks import build_sink
from tests.conftest import PG_URL
from tests.positions import offsets_of
from tests.sinks.contract import make_batch
from tests.sinks.test_mysql import MYSQL_URL
from tests.sinks.test_sql_exactly_once import mysql_connect

pytestmark = pytest.mark.integration

#: ``%s`` and ``%d`` read as placeholders, ``%"``/``%'`` as bad ones; quotes of every kind.
COLUMNS = {"i%d": "id", 'na"me': "name", "am'ount%s": "amount"}
KEY = "i%d"


class Postgres:
    """A schema ``s%"q'<tag>`` the sink creates; dropped after the test."""

    def __init__(self) -> None:
        import psycopg2

        self.tag = uuid.uuid4().hex[:8]
        self.schema = f"s%\"q'{self.tag}"
        self.conn = psycopg2.connect(PG_URL)
        self.conn.autocommit = True

    def config(self, table: str, offsets_table: str, **extra: Any) -> dict[str, Any]:
        return {
            "type": "postgres",
            "url": PG_URL,
            "schema": self.schema,
            "table": table,
            "offsets_table": offsets_table,
            **extra,
        }

    def col(self, name: str) -> str:
        return '"' + name.replace('"', '""') + '"'

    def ident(self, name: str) -> str:
        return f"{self.col(self.schema)}.{self.col(name)}"

    def run(self, text: str) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(text)  # no parameters: '%' is literal
            return cur.fetchall() if cur.description else []

    def close(self) -> None:
        self.run(f"DROP SCHEMA IF EXISTS {self.col(self.schema)} CASCADE")
        self.conn.close()


class MariaDB:
    """The database ``test``; the tables a test names are dropped after it."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:8]
        self.conn = mysql_connect()
        self.made: list[str] = []

    def config(self, table: str, offsets_table: str, **extra: Any) -> dict[str, Any]:
        self.made += [table, offsets_table]
        return {
            "type": "mysql",
            "url": MYSQL_URL,
            "table": table,
            "offsets_table": offsets_table,
            **extra,
        }

    def col(self, name: str) -> str:
        return "`" + name.replace("`", "``") + "`"

    ident = col

    def run(self, text: str) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(text)  # no parameters: '%' is literal
            return list(cur.fetchall()) if cur.description else []

    def close(self) -> None:
        for name in self.made:
            self.run(f"DROP TABLE IF EXISTS {self.ident(name)}")
        self.conn.close()


@pytest.fixture(params=["postgres", "mysql"])
def db(request: pytest.FixtureRequest) -> Iterator[Any]:
    target = Postgres() if request.param == "postgres" else MariaDB()
    try:
        yield target
    finally:
        target.close()


def rows(db: Any, table: str) -> list[tuple[Any, ...]]:
    cols = ", ".join(db.col(c) for c in COLUMNS)
    return sorted(db.run(f"SELECT {cols} FROM {db.ident(table)}"))


def offsets_rows(db: Any, offsets_table: str) -> list[tuple[Any, ...]]:
    part = '"partition"' if isinstance(db, Postgres) else "`partition`"
    return sorted(
        db.run(
            f"SELECT writer, topic, {part}, next_offset FROM {db.ident(offsets_table)} "
            f"WHERE {part} >= 0"
        )
    )


def with_tombstones(batch: pa.Table, rows_: set[int]) -> pa.Table:
    flags = [i in rows_ for i in range(batch.num_rows)]
    return batch.append_column("__tombstone", pa.array(flags, pa.bool_()))


WRITES = {
    "copy": {},
    "values": {"write_method": "values"},
    "upsert_and_delete": {"upsert_keys": [KEY], "delete_enabled": True},
}


@pytest.mark.parametrize(
    ("db", "write"),
    [*(("postgres", w) for w in sorted(WRITES)), ("mysql", "copy"), ("mysql", "upsert_and_delete")],
    indirect=["db"],
)  # the MySQL sink has one write method (multi-row INSERT): "copy" here
def test_identifiers_with_percent_and_quotes_write_and_commit_exactly_once(
    db: Any, write: str
) -> None:
    """``offsets_table: "off%sets"`` (the issue's case) and a table, schema and columns with
    ``%`` and quotes: rows and offsets commit together, a replay writes nothing, a new
    generation reads the offsets back; tombstones delete the rows they name."""
    table, offsets_table = f"o%r\"d'e`rs{db.tag}", f"off%sets{db.tag}"
    cfg = db.config(
        table, offsets_table, columns=COLUMNS, create_table=True, delivery="exactly_once",
        **WRITES[write],
    )  # fmt: skip
    sink = build_sink(cfg)
    sink.bind(TargetBinding("w%s@i'1", 1))
    sink.init_sink()
    try:
        assert sink.send_batch(make_batch(10)).failed == ()
        assert sink.send_batch(make_batch(10)).failed == ()  # a replay: covered
        assert sink.send_batch(make_batch(12)).failed == ()  # overlapping: 2 new rows
        expected = [(i, f"name {i}", i * 1.5) for i in range(12)]
        if write == "upsert_and_delete":
            batch = with_tombstones(make_batch(4, start=12), {1, 3})  # 13 and 15 never stay
            assert sink.send_batch(batch).failed == ()
            expected += [(12, "name 12", 18.0), (14, "name 14", 21.0)]
            assert sink.send_batch(with_tombstones(make_batch(1, start=16), {0})).failed == ()
        assert rows(db, table) == expected
        end = 17 if write == "upsert_and_delete" else 12
        assert offsets_rows(db, offsets_table) == [("w%s@i'1", "orders", 0, end)]
    finally:
        sink.cleanup_sink()
    again = build_sink(cfg)
    again.bind(TargetBinding("w%s@i'1", 2))
    assert offsets_of(again.target_offsets()) == {TopicPartition("orders", 0): end}


@pytest.mark.parametrize("write", ["copy", "upsert_and_delete"])
def test_identifiers_with_percent_and_quotes_write_at_least_once(db: Any, write: str) -> None:
    """The same names without an offsets table: every row each batch holds is written (a
    replay again: twice without upsert keys), tombstones delete."""
    table = f"o%r\"d'e`rs{db.tag}"
    cfg = db.config(
        table, f"off%sets{db.tag}", columns=COLUMNS, create_table=True,
        delivery="at_least_once", **WRITES[write],
    )  # fmt: skip
    sink = build_sink(cfg)
    sink.bind(TargetBinding("w", 1))
    sink.init_sink()
    try:
        assert sink.send_batch(make_batch(5)).failed == ()
        assert sink.send_batch(make_batch(5)).failed == ()
        once = [(i, f"name {i}", i * 1.5) for i in range(5)]
        if write == "copy":
            assert rows(db, table) == sorted(once * 2)
        else:
            assert sink.send_batch(with_tombstones(make_batch(2, start=3), {0, 1})).failed == ()
            assert rows(db, table) == once[:3]
        assert sink.target_offsets() is None
    finally:
        sink.cleanup_sink()
