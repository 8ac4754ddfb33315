"""Kafka-protocol source on librdkafka (confluent-kafka): ``source.client: confluent``.

Fetching, CRC checks and decompression run in librdkafka's C threads, outside the
GIL; Python only takes each consumed batch's columns into Arrow. Partitions are
assigned with explicit offsets (no group membership: Conveyor's scheduler owns
placement). Positions are tracked here: the offset after the last record consumed,
or the end a partition-EOF event reports, which is past any transaction markers.

Everything that is not client-specific (discovery, start positions, batching,
offsets handed to the loop, lag, the mirror's throttle, error classes) is in
``conveyor.brokers.kafka_source.KafkaSource``; the connection model becomes librdkafka
properties in ``conveyor.brokers.connection.librdkafka_config``.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
import uuid
from typing import Any

import pyarrow as pa

from conveyor.brokers.connection import (
    classify_kafka_error,
    librdkafka_config,
    tls_handshake_options,
    tls_problem,
)
from conveyor.brokers.kafka_source import KafkaSource, columns_to_table, default_bootstrap
from conveyor.core.errors import PermanentSourceError
from conveyor.core.model import Offsets, SourceSpec, TopicPartition

log = logging.getLogger("conveyor.kafka")

# confluent-kafka's timestamp types (TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME).
TIMESTAMP_TYPES = {1: "create", 2: "log_append"}
OFFSET_BEGINNING = -2
OFFSET_END = -1
# librdkafka's largest batch per consume() call.
CONSUME_MAX = 1_000_000


def consumer_config(spec: SourceSpec, *, client_id: str, **settings: Any) -> dict[str, Any]:
    """librdkafka consumer properties: Conveyor's settings, then the connection (secrets
    resolved: never log them), whose client_options (librdkafka names) win."""
    return {
        "log.connection.close": False,
        "logger": log,  # librdkafka's log lines through Python logging, not stderr
        **settings,
        **librdkafka_config(
            spec,
            prefix="source",
            default_bootstrap=default_bootstrap,
            client_id=client_id,
            client_options=True,
        ),
    }


class ConfluentSource(KafkaSource, client="confluent"):
    """The librdkafka client: ``assign`` with offsets, ``consume`` in batches."""

    def __init__(self, spec: SourceSpec, group_id: str, **kw: Any):
        super().__init__(spec, group_id, **kw)
        self._consumer: Any = None
        self._committer: Any = None
        self._position: dict[TopicPartition, int] = {}
        self._errors: list[Any] = []  # permanent errors librdkafka reported on its threads
        self._errors_lock = threading.Lock()

    @property
    def _timeout_s(self) -> float:
        return self.request_timeout_ms / 1000

    def _config(self, **settings: Any) -> dict[str, Any]:
        return consumer_config(
            self.spec, client_id=settings.pop("client_id", self.client_id), **settings
        )

    def _on_error(self, err: Any) -> None:
        # Called on librdkafka's background events (from consume/poll): outages are retried
        # by librdkafka itself; what no retry fixes stops the source at its next read.
        if classify_kafka_error(_exception(err)) != "transient":
            with self._errors_lock:
                self._errors.append(err)
        else:
            log.debug("librdkafka: %s", err)

    def _raise_reported(self) -> None:
        with self._errors_lock:
            errors, self._errors = self._errors, []
        if errors:
            raise _exception(errors[0])

    def _opened(self) -> bool:
        return self._consumer is not None

    def _connect(self) -> None:
        from confluent_kafka import Consumer

        conf = self._config(
            **{
                "group.id": f"{self.group_id}-conveyor-reader",  # required; never joined or committed
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
                # Every record batch's CRC-32C, as kafka-python checks it (in C here).
                "check.crcs": True,
                "isolation.level": self.spec.isolation_level,
                # A position outside the log is an error event (``_OutOfRange``), never a
                # silent jump: source.out_of_range decides (KafkaSource._position_lost).
                "auto.offset.reset": "error",
                "fetch.wait.max.ms": 100,
                "fetch.max.bytes": 64 << 20,
                # librdkafka fetches ahead while it holds fewer than queued.min.messages
                # (100,000) records per partition: over 200,000 records, 30-40 MB of the
                # run's RSS, while it drains a backlog. Kept: 50,000 saved 25-33 MB and cost
                # a fifth to a third of the rate, 20,000 with 2 MiB fetches half of it; 2 MiB
                # fetches alone saved 2-10 MB (docs/BENCHMARKS.md, "Run-process memory").
                "max.partition.fetch.bytes": 16 << 20,
                "queued.max.messages.kbytes": 256 << 10,
                "socket.timeout.ms": self.request_timeout_ms,
                "topic.metadata.refresh.interval.ms": int(self.spec.discovery_interval_s * 1000),
                "error_cb": self._on_error,
            }
        )
        problem = tls_problem(
            tls_handshake_options(
                self.spec, "consumer", prefix="source", default_bootstrap=default_bootstrap
            )
        )
        if problem:
            raise PermanentSourceError(f"cannot connect to Kafka at {self.bootstrap}: {problem}")
        self._consumer = Consumer(conf)

    def _topic_partitions(self, topics: list[str] | None) -> dict[str, set[int]]:
        self._raise_reported()
        out: dict[str, set[int]] = {}
        if topics is None:
            md = self._consumer.list_topics(timeout=self._timeout_s)
            found = md.topics.values()
        else:
            found = []
            for t in topics:
                md = self._consumer.list_topics(topic=t, timeout=self._timeout_s)
                found.extend(m for m in md.topics.values() if m.topic == t)
        for m in found:
            if m.error is None and m.partitions:
                out[m.topic] = set(m.partitions)
        return out

    def _assign(self, positions: dict[TopicPartition, int | str]) -> None:
        from confluent_kafka import TopicPartition as CTP

        resolved: dict[TopicPartition, int] = {}
        for tp, p in positions.items():
            if isinstance(p, int):
                resolved[tp] = p
            else:
                resolved[tp] = self._end_offsets([tp], p)[tp]
        self._consumer.assign([CTP(tp.topic, tp.partition, off) for tp, off in resolved.items()])
        self._position = dict(resolved)

    def _seek(self, offsets: Offsets) -> None:
        from confluent_kafka import TopicPartition as CTP

        self._position.update(offsets)
        self._consumer.assign(
            [CTP(tp.topic, tp.partition, off) for tp, off in self._position.items()]
        )

    def _positions(self) -> dict[TopicPartition, int | None]:
        return {tp: self._position.get(tp) for tp in self._partitions}

    def _offsets_for_time(self, parts: list[TopicPartition], ms: int) -> dict[TopicPartition, int]:
        from confluent_kafka import TopicPartition as CTP

        if not parts:
            return {}
        found = self._consumer.offsets_for_times(
            [CTP(tp.topic, tp.partition, ms) for tp in parts], timeout=self._timeout_s
        )
        return {TopicPartition(f.topic, f.partition): f.offset for f in found if f.offset >= 0}

    def _end_offsets(self, parts: list[TopicPartition], end: str) -> dict[TopicPartition, int]:
        from confluent_kafka import TopicPartition as CTP

        out: dict[TopicPartition, int] = {}
        for tp in parts:
            low, high = self._consumer.get_watermark_offsets(
                CTP(tp.topic, tp.partition), timeout=self._timeout_s
            )
            out[tp] = low if end == "earliest" else high
        return out

    def _ask_leaders(self) -> None:
        self._end_offsets(self._partitions, "latest")  # watermarks: positions do not move

    def _poll(self, max_records: int, timeout_s: float) -> tuple[pa.Table | None, int]:
        self._raise_reported()
        # consume(n, t) blocks until n records or t: wait for the first one only, then take
        # what librdkafka has already fetched (the caller decides whether to wait for more).
        msgs = self._consumer.consume(1, timeout_s)
        if not msgs:
            return None, 0
        if max_records > 1:
            msgs += self._consumer.consume(min(max_records - 1, CONSUME_MAX), 0)
        from confluent_kafka import Message

        ends: dict[TopicPartition, int] = {}
        # (KafkaError's == with None sets an exception: compared by identity, in C)
        if any(map(operator.is_not, map(Message.error, msgs), itertools.repeat(None))):
            msgs, ends = self._events(msgs)
            if not msgs:
                self._reached(ends)
                return None, 0
        # Each accessor mapped over the batch in C (no bound method per record).
        offsets = list(map(Message.offset, msgs))
        partitions = list(map(Message.partition, msgs))
        topics = list(map(Message.topic, msgs))
        types, stamps = zip(*map(Message.timestamp, msgs), strict=True)
        keys = list(map(Message.key, msgs))
        values = list(map(Message.value, msgs))
        table = columns_to_table(
            topics=topics,
            partitions=partitions,
            offsets=offsets,
            timestamps=list(stamps),
            timestamp_types=list(types),
            type_names=TIMESTAMP_TYPES,
            keys=keys,
            headers=list(map(Message.headers, msgs)),
            values=values,
        )
        # consume() returns each partition's records in offset order: the last one per
        # partition is where it stands (dict() keeps the last; built in C, one
        # TopicPartition per partition rather than per record).
        last = dict(zip(zip(topics, partitions, strict=True), offsets, strict=True))
        for (topic, partition), off in last.items():
            self._position[TopicPartition(topic, partition)] = off + 1
        self._reached(ends)
        nbytes = sum(map(len, filter(None, values))) + sum(map(len, filter(None, keys)))
        return table, nbytes

    def _events(self, msgs: list[Any]) -> tuple[list[Any], dict[TopicPartition, int]]:
        """The records among ``msgs`` and the ends partition-EOF events report (past
        transaction markers); any other error is raised."""
        from confluent_kafka import KafkaError

        records = []
        ends: dict[TopicPartition, int] = {}
        lost: list[TopicPartition] = []
        for m in msgs:
            err = m.error()
            if err is None:
                records.append(m)
            elif err.code() == KafkaError._PARTITION_EOF:
                if m.offset() >= 0:
                    ends[TopicPartition(m.topic(), m.partition())] = m.offset()
            elif err.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                lost.append(TopicPartition(m.topic(), m.partition()))
            else:
                raise _exception(err)
        if lost:
            raise _OutOfRange(lost)
        return records, ends

    def _reached(self, ends: dict[TopicPartition, int]) -> None:
        """A partition at its end stands there (after the records consumed before it)."""
        for tp, end in ends.items():
            if tp in self._position:
                self._position[tp] = max(self._position[tp], end)

    def _fetched_highwaters(self) -> dict[TopicPartition, int]:
        from confluent_kafka import TopicPartition as CTP

        out: dict[TopicPartition, int] = {}
        for tp in self._partitions:
            _low, high = self._consumer.get_watermark_offsets(
                CTP(tp.topic, tp.partition), cached=True
            )
            if high is not None and high >= 0:
                out[tp] = high
        return out

    def _commit_group(self, offsets: Offsets) -> None:
        from confluent_kafka import Consumer
        from confluent_kafka import TopicPartition as CTP

        if self._committer is None:
            self._committer = Consumer(
                self._config(
                    **{
                        "client_id": f"{self.client_id}-commit",
                        "group.id": self.group_id,
                        "enable.auto.commit": False,
                    }
                )
            )
        self._committer.commit(
            offsets=[CTP(tp.topic, tp.partition, off) for tp, off in offsets.items()],
            asynchronous=False,
        )

    def _group_committed(self, group: str) -> dict[TopicPartition, int | None]:
        from confluent_kafka import Consumer
        from confluent_kafka import TopicPartition as CTP

        reader = Consumer(
            self._config(
                **{
                    "client_id": f"{self.client_id}-takeover",
                    "group.id": group,
                    "enable.auto.commit": False,
                }
            )
        )
        try:
            found = reader.committed(
                [CTP(tp.topic, tp.partition) for tp in self._partitions], timeout=self._timeout_s
            )
        finally:
            reader.close()
        return {TopicPartition(f.topic, f.partition): f.offset for f in found}

    def _topic_ids(self, topics: list[str]) -> tuple[str | None, dict[str, str | None]]:
        from confluent_kafka import TopicCollection
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(consumer_config(self.spec, client_id=f"{self.client_id}-admin"))
        cluster = admin.describe_cluster(request_timeout=self._timeout_s).result(self._timeout_s)
        found = admin.describe_topics(TopicCollection(topics), request_timeout=self._timeout_s)
        ids: dict[str, str | None] = {}
        for topic, f in found.items():
            try:
                ids[topic] = topic_uuid(f.result(self._timeout_s).topic_id)
            except Exception as e:  # noqa: BLE001 - a topic gone meanwhile has no id
                if classify_kafka_error(e) == "transient":
                    raise
                ids[topic] = None
        return cluster.cluster_id, ids

    def _log_ranges(self, parts: list[TopicPartition]) -> dict[TopicPartition, tuple[int, int]]:
        from confluent_kafka import TopicPartition as CTP

        out: dict[TopicPartition, tuple[int, int]] = {}
        for tp in parts:
            low, high = self._consumer.get_watermark_offsets(
                CTP(tp.topic, tp.partition), timeout=self._timeout_s
            )
            out[tp] = (int(low), int(high))
        return out

    def _fetched_ends(self, parts: list[TopicPartition]) -> dict[TopicPartition, int]:
        from confluent_kafka import OFFSET_END, Consumer
        from confluent_kafka import TopicPartition as CTP

        probe = Consumer(
            self._config(
                client_id=f"{self.client_id}-probe",
                **{
                    "group.id": f"{self.group_id}-conveyor-probe",  # never joined or committed
                    "enable.auto.commit": False,
                    "enable.partition.eof": True,
                    "isolation.level": self.spec.isolation_level,
                    "max.partition.fetch.bytes": 1 << 20,
                    "fetch.max.bytes": 1 << 20,
                },
            )
        )
        out: dict[TopicPartition, int] = {}
        try:
            probe.assign([CTP(tp.topic, tp.partition, OFFSET_END) for tp in parts])
            deadline = time.monotonic() + self._timeout_s
            while len(out) < len(parts) and time.monotonic() < deadline:
                probe.consume(100, 0.2)
                for tp in parts:
                    _low, high = probe.get_watermark_offsets(
                        CTP(tp.topic, tp.partition), cached=True
                    )
                    if high is not None and high >= 0:
                        out[tp] = int(high)
        finally:
            probe.close()
        return out

    def _out_of_range_error(self, exc: BaseException) -> list[TopicPartition] | None:
        return list(exc.parts) if isinstance(exc, _OutOfRange) else None

    def _close(self) -> None:
        consumers, self._consumer, self._committer = (self._consumer, self._committer), None, None
        for c in consumers:
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    log.debug("error closing consumer", exc_info=True)


def topic_uuid(uid: Any) -> str | None:
    """A librdkafka ``Uuid`` as the standard UUID text (what kafka-python's reads as too)."""
    if uid is None:
        return None
    mask = (1 << 64) - 1
    msb, lsb = uid.get_most_significant_bits() & mask, uid.get_least_significant_bits() & mask
    return str(uuid.UUID(int=(msb << 64) | lsb))


class _OutOfRange(Exception):
    """Partitions librdkafka found out of range (``auto.offset.reset`` error)."""

    def __init__(self, parts: list[TopicPartition]):
        super().__init__(f"offset out of range: {', '.join(map(str, parts))}")
        self.parts = parts


def _exception(err: Any) -> BaseException:
    from confluent_kafka import KafkaException

    return KafkaException(err)
