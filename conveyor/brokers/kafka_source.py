"""What both Kafka-protocol source clients share: ``KafkaSource`` and the source layout.

``KafkaSource`` holds everything that is not client-specific: discovery of topics and
partitions, where each partition starts, batching on size and age, the offsets handed to the
loop (past transaction markers), lag, rewinding after a failed read, the consumer-group
mirror's throttle and the classification of errors. The clients subclass it:
``conveyor.brokers.kafka`` (kafka-python) and ``conveyor.brokers.confluent`` (librdkafka).
Build a source through ``conveyor.brokers.kafka.KafkaSource``, which imports both clients.

Offsets live in the meta store; they are mirrored to the Kafka consumer group named after
the connector so that standard tooling sees the connector's progress.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, ClassVar, Literal

import pyarrow as pa

from conveyor.brokers.connection import classify_kafka_error, describe_kafka_error
from conveyor.core.errors import (
    ConfigError,
    ConveyorError,
    PermanentSourceError,
    TransientSourceError,
)
from conveyor.core.loop import SourceBatch, next_offsets_of
from conveyor.core.model import (
    MESSAGE_SCHEMA,
    BatchPolicy,
    Offsets,
    SourceSpec,
    TopicPartition,
    parse_start_timestamp,
)
from conveyor.core.positions import (
    LogFacts,
    PositionNote,
    StoredPosition,
    judge_positions,
    log_id_of,
)
from conveyor.core.sink import ErrorKind

log = logging.getLogger("conveyor.kafka")

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

# What a batch read from the log looks like (one schema for every reader of messages).
SOURCE_SCHEMA = MESSAGE_SCHEMA

# While the partitions hold enough to fill the batch (a backlog), the batch keeps
# filling past max_wait_ms, up to max_records / max_bytes, for at most this long after
# its first record: one Spark round trip carries a full batch instead of what one
# short wait fetched. A source that has caught up closes its batches at max_wait_ms.
BACKLOG_FILL_S = 1.0

# Empty reads in a row with a position past its partition's fetched end before it counts as
# out of range (one read may carry a high watermark from before the position was set).
PAST_END_READS = 3


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


class KafkaSource(abc.ABC):
    """Reads batches from every partition of the spec's topics (and of topics matching its regex).

    ``KafkaSource(spec, group_id)`` builds the client ``spec.client`` names
    (``source_class``). This class holds everything the clients share: discovery of
    topics and partitions, where each partition starts (committed offset, start_from,
    earliest for partitions found later), batching on size and age, offsets handed to
    the loop (stepping over transaction markers), lag, rewinding after a failed read,
    throttling of the consumer-group mirror, and the classification of errors.

    A client implements the primitives below (``_connect`` ... ``_close``). They may
    block up to the request timeout; they raise the client's own exceptions, which
    this class classifies with ``source_error`` (one classifier for both clients).
    """

    client: ClassVar[str]

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
        only: Collection[TopicPartition] | None = None,
    ):
        self.spec = spec
        # A partition task reads only its partitions (given by the scheduler); the others,
        # found by discovery, are reported in ``discovered`` for the scheduler to place.
        self.only = frozenset(only) if only is not None else None
        self.discovered: list[TopicPartition] = []
        self.bootstrap = resolve_bootstrap(spec)
        self.group_id = group_id
        self.client_id = spec.client_id or client_id or f"conveyor-{group_id}"
        self.request_timeout_ms = request_timeout_ms
        self.mirror_interval_s = mirror_interval_s
        self._clock = clock
        self._partitions: list[TopicPartition] = []
        self._highwater: dict[TopicPartition, int] = {}
        # Where the loop's offsets stand: positions handed out with the last batch (or
        # committed at open). A position that moved past them without records (over a
        # transaction marker) is handed out in an empty batch, so it is committed too.
        self._handed: Offsets = {}
        self._last_discovery = 0.0
        self._last_mirror = 0.0
        self._mirror_lock = threading.Lock()
        # A client's poll may return nothing, without an error, while the brokers are
        # down: after probe_interval_s without a record, a read asks the leaders for their
        # end offsets (bounded by request_timeout_ms); no answer is an outage.
        self.probe_interval_s = probe_interval_s
        self._last_contact = clock()
        # The log id of each topic found (core/positions.py; None: the broker reports no topic
        # id): a run's PositionScope holds this dict, so commits name the logs found later too.
        self.log_ids: dict[str, str | None] = {}
        # Positions not taken as stored (out of range while reading), for the loop to report.
        self._notes: list[PositionNote] = []
        self._notes_lock = threading.Lock()
        # Empty reads in a row that found a partition's position past the end its fetches
        # report (a broker that answers such a fetch with nothing instead of an error, as
        # tansu: waiting would be silent).
        self._past_end: dict[TopicPartition, int] = {}

    # -- the client's primitives ---------------------------------------------------------

    @abc.abstractmethod
    def _connect(self) -> None:
        """Create the consumer (no group membership, no auto commit). Raises on bad settings."""

    @abc.abstractmethod
    def _topic_partitions(self, topics: list[str] | None) -> dict[str, set[int]]:
        """Partitions of ``topics`` (every topic of the cluster when None) that exist."""

    @abc.abstractmethod
    def _assign(self, positions: dict[TopicPartition, int | str]) -> None:
        """Assign exactly these partitions, each at an offset, "earliest" or "latest"."""

    @abc.abstractmethod
    def _seek(self, offsets: Offsets) -> None:
        """Move these assigned partitions to these offsets (the others keep their position)."""

    @abc.abstractmethod
    def _positions(self) -> dict[TopicPartition, int | None]:
        """Each assigned partition's next offset to read (None when not known yet)."""

    @abc.abstractmethod
    def _offsets_for_time(self, parts: list[TopicPartition], ms: int) -> dict[TopicPartition, int]:
        """The first offset stamped at or after ``ms`` (partitions without one are left out)."""

    @abc.abstractmethod
    def _end_offsets(self, parts: list[TopicPartition], end: str) -> dict[TopicPartition, int]:
        """Each partition's offset at its "earliest" or "latest" end."""

    @abc.abstractmethod
    def _ask_leaders(self) -> None:
        """One request to the partitions' leaders (their end offsets), bounded by
        request_timeout_ms; positions do not move. Raises when there is no answer."""

    @abc.abstractmethod
    def _poll(self, max_records: int, timeout_s: float) -> tuple[pa.Table | None, int]:
        """Records that arrive within ``timeout_s`` (at most ``max_records``) in the source
        layout, in offset order per partition, and their key + value bytes."""

    @abc.abstractmethod
    def _fetched_highwaters(self) -> dict[TopicPartition, int]:
        """High watermarks the last fetches reported (no request)."""

    @abc.abstractmethod
    def _commit_group(self, offsets: Offsets) -> None:
        """Commit ``offsets`` to the consumer group ``group_id`` (a second client)."""

    @abc.abstractmethod
    def _group_committed(self, group: str) -> dict[TopicPartition, int | None]:
        """Consumer group ``group``'s committed offsets of the assigned partitions."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Close the consumer and the group client."""

    @abc.abstractmethod
    def _topic_ids(self, topics: list[str]) -> tuple[str | None, dict[str, str | None]]:
        """The cluster id and each topic's id (KIP-516) as standard UUID text; None where the
        broker reports none."""

    @abc.abstractmethod
    def _log_ranges(self, parts: list[TopicPartition]) -> dict[TopicPartition, tuple[int, int]]:
        """Each partition's log start and end offsets (a client may move unassigned positions;
        ``open`` assigns afterwards)."""

    @abc.abstractmethod
    def _fetched_ends(self, parts: list[TopicPartition]) -> dict[TopicPartition, int]:
        """Each partition's log end as a fetch reports it (its high watermark), read by a
        short-lived consumer of its own within the request timeout; partitions it did not learn
        are left out."""

    @abc.abstractmethod
    def _out_of_range_error(self, exc: BaseException) -> list[TopicPartition] | None:
        """The partitions a client error says are out of range (their position is not in the
        log, ``auto.offset.reset`` set to error), or None when it is another error."""

    @abc.abstractmethod
    def _opened(self) -> bool:
        """Whether the consumer is open."""

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

    def _ensure_connected(self) -> None:
        if self._opened():
            return
        try:
            self._connect()
        except ConveyorError:
            raise
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"cannot connect to Kafka at {self.bootstrap}") from None

    # -- positions: the logs' identities and ranges (core/positions.py) ---------------------

    def describe_logs(self, stored: Offsets | None = None) -> dict[TopicPartition, LogFacts]:
        """Every partition of the spec's topics now (this source's own, for a task): its log id
        and the offsets its log holds. Connects if needed (``open`` then reuses the client).
        A ``stored`` position past the end a ListOffsets answer gives is checked against the
        end a fetch reports (tansu answers ListOffsets with its last record batch's base offset
        + 1, not the log end; a fetch's high watermark is right)."""
        self._ensure_connected()
        parts, _missing = self._discover()
        parts = self._mine(parts)
        try:
            self._learn_log_ids(sorted({tp.topic for tp in parts}))
            ranges = self._ranges(parts)
            doubtful = [tp for tp in parts if (stored or {}).get(tp, -1) > ranges[tp][1]]
            if doubtful:
                for tp, end in self._fetched_ends(doubtful).items():
                    ranges[tp] = (ranges[tp][0], max(ranges[tp][1], end))
        except ConveyorError:
            raise
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"reading the logs' offsets from {self.bootstrap}") from None
        return {tp: LogFacts(self.log_ids.get(tp.topic), lo, hi) for tp, (lo, hi) in ranges.items()}

    def _ranges(self, parts: list[TopicPartition]) -> dict[TopicPartition, tuple[int, int]]:
        """Each partition's log start and end, the end no lower than the last fetch reported."""
        fetched = self._fetched_highwaters() if self._partitions else {}
        return {
            tp: (lo, max(hi, fetched.get(tp, -1)))
            for tp, (lo, hi) in self._log_ranges(parts).items()
        }

    def _learn_log_ids(self, topics: list[str]) -> None:
        """The log ids of ``topics`` not known yet (a broker that reports none: None)."""
        todo = [t for t in topics if t not in self.log_ids]
        if not todo:
            return
        try:
            cluster, ids = self._topic_ids(todo)
        except ConveyorError:
            raise
        except Exception as e:  # noqa: BLE001 - a broker without DescribeTopics: no ids
            if classify_kafka_error(e) == ErrorKind.TRANSIENT:
                raise source_error(e, f"reading the topics' ids from {self.bootstrap}") from None
            log.info("%s: no topic ids from %s (%s)", self.group_id, self.bootstrap, e)
            cluster, ids = None, {}
        for t in todo:
            self.log_ids[t] = log_id_of(cluster, ids.get(t))

    def _position_lost(self, parts: list[TopicPartition]) -> None:
        """The client found these partitions' positions outside the log: each goes by
        ``source.out_of_range`` (``PositionLostError`` under ``fail``), noted for the loop."""
        positions = self._positions()
        stored = {
            tp: StoredPosition(int(p)) for tp in parts if (p := positions.get(tp)) is not None
        }
        facts = {
            tp: LogFacts(self.log_ids.get(tp.topic), lo, hi)
            for tp, (lo, hi) in self._ranges(list(stored)).items()
        }
        self._past_end.clear()
        start, notes = judge_positions(stored, facts, None, self.spec.out_of_range)
        # The loop's offsets stay where they were: the new position is handed out with the
        # next batch (an empty one if the partition holds nothing more) and so committed.
        self._seek({tp: start.get(tp, stored[tp].offset) for tp in stored})
        for n in notes:
            log.warning("%s: %s", self.group_id, n.message)
        with self._notes_lock:
            self._notes.extend(notes)

    def _check_past_end(self, positions: dict[TopicPartition, int | None]) -> None:
        """After an empty read: a position past the high watermark its partition's fetches
        report, ``PAST_END_READS`` empty reads in a row, is out of range (``_position_lost``)."""
        fetched = self._fetched_highwaters()
        past = {tp for tp, p in positions.items() if p is not None and p > fetched.get(tp, p)}
        self._past_end = {tp: self._past_end.get(tp, 0) + 1 for tp in past}
        lost = [tp for tp, n in self._past_end.items() if n >= PAST_END_READS]
        if lost:
            try:
                self._position_lost(lost)
            except ConveyorError:
                raise
            except Exception as e:  # noqa: BLE001 - classified
                raise source_error(e, f"reading the log range from {self.bootstrap}") from None

    def take_position_notes(self) -> list[PositionNote]:
        """Positions not taken as stored since the last call (the loop reports them)."""
        with self._notes_lock:
            notes, self._notes = self._notes, []
        return notes

    def _discover(self) -> tuple[list[TopicPartition], list[str]]:
        """Every partition to read now, and the listed topics that do not exist (yet)."""
        try:
            found = self._topic_partitions(
                None if self.spec.topics_regex is not None else list(self.spec.topics)
            )
        except ConveyorError:
            raise
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"reading the topics' metadata from {self.bootstrap}") from None
        parts: list[TopicPartition] = []
        missing: list[str] = []
        for topic in sorted({*self.spec.topics, *(t for t in found if self.spec.matches(t))}):
            ps = found.get(topic)
            if not ps:
                if topic in self.spec.topics:
                    missing.append(topic)
                continue
            parts.extend(TopicPartition(topic, p) for p in sorted(ps))
        self.discovered = list(parts)
        return parts, missing

    def _mine(self, parts: list[TopicPartition]) -> list[TopicPartition]:
        return parts if self.only is None else [tp for tp in parts if tp in self.only]

    def _assign_parts(self, parts: list[TopicPartition], committed: Offsets) -> None:
        """Assign ``parts``; keep the positions of partitions already read, start the others
        at their committed offset or the start position (start_from at open, earliest for
        partitions found later)."""
        known = self._positions() if self._partitions else {}
        start = self.spec.start_from if not self._partitions else "earliest"
        positions: dict[TopicPartition, int | str] = {}
        fresh: list[TopicPartition] = []
        for tp in parts:
            if known.get(tp) is not None:
                positions[tp] = known[tp]  # type: ignore[assignment]
            elif tp in committed:
                positions[tp] = committed[tp]
                self._handed[tp] = committed[tp]
            else:
                fresh.append(tp)
        try:
            if start in ("earliest", "latest"):
                positions.update({tp: start for tp in fresh})
            elif fresh:
                ms = int(parse_start_timestamp(start).timestamp() * 1000)
                found = self._offsets_for_time(fresh, ms)
                # nothing stamped at or after the time yet: from the end
                positions.update({tp: found.get(tp, "latest") for tp in fresh})
            self._assign(positions)
        except ConveyorError:
            raise
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"finding the start offsets ({start})") from None
        self._partitions = list(parts)

    @property
    def partitions(self) -> list[TopicPartition]:
        return list(self._partitions)

    def close(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - closing is best effort
            log.debug("error closing the consumer", exc_info=True)

    # -- reading ------------------------------------------------------------------

    def _maybe_discover(self) -> None:
        if self._clock() - self._last_discovery < self.spec.discovery_interval_s:
            return
        self._last_discovery = self._clock()
        parts, _ = self._discover()
        parts = self._mine(parts)
        new = [tp for tp in parts if tp not in set(self._partitions)]
        if new:
            self._learn_log_ids(sorted({tp.topic for tp in new}))
            # Kept partitions stay assigned even if their topic vanished from the metadata.
            keep = [tp for tp in self._partitions if tp not in set(parts)]
            self._assign_parts(sorted({*keep, *parts}), {})
            log.info(
                "%s: reading new partition(s) %s from the earliest offset",
                self.group_id,
                ", ".join(map(str, new)),
            )

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

    # -- offsets of a stopped connector (conveyor offsets reset) -----------------------

    def offsets_at(self, to: str) -> Offsets:
        """Every partition's offset at ``earliest``, ``latest`` or an ISO 8601 time (open first)."""
        parts = list(self._partitions)
        try:
            if to in ("earliest", "latest"):
                return self._end_offsets(parts, to)
            ms = int(parse_start_timestamp(to).timestamp() * 1000)
            found = self._offsets_for_time(parts, ms)
            ends = self._end_offsets([tp for tp in parts if tp not in found], "latest")
            return {tp: found[tp] if tp in found else ends[tp] for tp in parts}
        except ConveyorError:
            raise
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"finding offsets at {to}") from None

    def group_offsets(self, group: str) -> Offsets:
        """The committed offsets of consumer group ``group`` for this source's partitions
        (an OffsetFetch: the group is read, never joined)."""
        try:
            found = self._group_committed(group)
        except ConveyorError:
            raise
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"reading the offsets of consumer group {group!r}") from None
        return {tp: off for tp, off in found.items() if off is not None and off >= 0}
