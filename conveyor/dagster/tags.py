"""Run tags, job names and the run statuses that count as active: the one place the jobs that
tag their runs and the sensors that find runs by tag both read."""

from __future__ import annotations

from dagster import DagsterRunStatus

TAG_CONNECTOR = "conveyor/connector"
TAG_BROKER = "conveyor/broker"
TAG_GENERATION = "conveyor/generation"
TAG_TASK = "conveyor/task"
TAG_TASK_GENERATION = "conveyor/task_generation"
TAG_REPLAY = "conveyor/replay"
TAG_BACKFILL = "conveyor/backfill"
TAG_BACKFILL_REQUEST = "conveyor/backfill_request"  # the id of the request a backfill run serves
TAG_KIND = "conveyor/kind"
# A lakehouse table's maintenance run: not ``conveyor/connector``, which the scheduler takes for
# a connector run (it would fence or count it).
TAG_MAINTENANCE = "conveyor/maintenance"

# A run in one of these statuses holds (or will hold) its connector or task.
ACTIVE = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
]


def job_name(connector: str) -> str:
    """The Dagster job of a connector (sink or source)."""
    return f"connector__{connector}"


def replay_job_name(connector: str) -> str:
    """The Dagster job that replays a connector's dead letters."""
    return f"replay_dead_letters__{connector}"


def backfill_job_name(connector: str) -> str:
    """The Dagster job that reads a range of a connector's topics again into its sink."""
    return f"backfill__{connector}"
