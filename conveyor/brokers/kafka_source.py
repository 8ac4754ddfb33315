"""What both Kafka-protocol source clients share: ``KafkaSource`` and the source layout.

``KafkaSource`` holds everything that is not client-specific, in layers: the client's
primitives and shared state (``kafka_client.KafkaClient``), discovery and positions
(``kafka_positions.KafkaPositions``), then here batching on size and age, the offsets handed
to the loop (past transaction markers), lag, rewinding after a failed read and the
consumer-group mirror's throttle. The clients subclass it:
``conveyor.brokers.kafka`` (kafka-python) and ``conveyor.brokers.confluent`` (librdkafka).
Build a source through ``conveyor.brokers.kafka.KafkaSource``, which imports both clients.

Offsets live in the meta store; they are mirrored to the Kafka consumer group named after
the connector so that standard tooling sees the connector's progress.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import pyarrow as pa

from conveyor.brokers.connection import describe_kafka_error
from conveyor.brokers.kafka_client import (
    DEFAULT_BOOTSTRAP,
    default_bootstrap,
    resolve_bootstrap,
    source_error,
)
from conveyor.brokers.kafka_positions import PAST_END_READS, KafkaPositions
from conveyor.core.engine.loop import SourceBatch, next_offsets_of
from conveyor.core.errors import ConfigError, ConveyorError, TransientSourceError
from conveyor.core.model import MESSAGE_SCHEMA, BatchPolicy, Offsets, TopicPartition

__all__ = [
    "BACKLOG_FILL_S",
    "DEFAULT_BOOTSTRAP",
    "PAST_END_READS",
    "SOURCE_SCHEMA",
    "KafkaSource",
    "SourceClient",
    "columns_to_table",
    "default_bootstrap",
    "next_offsets_of",
    "resolve_bootstrap",
    "source_class",
    "source_error",
]

log = logging.getLogger("conveyor.kafka")

# What a batch read from the log looks like (one schema for every reader of messages).
SOURCE_SCHEMA = MESSAGE_SCHEMA

# While the partitions hold enough to fill the batch (a backlog), the batch keeps
# filling past max_wait_ms, up to max_records / max_bytes, for at most this long after
# its first record: one Spark round trip carries a full batch instead of what one
# short wait fetched. A source that has caught up closes its batches at max_wait_ms.
BACKLOG_FILL_S = 1.0


def columns_to_table(
    *,
    topics: list[str],
    partitions: list[int],
    offsets: list[int],
    timestamps: list[int | None],
    timestamp_types: list[int | None],
    type_names: dict[int, str],
    keys: list[bytes | None],
    headers: list[Any],
    values: list[bytes | None],
) -> pa.Table:
    """The source Arrow layout from a batch's columns (each a list, one item per record).

    Every column is converted by Arrow in one call; the only per-record work left in
    Python is the client's own accessors. Timestamps below 0 (none) become null,
    timestamp types are mapped through ``type_names`` (the client's codes)."""
    import pyarrow.compute as pc

    n = len(offsets)
    ts = pa.array(timestamps, pa.int64())
    ts = pc.if_else(pc.less(ts, 0), pa.scalar(None, pa.int64()), ts)
    codes = pa.array(timestamp_types, pa.int64())
    known = sorted(type_names)
    kinds = pc.take(
        pa.array([type_names[k] for k in known] + [None], pa.string()),
        pc.fill_null(pc.index_in(codes, pa.array(known, pa.int64())), len(known)),
    )
    # Topics repeat: a dictionary of the few names, decoded once.
    topic_col = pc.cast(pa.array(topics, pa.string()).dictionary_encode(), pa.string())
    return pa.table(
        {
            "__topic": topic_col,
            "__partition": pa.array(partitions, pa.int32()),
            "__offset": pa.array(offsets, pa.int64()),
            "__timestamp": ts.cast(pa.timestamp("ms", tz="UTC")),
            "__timestamp_type": kinds,
            "__key": pa.array(keys, pa.binary()),
            "__headers": _headers_array(headers),
            "__destination": pa.nulls(n, pa.string()),
            "__value": pa.array(values, pa.binary()),
        },
        schema=SOURCE_SCHEMA,
    )


def _headers_array(headers: list[Any]) -> pa.Array:
    """Each record's headers (a list of (key, value) pairs, or None) as the __headers column."""
    htype = SOURCE_SCHEMA.field("__headers").type
    if not any(headers):  # the common case: empty lists, built in Arrow
        offsets = pa.array([0] * (len(headers) + 1), pa.int32())
        return pa.ListArray.from_arrays(offsets, pa.array([], htype.value_type), type=htype)
    return pa.array([[{"key": k, "value": v} for k, v in (h or [])] for h in headers], htype)


SourceClient = Literal["confluent", "kafka-python"]


#: Each client's class by its ``source.client`` name: a client registers by subclassing
#: ``KafkaSource`` with ``client=...``. ``conveyor.brokers.kafka`` imports both clients, so
#: this module never imports a client (the clients import it, one way).
CLIENTS: dict[str, type[KafkaSource]] = {}


def source_class(client: str) -> type[KafkaSource]:
    """The source implementation of ``source.client``."""
    cls = CLIENTS.get(client)
    if cls is None:
        raise ConfigError(f"unknown Kafka client {client!r}", field="source.client")
    return cls


class KafkaSource(KafkaPositions):
    """Reads batches from every partition of the spec's topics (and of topics matching its regex).

    ``KafkaSource(spec, group_id)`` builds the client ``spec.client`` names
    (``source_class``). Over discovery and
    positions (``KafkaPositions``) and the client's primitives (``KafkaClient``, which a
    client implements), this class holds batching on size and age, offsets handed to the
    loop (stepping over transaction markers), lag, rewinding after a failed read and
    throttling of the consumer-group mirror.
    """

    def __init_subclass__(cls, client: str | None = None, **kwargs: Any) -> None:
        """``class C(KafkaSource, client="name")`` makes ``C`` the ``source.client: name``
        implementation (``source_class``); a subclass without ``client=`` is not registered."""
        super().__init_subclass__(**kwargs)
        if client is not None:
            cls.client = client
            CLIENTS[client] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> KafkaSource:
        if cls is KafkaSource:
            spec = args[0] if args else kwargs["spec"]
            cls = source_class(spec.client)
        return super().__new__(cls)

    # -- lifecycle -------------------------------------------------------------

    def open(self, committed: Offsets, *, wait_for_topics_s: float = 30.0) -> list[TopicPartition]:
        """Connect, discover partitions, assign them and seek to the committed offsets.

        Raises TransientSourceError while the cluster or a listed topic is not there
        (yet), PermanentSourceError / ConfigError for what no retry fixes (credentials,
        certificates, settings).
        """
        self._ensure_connected()
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
        self._assign_parts(self._mine(parts), committed)
        self._last_discovery = self._clock()
        log.info(
            "assigned %s from %s (%s)",
            ", ".join(f"{tp}@{committed.get(tp, self.spec.start_from)}" for tp in parts)
            or f"nothing yet (topics {self.spec.describe_topics()})",
            self.bootstrap,
            self.client,
        )
        return parts

    # -- reading ------------------------------------------------------------------

    def read(self, policy: BatchPolicy) -> SourceBatch | None:
        """Long-poll until the batch closes on size (records, bytes) or age."""
        if not self._opened():
            raise TransientSourceError("source is not open")
        self._maybe_discover()
        if not self._partitions:  # a topics_regex nothing matches yet
            time.sleep(policy.max_wait_ms / 1000)
            return None
        poll_deadline = time.monotonic() + policy.max_wait_ms / 1000
        # Where this read starts: a failed read rewinds here, so that records polled
        # before the error are read again instead of being skipped (the consumer's
        # position has already moved past them).
        start = self._positions()
        try:
            chunks, nbytes = self._fill(policy, poll_deadline)
            positions = self._positions()
        except Exception as e:  # noqa: BLE001 - classified
            lost = self._out_of_range_error(e)
            if lost:
                # Records polled before the error are dropped: read again from the positions
                # the policy chose (the lost partitions) or where the read started.
                self._rewind({tp: o for tp, o in start.items() if tp not in lost})
                try:
                    self._position_lost(lost)
                except ConveyorError:
                    raise
                except Exception as e2:  # noqa: BLE001 - classified
                    raise source_error(e2, f"reading the log range from {self.bootstrap}") from None
                return None
            self._rewind(start)
            raise source_error(e, f"reading from {self.bootstrap} failed") from None
        if chunks:
            self._last_contact = self._clock()
            self._past_end.clear()
        else:
            self._probe()
            self._check_past_end(positions)
        self._highwater.update(self._fetched_highwaters())
        return self._batch(chunks, positions, nbytes)

    def _fill(self, policy: BatchPolicy, poll_deadline: float) -> tuple[list[pa.Table], int]:
        """Poll until the batch closes: on size, at ``poll_deadline`` when nothing came, else
        ``max_wait_ms`` after its first record (up to ``BACKLOG_FILL_S`` while behind). The
        tables polled and their key + value bytes."""
        chunks: list[pa.Table] = []
        count = nbytes = 0
        first_at: float | None = None
        wait_s = policy.max_wait_ms / 1000
        fill_s = max(wait_s, BACKLOG_FILL_S)
        got = polled = False  # the last poll returned records; one poll happened
        while count < policy.max_records and nbytes < policy.max_bytes:
            now = time.monotonic()
            if first_at is None:
                deadline = poll_deadline
            else:
                deadline = first_at + wait_s
                if deadline - now <= 0.001 and got and self._behind(policy.max_records - count):
                    deadline = first_at + fill_s
            remaining = deadline - now
            if remaining <= 0.001 and polled:
                break
            table, size = self._poll(policy.max_records - count, max(remaining, 0.001))
            polled = True
            got = table is not None and table.num_rows > 0
            if table is not None and table.num_rows:
                chunks.append(table)
                count += table.num_rows
                nbytes += size
                if first_at is None:
                    first_at = time.monotonic()
        return chunks, nbytes

    def _rewind(self, start: dict[TopicPartition, int | None]) -> None:
        """After a failed read: back to where it started (best effort)."""
        rewind = {tp: off for tp, off in start.items() if off is not None}
        if rewind:
            try:
                self._seek(rewind)
            except Exception:  # noqa: BLE001 - the read's error is the one to report
                log.debug("rewinding after a failed read", exc_info=True)

    def _batch(
        self,
        chunks: list[pa.Table],
        positions: dict[TopicPartition, int | None],
        nbytes: int,
    ) -> SourceBatch | None:
        """The batch of the tables polled, with the offsets to commit after it (advanced past
        transaction markers to the consumer's positions); None when nothing moved."""
        table = chunks[0] if len(chunks) == 1 else pa.concat_tables(chunks) if chunks else None
        nxt = next_offsets_of(table) if table is not None else {}
        # Every polled record is in this batch, so each position is where the next read
        # starts: past the batch's records and any transaction markers after them.
        for tp, pos in positions.items():
            known = tp in nxt or tp in self._handed
            if known and pos is not None and pos > max(nxt.get(tp, -1), self._handed.get(tp, -1)):
                nxt[tp] = pos
        self._handed.update(nxt)
        if table is None:
            # Only markers were read: commit past them (an empty batch), or nothing at all.
            return SourceBatch(table=SOURCE_SCHEMA.empty_table(), next_offsets=nxt) if nxt else None
        if len(chunks) > 1 and len(self._partitions) > 1:
            table = table.sort_by(
                [("__topic", "ascending"), ("__partition", "ascending"), ("__offset", "ascending")]
            )
        return SourceBatch(table=table, next_offsets=nxt, nbytes=nbytes)

    def _behind(self, room: int) -> bool:
        """Whether the partitions hold at least ``room`` more records than read (high
        watermarks as last fetched): a backlog, not a stream arriving as it is read."""
        hw = self._fetched_highwaters()
        return (
            sum(
                max(0, hw[tp] - p)
                for tp, p in self._positions().items()
                if p is not None and tp in hw
            )
            >= room
        )

    def _probe(self) -> None:
        """Raise TransientSourceError when the partitions' leaders do not answer (see __init__)."""
        if not self._partitions or self._clock() - self._last_contact < self.probe_interval_s:
            return
        try:
            self._ask_leaders()
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"the brokers at {self.bootstrap} do not answer") from None
        self._last_contact = self._clock()

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
            self._commit_group(offsets)
            self._last_mirror = now
        except Exception as e:  # noqa: BLE001 - a failed mirror never stops the connector
            log.warning(
                "mirroring offsets to consumer group %r failed: %s",
                self.group_id,
                describe_kafka_error(e),
            )
        finally:
            self._mirror_lock.release()
