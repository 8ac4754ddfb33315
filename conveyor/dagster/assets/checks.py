"""Asset checks on sink assets: fail when a connector's lag keeps growing, or when it waits for
a run; complete through T.

Connector runs record a materialization on their sink asset at most once a
minute with ``lag`` in its metadata (see ``jobs.progress.progress_logger``).
The check reads those and asks the pure :func:`lag_verdict` whether lag grew
over the last ``N`` minutes (``CONVEYOR_LAG_CHECK_MINUTES``, default 10).
The sink assets are external (no op materializes them), so the checks run in
their own asset job ``lag_checks`` on a schedule that is running by default.

The same materializations carry the connector's event-time watermark (``watermark``,
``watermark_ts``, ``watermark_by_partition``, ``lag_seconds``, ``late_event_times``; rule in
``core/engine/watermarks.py``), and so do the observations a run logs between them as soon as the
watermark crosses a minute (or late data arrives): :func:`watermark_events` reads both kinds in
storage order, :func:`watermark_of` and :func:`late_ranges_of` their metadata, for the
``complete_through`` check (:func:`complete_through_check`, which users add to their own
definitions) and for ``conveyor.dagster.landed``.

``has_run`` (:func:`run_checks`) fails, severity WARN, while a connector of the asset is assigned
and its run waits in Dagster's run queue (``core.planning.scheduler``'s ``Waiting``): the scheduler sensor
reports it as the wait is found and again once the run heartbeats (:func:`run_check_events`), and
running it by hand reads the meta store.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetKey,
    AssetRecordsFilter,
    AssetSelection,
    DagsterInstance,
    DefaultScheduleStatus,
    MetadataValue,
    ScheduleDefinition,
    asset_check,
    define_asset_job,
    in_process_executor,
)

from conveyor.config.specs import LoadedSpec
from conveyor.core.model import ConnectorStatus
from conveyor.core.planning.scheduler import LIVE, WAITING_FOR_A_RUN
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_CONNECTOR
from conveyor.store.meta import ConnectorRow, UnknownConnectorError

DEFAULT_LAG_CHECK_MINUTES = 10.0
LAG_CHECK_MINUTES_ENV = "CONVEYOR_LAG_CHECK_MINUTES"
LAG_CHECK_NAME = "lag_not_growing"
LAG_CHECKS_JOB = "lag_checks"
LAG_CHECKS_CRON = "*/5 * * * *"
# Samples inside the window needed besides the baseline: one blip is not a trend.
MIN_SAMPLES_IN_WINDOW = 2
# Materializations read per evaluation; at one a minute per connector this covers
# two windows of 10 minutes for several connectors sharing a sink.
FETCH_LIMIT = 1000


@dataclass(frozen=True)
class LagSample:
    """One recorded lag value (sum of highwater minus committed) at a Unix time."""

    timestamp: float
    lag: int


@dataclass(frozen=True)
class LagVerdict:
    """Outcome of :func:`lag_verdict`: passed, why, and the numbers behind it."""

    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)


# The check's clock (tests freeze it at the time of their last sample).
clock: Callable[[], float] = time.time


def lag_check_minutes() -> float:
    """The window in minutes: ``$CONVEYOR_LAG_CHECK_MINUTES`` (a positive number) or 10."""
    raw = os.environ.get(LAG_CHECK_MINUTES_ENV, "").strip()
    if not raw:
        return DEFAULT_LAG_CHECK_MINUTES
    try:
        minutes = float(raw)
    except ValueError:
        return DEFAULT_LAG_CHECK_MINUTES
    return minutes if minutes > 0 else DEFAULT_LAG_CHECK_MINUTES


def lag_verdict(samples: Iterable[LagSample], *, now: float, window_s: float) -> LagVerdict:
    """Decide whether lag grew during the ``window_s`` seconds before ``now``.

    The baseline is the newest sample taken at least ``window_s`` ago. Lag grew
    when no sample inside the window fell back to the baseline or below: it has
    stayed above where it was ``window_s`` ago for the whole window (a single
    dip means the connector caught up and is not falling behind). Without a
    baseline, or with fewer than ``MIN_SAMPLES_IN_WINDOW`` samples in the
    window, there is too little data and the verdict passes. Pure: no clock, no I/O.
    """
    ordered = sorted((s for s in samples if s.timestamp <= now), key=lambda s: s.timestamp)
    start = now - window_s
    minutes = f"{window_s / 60:g}"
    before = [s for s in ordered if s.timestamp <= start]
    inside = [s for s in ordered if s.timestamp > start]
    if not before:
        return LagVerdict(
            True,
            f"too little data: no lag recorded {minutes} minutes ago or earlier ({len(inside)} recent sample(s))",
            {"samples_in_window": len(inside)},
        )
    if len(inside) < MIN_SAMPLES_IN_WINDOW:
        return LagVerdict(
            True,
            f"too little data: {len(inside)} lag sample(s) in the last {minutes} minutes, need {MIN_SAMPLES_IN_WINDOW}",
            {"samples_in_window": len(inside), "lag_baseline": before[-1].lag},
        )
    baseline = before[-1]
    latest = inside[-1]
    lowest = min(s.lag for s in inside)
    metadata = {
        "lag_baseline": baseline.lag,
        "lag_latest": latest.lag,
        "lag_min_in_window": lowest,
        "lag_growth": latest.lag - baseline.lag,
        "samples_in_window": len(inside),
        "window_minutes": window_s / 60,
    }
    if lowest > baseline.lag:
        return LagVerdict(
            False,
            f"lag grew for {minutes} minutes: {baseline.lag} -> {latest.lag} and never fell back to {baseline.lag}",
            metadata,
        )
    if latest.lag > baseline.lag:
        why = f"lag is up from {baseline.lag} to {latest.lag} but fell to {lowest} within the last {minutes} minutes"
    else:
        why = f"lag is flat or falling over the last {minutes} minutes: {baseline.lag} -> {latest.lag}"
    return LagVerdict(True, why, metadata)


def _samples_by_connector(
    context: AssetCheckExecutionContext, key: AssetKey, since: float
) -> dict[str, list[LagSample]]:
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=key, after_timestamp=since), limit=FETCH_LIMIT
    ).records
    out: dict[str, list[LagSample]] = defaultdict(list)
    for r in records:
        m = r.asset_materialization
        if m is None or "lag" not in m.metadata:
            continue
        value = m.metadata["lag"].value
        if not isinstance(value, (int, float)):
            continue
        out[(m.tags or {}).get(TAG_CONNECTOR, "")].append(LagSample(r.timestamp, int(value)))
    return out


def _lag_check(key: AssetKey, connectors: Sequence[str]) -> AssetChecksDefinition:
    @asset_check(
        asset=key,
        name=LAG_CHECK_NAME,
        description=(
            f"Fails when the lag of {', '.join(connectors)} grew over the last N minutes "
            f"(${LAG_CHECK_MINUTES_ENV}, default {DEFAULT_LAG_CHECK_MINUTES:g})."
        ),
        metadata={"connectors": ", ".join(connectors)},
    )
    def check(context) -> AssetCheckResult:  # type: ignore[no-untyped-def]  # dagster reads the annotation at runtime
        window_s = lag_check_minutes() * 60
        now = clock()
        by_connector = _samples_by_connector(context, key, now - 2 * window_s)
        if not by_connector:
            verdict = lag_verdict([], now=now, window_s=window_s)
            return AssetCheckResult(
                passed=True, description=verdict.description, metadata=verdict.metadata
            )
        verdicts = {
            c or "?": lag_verdict(s, now=now, window_s=window_s)
            for c, s in sorted(by_connector.items())
        }
        failed = {c: v for c, v in verdicts.items() if not v.passed}
        shown = failed or verdicts
        if len(shown) == 1:
            [(c, v)] = shown.items()
            return AssetCheckResult(
                passed=not failed, description=f"{c}: {v.description}", metadata=v.metadata
            )
        return AssetCheckResult(
            passed=not failed,
            description="; ".join(f"{c}: {v.description}" for c, v in shown.items()),
            metadata={"connectors_failing": ", ".join(failed)} if failed else {},
        )

    return check


def lag_checks(specs: Sequence[LoadedSpec]) -> list[AssetChecksDefinition]:
    """One ``lag_not_growing`` check per sink asset of the valid connectors."""
    sinks: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for ls in specs:
        if ls.ok and ls.sink is not None:
            sinks[tuple(ls.sink.asset_key_path())].append(ls.name)
    return [_lag_check(AssetKey(list(path)), names) for path, names in sinks.items()]


def lag_check_schedules(specs: Sequence[LoadedSpec]) -> list[ScheduleDefinition]:
    """Every five minutes, the ``lag_checks`` job runs all lag checks (none without connectors)."""
    checks = lag_checks(specs)
    if not checks:
        return []
    job = define_asset_job(
        LAG_CHECKS_JOB,
        selection=AssetSelection.checks(*(k for c in checks for k in c.check_keys)),
        description="Runs the lag_not_growing check of every sink asset.",
        # The checks only read the event log: one process, not one per check (Dagster's
        # default multiprocess executor would start a process for every sink asset).
        executor_def=in_process_executor,
    )
    return [
        ScheduleDefinition(
            name="conveyor_lag_checks",
            job=job,
            cron_schedule=LAG_CHECKS_CRON,
            default_status=DefaultScheduleStatus.RUNNING,
            description="Evaluates the sink assets' lag checks every five minutes.",
        )
    ]


# -- a connector that waits for its run -------------------------------------------------------

RUN_CHECK_NAME = "has_run"


def sink_assets(specs: Sequence[LoadedSpec]) -> dict[str, AssetKey]:
    """Each valid sink connector's sink asset, by connector name."""
    return {
        ls.name: AssetKey(list(ls.sink.asset_key_path()))
        for ls in specs
        if ls.ok and ls.sink is not None and not ls.is_source
    }


def waiting_for_a_run(row: ConnectorRow) -> bool:
    """Assigned, meant to run, and its last error says its run waits (``core.planning.scheduler``)."""
    return (
        row.status == ConnectorStatus.IDLE
        and row.broker_id is not None
        and row.desired.wants_run
        and (row.last_error or "").startswith(WAITING_FOR_A_RUN)
    )


def run_verdict(rows: Sequence[ConnectorRow]) -> tuple[bool, str]:
    """``has_run`` over the connectors of one asset: failed while any of them waits for its run."""
    waiting = [r for r in rows if waiting_for_a_run(r)]
    if waiting:
        return False, "; ".join(f"{r.name}: {r.last_error}" for r in waiting)
    return True, ", ".join(f"{r.name}: {r.status.value}" for r in rows) or "no connector"


def _run_check(key: AssetKey, connectors: Sequence[str]) -> AssetChecksDefinition:
    @asset_check(
        asset=key,
        name=RUN_CHECK_NAME,
        description=(
            f"Fails (WARN) while {', '.join(connectors)} is assigned but its run waits in "
            "Dagster's run queue; the reason names the limit that holds it."
        ),
        metadata={"connectors": ", ".join(connectors)},
    )
    def check(context, conveyor: ConveyorResource) -> AssetCheckResult:  # type: ignore[no-untyped-def]  # dagster reads the annotation at runtime
        store = conveyor.store()
        rows = []
        for name in connectors:
            with contextlib.suppress(UnknownConnectorError):
                rows.append(store.get(name))
        passed, why = run_verdict(rows)
        return AssetCheckResult(passed=passed, description=why, severity=AssetCheckSeverity.WARN)

    return check


def run_checks(specs: Sequence[LoadedSpec]) -> list[AssetChecksDefinition]:
    """One ``has_run`` check per sink asset of the valid sink connectors."""
    by_asset: dict[AssetKey, list[str]] = defaultdict(list)
    for name, key in sink_assets(specs).items():
        by_asset[key].append(name)
    return [_run_check(key, names) for key, names in by_asset.items()]


def run_check_events(
    assets: Mapping[str, AssetKey],
    waiting: Mapping[str, str],
    rows: Sequence[ConnectorRow],
    was: set[str],
) -> tuple[list[AssetCheckEvaluation], set[str]]:
    """The ``has_run`` evaluations a scheduler tick reports, and who waits after it.

    ``waiting``: the connectors the tick found waiting, with the reason; ``was``: those
    reported waiting before (the sensor's cursor). A connector reported waiting passes again
    once it is live, no longer meant to run, or gone."""
    by_name = {r.name: r for r in rows}
    events = []
    for name, reason in sorted(waiting.items()):
        if name in assets:
            events.append(_evaluation(assets[name], name, False, reason))
    still = set(waiting)
    for name in sorted(was - set(waiting)):
        row = by_name.get(name)
        if row is not None and row.desired.wants_run and row.status not in LIVE:
            still.add(name)  # not running yet: its failed evaluation stands
        elif name in assets:
            status = row.status.value if row is not None else "deleted"
            events.append(_evaluation(assets[name], name, True, f"{name}: {status}"))
    return events, still


def _evaluation(key: AssetKey, name: str, passed: bool, why: str) -> AssetCheckEvaluation:
    return AssetCheckEvaluation(
        asset_key=key,
        check_name=RUN_CHECK_NAME,
        passed=passed,
        severity=AssetCheckSeverity.WARN,
        description=why if passed else f"{name}: {why}",
        metadata={"connector": name},
    )


# -- the watermark on the sink asset -------------------------------------------------------

# Metadata of a sink asset's materializations (written by ``jobs.progress``).
WATERMARK = "watermark"  # ISO-8601 UTC text
WATERMARK_TS = "watermark_ts"  # the same as a timestamp
WATERMARK_BY_PARTITION = "watermark_by_partition"  # JSON: topic[partition] -> ISO high mark
IDLE_PARTITIONS = "idle_partitions"  # JSON list: partitions not holding the watermark back
LAG_SECONDS = "lag_seconds"  # now - watermark, when the report was made
LATE_EVENT_TIMES = "late_event_times"  # JSON list of [from, to] ISO event times since last report
COMPLETE_THROUGH_CHECK_NAME = "complete_through"
# Materializations read for the newest watermark of each connector of a sink asset.
WATERMARK_FETCH_LIMIT = 200


def iso(ts: float) -> str:
    """Unix seconds as ISO-8601 UTC text (``2025-01-02T03:04:05.123000Z``)."""
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def _seconds(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def watermark_of(metadata: Mapping[str, Any]) -> float | None:
    """The watermark a materialization reported (Unix seconds), None when it has none."""
    entry = metadata.get(WATERMARK_TS)
    if entry is not None and isinstance(entry.value, (int, float)):
        return float(entry.value)
    entry = metadata.get(WATERMARK)
    if entry is not None and isinstance(entry.value, str):
        try:
            return _seconds(entry.value)
        except ValueError:
            return None
    return None


def late_ranges_of(metadata: Mapping[str, Any]) -> list[tuple[float, float]]:
    """The late event-time ranges a materialization reported (Unix seconds)."""
    entry = metadata.get(LATE_EVENT_TIMES)
    if entry is None:
        return []
    value = entry.value
    if isinstance(value, str):
        value = json.loads(value)
    out = []
    for pair in value or []:
        try:
            out.append((_seconds(pair[0]), _seconds(pair[1])))
        except (ValueError, TypeError, IndexError):
            continue
    return out


@dataclass(frozen=True)
class WatermarkEvent:
    """A sink asset event that may carry a watermark: a run's materialization (its progress) or
    observation (a watermark report), with its storage id, time and connector."""

    storage_id: int
    timestamp: float
    connector: str
    metadata: Mapping[str, Any]


def watermark_events(
    instance: DagsterInstance,
    key: AssetKey,
    *,
    after: int | None = None,
    limit: int = WATERMARK_FETCH_LIMIT,
    ascending: bool = True,
) -> list[WatermarkEvent]:
    """The sink asset's materializations and observations after storage id ``after``, merged in
    storage order (``ascending``, else newest first). At most ``limit`` of each kind are read:
    where one kind filled its limit, the list stops at its last one, so that a reader going on
    from the last id returned skips nothing."""
    kinds = [
        (instance.fetch_materializations, "asset_materialization"),
        (instance.fetch_observations, "asset_observation"),
    ]
    events: list[WatermarkEvent] = []
    bounds: list[int] = []
    for fetch, attr in kinds:
        records = fetch(
            AssetRecordsFilter(asset_key=key, after_storage_id=after),
            limit=limit,
            ascending=ascending,
        ).records
        if len(records) >= limit:
            bounds.append(records[-1].storage_id)
        for r in records:
            event = getattr(r, attr, None)
            if event is not None:
                connector = (event.tags or {}).get(TAG_CONNECTOR, "")
                events.append(WatermarkEvent(r.storage_id, r.timestamp, connector, event.metadata))
    events.sort(key=lambda e: e.storage_id, reverse=not ascending)
    if bounds:
        cut = min(bounds) if ascending else max(bounds)
        events = [e for e in events if (e.storage_id <= cut if ascending else e.storage_id >= cut)]
    return events


def latest_watermarks(instance: DagsterInstance, key: AssetKey) -> dict[str, float]:
    """The newest watermark each connector reported on sink asset ``key`` (by connector tag)."""
    out: dict[str, float] = {}
    for e in watermark_events(instance, key, ascending=False):  # newest first
        wm = watermark_of(e.metadata)
        if wm is not None and e.connector not in out:
            out[e.connector] = wm
    return out


def complete_through_check(
    sink_asset_key: AssetKey | str | Sequence[str],
    *,
    max_lag_s: float | None = None,
    name: str = COMPLETE_THROUGH_CHECK_NAME,
) -> AssetChecksDefinition:
    """An asset check "complete through T" on a connector's sink asset: T is the watermark the
    connector last reported (the smallest, when several connectors write the asset). It fails
    when no watermark was reported yet, or (``max_lag_s``) when T is further behind now."""
    key = AssetKey.from_coercible(sink_asset_key)
    limit = "" if max_lag_s is None else f"; fails when more than {max_lag_s:g} s behind"

    @asset_check(
        asset=key,
        name=name,
        description=f"Complete through T: the connector's event-time watermark{limit}.",
    )
    def check(context) -> AssetCheckResult:  # dagster reads the annotation at runtime
        marks = latest_watermarks(context.instance, key)
        if not marks:
            return AssetCheckResult(
                passed=False, description="no watermark reported yet on this sink asset"
            )
        through = min(marks.values())
        behind = max(0.0, clock() - through)
        passed = max_lag_s is None or behind <= max_lag_s
        return AssetCheckResult(
            passed=passed,
            description=f"complete through {iso(through)} ({behind:.0f} s behind)",
            metadata={
                "complete_through": MetadataValue.timestamp(through),
                LAG_SECONDS: MetadataValue.float(behind),
                "connectors": MetadataValue.json({c or "?": iso(t) for c, t in marks.items()}),
            },
        )

    return check
