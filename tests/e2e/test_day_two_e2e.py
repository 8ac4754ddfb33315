"""The second day (issue 44), under a real Dagster instance with the default settings, on Apache
Kafka 3.8 (KRaft, the log on disk, SASL/SCRAM: ``../shared/kafka``) and on the embedded broker
(tansu, in memory): every stored position names its log, destination and incarnation, so each
scenario ends with every message that should land landed once into PostgreSQL (``delivery``'s
default, ``auto``: exactly once here), or with the connector saying why not.

- a broker restarted with its log kept, while the connector runs (Apache Kafka);
- records deleted below the committed offset while the connector is stopped (Apache Kafka's
  ``delete_records``, as retention does): the run resumes at the log start and says what it
  gave up (last error, history, the ``given_up`` counter);
- the topic deleted and created again with new records while the connector is stopped;
- the connector deleted and created again under the same name, into a new table;
- the embedded broker started again empty under the same home (``conveyor dev`` restarted);
- a new home (meta store) whose connector has a name an older project used on the same database.

Runs are launched and stopped through the webserver's GraphQL API and the meta store, as the
UI and ``conveyor connector stop`` do; every row is counted in the real table.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from conveyor.brokers.embedded import start_embedded_broker
from conveyor.control.operations import Operations
from conveyor.core.model import ConnectorStatus
from tests.apache_kafka import ApacheKafka
from tests.e2e.conftest import FINISHED, DagsterHarness, dagster_webserver, wait_for

# Each scenario launches two to four runs (Spark, the code location) on a machine other tests
# load too: minutes each, bounded.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

LANDED_S = 240  # a run's start (Spark, the code location) and its rows, on a loaded machine


# -- the logs: Apache Kafka (SASL/SCRAM, its log on disk) and tansu (in memory) --------------------


class Log:
    """A Kafka-protocol log the connectors read, with the admin calls the scenarios make."""

    name = "log"

    def client_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def source(self, topic: str) -> dict[str, Any]:
        raise NotImplementedError

    def admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        return AdminClient(self.client_config())

    def create(self, topic: str, partitions: int = 2) -> None:
        """The topic, created (again: Kafka refuses while a deleted one is still going)."""
        from confluent_kafka.admin import NewTopic

        def created() -> bool:
            admin = self.admin()  # held until the result: a dropped handle ends the request
            try:
                admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(60)
            except Exception as e:  # noqa: BLE001 - marked for deletion: try again
                if "already exists" not in str(e) and "marked for deletion" not in str(e):
                    raise
            return self._partitions(topic) == partitions

        wait_for(created, 60, f"topic {topic}", interval=1.0)

    def _partitions(self, topic: str) -> int:
        # Every topic's metadata, not the topic's by name: a request by name creates a topic
        # that is not there on a broker that creates topics automatically (tansu, and Kafka's
        # default), and would bring a deleted topic straight back.
        md = self.admin().list_topics(timeout=10)
        t = md.topics.get(topic)
        return len(t.partitions) if t is not None and t.error is None else 0

    def delete(self, topic: str) -> None:
        admin = self.admin()
        admin.delete_topics([topic])[topic].result(60)
        wait_for(lambda: self._partitions(topic) == 0, 60, f"topic {topic} deleted")

    def produce(self, topic: str, ids: range, partitions: int = 2) -> None:
        """JSON messages {"id": i, "name": ...}, id i to partition i % ``partitions``."""
        from confluent_kafka import Producer

        p = Producer({**self.client_config(), "linger.ms": 5})
        for i in ids:
            p.produce(
                topic,
                key=str(i).encode(),
                value=json.dumps({"id": i, "name": f"n{i}"}).encode(),
                partition=i % partitions,
            )
        assert p.flush(60) == 0


class KafkaLog(Log):
    name = "apache-kafka"

    def __init__(self, broker: ApacheKafka):
        self.broker = broker

    def client_config(self) -> dict[str, Any]:
        return self.broker.client_config()

    def source(self, topic: str) -> dict[str, Any]:
        return self.broker.source_spec(topic)

    def delete_records(self, topic: str, partition: int, before: int) -> None:
        from confluent_kafka import TopicPartition as CTP

        admin = self.admin()
        futures = admin.delete_records([CTP(topic, partition, before)])
        for f in futures.values():
            f.result(60)


class TansuLog(Log):
    name = "tansu"

    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap

    def client_config(self) -> dict[str, Any]:
        return {"bootstrap.servers": self.bootstrap}

    def source(self, topic: str) -> dict[str, Any]:
        return {"topics": [topic], "bootstrap_servers": self.bootstrap}


@pytest.fixture(params=["apache-kafka", "tansu"])
def log(request: pytest.FixtureRequest, tansu: str) -> Log:
    if request.param == "tansu":
        return TansuLog(tansu)
    return KafkaLog(request.getfixturevalue("apache_kafka"))


# -- the connector and its table --------------------------------------------------------------------


def spec(name: str, source: dict[str, Any], pg_url: str, schema: str, table: str) -> dict:
    """The defaults but for what a PostgreSQL sink needs: delivery auto, start_from earliest,
    out_of_range earliest."""
    return {
        "name": name,
        "source": source,
        "transform": {"decode": "json", "schema": "id BIGINT, name STRING"},
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": schema,
            "table": table,
            "create_table": True,
        },
    }


def rows(pg_url: str, schema: str, table: str = "orders") -> tuple[int, int]:
    """(rows, distinct ids) in the table; (0, 0) before it exists."""
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{schema}"."{table}"',))
        if cur.fetchone()[0] is None:
            return 0, 0
        cur.execute(f'SELECT count(*), count(DISTINCT id) FROM "{schema}"."{table}"')
        n, d = cur.fetchone()
        return int(n), int(d)


def offsets_rows(pg_url: str, schema: str) -> list[str]:
    """The writer ids the schema's offsets table holds."""
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{schema}".conveyor_offsets',))
        if cur.fetchone()[0] is None:
            return []
        cur.execute(f'SELECT DISTINCT writer FROM "{schema}".conveyor_offsets ORDER BY 1')
        return [r[0] for r in cur.fetchall()]


class Connector:
    """One connector of a harness: its spec file, its runs, its rows."""

    def __init__(self, dagster: DagsterHarness, name: str, spec: dict[str, Any], pg: tuple):
        self.dagster, self.name, self.spec = dagster, name, spec
        self.pg_url, self.schema = pg
        self.table = spec["sink"]["table"]
        dagster.write_spec(spec)
        dagster.reload()
        self.run_id: str | None = None

    def rows(self) -> tuple[int, int]:
        return rows(self.pg_url, self.schema, self.table)

    def run_until(self, n: int, what: str) -> None:
        """Launch a run (as the UI does) and wait until the table holds ``n`` rows, Running."""
        self.run_id = self.dagster.launch(self.name)
        wait_for(lambda: self.rows()[0] >= n, LANDED_S, f"{what}: {n} rows")
        wait_for(
            lambda: self.dagster.store.get(self.name).status == ConnectorStatus.RUNNING,
            60,
            f"{what}: Running",
        )

    def stop(self) -> None:
        """``conveyor connector stop``: the run stops itself at its next heartbeat."""
        self.dagster.store.stop(self.name, reason="the test stops it")
        if self.run_id is not None:
            self.dagster.wait_status(self.run_id, FINISHED)
        wait_for(
            lambda: self.dagster.store.get(self.name).status == ConnectorStatus.STOPPED,
            60,
            "Stopped",
        )

    def settled(self, n: int, what: str) -> None:
        """Exactly ``n`` rows, each id once, a few seconds after they all arrived (a second copy
        of anything would show up meanwhile)."""
        wait_for(lambda: self.rows()[0] >= n, LANDED_S, f"{what}: {n} rows")
        time.sleep(3)
        assert self.rows() == (n, n), f"{what}: {self.rows()} (rows, distinct), want {n}"

    def history(self) -> list[str]:
        return [h.reason for h in self.dagster.store.history(self.name, limit=200)]


@pytest.fixture
def pg(pg_url: str, pg_schema: str) -> tuple[str, str]:
    return pg_url, pg_schema


def new_name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


# -- the scenarios ----------------------------------------------------------------------------------


def test_a_broker_restarted_with_its_log_kept_loses_nothing_and_writes_nothing_twice(
    dagster: DagsterHarness, apache_kafka: ApacheKafka, pg: tuple
) -> None:
    log = KafkaLog(apache_kafka)
    name, topic = new_name("d2_restart"), new_name("t")
    log.create(topic)
    log.produce(topic, range(0, 2_000))
    c = Connector(dagster, name, spec(name, log.source(topic), *pg, "orders"), pg)
    try:
        c.run_until(500, "before the restart")
        apache_kafka.restart()
        log.produce(topic, range(2_000, 3_000))
        c.settled(3_000, "after the restart")
        row = dagster.store.get(name)
        assert row.status == ConnectorStatus.RUNNING and not row.counters.get("given_up")
    finally:
        c.stop()


def test_records_deleted_below_the_committed_offset_are_given_up_loudly(
    dagster: DagsterHarness, apache_kafka: ApacheKafka, pg: tuple
) -> None:
    log = KafkaLog(apache_kafka)
    name, topic = new_name("d2_retention"), new_name("t")
    log.create(topic, partitions=1)
    log.produce(topic, range(0, 1_000), partitions=1)
    c = Connector(dagster, name, spec(name, log.source(topic), *pg, "orders"), pg)
    c.run_until(1_000, "first run")
    c.stop()
    # 1,000 more while it is stopped; retention takes the first 500 of them, never read.
    log.produce(topic, range(1_000, 2_000), partitions=1)
    log.delete_records(topic, 0, 1_500)
    try:
        c.run_until(1_500, "after delete_records")
        c.settled(1_500, "after delete_records")
        with psycopg2.connect(c.pg_url) as conn, conn.cursor() as cur:
            cur.execute(f'SELECT min(id), max(id) FROM "{c.schema}".orders WHERE id >= 1000')
            assert cur.fetchone() == (1_500, 1_999)  # 1,000..1,499 were deleted unread
        row = dagster.store.get(name)
        assert row.status == ConnectorStatus.RUNNING
        assert row.counters.get("given_up") == {f"{topic}[0]": 500}, row.counters
        assert row.last_error and "below the log start 1500" in row.last_error
        assert "500 message(s) given up" in row.last_error
        assert any("position:" in h and "below the log start" in h for h in c.history())
    finally:
        c.stop()


def test_a_topic_deleted_and_created_again_is_read_from_its_new_start(
    dagster: DagsterHarness, log: Log, pg: tuple
) -> None:
    name, topic = new_name("d2_recreate"), new_name("t")
    log.create(topic)
    log.produce(topic, range(0, 1_000))
    c = Connector(dagster, name, spec(name, log.source(topic), *pg, "orders"), pg)
    c.run_until(1_000, "first run")
    c.stop()
    log.delete(topic)
    log.create(topic)
    log.produce(topic, range(10_000, 11_300))  # offsets below the stored ones: a new log
    try:
        c.run_until(2_300, "after the topic was created again")
        c.settled(2_300, "after the topic was created again")
        row = dagster.store.get(name)
        assert row.status == ConnectorStatus.RUNNING
        assert row.last_error and "another log" in row.last_error, row.last_error
        assert row.counters["messages_out"] == 1_300  # this run's: the new log's records
    finally:
        c.stop()


def test_a_connector_deleted_and_created_again_delivers_into_its_new_table(
    dagster: DagsterHarness, log: Log, pg: tuple
) -> None:
    name, topic = new_name("d2_again"), new_name("t")
    log.create(topic)
    log.produce(topic, range(0, 1_000))
    first = Connector(dagster, name, spec(name, log.source(topic), *pg, "orders"), pg)
    first.run_until(1_000, "the first connector")
    first.stop()
    old = dagster.store.get(name).incarnation
    assert any(w.startswith(f"{name}@{old}") for w in offsets_rows(*pg))
    ops = Operations(dagster.store, directory=dagster.connectors, actor="the test")
    assert ops.delete(name) == []  # its positions in the target removed: nothing left
    assert not any(w.startswith(f"{name}@") for w in offsets_rows(*pg))
    log.produce(topic, range(1_000, 3_000))
    again = Connector(dagster, name, spec(name, log.source(topic), *pg, "orders_again"), pg)
    try:
        assert dagster.store.get(name).incarnation != old
        again.run_until(3_000, "created again")
        again.settled(3_000, "created again")
        assert first.rows() == (1_000, 1_000)  # the old table untouched
    finally:
        again.stop()


def test_the_embedded_broker_started_again_empty_under_the_same_home(
    dagster: DagsterHarness, pg: tuple, tmp_path: Path
) -> None:
    """``conveyor dev`` stopped and started again: its tansu starts empty on the same port."""
    name, topic = new_name("d2_dev"), "orders"
    first = start_embedded_broker(log_path=tmp_path / "tansu1.log")
    port = int(first.bootstrap.rsplit(":", 1)[1])
    log = TansuLog(first.bootstrap)
    c: Connector | None = None
    try:
        log.create(topic)
        log.produce(topic, range(0, 2_500))
        c = Connector(dagster, name, spec(name, log.source(topic), *pg, "orders"), pg)
        c.run_until(2_500, "before the restart")
        c.stop()
        first.stop()
        second = start_embedded_broker(port=port, log_path=tmp_path / "tansu2.log")
        try:
            log.create(topic)
            log.produce(topic, range(100_000, 103_000))
            c.run_until(5_500, "after the restart")
            c.settled(5_500, "after the restart")
            row = dagster.store.get(name)
            assert row.status == ConnectorStatus.RUNNING and "another log" in (row.last_error or "")
        finally:
            c.stop()
            second.stop()
    finally:
        first.stop()


@pytest.mark.timeout(1500)  # two webservers, four runs
def test_a_name_an_older_project_used_on_the_same_database_starts_fresh(
    tmp_path: Path, tansu: str, spark_remote: str, pg: tuple
) -> None:
    """Two homes (two meta stores) one after the other, one connector name, one database: the
    new project's connector is a new incarnation and reads its own table from the start."""
    name, topic = new_name("d2_reuse"), new_name("t")
    log = TansuLog(tansu)
    log.create(topic)
    log.produce(topic, range(0, 1_500))
    with dagster_webserver(tmp_path / "older", tansu, spark_remote) as older:
        c = Connector(older, name, spec(name, log.source(topic), *pg, "orders"), pg)
        # Several generations in the older project: the newer one starts at generation 1.
        for n in (500, 1_000, 1_500):
            c.run_until(n, "the older project")
            c.stop()
        assert older.store.get(name).generation >= 3
    log.produce(topic, range(1_500, 3_000))
    with dagster_webserver(tmp_path / "newer", tansu, spark_remote) as newer:
        fresh = Connector(newer, name, spec(name, log.source(topic), *pg, "orders_new"), pg)
        try:
            fresh.run_until(3_000, "the newer project")
            fresh.settled(3_000, "the newer project")
            assert newer.store.get(name).status == ConnectorStatus.RUNNING
        finally:
            fresh.stop()
