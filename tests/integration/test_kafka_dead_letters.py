"""Dead letters to a Kafka topic ``<connector>.dlq`` on a real tansu broker."""

from __future__ import annotations

import uuid

import pytest
from kafka import KafkaConsumer

from conveyor.core.connection import KafkaConnection
from conveyor.core.engine.failure import FailedMessage
from conveyor.core.engine.loop import DeadLetter
from conveyor.spark.deadletters import KafkaDeadLetters

pytestmark = pytest.mark.integration


def test_letters_keep_the_original_message_and_carry_where_and_why(tansu):
    connector = f"dl_{uuid.uuid4().hex[:6]}"
    topic = f"{connector}.dlq"
    store = KafkaDeadLetters(
        KafkaConnection(bootstrap_servers=tansu), topic, connector=connector, generation=4
    )
    letters = [
        DeadLetter(
            failed=FailedMessage("orders", 1, 100 + i, f"violates check {i}", "data", attempts=3),
            key=f"k{i}".encode(),
            value=b'{"id": %d, "amount": -1}' % i,
            headers=[("trace", b"abc")],
            timestamp_ms=1_700_000_000_000 + i,
            first_failure_at=10.0,
            last_failure_at=12.5,
        )
        for i in range(3)
    ]
    store.write(letters)  # returns once the broker acknowledged (acks=all)
    consumer = KafkaConsumer(
        topic, bootstrap_servers=tansu, auto_offset_reset="earliest", consumer_timeout_ms=5_000
    )
    got = list(consumer)
    consumer.close()
    assert [(m.key, m.value) for m in got] == [(d.key, d.value) for d in letters]
    h = dict(got[1].headers)
    assert h["trace"] == b"abc"  # the original headers are kept
    assert h["conveyor.connector"] == connector.encode()
    assert h["conveyor.generation"] == b"4"
    assert (h["conveyor.topic"], h["conveyor.partition"], h["conveyor.offset"]) == (
        b"orders",
        b"1",
        b"101",
    )
    assert h["conveyor.error_class"] == b"data" and h["conveyor.error"] == b"violates check 1"
    assert h["conveyor.attempts"] == b"3"
    assert (
        float(h["conveyor.first_failure_at"]) == 10.0
        and float(h["conveyor.last_failure_at"]) == 12.5
    )
