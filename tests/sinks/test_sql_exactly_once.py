"""``delivery: exactly_once`` of the SQL sinks against the machine's PostgreSQL and MariaDB: each
batch's rows and its end offsets are committed in one transaction (the offsets table), a replay
writes nothing, a zombie's batch is refused with nothing written, and the offsets read back."""

from __future__ import annotations

import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from conveyor.core.errors import ConfigError, FencedError, PermanentSinkError, TransientSinkError
from conveyor.core.model import TopicPartition
from conveyor.core.positions import TargetBinding
from conveyor.core.sink import ErrorKind, send_isolating
from conveyor.sinks import build_sink
from tests.conftest import PG_URL
from tests.positions import offsets_of
from tests.sinks.contract import make_batch
from tests.sinks.test_mysql import MYSQL_URL

pytestmark = pytest.mark.integration


def mysql_connect() -> Any:
    """An autocommit pymysql connection to ``MYSQL_URL`` (the MySQL tests' server)."""
    import pymysql

    u = urllib.parse.urlsplit(MYSQL_URL)
    return pymysql.connect(
        host=u.hostname,
        port=u.port or 3306,
        user=u.username or "root",
        password=u.password or "",
        database=u.path.lstrip("/"),
        autocommit=True,
    )


class Postgres:
    """A schema of the machine's PostgreSQL, its SQL run on a connection of the test's own."""

    name = "postgres"

    def __init__(self) -> None:
        import psycopg2

        self.schema = f"eo_{uuid.uuid4().hex[:10]}"
        self.conn = psycopg2.connect(PG_URL)
        self.conn.autocommit = True
        self.run(f'CREATE SCHEMA "{self.schema}"')

    def run(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(sql, args or None)
            return cur.fetchall() if cur.description else []

    def table(self, name: str) -> str:
        return f'"{self.schema}"."{name}"'

    def create(self, name: str, *, key: bool = False) -> None:
        pk = " PRIMARY KEY" if key else ""
        self.run(
            f"CREATE TABLE {self.table(name)} (id bigint{pk}, name text NOT NULL, amount double precision)"
        )

    def config(self, table: str, **extra: Any) -> dict[str, Any]:
        return {
            "type": "postgres",
            "url": PG_URL,
            "schema": self.schema,
            "table": table,
            "delivery": "exactly_once",
            **extra,
        }

    def offsets(self, writer: str) -> dict[tuple[str, int], tuple[int, int]]:
        rows = self.run(
            f'SELECT topic, "partition", next_offset, generation FROM {self.table("conveyor_offsets")} '
            'WHERE writer = %s AND "partition" >= 0',
            writer,
        )
        return {(t, p): (o, g) for t, p, o, g in rows}

    def backend_of(self, sink: Any) -> int:
        return int(sink._conn.get_backend_pid())

    def kill(self, pid: int) -> None:
        self.run("SELECT pg_terminate_backend(%s)", pid)

    def close(self) -> None:
        self.run(f'DROP SCHEMA "{self.schema}" CASCADE')
        self.conn.close()


class MariaDB:
    """The machine's MariaDB database ``test``; the tables a test made are dropped after it."""

    name = "mysql"

    def __init__(self) -> None:
        import pymysql

        self.conn = pymysql.connect(host="127.0.0.1", user="root", database="test", autocommit=True)
        self.tag = uuid.uuid4().hex[:8]
        self.made: list[str] = [f"conveyor_offsets_{self.tag}"]

    def run(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(sql, args or None)
            return list(cur.fetchall()) if cur.description else []

    def table(self, name: str) -> str:
        return f"`{name}`"

    def create(self, name: str, *, key: bool = False) -> None:
        pk = " PRIMARY KEY" if key else ""
        self.made.append(name)
        self.run(
            f"CREATE TABLE `{name}` (id bigint{pk}, name varchar(100) NOT NULL, amount double) ENGINE=InnoDB"
        )

    def config(self, table: str, **extra: Any) -> dict[str, Any]:
        return {
            "type": "mysql",
            "url": MYSQL_URL,
            "table": table,
            "delivery": "exactly_once",
            "offsets_table": self.made[0],
            **extra,
        }

    def offsets(self, writer: str) -> dict[tuple[str, int], tuple[int, int]]:
        rows = self.run(
            f"SELECT topic, `partition`, next_offset, generation FROM `{self.made[0]}` "
            "WHERE writer = %s AND `partition` >= 0",
            writer,
        )
        return {(t, p): (o, g) for t, p, o, g in rows}

    def backend_of(self, sink: Any) -> int:
        return int(sink._conn.thread_id())

    def kill(self, pid: int) -> None:
        self.run(f"KILL {int(pid)}")

    def close(self) -> None:
        for name in self.made:
            self.run(f"DROP TABLE IF EXISTS `{name}`")
        self.conn.close()


@pytest.fixture(params=["postgres", "mysql"])
def db(request: pytest.FixtureRequest) -> Iterator[Any]:
    target = Postgres() if request.param == "postgres" else MariaDB()
    try:
        yield target
    finally:
        target.close()


def sink_for(db: Any, table: str, writer: str = "orders_eo", generation: int = 1, **extra: Any):
    sink = build_sink(db.config(table, **extra))
    sink.bind(TargetBinding(writer, generation))
    sink.init_sink()
    return sink


def count(db: Any, table: str) -> tuple[int, int]:
    rows = db.run(f"SELECT count(*), count(DISTINCT id) FROM {db.table(table)}")
    return int(rows[0][0]), int(rows[0][1])


def two_partitions(start: int, n: int) -> pa.Table:
    """``n`` messages of partition 0 and ``n`` of partition 1 (ids apart), interleaved."""
    a = make_batch(n, start=start, partition=0)
    b = make_batch(n, start=start, partition=1)
    b = b.set_column(0, "id", pa.array([10_000 + i for i in range(start, start + n)], pa.int64()))
    return pa.concat_tables([a, b])


def test_rows_and_offsets_commit_together_and_a_replay_writes_nothing(db: Any) -> None:
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    sink = sink_for(db, table)
    try:
        result = sink.send_batch(two_partitions(0, 100))
        assert result.failed == ()
        assert count(db, table) == (200, 200)
        assert db.offsets("orders_eo") == {("orders", 0): (100, 1), ("orders", 1): (100, 1)}
        # The same batch again, and one overlapping it: only the new rows are written.
        assert sink.send_batch(two_partitions(0, 100)).failed == ()
        assert count(db, table) == (200, 200)
        sink.send_batch(two_partitions(50, 100))
        assert count(db, table) == (300, 300)
        assert db.offsets("orders_eo") == {("orders", 0): (150, 1), ("orders", 1): (150, 1)}
    finally:
        sink.cleanup_sink()
    # A new run of the writer replays from before what the table holds: nothing twice.
    again = sink_for(db, table, generation=2)
    try:
        assert offsets_of(again.target_offsets()) == {
            TopicPartition("orders", 0): 150,
            TopicPartition("orders", 1): 150,
        }
        again.send_batch(two_partitions(0, 160))
        assert count(db, table) == (320, 320)
        assert db.offsets("orders_eo") == {("orders", 0): (160, 2), ("orders", 1): (160, 2)}
    finally:
        again.cleanup_sink()


def test_a_connection_killed_mid_transaction_leaves_neither_rows_nor_offsets(db: Any) -> None:
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    sink = sink_for(db, table)
    try:
        sink.send_batch(make_batch(10))
        killed = threading.Event()
        write = sink._write_batch

        def write_then_kill(*args: Any) -> Any:
            failures = write(*args)  # the rows are in the open transaction now
            db.kill(db.backend_of(sink))
            killed.set()
            return failures

        sink._write_batch = write_then_kill
        with pytest.raises(TransientSinkError):
            sink.send_batch(make_batch(10, start=10))
        assert killed.is_set()
        assert count(db, table) == (10, 10)
        assert db.offsets("orders_eo") == {("orders", 0): (10, 1)}
        # The retry (the loop's, after the outage) writes the batch once.
        sink._write_batch = write
        assert sink.send_batch(make_batch(10, start=10)).failed == ()
        assert count(db, table) == (20, 20)
        assert db.offsets("orders_eo") == {("orders", 0): (20, 1)}
    finally:
        sink.cleanup_sink()


def test_a_zombie_is_refused_and_writes_nothing(db: Any) -> None:
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    zombie = sink_for(db, table, generation=1)
    zombie.send_batch(make_batch(10))
    current = sink_for(db, table, generation=2)  # claims the writer: the zombie is fenced now
    try:
        with pytest.raises(FencedError, match="generation 2, this run is generation 1"):
            zombie.send_batch(make_batch(10, start=10))
        assert count(db, table) == (10, 10)
        current.send_batch(make_batch(20))
        assert count(db, table) == (20, 20)
        with pytest.raises(FencedError):
            zombie.send_batch(make_batch(10, start=20))
        assert count(db, table) == (20, 20)
        assert db.offsets("orders_eo") == {("orders", 0): (20, 2)}
        # A zombie starting again after the newer generation is refused at init.
        with pytest.raises(FencedError):
            sink_for(db, table, generation=1)
    finally:
        zombie.cleanup_sink()
        current.cleanup_sink()


def test_target_offsets_round_trip_per_writer(db: Any) -> None:
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    unbound = build_sink(db.config(table))
    assert offsets_of(unbound.target_offsets()) is None  # not bound: no offsets of its own
    first = build_sink(db.config(table))
    first.bind(TargetBinding("orders_eo", 1))
    assert offsets_of(first.target_offsets()) is None  # before the table exists
    first.init_sink()
    try:
        assert offsets_of(first.target_offsets()) is None  # the writer committed nothing yet
        first.send_batch(two_partitions(0, 7))
        task = sink_for(db, table, writer="orders_eo.task1")
        task.send_batch(make_batch(3, start=500, topic="other"))
        task.cleanup_sink()
        reader = build_sink(db.config(table))
        reader.bind(TargetBinding("orders_eo", 1))
        assert offsets_of(reader.target_offsets()) == {
            TopicPartition("orders", 0): 7,
            TopicPartition("orders", 1): 7,
        }
        reader.bind(TargetBinding("orders_eo.task1", 1))
        assert offsets_of(reader.target_offsets()) == {TopicPartition("other", 0): 503}
        at_least_once = build_sink(db.config(table, delivery="at_least_once"))
        at_least_once.bind(TargetBinding("orders_eo", 1))
        assert offsets_of(at_least_once.target_offsets()) is None
    finally:
        first.cleanup_sink()


def test_failed_rows_are_reported_and_a_resend_of_them_is_tried_not_dropped(db: Any) -> None:
    """Rows the table refuses (NOT NULL): the others commit with offsets past the batch; the
    loop's re-send of the failed rows reaches the table (and fails again), never dropped as
    covered."""
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    sink = sink_for(db, table)
    try:
        batch = make_batch(20, names={5: None, 19: None})
        failed = send_isolating(sink, batch)
        assert [f.index for f in failed] == [5, 19]
        assert all(f.kind is ErrorKind.DATA for f in failed)
        assert count(db, table) == (18, 18)
        # Next offset after the last row written: row 19 failed, so it is not covered.
        assert db.offsets("orders_eo") == {("orders", 0): (19, 1)}
        again = send_isolating(sink, batch.take(pa.array([5, 19])))
        assert [f.index for f in again] == [0, 1]
        # A replay of the whole batch writes nothing new and reports the failed rows again.
        assert [f.index for f in send_isolating(sink, batch)] == [5, 19]
        assert count(db, table) == (18, 18)
    finally:
        sink.cleanup_sink()


def test_fail_fast_commits_the_offsets_of_the_rows_before_the_failed_one(db: Any) -> None:
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    sink = sink_for(db, table)
    try:
        failed = send_isolating(sink, make_batch(20, names={7: None}), fail_fast=True)
        assert [f.index for f in failed] == [7]
        assert count(db, table) == (7, 7)
        assert db.offsets("orders_eo") == {("orders", 0): (7, 1)}
    finally:
        sink.cleanup_sink()


def test_upserts_and_the_created_table_take_part(db: Any) -> None:
    """With upsert_keys and create_table: the table and the offsets table are created, and a
    replay after the offsets moved on changes nothing (the row's later value stays)."""
    table = f"orders_{uuid.uuid4().hex[:8]}"
    if db.name == "mysql":
        db.made.append(table)
    sink = sink_for(db, table, upsert_keys=["id"], create_table=True)
    try:
        sink.send_batch(make_batch(10))
        sink.send_batch(make_batch(5, start=10, names={12: "new"}))
        sink.send_batch(make_batch(15, names={12: "stale"}))  # a replay of both
        assert count(db, table) == (15, 15)
        rows = db.run(f"SELECT name FROM {db.table(table)} WHERE id = 12")
        assert rows == [("new",)]
        assert db.offsets("orders_eo") == {("orders", 0): (15, 1)}
    finally:
        sink.cleanup_sink()


def test_an_unbound_sink_writes_at_least_once(db: Any) -> None:
    """A dead-letter replay builds the sink without a run to bind it to: it writes every row it
    is given (replayed messages lie before the offsets) and no offsets."""
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    bound = sink_for(db, table)
    replay = build_sink(db.config(table))
    replay.init_sink()
    try:
        bound.send_batch(make_batch(10))
        replay.send_batch(make_batch(1, start=3))
        assert count(db, table) == (11, 10)
        assert db.offsets("orders_eo") == {("orders", 0): (10, 1)}
    finally:
        bound.cleanup_sink()
        replay.cleanup_sink()


def test_delivery_is_validated_naming_the_field(db: Any) -> None:
    with pytest.raises(
        ConfigError, match="sink.delivery: Input should be 'auto', 'at_least_once' or"
    ):
        build_sink(db.config("t", delivery="twice"))
    with pytest.raises(ConfigError, match="sink.offsets_table"):
        build_sink(db.config("t", offsets_table=""))


def test_a_failed_row_written_on_a_later_try_is_covered_from_then_on(db: Any) -> None:
    """A row refused once and written on a re-send (its value fixed meanwhile, as a parent row
    arriving would) is no longer a failed row: a replay of its batch writes nothing again."""
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    sink = sink_for(db, table)
    try:
        assert [f.index for f in send_isolating(sink, make_batch(10, names={3: None}))] == [3]
        assert send_isolating(sink, make_batch(10).slice(3, 1)) == []
        assert count(db, table) == (10, 10)
        assert send_isolating(sink, make_batch(10)) == []
        assert count(db, table) == (10, 10)
        assert db.offsets("orders_eo") == {("orders", 0): (10, 1)}
    finally:
        sink.cleanup_sink()


def test_delivery_defaults_to_auto_exactly_once_where_the_target_allows_it(db: Any) -> None:
    """The default is auto (issue 37): bound to a run on a target whose user may keep the offsets
    table, it writes exactly once: a replayed batch adds nothing, the offsets table holds the
    writer's marks; an explicit delivery wins."""
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    base = {k: v for k, v in db.config(table).items() if k != "delivery"}
    sink = build_sink(base)
    assert sink.config.delivery == "auto" and sink.config.offsets_in_target()
    explicit = build_sink({**base, "delivery": "at_least_once"})
    assert not explicit.config.offsets_in_target()
    sink.bind(TargetBinding("orders_auto", 1))
    sink.init_sink()
    try:
        assert sink.delivery_in_effect() == "exactly_once"
        assert sink.send_batch(make_batch(5)).failed == ()
        assert sink.send_batch(make_batch(5)).failed == ()  # a re-send after a crash
    finally:
        sink.cleanup_sink()
    assert count(db, table) == (5, 5)
    assert db.offsets("orders_auto") == {("orders", 0): (5, 1)}


@pytest.fixture
def unprivileged(db: Any) -> Iterator[tuple[dict[str, Any], str]]:
    """A target table and a user who may write it but not create tables: the sink config
    (create_table true, delivery left to its default) and the table."""
    user = f"eo_user_{uuid.uuid4().hex[:8]}"
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    if db.name == "postgres":
        db.run(f'CREATE ROLE "{user}" LOGIN')
        db.run(f'GRANT USAGE ON SCHEMA "{db.schema}" TO "{user}"')
        db.run(f'GRANT SELECT, INSERT ON {db.table(table)} TO "{user}"')
        url = PG_URL.replace("postgres@", f"{user}@", 1)
        drop = [f'DROP OWNED BY "{user}"', f'DROP ROLE "{user}"']
    else:
        db.run(f"CREATE USER '{user}'@'%'")
        db.run(f"CREATE USER '{user}'@'localhost'")
        for host in ("%", "localhost"):
            db.run(f"GRANT SELECT, INSERT ON test.`{table}` TO '{user}'@'{host}'")
        url = MYSQL_URL.replace("root@", f"{user}@", 1)
        drop = [f"DROP USER '{user}'@'%'", f"DROP USER '{user}'@'localhost'"]
    config = {k: v for k, v in db.config(table).items() if k != "delivery"}
    try:
        yield {**config, "url": url, "create_table": True}, table
    finally:
        for sql in drop:
            db.run(sql)


def test_an_offsets_table_the_user_may_not_create_names_both_fixes(
    db: Any, unprivileged: tuple[dict[str, Any], str]
) -> None:
    config, table = unprivileged
    sink = build_sink({**config, "delivery": "exactly_once"})
    sink.bind(TargetBinding("orders_eo", 1))
    with pytest.raises(PermanentSinkError) as e:
        sink.init_sink()
    sink.cleanup_sink()
    assert "may not create" in str(e.value) and "Grant the user CREATE" in str(e.value)
    assert "delivery: at_least_once" in str(e.value)
    # The second fix works: at least once needs no offsets table.
    sink = build_sink({**config, "delivery": "at_least_once"})
    sink.init_sink()
    try:
        assert sink.send_batch(make_batch(5)).failed == ()
    finally:
        sink.cleanup_sink()
    assert count(db, table) == (5, 5)


def test_auto_writes_at_least_once_where_the_user_may_not_keep_the_offsets_table(
    db: Any, unprivileged: tuple[dict[str, Any], str], caplog: pytest.LogCaptureFixture
) -> None:
    """The default (auto) on a target whose user may not create the offsets table: the run
    writes at least once, says so in its log and in ``delivery_in_effect`` (the sink asset's
    ``delivery`` metadata), and an offsets change has nothing in the target to move."""
    config, table = unprivileged
    sink = build_sink(config)
    assert sink.config.delivery == "auto"
    sink.bind(TargetBinding("orders_eo", 1))
    assert offsets_of(sink.target_offsets()) is None
    with caplog.at_level("WARNING", logger="conveyor.sinks.sql"):
        sink.init_sink()
    try:
        assert sink.delivery_in_effect().startswith(
            "at_least_once (delivery auto: this user may not keep"
        )
        assert any("at least once into" in r.getMessage() for r in caplog.records)
        assert sink.send_batch(make_batch(5)).failed == ()
        assert sink.send_batch(make_batch(5)).failed == ()  # at least once: a re-send appends
    finally:
        sink.cleanup_sink()
    assert count(db, table) == (10, 5)
    sink.move_target_offsets("orders_eo", {"orders_eo": 2}, {TopicPartition("orders", 0): 0})


# -- positions name their log, destination and incarnation (issue 44, core/positions.py) ----------


def ledger(db: Any) -> str:
    """The quoted offsets table of ``db``."""
    return db.table("conveyor_offsets") if db.name == "postgres" else db.table(db.made[0])


def identity_rows(db: Any, writer: str) -> dict[tuple[str, int], tuple[int, str | None]]:
    """(topic, partition) -> (next_offset, log_id) of a writer's rows, the claim row left out."""
    q = '"partition"' if db.name == "postgres" else "`partition`"
    rows = db.run(
        f"SELECT topic, {q}, next_offset, log_id FROM {ledger(db)} WHERE writer = %s AND {q} >= 0",
        writer,
    )
    return {(t, int(p)): (int(o), lid) for t, p, o, lid in rows}


def scoped(writer: str, generation: int, log_id: str, **void: int) -> TargetBinding:
    from conveyor.core.positions import PositionScope

    binding = TargetBinding(writer, generation, PositionScope("dest", {"orders": log_id}))
    binding.void.update({TopicPartition("orders", int(p[1:])): o for p, o in void.items()})
    return binding


def test_a_position_of_another_log_covers_nothing_and_is_replaced(db: Any) -> None:
    """The topic was created again (a new log id): the new log's offsets 0..99 are below the
    old position 150, and every row of them is written, the row replaced, not raised."""
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    old = build_sink(db.config(table))
    old.bind(scoped("orders_eo@i1", 1, "c/old"))
    old.init_sink()
    try:
        old.send_batch(two_partitions(0, 150))
        assert identity_rows(db, "orders_eo@i1")[("orders", 0)] == (150, "c/old")
    finally:
        old.cleanup_sink()
    new = build_sink(db.config(table))
    new.bind(scoped("orders_eo@i1", 2, "c/new"))
    new.init_sink()
    try:
        assert new.send_batch(two_partitions(0, 100)).failed == ()
        # 300 rows of the old log, 200 of the new one (its ids 0..99 of each partition again)
        assert count(db, table) == (500, 300)
        assert identity_rows(db, "orders_eo@i1")[("orders", 0)] == (100, "c/new")
        # From then on its own position: a replay writes nothing.
        new.send_batch(two_partitions(0, 100))
        assert count(db, table) == (500, 300)
    finally:
        new.cleanup_sink()


def test_a_position_judged_outside_the_log_covers_nothing_until_replaced(db: Any) -> None:
    """Same log, but the run found the stored 150 past the log's end (the log was reset): its
    rows 0..99 are written, the position set back to 100, and is the run's own afterwards."""
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    first = build_sink(db.config(table))
    first.bind(scoped("orders_eo@i1", 1, "c/one"))
    first.init_sink()
    try:
        first.send_batch(two_partitions(0, 150))
    finally:
        first.cleanup_sink()
    run = build_sink(db.config(table))
    run.bind(scoped("orders_eo@i1", 2, "c/one", p0=150, p1=150))
    run.init_sink()
    try:
        run.send_batch(two_partitions(0, 100))
        assert identity_rows(db, "orders_eo@i1")[("orders", 0)] == (100, "c/one")
        assert count(db, table) == (500, 300)
        run.send_batch(two_partitions(0, 100))  # a replay of the run's own: nothing
        assert count(db, table) == (500, 300)
    finally:
        run.cleanup_sink()


def test_another_incarnation_and_a_retired_connector_find_nothing(db: Any) -> None:
    table = f"orders_{uuid.uuid4().hex[:8]}"
    db.create(table)
    sink = sink_for(db, table, writer="orders_eo@i1")
    try:
        sink.send_batch(two_partitions(0, 10))
    finally:
        sink.cleanup_sink()
    task = sink_for(db, table, writer="orders_eo.task2@i1")
    task.cleanup_sink()
    other = build_sink(db.config(table))
    other.bind(TargetBinding("orders_eo@i2", 1))
    assert other.target_offsets() is None  # a new incarnation of the name
    assert other.retire_target_offsets("orders_eo@i1") is None
    assert identity_rows(db, "orders_eo@i1") == {}
    assert db.run(f"SELECT count(*) FROM {ledger(db)}")[0][0] == 0  # claims too
