"""The Kafka-protocol source's client: the primitives each client implements
(``conveyor.brokers.kafka`` for kafka-python, ``conveyor.brokers.confluent`` for librdkafka),
the state every layer above shares, connecting and closing, and one classifier of errors.

The layers above it: ``kafka_positions.KafkaPositions`` (discovery, where each partition
starts and stands, a stopped connector's offsets), then ``kafka_source.KafkaSource``
(reading batches, lag, the consumer-group mirror)."""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from typing import ClassVar

import pyarrow as pa

from conveyor.brokers.connection import classify_kafka_error, describe_kafka_error
from conveyor.core.errors import ConveyorError, PermanentSourceError, TransientSourceError
from conveyor.core.model import Offsets, SourceSpec, TopicPartition
from conveyor.core.positions import PositionNote
from conveyor.core.sink import ErrorKind

log = logging.getLogger("conveyor.kafka")

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


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


class KafkaClient(abc.ABC):
    """The client primitives (``_connect`` ... ``_opened``) and the source's shared state.

    The primitives may block up to the request timeout; they raise the client's own
    exceptions, which the layers above classify with ``source_error`` (one classifier for
    both clients).
    """

    client: ClassVar[str]

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

    # -- connecting and closing ----------------------------------------------------------

    def _ensure_connected(self) -> None:
        if self._opened():
            return
        try:
            self._connect()
        except ConveyorError:
            raise
        except Exception as e:  # noqa: BLE001 - classified
            raise source_error(e, f"cannot connect to Kafka at {self.bootstrap}") from None

    def close(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - closing is best effort
            log.debug("error closing the consumer", exc_info=True)
