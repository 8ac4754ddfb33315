"""The Dagster code location: assembled from the connector specs (no logic here)."""

from __future__ import annotations

from dagster import Definitions

from conveyor.assets.lineage import lineage_specs
from conveyor.jobs.connector import connector_job
from conveyor.resources.conveyor import ConveyorResource, load_catalog
from conveyor.sensors.run_status import conveyor_run_failures


def build_defs() -> Definitions:
    catalog = load_catalog()
    return Definitions(
        assets=lineage_specs(catalog.specs),
        jobs=[connector_job(ls) for ls in catalog.specs],
        sensors=[conveyor_run_failures],
        resources={"conveyor": ConveyorResource()},
    )


defs = build_defs()
