"""Benchmark: the whole connector (source, Spark, sink) vs a bare consume-and-write loop, per sink.

For MySQL, Redis, Kafka and RabbitMQ (PostgreSQL: bench/test_bench_pipeline.py), the
connector and the bare loop of bench/harness.py drain the same backlog of JSON orders
into a fresh target. The bare loop's writes are the sink's, with the same client
library and settings:

- MySQL (pymysql): ``executemany`` of the INSERT, 1,000 rows per statement, a commit
  per batch; the sink with ``rows_per_statement: 1000``.
- Redis (redis-py): ``HSET <prefix>:<id> name <name> amount <amount>`` in pipelines of
  1,000; the sink with the same command template and ``pipeline_size: 1000``.
- Kafka (kafka-python): an idempotent ``acks=all`` producer (linger 5 ms, 256 KiB
  batches) sending each row re-encoded as JSON with the source key, headers and
  timestamp, ``flush()`` per batch, every future checked; the sink, same settings.
- RabbitMQ (pika): ``confirm_delivery()`` and a persistent ``basic_publish`` per row
  (pika's public API waits for each confirm); the sink in its default pipelined mode.

After each run the target is checked: every id 0..N-1 (MySQL, Redis) or exactly N
messages (Kafka, RabbitMQ). Run with::

    .venv/bin/python -m pytest bench/test_bench_connectors.py -m bench -s -n 0
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench import harness as h
from conveyor.spark.session import spark_session

pytestmark = pytest.mark.bench

MYSQL_URL = os.environ.get("CONVEYOR_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
REDIS_HOST = os.environ.get("CONVEYOR_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("CONVEYOR_TEST_REDIS_PORT", "6379"))
AMQP_URL = os.environ.get("CONVEYOR_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
CHUNK = 1000


@dataclass
class Target:
    """One fresh target: the sink's config, the bare loop's writer, a check, a cleanup."""

    sink_config: dict[str, Any]
    bare: Callable[[list[dict[str, Any]], list[Any]], None]
    check: Callable[[], None]
    close: Callable[[], None]


def mysql_target(tansu: str) -> Target:
    import pymysql

    from conveyor.sinks import build_sink
    from conveyor.sinks.mysql import quote_identifier

    table = f"bench_{uuid.uuid4().hex[:8]}"
    cfg = {"type": "mysql", "url": MYSQL_URL, "table": table, "rows_per_statement": CHUNK}
    conn = pymysql.connect(**build_sink(cfg).connect_kwargs())  # type: ignore[attr-defined]
    q = quote_identifier(table)
    with conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {q} (id BIGINT PRIMARY KEY, name VARCHAR(255), amount DOUBLE)")
    stmt = f"INSERT INTO {q} (id, name, amount) VALUES (%s, %s, %s)"

    def bare(rows: list[dict[str, Any]], records: list[Any]) -> None:
        values = [(d["id"], d["name"], d["amount"]) for d in rows]
        with conn.cursor() as cur:
            for i in range(0, len(values), CHUNK):
                cur.executemany(stmt, values[i : i + CHUNK])
        conn.commit()

    def check() -> None:
        with conn.cursor() as cur:
            cur.execute(f"SELECT count(*), count(DISTINCT id), min(id), max(id) FROM {q}")
            assert cur.fetchone() == (h.N, h.N, 0, h.N - 1)
        conn.commit()

    def close() -> None:
        with conn.cursor() as cur:
            cur.execute(f"DROP TABLE {q}")
        conn.close()

    return Target(cfg, bare, check, close)


def redis_target(tansu: str) -> Target:
    import redis

    r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT)
    prefix = f"bench_{uuid.uuid4().hex[:8]}"
    cfg = {
        "type": "redis",
        "host": REDIS_HOST,
        "port": REDIS_PORT,
        "commands": [
            f"HSET {prefix}:${{payload.id}} name ${{payload.name}} amount ${{payload.amount}}"
        ],
        "pipeline_size": CHUNK,
    }

    def bare(rows: list[dict[str, Any]], records: list[Any]) -> None:
        for i in range(0, len(rows), CHUNK):
            pipe = r.pipeline(transaction=False)
            for d in rows[i : i + CHUNK]:
                pipe.execute_command(
                    "HSET", f"{prefix}:{d['id']}", "name", d["name"], "amount", d["amount"]
                )
            assert not any(isinstance(x, Exception) for x in pipe.execute(raise_on_error=False))

    def keys() -> Iterator[bytes]:
        return r.scan_iter(f"{prefix}:*", count=10_000)

    def check() -> None:
        ids = {int(k.rsplit(b":", 1)[1]) for k in keys()}
        assert ids == set(range(h.N))
        assert r.hgetall(f"{prefix}:7") == {b"name": b"name 7", b"amount": b"3.5"}

    def close() -> None:
        batch = list(keys())
        for i in range(0, len(batch), 10_000):
            r.delete(*batch[i : i + 10_000])
        r.close()

    return Target(cfg, bare, check, close)


def kafka_target(tansu: str) -> Target:
    from kafka import KafkaProducer

    from tests.sinks.test_kafka import consume_all, create_topic, delete_topics

    topic = f"bench_out_{uuid.uuid4().hex[:8]}"
    create_topic(tansu, topic)
    settings = {"linger_ms": 5, "batch_size": 256 * 1024}
    cfg = {"type": "kafka", "bootstrap_servers": tansu, "topic": topic, **settings}
    producer = KafkaProducer(
        bootstrap_servers=tansu, acks="all", enable_idempotence=True, **settings
    )

    def bare(rows: list[dict[str, Any]], records: list[Any]) -> None:
        futures = [
            producer.send(
                topic,
                value=json.dumps(d, separators=(",", ":")).encode(),
                key=rec.key,
                headers=list(rec.headers or []),
                timestamp_ms=rec.timestamp,
            )
            for d, rec in zip(rows, records, strict=True)
        ]
        producer.flush()
        assert all(f.succeeded() for f in futures)

    def check() -> None:
        out = consume_all(tansu, topic, timeout_s=120)
        assert len(out) == h.N
        assert {json.loads(m.value)["id"] for m in out} == set(range(h.N))

    def close() -> None:
        producer.close()
        delete_topics(tansu, topic)

    return Target(cfg, bare, check, close)


def rabbitmq_target(tansu: str) -> Target:
    import pika

    queue = f"bench_{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    ch = conn.channel()
    ch.queue_declare(queue, arguments={"x-expires": 600_000})
    ch.confirm_delivery()
    cfg = {"type": "rabbitmq", "url": AMQP_URL, "exchange": "", "routing_key": queue}

    def bare(rows: list[dict[str, Any]], records: list[Any]) -> None:
        for d, rec in zip(rows, records, strict=True):
            props = pika.BasicProperties(
                content_type="application/json",
                delivery_mode=2,
                message_id=f"{rec.topic}-{rec.partition}-{rec.offset}",
                headers={k: v.decode() for k, v in rec.headers or []},
            )
            ch.basic_publish("", queue, json.dumps(d, separators=(",", ":")).encode(), props)

    def check() -> None:
        admin = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
        try:
            count = admin.channel().queue_declare(queue, passive=True).method.message_count
        finally:
            admin.close()
        assert count == h.N

    def close() -> None:
        ch.queue_delete(queue)
        conn.close()

    return Target(cfg, bare, check, close)


TARGETS = {
    "mysql": mysql_target,
    "redis": redis_target,
    "kafka": kafka_target,
    "rabbitmq": rabbitmq_target,
}


@pytest.mark.parametrize("sink", list(TARGETS))
def test_connector_vs_bare_loop(
    sink: str, tansu: str, warm_spark_remote: str, tmp_path: Path, capsys: Any
) -> None:
    spark = spark_session(warm_spark_remote)
    current: dict[str, Target] = {}

    def fresh() -> tuple[str, Target]:
        topic = h.new_topic()
        h.produce(tansu, topic, h.N)
        current["t"] = TARGETS[sink](tansu)
        return topic, current["t"]

    def bare() -> h.Run:
        topic, t = fresh()
        return h.run_bare(tansu, topic, h.N, t.bare)

    def connector() -> h.Run:
        topic, t = fresh()
        return h.run_connector(tansu, spark, t.sink_config, topic, h.N, tmp_path)

    def check(label: str) -> None:
        try:
            current["t"].check()
        finally:
            current["t"].close()

    result = h.compare(f"tansu -> {sink}", bare, connector, check)
    with capsys.disabled():
        print("\n" + result.report())
