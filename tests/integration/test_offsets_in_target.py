"""Offsets changes of a connector whose target keeps its offsets (``delivery: exactly_once``),
through ``Operations`` (what the REST API and the CLI call) against the machine's PostgreSQL,
MariaDB and Redis and a tansu broker: the change is made in the target first, fenced, then in the
meta store; a zombie run of the generation before it cannot commit afterwards; the next run starts
from the new offsets (the target's win on start, as ``sink_loop`` takes them) and writes the
re-read messages, once."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

from conveyor.brokers.kafka import KafkaSource
from conveyor.config.specs import load_source, resolved
from conveyor.control.operations import ConflictError, Operations
from conveyor.core.errors import FencedError, TransientSinkError
from conveyor.core.model import TopicPartition
from conveyor.core.positions import TargetBinding, writer_id
from conveyor.dagster.jobs.sink_loop import _binding, _start_positions
from conveyor.sinks import build_sink
from conveyor.store.meta import MetaStore
from tests.conftest import PG_URL
from tests.sinks.contract import make_batch
from tests.sinks.test_mysql import MYSQL_URL
from tests.sinks.test_redis import HOST, PORT

pytestmark = pytest.mark.integration

COLUMNS = {"id": "id", "p": "$partition", "o": "$offset"}


# -- the targets: where rows and offsets are, read on the test's own connections -----------------


class Postgres:
    kind = "postgres"

    def __init__(self, tag: str) -> None:
        import psycopg2

        self.schema = f"oit_{tag}"
        self.conn = psycopg2.connect(PG_URL)
        self.conn.autocommit = True

    def run(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(sql, args or None)
            return cur.fetchall() if cur.description else []

    def sink(self, topic: str) -> dict[str, Any]:
        return {
            "type": "postgres",
            "url": PG_URL,
            "schema": self.schema,
            "table": "rows",
            "create_table": True,
            "columns": COLUMNS,
            "delivery": "exactly_once",
        }

    def rows(self) -> list[tuple[int, int]]:
        return [(int(p), int(o)) for p, o in self.run(f'SELECT p, o FROM "{self.schema}".rows')]

    def held(self, writer: str) -> dict[TopicPartition, int]:
        rows = self.run(
            f'SELECT topic, "partition", next_offset FROM "{self.schema}".conveyor_offsets '
            'WHERE writer = %s AND "partition" >= 0',
            writer,
        )
        return {TopicPartition(t, p): o for t, p, o in rows}

    def close(self) -> None:
        self.run(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
        self.conn.close()


class MariaDB:
    kind = "mysql"

    def __init__(self, tag: str) -> None:
        import pymysql

        self.table, self.ledger = f"oit_{tag}", f"oit_offsets_{tag}"
        self.conn = pymysql.connect(host="127.0.0.1", user="root", database="test", autocommit=True)

    def run(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(sql, args or None)
            return list(cur.fetchall()) if cur.description else []

    def sink(self, topic: str) -> dict[str, Any]:
        return {
            "type": "mysql",
            "url": MYSQL_URL,
            "table": self.table,
            "create_table": True,
            "columns": COLUMNS,
            "delivery": "exactly_once",
            "offsets_table": self.ledger,
        }

    def rows(self) -> list[tuple[int, int]]:
        return [(int(p), int(o)) for p, o in self.run(f"SELECT p, o FROM `{self.table}`")]

    def held(self, writer: str) -> dict[TopicPartition, int]:
        rows = self.run(
            f"SELECT topic, `partition`, next_offset FROM `{self.ledger}` "
            "WHERE writer = %s AND `partition` >= 0",
            writer,
        )
        return {TopicPartition(t, p): o for t, p, o in rows}

    def close(self) -> None:
        self.run(f"DROP TABLE IF EXISTS `{self.table}`, `{self.ledger}`")
        self.conn.close()


class Redis:
    kind = "redis"

    def __init__(self, tag: str) -> None:
        import redis

        self.prefix = f"oit_{tag}"
        self.client = redis.Redis(host=HOST, port=PORT)
        self.names: list[str] = []  # the connectors whose offsets hashes go at the end

    def sink(self, topic: str) -> dict[str, Any]:
        return {
            "type": "redis",
            "host": HOST,
            "port": PORT,
            "commands": [f"RPUSH {self.prefix}:list ${{partition}}:${{offset}}"],
            "delivery": "exactly_once",
        }

    def rows(self) -> list[tuple[int, int]]:
        items = self.client.lrange(f"{self.prefix}:list", 0, -1)
        return [(int(p), int(o)) for p, o in (i.decode().split(":") for i in items)]

    def held(self, writer: str) -> dict[TopicPartition, int]:
        from conveyor.sinks import redis_transactions as rt

        return rt.parse_offsets(self.client.hgetall(rt.offsets_key(writer)))[0]

    def close(self) -> None:
        from conveyor.sinks import redis_transactions as rt

        self.client.delete(f"{self.prefix}:list")
        for name in self.names:
            for k in self.client.scan_iter(match=rt.offsets_key(name) + "*"):
                self.client.delete(k)
        self.client.close()


class Kafka:
    kind = "kafka"

    def __init__(self, tag: str, bootstrap: str) -> None:
        from tests.sinks.test_kafka import create_topic

        self.bootstrap, self.out = bootstrap, f"oit_out_{tag}"
        create_topic(bootstrap, self.out)

    def sink(self, topic: str) -> dict[str, Any]:
        return {
            "type": "kafka",
            "bootstrap_servers": self.bootstrap,
            "topic": self.out,
            "key": "${partition}:${offset}",
            "linger_ms": 1,
            "request_timeout_ms": 5_000,
            "delivery_timeout_ms": 15_000,
            "delivery": "exactly_once",
        }

    def rows(self, settle_s: float = 2.0) -> list[tuple[int, int]]:
        """Every record a read_committed consumer sees, until nothing new for ``settle_s``."""
        from confluent_kafka import Consumer
        from confluent_kafka import TopicPartition as Tp

        c = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"rc-{uuid.uuid4().hex}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
            }
        )
        c.assign([Tp(self.out, 0, 0)])
        keys: list[bytes] = []
        quiet = time.monotonic() + settle_s
        try:
            while time.monotonic() < quiet:
                m = c.poll(0.5)
                if m is not None and not m.error():
                    keys.append(m.key())
                    quiet = time.monotonic() + settle_s
        finally:
            c.close()
        return [(int(p), int(o)) for p, o in (k.decode().split(":") for k in keys)]

    def held(self, writer: str) -> dict[TopicPartition, int]:
        from conveyor.sinks.kafka_transactions import Transactions

        txn = Transactions({"bootstrap.servers": self.bootstrap}, TargetBinding(writer, 0), 10)
        return {tp: p.offset for tp, p in txn.read_offsets()[0].items()}

    def close(self) -> None:
        from tests.sinks.test_kafka import delete_topics

        delete_topics(self.bootstrap, self.out)


TARGETS = ["postgres", "mysql", "redis", "kafka"]


@pytest.fixture
def source(tansu: str) -> Iterator[str]:
    """The source topic (two partitions of 20 records): Kafka's group offsets need it to exist,
    and a reset to earliest reads its partitions."""
    from confluent_kafka import Producer

    from tests.sinks.test_kafka import create_topic, delete_topics

    topic = f"oit_src_{uuid.uuid4().hex[:8]}"
    create_topic(tansu, topic, partitions=2)
    # Records at the offsets the tests write and move to: a run judges its positions against
    # the log (core/positions.py), and a position past the log's end is not taken as stored.
    producer = Producer({"bootstrap.servers": tansu})
    for partition in (0, 1):
        for i in range(20):
            producer.produce(topic, value=str(i).encode(), partition=partition)
    assert producer.flush(30) == 0
    yield topic
    delete_topics(tansu, topic)


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest, tansu: str) -> Iterator[Any]:
    tag = uuid.uuid4().hex[:8]
    kinds = {"postgres": Postgres, "mysql": MariaDB, "redis": Redis}
    t = Kafka(tag, tansu) if request.param == "kafka" else kinds[request.param](tag)
    try:
        yield t
    finally:
        t.close()


@pytest.fixture
def ops(tmp_path: Path) -> Iterator[Operations]:
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    store.ensure_schema()
    try:
        yield Operations(store, directory=tmp_path / "connectors", actor="the test")
    finally:
        store.close()


# -- a connector's runs, as jobs/connector.py and sink_loop build them ----------------------------


def create(ops: Operations, target: Any, source: str, tansu: str) -> str:
    name = f"oit_{uuid.uuid4().hex[:8]}"
    spec = {
        "source": {"topics": [source], "bootstrap_servers": tansu},
        "sink": target.sink(source),
    }
    ops.put_config(name, spec)
    ops.stop(name)
    getattr(target, "names", []).append(name)
    return name


def wid(ops: Operations, name: str, writer: str | None = None) -> str:
    """The writer id a target keeps ``writer``'s (default: the connector's) positions under."""
    return writer_id(writer or name, ops.store.get(name).incarnation)


class Run:
    """A run by hand: it claims the connector (a new generation), binds its sink, and takes
    the target's positions over the meta store's, judged against the log
    (``sink_loop._start_positions``)."""

    def __init__(self, ops: Operations, name: str, writer: str | None = None) -> None:
        self.store, self.name = ops.store, name
        claim = ops.store.claim(
            name, run_id=uuid.uuid4().hex, expected_generation=None, holder_alive=lambda _: False
        )
        self.generation = claim.generation
        loaded = load_source(name, ops.store.get(name).spec_source)
        live = resolved(loaded)
        assert live.spec is not None
        self.sink = build_sink(live.sink)
        self.source = KafkaSource(live.spec.source, group_id=name)
        binding = _binding(live, claim, self.generation, writer or name, self.source)
        self.scope = binding.scope
        log = SimpleNamespace(log=logging.getLogger("test"))
        self.start, self.notes = _start_positions(
            log,  # type: ignore[arg-type]
            ops.store,
            self.source,
            self.sink,
            live,
            binding,
            None,
        )
        self.sink.init_sink()

    def send(self, batch: pa.Table, mirror: bool = True) -> None:
        """A batch written, then its offsets mirrored in the meta store (the committer)."""
        assert self.sink.send_batch(batch).failed == ()
        if mirror:
            ends = {
                TopicPartition(t, p): o + 1
                for t, p, o in zip(
                    batch.column("__topic").to_pylist(),
                    batch.column("__partition").to_pylist(),
                    batch.column("__offset").to_pylist(),
                    strict=True,
                )
            }
            self.store.commit(self.name, self.generation, ends, self.scope)

    def close(self) -> None:
        self.sink.cleanup_sink()
        self.source.close()


def messages(topic: str, ranges: dict[int, range]) -> pa.Table:
    """The messages of each partition's offsets (id = offset)."""
    return pa.concat_tables(
        [
            make_batch(len(r), start=r.start, topic=topic, partition=p)
            for p, r in ranges.items()
            if len(r)
        ]
    )


def expected(ranges: list[dict[int, range]]) -> list[tuple[int, int]]:
    return sorted((p, o) for d in ranges for p, r in d.items() for o in r)


# -- the tests ------------------------------------------------------------------------------------


def test_a_reset_backwards_moves_the_target_fences_a_zombie_and_the_next_run_rereads(
    ops: Operations, target: Any, source: str, tansu: str
) -> None:
    name = create(ops, target, source, tansu)
    p0, p1 = TopicPartition(source, 0), TopicPartition(source, 1)
    first = {0: range(0, 10), 1: range(0, 10)}
    zombie = Run(ops, name)
    try:
        assert zombie.start == {}
        zombie.send(messages(source, first))
        assert target.held(wid(ops, name)) == {p0: 10, p1: 10}
        ops.stop(name)
        new = ops.reset_offsets_to(name, to=f"{source}:0:3")
        assert new == {p0: 3}
        # Both moved: the target (backwards: a reset overwrites) and its mirror.
        assert target.held(wid(ops, name)) == {p0: 3, p1: 10}
        assert ops.store.committed_offsets(name) == {p0: 3, p1: 10}
        # The run of the generation before the reset cannot commit any more.
        with pytest.raises((FencedError, TransientSinkError)):
            zombie.sink.send_batch(messages(source, {0: range(10, 15), 1: range(10, 15)}))
    finally:
        zombie.close()
    assert sorted(target.rows()) == expected([first])
    run = Run(ops, name)
    try:
        assert run.start == {p0: 3, p1: 10}, run.notes
        again = {0: range(3, 12), 1: range(10, 12)}  # what the source reads from there
        run.send(messages(source, again))
        run.send(messages(source, again))  # sent twice: written once
        assert target.held(wid(ops, name)) == {p0: 12, p1: 12}
    finally:
        run.close()
    assert sorted(target.rows()) == expected([first, again])


def test_patch_and_delete_move_the_target_and_the_meta_store(
    ops: Operations, target: Any, source: str, tansu: str
) -> None:
    name = create(ops, target, source, tansu)
    p0, p1 = TopicPartition(source, 0), TopicPartition(source, 1)
    first = {0: range(0, 6), 1: range(0, 6)}
    run = Run(ops, name)
    try:
        run.send(messages(source, first))
    finally:
        run.close()
    ops.stop(name)
    body = {
        "offsets": [
            {
                "partition": {"kafka_topic": source, "kafka_partition": 0},
                "offset": {"kafka_offset": 2},
            },
            {"partition": {"kafka_topic": source, "kafka_partition": 1}, "offset": None},
        ]
    }
    ops.alter_offsets(name, body)
    assert target.held(wid(ops, name)) == {p0: 2}
    assert ops.store.committed_offsets(name) == {p0: 2}
    ops.reset_offsets(name)
    assert target.held(wid(ops, name)) == {}
    assert ops.store.committed_offsets(name) == {}
    ops.reset_offsets_to(name, to="earliest")
    assert target.held(wid(ops, name)) == {p0: 0, p1: 0}
    assert ops.store.committed_offsets(name) == {p0: 0, p1: 0}
    run = Run(ops, name)
    try:
        assert run.start == {p0: 0, p1: 0}
        run.send(messages(source, first))
    finally:
        run.close()
    assert sorted(target.rows()) == expected([first, first])


@pytest.mark.parametrize("target", ["postgres", "mysql", "redis"], indirect=True)
def test_task_writers_move_and_a_backfill_writer_does_not(
    ops: Operations, target: Any, source: str, tansu: str
) -> None:
    """The connector's partition tasks are its writers too (one the meta store no longer
    knows included); a backfill's writer is not the connector's and keeps its offsets."""
    name = create(ops, target, source, tansu)
    p0, p1 = TopicPartition(source, 0), TopicPartition(source, 1)
    writers = {f"{name}.task3": {0: range(0, 4)}, f"{name}.backfill-ab12": {0: range(0, 5)}}
    for writer, ranges in writers.items():
        run = Run(ops, name, writer=writer)
        try:
            run.send(messages(source, ranges), mirror=False)
        finally:
            run.close()
    ops.stop(name)
    ops.reset_offsets_to(name, to=f"{source}:0:1,{source}:1:7")
    assert target.held(wid(ops, name, f"{name}.task3")) == {p0: 1}
    assert target.held(wid(ops, name, f"{name}.backfill-ab12")) == {p0: 5}
    assert target.held(wid(ops, name)) == {p1: 7}  # held by no writer: the connector's own
    assert ops.store.committed_offsets(name) == {p0: 1, p1: 7}


def test_a_sink_that_cannot_move_them_refuses_and_nothing_changes(
    ops: Operations, source: str
) -> None:
    name = f"oit_{uuid.uuid4().hex[:8]}"
    sink = {"type": "delta", "path": f"delta/{name}"}  # never written: refused before
    ops.put_config(name, {"source": {"topics": [source]}, "sink": sink})
    ops.stop(name)
    ops.store.reset_offsets(name, {TopicPartition(source, 0): 4})
    with pytest.raises(ConflictError, match="commit without rows"):
        ops.reset_offsets(name)
    assert ops.store.committed_offsets(name) == {TopicPartition(source, 0): 4}
