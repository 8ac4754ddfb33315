"""Downstream assets that run when a connector's sink is complete through their time partition.

``landed_through(sink_asset_key, partitions_def, target=my_asset)`` is a sensor users put
beside their own time-partitioned asset that reads a connector's sink (a table, files). It
reads the watermark the connector reports on its sink asset (``core/engine/watermarks.py``; the
metadata of the run's materializations and of the observations it logs as soon as the
watermark crosses a minute, read by ``dagster/assets/checks.py``) and:

- requests a run of each partition once the watermark passes the partition's end, in time
  order, exactly once (the cursor keeps the end of the last partition requested; a run key
  per partition besides). There is one lateness, the connector's
  ``watermark.allowed_lateness_s``: the watermark already stays that far behind, so a
  partition runs as soon as the watermark passes its end;
- starts where it first sees a watermark: the partition holding it is the first it requests
  (or ``start``, declared: the partition holding that time), never every partition from the
  definition's start. Partitions before that are history: run them as a Dagster backfill;
- requests a backlog (a declared start in the past, a connector catching up) at most
  ``max_partitions_per_tick`` per tick (defaults: 5 every 5 s, one a second), oldest first;
- requests a partition again when late data for it was delivered after it was requested: the
  connector reports the event-time ranges of late events (``late_event_times``), which map to
  the partitions already requested that they overlap (kept in the cursor while the per-tick
  bound holds them back; late runs go before new ones).

With several connectors writing one sink asset, the watermark is the smallest of their newest
ones. A sensor, not an AutomationCondition: the watermark lives in event metadata, which
Dagster 1.13's conditions do not read, and a cursor gives "exactly once" plainly.
:func:`complete_through_check` (the asset check "complete through T") is re-exported here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from dagster import (
    AssetKey,
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    TimeWindow,
    TimeWindowPartitionsDefinition,
    sensor,
)

from conveyor.core.engine.watermarks import merge_ranges
from conveyor.dagster.assets.checks import (
    complete_through_check,
    iso,
    late_ranges_of,
    watermark_events,
    watermark_of,
)

__all__ = ["complete_through_check", "landed_through", "plan_partitions"]

# Sink events read per tick (a connector reports about one a minute, more while catching up).
RECORDS_PER_TICK = 1000
# Tag on the runs this sensor requests: why the partition runs.
TAG_LANDED = "conveyor/landed"
# Late ranges kept in the cursor while the per-tick bound holds their runs back.
MAX_PENDING_LATE = 64


@dataclass
class LandedCursor:
    """What the sensor has seen and done: the last sink event read, the newest watermark per
    connector, where it began (the start of the first partition it requests), the end (Unix
    seconds) of the last partition requested, and late ranges whose runs are still to request."""

    after: int | None = None
    marks: dict[str, float] = field(default_factory=dict)
    requested_end: float | None = None
    begin: float | None = None
    late: list[tuple[float, float]] = field(default_factory=list)
    late_runs: int = 0  # late runs requested: their run keys' serial

    @staticmethod
    def parse(text: str | None) -> LandedCursor:
        if not text:
            return LandedCursor()
        raw = json.loads(text)
        end = raw.get("end")
        return LandedCursor(
            raw.get("after"),
            dict(raw.get("marks") or {}),
            end,
            # A cursor of an earlier release began wherever it had requested up to.
            raw.get("begin", end if end is None else float("-inf")),
            [(float(a), float(b)) for a, b in raw.get("late") or []],
            int(raw.get("late_runs") or 0),
        )

    def dump(self) -> str:
        out: dict[str, Any] = {"after": self.after, "marks": self.marks, "end": self.requested_end}
        if self.begin is not None and self.begin != float("-inf"):
            out["begin"] = self.begin  # (an earlier release's cursor: no key, began anywhere)
        if self.late:
            out["late"] = [list(r) for r in self.late]
        if self.late_runs:
            out["late_runs"] = self.late_runs
        return json.dumps(out)


@dataclass(frozen=True)
class Plan:
    """One tick's decision: partitions to run the first time, partitions to run again, the end
    of the last partition requested, and the late ranges left for the next ticks."""

    first: tuple[str, ...]
    again: tuple[str, ...]
    requested_end: float | None
    late_left: tuple[tuple[float, float], ...] = ()


def _windows_from(
    partitions_def: TimeWindowPartitionsDefinition, start: float | None
) -> Iterator[tuple[str, TimeWindow]]:
    """Partitions in time order: the first one, or the one holding ``start``."""
    first = partitions_def.get_first_partition_window()
    if first is None:
        return
    window: TimeWindow | None = first
    if start is not None and start > first.start.timestamp():
        key = partitions_def.get_partition_key_for_timestamp(start)
        window = partitions_def.time_window_for_partition_key(key)
    while window is not None:
        yield partitions_def.get_partition_key_for_timestamp(window.start.timestamp()), window
        window = partitions_def.get_next_partition_window(window.end)


def partition_start(partitions_def: TimeWindowPartitionsDefinition, at: float) -> float:
    """The start of the partition holding ``at`` (the first partition's, before it)."""
    for _, window in _windows_from(partitions_def, at):
        return window.start.timestamp()
    return at


def _late_runs(
    partitions_def: TimeWindowPartitionsDefinition,
    late: Sequence[tuple[float, float]],
    *,
    begin: float | None,
    requested_end: float | None,
    budget: int,
) -> tuple[list[str], list[tuple[float, float]]]:
    """Partitions already requested (from ``begin`` to ``requested_end``) that the late ranges
    overlap, at most ``budget``; and the part of the ranges left for later."""
    if requested_end is None or begin is None:
        return [], []
    again: list[str] = []
    left: list[tuple[float, float]] = []
    for lo, hi in merge_ranges(list(late)):
        lo = max(lo, begin)
        if lo > hi or lo >= requested_end:
            continue
        for key, window in _windows_from(partitions_def, lo):
            if window.start.timestamp() > hi or window.end.timestamp() > requested_end:
                break
            if key in again:
                continue
            if len(again) >= budget:
                left.append((window.start.timestamp(), min(hi, requested_end)))
                break
            again.append(key)
    return again, merge_ranges(left, MAX_PENDING_LATE)


def plan_partitions(
    partitions_def: TimeWindowPartitionsDefinition,
    *,
    watermark: float | None,
    requested_end: float | None,
    late: Sequence[tuple[float, float]],
    begin: float | None = None,
    limit: int = 5,
) -> Plan:
    """Which partitions to run, at most ``limit``: again, those already requested (from
    ``begin``, ending at or before ``requested_end``) that a late range overlaps; then the
    first time, those whose end the watermark has passed since ``requested_end``."""
    if begin is None:
        begin = requested_end
    again, left = _late_runs(
        partitions_def, late, begin=begin, requested_end=requested_end, budget=limit
    )
    first: list[str] = []
    end = requested_end
    if watermark is not None:
        for key, window in _windows_from(partitions_def, requested_end):
            if len(first) + len(again) >= limit or window.end.timestamp() > watermark:
                break
            first.append(key)
            end = window.end.timestamp()
    return Plan(tuple(first), tuple(again), end, tuple(left))


def _read_sink(context: SensorEvaluationContext, key: AssetKey, cursor: LandedCursor) -> list[Any]:
    """Late ranges in the sink events after the cursor (oldest first); updates its marks and
    position."""
    late: list[tuple[float, float]] = []
    for e in watermark_events(context.instance, key, after=cursor.after, limit=RECORDS_PER_TICK):
        cursor.after = e.storage_id
        wm = watermark_of(e.metadata)
        if wm is not None:
            cursor.marks[e.connector] = max(wm, cursor.marks.get(e.connector, wm))
        late.extend(late_ranges_of(e.metadata))
    return late


def _seconds(start: datetime | str | float) -> float:
    """A declared start as Unix seconds (a naive time is UTC)."""
    if isinstance(start, (int, float)):
        return float(start)
    when = datetime.fromisoformat(start) if isinstance(start, str) else start
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def _begin(
    cursor: LandedCursor,
    partitions_def: TimeWindowPartitionsDefinition,
    watermark: float | None,
    start: float | None,
) -> str | None:
    """Where a sensor without a position begins: the declared ``start``, else the first
    watermark; returns the line its tick logs (None: nothing to decide yet)."""
    if cursor.requested_end is not None or (start is None and watermark is None):
        return None
    at = start if start is not None else watermark
    assert at is not None
    cursor.begin = cursor.requested_end = partition_start(partitions_def, at)
    how = "the declared start" if start is not None else f"the first watermark, {iso(at)}"
    return (
        f"beginning at the partition starting {iso(cursor.begin)} ({how}); earlier partitions "
        "are not requested (run them as a backfill)"
    )


def _requests(plan: Plan, cursor: LandedCursor) -> list[RunRequest]:
    """The tick's run requests: a partition's first run keyed by its key (once ever), a late
    run by its key and the late runs' serial (each one its own run)."""
    again = []
    for k in plan.again:
        cursor.late_runs += 1
        again.append(
            RunRequest(
                run_key=f"{k}@late.{cursor.late_runs}",
                partition_key=k,
                tags={TAG_LANDED: "late data"},
            )
        )
    first = [
        RunRequest(run_key=k, partition_key=k, tags={TAG_LANDED: "watermark"}) for k in plan.first
    ]
    return again + first


def landed_through(
    sink_asset_key: AssetKey | str | Sequence[str],
    partitions_def: TimeWindowPartitionsDefinition,
    *,
    target: Any,
    start: datetime | str | float | None = None,
    name: str | None = None,
    minimum_interval_seconds: int = 5,
    max_partitions_per_tick: int = 5,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
    lateness_s: float | None = None,
) -> SensorDefinition:
    """A sensor that runs ``target``'s partitions of ``partitions_def`` as the connector's
    watermark on ``sink_asset_key`` passes each one's end, from the first watermark it sees
    (or the partition holding ``start``), at most ``max_partitions_per_tick`` a tick, and runs
    a partition again when late data for it landed (see the module docstring).

    ``lateness_s`` is refused: the lateness is the connector's ``watermark.allowed_lateness_s``
    (the watermark already waits it out), one setting for every reader."""
    if lateness_s is not None:
        raise ValueError(
            "landed_through: lateness_s was removed; the lateness is the connector's "
            f"watermark.allowed_lateness_s (set it to {lateness_s:g} in the connector's spec): "
            "its watermark already stays that far behind, for every reader"
        )
    if max_partitions_per_tick < 1:
        raise ValueError("landed_through: max_partitions_per_tick must be at least 1")
    key = AssetKey.from_coercible(sink_asset_key)
    sensor_name = name or f"landed_through__{'__'.join(key.path)}"
    declared = None if start is None else _seconds(start)

    @sensor(
        name=sensor_name,
        target=target,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"Runs each time partition once {key.to_user_string()} is complete through "
        "its end (the connector's watermark), and again when late data for it landed.",
    )
    def landed(context: SensorEvaluationContext) -> SensorResult | SkipReason:
        cursor = LandedCursor.parse(context.cursor)
        late = cursor.late + _read_sink(context, key, cursor)
        watermark = min(cursor.marks.values()) if cursor.marks else None
        began = _begin(cursor, partitions_def, watermark, declared)
        if began:
            context.log.info(began)
        plan = plan_partitions(
            partitions_def,
            watermark=watermark,
            requested_end=cursor.requested_end,
            begin=cursor.begin,
            late=late,
            limit=max_partitions_per_tick,
        )
        cursor.requested_end, cursor.late = plan.requested_end, list(plan.late_left)
        _log_backlog(context, partitions_def, plan, watermark, max_partitions_per_tick)
        requests = _requests(plan, cursor)
        if not requests:
            through = "no watermark yet" if watermark is None else f"watermark {iso(watermark)}"
            return SensorResult(
                skip_reason=SkipReason(f"nothing new: {through}"), cursor=cursor.dump()
            )
        return SensorResult(run_requests=requests, cursor=cursor.dump())

    return landed


def _log_backlog(
    context: SensorEvaluationContext,
    partitions_def: TimeWindowPartitionsDefinition,
    plan: Plan,
    watermark: float | None,
    limit: int,
) -> None:
    """When the per-tick bound held requests back: how many partitions still wait."""
    if len(plan.first) + len(plan.again) < limit:
        return
    waiting = 0
    if watermark is not None and plan.requested_end is not None:
        waiting = partitions_def.get_num_partitions_in_window(
            TimeWindow(
                datetime.fromtimestamp(plan.requested_end, timezone.utc),
                datetime.fromtimestamp(watermark, timezone.utc),
            )
        )
    context.log.info(
        f"backlog: about {waiting} partition(s) behind the watermark and "
        f"{len(plan.late_left)} late range(s) wait; at most {limit} are requested a tick"
    )
