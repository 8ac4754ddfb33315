"""Issue 37's chaos test for PostgreSQL, MariaDB, Redis and Kafka under a real Dagster instance: a
connector with default settings but ``delivery: exactly_once`` into an append-only target (a table
without upsert keys; a Redis stream every message is XADDed to; a Kafka topic on the source's
broker, read with read_committed's rule) is killed with
-9 at random points, at least 20 times (seeded), some of them while the test holds the meta
store (the harness's SQLite file) in an EXCLUSIVE transaction, so that the target commits a
batch whose offsets the meta store cannot record; each time the run is relaunched. At the end
the table holds every message once: count = distinct = produced, and the offsets table's
offsets add up to what was produced.

Kafka: the output topic is read from its raw record batches with read_committed's rule applied
here (tests/kafka_read_committed.py), since tansu's own read_committed Fetch hands out aborted
records too; at the end no transaction is left without its marker. Some kills land with a
transaction open: the run is stopped (SIGSTOP) while a backlog is produced, so that its next
transactions are large, then stopped at random moments until the topic holds records it has not
committed, and killed; the next run's producer fences the id and the broker aborts that
transaction, whose records stay in the log, skipped. The broker is not restarted
mid-transaction: tansu keeps its log in memory only (this build has no other storage engine), so
a restart loses the source and the output topics alike."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest

from tests.conftest import PG_URL
from tests.e2e.conftest import FINISHED, SETTLE_S, DagsterHarness, produce, wait_for
from tests.e2e.test_lakehouse_e2e import kill_run
from tests.kafka_read_committed import Committed, Tail
from tests.sinks.test_mysql import MYSQL_URL
from tests.sinks.test_sql_exactly_once import mysql_connect

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1200)]

KILLS = int(os.environ.get("CONVEYOR_E2E_CHAOS_KILLS", "20"))
SEED = int(os.environ.get("CONVEYOR_E2E_CHAOS_SEED", "37"))
CHUNK = 500  # messages produced before and after each kill's point
TXN_CHUNK = 20_000  # a backlog the run, stopped meanwhile, then takes in large transactions
PARTITIONS = 3
TRANSFORM = {"decode": "json", "schema": "id BIGINT, name STRING, amount DOUBLE"}
WINS = "the target holds other offsets than the meta store, and wins"


class SqlTarget:
    """What the test asks of an SQL target: rows (count, distinct), ids, the writer's offsets."""

    orders: str
    offsets_table: str
    partition: str

    def sql(self, text: str, *args: Any) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def counts(self) -> tuple[int, int]:
        c, d = self.sql(f"SELECT count(*), count(DISTINCT id) FROM {self.orders}")[0]
        return int(c), int(d)

    def ids(self) -> set[int]:
        return {int(i) for (i,) in self.sql(f"SELECT id FROM {self.orders}")}

    def offsets(self, writer: str) -> int:
        rows = self.sql(
            f"SELECT sum(next_offset) FROM {self.offsets_table} WHERE writer = %s "
            f"AND {self.partition} >= 0",
            writer,
        )
        return int(rows[0][0] or 0)


class Postgres(SqlTarget):
    """An append-only table ``orders`` in a fresh schema of the machine's PostgreSQL."""

    def __init__(self) -> None:
        self.schema = f"chaos_{uuid.uuid4().hex[:10]}"
        self.orders = f'"{self.schema}".orders'
        self.offsets_table = f'"{self.schema}".conveyor_offsets'
        self.partition = '"partition"'
        self.sql(f'CREATE SCHEMA "{self.schema}"')
        self.sql(f"CREATE TABLE {self.orders} (id bigint, name text, amount double precision)")

    def sink(self) -> dict[str, Any]:
        return {"type": "postgres", "url": PG_URL, "schema": self.schema, "table": "orders"}

    def sql(self, text: str, *args: Any) -> list[tuple[Any, ...]]:
        conn = psycopg2.connect(PG_URL)
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute(text, args or None)
                return cur.fetchall() if cur.description else []
        finally:
            conn.close()

    def drop(self) -> None:
        self.sql(f'DROP SCHEMA "{self.schema}" CASCADE')


class MariaDB(SqlTarget):
    """An append-only InnoDB table in the machine's MariaDB (database ``test``), and an
    offsets table of its own."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:10]
        self.orders, self.offsets_table = f"chaos_{tag}", f"chaos_offsets_{tag}"
        self.partition = "`partition`"
        self.sql(
            f"CREATE TABLE {self.orders} (id bigint, name varchar(100), amount double) ENGINE=InnoDB"
        )

    def sink(self) -> dict[str, Any]:
        return {
            "type": "mysql",
            "url": MYSQL_URL,
            "table": self.orders,
            "offsets_table": self.offsets_table,
        }

    def sql(self, text: str, *args: Any) -> list[tuple[Any, ...]]:
        conn = mysql_connect()
        try:
            with conn.cursor() as cur:
                cur.execute(text, args or None)
                return list(cur.fetchall()) if cur.description else []
        finally:
            conn.close()

    def drop(self) -> None:
        self.sql(f"DROP TABLE IF EXISTS {self.orders}, {self.offsets_table}")


class Redis:
    """A stream in the machine's Redis that every message is XADDed to (not idempotent: a
    message written twice is two entries), and the writer's offsets hash."""

    def __init__(self) -> None:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=6379)
        self.prefix = f"chaos:{uuid.uuid4().hex[:10]}"
        self.stream = f"{self.prefix}:orders"

    def sink(self) -> dict[str, Any]:
        return {"type": "redis", "commands": [f"XADD {self.stream} * id ${{payload.id}}"]}

    def counts(self) -> tuple[int, int]:
        ids = [int(f[b"id"]) for _, f in self.r.xrange(self.stream)]
        return len(ids), len(set(ids))

    def ids(self) -> set[int]:
        return {int(f[b"id"]) for _, f in self.r.xrange(self.stream)}

    def offsets(self, writer: str) -> int:
        from conveyor.sinks import redis_transactions as rt

        held, _ = rt.parse_offsets(self.r.hgetall(rt.offsets_key(writer)))
        return sum(held.values())

    def drop(self) -> None:
        from conveyor.sinks import redis_transactions as rt

        self.r.delete(self.stream)
        for key in self.r.scan_iter(rt.offsets_key("eo_*")):
            self.r.delete(key)


class KafkaTopic:
    """An output topic on the embedded broker (the source's cluster, as exactly_once needs),
    read with read_committed's rule applied to its raw record batches: tansu's own
    read_committed Fetch also hands out aborted records (tests/kafka_read_committed.py)."""

    def __init__(self, bootstrap: str) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        self.bootstrap = bootstrap
        self.topic = f"chaos_out_{uuid.uuid4().hex[:10]}"
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.admin.create_topics([NewTopic(self.topic, PARTITIONS, 1)])[self.topic].result(30)
        self.tail = Tail(bootstrap, self.topic, PARTITIONS)

    def sink(self) -> dict[str, Any]:
        return {"type": "kafka", "bootstrap_servers": self.bootstrap, "topic": self.topic}

    def read(self) -> Committed:
        return self.tail.poll()

    def freeze_in_a_transaction(self, pid: int, produced: int, rng: random.Random) -> bool:
        """Stop the run process (SIGSTOP) at random moments until the topic holds records of
        a transaction it has not committed (True: left stopped), or until all ``produced``
        are committed without one caught open (False: left running)."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            os.kill(pid, signal.SIGSTOP)
            log = self.read()  # the run frozen: no commit can come meanwhile
            if log.pending:
                return True
            os.kill(pid, signal.SIGCONT)
            if len(log.records) >= produced:
                return False
            time.sleep(rng.uniform(0, 0.05))  # the next stop's random point, not a wait
        raise AssertionError(f"{self.topic}: {produced} messages not committed in {SETTLE_S} s")

    def counts(self) -> tuple[int, int]:
        ids = [json.loads(v or b"null")["id"] for v in self.read().values()]
        return len(ids), len(set(ids))

    def ids(self) -> set[int]:
        return {int(json.loads(v or b"null")["id"]) for v in self.read().values()}

    def offsets(self, writer: str) -> int:
        from confluent_kafka import ConsumerGroupTopicPartitions

        from conveyor.sinks.kafka_transactions import transactional_id

        group = transactional_id(writer)
        asked = self.admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])
        found = asked[group].result(30)
        return sum(tp.offset for tp in found.topic_partitions if tp.offset >= 0)

    def drop(self) -> None:
        self.admin.delete_topics([self.topic])[self.topic].result(30)


TARGETS = {"postgres": Postgres, "mysql": MariaDB, "redis": Redis, "kafka": KafkaTopic}


@pytest.fixture(params=list(TARGETS))
def target(request: pytest.FixtureRequest) -> Iterator[Any]:
    kind = TARGETS[request.param]
    made = kind(request.getfixturevalue("tansu")) if kind is KafkaTopic else kind()
    try:
        yield made
    finally:
        made.drop()


@contextlib.contextmanager
def meta_store_locked(dagster: DagsterHarness) -> Iterator[None]:
    """The harness's SQLite meta store held in an EXCLUSIVE transaction (no other writer)."""
    path = dagster.meta_url.removeprefix("sqlite:///")
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        conn.execute("BEGIN EXCLUSIVE")
        yield
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        conn.close()


def test_kill_9_twenty_times_with_the_meta_store_locked_leaves_every_message_once(
    dagster: DagsterHarness, tansu: str, target: Any
) -> None:
    rng = random.Random(SEED)
    tag = uuid.uuid4().hex[:6]
    name, topic = f"eo_{tag}", f"eo_{tag}"

    def counts() -> tuple[int, int]:
        return target.counts()

    def offsets() -> int:
        return target.offsets(name)

    def rows() -> int:
        return counts()[0]

    dagster.write_spec(
        {
            "name": name,
            "source": {"topics": [topic]},
            "transform": TRANSFORM,
            "sink": {**target.sink(), "delivery": "exactly_once"},
        }
    )
    produced = 0

    def more(n: int = CHUNK) -> None:
        nonlocal produced
        produce(tansu, topic, n, partitions=PARTITIONS, start=produced)
        produced += n

    more()
    dagster.reload()
    run = dagster.launch(name)
    runs = [run]
    locked_kills: list[int] = []  # the kill's index: the run after it must find the target ahead
    open_kills: list[int] = []  # Kafka: killed with a transaction's records in the topic
    points = ["startup", "stream", "stream", "locked"]
    if isinstance(target, KafkaTopic):
        points.append("transaction")
    started = time.monotonic()
    try:
        for k in range(KILLS):
            assert dagster.wait_status(run, {"STARTED", *FINISHED}) == "STARTED", dagster.run_log(
                run
            )
            point = rng.choice(points)
            wait_for(
                lambda run=run: (r := dagster.store.get(name)).run_id == run and bool(r.run_pid),
                SETTLE_S,
                f"run {k} claimed the connector",
            )
            if point == "startup":
                # Anywhere in the run's first seconds: building the loop, its first batch.
                time.sleep(rng.uniform(0, 2))  # the kill's random point, not a wait
                kill_run(dagster, name, run)
            else:
                before = rows()
                more()
                wait_for(lambda b=before: rows() > b, SETTLE_S, f"run {k} delivers")
                if point == "locked":
                    with meta_store_locked(dagster):
                        during = rows()
                        more()
                        # The target commits a batch; the run's commit to the meta store waits.
                        wait_for(lambda d=during: rows() > d, SETTLE_S, f"run {k}: target commit")
                        time.sleep(rng.uniform(0, 0.5))  # the kill's random point, not a wait
                        kill_run(dagster, name, run)
                    locked_kills.append(k)
                elif point == "transaction":
                    pid = dagster.store.get(name).run_pid
                    os.kill(pid, signal.SIGSTOP)  # a backlog: the next transactions are long
                    try:
                        more(TXN_CHUNK)
                    finally:
                        os.kill(pid, signal.SIGCONT)
                    # Its own generator: the points drawn stay the seed's, however many stops.
                    stops = random.Random(rng.random())
                    if target.freeze_in_a_transaction(pid, produced, stops):
                        open_kills.append(k)
                    kill_run(dagster, name, run)  # SIGKILL ends a stopped process too
                else:
                    more()
                    time.sleep(rng.uniform(0, 1.5))  # the kill's random point, not a wait
                    kill_run(dagster, name, run)
            run = dagster.launch(name)
            runs.append(run)
        # The last run delivers the rest: every message once, the offsets at the end.
        wait_for(lambda: rows() >= produced, 300, f"all {produced} messages delivered")
        wait_for(lambda: offsets() == produced, SETTLE_S, "the offsets at the end of the topic")
    finally:
        with contextlib.suppress(AssertionError):
            dagster.wait_status(run, {"STARTED", *FINISHED})
        with contextlib.suppress(Exception):  # ended already
            dagster.terminate(run)
        dagster.wait_status(run, FINISHED)
    elapsed = time.monotonic() - started
    assert counts() == (produced, produced), (counts(), produced)
    assert target.ids() == set(range(produced))
    if isinstance(target, KafkaTopic):  # every transaction of every run ended with a marker
        log = target.read()
        assert log.pending == {}
        # Runs were killed with a transaction's records in the topic: those records are there,
        # aborted (librdkafka's read_committed on tansu would deliver them: duplicates).
        assert open_kills, "the seed drew no kill with a transaction open"
        assert log.aborted, "no kill left an aborted transaction's records in the topic"
        print(
            f"kafka: {len(open_kills)} kills with a transaction open, {len(log.aborted)} records "
            f"of aborted transactions, {log.markers} markers"
        )
    assert len(runs) == KILLS + 1
    # The meta store missed the commits made while it was locked: a later run took the
    # target's offsets over it (else the test would not have tested the window).
    assert locked_kills, "the seed drew no kill with the meta store locked"
    logs = [dagster.run_log(r, tail=400) for r in runs[min(locked_kills) + 1 :]]
    assert any(WINS in log for log in logs), logs[-1]
    print(f"{KILLS} kills ({len(locked_kills)} with the meta store locked) in {elapsed:.0f} s")
