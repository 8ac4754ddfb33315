"""Test helpers for stored positions (``core/positions.py``)."""

from __future__ import annotations

from collections.abc import Mapping

from conveyor.core.model import Offsets, TopicPartition
from conveyor.core.positions import StoredPosition


def offsets_of(positions: Mapping[TopicPartition, StoredPosition] | None) -> Offsets | None:
    """The offsets of positions as a target returns them (None stays None)."""
    if positions is None:
        return None
    return {tp: p.offset for tp, p in positions.items()}
