"""The Dagster code location: assembled from the connector specs (no logic here)."""

from __future__ import annotations

from dagster import Definitions

from conveyor.assets.checks import lag_check_schedules, lag_checks
from conveyor.assets.lineage import lineage_specs
from conveyor.jobs.connector import connector_job
from conveyor.jobs.replay import replay_job
from conveyor.resources.conveyor import ConveyorResource, load_catalog
from conveyor.sensors.dead_letters import dead_letter_replay_sensor
from conveyor.sensors.run_status import conveyor_run_failures
from conveyor.sensors.scheduler import scheduler_sensor


def build_defs() -> Definitions:
    catalog = load_catalog()
    valid = [ls for ls in catalog.specs if ls.ok]
    connector_jobs = [connector_job(ls) for ls in catalog.specs]
    replay_jobs = [replay_job(ls) for ls in valid]
    return Definitions(
        assets=lineage_specs(catalog.specs),
        jobs=connector_jobs + replay_jobs,
        sensors=[
            scheduler_sensor(connector_jobs),
            conveyor_run_failures,
            dead_letter_replay_sensor(replay_jobs),
        ],
        resources={"conveyor": ConveyorResource()},
        asset_checks=lag_checks(catalog.specs),
        schedules=lag_check_schedules(catalog.specs),
    )


defs = build_defs()
