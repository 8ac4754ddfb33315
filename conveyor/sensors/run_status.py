"""Run-status sensor: a connector run that failed puts its connector in Error.

The op records its own errors; this catches what the op could not record (the
process died, the run failed before the op started). Only the connector's
current run counts: a refused duplicate launch never marks the connector.
"""

from __future__ import annotations

from dagster import DefaultSensorStatus, RunFailureSensorContext, run_failure_sensor

from conveyor.core.model import ConnectorStatus
from conveyor.core.state import StateChange
from conveyor.jobs.runs import TAG_CONNECTOR
from conveyor.resources.conveyor import ConveyorResource
from conveyor.store.meta import UnknownConnectorError


@run_failure_sensor(
    name="conveyor_run_failures",
    description="Marks a connector Error when its current run fails.",
    default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=5,
    monitor_all_code_locations=False,
)
def conveyor_run_failures(context: RunFailureSensorContext, conveyor: ConveyorResource) -> None:
    run = context.dagster_run
    name = run.tags.get(TAG_CONNECTOR)
    if not name:
        return
    store = conveyor.store()
    try:
        row = store.get(name)
    except UnknownConnectorError:
        return
    if row.run_id != run.run_id or row.status in (ConnectorStatus.ERROR, ConnectorStatus.STOPPED):
        return
    message = context.failure_event.message or "run failed"
    store.apply(name, row.generation, StateChange.mark_error(message), f"run {run.run_id} failed")
    context.log.info(f"connector {name}: run {run.run_id} failed -> Error: {message}")
