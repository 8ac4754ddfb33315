"""The test reader that applies read_committed's rule to a topic's raw record batches
(tests/kafka_read_committed.py): the rule on batches made here, then against transactions a
librdkafka producer commits and aborts on tansu, and against librdkafka's own read_committed
consumer where the two agree (committed transactions only)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kafka_read_committed import (
    Batch,
    Record,
    Tail,
    fetch_batches,
    read_committed,
    read_topic,
)


def records(partition: int, first: int, values: list[bytes]) -> tuple[Record, ...]:
    return tuple(Record(partition, first + i, None, v) for i, v in enumerate(values))


def data(partition: int, offset: int, pid: int, values: list[bytes], txn: bool = True) -> Batch:
    return Batch(
        partition,
        offset,
        offset + len(values),
        pid,
        txn,
        False,
        None,
        records(partition, offset, values),
    )


def marker(partition: int, offset: int, pid: int, commit: bool) -> Batch:
    return Batch(partition, offset, offset + 1, pid, True, True, commit, ())


def test_a_commit_marker_releases_its_producers_records_and_an_abort_drops_them() -> None:
    got = read_committed(
        [
            data(0, 0, 7, [b"a", b"b"]),
            data(0, 2, 8, [b"x"]),  # another producer's, interleaved
            marker(0, 3, 7, commit=True),
            data(0, 4, 7, [b"c"]),
            marker(0, 5, 8, commit=False),
            marker(0, 6, 7, commit=False),
            data(0, 7, -1, [b"plain"], txn=False),
        ]
    )
    assert got.values() == [b"a", b"b", b"plain"]
    assert [r.value for r in got.aborted] == [b"x", b"c"]
    assert got.pending == {} and got.markers == 3


def test_records_with_no_marker_yet_are_pending_not_delivered() -> None:
    got = read_committed([data(0, 0, 7, [b"a"]), marker(0, 1, 7, True), data(0, 2, 7, [b"b"])])
    assert got.values() == [b"a"]
    assert {k: [r.value for r in v] for k, v in got.pending.items()} == {(0, 7): [b"b"]}


def test_a_marker_applies_to_its_own_partition_only() -> None:
    got = read_committed([data(0, 0, 7, [b"p0"]), data(1, 0, 7, [b"p1"]), marker(1, 1, 7, True)])
    assert got.values() == [b"p1"]
    assert list(got.pending) == [(0, 7)]


# -- against the embedded broker ---------------------------------------------------------------


@pytest.fixture
def topic(tansu: str) -> Iterator[str]:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"rc_{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": tansu})
    admin.create_topics([NewTopic(name, 2, 1)])[name].result(30)
    yield name
    admin.delete_topics([name])[name].result(30)


def transactional(tansu: str) -> Any:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": tansu, "transactional.id": f"rc-{uuid.uuid4().hex}"})
    p.init_transactions(30)
    return p


def transaction(p: Any, topic: str, values: list[str], *, commit: bool) -> None:
    p.begin_transaction()
    for i, v in enumerate(values):
        p.produce(topic, value=v.encode(), partition=i % 2)
    p.flush(30)
    if commit:
        p.commit_transaction(30)
    else:
        p.abort_transaction(30)


def librdkafka_read_committed(tansu: str, topic: str, expected: int) -> list[bytes]:
    """What librdkafka's read_committed consumer delivers from both partitions, up to the end."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": tansu,
            "group.id": f"rc-{uuid.uuid4().hex}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    c.assign([TopicPartition(topic, p, 0) for p in (0, 1)])
    out: list[bytes] = []
    ended: set[int] = set()
    try:
        while len(ended) < 2 or len(out) < expected:
            m = c.poll(30)
            assert m is not None, f"librdkafka delivered {len(out)} of {expected} records"
            if m.error():
                ended.add(m.partition())
            else:
                out.append(m.value())
    finally:
        c.close()
    return out


@pytest.mark.integration
def test_one_committed_and_one_aborted_transaction_read_back_the_committed_records(
    tansu: str, topic: str
) -> None:
    p = transactional(tansu)
    transaction(p, topic, ["c0", "c1", "c2", "c3"], commit=True)
    transaction(p, topic, ["a0", "a1", "a2"], commit=False)
    transaction(p, topic, ["d0", "d1"], commit=True)
    got = read_topic(tansu, topic)
    assert sorted(got.values()) == [b"c0", b"c1", b"c2", b"c3", b"d0", b"d1"]
    assert sorted(r.value for r in got.aborted) == [b"a0", b"a1", b"a2"]
    assert got.pending == {}
    # Each transaction left a marker on both partitions it wrote to.
    batches = fetch_batches(tansu, topic, 0) + fetch_batches(tansu, topic, 1)
    assert sorted(b.commit for b in batches if b.control) == [False, False, True, True, True, True]


@pytest.mark.integration
def test_a_transaction_left_open_is_pending_until_a_new_producer_of_the_id_fences_it(
    tansu: str, topic: str
) -> None:
    from confluent_kafka import Producer

    tid = f"rc-{uuid.uuid4().hex}"
    conf = {"bootstrap.servers": tansu, "transactional.id": tid}
    first = Producer(conf)
    first.init_transactions(30)
    transaction(first, topic, ["c0", "c1"], commit=True)
    first.begin_transaction()
    for i in range(4):
        first.produce(topic, value=f"open{i}".encode(), partition=i % 2)
    first.flush(30)
    got = read_topic(tansu, topic)  # the process dies here: no commit, no abort
    assert sorted(got.values()) == [b"c0", b"c1"]
    assert sum(len(v) for v in got.pending.values()) == 4
    second = Producer(conf)
    second.init_transactions(30)  # fences the first and ends its open transaction
    transaction(second, topic, ["n0", "n1"], commit=True)
    got = read_topic(tansu, topic)
    assert sorted(got.values()) == [b"c0", b"c1", b"n0", b"n1"]
    assert got.pending == {}, "the fenced producer's open transaction got no marker"


@pytest.mark.integration
def test_it_agrees_with_librdkafka_read_committed_on_committed_transactions(
    tansu: str, topic: str
) -> None:
    p = transactional(tansu)
    for t in range(5):
        transaction(p, topic, [f"t{t}r{i}" for i in range(7)], commit=True)
    plain = transactional(tansu)  # a second producer, interleaved with the first
    transaction(plain, topic, ["x0", "x1", "x2"], commit=True)
    mine = read_topic(tansu, topic)
    assert mine.pending == {} and mine.aborted == []
    theirs = librdkafka_read_committed(tansu, topic, expected=38)
    assert sorted(mine.values()) == sorted(theirs)
    assert len(theirs) == 38


@pytest.mark.integration
def test_a_tail_sees_an_open_transaction_then_its_commit(tansu: str, topic: str) -> None:
    p = transactional(tansu)
    tail = Tail(tansu, topic, 2)
    assert tail.poll().records == []
    transaction(p, topic, ["c0", "c1"], commit=True)
    p.begin_transaction()
    p.produce(topic, value=b"open", partition=0)
    p.flush(30)
    seen = tail.poll()
    assert sorted(seen.values()) == [b"c0", b"c1"]
    assert [r.value for held in seen.pending.values() for r in held] == [b"open"]
    p.commit_transaction(30)
    seen = tail.poll()
    assert sorted(seen.values()) == [b"c0", b"c1", b"open"] and seen.pending == {}
