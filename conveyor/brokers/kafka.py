"""Kafka-protocol source: reads each partition from the committed offset.

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
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from conveyor.brokers.connection import (
    classify_kafka_error,
    describe_kafka_error,
    kafka_python_options,
    tls_problem,
)
from conveyor.core.errors import (
    ConfigError,
    ConveyorError,
    PermanentSourceError,
    TransientSourceError,
)
from conveyor.core.loop import SourceBatch
from conveyor.core.model import (
    BatchPolicy,
    Offsets,
    SourceSpec,
    TopicPartition,
    parse_start_timestamp,
)
from conveyor.core.sink import ErrorKind

log = logging.getLogger("conveyor.kafka")

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

SOURCE_SCHEMA = pa.schema(
    [
        ("__topic", pa.string()),
        ("__partition", pa.int32()),
        ("__offset", pa.int64()),
        ("__timestamp", pa.timestamp("ms", tz="UTC")),
        ("__timestamp_type", pa.string()),
        ("__key", pa.binary()),
        ("__headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        ("__destination", pa.string()),
        ("__value", pa.binary()),
    ]
)

# Kafka's timestamp types (record attribute bit 3) as __timestamp_type values.
TIMESTAMP_TYPES = {0: "create", 1: "log_append"}


def default_bootstrap() -> str:
    return os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP") or DEFAULT_BOOTSTRAP


def resolve_bootstrap(spec: SourceSpec) -> str:
    return spec.bootstrap_servers or default_bootstrap()


def source_error(exc: BaseException, context: str) -> ConveyorError:
    """The source error for an exception of kafka-python: permanent unless it is an outage."""
    if isinstance(exc, ConveyorError):
        return exc
    if classify_kafka_error(exc) is ErrorKind.TRANSIENT:
        return TransientSourceError(f"{context}: {describe_kafka_error(exc)}")
    return PermanentSourceError(f"{context}: {describe_kafka_error(exc)}")


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
            "__timestamp_type": pa.array(
                [TIMESTAMP_TYPES.get(getattr(r, "timestamp_type", None)) for r in records],
                pa.string(),
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
    """Reads batches from every partition of the spec's topics (and of topics matching its regex)."""

    def __init__(
        self,
        spec: SourceSpec,
        group_id: str,
        *,
        client_id: str | None = None,
        request_timeout_ms: int = 30_000,
        mirror_interval_s: float = 5.0,
        probe_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.spec = spec
        self.bootstrap = resolve_bootstrap(spec)
        self.group_id = group_id
        self.client_id = spec.client_id or client_id or f"conveyor-{group_id}"
        self.request_timeout_ms = request_timeout_ms
        self.mirror_interval_s = mirror_interval_s
        self._clock = clock
        self._consumer: Any = None
        self._committer: Any = None
        self._partitions: list[TopicPartition] = []
        self._highwater: dict[TopicPartition, int] = {}
        # Where the loop's offsets stand: positions handed out with the last batch (or
        # committed at open). A position that moved past them without records (over a
        # transaction marker) is handed out in an empty batch, so it is committed too.
        self._handed: Offsets = {}
        self._last_discovery = 0.0
        self._last_mirror = 0.0
        self._mirror_lock = threading.Lock()
        # kafka-python's poll() returns nothing, without an error, while the brokers are
        # down: after probe_interval_s without a record, a read asks the leaders for their
        # end offsets (bounded by request_timeout_ms); no answer is an outage.
        self.probe_interval_s = probe_interval_s
        self._last_contact = clock()

    # -- lifecycle -------------------------------------------------------------

    def consumer_options(self, **settings: Any) -> dict[str, Any]:
        return consumer_options(self.spec, client_id=self.client_id, **settings)

    def open(self, committed: Offsets, *, wait_for_topics_s: float = 30.0) -> list[TopicPartition]:
        """Connect, discover partitions, assign them and seek to the committed offsets.

        Raises TransientSourceError while the cluster or a listed topic is not there
        (yet), PermanentSourceError / ConfigError for what no retry fixes (credentials,
        certificates, settings).
        """
        from kafka import KafkaConsumer

        options = self.consumer_options(
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="latest" if self.spec.start_from == "latest" else "earliest",
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
        try:
            self._consumer = KafkaConsumer(**options)
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"cannot connect to Kafka at {self.bootstrap}") from None
        deadline = time.monotonic() + wait_for_topics_s
        while True:
            parts, missing = self._discover()
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if missing:
            raise TransientSourceError(
                f"topic(s) {', '.join(missing)} not found on {self.bootstrap}"
            )
        self._assign(parts, committed)
        self._last_discovery = self._clock()
        log.info(
            "assigned %s from %s",
            ", ".join(f"{tp}@{committed.get(tp, self.spec.start_from)}" for tp in parts)
            or f"nothing yet (topics {self.spec.describe_topics()})",
            self.bootstrap,
        )
        return parts

    def _discover(self) -> tuple[list[TopicPartition], list[str]]:
        """Every partition to read now, and the listed topics that do not exist (yet)."""
        try:
            names = set(self._consumer.topics()) if self.spec.topics_regex is not None else set()
            parts: list[TopicPartition] = []
            missing: list[str] = []
            for topic in sorted({*self.spec.topics, *(t for t in names if self.spec.matches(t))}):
                ps = self._consumer.partitions_for_topic(topic)
                if not ps:
                    if topic in self.spec.topics:
                        missing.append(topic)
                    continue
                parts.extend(TopicPartition(topic, p) for p in sorted(ps))
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"reading the topics' metadata from {self.bootstrap}") from None
        return parts, missing

    def _assign(self, parts: list[TopicPartition], committed: Offsets) -> None:
        """Assign ``parts``; keep the positions of partitions already read, seek the others
        to their committed offset or the start position."""
        from kafka import TopicPartition as KTP

        c = self._consumer
        known = {tp: self._position(c, KTP(tp.topic, tp.partition)) for tp in self._partitions}
        c.assign([KTP(tp.topic, tp.partition) for tp in parts])
        fresh: list[TopicPartition] = []
        for tp in parts:
            ktp = KTP(tp.topic, tp.partition)
            if tp in known:
                c.seek(ktp, known[tp])
            elif tp in committed:
                c.seek(ktp, committed[tp])
                self._handed[tp] = committed[tp]
            else:
                fresh.append(tp)
        self._seek_start(fresh, initial=not self._partitions)
        self._partitions = list(parts)

    def _seek_start(self, parts: list[TopicPartition], *, initial: bool) -> None:
        """Partitions without a committed offset: start_from at open, earliest when found later."""
        from kafka import TopicPartition as KTP

        if not parts:
            return
        ktps = [KTP(tp.topic, tp.partition) for tp in parts]
        start = self.spec.start_from if initial else "earliest"
        c = self._consumer
        try:
            if start == "earliest":
                c.seek_to_beginning(*ktps)
            elif start == "latest":
                c.seek_to_end(*ktps)
            else:
                ms = int(parse_start_timestamp(start).timestamp() * 1000)
                found = c.offsets_for_times(
                    {k: ms for k in ktps}, timeout_ms=self.request_timeout_ms
                )
                past_end = [k for k in ktps if found.get(k) is None]
                for k in ktps:
                    if found.get(k) is not None:
                        c.seek(k, found[k].offset)
                if past_end:  # nothing stamped at or after the time yet: from the end
                    c.seek_to_end(*past_end)
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"finding the start offsets ({start})") from None

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

    def _maybe_discover(self) -> None:
        if self._clock() - self._last_discovery < self.spec.discovery_interval_s:
            return
        self._last_discovery = self._clock()
        parts, _ = self._discover()
        new = [tp for tp in parts if tp not in set(self._partitions)]
        if new:
            # Kept partitions stay assigned even if their topic vanished from the metadata.
            keep = [tp for tp in self._partitions if tp not in set(parts)]
            self._assign(sorted({*keep, *parts}), {})
            log.info(
                "%s: reading new partition(s) %s from the earliest offset",
                self.group_id,
                ", ".join(map(str, new)),
            )

    def read(self, policy: BatchPolicy) -> SourceBatch | None:
        """Long-poll until the batch closes on size (records, bytes) or age."""
        from kafka import TopicPartition as KTP

        if self._consumer is None:
            raise TransientSourceError("source is not open")
        self._maybe_discover()
        if not self._partitions:  # a topics_regex nothing matches yet
            time.sleep(policy.max_wait_ms / 1000)
            return None
        records: list[Any] = []
        nbytes = 0
        first_at: float | None = None
        wait_s = policy.max_wait_ms / 1000
        poll_deadline = time.monotonic() + wait_s
        # Where this read starts: a failed read rewinds here, so that records polled
        # before the error are read again instead of being skipped (the consumer's
        # position has already moved past them).
        start = {tp: self._position(self._consumer, tp) for tp in self._consumer.assignment()}
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
            positions = {
                TopicPartition(k.topic, k.partition): self._position(self._consumer, k)
                for k in (KTP(tp.topic, tp.partition) for tp in self._partitions)
            }
        except Exception as e:  # noqa: BLE001 - classified
            for tp, pos in start.items():
                if pos is not None:
                    self._consumer.seek(tp, pos)
            raise source_error(e, f"reading from {self.bootstrap} failed") from None
        if records:
            self._last_contact = self._clock()
        else:
            self._probe()
        self._refresh_highwater()
        nxt: Offsets = {}
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            if r.offset + 1 > nxt.get(tp, -1):
                nxt[tp] = r.offset + 1
        # Every polled record is in this batch, so each position is where the next read
        # starts: past the batch's records and any transaction markers after them.
        for tp, pos in positions.items():
            known = tp in nxt or tp in self._handed
            if known and pos is not None and pos > max(nxt.get(tp, -1), self._handed.get(tp, -1)):
                nxt[tp] = pos
        self._handed.update(nxt)
        if not records:
            # Only markers were read: commit past them (an empty batch), or nothing at all.
            return SourceBatch(table=SOURCE_SCHEMA.empty_table(), next_offsets=nxt) if nxt else None
        if len(self._partitions) > 1:
            records.sort(key=lambda r: (r.topic, r.partition, r.offset))
        return SourceBatch(table=records_to_table(records), next_offsets=nxt, nbytes=nbytes)

    def _probe(self) -> None:
        """Raise TransientSourceError when the partitions' leaders do not answer (see __init__)."""
        from kafka import TopicPartition as KTP

        if not self._partitions or self._clock() - self._last_contact < self.probe_interval_s:
            return
        try:
            self._consumer.end_offsets(
                [KTP(tp.topic, tp.partition) for tp in self._partitions],
                timeout_ms=self.request_timeout_ms,
            )
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"the brokers at {self.bootstrap} do not answer") from None
        self._last_contact = self._clock()

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
            self._last_mirror = now
        except Exception as e:  # noqa: BLE001 - a failed mirror never stops the connector
            log.warning(
                "mirroring offsets to consumer group %r failed: %s",
                self.group_id,
                describe_kafka_error(e),
            )
        finally:
            self._mirror_lock.release()

    # -- offsets of a stopped connector (conveyor offsets reset) -----------------------

    def _position(self, consumer: Any, ktp: Any) -> int:
        """The consumer's position, bounded by ``request_timeout_ms`` (an outage past it)."""
        pos = consumer.position(ktp, timeout_ms=self.request_timeout_ms)
        if pos is None:
            raise TransientSourceError(
                f"the position of {ktp.topic}[{ktp.partition}] was not known within "
                f"{self.request_timeout_ms} ms"
            )
        return int(pos)

    def offsets_at(self, to: str) -> Offsets:
        """Every partition's offset at ``earliest``, ``latest`` or an ISO 8601 time (open first)."""
        from kafka import TopicPartition as KTP

        c = self._consumer
        ktps = {tp: KTP(tp.topic, tp.partition) for tp in self._partitions}
        try:
            if to == "earliest":
                c.seek_to_beginning(*ktps.values())
            elif to == "latest":
                c.seek_to_end(*ktps.values())
            else:
                ms = int(parse_start_timestamp(to).timestamp() * 1000)
                found = c.offsets_for_times(
                    {k: ms for k in ktps.values()}, timeout_ms=self.request_timeout_ms
                )
                for k in ktps.values():
                    if found.get(k) is not None:
                        c.seek(k, found[k].offset)
                    else:
                        c.seek_to_end(k)
            return {tp: self._position(c, k) for tp, k in ktps.items()}
        except ConveyorError:
            raise
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"finding offsets at {to}") from None

    def group_offsets(self, group: str) -> Offsets:
        """The committed offsets of consumer group ``group`` for this source's partitions
        (an OffsetFetch: the group is read, never joined)."""
        from kafka import KafkaConsumer
        from kafka import TopicPartition as KTP

        try:
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
                found = {
                    tp: reader.committed(
                        KTP(tp.topic, tp.partition), timeout_ms=self.request_timeout_ms
                    )
                    for tp in self._partitions
                }
            finally:
                reader.close(autocommit=False)
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"reading the offsets of consumer group {group!r}") from None
        return {tp: off for tp, off in found.items() if off is not None and off >= 0}


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
