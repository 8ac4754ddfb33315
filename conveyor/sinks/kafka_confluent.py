"""The Kafka sink's librdkafka client (confluent-kafka): ``sink.client: confluent``.

Record encoding, batching, compression and the partitioner run in librdkafka's C
threads, outside the GIL; Python only calls ``produce`` per row, in one loop over the
batch's records (``send_rows``, where kafka-python's ``send`` is called per row).
``ConfluentProducer`` gives the librdkafka producer the other kafka-python
``KafkaProducer`` calls the sink makes (``flush``, ``partitions_for``, ``close``), so
everything else in ``conveyor.sinks.kafka`` (message building, templates, routing, the
failure semantics) is shared by both clients.

Acknowledgement is per row, as kafka-python's futures give it, without a Python object or
call per delivered record: each row is produced with its index's reporter (``_Report``,
made once per index and reused by every batch), and ``delivery.report.only.error`` has
confluent-kafka call it only for a record that failed. Once ``flush`` returned with
nothing left in the queue, every record was either acknowledged or reported failed
(``take_failures``). A delivery report object per row cost the loop's thread three times
the CPU of the rest of ``send_rows`` (docs/sinks/kafka.md).

The connection becomes librdkafka properties in
``conveyor.brokers.connection.librdkafka_config`` (the source's mapping);
``client_options`` take librdkafka's dotted names, as for ``source.client: confluent``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from conveyor.brokers.connection import librdkafka_config
from conveyor.sinks.kafka_config import KafkaSinkConfig

log = logging.getLogger("conveyor.sinks.kafka")

# librdkafka's bound of message.max.bytes.
_MAX_MESSAGE_BYTES = 1_000_000_000


def producer_config(c: KafkaSinkConfig) -> dict[str, Any]:
    """librdkafka producer properties of a sink config: the sink's settings, then the
    connection (secrets resolved: never log them), whose client_options (librdkafka
    names) win. Raises ConfigError naming the field."""
    return {
        "log.connection.close": False,
        "logger": log,  # librdkafka's log lines through Python logging, not stderr
        "acks": "all" if c.acks == "all" else 1,
        "enable.idempotence": c.idempotent,
        "compression.type": c.compression,
        "linger.ms": c.linger_ms,
        "batch.size": c.batch_size,
        "message.max.bytes": min(c.max_request_size, _MAX_MESSAGE_BYTES),
        "request.timeout.ms": c.request_timeout_ms,
        "message.timeout.ms": c.delivery_timeout_ms,
        "socket.connection.setup.timeout.ms": max(c.connect_timeout_ms, 1_000),
        # kafka-python's (and Java's) partitioner: murmur2 of the key, so a key lands on
        # the same partition with either client; a null key goes to a random partition
        # (sticky for sticky.partitioning.linger.ms).
        "partitioner": "murmur2_random",
        # A batch is produced whole before one flush: room for large batches in the queue.
        "queue.buffering.max.messages": 2_000_000,
        # Delivery reports reach Python for failed records only (ConfluentProducer).
        "delivery.report.only.error": True,
        **librdkafka_config(c, prefix="sink", client_options=True),
    }


def admin_config(c: KafkaSinkConfig) -> dict[str, Any]:
    """librdkafka properties of the admin client that reads a topic's limits."""
    conf = librdkafka_config(c, prefix="sink", client_options=False)
    return {"log.connection.close": False, "logger": log, **conf}


class Records(Protocol):
    """A batch's records column by column, as ``send_rows`` reads them (the sink's
    ``conveyor.sinks.kafka_records.Outgoing``): row ``i`` goes to ``topics[i]``."""

    @property
    def topics(self) -> Sequence[Any]: ...
    @property
    def values(self) -> Sequence[bytes | None]: ...
    @property
    def keys(self) -> Sequence[bytes | None]: ...
    @property
    def headers(self) -> Sequence[list[tuple[str, bytes]] | None]: ...
    @property
    def stamps(self) -> Sequence[int | None]: ...
    @property
    def partitions(self) -> Sequence[int | None]: ...


class _Report:
    """Row ``row``'s delivery report: records a failure (with ``delivery.report.only.error``
    confluent-kafka calls it for failures only; a success is ignored either way)."""

    __slots__ = ("failures", "row")

    def __init__(self, row: int, failures: list[tuple[int, BaseException]]):
        self.row = row
        self.failures = failures

    def __call__(self, err: Any, _msg: Any) -> None:
        if err is not None:
            from confluent_kafka import KafkaException

            self.failures.append((self.row, KafkaException(err)))


class ConfluentProducer:
    """A librdkafka producer behind the calls the sink makes of kafka-python's."""

    def __init__(self, c: KafkaSinkConfig, conf: dict[str, Any], *, client: Any = None):
        self.config = c
        self._failures: list[tuple[int, BaseException]] = []
        self._reports: list[_Report] = []  # row i's reporter at index i
        if client is None:
            from confluent_kafka import Producer

            client = Producer({**conf, "error_cb": self._on_error})
        self._p = client

    @property
    def client(self) -> Any:
        """librdkafka's producer (its transactions: ``conveyor.sinks.kafka_transactions``)."""
        return self._p

    def _on_error(self, err: Any) -> None:
        # Outages are retried by librdkafka and end in the records' delivery reports.
        log.debug("librdkafka: %s", err)

    def bootstrap(self, timeout_s: float) -> None:
        """Reach the cluster (a metadata request), as kafka-python does when it starts."""
        self._p.list_topics(timeout=timeout_s)

    def send_rows(
        self, out: Records, rows: Sequence[int]
    ) -> tuple[int, tuple[int, Exception] | None]:
        """Produce each of ``rows`` of a batch's records, in order, in one loop: how many
        were produced, and the row whose ``produce`` raised (nothing after it is
        produced), if one did. Failed deliveries are reported by ``take_failures`` after
        ``flush``."""
        produce = self._p.produce
        topics, values, keys, headers = out.topics, out.values, out.keys, out.headers
        stamps, partitions = out.stamps, out.partitions
        reports = self._reports
        if len(out.topics) > len(reports):
            failures = self._failures
            reports.extend(_Report(i, failures) for i in range(len(reports), len(out.topics)))
        sent = 0
        for i in rows:
            topic, value, key, ts, partition = (
                topics[i],
                values[i],
                keys[i],
                stamps[i],
                partitions[i],
            )
            # Positional (confluent-kafka's keyword parsing costs a third of the call): topic,
            # value, key, partition (-1: the partitioner's), on_delivery, its alias,
            # timestamp (0: the producer's clock), headers.
            args = (
                topic,
                value,
                key,
                -1 if partition is None else partition,
                reports[i],
                None,
                0 if ts is None else ts,
                headers[i],
            )
            try:
                if value is None and key is None:
                    raise ValueError("a record needs a key or a value (both are null)")
                try:
                    produce(*args)
                except BufferError:
                    self._wait_for_room(args)
            except Exception as e:  # noqa: BLE001 - the sink classifies it
                return sent, (i, e)
            sent += 1
        return sent, None

    def take_failures(self) -> list[tuple[int, BaseException]]:
        """The rows whose delivery failed since the last call, with librdkafka's error, in
        report order. After ``flush`` returned, every other row produced was acknowledged."""
        failures = self._failures.copy()
        self._failures.clear()  # in place: every reporter holds this list
        return failures

    def _wait_for_room(self, args: tuple[Any, ...]) -> None:
        # The local queue is full: serve delivery reports until there is room, at most
        # max_block_ms (kafka-python's bound on a send() waiting for buffer space).
        deadline = time.monotonic() + self.config.max_block_ms / 1000
        while True:
            self._p.poll(0.05)
            try:
                self._p.produce(*args)
                return
            except BufferError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"the producer's queue stayed full for {self.config.max_block_ms} ms"
                    ) from None

    def flush(self, timeout: float | None = None) -> None:
        left = self._p.flush(-1 if timeout is None else timeout)
        if left:
            from kafka.errors import KafkaTimeoutError

            raise KafkaTimeoutError(f"{left} record(s) not delivered within {timeout} s")

    def partitions_for(self, topic: str) -> set[int]:
        """The topic's partitions; kafka-python's KafkaTimeoutError when the cluster says
        it does not exist (as kafka-python raises after max_block_ms)."""
        from confluent_kafka import KafkaError, KafkaException

        md = self._p.list_topics(topic=topic, timeout=self.config.max_block_ms / 1000)
        t = md.topics.get(topic)
        if t is None or (
            t.error is not None and t.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
        ):
            from kafka.errors import KafkaTimeoutError

            raise KafkaTimeoutError(f"topic {topic!r} not found")
        if t.error is not None:
            raise KafkaException(t.error)
        return set(t.partitions)

    def close(self, timeout: float | None = None, null_logger: bool = False) -> None:
        """Deliver what is buffered within ``timeout``; with 0, abandon it (the batch is
        sent again)."""
        if timeout == 0:
            self._p.purge(in_queue=True, in_flight=True, blocking=False)
            self._p.flush(0)
        else:
            self._p.flush(-1 if timeout is None else timeout)
        self._p = None


def topic_limit(admin: Any, topic: str, timeout_s: float) -> int | None:
    """The topic's ``max.message.bytes`` through a librdkafka AdminClient, or None."""
    from confluent_kafka.admin import ConfigResource

    futures = admin.describe_configs(
        [ConfigResource(ConfigResource.Type.TOPIC, topic)], request_timeout=timeout_s
    )
    for fut in futures.values():
        entry = fut.result(timeout=timeout_s + 1).get("max.message.bytes")
        value = getattr(entry, "value", None)
        return int(value) if value not in (None, "") else None
    return None
