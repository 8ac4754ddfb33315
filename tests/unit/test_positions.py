"""``core/positions.py``: what a stored position belongs to, and the rule that decides its use."""

from __future__ import annotations

import pytest

from conveyor.core.model import TopicPartition
from conveyor.core.positions import (
    LogFacts,
    OutOfRange,
    PositionLostError,
    PositionScope,
    StoredPosition,
    TargetBinding,
    given_up_counts,
    judge_positions,
    log_id_of,
    split_writer_id,
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
