"""The PostgreSQL polling source loses nothing: late-committing transactions, destructive
commits by key and row version, equal timestamps, a crash between produce and commit.

The source-level tests drive poll/commit the way the loop does (tests/integration/
sources_harness.py drives the whole loop: Spark, routing, tansu, the meta store)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import psycopg2
import pytest

from conveyor.core.errors import ConfigError
from conveyor.sources import build_source
from conveyor.sources.base import Polled, Source
from conveyor.sources.postgres_polling import (
    PostgresPollingConfig,
    PostgresPollingSource,
    recent_xmin,
)
from tests.integration.sources_harness import (
    build_loop,
    claimed_store,
    read_topic,
    running,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def db(pg_url: str, pg_schema: str) -> Iterator[Any]:
    """An autocommit connection and a queue table ``<schema>.q`` (serial key, done flag)."""
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{pg_schema}".q (id serial PRIMARY KEY, body text, '
            "at timestamptz NOT NULL DEFAULT now(), done boolean NOT NULL DEFAULT false)"
        )
    yield conn
    conn.close()


def sql1(conn: Any, q: str, args: tuple[Any, ...] = ()) -> Any:
    with conn.cursor() as cur:
        cur.execute(q, args)
        return cur.fetchone()[0] if cur.description else None


def source(pg_url: str, table: str, **extra: Any) -> Source:
    s = build_source(
        {"type": "postgres_polling", "url": pg_url, "table": table, "incrementing_column": "id"}
        | extra
    )
    s.validate()
    return s


def ids(polled: Polled | None) -> list[int]:
    return [] if polled is None else [json.loads(m.payload or b"")["id"] for m in polled.messages]


# -- the visibility horizon (non-destructive) ------------------------------------------


def test_an_open_transaction_holds_back_the_rows_committed_after_it(pg_url, pg_schema, db):
    """Writer B takes id n and stays open while A commits n+1..n+3: a poll returns the rows
    below n only (the state does not move past n); once B commits, n and the rest follow."""
    t = f"{pg_schema}.q"
    db.cursor().execute(f"INSERT INTO {t} (body) SELECT 'a' FROM generate_series(1, 5)")
    src = source(pg_url, t)
    src.init(None)
    b = psycopg2.connect(pg_url)
    try:
        held = sql1(b, f"INSERT INTO {t} (body) VALUES ('late') RETURNING id")
        db.cursor().execute(f"INSERT INTO {t} (body) SELECT 'a' FROM generate_series(1, 3)")
        first = src.poll(None, 100, 0.3)
        assert ids(first) == [1, 2, 3, 4, 5]
        assert first is not None and first.state == {"last": {"id": 5}}
        assert src.poll(first.state, 100, 0.3) is None  # 7..9 are committed, held back
        b.commit()
    finally:
        b.close()
    assert held == 6
    assert ids(src.poll(first.state, 100, 0.3)) == [6, 7, 8, 9]
    src.close()


def test_the_horizon_ignores_other_rows_and_frozen_rows(pg_url, pg_schema, db):
    """VACUUM FREEZE keeps a row's raw xmin: frozen rows are read, and commit finds them by
    their row version."""
    t = f"{pg_schema}.q"
    db.cursor().execute(f"INSERT INTO {t} (body) SELECT 'a' FROM generate_series(1, 4)")
    db.cursor().execute(f"VACUUM FREEZE {t}")
    src = source(pg_url, t, delete_after_read=True, destructive=True)
    src.init(None)
    polled = src.poll(None, 100, 0.3)
    assert ids(polled) == [1, 2, 3, 4]
    assert polled is not None
    src.commit(polled.state)
    assert sql1(db, f"SELECT count(*) FROM {t}") == 0
    src.close()


@pytest.mark.parametrize(
    ("xmin", "lo", "hi", "recent"),
    [
        (4294967294, 4294967293, 4294967301, True),  # running window spans the wrap: before it
        (4, 4294967293, 4294967301, True),  # ... and after it (epoch 1, low bits 4)
        (4294967290, 4294967293, 4294967301, False),  # older than the snapshot's xmin
        (100, 4294967293, 4294967301, False),  # frozen, epochs old: reads as the future, is old
        (2, 4294967293, 4294967301, False),  # FrozenTransactionId
        (1500, 1000, 1000, False),  # nothing running: every visible row is old
        (999, 1000, 1010, False),
        (1000, 1000, 1010, True),
        (1009, 1000, 1010, True),
        (1010 + (5 << 32) - (1 << 32), 1000 + (5 << 32), 1010 + (5 << 32), False),
    ],
)
def test_recent_xmin_across_xid_wraparound(db, xmin, lo, hi, recent):
    """The horizon's arithmetic on xid8 snapshot bounds and 32-bit row xmins, evaluated by
    PostgreSQL itself (the same SQL the source runs)."""
    from psycopg2 import sql

    low = xmin % (1 << 32)
    q = sql.SQL("SELECT {}").format(recent_xmin(sql.Literal(low), sql.Literal(lo), sql.Literal(hi)))
    with db.cursor() as cur:
        cur.execute(q)
        assert cur.fetchone()[0] is recent


def test_the_horizon_across_xid_wraparound():
    """A private cluster whose next xid is 2^32 - 100. Writer B takes an id just before the
    wrap and stays open; after 150 more xids A writes 200 rows, whose 32-bit xmins wrap to
    small numbers (a plain xmin < snapshot-xmin comparison would read past B's row). They
    are held back until B commits; then frozen rows are read from scratch and a destructive
    source deletes every row by its (wrapped) row version."""
    from tests.integration.pg_cluster import private_cluster

    with private_cluster(next_xid=(1 << 32) - 100) as url:
        conn = psycopg2.connect(url)
        conn.autocommit = True
        conn.cursor().execute(
            "CREATE TABLE q (id serial PRIMARY KEY, body text, at timestamptz NOT NULL "
            "DEFAULT now(), done boolean NOT NULL DEFAULT false)"
        )
        conn.cursor().execute("INSERT INTO q (body) SELECT 'a' FROM generate_series(1, 5)")
        src = source(url, "public.q")
        src.init(None)
        b = psycopg2.connect(url)
        try:
            held = sql1(b, "INSERT INTO q (body) VALUES ('late') RETURNING id")
            for _ in range(150):  # past the wrap: each takes an xid
                sql1(conn, "SELECT pg_current_xact_id()")
            for _ in range(200):
                conn.cursor().execute("INSERT INTO q (body) VALUES ('a')")
            # Every row after B's has a wrapped xmin, below the snapshot xmin's low 32 bits.
            assert sql1(conn, "SELECT max(xmin::text::bigint) FROM q WHERE id > 6") < 1000
            first = src.poll(None, 500, 0.3)
            assert ids(first) == [1, 2, 3, 4, 5] and held == 6 and first is not None
            assert src.poll(first.state, 500, 0.3) is None
            b.commit()
        finally:
            b.close()
        assert ids(src.poll(first.state, 500, 0.3)) == list(range(6, 207))
        conn.cursor().execute("VACUUM FREEZE q")
        b = psycopg2.connect(url)  # an open transaction while frozen rows are read
        try:
            sql1(b, "INSERT INTO q (body) VALUES ('open') RETURNING id")
            assert ids(src.poll(None, 500, 0.3)) == list(range(1, 207))
        finally:
            b.rollback()
            b.close()
        src.close()
        dst = source(url, "public.q", delete_after_read=True, destructive=True)
        dst.init(None)
        polled = dst.poll(None, 500, 0.3)
        assert ids(polled) == list(range(1, 207)) and polled is not None
        dst.commit(polled.state)
        assert sql1(conn, "SELECT count(*) FROM q") == 0
        dst.close()
        conn.close()


# -- destructive commits: exactly the rows read -----------------------------------------


def test_a_crash_between_produce_and_commit_deletes_nothing_unread(pg_url, pg_schema, db):
    """The batch is produced and its state stored, then the process dies before commit.
    Meanwhile a transaction that took a lower id commits, a row read is updated, new rows
    arrive. The next run polls (none of the stored rows again), runs the owed commit, and
    runs it once more: only the rows read, in the version read, are deleted."""
    t = f"{pg_schema}.q"
    b = psycopg2.connect(pg_url)
    try:
        late = sql1(b, f"INSERT INTO {t} (body) VALUES ('late') RETURNING id")
        db.cursor().execute(f"INSERT INTO {t} (body) SELECT 'a' FROM generate_series(1, 5)")
        first = source(pg_url, t, delete_after_read=True, destructive=True)
        first.init(None)
        polled = first.poll(None, 100, 0.3)
        assert ids(polled) == [2, 3, 4, 5, 6] and late == 1
        assert polled is not None
        stored = json.loads(json.dumps(polled.state))  # what the meta store keeps
        first.close()  # the crash: no commit
        b.commit()
    finally:
        b.close()
    db.cursor().execute(f"UPDATE {t} SET body = 'changed' WHERE id = 4")
    db.cursor().execute(f"INSERT INTO {t} (body) VALUES ('new')")
    again = source(pg_url, t, delete_after_read=True, destructive=True)
    again.init(stored)
    nxt = again.poll(stored, 100, 0.3)
    assert ids(nxt) == [1, 4, 7]  # the late row, the changed row, the new one; not 2, 3, 5, 6
    again.commit(stored)
    again.commit(stored)  # re-run after a crash of the commit itself: touches nothing more
    left = f"SELECT array_agg(id ORDER BY id) FROM {t}"
    assert sql1(db, left) == [1, 4, 7]
    assert nxt is not None
    again.commit(nxt.state)
    assert sql1(db, left) is None
    again.close()


class _Crash(BaseException):
    """Stands for the process dying (kill -9) right after the batch's state was stored."""


class _CrashBeforeCommit(PostgresPollingSource):
    """The real source, dying where its commit would start."""

    def commit(self, state: dict[str, Any]) -> None:
        raise _Crash


def test_a_crash_before_commit_through_the_loop(
    tmp_path, tansu, spark_remote, pg_url, pg_schema, db
):
    """Through the loop (Spark, tansu, the meta store): the first run produces a batch,
    stores its state and dies before commit, while a transaction holding a lower id is
    open. Then that row commits, a row read is changed, a new row arrives. The next run
    owes the commit: nothing unread is deleted, the batch is not produced again (only the
    changed row, in its new version), the table ends empty."""
    t = f"{pg_schema}.q"
    name = f"src_{uuid.uuid4().hex[:6]}"
    topic = f"{name}.q"
    cfg = {
        "type": "postgres_polling",
        "url": pg_url,
        "table": t,
        "incrementing_column": "id",
        "destination": topic,
        "destructive": True,
        "delete_after_read": True,
    }
    spec = {"name": name, "source": cfg, "batch": {"max_records": 50, "max_wait_ms": 100}}
    store, gen = claimed_store(tmp_path, name)
    b = psycopg2.connect(pg_url)
    try:
        assert sql1(b, f"INSERT INTO {t} (body) VALUES ('late') RETURNING id") == 1
        db.cursor().execute(f"INSERT INTO {t} (body) SELECT 'a' FROM generate_series(1, 5)")
        crashing = _CrashBeforeCommit(PostgresPollingConfig.model_validate(cfg))
        loop = build_loop(
            spec,
            store=store,
            generation=gen,
            bootstrap=tansu,
            spark_remote=spark_remote,
            source=crashing,
        )
        with pytest.raises(_Crash), running(loop):
            wait_for(lambda: store.source_state(name) is not None, what="the batch stored")
        assert [r[0] for r in store.source_state(name)[1]["read"]] == [2, 3, 4, 5, 6]
        assert sql1(db, f"SELECT count(*) FROM {t}") == 5  # nothing deleted
        b.commit()
    finally:
        b.close()
    db.cursor().execute(f"UPDATE {t} SET body = 'changed' WHERE id = 3")
    db.cursor().execute(f"INSERT INTO {t} (body) VALUES ('new')")
    loop = build_loop(spec, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(lambda: sql1(db, f"SELECT count(*) FROM {t}") == 0, what="every row deleted")
    got = [
        (v["id"], v["body"]) for v in map(json.loads, (m.value for m in read_topic(tansu, topic)))
    ]
    assert got[:5] == [(2, "a"), (3, "a"), (4, "a"), (5, "a"), (6, "a")]
    assert sorted(got[5:]) == [(1, "late"), (3, "changed"), (7, "new")]


def test_processed_column_marks_only_the_rows_read(pg_url, pg_schema, db):
    t = f"{pg_schema}.q"
    db.cursor().execute(f"INSERT INTO {t} (body) SELECT 'a' FROM generate_series(1, 3)")
    src = source(pg_url, t, processed_column="done", destructive=True)
    src.init(None)
    polled = src.poll(None, 2, 0.3)
    assert ids(polled) == [1, 2] and polled is not None
    db.cursor().execute(f"UPDATE {t} SET body = 'changed' WHERE id = 2")
    src.commit(polled.state)
    src.commit(polled.state)
    assert sql1(db, f"SELECT array_agg(id ORDER BY id) FROM {t} WHERE done") == [1]
    # Row 2 changed after it was read: not marked, read again (its new version).
    assert ids(src.poll(polled.state, 10, 0.3)) == [2, 3]
    src.close()


# -- keys and config --------------------------------------------------------------------


def test_a_key_is_required_where_order_or_commits_need_one(pg_url, pg_schema, db):
    t = f"{pg_schema}.nokey"
    db.cursor().execute(f"CREATE TABLE {t} (n int, at timestamptz, u int NOT NULL UNIQUE, m int)")
    ts = {"incrementing_column": None, "timestamp_column": "at"}
    with pytest.raises(ConfigError, match=r"source\.unique_key: .* no primary key"):
        source(pg_url, t, **ts).init(None)
    with pytest.raises(ConfigError, match=r"source\.unique_key: .* no primary key"):
        source(pg_url, t, incrementing_column="n", delete_after_read=True, destructive=True).init(
            None
        )
    with pytest.raises(ConfigError, match=r"source\.unique_key: .* may be NULL"):
        source(pg_url, t, unique_key=["m"], **ts).init(None)
    db.cursor().execute(f"ALTER TABLE {t} ALTER COLUMN m SET NOT NULL")
    with pytest.raises(ConfigError, match=r"source\.unique_key: no unique index"):
        source(pg_url, t, unique_key=["m"], **ts).init(None)
    source(pg_url, t, unique_key=["u"], **ts).init(None)
    # A primary key's INCLUDE columns are not part of the key.
    db.cursor().execute(f"CREATE TABLE {t}2 (a int, b int, PRIMARY KEY (a) INCLUDE (b))")
    src = source(pg_url, f"{t}2", incrementing_column="a", delete_after_read=True, destructive=True)
    src.init(None)
    db.cursor().execute(f"INSERT INTO {t}2 VALUES (1, NULL)")
    polled = src.poll(None, 10, 0.1)
    assert polled is not None and [r[:-1] for r in polled.state["read"]] == [[1]]
    src.commit(polled.state)
    assert sql1(db, f"SELECT count(*) FROM {t}2") == 0
    src.close()
    source(pg_url, t, incrementing_column="n").init(None)  # incrementing: a key is optional
    db.cursor().execute(f"CREATE VIEW {pg_schema}.v AS SELECT * FROM {pg_schema}.q")
    with pytest.raises(ConfigError, match=r"source\.table: .* not a table"):
        source(pg_url, f"{pg_schema}.v").init(None)
    with pytest.raises(ConfigError, match=r"source\.processed_column: .* not boolean"):
        source(pg_url, f"{pg_schema}.q", processed_column="body", destructive=True).init(None)


def test_a_composite_key_of_exact_values_orders_resumes_and_commits(pg_url, pg_schema, db):
    """Key (tenant text, n numeric(30,2)) under one timestamp: read two at a time in
    (timestamp, tenant, n) order, resumed after the stored key (kept exact: no float), and
    marked by it."""
    t = f"{pg_schema}.ck"
    db.cursor().execute(
        f"CREATE TABLE {t} (tenant text, n numeric(30, 2), at timestamp NOT NULL, "
        "done boolean NOT NULL DEFAULT false, PRIMARY KEY (tenant, n))"
    )
    big = "1234567890123456789012345.67"
    rows = [("b", "1.10"), ("a", big), ("a", "1.10"), ("b", "0.01"), ("a", "2.00")]
    with db.cursor() as cur:
        for tenant, n in rows:
            cur.execute(
                f"INSERT INTO {t} (tenant, n, at) VALUES (%s, %s, '2026-01-01')", (tenant, n)
            )
    want = [("a", "1.10"), ("a", "2.00"), ("a", big), ("b", "0.01"), ("b", "1.10")]
    for extra in ({}, {"processed_column": "done", "destructive": True}):
        src = source(pg_url, t, incrementing_column=None, timestamp_column="at", **extra)
        src.init(None)
        state, got = None, []
        while (polled := src.poll(state, 2, 0.1)) is not None:
            for m in polled.messages:
                d = json.loads(m.payload or b"", parse_float=Decimal)
                got.append((d["tenant"], str(d["n"])))
            state = json.loads(json.dumps(polled.state))
            src.commit(state)
        assert got == want
        src.close()
    assert sql1(db, f"SELECT count(*) FROM {t} WHERE done") == 5


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"delay_ms": 100}, r"source\.delay_ms: delay_ms applies to timestamp_column only"),
        (
            {
                "timestamp_column": "at",
                "incrementing_column": None,
                "delay_ms": 1,
                "destructive": True,
                "delete_after_read": True,
            },
            r"source\.delay_ms: delay_ms is not needed",
        ),
        ({"unique_key": []}, r"source\.unique_key: .*distinct, non-empty"),
        ({"unique_key": ["id", "id"]}, r"source\.unique_key: .*distinct, non-empty"),
        ({"timestamp_column": "at"}, r"source\.incrementing_column: give exactly one"),
    ],
)
def test_bad_config_names_the_field(pg_url, extra, message):
    with pytest.raises(ConfigError, match=message):
        source(pg_url, "public.q", **extra)


def test_delay_ms_reads_a_timestamp_only_once_it_is_old_enough(pg_url, pg_schema, db):
    t = f"{pg_schema}.q"
    db.cursor().execute(f"INSERT INTO {t} (body, at) VALUES ('old', now() - interval '1 hour')")
    db.cursor().execute(f"INSERT INTO {t} (body, at) VALUES ('fresh', now())")
    src = source(pg_url, t, incrementing_column=None, timestamp_column="at", delay_ms=1500)
    src.init(None)
    polled = src.poll(None, 10, 0.1)
    assert ids(polled) == [1] and polled is not None
    wait_for(lambda: ids(src.poll(polled.state, 10, 0.1)) == [2], what="the fresh row, later")
    src.close()


# -- end to end: two writers whose commits interleave -------------------------------------


def interleaved_writers(
    pg_url: str, table: str, consumed: Callable[[Any, int], bool], holds: int = 10, per: int = 20
) -> tuple[list[int], list[int]]:
    """Writer A inserts ``holds * per`` rows, one transaction each. ``holds`` times among
    them writer B inserts a row and keeps its transaction open until A has committed a
    higher id and ``consumed`` says the source has read it; then B commits. Returns A's ids
    and B's (late) ids."""
    ordinary: list[int] = []
    late: list[int] = []
    go = [threading.Event() for _ in range(holds)]
    held = [threading.Event() for _ in range(holds)]
    errors: list[BaseException] = []

    def writer_a() -> None:
        conn = psycopg2.connect(pg_url)
        conn.autocommit = True
        try:
            for i in range(holds * per):
                if i % per == per // 2:
                    go[i // per].set()
                    if not held[i // per].wait(60):
                        raise AssertionError("writer B never opened its transaction")
                ordinary.append(sql1(conn, f"INSERT INTO {table} (body) VALUES ('a') RETURNING id"))
        finally:
            conn.close()

    def writer_b() -> None:
        conn = psycopg2.connect(pg_url)
        watch = psycopg2.connect(pg_url)
        watch.autocommit = True
        try:
            for i in range(holds):
                if not go[i].wait(60):
                    raise AssertionError("writer A never reached its turn")
                mine = sql1(conn, f"INSERT INTO {table} (body) VALUES ('late') RETURNING id")
                held[i].set()
                # Open until a higher id, committed by A, has been read (and deleted/marked).
                wait_for(
                    lambda mine=mine: any(x > mine and consumed(watch, x) for x in list(ordinary)),
                    what=f"a row after {mine} read while {mine} is uncommitted",
                )
                conn.commit()
                late.append(mine)
        finally:
            conn.close()
            watch.close()

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the test
                errors.append(e)
                for ev in held + go:
                    ev.set()

        return run

    threads = [threading.Thread(target=guarded(f), daemon=True) for f in (writer_a, writer_b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    if errors:
        raise errors[0]
    return ordinary, late


@pytest.mark.parametrize("mode", ["delete_after_read", "processed_column"])
def test_interleaved_writers_lose_no_row(
    tmp_path, tansu, spark_remote, pg_url, pg_schema, db, mode
):
    """The issue's race: ten late commits among 200 ordinary inserts while the connector
    polls and commits destructively. Every row is produced exactly once, each late row
    after a higher id was already produced, and the table ends empty (all marked)."""
    t = f"{pg_schema}.q"
    name = f"src_{uuid.uuid4().hex[:6]}"
    topic = f"{name}.q"
    extra: dict[str, Any] = (
        {"delete_after_read": True} if mode == "delete_after_read" else {"processed_column": "done"}
    )
    spec = {
        "name": name,
        "source": {
            "type": "postgres_polling",
            "url": pg_url,
            "table": t,
            "incrementing_column": "id",
            "destination": topic,
            "destructive": True,
            **extra,
        },
        "batch": {"max_records": 7, "max_wait_ms": 100},
    }
    if mode == "delete_after_read":

        def consumed(conn: Any, x: int) -> bool:
            return sql1(conn, f"SELECT count(*) FROM {t} WHERE id = %s", (x,)) == 0

        remaining = f"SELECT count(*) FROM {t}"
    else:

        def consumed(conn: Any, x: int) -> bool:
            return sql1(conn, f"SELECT done FROM {t} WHERE id = %s", (x,)) is True

        remaining = f"SELECT count(*) FROM {t} WHERE NOT done"
    store, gen = claimed_store(tmp_path, name)
    loop = build_loop(spec, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        ordinary, late = interleaved_writers(pg_url, t, consumed)
        wait_for(lambda: sql1(db, remaining) == 0, what="every row read and committed")
    assert len(ordinary) == 200 and len(late) == 10
    produced = [json.loads(m.value)["id"] for m in read_topic(tansu, topic)]
    assert sorted(produced) == sorted(ordinary + late)  # every row, exactly once
    for mine in late:  # each late row was produced after a higher id: really read late
        assert any(x > mine for x in produced[: produced.index(mine)])
    if mode == "processed_column":
        assert sql1(db, f"SELECT count(*) FROM {t} WHERE done") == 210


def test_equal_timestamps_across_batch_boundaries(
    tmp_path, tansu, spark_remote, pg_url, pg_schema, db
):
    """Forty rows of one timestamp read seven at a time, and two more of that timestamp
    written after it was read (read after a restart): every row exactly once, in
    (timestamp, id) order. Resuming strictly after the last timestamp would lose 34."""
    t = f"{pg_schema}.q"
    at = "2026-01-01 00:00:00+00"
    with db.cursor() as cur:
        cur.execute(
            f"INSERT INTO {t} (body, at) VALUES ('before', timestamptz '{at}' - interval '1 s')"
        )
        cur.execute(
            f"INSERT INTO {t} (body, at) SELECT 'same', timestamptz '{at}' FROM generate_series(1, 40)"
        )
    name = f"src_{uuid.uuid4().hex[:6]}"
    topic = f"{name}.q"
    spec = {
        "name": name,
        "source": {
            "type": "postgres_polling",
            "url": pg_url,
            "table": t,
            "timestamp_column": "at",
            "destination": topic,
        },
        "batch": {"max_records": 7, "max_wait_ms": 100},
    }
    store, gen = claimed_store(tmp_path, name)
    loop = build_loop(spec, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 41, what="41 rows")
    got = [json.loads(m.value) for m in read_topic(tansu, topic)]
    assert [g["id"] for g in got] == list(range(1, 42))
    version, state = store.source_state(name)
    assert version == 2 and state["last"]["id"] == 41
    # Written later with the timestamp last read: read, after the stored (timestamp, key).
    with db.cursor() as cur:
        cur.execute(
            f"INSERT INTO {t} (body, at) SELECT 'late', timestamptz '{at}' FROM generate_series(1, 2)"
        )
    loop = build_loop(spec, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 2, what="the two late rows")
    assert [json.loads(m.value)["id"] for m in read_topic(tansu, topic)][41:] == [42, 43]
