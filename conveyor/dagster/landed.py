"""Downstream assets that run when a connector's sink is complete through their time partition.

``landed_through(sink_asset_key, partitions_def, target=my_asset)`` is a sensor users put
beside their own time-partitioned asset that reads a connector's sink (a table, files). It
reads the watermark the connector reports on its sink asset (``core/watermarks.py``;
metadata in ``dagster/assets/checks.py``) and:

- requests a run of each partition once the watermark passes the partition's end plus
  ``lateness_s``, in time order, exactly once (the cursor keeps the end of the last partition
  requested; a run key per partition besides);
- requests a partition again when late data for it was delivered after it was requested: the
  connector reports the event-time ranges of late events (``late_event_times``), which map to
  the partitions already requested that they overlap.

With several connectors writing one sink asset, the watermark is the smallest of their newest
ones. A sensor, not an AutomationCondition: the watermark lives in materialization metadata,
which Dagster 1.13's conditions do not read, and a cursor gives "exactly once" plainly.
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
    AssetRecordsFilter,
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

from conveyor.dagster.assets.checks import (
    complete_through_check,
    iso,
    late_ranges_of,
    watermark_of,
)
from conveyor.dagster.tags import TAG_CONNECTOR

__all__ = ["complete_through_check", "landed_through", "plan_partitions"]

# Sink materializations read per tick (a connector reports about one a minute).
RECORDS_PER_TICK = 1000
# Tag on the runs this sensor requests: why the partition runs.
TAG_LANDED = "conveyor/landed"


@dataclass
class LandedCursor:
    """What the sensor has seen and done: the last sink materialization read, the newest
    watermark per connector, and the end (Unix seconds) of the last partition requested."""

    after: int | None = None
    marks: dict[str, float] = field(default_factory=dict)
    requested_end: float | None = None

    @staticmethod
    def parse(text: str | None) -> LandedCursor:
        if not text:
            return LandedCursor()
        raw = json.loads(text)
        return LandedCursor(raw.get("after"), dict(raw.get("marks") or {}), raw.get("end"))

    def dump(self) -> str:
        return json.dumps({"after": self.after, "marks": self.marks, "end": self.requested_end})


@dataclass(frozen=True)
class Plan:
    """One tick's decision: partitions to run the first time, partitions to run again."""

    first: tuple[str, ...]
    again: tuple[str, ...]
    requested_end: float | None


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)


def _windows_from(
    partitions_def: TimeWindowPartitionsDefinition, start: float | None
) -> Iterator[tuple[str, TimeWindow]]:
    """Partitions in time order: the first one, or the one that begins at ``start``."""
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


def plan_partitions(
    partitions_def: TimeWindowPartitionsDefinition,
    *,
    watermark: float | None,
    requested_end: float | None,
    late: Sequence[tuple[float, float]],
    lateness_s: float = 0.0,
    limit: int = 100,
) -> Plan:
    """Which partitions to run: those whose end plus ``lateness_s`` the watermark has passed
    since ``requested_end`` (at most ``limit``), and again those already requested (ending at
    or before ``requested_end``) that a late range overlaps."""
    again: list[str] = []
    if requested_end is not None:
        for lo, hi in late:
            for key, window in _windows_from(partitions_def, lo):
                if window.start.timestamp() > hi or window.end.timestamp() > requested_end:
                    break
                if key not in again:
                    again.append(key)
    first: list[str] = []
    end = requested_end
    if watermark is not None:
        for key, window in _windows_from(partitions_def, requested_end):
            if len(first) >= limit or window.end.timestamp() + lateness_s > watermark:
                break
            first.append(key)
            end = window.end.timestamp()
    return Plan(tuple(first), tuple(again), end)


def _read_sink(context: SensorEvaluationContext, key: AssetKey, cursor: LandedCursor) -> list[Any]:
    """Sink materializations after the cursor, oldest first; updates its marks and position."""
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=key, after_storage_id=cursor.after),
        limit=RECORDS_PER_TICK,
        ascending=True,
    ).records
    late: list[tuple[float, float]] = []
    for r in records:
        cursor.after = r.storage_id
        m = r.asset_materialization
        if m is None:
            continue
        connector = (m.tags or {}).get(TAG_CONNECTOR, "")
        wm = watermark_of(m.metadata)
        if wm is not None:
            cursor.marks[connector] = max(wm, cursor.marks.get(connector, wm))
        late.extend(late_ranges_of(m.metadata))
    return late


def landed_through(
    sink_asset_key: AssetKey | str | Sequence[str],
    partitions_def: TimeWindowPartitionsDefinition,
    *,
    target: Any,
    lateness_s: float = 0.0,
    name: str | None = None,
    minimum_interval_seconds: int = 30,
    max_partitions_per_tick: int = 100,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """A sensor that runs ``target``'s partitions of ``partitions_def`` as the connector's
    watermark on ``sink_asset_key`` passes each one's end plus ``lateness_s``, and runs a
    partition again when late data for it landed (see the module docstring)."""
    key = AssetKey.from_coercible(sink_asset_key)
    sensor_name = name or f"landed_through__{'__'.join(key.path)}"

    @sensor(
        name=sensor_name,
        target=target,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"Runs each time partition once {key.to_user_string()} is complete through "
        f"its end (+{lateness_s:g} s), and again when late data for it landed.",
    )
    def landed(context: SensorEvaluationContext) -> SensorResult | SkipReason:
        cursor = LandedCursor.parse(context.cursor)
        late = _read_sink(context, key, cursor)
        watermark = min(cursor.marks.values()) if cursor.marks else None
        plan = plan_partitions(
            partitions_def,
            watermark=watermark,
            requested_end=cursor.requested_end,
            late=late,
            lateness_s=lateness_s,
            limit=max_partitions_per_tick,
        )
        cursor.requested_end = plan.requested_end
        requests = [
            RunRequest(run_key=k, partition_key=k, tags={TAG_LANDED: "watermark"})
            for k in plan.first
        ] + [
            RunRequest(
                run_key=f"{k}@late{cursor.after}", partition_key=k, tags={TAG_LANDED: "late data"}
            )
            for k in plan.again
        ]
        if not requests:
            through = "no watermark yet" if watermark is None else f"watermark {iso(watermark)}"
            return SensorResult(
                skip_reason=SkipReason(f"nothing new: {through}"), cursor=cursor.dump()
            )
        return SensorResult(run_requests=requests, cursor=cursor.dump())

    return landed
