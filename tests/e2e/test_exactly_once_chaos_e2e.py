"""Issue 37's chaos test for PostgreSQL, MariaDB, Redis and Kafka under a real Dagster instance: a
connector with default settings but ``delivery: exactly_once`` into an append-only target (a table
without upsert keys; a Redis stream every message is XADDed to; a Kafka topic on the source's
broker, read with read_committed's rule) is killed with
-9 at random points, at least 20 times (seeded), some of them while the test holds the meta
store (the harness's SQLite file) in an EXCLUSIVE transaction, so that the target commits a
batch whose offsets the meta store cannot record; each time the run is relaunched. At the end
the table holds every message once: count = distinct = produced, and the offsets table's
offsets add up to what was produced.

The target restarted mid-transaction (PostgreSQL, MariaDB, Redis): each runs on a private
server of its own on a free port (tests/integration/pg_cluster.py, tests/private_servers.py;
the machine's shared servers are never restarted). Before ``CONVEYOR_E2E_CHAOS_RESTARTS`` (4)
of the kills, drawn from their own generator so that the kill points stay the seed's, the run
is stopped (SIGSTOP) while a backlog of 5,000 messages is produced, then, as it drains it,
stopped at random moments until the target shows one of its transactions open, and the server
is crashed while the run is stopped: PostgreSQL ``pg_ctl -m immediate``, MariaDB and Redis
SIGKILL, each started again on the same port and data (crash recovery; Redis replays its
fsync'd AOF). "Open" here: PostgreSQL, a session of ``application_name`` conveyor holding
its write lock on the table and not committing; MariaDB, an active InnoDB transaction with a
batch's rows written (SHOW ENGINE INNODB STATUS); Redis, a client inside ``MULTI`` with its
commands queued and no ``EXEC`` yet (not required: redis-py sends a whole transaction in one
write, and a run may drain its backlogs without one caught). Up to four
backlogs are tried; if none is caught, the server is restarted while the run waits. The same
run must ride the restart (Degraded by the lost connection, it reconnects and delivers
everything with its offsets, still STARTED); the drawn kill follows. At the end each SQL
target had at least one restart with a transaction open, and each such run was Degraded.

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
import re
import signal
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import pytest

from conveyor.core.positions import writer_id
from tests.e2e.conftest import FINISHED, SETTLE_S, DagsterHarness, produce, wait_for
from tests.e2e.test_lakehouse_e2e import kill_run
from tests.integration.pg_cluster import PrivateCluster, private_server
from tests.kafka_read_committed import Committed, Tail
from tests.private_servers import PrivateMariaDB, PrivateRedis, private_mariadb, private_redis

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1200)]

KILLS = int(os.environ.get("CONVEYOR_E2E_CHAOS_KILLS", "20"))
SEED = int(os.environ.get("CONVEYOR_E2E_CHAOS_SEED", "37"))
CHUNK = 500  # messages produced before and after each kill's point
TXN_CHUNK = 20_000  # a backlog the run, stopped meanwhile, then takes in large transactions
RESTARTS = int(os.environ.get("CONVEYOR_E2E_CHAOS_RESTARTS", "4"))
RESTART_CHUNK = 5_000  # the backlog being drained when the target is restarted
RESTART_TRIES = 4  # backlogs drained, at most, before one of its transactions is caught open
PARTITIONS = 3
TRANSFORM = {"decode": "json", "schema": "id BIGINT, name STRING, amount DOUBLE"}
WINS = "the target holds other positions than the meta store, and wins"


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
    """An append-only table ``orders`` in a fresh schema of a private PostgreSQL cluster
    (tests/integration/pg_cluster.py), which the test crash-restarts (``pg_ctl -m immediate``)."""

    def __init__(self, server: PrivateCluster) -> None:
        self.server, self.url = server, server.url
        self.schema = f"chaos_{uuid.uuid4().hex[:10]}"
        self.orders = f'"{self.schema}".orders'
        self.offsets_table = f'"{self.schema}".conveyor_offsets'
        self.partition = '"partition"'
        self.sql(f'CREATE SCHEMA "{self.schema}"')
        self.sql(f"CREATE TABLE {self.orders} (id bigint, name text, amount double precision)")

    def sink(self) -> dict[str, Any]:
        return {"type": "postgres", "url": self.url, "schema": self.schema, "table": "orders"}

    def open_transactions(self) -> int:
        """The connector's sessions in a transaction that has written to the table (its lock
        on it held) and is not committing: with the run stopped, none can begin to commit."""
        rows = self.sql(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.relation = %s::regclass AND l.mode = 'RowExclusiveLock' "
            "AND a.application_name = 'conveyor' AND a.query NOT ILIKE 'commit%%' "
            "AND a.state IN ('idle in transaction', 'active')",
            self.orders,
        )
        return int(rows[0][0])

    def sql(self, text: str, *args: Any) -> list[tuple[Any, ...]]:
        conn = psycopg2.connect(self.url)
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
    """An append-only InnoDB table in a private MariaDB (database ``test``,
    tests/private_servers.py), which the test SIGKILLs and starts again (InnoDB's crash
    recovery), and an offsets table of its own."""

    def __init__(self, server: PrivateMariaDB) -> None:
        self.server = server
        tag = uuid.uuid4().hex[:10]
        self.orders, self.offsets_table = f"chaos_{tag}", f"chaos_offsets_{tag}"
        self.partition = "`partition`"
        self.sql(
            f"CREATE TABLE {self.orders} (id bigint, name varchar(100), amount double) ENGINE=InnoDB"
        )

    def sink(self) -> dict[str, Any]:
        return {
            "type": "mysql",
            "url": self.server.url,
            "table": self.orders,
            "offsets_table": self.offsets_table,
        }

    def open_transactions(self) -> int:
        """Sessions' InnoDB transactions that wrote a batch (more undo entries than the offsets
        rows a claim writes), active, not committing: SHOW ENGINE INNODB STATUS, made when
        asked (information_schema.innodb_trx is a cache refreshed at most every 0.1 s)."""
        status = str(self.sql("SHOW ENGINE INNODB STATUS")[0][2])
        found = 0
        for trx in status.split("---TRANSACTION ")[1:]:
            head = trx.split("\n", 1)[0]
            undo = re.search(r"undo log entries (\d+)", trx)
            thread = re.search(r"thread id (\d+)", trx)
            if (
                "ACTIVE" in head
                and "PREPARED" not in head
                and undo is not None
                and int(undo.group(1)) > 2 * PARTITIONS
                and thread is not None
                and thread.group(1) != "0"
            ):
                found += 1
        return found

    def sql(self, text: str, *args: Any) -> list[tuple[Any, ...]]:
        conn = self.server.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(text, args or None)
                return list(cur.fetchall()) if cur.description else []
        finally:
            conn.close()

    def drop(self) -> None:
        self.sql(f"DROP TABLE IF EXISTS {self.orders}, {self.offsets_table}")


class Redis:
    """A stream in a private Redis (AOF, ``appendfsync always``: tests/private_servers.py)
    that every message is XADDed to (not idempotent: a message written twice is two entries),
    and the writer's offsets hash. The test SIGKILLs the server and starts it again (AOF
    replay)."""

    def __init__(self, server: PrivateRedis) -> None:
        self.server = server
        self.r = server.client()
        self.prefix = f"chaos:{uuid.uuid4().hex[:10]}"
        self.stream = f"{self.prefix}:orders"

    def sink(self) -> dict[str, Any]:
        return {
            "type": "redis",
            "host": "127.0.0.1",
            "port": self.server.port,
            "commands": [f"XADD {self.stream} * id ${{payload.id}}"],
        }

    def open_transactions(self) -> int:
        """Clients inside ``MULTI`` (flag ``x``): a transaction the server has begun to
        queue and not yet executed."""
        return sum("x" in c["flags"] for c in self.r.client_list())

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
SERVERS = {"postgres": private_server, "mysql": private_mariadb, "redis": private_redis}


@pytest.fixture(params=list(TARGETS))
def target(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The target, on a private server of its own where the test restarts it (all but Kafka:
    the source's embedded broker); the server is killed and its files removed after."""
    kind = TARGETS[request.param]
    with contextlib.ExitStack() as stack:
        if kind is KafkaTopic:
            made = kind(request.getfixturevalue("tansu"))
        else:
            made = kind(stack.enter_context(SERVERS[request.param]()))
        try:
            yield made
        finally:
            made.drop()


def restart_in_a_transaction(
    target: Any, pid: int, drained: Callable[[], bool], rng: random.Random
) -> bool:
    """Stop the run process (SIGSTOP) at random moments while it drains its backlog until
    the target holds one of its transactions open, and crash-restart the target then, the run
    still stopped (True); False if the backlog was ``drained`` first (no restart). The run is
    continued (SIGCONT) either way."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        os.kill(pid, signal.SIGSTOP)
        try:
            if target.open_transactions() > 0:
                target.server.crash_restart()
                return True
            if drained():
                return False
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(rng.uniform(0, 0.01))  # the next stop's random point, not a wait
    raise AssertionError(f"the backlog not delivered in {SETTLE_S} s")


def step_errors(dagster: DagsterHarness, run_id: str) -> str:
    """The run's errors with their causes and stacks (the run log shows their first line)."""
    with dagster.instance() as inst:
        out = []
        for rec in inst.all_logs(run_id):
            event = rec.dagster_event
            err = getattr(event.event_specific_data, "error", None) if event else None
            if err is not None:
                out.append(err.to_string())
        return "\n".join(out)


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
        # Under the connector's writer id (``<name>@<incarnation>``, core/positions.py).
        incarnation = dagster.store.get(name).incarnation
        return target.offsets(writer_id(name, incarnation) if incarnation else name)

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
    # The target's restarts (all but Kafka): before the kills drawn here, from their own
    # generator so that the kill points stay the seed's. (kill index, transaction open?)
    restarts_rng = random.Random(f"{SEED}:restarts")
    restart_at = (
        set()
        if isinstance(target, KafkaTopic)
        else set(restarts_rng.sample(range(KILLS), min(RESTARTS, KILLS)))
    )
    restarts: list[tuple[int, bool]] = []
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
            if k in restart_at:
                pid = dagster.store.get(name).run_pid
                stops = random.Random(restarts_rng.random())
                for _ in range(RESTART_TRIES):
                    os.kill(pid, signal.SIGSTOP)  # a backlog: the next transactions are long
                    try:
                        more(RESTART_CHUNK)
                    finally:
                        os.kill(pid, signal.SIGCONT)
                    drained = lambda: offsets() == produced  # noqa: E731 - cheaper than rows()
                    if hit := restart_in_a_transaction(target, pid, drained, stops):
                        break
                else:  # no transaction caught open: restarted while the run waits
                    target.server.crash_restart()
                restarts.append((k, hit))
                # The same run rides the restart: it delivers everything, offsets with it.
                try:
                    wait_for(lambda: offsets() == produced, SETTLE_S, f"run {k} after restart")
                except AssertionError as e:
                    log = dagster.run_log(run, tail=200)
                    raise AssertionError(f"{e}\n{log}\n{step_errors(dagster, run)}") from None
                assert dagster.run_status(run) == "STARTED", dagster.run_log(run)
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
    if restart_at:
        # A restart that cut a transaction off made its run Degraded; the run recovered on
        # its own (it delivered the rest above, still the same run).
        assert len(restarts) == len(restart_at) >= 3, restarts
        history = dagster.store.history(name, limit=10_000)
        caught = [k for k, hit in restarts if hit]
        degraded = {h.run_id for h in history if h.to_status == "Degraded"}
        assert {runs[k] for k in caught} <= degraded, (restarts, degraded)
        if not isinstance(target, Redis):
            assert caught, "no restart caught the connector's transaction open"
        print(f"{len(restarts)} target restarts, {len(caught)} with a transaction open")
    # The meta store missed the commits made while it was locked: a later run took the
    # target's offsets over it (else the test would not have tested the window).
    assert locked_kills, "the seed drew no kill with the meta store locked"
    logs = [dagster.run_log(r, tail=400) for r in runs[min(locked_kills) + 1 :]]
    assert any(WINS in log for log in logs), logs[-1]
    print(f"{KILLS} kills ({len(locked_kills)} with the meta store locked) in {elapsed:.0f} s")
