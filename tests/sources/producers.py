"""Test messages written by librdkafka (confluent-kafka): a client other than the source's."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CODECS = ("gzip", "snappy", "lz4", "zstd")


@dataclass
class Msg:
    value: bytes | None
    key: bytes | None = None
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)
    partition: int | None = None
    timestamp_ms: int | None = None


def _quiet(conf: dict[str, Any]) -> dict[str, Any]:
    # librdkafka logs every closed idle connection (tansu closes them); keep test output readable.
    return {"log.connection.close": False, "log_level": 3, **conf}


def create_topic(bootstrap: str, topic: str, partitions: int = 1, **conf: Any) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(_quiet({"bootstrap.servers": bootstrap, **conf}))
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(30)


def produce(
    bootstrap: str,
    topic: str,
    messages: Iterable[Msg],
    *,
    one_per_batch: bool = False,
    **conf: Any,
) -> int:
    """Produce and wait for every acknowledgement; raises on the first delivery error.

    ``conf`` is librdkafka configuration, e.g. ``{"compression.type": "zstd",
    "enable.idempotence": True}``. ``one_per_batch`` flushes after each message, so
    that every record batch holds one record (tansu answers ListOffsets in batches)."""
    from confluent_kafka import KafkaException, Producer

    p = Producer(_quiet({"bootstrap.servers": bootstrap, "linger.ms": 5, **conf}))
    errors: list[Any] = []
    n = 0

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    for m in messages:
        kw: dict[str, Any] = {"value": m.value, "key": m.key, "on_delivery": delivered}
        if m.headers:
            kw["headers"] = m.headers
        if m.partition is not None:
            kw["partition"] = m.partition
        if m.timestamp_ms is not None:
            kw["timestamp"] = m.timestamp_ms
        while True:
            try:
                p.produce(topic, **kw)
                break
            except BufferError:
                p.poll(0.1)
        n += 1
        if one_per_batch:
            p.flush(30)
        else:
            p.poll(0)
    left = p.flush(60)
    if left or errors:
        raise KafkaException(errors[0] if errors else f"{left} message(s) not delivered")
    return n
