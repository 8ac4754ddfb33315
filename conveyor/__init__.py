"""Conveyor: message connectors on Dagster, data path on Spark Connect."""

__version__ = "0.1.0"
