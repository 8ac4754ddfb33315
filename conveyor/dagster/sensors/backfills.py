"""Backfills sensor: launches ``backfill__<connector>`` for each backfill request of the CLI or
the API (``conveyor backfill``, ``POST /connectors/{name}/backfills``), and fails the requests
whose run failed.

The CLI and the API only write the request to the meta store; this sensor launches its run
(run key and tag from the request, its range and id as run config) and marks it launched. The
run reports running, its counts and its end to the request itself; a run that failed, was
canceled or died before it could say so is marked failed here. A request for a connector
whose backfill job is not in the code location (a spec added since the last reload) waits for
the reload, and fails after ``LAUNCH_TIMEOUT_S``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dagster import (
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    JobDefinition,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_BACKFILL, TAG_BACKFILL_REQUEST, backfill_job_name
from conveyor.store.meta import (
    BACKFILL_FAILED,
    BACKFILL_LAUNCHED,
    BACKFILL_OPEN,
    BACKFILL_REQUESTED,
    BACKFILL_SUCCEEDED,
    BackfillRequest,
)

LAUNCH_TIMEOUT_S = 600.0  # a request with no run after this long (no job, no launch) fails
_ENDED = {"FAILURE": "failed", "CANCELED": "was canceled"}


@dataclass(frozen=True)
class RunSeen:
    """The run Dagster has for a request: its id and status name."""

    run_id: str
    status: str


@dataclass(frozen=True)
class Mark:
    """A request's state to write (``update_backfill``)."""

    request_id: int
    state: str
    message: str | None = None
    run_id: str | None = None


def request_key(r: BackfillRequest) -> str:
    """The run key and tag of a request's run: its id and when it was asked for (a meta store
    made anew counts ids from 1 again, and Dagster never launches a run key twice)."""
    return f"{r.id}.{int(r.requested_at * 1000)}"


def backfill_decisions(
    requests: Iterable[BackfillRequest],
    runs: dict[int, RunSeen],
    launchable: set[str] | None,
    now: float,
) -> tuple[list[BackfillRequest], list[Mark]]:
    """Pure: the open requests to launch now, and the marks to write.

    ``runs``: the run Dagster has for a request, by request id; ``launchable``: the backfill
    jobs of the code location (None: every one)."""
    launch: list[BackfillRequest] = []
    marks: list[Mark] = []
    for r in requests:
        run = runs.get(r.id)
        if run is None:
            if r.state == BACKFILL_REQUESTED and (
                launchable is None or backfill_job_name(r.connector) in launchable
            ):
                launch.append(r)
                marks.append(Mark(r.id, BACKFILL_LAUNCHED))
            elif now - r.updated_at > LAUNCH_TIMEOUT_S:
                why = (
                    "no run was launched"
                    if r.state != BACKFILL_REQUESTED
                    else f"the code location has no job {backfill_job_name(r.connector)} "
                    "(a source connector, an invalid spec, or not reloaded)"
                )
                marks.append(Mark(r.id, BACKFILL_FAILED, f"{why} in {LAUNCH_TIMEOUT_S:.0f} s"))
            continue
        if r.state == BACKFILL_REQUESTED:
            marks.append(Mark(r.id, BACKFILL_LAUNCHED, run_id=run.run_id))
        if run.status in _ENDED:
            what = _ENDED[run.status]
            marks.append(Mark(r.id, BACKFILL_FAILED, f"run {run.run_id} {what}", run.run_id))
        elif run.status == "SUCCESS":
            marks.append(
                Mark(r.id, BACKFILL_SUCCEEDED, "its run succeeded without reporting", run.run_id)
            )
    return launch, marks


def runs_of(instance: DagsterInstance, requests: Iterable[BackfillRequest]) -> dict[int, RunSeen]:
    """The run Dagster has for each request (found by its tag), newest first."""
    out: dict[int, RunSeen] = {}
    for r in requests:
        found = instance.get_runs(
            filters=RunsFilter(tags={TAG_BACKFILL_REQUEST: request_key(r)}), limit=1
        )
        if found:
            status = found[0].status
            out[r.id] = RunSeen(
                found[0].run_id, status.value if isinstance(status, DagsterRunStatus) else status
            )
    return out


def run_request(r: BackfillRequest) -> RunRequest:
    """The run of request ``r``: its job, range and id as run config, tags linking it."""
    return RunRequest(
        run_key=f"backfill:{request_key(r)}",
        job_name=backfill_job_name(r.connector),
        run_config={
            "ops": {
                f"backfill_range__{r.connector}": {
                    "config": {"start": r.start, "end": r.end, "request_id": r.id}
                }
            }
        },
        tags={
            TAG_BACKFILL: r.connector,
            TAG_BACKFILL_REQUEST: request_key(r),
            "conveyor/requested_by": r.requested_by[:200],
        },
    )


def backfill_requests_sensor(jobs: Sequence[JobDefinition] | None) -> SensorDefinition:
    """The ``conveyor_backfill_requests`` sensor, targeting the backfill jobs of this location
    (``None``, in tests: no target check)."""
    launchable = None if jobs is None else {j.name for j in jobs}

    @sensor(
        name="conveyor_backfill_requests",
        description="Launches the backfills requested from the CLI or the REST API and "
        "follows their runs (conveyor backfill, POST /connectors/{name}/backfills).",
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=10,
        jobs=list(jobs) if jobs else None,
    )
    def conveyor_backfill_requests(  # type: ignore[no-untyped-def]
        context: SensorEvaluationContext, conveyor: ConveyorResource
    ):
        store = conveyor.store()
        requests = store.backfills(states=BACKFILL_OPEN, limit=1000)
        launch, marks = backfill_decisions(
            requests, runs_of(context.instance, requests), launchable, time.time()
        )
        for m in marks:
            store.update_backfill(m.request_id, m.state, run_id=m.run_id, message=m.message)
        if not launch:
            return SkipReason(
                f"{len(requests)} backfill request(s) open, none to launch"
                if requests
                else "no backfill request"
            )
        return [run_request(r) for r in launch]

    return conveyor_backfill_requests
