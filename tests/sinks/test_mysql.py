"""MySQL sink: the contract suite and MySQL-specific behaviour against the machine's MariaDB."""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pymysql
import pytest

from conveyor.core.errors import ConfigError, PermanentSinkError, TransientSinkError
from conveyor.sinks import build_sink
from conveyor.sinks.mysql import MySQLSink, quote_identifier
from tests.sinks.contract import BASE_TS, SinkContract, closed_port, make_batch, unique

pytestmark = pytest.mark.integration

MYSQL_URL = os.environ.get("CONVEYOR_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")


def _connect(**over: Any) -> Any:
    kw = build_sink({"type": "mysql", "url": MYSQL_URL, "table": "x"}).connect_kwargs()  # type: ignore[attr-defined]
    kw.update({"autocommit": True, **over})
    return pymysql.connect(**kw)


def _exec(sql: str, *args: Any, fetch: bool = False) -> list[tuple[Any, ...]]:
    conn = _connect()
    try:
        with conn.cursor() as cur:
            cur.execute(sql, args or None)
            return list(cur.fetchall()) if fetch else []
    finally:
        conn.close()


def _drop(table: str) -> None:
    _exec(f"DROP TABLE IF EXISTS {quote_identifier(table)}")


def _count(table: str) -> int:
    return int(_exec(f"SELECT COUNT(*) FROM {quote_identifier(table)}", fetch=True)[0][0])


CONTRACT_DDL = (
    "CREATE TABLE {t} (id BIGINT {pk}, name VARCHAR(255) NOT NULL, amount DOUBLE CHECK (amount >= 0), "
    "k VARBINARY(255), h JSON, ts DATETIME(3)) ENGINE=InnoDB"
)


class TestMySQLContract(SinkContract):
    sink_type = "mysql"
    idempotent = True  # upsert on id
    keeps_keys = keeps_headers = keeps_timestamps = True

    def make_target(self) -> Iterator[str]:
        table = unique("orders")
        _exec(CONTRACT_DDL.format(t=quote_identifier(table), pk="PRIMARY KEY"))
        yield table
        _drop(table)

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "mysql",
            "url": MYSQL_URL,
            "table": target,
            "columns": {
                "id": "id",
                "name": "name",
                "amount": "amount",
                "k": "$key",
                "h": "$headers",
                "ts": "$timestamp",
            },
            "upsert_keys": ["id"],
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        rows = _exec(f"SELECT id, name, k, h, ts FROM {quote_identifier(target)}", fetch=True)
        return [
            {
                "id": i,
                "name": n,
                "key": bytes(k) if k is not None else None,
                "headers": {a: b.encode() for a, b in json.loads(h or "{}").items()},
                "timestamp": ts.replace(tzinfo=dt.timezone.utc) if ts else None,
            }
            for i, n, k, h, ts in rows
        ]

    def poison_batch(self, target: str):
        # Row 250 violates NOT NULL (1048), row 400 the CHECK constraint (MariaDB 4025).
        return make_batch(500, names={250: None}, amounts={400: -1.0}), {250, 400}

    def outage_config(self, target: str) -> dict[str, Any]:
        return {
            **self.config(target),
            "url": f"mysql://root@127.0.0.1:{closed_port()}/test",
            "connect_timeout_s": 2,
        }

    bad_fields = [
        ({"table": ""}, "table"),
        ({"table": "x" * 65}, "table"),
        ({"url": "postgresql://root@127.0.0.1/test"}, "url"),
        ({"url": "mysql://root@127.0.0.1:3306/"}, "url"),
        ({"url": None}, "url"),
        ({"host": "127.0.0.1"}, "url"),
        ({"url_env": "CONVEYOR_TEST_MYSQL_SINK_URL"}, "url_env"),  # both url and url_env
        ({"user": "root"}, "user"),
        ({"rows_per_statement": 0}, "rows_per_statement"),
        ({"connect_timeout_s": 0}, "connect_timeout_s"),
        ({"read_timeout_s": 0}, "read_timeout_s"),
        ({"write_timeout_s": -1}, "write_timeout_s"),
        ({"columns": {"id": "$nope"}}, "columns"),
        ({"columns": {}}, "columns"),
        ({"upsert_keys": ["missing_column"]}, "upsert_keys"),
    ]


class TestMySQLAppendContract(TestMySQLContract):
    """Plain INSERT without upsert keys: a replay duplicates rows (documented)."""

    idempotent = False

    def make_target(self) -> Iterator[str]:
        table = unique("orders")
        _exec(CONTRACT_DDL.format(t=quote_identifier(table), pk=""))
        yield table
        _drop(table)

    def config(self, target: str) -> dict[str, Any]:
        cfg = super().config(target)
        del cfg["upsert_keys"]
        return cfg


# -- MySQL-specific behaviour ------------------------------------------------------------------


@pytest.fixture
def table() -> Iterator[str]:
    name = unique("t")
    yield name
    _drop(name)


def _sink(table: str, **over: Any) -> MySQLSink:
    s = build_sink({"type": "mysql", "url": MYSQL_URL, "table": table, **over})
    assert isinstance(s, MySQLSink)
    return s


def test_create_table_from_the_first_batch(table: str) -> None:
    s = _sink(
        table,
        create_table=True,
        columns={
            "id": "id",
            "name": "name",
            "amount": "amount",
            "k": "$key",
            "ts": "$timestamp",
            "h": "$headers",
            "doc": "$payload",
            "off": "$offset",
            "topic": "$topic",
            "part": "$partition",
        },
        upsert_keys=["topic", "part", "off"],
    )
    s.init_sink()
    try:
        assert s.send_batch(make_batch(20)).failed == ()
        assert s.send_batch(make_batch(20)).failed == ()  # replay: upsert on (topic, part, off)
    finally:
        s.cleanup_sink()
    cols = dict(
        _exec(
            "SELECT COLUMN_NAME, COLUMN_TYPE FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
            table,
            fetch=True,
        )
    )
    assert cols["id"] == "bigint(20)" and cols["name"] == "longtext" and cols["amount"] == "double"
    assert (
        cols["k"] == "longblob" and cols["ts"] == "datetime(3)" and cols["topic"] == "varchar(255)"
    )
    assert cols["part"] == "int(11)" and cols["off"] == "bigint(20)"
    pk = _exec(
        "SELECT COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND INDEX_NAME = 'PRIMARY' ORDER BY SEQ_IN_INDEX",
        table,
        fetch=True,
    )
    assert [r[0] for r in pk] == ["topic", "part", "off"]
    assert _count(table) == 20
    doc, h, ts = _exec(
        f"SELECT doc, h, ts FROM {quote_identifier(table)} WHERE id = 7", fetch=True
    )[0]
    assert json.loads(doc) == {"id": 7, "name": "name 7", "amount": 10.5}
    assert json.loads(h) == {"h": "7"}
    assert ts == (BASE_TS + dt.timedelta(milliseconds=7)).replace(tzinfo=None)


def test_create_table_default_columns_without_keys(table: str) -> None:
    s = _sink(table, create_table=True)
    s.init_sink()
    try:
        assert s.send_batch(make_batch(5)).failed == ()
    finally:
        s.cleanup_sink()
    assert sorted(
        r[0] for r in _exec(f"SELECT id FROM {quote_identifier(table)}", fetch=True)
    ) == list(range(5))


def test_upsert_updates_existing_rows_and_later_rows_win(table: str) -> None:
    _exec(
        f"CREATE TABLE {quote_identifier(table)} (id BIGINT PRIMARY KEY, name VARCHAR(100) NOT NULL, amount DOUBLE)"
    )
    s = _sink(
        table,
        columns={"id": "id", "name": "name", "amount": "amount"},
        upsert_keys=["id"],
        rows_per_statement=7,
    )
    s.init_sink()
    try:
        s.send_batch(make_batch(30))
        s.send_batch(make_batch(30, names={3: "renamed"}, amounts={4: 99.0}))
        # The same key twice in one batch: the later row wins.
        dup = pa.concat_tables(
            [
                make_batch(1, start=5, names={5: "first"}),
                make_batch(1, start=5, names={5: "second"}),
            ]
        )
        assert s.send_batch(dup).failed == ()
    finally:
        s.cleanup_sink()
    rows = dict(
        (i, (n, a))
        for i, n, a in _exec(f"SELECT id, name, amount FROM {quote_identifier(table)}", fetch=True)
    )
    assert len(rows) == 30
    assert rows[3] == ("renamed", 4.5) and rows[4] == ("name 4", 99.0) and rows[5][0] == "second"


def test_upsert_keys_must_be_a_unique_index(table: str) -> None:
    _exec(
        f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name VARCHAR(100), amount DOUBLE, KEY (id))"
    )
    s = _sink(table, upsert_keys=["id"], columns={"id": "id", "name": "name", "amount": "amount"})
    with pytest.raises(
        PermanentSinkError, match=r"upsert_keys \(id\) are not the PRIMARY KEY or a UNIQUE index"
    ):
        s.init_sink()
    s.cleanup_sink()


def test_upsert_on_a_composite_unique_index(table: str) -> None:
    _exec(
        f"CREATE TABLE {quote_identifier(table)} (seq BIGINT AUTO_INCREMENT PRIMARY KEY, topic VARCHAR(100), off BIGINT, name TEXT, UNIQUE KEY (topic, off))"
    )
    s = _sink(
        table,
        columns={"topic": "$topic", "off": "$offset", "name": "name"},
        upsert_keys=["off", "topic"],
    )
    s.init_sink()
    try:
        s.send_batch(make_batch(10))
        s.send_batch(make_batch(10, names={2: "again"}))
    finally:
        s.cleanup_sink()
    assert _count(table) == 10
    assert _exec(f"SELECT name FROM {quote_identifier(table)} WHERE off = 2", fetch=True) == [
        ("again",)
    ]


def test_missing_table_is_permanent_and_named(table: str) -> None:
    s = _sink(table)
    with pytest.raises(
        PermanentSinkError, match=f"`{table}` does not exist in database 'test'.*create_table"
    ):
        s.init_sink()
    s.cleanup_sink()


def test_table_dropped_while_running_is_permanent(table: str) -> None:
    _exec(f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name TEXT, amount DOUBLE)")
    s = _sink(table)
    s.init_sink()
    try:
        s.send_batch(make_batch(3))
        _drop(table)
        with pytest.raises(PermanentSinkError, match=f"table `{table}`.*does not exist"):
            s.send_batch(make_batch(3))
    finally:
        s.cleanup_sink()


def test_wrong_columns_are_listed(table: str) -> None:
    _exec(f"CREATE TABLE {quote_identifier(table)} (id BIGINT, label TEXT)")
    s = _sink(table)
    s.init_sink()
    try:
        with pytest.raises(
            PermanentSinkError, match=r"has no column\(s\) name, amount \(it has id, label\)"
        ):
            s.send_batch(make_batch(3))
    finally:
        s.cleanup_sink()
    s = _sink(table, columns={"id": "nope"})
    s.init_sink()
    try:
        with pytest.raises(
            ConfigError, match="source column 'nope' is not in the transformed batch"
        ):
            s.send_batch(make_batch(3))
    finally:
        s.cleanup_sink()


def test_unmapped_not_null_column_is_permanent(table: str) -> None:
    _exec(
        f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name TEXT, amount DOUBLE, required_col INT NOT NULL)"
    )
    s = _sink(table)
    s.init_sink()
    try:
        with pytest.raises(PermanentSinkError, match="1364"):
            s.send_batch(make_batch(3))
    finally:
        s.cleanup_sink()
    assert _count(table) == 0


def test_identifiers_with_backticks_and_percent_signs(table: str) -> None:
    name = table + "`we%ird %s"
    try:
        _exec(
            f"CREATE TABLE {quote_identifier(name)} ({quote_identifier('i`d')} BIGINT PRIMARY KEY, {quote_identifier('na%me')} TEXT, {quote_identifier('VALUES (%s)')} DOUBLE)"
        )
        s = _sink(
            name,
            columns={"i`d": "id", "na%me": "name", "VALUES (%s)": "amount"},
            upsert_keys=["i`d"],
        )
        s.init_sink()
        try:
            assert s.send_batch(make_batch(5)).failed == ()
            assert s.send_batch(make_batch(5, names={1: "it's \\ 'quoted' %s"})).failed == ()
        finally:
            s.cleanup_sink()
        rows = dict(
            _exec(
                f"SELECT {quote_identifier('i`d')}, {quote_identifier('na%me')} FROM {quote_identifier(name)}",
                fetch=True,
            )
        )
        assert rows == {
            0: "name 0",
            1: "it's \\ 'quoted' %s",
            2: "name 2",
            3: "name 3",
            4: "name 4",
        }
    finally:
        _drop(name)


def test_every_data_error_is_isolated_to_its_row(table: str) -> None:
    parent = table + "_parent"
    _exec(f"CREATE TABLE {quote_identifier(parent)} (id BIGINT PRIMARY KEY) ENGINE=InnoDB")
    _exec(f"INSERT INTO {quote_identifier(parent)} VALUES (1)")
    try:
        _exec(
            f"CREATE TABLE {quote_identifier(table)} (id BIGINT PRIMARY KEY, name VARCHAR(10) NOT NULL, "
            "amount DOUBLE CHECK (amount >= 0), small TINYINT, num INT, parent BIGINT, "
            f"FOREIGN KEY (parent) REFERENCES {quote_identifier(parent)} (id)) ENGINE=InnoDB"
        )
        n = 200
        names = {i: f"n{i}" for i in range(n)}
        names.update({10: None, 40: "x" * 11})
        small = {i: 1 for i in range(n)}
        small[60] = 1000
        num = {i: str(i) for i in range(n)}
        num[80] = "not a number"
        parents = {i: 1 for i in range(n)}
        parents[120] = 42
        amounts = {i: float(i) for i in range(n)}
        amounts[100] = -5.0
        amounts[140] = float("nan")
        batch = pa.table(
            {
                "id": pa.array(
                    [5 if i == 160 else i for i in range(n)], pa.int64()
                ),  # 160 repeats id 5: duplicate key
                "name": pa.array([names[i] for i in range(n)], pa.string()),
                "amount": pa.array([amounts[i] for i in range(n)], pa.float64()),
                "small": pa.array([small[i] for i in range(n)], pa.int64()),
                "num": pa.array([num[i] for i in range(n)], pa.string()),
                "parent": pa.array([parents[i] for i in range(n)], pa.int64()),
            }
        )
        s = _sink(table, rows_per_statement=64)
        s.init_sink()
        try:
            result = s.send_batch(batch)
        finally:
            s.cleanup_sink()
        by_index = {f.index: f.message for f in result.failed}
        assert set(by_index) == {10, 40, 60, 80, 100, 120, 140, 160}
        assert "(1048)" in by_index[10] and "cannot be null" in by_index[10]
        assert "(1406)" in by_index[40]
        assert "(1264)" in by_index[60]
        assert "(1366)" in by_index[80]
        assert "(4025)" in by_index[100] or "(3819)" in by_index[100]
        assert "(1452)" in by_index[120]
        assert "nan" in by_index[140]
        assert "(1062)" in by_index[160]
        stored = sorted(
            r[0] for r in _exec(f"SELECT id FROM {quote_identifier(table)}", fetch=True)
        )
        assert stored == [i for i in range(n) if i not in by_index]
    finally:
        _drop(table)
        _drop(parent)


def test_strict_mode_is_on_for_the_session(table: str) -> None:
    """Even with a permissive server default, a too-long value is an error, not a truncation warning."""
    _exec(f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name VARCHAR(3), amount DOUBLE)")
    s = _sink(table)
    s.init_sink()
    try:
        with s._conn.cursor() as cur:  # the sink's own session
            cur.execute("SELECT @@SESSION.sql_mode, @@SESSION.time_zone")
            mode, tz = cur.fetchone()
        assert "STRICT_ALL_TABLES" in mode and tz == "+00:00"
        result = s.send_batch(make_batch(3, names={0: "abc", 1: "abcd", 2: "ab"}))
    finally:
        s.cleanup_sink()
    assert [f.index for f in result.failed] == [1]
    assert sorted(
        r[0] for r in _exec(f"SELECT name FROM {quote_identifier(table)}", fetch=True)
    ) == ["ab", "abc"]


def test_non_transactional_engine_keeps_good_rows_exactly_once(table: str) -> None:
    _exec(
        f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name VARCHAR(20) NOT NULL, amount DOUBLE) ENGINE=MyISAM"
    )
    s = _sink(table)
    s.init_sink()
    try:
        result = s.send_batch(make_batch(50, names={20: None, 21: None}))
    finally:
        s.cleanup_sink()
    assert {f.index for f in result.failed} == {20, 21}
    assert sorted(r[0] for r in _exec(f"SELECT id FROM {quote_identifier(table)}", fetch=True)) == [
        i for i in range(50) if i not in (20, 21)
    ]


def test_rows_per_statement_makes_multi_row_inserts(table: str) -> None:
    _exec(f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name TEXT, amount DOUBLE)")
    s = _sink(table, rows_per_statement=100)
    s.init_sink()
    try:
        with s._conn.cursor() as cur:
            cur.execute("SHOW SESSION STATUS LIKE 'Com_insert'")
            before = int(cur.fetchone()[1])
        assert s.send_batch(make_batch(500)).failed == ()
        with s._conn.cursor() as cur:
            cur.execute("SHOW SESSION STATUS LIKE 'Com_insert'")
            after = int(cur.fetchone()[1])
    finally:
        s.cleanup_sink()
    assert after - before == 5
    assert _count(table) == 500


def test_max_statement_bytes_splits_large_statements(table: str) -> None:
    _exec(f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name LONGTEXT, amount DOUBLE)")
    s = _sink(table, rows_per_statement=1000, max_statement_bytes=4096)
    s.init_sink()
    try:
        big = {i: "x" * 1000 for i in range(100)}
        assert s.send_batch(make_batch(100, names=big)).failed == ()
    finally:
        s.cleanup_sink()
    assert _count(table) == 100


def test_connection_killed_between_batches_is_transient_then_recovers(table: str) -> None:
    _exec(
        f"CREATE TABLE {quote_identifier(table)} (id BIGINT PRIMARY KEY, name TEXT, amount DOUBLE)"
    )
    s = _sink(table, upsert_keys=["id"])
    s.init_sink()
    try:
        s.send_batch(make_batch(10))
        _exec(f"KILL {s._conn.thread_id()}")
        with pytest.raises(TransientSinkError, match="MySQL write failed: \\((2006|2013)\\)"):
            s.send_batch(make_batch(10, start=10))
        assert s.send_batch(make_batch(10, start=10)).failed == ()  # reconnects
    finally:
        s.cleanup_sink()
    assert _count(table) == 20


def test_lock_wait_timeout_is_transient_and_nothing_is_committed(table: str) -> None:
    _exec(
        f"CREATE TABLE {quote_identifier(table)} (id BIGINT PRIMARY KEY, name TEXT, amount DOUBLE) ENGINE=InnoDB"
    )
    holder = _connect(autocommit=False)
    try:
        with holder.cursor() as cur:
            cur.execute(
                f"INSERT INTO {quote_identifier(table)} VALUES (300, 'held', 0)"
            )  # row lock, not committed
        s = _sink(table, upsert_keys=["id"], rows_per_statement=100, lock_wait_timeout_s=1)
        s.init_sink()
        try:
            with pytest.raises(TransientSinkError, match="1205"):
                s.send_batch(make_batch(500))
        finally:
            s.cleanup_sink()
    finally:
        holder.rollback()
        holder.close()
    assert _count(table) == 0  # statements before the lock were rolled back with the batch


def test_read_timeout_is_transient(table: str) -> None:
    _exec(f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name TEXT, amount DOUBLE)")
    _exec(
        f"CREATE TRIGGER {quote_identifier(table + '_slow')} BEFORE INSERT ON {quote_identifier(table)} FOR EACH ROW SET @conveyor_slept = SLEEP(3)"
    )
    s = _sink(table, read_timeout_s=1)
    s.init_sink()
    try:
        with pytest.raises(TransientSinkError, match="2013"):
            s.send_batch(make_batch(1))
    finally:
        s.cleanup_sink()


def test_wrong_password_and_unknown_database_are_permanent(table: str) -> None:
    with pytest.raises(PermanentSinkError, match="1045"):
        build_sink(
            {"type": "mysql", "url": "mysql://root:wrong@127.0.0.1:3306/test", "table": table}
        ).init_sink()
    with pytest.raises(PermanentSinkError, match="1049"):
        build_sink(
            {
                "type": "mysql",
                "host": "127.0.0.1",
                "database": f"no_such_db_{uuid.uuid4().hex[:6]}",
                "table": table,
            }
        ).init_sink()


def test_missing_insert_privilege_is_permanent(table: str) -> None:
    _exec(f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name TEXT, amount DOUBLE)")
    user, pw = f"conveyor_ro_{uuid.uuid4().hex[:6]}", "s3cret pass"
    _exec(f"CREATE USER '{user}'@'%%' IDENTIFIED BY %s", pw)
    _exec(f"CREATE USER '{user}'@'localhost' IDENTIFIED BY %s", pw)
    try:
        for host in ("%", "localhost"):
            _exec(f"GRANT SELECT ON test.* TO '{user}'@'{host}'")
        s = build_sink(
            {
                "type": "mysql",
                "host": "127.0.0.1",
                "user": user,
                "password": pw,
                "database": "test",
                "table": table,
            }
        )
        assert "s3cret" not in repr(s.config) and "s3cret" not in json.dumps(s.config.redacted())
        s.init_sink()
        try:
            with pytest.raises(PermanentSinkError, match="1142"):
                s.send_batch(make_batch(2))
        finally:
            s.cleanup_sink()
    finally:
        _exec(f"DROP USER IF EXISTS '{user}'@'%'")
        _exec(f"DROP USER IF EXISTS '{user}'@'localhost'")


def test_url_env_and_host_fields(table: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _exec(f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name TEXT, amount DOUBLE)")
    monkeypatch.setenv("CONVEYOR_TEST_MYSQL_SINK_URL", MYSQL_URL)
    from conveyor.config.specs import from_mapping, resolved

    for cfg in (
        {"url_env": "CONVEYOR_TEST_MYSQL_SINK_URL"},
        {"host": "127.0.0.1", "port": 3306, "user": "root", "database": "test"},
    ):
        # As a run builds it: url_env is ${env:...}, resolved in the run.
        raw = {"type": "mysql", "table": table, **cfg}
        ls = from_mapping(
            {"name": "c", "source": {"topics": ["t"]}, "sink": raw}, source="t", fallback_name="c"
        )
        s = build_sink(resolved(ls).sink)
        assert isinstance(s, MySQLSink)
        assert s.config.asset_key_path() == ["mysql", "test", table]
        s.init_sink()
        try:
            assert s.send_batch(make_batch(2)).failed == ()
        finally:
            s.cleanup_sink()
    assert _count(table) == 4


def test_concurrent_sinks_on_one_table(table: str) -> None:
    """Two connectors upserting overlapping keys: InnoDB serializes them, nothing is lost."""
    _exec(
        f"CREATE TABLE {quote_identifier(table)} (id BIGINT PRIMARY KEY, name TEXT, amount DOUBLE)"
    )
    errors: list[BaseException] = []

    def run(start: int) -> None:
        s = _sink(table, upsert_keys=["id"], rows_per_statement=50)
        s.init_sink()
        try:
            for _ in range(3):
                try:
                    s.send_batch(make_batch(300, start=start))
                except TransientSinkError:  # a deadlock is retried, as the runtime would
                    s.send_batch(make_batch(300, start=start))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            s.cleanup_sink()

    threads = [threading.Thread(target=run, args=(x,)) for x in (0, 150)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert _count(table) == 450


def test_a_row_above_max_allowed_packet_is_a_data_error(table: str) -> None:
    """The server would drop the connection (1153) and every retry would fail again."""
    _exec(f"CREATE TABLE {quote_identifier(table)} (id BIGINT, name LONGTEXT, amount DOUBLE)")
    limit = int(_exec("SELECT @@max_allowed_packet", fetch=True)[0][0])
    s = _sink(table, max_statement_bytes=1 << 30)  # capped to the server's limit
    s.init_sink()
    try:
        result = s.send_batch(make_batch(5, names={1: "x" * (limit + 1), 3: "y" * (limit // 2)}))
        assert [f.index for f in result.failed] == [1]
        assert "exceeds the server's max_allowed_packet" in result.failed[0].message
        assert s.send_batch(make_batch(1, start=5)).failed == ()  # same connection, still fine
    finally:
        s.cleanup_sink()
    assert sorted(r[0] for r in _exec(f"SELECT id FROM {quote_identifier(table)}", fetch=True)) == [
        0,
        2,
        3,
        4,
        5,
    ]


class _ArrowLiterals:
    """Columns and the message timestamp only: the rows' literals are built by Arrow
    (``literal_column``) and bisected the same way when the server refuses a statement."""

    keeps_keys = keeps_headers = False

    def config(self, target: str) -> dict[str, Any]:
        cfg = super().config(target)  # type: ignore[misc]
        del cfg["columns"]["k"], cfg["columns"]["h"]
        return cfg  # type: ignore[no-any-return]


class TestMySQLLiteralsContract(_ArrowLiterals, TestMySQLContract):
    pass


class TestMySQLLiteralsAppendContract(_ArrowLiterals, TestMySQLAppendContract):
    pass


HOSTILE_TEXT = [
    "plain",
    "it's",
    'say "hi"',
    "back\\slash\\",
    "\\'; DROP TABLE x; --",
    "nul\x00inside",
    "ctrl-z\x1a",
    "lines\r\nand\ttabs",
    "é ü 中文 😀",
    "%s %(x)s %%",
    "",
    None,
]


@pytest.mark.parametrize("upsert", [False, True], ids=["insert", "upsert"])
def test_arrow_literals_write_what_pymysql_escaping_writes(
    upsert: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same hostile batch written through Arrow's literals and through pymysql's
    value-by-value escaping lands identically (text, floats to the bit, integers at their
    limits, booleans, dates, timestamps of every unit and zone, decimals and JSON through
    pymysql's own literals, nulls), in statements split by max_statement_bytes."""
    import decimal

    n = len(HOSTILE_TEXT)
    floats = [0.1, 1e20, -0.0, 1e-7, 123456789.125, 5e-324, 1.7976931348623157e308, 2.5, -1.0]
    floats += [3.0, None, 1 / 3]
    micros = [0, 1_700_000_000_123_456, -1_000_001, None] + [
        i * 86_400_000_000 for i in range(n - 4)
    ]
    raw = pa.array(micros, pa.int64())
    batch = pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "txt": pa.array(HOSTILE_TEXT, pa.string()),
            "big": pa.array([-(2**63), 2**63 - 1] + [None] + list(range(n - 3)), pa.int64()),
            "f64": pa.array(floats, pa.float64()),
            "f32": pa.array([0.1, 1.5, None] + [float(i) / 7 for i in range(n - 3)], pa.float32()),
            "flag": pa.array([True, False, None] + [True] * (n - 3)),
            "day": pa.array([dt.date(2026, 11, 25), dt.date(1000, 1, 1), None] + [dt.date(2000, 1, 1)] * (n - 3)),
            "ts_utc": raw.cast(pa.timestamp("us", tz="UTC")),
            "ts_ny": raw.cast(pa.timestamp("us", tz="America/New_York")),
            "ts_ms": pa.array([None if m is None else m // 1000 for m in micros], pa.timestamp("ms")),
            "ts_ns": pa.array([None if m is None else m * 1000 for m in micros], pa.timestamp("ns")),
            "amt": pa.array([decimal.Decimal("1.25"), None] + [decimal.Decimal(i) for i in range(n - 2)], pa.decimal128(10, 2)),
            "doc": pa.array([{"a": 1, "b": "x'y"}, None] + [{"a": i, "b": ""} for i in range(n - 2)]),
        }
    )  # fmt: skip
    ddl = (
        "id BIGINT {pk}, txt LONGTEXT, big BIGINT, f64 DOUBLE, f32 DOUBLE, flag BOOLEAN,"
        " day DATE, ts_utc DATETIME(6), ts_ny DATETIME(6), ts_ms DATETIME(6), ts_ns DATETIME(6),"
        " amt DECIMAL(10,2), doc LONGTEXT"
    ).format(pk="PRIMARY KEY" if upsert else "")
    got = {}
    for how in ("arrow", "pymysql"):
        name = unique(f"lit_{how}")
        _exec(f"CREATE TABLE {quote_identifier(name)} ({ddl})")
        try:
            with monkeypatch.context() as m:
                if how == "pymysql":
                    m.setattr(MySQLSink, "_literals", lambda self, batch: None)
                else:  # the Arrow path must be the one taken
                    m.setattr(MySQLSink, "_execute", lambda *a: pytest.fail("pymysql path"))
                cfg: dict[str, Any] = {"max_statement_bytes": 1024, "rows_per_statement": 1000}
                sink = _sink(name, **cfg, **({"upsert_keys": ["id"]} if upsert else {}))
                sink.init_sink()
                try:
                    assert sink.send_batch(batch).failed == ()
                    if upsert:  # the second write updates every row in place
                        assert sink.send_batch(batch).failed == ()
                finally:
                    sink.cleanup_sink()
            got[how] = _exec(f"SELECT * FROM {quote_identifier(name)} ORDER BY id", fetch=True)
        finally:
            _drop(name)
    assert len(got["arrow"]) == n
    assert got["arrow"] == got["pymysql"]
    assert [r[1] for r in got["arrow"]] == HOSTILE_TEXT
    assert [r[3] for r in got["arrow"]] == floats
    # To the bit (``==`` takes -0.0 for 0.0; MariaDB stores -0.0 as 0 either way).
    assert [repr(r[3]) for r in got["arrow"]] == [repr(r[3]) for r in got["pymysql"]]


def test_arrow_literal_statements_split_as_pymysql_executemany() -> None:
    from conveyor.sinks.mysql import literal_statements, row_literals

    rows = row_literals([pa.array([f"'{'x' * i}'" for i in range(10)], pa.large_string())])
    stmts = list(literal_statements(rows, b"INSERT INTO t VALUES ", b"", 40))
    assert all(len(s) <= 40 or s.count(b"(") == 1 for s in stmts)
    values = b",".join(s.removeprefix(b"INSERT INTO t VALUES ") for s in stmts)
    assert values == b",".join(f"('{'x' * i}')".encode() for i in range(10))
    assert len(stmts) > 3
    one = list(literal_statements(rows.slice(9), b"P ", b" Q", 5))  # a row above the limit
    assert one == [b"P ('xxxxxxxxx') Q"]
