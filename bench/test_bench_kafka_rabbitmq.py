"""Benchmark: the Kafka and RabbitMQ sinks' ``send_batch`` vs a bare client loop doing the same writes.

Same run, same servers (tansu started by the fixture, the machine's RabbitMQ), same
messages: 10 batches of 10,000 decoded rows (``tests.sinks.contract.make_batch``: key,
one header, timestamp, JSON payload of id/name/amount). The bare loops start from the
same Arrow batch, as a hand-written consumer would after decoding:

- Kafka, per client (``sink.client``): the same library's producer (idempotent, acks=all,
  same linger/batch size), a call per row with key, headers and timestamp (confluent-kafka
  ``produce`` with a delivery callback, kafka-python ``send``), ``flush()``, then every
  delivery checked.
- RabbitMQ: ``BlockingChannel.confirm_delivery()`` and ``basic_publish`` per row
  (persistent, message_id, headers), i.e. pika's public API waiting for each confirm.

Only counts are asserted; throughputs and ratios are printed. Run with::

    /work/venv/bin/python -m pytest bench/test_bench_kafka_rabbitmq.py -m bench -s -n 0
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable

import pika
import pyarrow as pa
import pytest

from conveyor.sinks import build_sink
from conveyor.sinks.kafka import timestamp_ms
from tests.sinks.contract import make_batch
from tests.sinks.test_kafka import consume_all, create_topic, delete_topics

pytestmark = pytest.mark.bench

BATCHES = int(os.environ.get("CONVEYOR_BENCH_BATCHES", "10"))
ROWS = int(os.environ.get("CONVEYOR_BENCH_BATCH", "10000"))
AMQP_URL = os.environ.get("CONVEYOR_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def batches() -> list[pa.Table]:
    return [make_batch(ROWS, start=i * ROWS) for i in range(BATCHES)]


def timed(label: str, fn: Callable[[pa.Table], None], data: list[pa.Table]) -> float:
    start, cpu = time.perf_counter(), time.thread_time()
    for b in data:
        fn(b)
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
    rate = BATCHES * ROWS / elapsed
    per = cpu / (BATCHES * ROWS) * 100_000
    print(
        f"  {label:<42} {BATCHES * ROWS:>7} msgs in {elapsed:6.2f} s = {rate:>9,.0f} msgs/s, "
        f"calling thread's CPU {per:.2f} s per 100K"
    )
    return rate


def report(title: str, sink_rate: float, bare_rate: float) -> None:
    print(f"  {title}: sink / bare = {sink_rate / bare_rate:.2f}")


# -- Kafka ---------------------------------------------------------------------------------------


def _bare_confluent(tansu: str, topic: str, settings: dict[str, int]) -> tuple[Callable, Callable]:
    """What a user writes with confluent-kafka: ``produce`` per row with key, headers,
    timestamp and a delivery callback, ``flush()``, every delivery checked."""
    from confluent_kafka import Producer

    producer = Producer(
        {
            "bootstrap.servers": tansu,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": settings["linger_ms"],
            "batch.size": settings["batch_size"],
            "queue.buffering.max.messages": 2_000_000,
        }
    )

    def bare(b: pa.Table) -> None:
        errors: list[object] = []

        def delivered(err: object, _msg: object) -> None:
            if err is not None:
                errors.append(err)

        for row in b.to_pylist():
            value = json.dumps(
                {"id": row["id"], "name": row["name"], "amount": row["amount"]},
                separators=(",", ":"),
            ).encode()
            producer.produce(
                topic,
                value=value,
                key=row["__key"],
                headers=[(h["key"], h["value"]) for h in row["__headers"]],
                timestamp=timestamp_ms(row["__timestamp"]) or 0,
                on_delivery=delivered,
            )
        assert producer.flush(60) == 0 and not errors

    return bare, lambda: producer.flush(10)


def _bare_kafka_python(
    tansu: str, topic: str, settings: dict[str, int]
) -> tuple[Callable, Callable]:
    """What a user writes with kafka-python: ``send`` per row, ``flush()``, every future checked."""
    from kafka import KafkaProducer

    producer = KafkaProducer(
        bootstrap_servers=tansu, acks="all", enable_idempotence=True, **settings
    )

    def bare(b: pa.Table) -> None:
        futures = []
        for row in b.to_pylist():
            value = json.dumps(
                {"id": row["id"], "name": row["name"], "amount": row["amount"]},
                separators=(",", ":"),
            ).encode()
            headers = [(h["key"], h["value"]) for h in row["__headers"]]
            futures.append(
                producer.send(
                    topic,
                    value=value,
                    key=row["__key"],
                    headers=headers,
                    timestamp_ms=timestamp_ms(row["__timestamp"]),
                )
            )
        producer.flush()
        assert all(f.succeeded() for f in futures)

    return bare, producer.close


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_bench_kafka_sink_vs_bare_producer(tansu: str, client: str) -> None:
    """The sink with ``client`` against a bare loop of the same client library."""
    data = batches()
    t_sink, t_bare = f"bench_ks_{uuid.uuid4().hex[:8]}", f"bench_kb_{uuid.uuid4().hex[:8]}"
    create_topic(tansu, t_sink)
    create_topic(tansu, t_bare)
    settings = {"linger_ms": 5, "batch_size": 256 * 1024}
    print(
        f"\nKafka ({client}) -> tansu at {tansu}: {BATCHES} batches x {ROWS} rows, acks=all, "
        "idempotent, linger 5 ms, batch 256 KiB"
    )
    try:
        sink = build_sink(
            {
                "type": "kafka",
                "bootstrap_servers": tansu,
                "topic": t_sink,
                "client": client,
                **settings,
            }
        )
        sink.init_sink()

        def via_sink(b: pa.Table) -> None:
            assert sink.send_batch(b).failed == ()

        make = _bare_confluent if client == "confluent" else _bare_kafka_python
        bare, close = make(tansu, t_bare, settings)
        try:
            bare_rate = timed(f"bare {client} producer loop", bare, data)
            sink_rate = timed(f"KafkaSink.send_batch ({client})", via_sink, data)
        finally:
            close()
            sink.cleanup_sink()
        report(f"Kafka ({client})", sink_rate, bare_rate)
        assert len(consume_all(tansu, t_sink, timeout_s=120)) == BATCHES * ROWS
        assert len(consume_all(tansu, t_bare, timeout_s=120)) == BATCHES * ROWS
    finally:
        delete_topics(tansu, t_sink, t_bare)


# -- RabbitMQ ------------------------------------------------------------------------------------


def _queue_count(queue: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


def _purge(queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        conn.channel().queue_purge(queue)
    finally:
        conn.close()


def test_bench_rabbitmq_sink_vs_bare_pika() -> None:
    data = batches()
    queue = f"bench_rq_{uuid.uuid4().hex[:8]}"
    admin = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    admin.channel().queue_declare(queue, arguments={"x-expires": 600_000})
    admin.close()
    print(
        f"\nRabbitMQ at {AMQP_URL.rsplit('@', 1)[-1]}: {BATCHES} batches x {ROWS} rows, default exchange -> one queue, persistent, confirms"
    )
    total = BATCHES * ROWS
    try:
        conn = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
        ch = conn.channel()
        ch.confirm_delivery()

        def bare(b: pa.Table) -> None:
            for row in b.to_pylist():
                body = json.dumps(
                    {"id": row["id"], "name": row["name"], "amount": row["amount"]},
                    separators=(",", ":"),
                ).encode()
                headers = {h["key"]: h["value"].decode() for h in row["__headers"]}
                props = pika.BasicProperties(
                    content_type="application/json",
                    delivery_mode=2,
                    message_id=f"{row['__topic']}-{row['__partition']}-{row['__offset']}",
                    headers=headers,
                )
                ch.basic_publish("", queue, body, props)

        try:
            bare_rate = timed("bare pika publish, confirm per message", bare, data)
        finally:
            conn.close()
        assert _queue_count(queue) == total
        _purge(queue)

        rates = {}
        for mode in ("pipelined", "per_message"):
            sink = build_sink(
                {
                    "type": "rabbitmq",
                    "url": AMQP_URL,
                    "exchange": "",
                    "routing_key": queue,
                    "confirm_mode": mode,
                }
            )
            sink.init_sink()

            def via_sink(b: pa.Table, sink=sink) -> None:
                assert sink.send_batch(b).failed == ()

            try:
                rates[mode] = timed(f"RabbitMQSink.send_batch ({mode})", via_sink, data)
            finally:
                sink.cleanup_sink()
            assert _queue_count(queue) == total
            _purge(queue)
        report("RabbitMQ pipelined confirms vs bare", rates["pipelined"], bare_rate)
        report("RabbitMQ per-message confirms vs bare", rates["per_message"], bare_rate)
    finally:
        admin = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
        admin.channel().queue_delete(queue)
        admin.close()
