"""``sink_loop._start_positions``: where a run starts, from the meta store's positions and those a
target keeps, judged against the logs as the broker describes them (``core/positions.py``)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from types import SimpleNamespace

import pytest

from conveyor.core.model import Offsets, TopicPartition
from conveyor.core.positions import (
    LogFacts,
    PositionLostError,
    PositionScope,
    StoredPosition,
    StoredPositions,
    TargetBinding,
)
from conveyor.core.sink import OffsetsInTarget
from conveyor.dagster.jobs.sink_loop import _start_positions

P0, P1 = TopicPartition("t", 0), TopicPartition("t", 1)
LOG = SimpleNamespace(log=logging.getLogger("test"))
DEST = "postgres/public/orders"
LOG_A, LOG_B = "cluster/topic-a", "cluster/topic-b"


class Target:
    """A target holding one writer's positions (what an exactly-once sink reads back)."""

    def __init__(self, held: StoredPositions | None):
        self.held = held
        self.bound: TargetBinding | None = None

    def bind(self, binding: TargetBinding) -> None:
        self.bound = binding

    def target_offsets(self) -> StoredPositions | None:
        return self.held

    def move_target_offsets(
        self,
        connector: str,
        generations: Mapping[str, int],
        offsets: Offsets,
        *,
        forget: Collection[TopicPartition] = (),
        replace: bool = False,
    ) -> None:
        raise AssertionError("not called")

    def retire_target_offsets(self, connector: str) -> str | None:
        return None


class Source:
    def __init__(self, facts: dict[TopicPartition, LogFacts]):
        self.facts = facts

    def describe_logs(self, stored: Offsets | None = None) -> dict[TopicPartition, LogFacts]:
        return self.facts


class Store:
    def __init__(self, stored: StoredPositions):
        self.stored = stored

    def stored_positions(self, name: str) -> StoredPositions:
        return dict(self.stored)


def spec(out_of_range: str = "earliest") -> SimpleNamespace:
    return SimpleNamespace(
        name="c", spec=SimpleNamespace(source=SimpleNamespace(out_of_range=out_of_range))
    )


def binding(writer: str = "c@inc1") -> TargetBinding:
    return TargetBinding(writer, 7, PositionScope(DEST, {"t": LOG_A}))


def facts(lo: int = 0, hi: int = 100, log_id: str = LOG_A) -> dict[TopicPartition, LogFacts]:
    return {P0: LogFacts(log_id, lo, hi), P1: LogFacts(log_id, lo, hi)}


def start(target, stored, fx, partitions=None, out_of_range="earliest"):
    return _start_positions(
        LOG, Store(stored), Source(fx), target, spec(out_of_range), binding(), partitions
    )  # type: ignore[arg-type]


def pos(o: int, log_id: str | None = LOG_A, dest: str | None = DEST) -> StoredPosition:
    return StoredPosition(o, log_id, dest)


def test_the_target_wins_over_the_meta_store_for_a_connector() -> None:
    target = Target({P0: pos(5), P1: pos(40)})
    assert isinstance(target, OffsetsInTarget)
    offsets, notes = start(target, {P0: pos(9), P1: pos(30)}, facts())
    assert offsets == {P0: 5, P1: 40}  # a reset moves both: the target is the truth
    assert notes == []
    assert target.bound == binding()


def test_a_task_takes_only_its_partitions_and_never_a_stale_row_of_its_own() -> None:
    # c.task0 wrote partition 0 up to 10, then partition 0 moved to c.task1, which wrote it up to
    # 20 (the meta store mirrors 20); partition 0 is back at task 0: its own row (10) is stale.
    offsets, _ = start(Target({P0: pos(10), P1: pos(3)}), {P0: pos(20)}, facts(), {P0})
    assert offsets == {P0: 20}
    # A target ahead of the meta store (the mirror lags the target's commit) still wins.
    ahead, _ = start(Target({P0: pos(25)}), {P0: pos(20)}, facts(), {P0})
    assert ahead[P0] == 25


def test_a_sink_that_keeps_no_offsets_starts_from_the_meta_store() -> None:
    offsets, notes = start(object(), {P0: pos(1)}, facts())
    assert offsets == {P0: 1} and notes == []


def test_positions_of_a_topic_created_again_are_set_aside_in_the_target_and_the_meta_store() -> (
    None
):
    # The topic was deleted and created again: its log id is now B. Both stores name A.
    target = Target({P0: pos(27_700), P1: pos(400)})
    offsets, notes = start(target, {P0: pos(433), P1: pos(400)}, facts(0, 1300, LOG_B))
    assert offsets == {}  # both partitions start per start_from
    assert {n.kind for n in notes} == {"other_log"}
    assert "27700" in notes[0].message and LOG_B in notes[0].message


def test_a_position_below_the_log_start_resumes_at_it_and_counts_what_was_given_up() -> None:
    offsets, notes = start(object(), {P0: pos(1_000), P1: pos(2_000)}, facts(1_999, 3_000))
    assert offsets == {P0: 1_999, P1: 2_000}
    (note,) = notes
    assert (note.tp, note.kind, note.given_up, note.resumed_at) == (P0, "below_start", 999, 1_999)
    with pytest.raises(PositionLostError, match="out_of_range is fail"):
        start(object(), {P0: pos(1_000)}, facts(1_999, 3_000), out_of_range="fail")


def test_positions_of_the_release_before_name_no_log_and_are_range_checked() -> None:
    offsets, notes = start(object(), {P0: pos(50, None, None)}, facts(0, 100))
    assert offsets == {P0: 50} and notes == []
    offsets, notes = start(object(), {P0: pos(500, None, None)}, facts(0, 100))
    assert offsets == {P0: 0} and notes[0].kind == "above_end"


def test_a_target_position_outside_the_log_is_void_for_the_sink() -> None:
    """The target holds 500 on a log that now ends at 100 (reset): the run starts at 0, and the
    sink must not take 500 as covering the new log's records."""
    target = Target({P0: pos(500)})
    b = binding()
    offsets, notes = _start_positions(
        LOG, Store({}), Source(facts(0, 100)), target, spec(), b, None
    )  # type: ignore[arg-type]
    assert offsets == {P0: 0} and notes[0].kind == "above_end"
    assert target.bound is b and b.void == {P0: 500}
    assert b.usable({P0: pos(500)}) == {}
