"""The shared source's batching (``KafkaSource.read``) over a fake client: a batch closes
on age once the source has caught up, and keeps filling while there is a backlog."""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa

from conveyor.brokers.kafka import KafkaSource, columns_to_table
from conveyor.core.model import BatchPolicy, Offsets, SourceSpec, TopicPartition

TP = TopicPartition("orders", 0)


class FakeClient(KafkaSource):
    """A partition of ``end`` records, fetched 100 at a time, 5 ms per fetch."""

    client = "fake"

    def __init__(self, end: int):
        super().__init__(SourceSpec(topics=["orders"], bootstrap_servers="127.0.0.1:1"), "g")
        self.end = end
        self.pos = 0
        self._partitions = [TP]

    def _opened(self) -> bool:
        return True

    def _positions(self) -> dict[TopicPartition, int | None]:
        return {TP: self.pos}

    def _fetched_highwaters(self) -> dict[TopicPartition, int]:
        return {TP: self.end}

    def _seek(self, offsets: Offsets) -> None:
        self.pos = offsets[TP]

    def _poll(self, max_records: int, timeout_s: float) -> tuple[pa.Table | None, int]:
        time.sleep(0.005)
        n = min(100, max_records, self.end - self.pos)
        if n <= 0:
            return None, 0
        offsets = list(range(self.pos, self.pos + n))
        self.pos += n
        table = columns_to_table(
            topics=["orders"] * n,
            partitions=[0] * n,
            offsets=offsets,
            timestamps=[1_000] * n,
            timestamp_types=[0] * n,
            type_names={0: "create"},
            keys=[None] * n,
            headers=[None] * n,
            values=[b"{}"] * n,
        )
        return table, 2 * n

    # The primitives reading does not call.
    def _connect(self) -> None:
        raise AssertionError("not called")

    def _topic_partitions(self, topics: list[str] | None) -> dict[str, set[int]]:
        raise AssertionError("not called")

    def _assign(self, positions: dict[TopicPartition, int | str]) -> None:
        raise AssertionError("not called")

    def _offsets_for_time(self, parts: list[TopicPartition], ms: int) -> dict[TopicPartition, int]:
        raise AssertionError("not called")

    def _end_offsets(self, parts: list[TopicPartition], end: str) -> dict[TopicPartition, int]:
        raise AssertionError("not called")

    def _ask_leaders(self) -> None:
        raise AssertionError("not called")

    def _commit_group(self, offsets: Offsets) -> None:
        raise AssertionError("not called")

    def _topic_ids(self, topics: list[str]) -> tuple[str | None, dict[str, str | None]]:
        raise AssertionError("not called")

    def _log_ranges(self, parts: list[TopicPartition]) -> dict[TopicPartition, tuple[int, int]]:
        raise AssertionError("not called")

    def _fetched_ends(self, parts: list[TopicPartition]) -> dict[TopicPartition, int]:
        raise AssertionError("not called")

    def _out_of_range_error(self, exc: BaseException) -> list[TopicPartition] | None:
        return None

    def _group_committed(self, group: str) -> dict[TopicPartition, int | None]:
        raise AssertionError("not called")

    def _close(self) -> None:
        raise AssertionError("not called")

    def _maybe_discover(self) -> None:
        pass

    def _probe(self) -> None:
        pass


def test_a_backlog_fills_the_batch_past_max_wait() -> None:
    source = FakeClient(end=1_000)
    batch = source.read(BatchPolicy(max_records=1_000, max_wait_ms=1))
    assert batch is not None
    # 1 ms after the first record the partition still holds more: the batch fills to
    # max_records (10 fetches) instead of closing on age after the first one.
    assert batch.table.num_rows == 1_000
    assert batch.table.column("__offset").to_pylist() == list(range(1_000))
    assert batch.next_offsets == {TP: 1_000}


def test_a_caught_up_source_closes_on_age_and_on_size() -> None:
    # 250 records: less than the batch's room, a stream read as it arrives, not a
    # backlog: the batch closes on age (after one fetch) and the next read goes on.
    source = FakeClient(end=250)
    policy = BatchPolicy(max_records=1_000, max_wait_ms=1)
    batch = source.read(policy)
    assert batch is not None and batch.table.num_rows == 100
    offsets = batch.table.column("__offset").to_pylist()
    while (more := source.read(policy)) is not None:
        offsets += more.table.column("__offset").to_pylist()
    assert offsets == list(range(250))
    source = FakeClient(end=1_000)
    sized = source.read(BatchPolicy(max_records=300, max_wait_ms=1))
    assert sized is not None and sized.table.num_rows == 300
    assert sized.next_offsets == {TP: 300}


def test_fake_is_a_kafka_source() -> None:
    source: Any = FakeClient(end=0)
    assert isinstance(source, KafkaSource) and source.client == "fake"
