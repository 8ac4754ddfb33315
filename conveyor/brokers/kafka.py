"""Kafka-protocol source: reads each partition from the committed offset.

``KafkaSource(spec, group_id)`` (from here: this module imports both clients) builds the
client ``source.client`` names; what both clients share is in
``conveyor.brokers.kafka_source``, the librdkafka client in ``conveyor.brokers.confluent``.
This module is the kafka-python client.

kafka-python with manual ``assign`` + ``seek`` (no group rebalances: Conveyor's
scheduler owns placement). Offsets live in the meta store; they are mirrored to
the Kafka consumer group named after the connector so that standard tooling
sees the connector's progress. Lag comes from ``highwater()`` (tansu's
``end_offsets`` is wrong).

The source connects with the spec's ``KafkaConnection`` (TLS, SASL, client
options), reads ``read_committed`` by default, and every ``discovery_interval_s``
looks for new partitions of its topics and new topics matching ``topics_regex``:
those are assigned while the connector runs and read from their earliest offset.
Offsets handed to the loop are the consumer's positions, which step over
transaction markers: a partition ending in a commit marker is caught up (lag 0).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import pyarrow as pa

from conveyor.brokers.confluent import ConfluentSource
from conveyor.brokers.connection import kafka_python_options, tls_problem
from conveyor.brokers.kafka_source import (
    BACKLOG_FILL_S,
    DEFAULT_BOOTSTRAP,
    SOURCE_SCHEMA,
    KafkaSource,
    SourceClient,
    columns_to_table,
    default_bootstrap,
    next_offsets_of,
    resolve_bootstrap,
    source_class,
    source_error,
)
from conveyor.core.errors import ConfigError, PermanentSourceError, TransientSourceError
from conveyor.core.model import Offsets, SourceSpec, TopicPartition, parse_start_timestamp

log = logging.getLogger("conveyor.kafka")

# The source's interface: what both clients share is in conveyor.brokers.kafka_source, and
# is used from here (importing this module registers both clients).
__all__ = [
    "BACKLOG_FILL_S",
    "DEFAULT_BOOTSTRAP",
    "SOURCE_SCHEMA",
    "TIMESTAMP_TYPES",
    "ConfluentSource",
    "KafkaPythonSource",
    "KafkaSource",
    "SourceClient",
    "columns_to_table",
    "consumer_options",
    "default_bootstrap",
    "next_offsets_of",
    "records_to_table",
    "resolve_bootstrap",
    "source_class",
    "source_error",
    "source_time",
    "validate_bootstrap",
]

# Kafka's timestamp types (record attribute bit 3) as __timestamp_type values.
TIMESTAMP_TYPES = {0: "create", 1: "log_append"}


def consumer_options(spec: SourceSpec, *, client_id: str, **settings: Any) -> dict[str, Any]:
    """KafkaConsumer keyword arguments: Conveyor's settings, then the connection (secrets
    resolved: never log them), whose client_options win."""
    return {
        **settings,
        **kafka_python_options(
            spec,
            "consumer",
            prefix="source",
            default_bootstrap=default_bootstrap,
            client_id=client_id,
        ),
    }


def records_to_table(records: list[Any]) -> pa.Table:
    """kafka-python ConsumerRecords -> the source Arrow layout, one column at a time."""
    return columns_to_table(
        topics=[r.topic for r in records],
        partitions=[r.partition for r in records],
        offsets=[r.offset for r in records],
        timestamps=[r.timestamp for r in records],
        timestamp_types=[getattr(r, "timestamp_type", None) for r in records],
        type_names=TIMESTAMP_TYPES,
        keys=[r.key for r in records],
        headers=[r.headers for r in records],
        values=[r.value for r in records],
    )


class KafkaPythonSource(KafkaSource, client="kafka-python"):
    """The kafka-python client: manual ``assign`` + ``seek``, positions from the consumer."""

    def __init__(self, spec: SourceSpec, group_id: str, **kw: Any):
        super().__init__(spec, group_id, **kw)
        self._consumer: Any = None
        self._committer: Any = None

    def consumer_options(self, **settings: Any) -> dict[str, Any]:
        return consumer_options(self.spec, client_id=self.client_id, **settings)

    def _opened(self) -> bool:
        return self._consumer is not None

    def _connect(self) -> None:
        from kafka import KafkaConsumer

        options = self.consumer_options(
            group_id=None,
            enable_auto_commit=False,
            # A position outside the log raises OffsetOutOfRangeError: source.out_of_range
            # decides (KafkaSource._position_lost), never a silent jump.
            auto_offset_reset="none",
            isolation_level=self.spec.isolation_level,
            max_poll_records=100_000,
            fetch_max_bytes=64 << 20,
            max_partition_fetch_bytes=16 << 20,
            fetch_max_wait_ms=100,
            request_timeout_ms=self.request_timeout_ms,
            metadata_max_age_ms=int(self.spec.discovery_interval_s * 1000),
        )
        problem = tls_problem(options)
        if problem:
            raise PermanentSourceError(f"cannot connect to Kafka at {self.bootstrap}: {problem}")
        self._consumer = KafkaConsumer(**options)

    def _topic_partitions(self, topics: list[str] | None) -> dict[str, set[int]]:
        c = self._consumer
        names = list(c.topics()) if topics is None else topics
        out: dict[str, set[int]] = {}
        for topic in names:
            ps = c.partitions_for_topic(topic)
            if ps:
                out[topic] = set(ps)
        return out

    def _assign(self, positions: dict[TopicPartition, int | str]) -> None:
        from kafka import TopicPartition as KTP

        c = self._consumer
        ktps = {tp: KTP(tp.topic, tp.partition) for tp in positions}
        c.assign(list(ktps.values()))
        earliest = [ktps[tp] for tp, p in positions.items() if p == "earliest"]
        latest = [ktps[tp] for tp, p in positions.items() if p == "latest"]
        for tp, p in positions.items():
            if isinstance(p, int):
                c.seek(ktps[tp], p)
        if earliest:
            c.seek_to_beginning(*earliest)
        if latest:
            c.seek_to_end(*latest)

    def _seek(self, offsets: Offsets) -> None:
        from kafka import TopicPartition as KTP

        for tp, off in offsets.items():
            self._consumer.seek(KTP(tp.topic, tp.partition), off)

    def _positions(self) -> dict[TopicPartition, int | None]:
        from kafka import TopicPartition as KTP

        c = self._consumer
        return {tp: self._position(c, KTP(tp.topic, tp.partition)) for tp in self._partitions}

    def _position(self, consumer: Any, ktp: Any) -> int:
        """The consumer's position, bounded by ``request_timeout_ms`` (an outage past it)."""
        pos = consumer.position(ktp, timeout_ms=self.request_timeout_ms)
        if pos is None:
            raise TransientSourceError(
                f"the position of {ktp.topic}[{ktp.partition}] was not known within "
                f"{self.request_timeout_ms} ms"
            )
        return int(pos)

    def _offsets_for_time(self, parts: list[TopicPartition], ms: int) -> dict[TopicPartition, int]:
        from kafka import TopicPartition as KTP

        found = self._consumer.offsets_for_times(
            {KTP(tp.topic, tp.partition): ms for tp in parts}, timeout_ms=self.request_timeout_ms
        )
        return {
            tp: found[k].offset
            for tp in parts
            if found.get(k := KTP(tp.topic, tp.partition)) is not None
        }

    def _end_offsets(self, parts: list[TopicPartition], end: str) -> dict[TopicPartition, int]:
        # seek + position (a ListOffsets per partition): tansu's end_offsets is wrong.
        from kafka import TopicPartition as KTP

        c = self._consumer
        ktps = {tp: KTP(tp.topic, tp.partition) for tp in parts}
        if not ktps:
            return {}
        if end == "earliest":
            c.seek_to_beginning(*ktps.values())
        else:
            c.seek_to_end(*ktps.values())
        return {tp: self._position(c, k) for tp, k in ktps.items()}

    def _ask_leaders(self) -> None:
        from kafka import TopicPartition as KTP

        self._consumer.end_offsets(
            [KTP(tp.topic, tp.partition) for tp in self._partitions],
            timeout_ms=self.request_timeout_ms,
        )

    def _poll(self, max_records: int, timeout_s: float) -> tuple[pa.Table | None, int]:
        got = self._consumer.poll(timeout_ms=max(1, int(timeout_s * 1000)), max_records=max_records)
        records: list[Any] = []
        nbytes = 0
        for msgs in got.values():
            records.extend(msgs)
            nbytes += sum(len(m.value or b"") + len(m.key or b"") for m in msgs)
        if not records:
            return None, 0
        return records_to_table(records), nbytes

    def _fetched_highwaters(self) -> dict[TopicPartition, int]:
        from kafka import TopicPartition as KTP

        out: dict[TopicPartition, int] = {}
        for tp in self._partitions:
            hw = self._consumer.highwater(KTP(tp.topic, tp.partition))
            if hw is not None:
                out[tp] = hw
        return out

    def _commit_group(self, offsets: Offsets) -> None:
        from kafka import KafkaConsumer
        from kafka import TopicPartition as KTP
        from kafka.structs import OffsetAndMetadata

        if self._committer is None:
            self._committer = KafkaConsumer(
                **consumer_options(
                    self.spec,
                    client_id=f"{self.client_id}-commit",
                    group_id=self.group_id,
                    enable_auto_commit=False,
                    session_timeout_ms=6_000,
                    request_timeout_ms=self.request_timeout_ms,
                )
            )
        self._committer.commit(
            {
                KTP(tp.topic, tp.partition): OffsetAndMetadata(off, "", -1)
                for tp, off in offsets.items()
            }
        )

    def _group_committed(self, group: str) -> dict[TopicPartition, int | None]:
        from kafka import KafkaConsumer
        from kafka import TopicPartition as KTP

        reader = KafkaConsumer(
            **consumer_options(
                self.spec,
                client_id=f"{self.client_id}-takeover",
                group_id=group,
                enable_auto_commit=False,
                request_timeout_ms=self.request_timeout_ms,
            )
        )
        try:
            return {
                tp: reader.committed(
                    KTP(tp.topic, tp.partition), timeout_ms=self.request_timeout_ms
                )
                for tp in self._partitions
            }
        finally:
            reader.close(autocommit=False)

    def _topic_ids(self, topics: list[str]) -> tuple[str | None, dict[str, str | None]]:
        client = getattr(self._consumer, "_client", None)  # kafka-python's metadata (KIP-516)
        cluster = getattr(client, "cluster", None)
        if cluster is None:
            return None, {}
        for t in topics:
            self._consumer.partitions_for_topic(t)  # metadata for the topic, if not yet
        ids: dict[str, str | None] = {}
        for t in topics:
            uid = cluster.topic_id(t)
            ids[t] = str(uid) if uid else None
        return cluster.cluster_id, ids

    def _log_ranges(self, parts: list[TopicPartition]) -> dict[TopicPartition, tuple[int, int]]:
        # seek + position (as _end_offsets: tansu's end_offsets is wrong), on an assignment
        # that holds the partitions; ``open`` and ``_position_lost`` seek afterwards.
        from kafka import TopicPartition as KTP

        c = self._consumer
        assigned = set(c.assignment())
        wanted = {KTP(tp.topic, tp.partition) for tp in parts}
        if not wanted <= assigned:
            c.assign(list(assigned | wanted))
        lo = self._end_offsets(parts, "earliest")
        hi = self._end_offsets(parts, "latest")
        return {tp: (lo[tp], hi[tp]) for tp in parts}

    def _fetched_ends(self, parts: list[TopicPartition]) -> dict[TopicPartition, int]:
        import time

        from kafka import KafkaConsumer
        from kafka import TopicPartition as KTP

        probe = KafkaConsumer(
            **consumer_options(
                self.spec,
                client_id=f"{self.client_id}-probe",
                group_id=None,
                enable_auto_commit=False,
                isolation_level=self.spec.isolation_level,
                request_timeout_ms=self.request_timeout_ms,
                fetch_max_bytes=1 << 20,
                max_partition_fetch_bytes=1 << 20,
            )
        )
        out: dict[TopicPartition, int] = {}
        try:
            ktps = {tp: KTP(tp.topic, tp.partition) for tp in parts}
            probe.assign(list(ktps.values()))
            probe.seek_to_end(*ktps.values())
            deadline = time.monotonic() + self.request_timeout_ms / 1000
            while len(out) < len(parts) and time.monotonic() < deadline:
                probe.poll(timeout_ms=200)
                for tp, k in ktps.items():
                    high = probe.highwater(k)
                    if high is not None:
                        out[tp] = int(high)
        finally:
            probe.close(autocommit=False)
        return out

    def _out_of_range_error(self, exc: BaseException) -> list[TopicPartition] | None:
        from kafka.errors import NoOffsetForPartitionError, OffsetOutOfRangeError

        if not isinstance(exc, (OffsetOutOfRangeError, NoOffsetForPartitionError)):
            return None
        found = exc.args[0] if exc.args and isinstance(exc.args[0], (dict, set, list)) else {}
        parts = [TopicPartition(k.topic, k.partition) for k in found]
        return parts or list(self._partitions)

    def _close(self) -> None:
        for c in (self._consumer, self._committer):
            if c is not None:
                try:
                    c.close(autocommit=False)
                except Exception:  # noqa: BLE001 - closing is best effort
                    log.debug("error closing consumer", exc_info=True)
        self._consumer = self._committer = None


def source_time(value: str) -> dt.datetime:
    """``--to-datetime`` / ``start_from`` text as an aware datetime (ConfigError when invalid)."""
    try:
        return parse_start_timestamp(value)
    except ValueError:
        raise ConfigError(
            f"{value!r} is not an ISO 8601 time such as 2026-11-01T00:00:00Z"
        ) from None


def validate_bootstrap(value: str) -> None:
    for hp in value.split(","):
        host, _, port = hp.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{hp!r} is not host:port", field="source.bootstrap_servers")
