"""Kafka-protocol source: reads each partition from the committed offset.

kafka-python with manual ``assign`` + ``seek`` (no group rebalances: Conveyor's
scheduler owns placement). Offsets live in the meta store; they are mirrored to
the Kafka consumer group named after the connector so that standard tooling
sees the connector's progress. Lag comes from ``highwater()`` (tansu's
``end_offsets`` is wrong).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import pyarrow as pa

from conveyor.core.errors import ConfigError, TransientSourceError
from conveyor.core.loop import SourceBatch
from conveyor.core.model import BatchPolicy, Offsets, SourceSpec, TopicPartition

log = logging.getLogger("conveyor.kafka")

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

SOURCE_SCHEMA = pa.schema(
    [
        ("__topic", pa.string()),
        ("__partition", pa.int32()),
        ("__offset", pa.int64()),
        ("__timestamp", pa.timestamp("ms", tz="UTC")),
        ("__key", pa.binary()),
        ("__headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        ("__destination", pa.string()),
        ("__value", pa.binary()),
    ]
)


def resolve_bootstrap(spec: SourceSpec) -> str:
    return spec.bootstrap_servers or os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP") or DEFAULT_BOOTSTRAP


def records_to_table(records: list[Any]) -> pa.Table:
    """kafka-python ConsumerRecords -> the source Arrow layout."""
    return pa.table(
        {
            "__topic": pa.array([r.topic for r in records], pa.string()),
            "__partition": pa.array([r.partition for r in records], pa.int32()),
            "__offset": pa.array([r.offset for r in records], pa.int64()),
            "__timestamp": pa.array(
                [
                    r.timestamp if r.timestamp is not None and r.timestamp >= 0 else None
                    for r in records
                ],
                pa.timestamp("ms", tz="UTC"),
            ),
            "__key": pa.array([r.key for r in records], pa.binary()),
            "__headers": _headers_array(records),
            "__destination": pa.nulls(len(records), pa.string()),
            "__value": pa.array([r.value for r in records], pa.binary()),
        },
        schema=SOURCE_SCHEMA,
    )


def _headers_array(records: list[Any]) -> pa.Array:
    htype = SOURCE_SCHEMA.field("__headers").type
    if not any(r.headers for r in records):  # the common case: empty lists, built in Arrow
        offsets = pa.array([0] * (len(records) + 1), pa.int32())
        return pa.ListArray.from_arrays(offsets, pa.array([], htype.value_type), type=htype)
    return pa.array(
        [[{"key": k, "value": v} for k, v in (r.headers or [])] for r in records], htype
    )


class KafkaSource:
    """Reads batches from every partition of the spec's topics."""

    def __init__(
        self,
        spec: SourceSpec,
        group_id: str,
        *,
        client_id: str = "conveyor",
        request_timeout_ms: int = 30_000,
        mirror_interval_s: float = 5.0,
    ):
        self.spec = spec
        self.bootstrap = resolve_bootstrap(spec)
        self.group_id = group_id
        self.client_id = client_id
        self.request_timeout_ms = request_timeout_ms
        self.mirror_interval_s = mirror_interval_s
        self._consumer: Any = None
        self._committer: Any = None
        self._partitions: list[TopicPartition] = []
        self._highwater: dict[TopicPartition, int] = {}
        self._last_mirror = 0.0
        self._mirror_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------

    def open(self, committed: Offsets, *, wait_for_topics_s: float = 30.0) -> list[TopicPartition]:
        """Connect, discover partitions, assign them and seek to the committed offsets."""
        from kafka import KafkaConsumer
        from kafka import TopicPartition as KTP
        from kafka.errors import KafkaError

        try:
            self._consumer = KafkaConsumer(
                bootstrap_servers=self.bootstrap.split(","),
                client_id=self.client_id,
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset=self.spec.start_from,
                max_poll_records=100_000,
                fetch_max_bytes=64 << 20,
                max_partition_fetch_bytes=16 << 20,
                fetch_max_wait_ms=100,
                request_timeout_ms=self.request_timeout_ms,
            )
        except KafkaError as e:
            raise TransientSourceError(f"cannot connect to Kafka at {self.bootstrap}: {e}") from e
        deadline = time.monotonic() + wait_for_topics_s
        missing = list(self.spec.topics)
        parts: list[TopicPartition] = []
        while True:
            parts = []
            missing = []
            for topic in self.spec.topics:
                ps = self._consumer.partitions_for_topic(topic)
                if not ps:
                    missing.append(topic)
                else:
                    parts.extend(TopicPartition(topic, p) for p in sorted(ps))
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if missing:
            raise TransientSourceError(
                f"topic(s) {', '.join(missing)} not found on {self.bootstrap}"
            )
        self._partitions = parts
        self._consumer.assign([KTP(tp.topic, tp.partition) for tp in parts])
        for tp in parts:
            ktp = KTP(tp.topic, tp.partition)
            if tp in committed:
                self._consumer.seek(ktp, committed[tp])
            elif self.spec.start_from == "earliest":
                self._consumer.seek_to_beginning(ktp)
            else:
                self._consumer.seek_to_end(ktp)
        log.info(
            "assigned %s from %s",
            ", ".join(f"{tp}@{committed.get(tp, self.spec.start_from)}" for tp in parts),
            self.bootstrap,
        )
        return parts

    @property
    def partitions(self) -> list[TopicPartition]:
        return list(self._partitions)

    def close(self) -> None:
        for c in (self._consumer, self._committer):
            if c is not None:
                try:
                    c.close(autocommit=False)
                except Exception:  # noqa: BLE001 - closing is best effort
                    log.debug("error closing consumer", exc_info=True)
        self._consumer = self._committer = None

    # -- reading ------------------------------------------------------------------

    def read(self, policy: BatchPolicy) -> SourceBatch | None:
        """Long-poll until the batch closes on size (records, bytes) or age."""
        from kafka.errors import KafkaError

        if self._consumer is None:
            raise TransientSourceError("source is not open")
        records: list[Any] = []
        nbytes = 0
        first_at: float | None = None
        wait_s = policy.max_wait_ms / 1000
        poll_deadline = time.monotonic() + wait_s
        # Where this read starts: a failed read rewinds here, so that records polled
        # before the error are read again instead of being skipped (the consumer's
        # position has already moved past them).
        start = {tp: self._consumer.position(tp) for tp in self._consumer.assignment()}
        try:
            while len(records) < policy.max_records and nbytes < policy.max_bytes:
                now = time.monotonic()
                deadline = (first_at + wait_s) if first_at is not None else poll_deadline
                remaining_ms = int((deadline - now) * 1000)
                if remaining_ms <= 0:
                    break
                got = self._consumer.poll(
                    timeout_ms=remaining_ms, max_records=policy.max_records - len(records)
                )
                for msgs in got.values():
                    records.extend(msgs)
                    nbytes += sum(len(m.value or b"") + len(m.key or b"") for m in msgs)
                if records and first_at is None:
                    first_at = time.monotonic()
        except KafkaError as e:
            for tp, pos in start.items():
                if pos is not None:
                    self._consumer.seek(tp, pos)
            raise TransientSourceError(f"reading from {self.bootstrap} failed: {e}") from e
        self._refresh_highwater()
        if not records:
            return None
        if len(self.spec.topics) > 1 or len(self._partitions) > 1:
            records.sort(key=lambda r: (r.topic, r.partition, r.offset))
        table = records_to_table(records)
        nxt: Offsets = {}
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            if r.offset + 1 > nxt.get(tp, -1):
                nxt[tp] = r.offset + 1
        return SourceBatch(table=table, next_offsets=nxt, nbytes=nbytes)

    def _refresh_highwater(self) -> None:
        from kafka import TopicPartition as KTP

        for tp in self._partitions:
            hw = self._consumer.highwater(KTP(tp.topic, tp.partition))
            if hw is not None:
                self._highwater[tp] = hw

    def lag(self, committed: Offsets) -> int | None:
        """Sum over partitions of highwater - committed (None until a fetch reported highwaters)."""
        if not self._highwater:
            return None
        total = 0
        for tp, hw in self._highwater.items():
            total += max(0, hw - committed.get(tp, 0))
        return total

    def highwaters(self) -> dict[TopicPartition, int]:
        return dict(self._highwater)

    # -- mirroring the commit to the consumer group -----------------------------------

    def mirror_commit(self, offsets: Offsets, *, force: bool = False) -> None:
        """Best effort, throttled: Kafka tooling sees the group's progress; the meta store is the truth."""
        now = time.monotonic()
        if not offsets or (not force and now - self._last_mirror < self.mirror_interval_s):
            return
        if not self._mirror_lock.acquire(blocking=False):
            return
        try:
            from kafka import KafkaConsumer
            from kafka import TopicPartition as KTP
            from kafka.structs import OffsetAndMetadata

            if self._committer is None:
                self._committer = KafkaConsumer(
                    bootstrap_servers=self.bootstrap.split(","),
                    client_id=f"{self.client_id}-commit",
                    group_id=self.group_id,
                    enable_auto_commit=False,
                    session_timeout_ms=6_000,
                    request_timeout_ms=self.request_timeout_ms,
                )
                self._committer.assign([KTP(tp.topic, tp.partition) for tp in self._partitions])
            self._committer.commit(
                {
                    KTP(tp.topic, tp.partition): OffsetAndMetadata(off, "", -1)
                    for tp, off in offsets.items()
                }
            )
            self._last_mirror = now
        except Exception as e:  # noqa: BLE001 - a failed mirror never stops the connector
            log.warning("mirroring offsets to consumer group %r failed: %s", self.group_id, e)
        finally:
            self._mirror_lock.release()


def validate_bootstrap(value: str) -> None:
    for hp in value.split(","):
        host, _, port = hp.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{hp!r} is not host:port", field="source.bootstrap_servers")
