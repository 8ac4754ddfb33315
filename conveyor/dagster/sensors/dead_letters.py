"""Dead-letter sensor: launches a replay once a connector with ``auto_replay`` is healthy again.

Healthy = Running (not Degraded) for ``replay_after_s``. The cursor remembers, per
connector, the dead-letter count already handed to a replay, so each new batch
of dead letters is replayed once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from dagster import (
    DefaultSensorStatus,
    JobDefinition,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from conveyor.core.model import ConnectorStatus, FailureSpec
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_CONNECTOR, replay_job_name


def replay_requests(
    rows: list, cursor: dict[str, int], now: float
) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Pure: (connector, dead_lettered) pairs to replay now, and the new cursor."""
    out = []
    new_cursor = dict(cursor)
    for row in rows:
        if row.spec_error or not row.spec:
            continue
        try:
            failure = FailureSpec.model_validate((row.spec or {}).get("failure") or {})
        except ValueError:
            continue
        if not failure.dead_letter.auto_replay:
            continue
        dead = int(row.counters.get("dead_lettered", 0))
        seen = cursor.get(f"{row.name}:{row.generation}", 0)
        healthy_for = now - row.status_since if row.status == ConnectorStatus.RUNNING else -1
        if dead > seen and healthy_for >= failure.dead_letter.replay_after_s:
            out.append((row.name, dead))
            new_cursor[f"{row.name}:{row.generation}"] = dead
    return out, new_cursor


def dead_letter_replay_sensor(jobs: Sequence[JobDefinition] | None) -> SensorDefinition:
    """The ``conveyor_dead_letter_replay`` sensor, targeting the replay jobs of this location.

    Dagster refuses a RunRequest from a sensor without declared targets, so the replay
    jobs are its targets; a connector whose replay job is not in the location yet (spec
    added, location not reloaded) waits for the reload. ``None`` (tests): no target check.
    """
    launchable = None if jobs is None else {j.name for j in jobs}

    @sensor(
        name="conveyor_dead_letter_replay",
        description="Replays dead letters automatically for connectors with failure.dead_letter.auto_replay.",
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=30,
        jobs=list(jobs) if jobs else None,
    )
    def conveyor_dead_letter_replay(  # type: ignore[no-untyped-def]
        context: SensorEvaluationContext, conveyor: ConveyorResource
    ):
        rows = [
            r
            for r in conveyor.store().list()
            if launchable is None or replay_job_name(r.name) in launchable
        ]
        cursor = json.loads(context.cursor) if context.cursor else {}
        todo, cursor = replay_requests(rows, cursor, time.time())
        context.update_cursor(json.dumps(cursor))
        if not todo:
            return SkipReason("no connector with new dead letters is due for a replay")
        return [
            RunRequest(
                run_key=f"replay:{name}:{dead}",
                job_name=replay_job_name(name),
                tags={TAG_CONNECTOR: name},
            )
            for name, dead in todo
        ]

    return conveyor_dead_letter_replay
