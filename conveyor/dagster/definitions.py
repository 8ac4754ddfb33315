"""The Dagster code location: assembled from the connector spec files (no logic here).

Loading it reads the spec files and the environment only: it never touches the meta
store (the scheduler sensor syncs the specs into it on each tick, and a run syncs its
own spec when it starts).
"""

from __future__ import annotations

from collections.abc import Sequence

from dagster import Definitions

from conveyor.config.specs import LoadedSpec, connectors_dir
from conveyor.dagster.assets.checks import lag_check_schedules, lag_checks, run_checks
from conveyor.dagster.assets.lineage import lineage_specs
from conveyor.dagster.jobs.backfill import backfill_job
from conveyor.dagster.jobs.connector import connector_job
from conveyor.dagster.jobs.maintenance import is_lakehouse, maintenance_job
from conveyor.dagster.jobs.replay import replay_job
from conveyor.dagster.jobs.source_connector import source_connector_job
from conveyor.dagster.resources.conveyor import conveyor_resource
from conveyor.dagster.sensors.backfills import backfill_requests_sensor
from conveyor.dagster.sensors.dead_letters import dead_letter_replay_sensor
from conveyor.dagster.sensors.run_status import conveyor_run_failures
from conveyor.dagster.sensors.scheduler import SpecSources, scheduler_sensor


def conveyor_defs(specs: Sequence[LoadedSpec], sources: SpecSources) -> Definitions:
    """Everything Conveyor puts in a code location for these connectors."""
    specs = list(specs)
    valid = [ls for ls in specs if ls.ok and not ls.is_source]
    connector_jobs = [
        source_connector_job(ls) if ls.is_source else connector_job(ls) for ls in specs
    ]
    replay_jobs = [replay_job(ls) for ls in valid]
    maintenance_jobs = [maintenance_job(ls) for ls in valid if is_lakehouse(ls)]
    backfill_jobs = [backfill_job(ls) for ls in valid]
    return Definitions(
        assets=lineage_specs(specs),
        jobs=connector_jobs + replay_jobs + maintenance_jobs + backfill_jobs,
        sensors=[
            scheduler_sensor(connector_jobs, specs, sources),
            conveyor_run_failures,
            dead_letter_replay_sensor(replay_jobs),
            backfill_requests_sensor(backfill_jobs),
        ],
        resources={"conveyor": conveyor_resource()},
        asset_checks=lag_checks(specs) + run_checks(specs),
        schedules=lag_check_schedules(specs),
    )


def build_defs() -> Definitions:
    sources = SpecSources(connectors_dir())
    return conveyor_defs(sources.scan(), sources)


defs = build_defs()
