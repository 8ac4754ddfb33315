"""Dagster's run queue sized to the fleet: the QueuedRunCoordinator's limits from the brokers'
declared capacity plus room for one-off jobs, and why a queued connector run waits.

Connector runs (and partition-task runs) carry ``conveyor/broker``; the scheduler never
places more of them on a broker than its capacity, and the queue holds them to the same
figure (one tag limit per broker). ``max_concurrent_runs`` is the fleet's capacity plus
``OneOffRoom.total``: connectors can never take the slots kept for backfills, dead-letter
replays, table maintenance and everything else (a user's asset jobs, the lag checks), and
each one-off kind has a tag limit of its own, so a burst of backfills cannot take the room
of the others. Untagged runs (a user's jobs) are bounded only by the total: while they hold
slots the connectors do not use, a connector's run may wait for one, which the scheduler
then reports (:func:`queue_blocker`, ``core.planning.scheduler``'s ``Waiting``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dagster import DagsterRunStatus

from conveyor.dagster.tags import TAG_BACKFILL, TAG_BROKER, TAG_MAINTENANCE, TAG_REPLAY

# The runs the queue counts against its limits (Dagster's daemon counts these).
IN_PROGRESS = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]


@dataclass(frozen=True)
class OneOffRoom:
    """Run slots kept beside the connectors' for jobs that come and go."""

    backfill: int = 2
    """``backfill__<connector>`` runs at once (tag ``conveyor/backfill``)."""
    replay: int = 2
    """``replay_dead_letters__<connector>`` runs at once (tag ``conveyor/replay``)."""
    maintenance: int = 1
    """``maintain_table__<connector>`` runs at once (tag ``conveyor/maintenance``)."""
    other: int = 3
    """Untagged runs: a user's asset jobs, the lag checks, the demo's downstream asset."""

    @property
    def total(self) -> int:
        return self.backfill + self.replay + self.maintenance + self.other

    def tag_limits(self) -> list[dict[str, Any]]:
        """One limit per one-off kind, over every value of its tag (any connector)."""
        return [
            {"key": TAG_BACKFILL, "limit": self.backfill},
            {"key": TAG_REPLAY, "limit": self.replay},
            {"key": TAG_MAINTENANCE, "limit": self.maintenance},
        ]


def run_queue_config(
    brokers: Sequence[tuple[str, int]], room: OneOffRoom | None = None
) -> dict[str, Any]:
    """The QueuedRunCoordinator's ``max_concurrent_runs`` and ``tag_concurrency_limits`` for
    ``brokers`` (id, capacity): each broker's runs limited to its capacity, the total to the
    fleet's capacity plus ``room``'s one-off slots, each one-off kind to its own share."""
    room = room or OneOffRoom()
    if any(cap < 0 for _, cap in brokers):
        raise ValueError(f"a broker's capacity cannot be negative: {list(brokers)}")
    limits = [{"key": TAG_BROKER, "value": bid, "limit": cap} for bid, cap in brokers]
    return {
        "max_concurrent_runs": sum(cap for _, cap in brokers) + room.total,
        "tag_concurrency_limits": limits + room.tag_limits(),
    }


def _matches(limit: Mapping[str, Any], tags: Mapping[str, str]) -> bool:
    """Whether a run with ``tags`` counts against ``limit`` (Dagster's rule: a limit with a
    string value counts that value; one without, every value of its key)."""
    key, value = limit["key"], limit.get("value")
    if key not in tags:
        return False
    return not isinstance(value, str) or tags[key] == value


def queue_blocker(
    max_concurrent_runs: int,
    tag_limits: Sequence[Mapping[str, Any]],
    queued_tags: Mapping[str, str],
    in_progress: Iterable[Mapping[str, str]],
) -> str | None:
    """Which limit of the run queue holds a queued run with ``queued_tags``, given the tags of
    the runs in progress; None when none does (the daemon has not dequeued it yet, or it is
    down). A per-unique-value limit (``applyLimitPerUniqueValue``) counts the run's own value."""
    running = list(in_progress)
    if 0 <= max_concurrent_runs <= len(running):
        return f"run queue full: {len(running)} of max_concurrent_runs {max_concurrent_runs} in progress"
    for limit in tag_limits:
        value = limit.get("value")
        per_value = isinstance(value, Mapping) and value.get("applyLimitPerUniqueValue")
        if not _matches(limit, queued_tags):
            continue
        key = limit["key"]
        if per_value:
            n = sum(1 for t in running if t.get(key) == queued_tags[key])
            what = f"{key}={queued_tags[key]}"
        else:
            n = sum(1 for t in running if _matches(limit, t))
            what = f"{key}={value}" if isinstance(value, str) else key
        if n >= limit["limit"]:
            return f"tag limit {what}: {n} of {limit['limit']} in progress"
    return None


def instance_queue_limits(instance: Any) -> tuple[int, list[Mapping[str, Any]]] | None:
    """The instance's run queue limits (max runs, tag limits); None without a run queue."""
    get = getattr(instance.run_coordinator, "get_run_queue_config", None)
    if get is None:
        return None
    cfg = get()
    return cfg.max_concurrent_runs, list(cfg.tag_concurrency_limits or [])
