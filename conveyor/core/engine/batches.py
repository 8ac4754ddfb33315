"""What flows through the sink connector loop (``core.engine.loop``) and its collaborators: a source
batch, the transform's output and the rows it rejected, a dead letter and where it is written,
and each row's coordinates (topic, partition, offset)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from conveyor.core.engine.failure import FailedMessage
from conveyor.core.model import OFFSET_COL, PARTITION_COL, TOPIC_COL, Offsets, TopicPartition


@dataclass(frozen=True)
class SourceBatch:
    """Messages read from the log: the source table and the positions after it."""

    table: pa.Table  # META_COLUMNS (without __destination) + __value
    next_offsets: Offsets  # per partition read in this batch: last offset + 1
    nbytes: int = 0


@dataclass(frozen=True)
class Rejected:
    """A source row the transform could not decode, or whose destination was refused."""

    index: int  # row index in the source batch
    message: str
    error_class: str = "decode"


@dataclass(frozen=True)
class Transformed:
    table: pa.Table  # rows to send, META_COLUMNS + payload columns
    rejected: tuple[Rejected, ...] = ()
    filtered: int = 0


class DeadLetterWriter(Protocol):
    def write(self, letters: list[DeadLetter]) -> None:
        """Durably store dead letters; returns only once they are safe."""


@dataclass(frozen=True)
class DeadLetter:
    """A failed message with everything needed to inspect and replay it."""

    failed: FailedMessage
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    timestamp_ms: int | None
    first_failure_at: float
    last_failure_at: float


def coords(table: pa.Table, index: int) -> tuple[str, int, int]:
    """(topic, partition, offset) of the row at ``index``."""
    return (
        table.column(TOPIC_COL)[index].as_py(),
        table.column(PARTITION_COL)[index].as_py(),
        table.column(OFFSET_COL)[index].as_py(),
    )


def all_coords(table: pa.Table) -> list[tuple[str, int, int]]:
    """(topic, partition, offset) of every row, in order."""
    return list(
        zip(
            table.column(TOPIC_COL).to_pylist(),
            table.column(PARTITION_COL).to_pylist(),
            table.column(OFFSET_COL).to_pylist(),
            strict=True,
        )
    )


def offsets_before(table: pa.Table, cut: int, next_offsets: Offsets) -> Offsets:
    """What a commit of the rows before source index ``cut`` stores: per partition, the
    offset of its first row at or after ``cut``, else the batch's next offset."""
    out = dict(next_offsets)
    seen: set[TopicPartition] = set()
    for i, (topic, part, off) in enumerate(all_coords(table)):
        tp = TopicPartition(topic, part)
        if i >= cut and tp not in seen:
            seen.add(tp)
            out[tp] = off
    return out
