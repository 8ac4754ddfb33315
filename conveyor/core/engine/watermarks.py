"""Event-time watermarks: how far a connector's sink is complete, per partition and as a whole.

The rule (Flink's watermarks with idleness; the idle case is Beam's KafkaIO
``CustomTimestampPolicyWithLimitedDelay``):

- per (topic, partition), the **high mark** is the greatest event time delivered and
  committed: the record timestamp ``__timestamp``, or the transform output column named by
  ``watermark.column``. It only moves forward, and only once a batch is committed (for a sink
  that acknowledges at its own commit, a lakehouse table: once that commit is made);
- a partition is **idle** when it is caught up (no lag; when its lag is unknown, this part is
  not asked) and has delivered nothing for ``watermark.idle_after_s``. An idle partition does
  not hold the watermark back; it is active again as soon as it delivers;
- ``watermark.allowed_lateness_s`` is the one lateness: how long after its event time an
  event may arrive and still count as on time. The watermark always stays that far behind
  what is known;
- the connector's **low watermark** is the smallest high mark of the active partitions, minus
  the lateness. An active partition that has delivered nothing yet (a backlog not reached, a
  new partition) holds it where it is;
- **idle means complete**: when every partition is idle, everything the log held when the
  source was last seen caught up (``quiet_at``: the start of the latest read that found
  nothing) has been delivered, so the low watermark is that moment (or the greatest high mark,
  if later) minus the lateness: an event still to come arrives after it, and if its time is
  further behind than the lateness it is late by definition. Without a quiet read it is the
  greatest high mark minus the lateness. So a stream that stops completes its last minute;
- the low watermark never goes back within a run (a partition turning active again with older
  events makes those events late, it does not undo what was reported);
- **lag in time** is ``now - low watermark``;
- an event is **late** when its time is below the low watermark as it stood before its batch
  was committed. While the watermark is unknown (a new run rebuilds it from the batches it
  commits), every committed event time counts as possibly late: a reader that acted on an
  earlier run's watermark decides what that means (``conveyor.dagster.landed`` re-runs only
  partitions it already ran). Late event times are kept as ranges, per partition and batch,
  until reported.

A report is worth making (:func:`report_due`) when late ranges wait, or when the low
watermark became known or crossed a whole minute (every Dagster time partition ends on one):
the loop reports then, at most once a second, besides its periodic progress.

Times are Unix seconds (floats). Computed per committed batch with Arrow (grouped by
partition), never per row. Pure: the caller passes ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from conveyor.core.errors import ConfigError
from conveyor.core.model import (
    PARTITION_COL,
    TIMESTAMP_COL,
    TOPIC_COL,
    TopicPartition,
    WatermarkSpec,
)

# Late ranges kept between two reports; beyond it the closest ones are merged.
MAX_LATE_RANGES = 64
# Every Dagster time partition ends on a whole minute: a report when the watermark crosses one.
REPORT_GRID_S = 60.0


@dataclass(frozen=True)
class Watermark:
    """The watermark at one moment: the low mark, the high mark per partition, which partitions
    were idle, the lag in time, and the late event-time ranges since the last report."""

    low: float | None
    by_partition: dict[str, float]
    idle: tuple[str, ...] = ()
    lag_seconds: float | None = None
    late: tuple[tuple[float, float], ...] = ()


@dataclass
class _Partition:
    high: float | None = None
    last_delivered: float = 0.0


@dataclass
class WatermarkTracker:
    """The high marks of one run, fed with each committed batch (see the module's rule).
    ``floor``: the greatest low watermark computed so far (it never goes back)."""

    rule: WatermarkSpec
    started: float
    partitions: dict[str, _Partition] = field(default_factory=dict)
    late: list[tuple[float, float]] = field(default_factory=list)
    floor: float | None = None

    def observe(
        self,
        rows: pa.Table,
        now: float,
        lags: Mapping[str, int | None],
        quiet_at: float | None = None,
    ) -> None:
        """A committed batch's delivered rows (with ``__topic``, ``__partition`` and the event
        time column): move the high marks, record late ranges. ``lags``: per partition
        (``topic[partition]``), messages behind its high watermark, None when unknown;
        ``quiet_at``: when the source last found nothing to read (None: not yet)."""
        if rows.num_rows == 0:
            return
        before = self.current(now, lags, quiet_at).low
        times = event_seconds(rows, self.rule.column)
        keyed = pa.table(
            {
                "t": rows.column(TOPIC_COL),
                "p": rows.column(PARTITION_COL),
                "s": times,
                "late": _below(times, before),
            }
        )
        highs = keyed.group_by(["t", "p"]).aggregate([("s", "max")])
        for t, p, high in zip(
            *(highs.column(c).to_pylist() for c in ("t", "p", "s_max")), strict=True
        ):
            mark = self.partitions.setdefault(str(TopicPartition(t, p)), _Partition())
            mark.last_delivered = now
            if high is not None and (mark.high is None or high > mark.high):
                mark.high = high
        late = keyed.filter(keyed.column("late"))
        if late.num_rows:
            spans = late.group_by(["t", "p"]).aggregate([("s", "min"), ("s", "max")])
            self.late.extend(
                zip(
                    spans.column("s_min").to_pylist(),
                    spans.column("s_max").to_pylist(),
                    strict=True,
                )
            )
            self.late = merge_ranges(self.late, MAX_LATE_RANGES)

    def current(
        self, now: float, lags: Mapping[str, int | None], quiet_at: float | None = None
    ) -> Watermark:
        """The watermark now; ``lags`` also names partitions that delivered nothing yet;
        ``quiet_at`` as for :meth:`observe`."""
        for name in lags:
            self.partitions.setdefault(name, _Partition(last_delivered=self.started))
        idle = tuple(
            sorted(
                name
                for name, mark in self.partitions.items()
                if now - mark.last_delivered >= self.rule.idle_after_s and not lags.get(name)
            )
        )
        highs = {n: m.high for n, m in self.partitions.items() if m.high is not None}
        low = low_watermark(self.partitions, idle, self.rule.allowed_lateness_s, quiet_at)
        if low is None or (self.floor is not None and low < self.floor):
            low = self.floor
        self.floor = low
        return Watermark(
            low=low,
            by_partition=dict(sorted(highs.items())),
            idle=idle,
            lag_seconds=None if low is None else max(0.0, now - low),
            late=tuple(self.late),
        )

    def take_late(self) -> tuple[tuple[float, float], ...]:
        """The late ranges since the last call (they are reported once)."""
        out, self.late = tuple(self.late), []
        return out


def low_watermark(
    partitions: Mapping[str, _Partition],
    idle: tuple[str, ...],
    allowed_lateness_s: float,
    quiet_at: float | None = None,
) -> float | None:
    """The rule's low watermark over ``partitions`` before the floor (module docstring)."""
    if not partitions:
        return None
    active = [m.high for n, m in partitions.items() if n not in idle]
    if active:
        if any(h is None for h in active):
            return None
        return min(h for h in active if h is not None) - allowed_lateness_s
    # Idle means complete: through the moment the source was last seen caught up.
    known = [m.high for m in partitions.values() if m.high is not None]
    if quiet_at is not None:
        known.append(quiet_at)
    return max(known) - allowed_lateness_s if known else None


def report_due(reported: float | None, wm: Watermark) -> bool:
    """Whether ``wm`` is worth a report now, the last report having said ``reported`` (the low
    watermark then): late ranges wait, or the low watermark became known or crossed a whole
    minute (``REPORT_GRID_S``), where a time partition may end."""
    if wm.late:
        return True
    if wm.low is None:
        return False
    if reported is None:
        return True
    return math.floor(wm.low / REPORT_GRID_S) > math.floor(reported / REPORT_GRID_S)


def event_seconds(rows: pa.Table, column: str | None) -> pa.Array:
    """The event time of each row as Unix seconds (float64; null where the time is null)."""
    name = column or TIMESTAMP_COL
    where = "watermark.column" if column else "the record timestamp"
    if name not in rows.schema.names:
        raise ConfigError(
            f"watermark.column: the transform's output has no column {name!r} "
            f"(it has {', '.join(n for n in rows.schema.names if not n.startswith('__'))})"
        )
    col = rows.column(name).combine_chunks()
    if pa.types.is_date(col.type):
        col = pc.cast(col, pa.timestamp("s"))
    if not pa.types.is_timestamp(col.type):
        raise ConfigError(
            f"{where}: column {name!r} is {col.type}, not a timestamp: cast it in transform.select "
            "(for example `CAST(ts AS TIMESTAMP) AS ts`)"
        )
    micros = pc.cast(pc.cast(col, pa.timestamp("us", tz=col.type.tz)), pa.int64())
    return pc.divide(pc.cast(micros, pa.float64()), 1_000_000.0)


def _below(times: pa.Array, low: float | None) -> pa.Array:
    """Which times are late against ``low`` (all of them while it is unknown)."""
    if low is None:
        return pc.is_valid(times)
    return pc.fill_null(pc.less(times, low), False)


def merge_ranges(
    ranges: list[tuple[float, float]], limit: int = MAX_LATE_RANGES
) -> list[tuple[float, float]]:
    """Overlapping ranges as one; beyond ``limit``, the two closest ones merged until it fits."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    while len(out) > limit:
        i = min(range(len(out) - 1), key=lambda j: out[j + 1][0] - out[j][1])
        out[i : i + 2] = [(out[i][0], max(out[i][1], out[i + 1][1]))]
    return out
