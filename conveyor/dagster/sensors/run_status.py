"""Run-status sensor: a connector run that failed under a live connector, recorded.

The op records its own errors and releases its connector as Error before its run
ends. A run that failed while its connector still says Running, Degraded or Paused
had its process die under it (``kill -9``, the OOM killer): what Dagster says of it
(the exit code) goes to the connector's history here. The decision is the
scheduler's alone (``core.planning.scheduler``: relaunched at once, or Error when the
restarts keep failing); marking the connector Error here would send a crash down
the restart backoff meant for failing connectors. Only the connector's current run
counts: a refused duplicate launch is not recorded.
"""

from __future__ import annotations

from dagster import DefaultSensorStatus, RunFailureSensorContext, run_failure_sensor

from conveyor.core.planning.scheduler import LIVE
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_CONNECTOR
from conveyor.store.meta import UnknownConnectorError


@run_failure_sensor(
    name="conveyor_run_failures",
    description="Records in a connector's history why its current run failed when the "
    "connector did not say so itself (its process died); the scheduler relaunches it.",
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
    if row.run_id != run.run_id or row.status not in LIVE:
        return  # not its current run, or the run released the connector itself
    message = context.failure_event.message or "run failed"
    store.record(name, f"run {run.run_id} failed: {message}", run_id=run.run_id)
    context.log.info(f"connector {name}: run {run.run_id} failed ({message}); its process died")
