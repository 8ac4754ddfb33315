"""Tables that evolve (``auto_evolve``, issue 36 point 4) in the SQL sinks, against the
machine's PostgreSQL and MariaDB: a missing table created with exact types, a new field
adding a column in the running sink, narrowing and a removed required column refused naming
the column, two sinks adding one column at once, and the default (off) left as it was."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import psycopg2
import pyarrow as pa
import pymysql
import pytest

from conveyor.core.errors import PermanentSinkError
from conveyor.sinks import build_sink
from conveyor.sinks.base import Sink
from tests.conftest import PG_URL
from tests.sinks.contract import make_batch, unique

pytestmark = pytest.mark.integration

SCHEMA = "conveyor_evolve"
MYSQL_URL = os.environ.get("CONVEYOR_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
META = ["__topic", "__partition", "__offset", "__timestamp", "__key", "__headers"]


class Db:
    """One database under test: its statements, its sink config and its table's columns."""

    name: str

    def connect(self, autocommit: bool = True) -> Any:
        raise NotImplementedError

    def table_ref(self, table: str) -> str:
        raise NotImplementedError

    def sink_config(self, table: str) -> dict[str, Any]:
        raise NotImplementedError

    def column_types(self, table: str) -> dict[str, str]:
        raise NotImplementedError

    def waiting_alters(self, table: str) -> int:
        """Sessions whose ALTER TABLE on ``table`` waits for a lock."""
        raise NotImplementedError

    def execute(self, sql: str, *args: Any, fetch: bool = False) -> list[tuple[Any, ...]]:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(sql, args or None)
                return list(cur.fetchall()) if fetch else []
        finally:
            conn.close()

    def select(self, table: str, columns: str) -> list[tuple[Any, ...]]:
        return self.execute(
            f"SELECT {columns} FROM {self.table_ref(table)} ORDER BY id", fetch=True
        )


class Postgres(Db):
    name = "postgres"

    def connect(self, autocommit: bool = True) -> Any:
        conn = psycopg2.connect(PG_URL)
        conn.autocommit = autocommit
        return conn

    def table_ref(self, table: str) -> str:
        return f'"{SCHEMA}"."{table}"'

    def sink_config(self, table: str) -> dict[str, Any]:
        return {"type": "postgres", "url": PG_URL, "schema": SCHEMA, "table": table}

    def column_types(self, table: str) -> dict[str, str]:
        rows = self.execute(
            "SELECT attname, format_type(atttypid, atttypmod), attnotnull FROM pg_attribute "
            "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            self.table_ref(table),
            fetch=True,
        )
        return {n: t + (" not null" if not_null else "") for n, t, not_null in rows}

    def waiting_alters(self, table: str) -> int:
        rows = self.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
            f"ALTER TABLE %{table}%",
            fetch=True,
        )
        return int(rows[0][0])


class MariaDb(Db):
    name = "mysql"

    def connect(self, autocommit: bool = True) -> Any:
        kw = build_sink(self.sink_config("x")).connect_kwargs()  # type: ignore[attr-defined]
        kw.update(autocommit=autocommit)
        return pymysql.connect(**kw)

    def table_ref(self, table: str) -> str:
        return f"`{table}`"

    def sink_config(self, table: str) -> dict[str, Any]:
        return {"type": "mysql", "url": MYSQL_URL, "table": table}

    def column_types(self, table: str) -> dict[str, str]:
        rows = self.execute(
            "SELECT COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() "
            "AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
            table,
            fetch=True,
        )
        return {n: t + ("" if nullable == "YES" else " not null") for n, t, nullable in rows}

    def waiting_alters(self, table: str) -> int:
        rows = self.execute(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE STATE = 'Waiting for table metadata lock' "
            "AND INFO LIKE %s",
            f"ALTER TABLE `{table}`%",
            fetch=True,
        )
        return int(rows[0][0])


@pytest.fixture(params=[Postgres(), MariaDb()], ids=lambda d: d.name)
def db(request: pytest.FixtureRequest) -> Db:
    d: Db = request.param
    if isinstance(d, Postgres):
        d.execute(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
    return d


@pytest.fixture
def table(db: Db) -> Iterator[str]:
    name = unique("evolve")
    yield name
    db.execute(f"DROP TABLE IF EXISTS {db.table_ref(name)}")


@pytest.fixture
def sinks() -> Iterator[Callable[..., Sink]]:
    """Builds and starts sinks, and closes every one of them at the end."""
    started: list[Sink] = []

    def start(db: Db, table: str, **cfg: Any) -> Sink:
        sink = build_sink(db.sink_config(table) | cfg)
        sink.init_sink()
        started.append(sink)
        return sink

    yield start
    for s in started:
        s.cleanup_sink()


def batch(ids: list[int], **columns: pa.Array) -> pa.Table:
    """A decoded batch of messages ``ids``: ``columns`` as its payload, then the message columns."""
    meta = make_batch(len(ids), start=ids[0]).select(META)
    payload = pa.table({"id": pa.array(ids, pa.int64()), **columns})
    for name in META:
        payload = payload.append_column(name, meta.column(name))
    return payload


def names(ids: list[int], prefix: str = "name") -> pa.Array:
    return pa.array([f"{prefix} {i}" for i in ids], pa.string())


# -- a missing table, created with exact types --------------------------------------------------

UTC = dt.timezone.utc
DOC = pa.struct([("a", pa.int64()), ("tags", pa.list_(pa.string()))])
TYPED = {
    "amount": pa.array([Decimal("12345678.90"), Decimal("-0.01")], pa.decimal128(12, 2)),
    "at": pa.array(
        [dt.datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC), None], pa.timestamp("us", "UTC")
    ),
    "local": pa.array([dt.datetime(2024, 5, 1, 23, 59, 59, 654321)] * 2, pa.timestamp("us")),
    "day": pa.array([dt.date(2024, 2, 29), dt.date(1970, 1, 1)], pa.date32()),
    "clock": pa.array([dt.time(13, 14, 15, 161718), dt.time(0, 0)], pa.time64("us")),
    "doc": pa.array([{"a": 1, "tags": ["x", "y"]}, {"a": None, "tags": []}], DOC),
    "attrs": pa.array([[("k", 1), ("j", 2)], None], pa.map_(pa.string(), pa.int64())),
    "raw": pa.array([b"\x00\xff\\", b""], pa.binary()),
    "ok": pa.array([True, False], pa.bool_()),
    "tiny": pa.array([-128, 127], pa.int8()),
    "small": pa.array([-32768, 32767], pa.int16()),
    "medium": pa.array([-(2**31), 2**31 - 1], pa.int32()),
    "big": pa.array([2**64 - 1, 0], pa.uint64()),
    "f32": pa.array([1.5, -0.25], pa.float32()),
    "f64": pa.array([0.1, 1e300], pa.float64()),
    "label": pa.array(["tab\there", "ünï"], pa.string()),
}
TYPES = {
    "postgres": {
        "id": "bigint",
        "amount": "numeric(12,2)",
        "at": "timestamp with time zone",
        "local": "timestamp without time zone",
        "day": "date",
        "clock": "time without time zone",
        "doc": "jsonb",
        "attrs": "jsonb",
        "raw": "bytea",
        "ok": "boolean",
        "tiny": "smallint",
        "small": "smallint",
        "medium": "integer",
        "big": "numeric(20,0)",
        "f32": "real",
        "f64": "double precision",
        "label": "text",
    },
    "mysql": {
        "id": "bigint(20)",
        "amount": "decimal(12,2)",
        "at": "datetime(6)",
        "local": "datetime(6)",
        "day": "date",
        "clock": "time(6)",
        "doc": "longtext",  # MariaDB's JSON is LONGTEXT with a json_valid check
        "attrs": "longtext",
        "raw": "longblob",
        "ok": "tinyint(1)",
        "tiny": "tinyint(4)",
        "small": "smallint(6)",
        "medium": "int(11)",
        "big": "bigint(20) unsigned",
        "f32": "float",
        "f64": "double",
        "label": "longtext",
    },
}


def test_a_missing_table_is_created_with_exact_types_and_contents(db: Db, table: str, sinks):
    sink = sinks(db, table, create_table=True, auto_evolve=True)
    assert sink.send_batch(batch([1, 2], **TYPED)).failed == ()
    assert db.column_types(table) == TYPES[db.name]
    rows = db.select(table, ", ".join(["id", *TYPED]))
    got = [dict(zip(["id", *TYPED], r, strict=True)) for r in rows]
    for row in got:  # each database's Python values, normalised
        row["raw"] = bytes(row["raw"])
        for c in ("doc", "attrs"):
            row[c] = json.loads(row[c]) if isinstance(row[c], str) else row[c]
        if db.name == "mysql":  # UTC wall time in DATETIME; TIME as a timedelta; BOOLEAN 0/1
            row["at"] = row["at"] and row["at"].replace(tzinfo=UTC)
            row["clock"] = (dt.datetime.min + row["clock"]).time()
            row["ok"] = bool(row["ok"])
    assert got == [
        {
            "id": 1,
            "amount": Decimal("12345678.90"),
            "at": dt.datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC),
            "local": dt.datetime(2024, 5, 1, 23, 59, 59, 654321),
            "day": dt.date(2024, 2, 29),
            "clock": dt.time(13, 14, 15, 161718),
            "doc": {"a": 1, "tags": ["x", "y"]},
            "attrs": {"k": 1, "j": 2},
            "raw": b"\x00\xff\\",
            "ok": True,
            "tiny": -128,
            "small": -32768,
            "medium": -(2**31),
            "big": 2**64 - 1,
            "f32": 1.5,
            "f64": 0.1,
            "label": "tab\there",
        },
        {
            "id": 2,
            "amount": Decimal("-0.01"),
            "at": None,
            "local": dt.datetime(2024, 5, 1, 23, 59, 59, 654321),
            "day": dt.date(1970, 1, 1),
            "clock": dt.time(0, 0),
            "doc": {"a": None, "tags": []},
            "attrs": None,
            "raw": b"",
            "ok": False,
            "tiny": 127,
            "small": 32767,
            "medium": 2**31 - 1,
            "big": 0,
            "f32": -0.25,
            "f64": 1e300,
            "label": "ünï",
        },
    ]


# -- a new field adds a column, without a restart -----------------------------------------------


@pytest.mark.parametrize("upsert", [False, True], ids=["insert", "upsert"])
def test_a_new_field_adds_a_nullable_column_in_the_running_sink(db: Db, table: str, sinks, upsert):
    cfg: dict[str, Any] = {"create_table": True, "auto_evolve": True}
    if upsert:
        cfg["upsert_keys"] = ["id"]
    sink = sinks(db, table, **cfg)
    assert sink.send_batch(batch([1, 2], name=names([1, 2]))).failed == ()
    assert list(db.column_types(table)) == ["id", "name"]
    # The writer schema gains an optional field: the same sink adds the column and writes it.
    emails = pa.array(["c@x", None], pa.string())
    tags = pa.array([["a"], ["b", "c"]], pa.list_(pa.string()))
    assert sink.send_batch(batch([3, 4], name=names([3, 4]), email=emails, tags=tags)).failed == ()
    types = db.column_types(table)
    assert list(types) == ["id", "name", "email", "tags"]
    assert types["email"] == ("text" if db.name == "postgres" else "longtext")
    assert types["tags"] == ("jsonb" if db.name == "postgres" else "longtext")
    # A batch of the old schema again (the optional field dropped): its rows get NULL there.
    assert sink.send_batch(batch([5], name=names([5]))).failed == ()
    rows = [
        (i, n, e, json.loads(t) if isinstance(t, str) else t)
        for i, n, e, t in db.select(table, "id, name, email, tags")
    ]
    assert rows == [
        (1, "name 1", None, None),
        (2, "name 2", None, None),
        (3, "name 3", "c@x", ["a"]),
        (4, "name 4", None, ["b", "c"]),
        (5, "name 5", None, None),
    ]


def test_a_configured_mapping_adds_only_its_columns(db: Db, table: str, sinks):
    """With ``columns``, a new payload field outside it is not added; a mapped target the
    table lacks is."""
    db.execute(f"CREATE TABLE {db.table_ref(table)} (id BIGINT, name TEXT)")
    sink = sinks(
        db, table, auto_evolve=True, columns={"id": "id", "name": "name", "off": "$offset"}
    )
    assert sink.send_batch(batch([7], name=names([7]), email=pa.array(["e"]))).failed == ()
    assert list(db.column_types(table)) == ["id", "name", "off"]
    assert db.select(table, "id, name, off") == [(7, "name 7", 7)]


def test_off_by_default_a_missing_column_is_refused_and_a_new_field_dropped(
    db: Db, table: str, sinks
):
    db.execute(f"CREATE TABLE {db.table_ref(table)} (id BIGINT, name TEXT)")
    sink = sinks(db, table)
    with pytest.raises(PermanentSinkError, match=r"has no column\(s\) email"):
        sink.send_batch(batch([1], name=names([1]), email=pa.array(["e"])))
    other = sinks(db, table)
    assert other.send_batch(batch([1], name=names([1]))).failed == ()
    # Resolved on the first batch: a later field is not written and no column is added.
    assert other.send_batch(batch([2], name=names([2]), email=pa.array(["e"]))).failed == ()
    assert list(db.column_types(table)) == ["id", "name"]
    assert db.select(table, "id, name") == [(1, "name 1"), (2, "name 2")]


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "kind"),
    [
        (pa.array([Decimal("1.50")], pa.decimal128(10, 2)), "decimal128"),
        (pa.array(["12"], pa.string()), "string"),
        (pa.array([1], pa.int64()), "int64"),  # into a 32-bit column
    ],
    ids=["decimal", "string", "wider-integer"],
)
def test_narrowing_is_refused_naming_the_column_and_nothing_is_altered(
    db: Db, table: str, sinks, values: pa.Array, kind: str
):
    db.execute(f"CREATE TABLE {db.table_ref(table)} (id BIGINT, qty INTEGER, name TEXT)")
    before = db.column_types(table)
    sink = sinks(db, table, auto_evolve=True)
    assert sink.send_batch(batch([1], qty=pa.array([5], pa.int32()), name=names([1]))).failed == ()
    with pytest.raises(PermanentSinkError) as err:
        sink.send_batch(batch([2], qty=values, name=names([2]), email=pa.array(["e"])))
    msg = str(err.value)
    assert f"{table}" in msg and "column qty" in msg and kind in msg and "narrowing" in msg
    assert db.column_types(table) == before  # nothing added (email neither), nothing retyped
    assert db.select(table, "id, qty") == [(1, 5)]


def test_a_missing_not_null_column_is_refused_naming_it(db: Db, table: str, sinks):
    db.execute(
        f"CREATE TABLE {db.table_ref(table)} (id BIGINT, name TEXT, code TEXT NOT NULL, "
        "n INTEGER NOT NULL DEFAULT 0)"
    )
    sink = sinks(db, table, auto_evolve=True)
    code = pa.array(["c"], pa.string())
    assert sink.send_batch(batch([1], name=names([1]), code=code)).failed == ()
    # The required field leaves the schema: refused, naming it (n has a default: not named).
    with pytest.raises(
        PermanentSinkError, match=r"NOT NULL column\(s\) without a default.*: code \("
    ) as err:
        sink.send_batch(batch([2], name=names([2])))
    assert table in str(err.value)
    assert db.select(table, "id, code, n") == [(1, "c", 0)]


# -- two sinks adding one column at once --------------------------------------------------------


def test_two_sinks_adding_the_same_column_at_once_both_succeed(db: Db, table: str, sinks, caplog):
    """Both sinks pass their check (the table lacks the column), then wait behind a third
    session's lock; released, one adds it and the other finds it there (PostgreSQL's IF NOT
    EXISTS; MySQL's duplicate-column error, counted as done)."""
    db.execute(f"CREATE TABLE {db.table_ref(table)} (id BIGINT, name TEXT)")
    first, second = (sinks(db, table, auto_evolve=True) for _ in range(2))
    for s, i in ((first, 1), (second, 2)):
        assert s.send_batch(batch([i], name=names([i]))).failed == ()
    blocker = db.connect(autocommit=False)
    errors: list[BaseException] = []

    def send(sink: Sink, i: int) -> None:
        try:
            assert (
                sink.send_batch(batch([i], name=names([i]), email=pa.array([f"{i}@x"]))).failed
                == ()
            )
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=send, args=(s, i)) for s, i in ((first, 3), (second, 4))]
    caplog.set_level(logging.INFO, logger=f"conveyor.sinks.{db.name}")
    try:
        with blocker.cursor() as cur:  # a reader's open transaction holds the table
            cur.execute(f"SELECT * FROM {db.table_ref(table)}")
            cur.fetchall()
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while db.waiting_alters(table) < 2:
            assert time.monotonic() < deadline, "the two ALTER TABLE statements never waited"
            assert not errors, errors
            time.sleep(0.05)
    finally:
        blocker.rollback()
        blocker.close()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert list(db.column_types(table)) == ["id", "name", "email"]
    assert db.select(table, "id, email") == [(1, None), (2, None), (3, "3@x"), (4, "4@x")]
    if db.name == "mysql":  # one ALTER added it; the other's was the duplicate
        added = [r for r in caplog.records if "added column" in r.getMessage()]
        assert len(added) == 1, [r.getMessage() for r in added]
