"""Where a Kafka-protocol source reads: discovery of topics and partitions (the spec's
topics and regex, new partitions found later), where each partition starts (committed offset,
start_from, earliest for partitions found later), the logs' identities and ranges
(``core/positions.py``: a position outside its log goes by ``source.out_of_range``), and the
offsets a stopped connector may be reset to."""

from __future__ import annotations

import logging

from conveyor.brokers.connection import classify_kafka_error
from conveyor.brokers.kafka_client import KafkaClient, source_error
from conveyor.core.errors import ConveyorError
from conveyor.core.model import Offsets, TopicPartition, parse_start_timestamp
from conveyor.core.positions import (
    LogFacts,
    PositionNote,
    StoredPosition,
    judge_positions,
    log_id_of,
)
from conveyor.core.sink import ErrorKind

log = logging.getLogger("conveyor.kafka")

# Empty reads in a row with a position past its partition's fetched end before it counts as
# out of range (one read may carry a high watermark from before the position was set).
PAST_END_READS = 3


class KafkaPositions(KafkaClient):
    """Discovery and positions over the client's primitives."""

    # -- discovery -------------------------------------------------------------------

    @property
    def partitions(self) -> list[TopicPartition]:
        return list(self._partitions)

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
