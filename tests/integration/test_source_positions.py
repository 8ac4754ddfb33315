"""The Kafka source and the positions it is given (issue 44, ``core/positions.py``), on Apache
Kafka 3.8 (``delete_records`` as retention does it, a topic deleted and created again) and on
tansu (a position past the end its fetches report, where it answers with nothing instead of an
error), with both clients: a position outside the log is never skipped over or waited on
silently; ``source.out_of_range`` decides, and each decision is a note with the messages given up.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.model import BatchPolicy, SourceSpec, TopicPartition
from conveyor.core.positions import PositionLostError, PositionNote
from tests.apache_kafka import ApacheKafka

pytestmark = pytest.mark.integration

POLICY = BatchPolicy(max_records=500, max_wait_ms=200)
CLIENTS = ["confluent", "kafka-python"]


class Kafka:
    """The broker's admin calls, with the SCRAM user (Apache Kafka) or none (tansu)."""

    def __init__(self, config: dict[str, Any], source: dict[str, Any]):
        self.config, self.source = config, source

    def admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        return AdminClient(self.config)

    def create(self, topic: str) -> None:
        from confluent_kafka.admin import NewTopic

        admin = self.admin()  # held until the result
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(60)

    def delete(self, topic: str) -> None:
        admin = self.admin()
        admin.delete_topics([topic])[topic].result(60)
        deadline = time.monotonic() + 60
        # Every topic's metadata (a request by name would create the topic again: see
        # tests/e2e/test_day_two_e2e.py).
        while topic in admin.list_topics(timeout=10).topics:
            assert time.monotonic() < deadline, f"topic {topic} still there after 60 s"
            time.sleep(0.5)

    def produce(self, topic: str, n: int) -> None:
        from confluent_kafka import Producer

        p = Producer(self.config)
        for i in range(n):
            p.produce(topic, value=str(i).encode(), partition=0)
        assert p.flush(60) == 0

    def delete_records(self, topic: str, before: int) -> None:
        from confluent_kafka import TopicPartition as CTP

        admin = self.admin()
        for f in admin.delete_records([CTP(topic, 0, before)]).values():
            f.result(60)

    def spec(self, topic: str, client: str, **extra: Any) -> SourceSpec:
        return SourceSpec(**{**self.source, "topics": [topic], "client": client, **extra})


@pytest.fixture
def kafka(apache_kafka: ApacheKafka, monkeypatch: pytest.MonkeyPatch) -> Kafka:
    from tests.apache_kafka import PASSWORD, PASSWORD_ENV

    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)  # the spec refers to it, as a user's does
    spec = apache_kafka.source_spec("x")
    spec.pop("topics")
    return Kafka(apache_kafka.client_config(), spec)


@pytest.fixture
def tansu_kafka(tansu: str) -> Kafka:
    return Kafka({"bootstrap.servers": tansu}, {"bootstrap_servers": tansu})


@pytest.fixture
def topic() -> str:
    return f"pos_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def opened() -> Iterator[list[KafkaSource]]:
    sources: list[KafkaSource] = []
    yield sources
    for s in sources:
        s.close()


def drain(source: KafkaSource, until: int, timeout: float = 60) -> tuple[list[int], list[Any]]:
    """Offsets read until the position reaches ``until``, and the notes taken meanwhile."""
    offsets: list[int] = []
    notes: list[PositionNote] = []
    tp = TopicPartition(source.spec.topics[0], 0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = source.read(POLICY)
        notes += source.take_position_notes()
        if batch is not None:
            offsets += batch.table.column("__offset").to_pylist()
            if batch.next_offsets.get(tp, -1) >= until:
                return offsets, notes
    raise AssertionError(f"read {len(offsets)} records, notes {notes}, not up to {until}")


@pytest.mark.parametrize("client", CLIENTS)
def test_records_deleted_under_a_reading_source_are_given_up_and_said(
    kafka: Kafka, topic: str, client: str, opened: list[KafkaSource]
) -> None:
    kafka.create(topic)
    kafka.produce(topic, 1_000)
    source = KafkaSource(kafka.spec(topic, client), group_id=f"g_{topic}")
    opened.append(source)
    tp = TopicPartition(topic, 0)
    facts = source.describe_logs({tp: 0})
    assert (facts[tp].start, facts[tp].end) == (0, 1_000) and facts[tp].log_id
    # Retention after the run judged its positions, before its client fetched anything: the
    # fetch finds the position gone (librdkafka fetches ahead as soon as a partition is
    # assigned, so the deletion comes first here).
    kafka.delete_records(topic, 600)
    source.open({tp: 0})
    offsets, notes = drain(source, 1_000)
    assert offsets == list(range(600, 1_000))
    (note,) = notes
    assert (note.tp, note.kind, note.stored, note.resumed_at, note.given_up) == (
        tp,
        "below_start",
        0,
        600,
        600,
    )


@pytest.mark.parametrize("client", CLIENTS)
def test_out_of_range_fail_stops_the_source_naming_both_offsets(
    kafka: Kafka, topic: str, client: str, opened: list[KafkaSource]
) -> None:
    kafka.create(topic)
    kafka.produce(topic, 100)
    source = KafkaSource(kafka.spec(topic, client, out_of_range="fail"), group_id=f"g_{topic}")
    opened.append(source)
    kafka.delete_records(topic, 50)
    source.open({TopicPartition(topic, 0): 10})
    with pytest.raises(PositionLostError, match=r"stored offset 10 is below the log start 50"):
        drain(source, 100)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_topic_created_again_is_another_log(
    kafka: Kafka, tansu_kafka: Kafka, topic: str, client: str, opened: list[KafkaSource]
) -> None:
    for broker in (kafka, tansu_kafka):
        broker.create(topic)
        first = KafkaSource(broker.spec(topic, client), group_id=f"g_{topic}")
        opened.append(first)
        before = first.describe_logs()[TopicPartition(topic, 0)].log_id
        first.close()
        broker.delete(topic)
        broker.create(topic)
        again = KafkaSource(broker.spec(topic, client), group_id=f"g_{topic}")
        opened.append(again)
        after = again.describe_logs()[TopicPartition(topic, 0)].log_id
        assert before and after and before != after


@pytest.mark.parametrize("client", CLIENTS)
def test_a_position_past_the_end_tansu_answers_with_nothing_is_found_not_waited_on(
    tansu_kafka: Kafka, topic: str, client: str, opened: list[KafkaSource]
) -> None:
    """tansu answers a fetch past the log end with no records and no error: the source sees its
    position past the high watermark its fetches report and goes by out_of_range (earliest)."""
    tansu_kafka.create(topic)
    tansu_kafka.produce(topic, 20)  # one record batch: tansu's ListOffsets says its end is 1
    source = KafkaSource(tansu_kafka.spec(topic, client), group_id=f"g_{topic}")
    opened.append(source)
    tp = TopicPartition(topic, 0)
    # The end a fetch reports, not ListOffsets' short answer: position 15 is inside the log.
    assert source.describe_logs({tp: 15})[tp].end == 20
    source.open({tp: 50})
    offsets, notes = drain(source, 20)
    assert offsets == list(range(20))
    (note,) = notes
    assert (note.kind, note.stored, note.resumed_at, note.given_up) == ("above_end", 50, 0, 0)
