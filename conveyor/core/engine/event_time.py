"""The sink loop's event time (``core.engine.loop``): the event-time rows of the batches it delivered
(held while the sink holds them uncommitted), the reads that found the source caught up, the
watermark they make (``core.engine.watermarks``) and when it is reported (``Progress``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from conveyor.core.engine.batches import all_coords
from conveyor.core.engine.watermarks import Watermark, WatermarkTracker, report_due
from conveyor.core.model import (
    PARTITION_COL,
    TIMESTAMP_COL,
    TOPIC_COL,
    Counters,
    Offsets,
    WatermarkSpec,
)


@dataclass
class Progress:
    counters: Counters
    offsets: Offsets
    final: bool = False
    # The watermark at this report, with the late event times since the previous report.
    watermark: Watermark | None = None
    # A report made because the watermark moved (``report_due``), between progress reports.
    watermark_only: bool = False


class Pacing(Protocol):
    """What paces the reports (the loop's ``LoopConfig``, read at each report)."""

    watermark: WatermarkSpec
    progress_interval_s: float
    watermark_report_min_s: float


class EventTime:
    """The watermark of one loop (``cfg``: its config, read live). ``committed``, ``counters`` and ``held`` read the loop's
    committed offsets, counters (the highwaters of the last fetch) and the offsets a sink holds
    uncommitted."""

    def __init__(
        self,
        cfg: Pacing,
        clock: Callable[[], float],
        *,
        committed: Callable[[], Offsets],
        counters: Callable[[], Counters],
        held: Callable[[], Offsets],
    ):
        self.cfg = cfg
        self.clock = clock
        self.committed, self.counters, self.held = committed, counters, held
        self.tracker = WatermarkTracker(cfg.watermark, clock())
        self._reported_low: float | None = None  # the low watermark of the last report
        self._last_watermark_report = 0.0
        self._last_progress: float | None = None
        # The event-time rows of the batches a sink accepted and has not committed, in order.
        self.rows: list[pa.Table] = []
        # Reads that brought a batch, batches processed, and the latest read that found
        # nothing: (its start, reads with a batch before it). The source was caught up then.
        self._reads = 0
        self._processed = 0
        self._quiet: tuple[float, int] | None = None

    def read(self, started: float, found: bool) -> None:
        """A read that began at ``started`` brought a batch (``found``) or nothing."""
        if found:
            self._reads += 1
        else:
            self._quiet = (started, self._reads)

    def processed(self, delivered: pa.Table | None) -> None:
        """A batch is over; its ``delivered`` rows' event times are kept until committed."""
        self._processed += 1
        if delivered is not None and delivered.num_rows:
            self.rows.append(self.event_rows(delivered))

    def observe(self, rows: list[pa.Table], lags: dict[str, int | None]) -> None:
        """Committed ``rows`` move the watermark (lateness judged with ``lags``)."""
        if rows:
            table = (
                rows[0] if len(rows) == 1 else pa.concat_tables(rows, promote_options="permissive")
            )
            self.tracker.observe(table, self.clock(), lags)

    def event_rows(self, rows: pa.Table) -> pa.Table:
        """What the watermark reads of delivered rows (kept while they are held)."""
        keep = [TOPIC_COL, PARTITION_COL, self.cfg.watermark.column or TIMESTAMP_COL]
        return rows.select(keep) if set(keep) <= set(rows.schema.names) else rows

    def quiet_at(self) -> float | None:
        """When the source was last seen caught up (a read that found nothing began), if
        every batch read before then is committed (none in flight, none held); else None."""
        if self._quiet is None or self.held() or self.rows:
            return None
        at, reads_before = self._quiet
        return at if self._processed >= reads_before else None

    def delivered_rows(self, source: pa.Table, out: pa.Table, cut: int | None = None) -> pa.Table:
        """The rows whose event times a committed batch delivered: the source rows (the record
        timestamp) or the transform's output (``watermark.column``), those before ``cut`` only."""
        if self.cfg.watermark.column is None:
            return source if cut is None else source.slice(0, cut)
        if cut is None or out.num_rows == 0:
            return out
        at = {c: i for i, c in enumerate(all_coords(source))}
        return out.filter(pa.array([at[c] < cut for c in all_coords(out)], pa.bool_()))

    def partition_lags(self) -> dict[str, int | None]:
        """Per partition (``topic[partition]``) the last fetch reported: messages behind its
        high watermark, None when nothing was committed there yet."""
        committed = {str(tp): off for tp, off in self.committed().items()}
        lags: dict[str, int | None] = {
            name: (max(0, hw - committed[name]) if name in committed else None)
            for name, hw in (self.counters().highwaters or {}).items()
        }
        for tp in self.held():  # rows a sink holds uncommitted: not caught up
            lags[str(tp)] = max(lags.get(str(tp)) or 0, 1)
        return lags

    def watermark(self, now: float | None = None) -> Watermark:
        """The watermark now (late ranges included; ``take_late`` once reported)."""
        at = self.clock() if now is None else now
        return self.tracker.current(at, self.partition_lags(), self.quiet_at())

    def progress(self, now: float) -> Progress | None:
        """A progress report every ``progress_interval_s``; between them a watermark report
        when one is due (``report_due``), at most every ``watermark_report_min_s``; else None."""
        last = self._last_progress
        if last is None or now - last >= self.cfg.progress_interval_s:
            self._last_progress = now
            wm = self.reported(self.watermark(now))
            return Progress(self.counters(), dict(self.committed()), watermark=wm)
        if now - self._last_watermark_report < self.cfg.watermark_report_min_s:
            return None
        wm = self.watermark(now)
        if not report_due(self._reported_low, wm):
            return None
        self._last_watermark_report = now
        return Progress(
            self.counters(),
            dict(self.committed()),
            watermark=self.reported(wm),
            watermark_only=True,
        )

    def final(self) -> Progress:
        """The run's last report (the loop closed)."""
        wm = self.reported(self.watermark())
        return Progress(self.counters(), dict(self.committed()), final=True, watermark=wm)

    def reported(self, wm: Watermark) -> Watermark:
        """``wm`` as it goes out: its late ranges are taken (reported once)."""
        self.tracker.take_late()
        self._reported_low = wm.low
        return wm
