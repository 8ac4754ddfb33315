"""What a stored position belongs to, and the one rule that decides whether it is used.

A connector's position in a partition (the next offset to read) is only valid for the log,
the destination and the connector it was written for. Every place that keeps one (the meta
store's offsets, a partition task's commits, a target's offsets table, Redis hash, Kafka
transactional group or lakehouse commit mark) stores it with:

- **the log**: ``log_id``, the cluster id and the topic id the broker reports
  (``<cluster>/<topic id>``, KIP-516): a topic deleted and created again under the same name
  has a new id, a broker that starts again empty (tansu) new topic ids. None where the broker
  reports no topic id (then only the range check below guards the position);
- **the destination**: the sink's asset key (``postgres/public/orders``): a connector pointed at
  another table, stream or key prefix does not carry its old position there;
- **the incarnation**: an id the meta store mints when the connector is created
  (``conveyor_connectors.incarnation``). A target keeps positions under the writer id
  ``<writer>@<incarnation>``, so a connector deleted and created again, or one of the same name
  in another project (another meta store) on the same database, never finds them.

``judge_positions`` is the rule (pure): a position naming another log or destination is set
aside (the partition starts per ``source.start_from``); one outside the log (below its start:
retention deleted what was never read; above its end: the log was reset) goes by
``source.out_of_range`` (``earliest``, the default, loses nothing it could still read and says
what it could not; ``latest``; ``fail``). Every such decision is a ``PositionNote``: logged,
recorded in the connector's history and last error, counted per partition in ``given_up``.

A position given from outside (the REST API's KIP-875 ``PATCH .../offsets``, the CLI's
``offsets reset --to``, a backfill's start or end) passes one validator, at the end of this
module: ``checked_position`` for one (topic, partition, offset), ``parse_positions`` for
``TOPIC:PARTITION:OFFSET[,...]`` (``PositionError`` naming the item and the rule).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from conveyor.core.errors import PermanentSourceError
from conveyor.core.model import Offsets, SourceSpec, TopicPartition

#: Separates a writer's name from its connector's incarnation in a target's writer id.
INCARNATION_SEP = "@"


class PositionLostError(PermanentSourceError):
    """A stored position lies outside the log and ``source.out_of_range`` is ``fail``: the
    connector goes to Error (no retry brings the records back)."""


class OutOfRange(str, enum.Enum):
    """What a position outside the log does (``source.out_of_range``)."""

    EARLIEST = "earliest"  # resume at the log's start: every record still there is read
    LATEST = "latest"  # resume at the log's end: records in between are given up
    FAIL = "fail"  # the connector goes to Error; the operator moves the offsets


@dataclass(frozen=True)
class StoredPosition:
    """A position as a store keeps it: the next offset, and what it belongs to (None: written
    before positions named their log and destination, by the release before issue 44, or set by
    an operator for whatever log is there)."""

    offset: int
    log_id: str | None = None
    destination: str | None = None


StoredPositions = dict[TopicPartition, StoredPosition]


@dataclass
class PositionScope:
    """What a run's positions are positions of: its sink's destination, and the log id of each
    topic it reads (filled by the source as it finds topics; None: no id reported)."""

    destination: str | None
    log_ids: dict[str, str | None] = field(default_factory=dict)

    def position(self, tp: TopicPartition, offset: int) -> StoredPosition:
        return StoredPosition(offset, self.log_ids.get(tp.topic), self.destination)


@dataclass(frozen=True)
class TargetBinding:
    """What a sink whose target keeps offsets (``core.sink.OffsetsInTarget``) commits for: the
    writer id (``<writer>@<incarnation>``), the run's generation, and the scope its positions
    name. ``legacy_writer``: the bare writer name the release before incarnations used, whose
    positions a migrated connector takes over once (None: none to take)."""

    writer: str
    generation: int
    scope: PositionScope = field(default_factory=lambda: PositionScope(None))
    legacy_writer: str | None = None
    # Positions the run judged outside the log at start (``judge_positions``), by partition:
    # such a stored offset covers nothing, and the partition's next commit replaces it (once
    # the target holds another offset there, it is the run's own again).
    void: dict[TopicPartition, int] = field(default_factory=dict, compare=False)

    def usable(self, stored: Mapping[TopicPartition, StoredPosition]) -> Offsets:
        """The offsets of ``stored`` that are positions of this scope's logs and destination,
        and not positions the run found outside the log."""
        ok = usable_offsets(stored, self.scope.log_ids, self.scope.destination)
        return {tp: o for tp, o in ok.items() if self.void.get(tp) != o}


@dataclass(frozen=True)
class LogFacts:
    """What the broker says of one partition now: its log id and the offsets it holds."""

    log_id: str | None
    start: int  # the log start offset (low watermark)
    end: int  # the log end offset (high watermark)


@dataclass(frozen=True)
class PositionNote:
    """A stored position not used as it was, and why (shown to the operator)."""

    tp: TopicPartition
    kind: str  # other_log | other_destination | below_start | above_end
    stored: int
    resumed_at: int | None  # None: per source.start_from (the position was set aside)
    given_up: int  # records skipped that the log still held or had held unread
    message: str


def writer_id(writer: str, incarnation: str) -> str:
    """The name a target keeps a writer's positions under: ``<writer>@<incarnation>``."""
    return f"{writer}{INCARNATION_SEP}{incarnation}"


def split_writer_id(wid: str) -> tuple[str, str | None]:
    """``(writer, incarnation)`` of a writer id; incarnation None for a writer id of the release
    before incarnations (the bare writer name)."""
    writer, sep, incarnation = wid.rpartition(INCARNATION_SEP)
    if not sep or not incarnation:
        return wid, None
    return writer, incarnation


def log_id_of(cluster_id: str | None, topic_id: str | None) -> str | None:
    """``<cluster>/<topic id>``; None when the broker reports no topic id (or the null id)."""
    if not topic_id or topic_id.strip("A=") == "" or set(topic_id) <= {"0", "-"}:
        return None
    return f"{cluster_id or '-'}/{topic_id}"


def other_identity(
    stored: StoredPosition, log_id: str | None, destination: str | None
) -> str | None:
    """Why ``stored`` is not a position in the log ``log_id`` for ``destination`` (``other_log``
    or ``other_destination``); None when it is, or cannot be told apart (an unknown side)."""
    if stored.log_id is not None and log_id is not None and stored.log_id != log_id:
        return "other_log"
    if (
        stored.destination is not None
        and destination is not None
        and stored.destination != destination
    ):
        return "other_destination"
    return None


def usable_offsets(
    stored: Mapping[TopicPartition, StoredPosition],
    log_ids: Mapping[str, str | None],
    destination: str | None,
) -> Offsets:
    """The offsets of ``stored`` that belong to the current logs (``log_ids`` by topic) and
    ``destination``: what a target's rows may cover (the rows they skip as written already)."""
    return {
        tp: p.offset
        for tp, p in stored.items()
        if other_identity(p, log_ids.get(tp.topic), destination) is None
    }


def judge_positions(
    stored: Mapping[TopicPartition, StoredPosition],
    facts: Mapping[TopicPartition, LogFacts],
    destination: str | None,
    policy: OutOfRange | str = OutOfRange.EARLIEST,
) -> tuple[Offsets, list[PositionNote]]:
    """Where each partition with a stored position starts, and the notes for those not taken
    as stored. A partition the broker did not describe keeps its position (its log is not
    known yet: the source finds it later and reads it from there). ``PositionLostError`` under
    ``fail`` for a position outside the log."""
    policy = OutOfRange(policy)
    start: Offsets = {}
    notes: list[PositionNote] = []
    for tp, p in sorted(stored.items(), key=lambda kv: (kv[0].topic, kv[0].partition)):
        f = facts.get(tp)
        if f is None:
            start[tp] = p.offset
            continue
        why = other_identity(p, f.log_id, destination)
        if why is not None:
            notes.append(_set_aside(tp, p, f, destination, why))
            continue
        if f.start <= p.offset <= f.end:
            start[tp] = p.offset
            continue
        note = _out_of_range(tp, p, f, policy)
        notes.append(note)
        if note.resumed_at is not None:
            start[tp] = note.resumed_at
    return start, notes


def _set_aside(
    tp: TopicPartition, p: StoredPosition, f: LogFacts, destination: str | None, why: str
) -> PositionNote:
    if why == "other_log":
        what = (
            f"the stored offset {p.offset} is a position in another log ({p.log_id}; the topic "
            f"is now {f.log_id}: deleted and created again, or a broker that started empty)"
        )
    else:
        what = (
            f"the stored offset {p.offset} was written for another destination "
            f"({p.destination}; the connector now writes to {destination})"
        )
    return PositionNote(tp, why, p.offset, None, 0, f"{tp}: {what}; starting per start_from")


def _out_of_range(
    tp: TopicPartition, p: StoredPosition, f: LogFacts, policy: OutOfRange
) -> PositionNote:
    below = p.offset < f.start
    kind = "below_start" if below else "above_end"
    where = (
        f"below the log start {f.start} (retention or delete_records removed records never read)"
        if below
        else f"above the log end {f.end} (the log was reset or truncated)"
    )
    head = f"{tp}: the stored offset {p.offset} is {where}"
    if policy is OutOfRange.FAIL:
        raise PositionLostError(
            f"{head}; source.out_of_range is fail: move the offsets (conveyor offsets reset) "
            "or set out_of_range: earliest or latest"
        )
    if policy is OutOfRange.EARLIEST:
        lost = f.start - p.offset if below else 0
        return PositionNote(
            tp,
            kind,
            p.offset,
            f.start,
            lost,
            f"{head}; resumed at the log start {f.start}"
            + (f", {lost} message(s) given up" if lost else ""),
        )
    lost = f.end - p.offset if below else f.end - f.start
    return PositionNote(
        tp, kind, p.offset, f.end, lost,
        f"{head}; resumed at the log end {f.end} (out_of_range: latest), {lost} message(s) given up",
    )  # fmt: skip


def given_up_counts(notes: list[PositionNote], into: Mapping[str, int] | None) -> dict[str, int]:
    """The per-partition counter of messages given up (``topic[partition]``), ``notes`` added."""
    out = dict(into or {})
    for n in notes:
        if n.given_up:
            out[str(n.tp)] = out.get(str(n.tp), 0) + n.given_up
    return out


# -- positions given from outside (KIP-875 PATCH, offsets reset --to, backfill ranges) ---------

#: Kafka's bounds: a partition number is an int32, an offset an int64 (both >= 0 here).
MAX_PARTITION = 2**31 - 1
MAX_OFFSET = 2**63 - 1


class PositionError(ValueError):
    """A position given from outside that breaks a rule. ``part``: ``topic``, ``partition``,
    ``offset`` (the message names the value and the rule), or ``item`` (the text of one
    ``TOPIC:PARTITION:OFFSET``, named at the front of the message)."""

    def __init__(self, part: str, message: str):
        super().__init__(message)
        self.part = part


def topics_read(spec: Mapping[str, Any] | None) -> SourceSpec | None:
    """What a connector reads, from its stored spec: ``source.topics`` and ``source.topics_regex``
    (``SourceSpec.matches``). None when the spec names neither (a source connector, a spec file
    removed): nothing to check a topic against."""
    source = (spec or {}).get("source")
    if not isinstance(source, Mapping) or not (source.get("topics") or source.get("topics_regex")):
        return None
    try:
        return SourceSpec.model_validate(
            {"topics": source.get("topics") or [], "topics_regex": source.get("topics_regex")}
        )
    except ValidationError:
        return None


def _bounded(value: object, part: str, top: int, what: str) -> int:
    """``value`` (an integer, or its decimal digits as KIP-875 takes them) within 0..``top``."""
    shown = _shown(value)
    number: object = value
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value):
        # More digits than any number in range: not read (int() refuses over 4,300 digits).
        digits = value.lstrip("-")
        number = int(value) if len(digits) <= 30 else (-1 if value.startswith("-") else top + 1)
    if not isinstance(number, int) or isinstance(number, bool):
        raise PositionError(part, f"{shown} is not {what}: an integer from 0 to {top}")
    if not 0 <= number <= top:
        raise PositionError(part, f"{shown} is out of range: {what} is from 0 to {top}")
    return number


def _shown(value: object) -> str:
    """``value`` as an error message quotes it: short, whatever its size."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value) if value.bit_length() <= 128 else f"a {value.bit_length()}-bit number"
    if not isinstance(value, str):
        return repr(value)[:40]
    text = value[:40] + ("..." if len(value) > 40 else "")
    return text if re.fullmatch(r"-?[0-9.]+", text) else repr(text)


def checked_position(
    topic: object, partition: object, offset: object, reads: SourceSpec | None
) -> tuple[TopicPartition, int | None]:
    """The one rule of a position given from outside (KIP-875's: the topic a name, the
    partition Kafka's int32 and the offset its int64, both >= 0, given as integers or their
    decimal digits) and, with ``reads``, a topic the connector reads (listed, or matching
    ``topics_regex``). ``offset`` None: none given (a partition to forget). PositionError
    naming the part that breaks it."""
    if not isinstance(topic, str) or not topic:
        raise PositionError("topic", "expected a topic name")
    if reads is not None and not reads.matches(topic):
        raise PositionError(
            "topic",
            f"the connector does not read topic {topic[:80]!r} (it reads "
            f"{reads.describe_topics()})",
        )
    p = _bounded(partition, "partition", MAX_PARTITION, "a partition number (int32)")
    off = None if offset is None else _bounded(offset, "offset", MAX_OFFSET, "an offset (int64)")
    return TopicPartition(topic, p), off


def parse_positions(text: str, reads: SourceSpec | None) -> Offsets:
    """``TOPIC:PARTITION:OFFSET[,...]`` (spaces around items allowed), each item checked by
    ``checked_position``, none given twice. PositionError naming the item and the rule."""
    out: Offsets = {}
    for raw in text.split(","):
        item = raw.strip()
        shown = repr(item[:80])
        topic, sep, rest = item.rpartition(":")
        topic, sep2, part = topic.rpartition(":")
        if not (sep and sep2):
            raise PositionError("item", f"{shown} is not TOPIC:PARTITION:OFFSET")
        try:
            tp, offset = checked_position(topic, part, rest, reads)
        except PositionError as e:
            raise PositionError("item", f"{shown}: {e.part}: {e}") from None
        if tp in out:
            raise PositionError("item", f"{shown}: partition {tp} is given twice")
        assert offset is not None
        out[tp] = offset
    return out
