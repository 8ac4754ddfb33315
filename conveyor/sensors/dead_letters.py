"""Dead-letter sensor: launches a replay once a connector with ``auto_replay`` is healthy again.

Healthy = Running (not Degraded) for ``replay_after_s``. The cursor remembers, per
connector, the dead-letter count already handed to a replay, so each new batch
of dead letters is replayed once.
"""

from __future__ import annotations

import json
import time

from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SkipReason, sensor

from conveyor.core.model import ConnectorStatus
from conveyor.resources.conveyor import ConveyorResource
from conveyor.specs import from_store_row


def replay_requests(
    rows: list, cursor: dict[str, int], now: float
) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Pure: (connector, dead_lettered) pairs to replay now, and the new cursor."""
    out = []
    new_cursor = dict(cursor)
    for row in rows:
        ls = from_store_row(row.name, row.spec_json, row.spec_source, row.spec_error)
        if not ls.ok or ls.spec is None or not ls.spec.failure.dead_letter.auto_replay:
            continue
        dead = int(row.counters.get("dead_lettered", 0))
        seen = cursor.get(f"{row.name}:{row.generation}", 0)
        healthy_for = now - row.status_since if row.status == ConnectorStatus.RUNNING else -1
        if dead > seen and healthy_for >= ls.spec.failure.dead_letter.replay_after_s:
            out.append((row.name, dead))
            new_cursor[f"{row.name}:{row.generation}"] = dead
    return out, new_cursor


@sensor(
    name="conveyor_dead_letter_replay",
    description="Replays dead letters automatically for connectors with failure.dead_letter.auto_replay.",
    default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=30,
)
def conveyor_dead_letter_replay(context: SensorEvaluationContext, conveyor: ConveyorResource):  # type: ignore[no-untyped-def]
    cursor = json.loads(context.cursor) if context.cursor else {}
    todo, cursor = replay_requests(conveyor.store().list(), cursor, time.time())
    context.update_cursor(json.dumps(cursor))
    if not todo:
        return SkipReason("no connector with new dead letters is due for a replay")
    return [
        RunRequest(
            run_key=f"replay:{name}:{dead}",
            job_name=f"replay_dead_letters__{name}",
            tags={"conveyor/connector": name},
        )
        for name, dead in todo
    ]
