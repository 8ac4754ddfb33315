"""``sink_loop._target_offsets_win``: whose offsets a run starts from when its target keeps them."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from types import SimpleNamespace

from conveyor.core.model import Offsets, TopicPartition
from conveyor.core.sink import OffsetsInTarget
from conveyor.dagster.jobs.sink_loop import _target_offsets_win

P0, P1 = TopicPartition("t", 0), TopicPartition("t", 1)
LOG = SimpleNamespace(log=logging.getLogger("test"))


class Target:
    """A target holding one writer's offsets (what an exactly-once sink reads back)."""

    def __init__(self, held: Offsets | None):
        self.held = held
        self.bound: tuple[str, int] | None = None

    def bind(self, connector: str, generation: int) -> None:
        self.bound = (connector, generation)

    def target_offsets(self) -> Offsets | None:
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
        self.held = (
            {} if replace else {tp: o for tp, o in (self.held or {}).items() if tp not in forget}
        )
        self.held.update(offsets)


def test_the_target_wins_over_the_meta_store_for_a_connector() -> None:
    target = Target({P0: 5, P1: 40})
    assert isinstance(target, OffsetsInTarget)
    start = _target_offsets_win(LOG, target, "c", 7, {P0: 9, P1: 30}, None)  # type: ignore[arg-type]
    assert start == {P0: 5, P1: 40}  # a reset moves both: the target is the truth
    assert target.bound == ("c", 7)


def test_a_task_takes_only_its_partitions_and_never_a_stale_row_of_its_own() -> None:
    # c.task0 wrote partition 0 up to 10, then partition 0 moved to c.task1, which wrote it up to
    # 20 (the meta store mirrors 20); partition 0 is back at task 0: its own row (10) is stale.
    target = Target({P0: 10, P1: 3})
    start = _target_offsets_win(LOG, target, "c.task0", 4, {P0: 20, P1: 3}, {P0})  # type: ignore[arg-type]
    assert start[P0] == 20
    # Partition 1 is not this task's: its offset stays the meta store's.
    assert start[P1] == 3
    # A target ahead of the meta store (the mirror lags the target's commit) still wins.
    ahead = _target_offsets_win(LOG, Target({P0: 25}), "c.task0", 5, {P0: 20}, {P0})  # type: ignore[arg-type]
    assert ahead[P0] == 25


def test_a_sink_that_keeps_no_offsets_changes_nothing() -> None:
    committed = {P0: 1}
    assert _target_offsets_win(LOG, object(), "c", 1, committed, None) == committed  # type: ignore[arg-type]
