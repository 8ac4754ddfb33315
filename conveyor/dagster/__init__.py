"""The Dagster layer: definitions, components, jobs, sensors, assets, resources, and the run tags they share."""
