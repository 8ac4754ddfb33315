"""The ``conveyor_scheduler`` sensor: Dagster glue over the pure ``core.planning.scheduler``.

Each tick (every sensor-daemon iteration: 5 s, Dagster's floor) it reads connectors,
brokers and active runs, asks ``core.planning.scheduler.plan`` for decisions, and carries them
out: store writes, ``RunRequest``s, terminations. Every decision is logged and written
to the connector's history with its reason. One connector's exception never fails the
tick for the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetKey,
    DagsterRunStatus,
    DefaultSensorStatus,
    JobDefinition,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from conveyor.config.reload import ReloadRequests
from conveyor.config.specs import LoadedSpec, scan, sync_files
from conveyor.core.host.processes import pid_alive
from conveyor.core.planning import scheduler as core
from conveyor.dagster.assets.checks import run_check_events, sink_assets
from conveyor.dagster.resources.conveyor import ConveyorResource, broker_views
from conveyor.dagster.run_queue import IN_PROGRESS, instance_queue_limits, queue_blocker
from conveyor.dagster.tags import ACTIVE, TAG_BROKER, TAG_CONNECTOR, TAG_GENERATION, job_name
from conveyor.store.meta import ConnectorRow, MetaStore, UnknownConnectorError


def connector_view(row: ConnectorRow, launchable: set[str] | None = None) -> core.ConnectorView:
    spec = row.spec or {}
    return core.ConnectorView(
        name=row.name,
        launchable=launchable is None or job_name(row.name) in launchable,
        desired=row.desired,
        status=row.status,
        broker_id=row.broker_id,
        generation=row.generation,
        run_id=row.run_id,
        heartbeat_at=row.heartbeat_at,
        status_since=row.status_since,
        updated_at=row.updated_at,
        heartbeat_timeout_s=float(spec.get("heartbeat_timeout_s", 30.0)),
        msgs_per_s=float(row.counters.get("msgs_per_s", 0.0) or 0.0),
        restarts=row.restarts,
        max_restarts=int(spec.get("max_restarts", 5)),
        next_restart_at=row.next_restart_at,
        last_error=row.last_error,
        last_moved_at=row.last_moved_at,
        spec_error=row.spec_error,
    )


def run_views(instance: Any, rows: list[ConnectorRow], now: float) -> list[core.RunView]:
    """Active connector runs, plus each connector's current run whatever its status; a queued
    run names the run queue's limit that holds it (``run_queue.queue_blocker``)."""
    host = socket.gethostname()
    seen: dict[str, Any] = {}
    since: dict[str, float] = {}
    for rec in instance.get_run_records(filters=RunsFilter(statuses=ACTIVE)):
        run = rec.dagster_run
        if TAG_CONNECTOR in run.tags:
            seen[run.run_id] = run
            stamp = rec.update_timestamp or rec.create_timestamp
            since[run.run_id] = stamp.timestamp() if stamp else now
    for row in rows:
        if row.run_id and row.run_id not in seen:
            run = instance.get_run_by_id(row.run_id)
            if run is not None:
                seen[run.run_id] = run
    pids = {r.run_id: r.run_pid for r in rows if r.run_id and r.run_host == host}
    blocker = _queue_blockers(instance, [r for r in seen.values() if r.status.value == "QUEUED"])
    out = []
    for run in seen.values():
        gen = run.tags.get(TAG_GENERATION)
        canceling = run.status == DagsterRunStatus.CANCELING
        out.append(
            core.RunView(
                run_id=run.run_id,
                connector=run.tags[TAG_CONNECTOR],
                generation=int(gen) if gen is not None else None,
                broker_id=run.tags.get(TAG_BROKER),
                status=run.status.value,
                pid=pids.get(run.run_id),
                canceling_since=since.get(run.run_id, now) if canceling else None,
                local=run.run_id in pids,
                process_alive=pid_alive(pids[run.run_id]) if pids.get(run.run_id) else None,
                status_since=since.get(run.run_id),
                blocker=blocker(run),
            )
        )
    return out


def _queue_blockers(instance: Any, queued: list[Any]) -> Callable[[Any], str | None]:
    """For the queued connector runs: which limit of the instance's run queue holds each."""
    limits = instance_queue_limits(instance) if queued else None
    if limits is None:
        return lambda _run: None
    in_progress = [r.tags for r in instance.get_runs(filters=RunsFilter(statuses=IN_PROGRESS))]
    held = {r.run_id: queue_blocker(*limits, r.tags, in_progress) for r in queued}
    return lambda run: held.get(run.run_id)


def apply_plan(
    context: Any,
    store: MetaStore,
    plan: core.Plan,
    views: dict[str, core.ConnectorView],
) -> list[RunRequest]:
    """Carry out decisions; each in its own try so one failure never stops the others."""
    requests: list[RunRequest] = []
    instance = context.instance
    for d in plan.decisions:
        try:
            requests.extend(_apply(instance, store, d, views.get(d.name)))
            context.log.info(f"{d.name}: {type(d).__name__}: {d.reason}")
        except Exception as e:  # noqa: BLE001 - reported per decision
            context.log.error(f"{d.name}: {type(d).__name__} failed: {type(e).__name__}: {e}")
            with contextlib.suppress(Exception):  # the connector may be gone
                store.record(
                    d.name, f"scheduler: {type(d).__name__} failed: {type(e).__name__}: {e}"
                )
    return requests


def _terminate(instance: Any, run_id: str | None) -> bool:
    if not run_id:
        return False
    run = instance.get_run_by_id(run_id)
    if run is None or run.is_finished:
        return False
    return bool(instance.run_launcher.terminate(run_id))


def _still_held(store: MetaStore, name: str, run_id: str) -> bool:
    """Whether ``run_id`` still holds ``name`` live, read now (after its end was seen)."""
    row = store.get(name)
    return row.run_id == run_id and row.status in core.LIVE


def _released_by_its_run(store: MetaStore, name: str, run_id: str | None) -> bool:
    """Whether ``run_id`` released ``name`` itself just now (``core.ending_itself``), read at
    the moment of a terminate: the tick's plan may have read the connector a moment before."""
    if run_id is None:
        return False
    try:
        row = store.get(name)
    except UnknownConnectorError:
        return False  # deleted: its run is terminated
    return core.ending_itself(run_id, connector_view(row), time.time(), scheduler_config())


def run_key(row: ConnectorRow) -> str:
    """``name:generation@created``: a connector deleted and created again under its name starts
    at generation 1 again, and Dagster skips a run key it has seen (the launch then waited for
    the launch timeout); the creation time (ms) keeps the keys of the two apart."""
    return f"{row.name}:{row.generation}@{int(row.created_at * 1000)}"


def _apply(
    instance: Any, store: MetaStore, d: core.Decision, view: core.ConnectorView | None
) -> list[RunRequest]:
    """One decision: its state change (fenced, in the store), then its side effects."""
    reason = f"scheduler: {d.reason}"
    row = None
    if d.while_run is not None and not _still_held(store, d.name, d.while_run):
        return []  # the run released the connector itself before it ended: not a crash
    if d.change is not None:
        expected = d.expected_generation(view.generation) if view is not None else None
        row = store.apply(d.name, expected, d.change, reason)
        if row is None:
            return []  # fenced: the connector moved on since the snapshot; nothing else to do
    match d:
        case core.Move():
            _terminate(instance, d.run_id)
        case core.Assign():
            assert row is not None
            tags = {
                **d.tags,
                TAG_CONNECTOR: d.name,
                TAG_BROKER: d.broker_id,
                TAG_GENERATION: str(row.generation),
            }
            return [RunRequest(run_key=run_key(row), job_name=job_name(d.name), tags=tags)]
        case core.Terminate():
            if _released_by_its_run(store, d.name, d.run_id):
                return []  # read again now: its loop saw the stop meanwhile and it is ending
            if _terminate(instance, d.run_id):
                store.record(d.name, f"{reason} (run {d.run_id} terminated)", run_id=d.run_id)
        case core.KillZombie():
            os.kill(d.pid, signal.SIGKILL)
            store.record(d.name, f"{reason}: killed", run_id=d.run_id)
        case core.ReportCanceled():
            run = instance.get_run_by_id(d.run_id)
            if run is not None and not run.is_finished:
                instance.report_run_canceled(run, message=d.reason)
                store.record(d.name, reason, run_id=d.run_id)
        case core.Failed():
            store.record(d.name, f"scheduler could not decide: {d.error}")
    return []


def scheduler_config() -> core.SchedulerConfig:
    """Defaults, overridable by environment (CONVEYOR_SCHEDULER_<FIELD>, e.g. ..._LAUNCH_TIMEOUT_S)."""
    values: dict[str, float] = {}
    for f in fields(core.SchedulerConfig):
        raw = os.environ.get(f"CONVEYOR_SCHEDULER_{f.name.upper()}")
        if raw:
            values[f.name] = float(raw)
    return core.SchedulerConfig(**values)


def tick(
    context: Any, store: MetaStore, now: float | None = None, launchable: set[str] | None = None
) -> tuple[core.Plan, list[RunRequest]]:
    """One scheduler tick against the store and the instance; returns the plan and run requests.

    ``launchable``: job names the sensor can target (None: all).
    """
    from conveyor.dagster.sensors.tasks import tasks_spec, tasks_tick

    now = time.time() if now is None else now
    all_rows = store.list()
    # Connectors with tasks.max > 1 run as partition tasks, planned by sensors/tasks.py.
    tasked = {r.name for r in all_rows if tasks_spec(r) is not None}
    rows = [r for r in all_rows if r.name not in tasked]
    views = {r.name: connector_view(r, launchable) for r in rows}
    plan = core.plan(
        list(views.values()),
        broker_views(store),
        [v for v in run_views(context.instance, rows, now) if v.connector not in tasked],
        now,
        scheduler_config(),
    )
    requests = apply_plan(context, store, plan, views)
    return plan, requests + tasks_tick(
        context,
        store,
        store.list(),  # as the assignments above left them
        now,
        launchable=launchable,
        launch_timeout_s=scheduler_config().launch_timeout_s,
    )


@dataclass(frozen=True)
class SpecSources:
    """Where a code location's connector specs come from: what the sensor rescans each tick.

    ``connectors_dir``: plain spec files (None: none); ``defs_roots``: components projects'
    defs folders, searched for ``ConnectorComponent`` files.
    """

    connectors_dir: Path | None = None
    defs_roots: tuple[Path, ...] = ()

    def scan(self) -> list[LoadedSpec]:
        return scan(self.connectors_dir, self.defs_roots)


def location_fingerprint(specs: Sequence[LoadedSpec]) -> str:
    """What a code location is built from (see ``LoadedSpec.location_fingerprint``)."""
    parts = sorted(ls.location_fingerprint() for ls in specs)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


_reloads = ReloadRequests()
# A spec written through the REST API is reloaded by the API at once; the sensor reloads
# for files changed by hand, once the change has waited this long.
RELOAD_GRACE_S = float(os.environ.get("CONVEYOR_RELOAD_GRACE_S", "10"))


def sync_and_reload(
    context: Any, store: MetaStore, sources: SpecSources, loaded_fingerprint: str | None
) -> None:
    """Bring the store in line with the spec files, and the code location when they differ.

    A components file that does not validate is not reloaded into the location (it would
    fail to load): the connector shows the error until the file is fixed.
    """
    found = sources.scan()
    for note in sync_files(store, found):
        context.log.info(note)
    if loaded_fingerprint is None:
        return
    now_fp = location_fingerprint(found)
    if now_fp == loaded_fingerprint:
        return
    broken = [ls for ls in found if ls.is_component and not ls.ok]
    if broken:
        context.log.warning(
            "not reloading the code location: " + "; ".join(str(ls.error) for ls in broken)
        )
        return
    origin = getattr(context, "code_location_origin", None)
    location = getattr(origin, "location_name", None)
    if _reloads.request(now_fp, "connector specs changed", location, grace_s=RELOAD_GRACE_S):
        context.log.info(f"connector specs changed: reloading code location {location or ''}")


def waiting_reports(
    cursor: str | None, plan: core.Plan, store: MetaStore, assets: dict[str, AssetKey]
) -> tuple[list[AssetCheckEvaluation], str | None]:
    """The ``has_run`` evaluations of a tick (``checks.run_check_events``) and the cursor that
    remembers who was reported waiting (a JSON list of names; None, which keeps the cursor as
    it is, only when nobody waits nor waited)."""
    waiting = {d.name: d.reason for d in plan.of(core.Waiting)}
    was = set(json.loads(cursor)) if cursor else set()
    if not waiting and not was:
        return [], None
    events, still = run_check_events(assets, waiting, store.list() if was else [], was)
    return events, json.dumps(sorted(still))


def scheduler_sensor(
    jobs: Sequence[JobDefinition] | None,
    specs: Sequence[LoadedSpec] | None = None,
    sources: SpecSources | None = None,
) -> SensorDefinition:
    """The ``conveyor_scheduler`` sensor, targeting the connector jobs of this code location.

    Each tick it first syncs the spec files into the meta store (new, changed, removed)
    and asks for a reload of the code location when they differ from ``specs``, what the
    location was built from: a connector whose job is not in the location yet is not
    assigned (its run could not be launched) until the reload brings it. ``jobs=None``
    (tests): no target check; ``sources=None``: no file sync.
    """
    launchable = None if jobs is None else {j.name for j in jobs}
    loaded_fp = location_fingerprint(specs) if specs is not None else None
    assets = sink_assets(specs or [])

    @sensor(
        name="conveyor_scheduler",
        description="Syncs connector spec files, assigns connectors to broker executors, heals lost "
        "runs, reclaims stopped ones (the Meta scheduler).",
        default_status=DefaultSensorStatus.RUNNING,
        # Below the daemon's own 5 s loop, so that every iteration ticks: with 5 s here the
        # last tick's recorded start lags its iteration's, the next check finds 4.9 s
        # elapsed and skips, and the scheduler ticked every 10 s half of the time (measured
        # in the scheduler e2e: the kill -9 failover waited for it).
        minimum_interval_seconds=1,
        jobs=list(jobs) if jobs else None,
    )
    def conveyor_scheduler(
        context: SensorEvaluationContext, conveyor: ConveyorResource
    ) -> SensorResult:
        store = conveyor.store()
        try:
            conveyor.sync_brokers(store)
        except Exception as e:  # noqa: BLE001 - scheduling goes on with the stored brokers
            context.log.error(f"syncing the brokers file failed: {type(e).__name__}: {e}")
        if sources is not None:
            try:
                sync_and_reload(context, store, sources, loaded_fp)
            except Exception as e:  # noqa: BLE001 - scheduling goes on with what the store holds
                context.log.error(f"syncing connector specs failed: {type(e).__name__}: {e}")
        plan, requests = tick(context, store, launchable=launchable)
        events, cursor = waiting_reports(context.cursor, plan, store, assets)
        skip = None if plan.decisions or events else "nothing to do"
        return SensorResult(
            run_requests=requests,
            skip_reason=skip if not requests else None,
            asset_events=events,
            cursor=cursor,
        )

    return conveyor_scheduler
