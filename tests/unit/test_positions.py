"""``core/positions.py``: what a stored position belongs to, and the rule that decides its use."""

from __future__ import annotations

import pytest

from conveyor.core.model import SourceSpec, TopicPartition
from conveyor.core.positions import (
    LogFacts,
    OutOfRange,
    PositionError,
    PositionLostError,
    PositionScope,
    StoredPosition,
    TargetBinding,
    checked_position,
    given_up_counts,
    judge_positions,
    log_id_of,
    parse_positions,
    split_writer_id,
    topics_read,
    usable_offsets,
    writer_id,
)
from conveyor.core.sink import is_writer_of, task_writer

TP = TopicPartition("orders", 0)


def test_writer_ids_name_the_incarnation_and_old_names_have_none() -> None:
    assert writer_id("orders", "ab12") == "orders@ab12"
    assert split_writer_id("orders@ab12") == ("orders", "ab12")
    assert split_writer_id("orders") == ("orders", None)
    assert split_writer_id("a@b@c") == ("a@b", "c")


def test_a_writer_of_another_incarnation_is_not_the_connectors() -> None:
    me = writer_id("orders", "new")
    assert is_writer_of(me, writer_id(task_writer("orders", 3), "new"))
    assert not is_writer_of(me, writer_id(task_writer("orders", 3), "old"))
    assert not is_writer_of(me, writer_id("orders", "old"))
    assert not is_writer_of(me, "orders")  # the release before incarnations
    assert not is_writer_of(me, writer_id("orders.backfill-r1", "new"))
    assert is_writer_of("orders", "orders.task1")  # bare names among themselves


def test_log_ids_need_a_topic_id() -> None:
    assert log_id_of("c1", "2ddeb466-5ae6-4e0f-a9ef-a2478cee3dbd") == (
        "c1/2ddeb466-5ae6-4e0f-a9ef-a2478cee3dbd"
    )
    assert log_id_of("c1", None) is None
    assert log_id_of("c1", "00000000-0000-0000-0000-000000000000") is None
    assert log_id_of("c1", "AAAAAAAAAAAAAAAAAAAAAA") is None
    assert log_id_of(None, "x1") == "-/x1"


@pytest.mark.parametrize(
    ("stored", "facts", "want", "kind", "given_up"),
    [
        (StoredPosition(5, "L"), LogFacts("L", 0, 10), 5, None, 0),
        (StoredPosition(10, "L"), LogFacts("L", 0, 10), 10, None, 0),  # at the end: caught up
        (StoredPosition(0, "L"), LogFacts("L", 0, 0), 0, None, 0),  # an empty log
        (StoredPosition(5, "OLD"), LogFacts("L", 0, 10), None, "other_log", 0),
        (StoredPosition(5, None), LogFacts("L", 0, 10), 5, None, 0),  # no log named: kept
        (StoredPosition(5, "L"), LogFacts(None, 0, 10), 5, None, 0),  # no id reported: kept
        (StoredPosition(2, "L"), LogFacts("L", 7, 10), 7, "below_start", 5),
        (StoredPosition(20, "L"), LogFacts("L", 0, 10), 0, "above_end", 0),
    ],
)
def test_judge_earliest(stored, facts, want, kind, given_up) -> None:
    start, notes = judge_positions({TP: stored}, {TP: facts}, None)
    assert start.get(TP) == want
    assert [n.kind for n in notes] == ([kind] if kind else [])
    assert sum(n.given_up for n in notes) == given_up


def test_judge_latest_and_fail() -> None:
    start, notes = judge_positions(
        {TP: StoredPosition(2, "L")}, {TP: LogFacts("L", 7, 10)}, None, OutOfRange.LATEST
    )
    assert start == {TP: 10} and notes[0].given_up == 8
    start, notes = judge_positions(
        {TP: StoredPosition(20, "L")}, {TP: LogFacts("L", 3, 10)}, None, "latest"
    )
    assert start == {TP: 10} and notes[0].given_up == 7  # the new log's records skipped
    with pytest.raises(PositionLostError, match=r"orders\[0\].*below the log start 7"):
        judge_positions({TP: StoredPosition(2, "L")}, {TP: LogFacts("L", 7, 10)}, None, "fail")


def test_another_destination_sets_a_position_aside() -> None:
    stored = {TP: StoredPosition(5, "L", "postgres/public/a")}
    start, notes = judge_positions(stored, {TP: LogFacts("L", 0, 10)}, "postgres/public/b")
    assert start == {} and notes[0].kind == "other_destination"
    assert "postgres/public/a" in notes[0].message
    # A partition the broker does not describe (not found now) keeps its position.
    assert judge_positions(stored, {}, "postgres/public/b")[0] == {TP: 5}


def test_usable_offsets_and_bindings() -> None:
    stored = {
        TP: StoredPosition(5, "L", "d"),
        TopicPartition("orders", 1): StoredPosition(6, "OLD", "d"),
        TopicPartition("other", 0): StoredPosition(7, None, None),
    }
    assert usable_offsets(stored, {"orders": "L", "other": "X"}, "d") == {
        TP: 5,
        TopicPartition("other", 0): 7,
    }
    b = TargetBinding("w@i", 1, PositionScope("d", {"orders": "L"}))
    assert b.usable(stored) == {TP: 5, TopicPartition("other", 0): 7}
    assert b.scope.position(TP, 9) == StoredPosition(9, "L", "d")


def test_given_up_counts_add_up_per_partition() -> None:
    _, notes = judge_positions({TP: StoredPosition(2, "L")}, {TP: LogFacts("L", 7, 10)}, None)
    assert given_up_counts(notes, {"orders[0]": 3, "x[1]": 1}) == {"orders[0]": 8, "x[1]": 1}


# -- positions given from outside: one validator for the API, the CLI and backfills -------------


def reads(topics: list[str] | None = None, regex: str | None = None) -> SourceSpec:
    return SourceSpec(topics=topics or [], topics_regex=regex)


@pytest.mark.parametrize(
    ("topic", "partition", "offset", "part", "message"),
    [
        ("orders", -1, 3, "partition", "-1 is out of range: a partition number (int32) is from 0"),
        ("orders", 2**31, 3, "partition", "2147483648 is out of range"),
        ("orders", "x", 3, "partition", "'x' is not a partition number (int32)"),
        ("orders", True, 3, "partition", "True is not a partition number"),
        ("orders", 1.0, 3, "partition", "1.0 is not a partition number"),
        ("orders", 0, -5, "offset", "-5 is out of range: an offset (int64) is from 0"),
        ("orders", 0, 2**70, "offset", "1180591620717411303424 is out of range"),
        ("orders", 0, 2**63, "offset", "9223372036854775808 is out of range"),
        ("orders", 0, 10**400, "offset", "a 1329-bit number is out of range"),
        ("orders", 0, "9" * 5000, "offset", "9999999999999999999999999999999999999999... is out"),
        ("orders", 0, "-5", "offset", "-5 is out of range"),
        ("orders", 0, " 5", "offset", "' 5' is not an offset"),
        ("orders", 0, "٥", "offset", "'٥' is not an offset"),  # int() reads it; Kafka does not
        ("orders", 0, [], "offset", "[] is not an offset"),
        ("", 0, 1, "topic", "expected a topic name"),
        (None, 0, 1, "topic", "expected a topic name"),
        (
            "clicks",
            0,
            1,
            "topic",
            "the connector does not read topic 'clicks' (it reads orders, /ord.*/)",
        ),
        ("__ordx", 0, 1, "topic", "the connector does not read topic '__ordx'"),
    ],
)
def test_a_position_breaking_a_rule_names_its_part_and_the_rule(
    topic, partition, offset, part, message
):
    with pytest.raises(PositionError) as e:
        checked_position(topic, partition, offset, reads(["orders"], "ord.*"))
    assert e.value.part == part
    assert str(e.value).startswith(message), str(e.value)


def test_positions_within_kafkas_bounds_of_topics_the_connector_reads_are_taken() -> None:
    r = reads(["orders"], "ord.*")
    assert checked_position("orders", 0, 0, r) == (TP, 0)
    top = (TopicPartition("orders", 2**31 - 1), 2**63 - 1)
    assert checked_position("orders", 2**31 - 1, 2**63 - 1, r) == top
    assert checked_position("ordx", "7", "12", r) == (TopicPartition("ordx", 7), 12)  # regex
    assert checked_position("orders", 3, None, r) == (TopicPartition("orders", 3), None)
    assert checked_position("anything", 0, 1, None) == (TopicPartition("anything", 0), 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("orders:0:-5", "'orders:0:-5': offset: -5 is out of range"),
        ("orders:-1:3", "'orders:-1:3': partition: -1 is out of range"),
        ("clicks:0:5", "'clicks:0:5': topic: the connector does not read topic 'clicks'"),
        (f"orders:0:{2**70}", f"'orders:0:{2**70}': offset: {2**70} is out of range"),
        ("orders:0", "'orders:0' is not TOPIC:PARTITION:OFFSET"),
        ("orders:0:5,", "'' is not TOPIC:PARTITION:OFFSET"),
        ("orders:0:5, orders:0:7", "'orders:0:7': partition orders[0] is given twice"),
        (":0:5", "':0:5': topic: expected a topic name"),
        ("orders:x:5", "'orders:x:5': partition: 'x' is not a partition number"),
    ],
)
def test_a_list_of_positions_is_refused_naming_the_item_and_the_rule(text, message):
    with pytest.raises(PositionError) as e:
        parse_positions(text, reads(["orders"]))
    assert str(e.value).startswith(message), str(e.value)


def test_a_list_of_positions_is_read_into_offsets() -> None:
    assert parse_positions(" orders:0:5, orders:1:7 ,ordx:2:0", reads(["orders"], "ord.")) == {
        TopicPartition("orders", 0): 5,
        TopicPartition("orders", 1): 7,
        TopicPartition("ordx", 2): 0,
    }


def test_the_topics_a_stored_spec_reads() -> None:
    r = topics_read({"source": {"topics": ["orders"], "topics_regex": "cl.*"}, "sink": {}})
    assert r is not None and r.matches("orders") and r.matches("clicks") and not r.matches("x")
    assert topics_read({"source": {"topics_regex": "a.*"}}).matches("ab")  # type: ignore[union-attr]
    assert topics_read(None) is None
    assert topics_read({"kind": "source", "source": {"type": "postgres"}}) is None
    assert topics_read({"source": {"topics": ["bad name"]}}) is None  # not a spec Conveyor wrote
