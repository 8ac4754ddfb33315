"""Partitions added to a running connector's topic (no server: tansu cannot add partitions).

tansu 0.6.0 refuses CreatePartitions, so partition growth is driven here through a fake
kafka-python consumer whose metadata grows; the same discovery path is exercised against
tansu with a new topic matching ``topics_regex`` (tests/sources/contract.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from kafka import TopicPartition as KTP

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.model import BatchPolicy, SourceSpec, TopicPartition


class FakeConsumer:
    def __init__(self, **options: Any):
        self.options = options
        self.partitions: dict[str, set[int]] = {"orders": {0, 1}}
        self.ends: dict[KTP, int] = {}
        self.pos: dict[KTP, int] = {}
        self.assigned: list[KTP] = []

    def topics(self) -> set[str]:
        return set(self.partitions)

    def partitions_for_topic(self, topic: str) -> set[int]:
        return set(self.partitions.get(topic, set()))

    def assign(self, parts: list[KTP]) -> None:
        self.assigned = list(parts)
        self.pos = {}  # as kafka-python: a new assignment forgets positions

    def assignment(self) -> set[KTP]:
        return set(self.assigned)

    def position(self, tp: KTP, timeout_ms: int | None = None) -> int | None:
        return self.pos.get(tp)

    def seek(self, tp: KTP, off: int) -> None:
        self.pos[tp] = off

    def seek_to_beginning(self, *tps: KTP) -> None:
        for tp in tps:
            self.pos[tp] = 0

    def seek_to_end(self, *tps: KTP) -> None:
        for tp in tps:
            self.pos[tp] = self.ends.get(tp, 0)

    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, Any]:
        return {}

    def highwater(self, tp: KTP) -> int | None:
        return self.ends.get(tp)

    def end_offsets(self, tps: list[KTP], timeout_ms: int | None = None) -> dict[KTP, int]:
        return {tp: self.ends.get(tp, 0) for tp in tps}

    def close(self, autocommit: bool = False) -> None:
        pass


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> list[FakeConsumer]:
    made: list[FakeConsumer] = []

    def factory(**options: Any) -> FakeConsumer:
        made.append(FakeConsumer(**options))
        return made[-1]

    import kafka

    factory.DEFAULT_CONFIG = kafka.KafkaConsumer.DEFAULT_CONFIG  # type: ignore[attr-defined]
    monkeypatch.setattr("kafka.KafkaConsumer", factory)
    return made


def test_new_partitions_are_assigned_from_the_earliest_offset_and_others_keep_their_place(
    fake: list[FakeConsumer],
) -> None:
    now = [0.0]
    spec = SourceSpec(
        topics=["orders"],
        bootstrap_servers="127.0.0.1:1",
        start_from="latest",
        client="kafka-python",
    )
    source = KafkaSource(spec, group_id="c", clock=lambda: now[0])
    committed = {TopicPartition("orders", 0): 40}
    c = None
    try:
        source.open(committed)
        c = fake[0]
        c.ends = {KTP("orders", 0): 50, KTP("orders", 1): 70, KTP("orders", 2): 5}
        assert c.options["isolation_level"] == "read_committed"
        assert c.options["metadata_max_age_ms"] == 30_000
        assert c.pos == {KTP("orders", 0): 40, KTP("orders", 1): 0}  # latest: seek_to_end at 0
        c.pos[KTP("orders", 0)] = 45  # read on meanwhile
        c.partitions["orders"].add(2)
        policy = BatchPolicy(max_wait_ms=1)
        source.read(policy)
        assert len(c.assigned) == 2, "nothing new before the discovery interval"
        now[0] = 30.0
        source.read(policy)
        assert sorted(c.assigned) == [KTP("orders", p) for p in (0, 1, 2)]
        # the new partition starts at its beginning (not at start_from: latest); the others
        # keep the position they had reached
        assert c.pos[KTP("orders", 2)] == 0 and c.pos[KTP("orders", 0)] == 45
        assert TopicPartition("orders", 2) in source.highwaters()
        assert source.lag({TopicPartition("orders", 0): 45, TopicPartition("orders", 1): 70}) == 10
    finally:
        source.close()
