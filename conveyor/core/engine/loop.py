"""The connector loop: read -> transform -> send -> commit, at least once.

Order inside one batch, always: transform, send, failed messages follow the
failure policy (dead letters flushed), then offsets committed, then heartbeat.
Nothing is committed before the sink acknowledged. Batches flow through a
three-stage pipeline: while batch N is in the sink, N+1 (up to N+depth,
``LoopConfig.transform_depth``) is transformed (Spark) and the next is read, each
stage on its own threads. Sending, committing and every error decision stay on the
loop's thread, in source order.

Control (``Directive``, the answer to each heartbeat): a *pause* takes effect at the
next batch boundary: the loop and its read-ahead stop reading (batches already read
ahead wait), the run keeps its assignment and heartbeats every
``LoopConfig.paused_poll_s``, and a resume goes on from there. A *reconfigure* (the
spec changed) ends ``run()`` at the next batch boundary the way a stop does, with
``reconfigure_requested`` set: the caller builds a new loop from the new spec and the
committed offsets, in the same run.

Interrupts (Dagster raises ``DagsterExecutionInterruptedError``, a
``BaseException``, in the op's thread) may land anywhere. The shutdown path
commits only what was acknowledged, cleans up the sink, and re-raises. It is
safe to trigger twice. No signal handlers are installed here.

All collaborators are injected; the loop performs no I/O of its own, so the
whole module is tested with in-memory fakes and a fake clock.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import pyarrow as pa

from conveyor.core.engine.batches import (
    DeadLetter,
    DeadLetterWriter,
    Rejected,
    SourceBatch,
    Transformed,
    coords,
    offsets_before,
)
from conveyor.core.engine.delivery import Delivery
from conveyor.core.engine.destination_screen import DestinationScreen
from conveyor.core.engine.event_time import EventTime, Progress
from conveyor.core.engine.failure import FailedMessage, OutageTracker
from conveyor.core.engine.liveness import Stage, stage_of
from conveyor.core.engine.read_ahead import Ahead, Reader, Source, Transformer
from conveyor.core.engine.routing import DestinationRulesSpec
from conveyor.core.engine.stopping import Directive, LoopControl, Stopping
from conveyor.core.engine.throughput import Throughput
from conveyor.core.errors import (
    OUTAGES,
    ConveyorError,
    DataPolicyError,
    FencedError,
)
from conveyor.core.model import (
    OFFSET_COL,
    PARTITION_COL,
    TOPIC_COL,
    BatchPolicy,
    ConnectorStatus,
    Counters,
    FailurePolicyName,
    FailureSpec,
    Offsets,
    RetrySpec,
    TopicPartition,
    WatermarkSpec,
)
from conveyor.core.positions import PositionNote, given_up_counts
from conveyor.core.sink import (
    AcknowledgesAtCommit,
    SinkProtocol,
)

log = logging.getLogger("conveyor.loop")

# Names other modules import from here (defined in ``core.engine.batches``).
__all__ = [
    "ConnectorLoop",
    "DataPolicyError",
    "DeadLetter",
    "DeadLetterWriter",
    "LoopConfig",
    "Progress",
    "Rejected",
    "SourceBatch",
    "Source",
    "Transformed",
    "Transformer",
    "next_offsets_of",
    "offsets_before",
    "run_loop",
]


class Committer(Protocol):
    """The run's fenced writes to the meta store."""

    def commit(self, offsets: Offsets) -> None:
        """Persist offsets for this generation; raises FencedError when superseded."""

    def heartbeat(
        self, counters: Counters, status: ConnectorStatus, reason: str | None
    ) -> Directive | bool | None:
        """Liveness + counters; returns what to do next (False: stop; True/None: run).

        Raises FencedError when superseded. May be called from another thread than the
        loop's: the loop only sets events from its answer.
        """

    # Optional: ``ensure_current()``, raising FencedError when this run's generation is no
    # longer current; called before each batch is sent, so that a fenced run sends at most
    # the batch it was sending when it was fenced. TransientStoreError from any of these
    # methods is an outage of the meta store (retried, Degraded).


@dataclass
class LoopConfig:
    name: str
    batch: BatchPolicy = field(default_factory=BatchPolicy)
    retry: RetrySpec = field(default_factory=RetrySpec)
    failure: FailureSpec = field(default_factory=FailureSpec)
    heartbeat_interval_s: float = 1.0
    progress_interval_s: float = 60.0
    prefetch: bool = True  # read the next batch on a thread
    # With prefetch: also transform the next batch on a thread, while this one is sent.
    transform_ahead: bool = True
    # With transform_ahead: how many batches may be in the transform (Spark) at once.
    transform_depth: int = 1
    # While paused: how often to heartbeat (and so how soon a resume is seen).
    paused_poll_s: float = 0.25
    # Admission, cap and breakers for rows that choose their destination (__destination).
    destinations: DestinationRulesSpec | None = None
    # The event-time watermark's rule (core/engine/watermarks.py), reported with each progress.
    watermark: WatermarkSpec = field(default_factory=WatermarkSpec)
    # Between progress reports, a watermark report when it is due (``report_due``), at most
    # this often.
    watermark_report_min_s: float = 1.0


class ConnectorLoop(LoopControl):
    """Runs one connector until ``stop_requested()`` or an error. Call ``run()`` once."""

    def __init__(
        self,
        config: LoopConfig,
        *,
        source: Source,
        transform: Transformer,
        sink: SinkProtocol,
        committer: Committer,
        committed: Offsets,
        dead_letters: DeadLetterWriter | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
        on_progress: Callable[[Progress], None] | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
        counters: Counters | None = None,
        start_positions: Callable[[], tuple[Offsets, list[PositionNote]]] | None = None,
        on_positions: Callable[[list[PositionNote]], None] | None = None,
    ):
        """``start_positions``: where the run starts (``committed`` judged against the logs as
        they are, merged with what a target that keeps offsets holds: ``core/positions.py``),
        and the positions not taken as stored; read before the sink is initialised, under the
        outage retries (an unreachable broker or target is Degraded, then Error).
        ``on_positions``: told every position not taken as stored (at start, and those the
        source finds out of range while reading); the loop counts their messages given up."""
        self.cfg = config
        self._start_positions = start_positions
        self.on_positions = on_positions
        self.source = source
        self.transform = transform
        self.sink = sink
        self.committer = committer
        self.dead_letters = dead_letters
        self.on_progress = on_progress
        self.clock = clock
        self._init_control(config.name, stop_requested, sleep, counters, config.paused_poll_s)
        self.committed: Offsets = dict(committed)
        # A sink that acknowledges at its own commit (None: at each send_batch).
        self._buffering = sink if isinstance(sink, AcknowledgesAtCommit) else None
        self._acked: Offsets | None = None  # acknowledged by the sink, not yet committed
        self._outage = OutageTracker(config.retry, rng or random.Random())
        self.delivery = Delivery(
            config.name, config.failure, sink, dead_letters,
            retry=self._with_outage_retry, count=self._count, clock=self.clock,
        )  # fmt: skip
        self.destinations = DestinationScreen(config.destinations, self.clock)
        self._last_heartbeat = 0.0
        self.throughput = Throughput()
        # A sink that acknowledges at its own commit (AcknowledgesAtCommit): the offsets of
        # the batches it accepted and has not committed yet (their rows: ``event_time.rows``).
        self._held: Offsets = {}
        self.event_time = EventTime(
            config, self.clock,
            committed=lambda: self.committed, counters=lambda: self.counters,
            held=lambda: self._held,
        )  # fmt: skip
        self.reading = Reader(
            config, lambda: self.source, transform, paused=self._pause_event, stages=self.stages,
            noted=self.event_time.read, retry=self._with_outage_retry, clock=self.clock,
        )  # fmt: skip
        self._closed = False
        if config.failure.policy == FailurePolicyName.DEAD_LETTER and dead_letters is None:
            raise ConveyorError("failure policy dead_letter needs a dead-letter store")

    # -- public ---------------------------------------------------------------

    def run(self) -> Counters:
        """Run until stopped. Returns the final counters; raises on a connector error."""
        try:
            with self.stages.stage(Stage.INIT):
                self.sink.validate()
            prepare = getattr(self.transform, "prepare", None)
            if prepare is not None:
                self._with_outage_retry("prepare transform", prepare)
            notes: list[PositionNote] = []
            if self._start_positions is not None:
                committed, notes = self._with_outage_retry("init sink", self._start_positions)
                self.committed = dict(committed)
            self._with_outage_retry("init sink", self.sink.init_sink)
            open_source = getattr(self.source, "open", None)
            if open_source is not None:
                self._with_outage_retry("open source", lambda: open_source(dict(self.committed)))
            self._note_positions(notes, commit=True)
            self._heartbeat(force=True)
            self.reading.start()
            while not self._should_stop():
                if self._pause_event.is_set():
                    self._paused()
                    continue
                item = self.reading.next()
                self._note_positions(self._source_notes())
                if item is None:
                    # The source is quiet: a sink's buffer whose time has come is committed.
                    self._commit_held(due_only=True)
                    self._heartbeat()
                    continue
                self._process(item)
            if self._fenced is not None:
                raise self._fenced
            self._commit_held(due_only=False)  # a clean stop: what the sink holds goes in
            return self.counters
        except FencedError:
            self._acked = None  # never commit after losing the assignment
            self._drop_held()
            raise
        except BaseException:
            self._commit_held_once()
            self._commit_acknowledged(retry=False)
            raise
        finally:
            self._stop_event.set()
            self.reading.stop()
            self._close()

    def _source_notes(self) -> list[PositionNote]:
        take = getattr(self.source, "take_position_notes", None)
        return take() if take is not None else []

    def _note_positions(self, notes: list[PositionNote], *, commit: bool = False) -> None:
        """Positions not taken as stored: their given-up messages counted, the run told
        (``on_positions``); at start (``commit``) a resumed position is committed at once, so a
        restart before the partition's next batch does not find it outside the log again."""
        if not notes:
            return
        self.counters = replace(
            self.counters, given_up=given_up_counts(notes, self.counters.given_up)
        )
        resumed = {n.tp: n.resumed_at for n in notes if n.resumed_at is not None}
        if commit and resumed:
            self._with_outage_retry("commit", lambda: self.committer.commit(resumed))
            self.committed.update(resumed)
        if self.on_positions is not None:
            self.on_positions(notes)

    def _ensure_current(self) -> None:
        """Before a batch is sent: stop if this run's generation is no longer current."""
        if self._fenced is not None:
            raise self._fenced
        check = getattr(self.committer, "ensure_current", None)
        if check is not None:
            self._with_outage_retry("check generation", check)

    # -- one batch --------------------------------------------------------------

    def _process(self, item: Ahead) -> None:
        started = self.clock()
        sb = item.batch
        n_in = sb.table.num_rows
        if n_in == 0:
            # Positions moved without records (over transaction markers): nothing to send,
            # the offsets are committed so that the partition shows no lag.
            self._acked = sb.next_offsets
            self._settle(None)
            self._heartbeat()
            return
        tr = item.transformed
        if tr is None:
            tr = self._with_outage_retry(
                "transform", lambda: self.transform(sb.table), failed_first=item.outage
            )
        tr = self.destinations.screen(sb.table, tr)
        failures = [
            FailedMessage(*coords(sb.table, r.index), error=r.message, error_class=r.error_class)
            for r in tr.rejected
        ]
        self._ensure_current()
        if self.cfg.failure.policy == FailurePolicyName.FAIL:
            self._process_fail_fast(sb, tr, failures, started)
            return
        sent, data_failed = self.delivery.deliver(tr.table)
        self.destinations.record(tr.table, data_failed)
        failures.extend(data_failed)
        discarded, dead = self.delivery.apply_policy(sb.table, failures)
        # Dead letters are flushed, the sink acknowledged: only now may offsets move.
        self._acked = sb.next_offsets
        self._batch_done(
            started,
            delivered=self.event_time.delivered_rows(sb.table, tr.table),
            messages_in=n_in,
            messages_out=sent,
            filtered=tr.filtered,
            failed=len(failures),
            discarded=discarded,
            dead_lettered=dead,
        )
        if self.status == ConnectorStatus.DEGRADED:
            self._set_status(ConnectorStatus.RUNNING, "recovered: batch delivered")
        self._heartbeat()

    def _process_fail_fast(
        self, sb: SourceBatch, tr: Transformed, decode_failed: list[FailedMessage], started: float
    ) -> None:
        """The ``fail`` policy: deliver and commit the rows before the first failed message,
        send nothing after it, then stop with its coordinates."""
        ff = self.delivery.before_first_failure(sb, tr, decode_failed, self.destinations.record)
        self._acked = ff.acked
        self._batch_done(
            started,
            delivered=self.event_time.delivered_rows(sb.table, ff.table, ff.cut),
            messages_in=ff.done,
            messages_out=ff.sent_before,
            filtered=tr.filtered if ff.first is None else 0,
            failed=1 if ff.first is not None else 0,
        )
        if ff.first is not None:
            self._heartbeat(force=True)
            raise ff.error()
        if self.status == ConnectorStatus.DEGRADED:
            self._set_status(ConnectorStatus.RUNNING, "recovered: batch delivered")
        self._heartbeat()

    def _batch_done(
        self, started: float, *, messages_out: int, delivered: pa.Table, **counts: int
    ) -> None:
        """A batch is over and ``_acked`` holds what it acknowledged: commit it and move the
        watermark with the ``delivered`` rows' event times (``_settle``); the outage (if any)
        is over; the batch's latency and rate are recorded and its counts added."""
        self._settle(delivered)
        self._outage.recovered()
        now = self.clock()
        self.throughput.batch(now, now - started, messages_out)
        self._count(messages_out=messages_out, batches=1, **counts)

    # -- batches a sink holds until its own commit (AcknowledgesAtCommit) -------------------

    def _settle(self, delivered: pa.Table | None) -> None:
        """A batch is over and ``_acked`` holds its offsets: they are committed, and the
        watermark moves with its ``delivered`` rows, together with the batches held before
        it; unless the sink still holds rows it has not committed: then this batch is held
        too, until the sink's commit (the contract in ``core/sink.py``)."""
        self.event_time.processed(delivered)
        if self._acked is not None:
            self._held.update(self._acked)
            self._acked = None
        if not self._sink_uncommitted():
            self._release_held()

    def _release_held(self, retry: bool = True) -> None:
        """The sink has nothing uncommitted: commit the held offsets, move the watermark
        (judging lateness by the watermark as it stood with these rows still held)."""
        lags = self.event_time.partition_lags()
        if self._held:
            self._acked, self._held = self._held, {}
        rows, self.event_time.rows = self.event_time.rows, []
        self._commit_acknowledged(retry=retry)
        self.event_time.observe(rows, lags)

    def _commit_held(self, *, due_only: bool) -> None:
        """Commit what the sink holds (``due_only``: once its interval or size is reached),
        with outage retries, then acknowledge the batches held for it."""
        if not self._held and not self.event_time.rows:
            return
        if self._buffering is not None and self._buffering.uncommitted_rows():
            if due_only and not self._buffering.commit_due():
                return
            self._with_outage_retry("commit held", self._buffering.commit_held)
        if not self._sink_uncommitted():
            self._release_held()

    def _commit_held_once(self) -> None:
        """On the way out after an error or an interrupt (not a fence): the sink's buffer
        committed once, no retry, then what was held and acknowledged is committed. A buffer
        that cannot be committed is dropped: its offsets never moved, it is read again."""
        if self._acked is not None:
            self._held.update(self._acked)
            self._acked = None
        try:
            if self._buffering is not None and self._buffering.uncommitted_rows():
                with self.stages.stage(Stage.SEND):
                    self._buffering.commit_held()
        except Exception as e:  # noqa: BLE001 - the error that ends the loop is the one raised
            log.warning(
                "%s: the sink's buffer was not committed on the way out: %s", self.cfg.name, e
            )
            self._drop_held()
            return
        self._release_held(retry=False)

    def _drop_held(self) -> None:
        self._held, self.event_time.rows = {}, []

    def _sink_uncommitted(self) -> int:
        """Rows the sink accepted and has not committed (0 for a sink that acknowledges each
        ``send_batch``)."""
        return self._buffering.uncommitted_rows() if self._buffering is not None else 0

    # -- outages ------------------------------------------------------------------

    def _with_outage_retry(
        self, what: str, fn: Callable[[], Any], *, failed_first: Exception | None = None
    ) -> Any:
        """``fn()`` until it succeeds, retrying outages. ``failed_first``: an outage ``fn``
        already ran into elsewhere (a transform ahead), counted as the first attempt. A
        success after an outage ends the Degraded state it set: an idle connector whose
        start ran into one delivers no batch that would (two sinks creating one offsets
        table at once: PostgreSQL's unique violation on ``pg_type``, retried)."""
        pending = failed_first
        failed = False
        while True:
            try:
                if pending is not None:
                    error, pending = pending, None
                    raise error
                with self.stages.stage(stage_of(what)):
                    result = fn()
                if failed and self.status == ConnectorStatus.DEGRADED:
                    self._set_status(ConnectorStatus.RUNNING, f"recovered: {what} succeeded")
                    self._heartbeat(force=True)
                return result
            except OUTAGES as e:
                failed = True
                self._outage_wait(what, e)

    # -- commits, heartbeats, progress -----------------------------------------------

    def _commit_acknowledged(self, retry: bool = True) -> None:
        """Commit what the sink acknowledged; a meta-store outage is retried unless shutting down."""
        if self._acked is None:
            return
        offsets = self._acked
        try:
            if retry:
                self._with_outage_retry("commit", lambda: self.committer.commit(offsets))
            else:
                with self.stages.stage(Stage.COMMIT):
                    self.committer.commit(offsets)
        except FencedError:
            self._acked = None
            raise
        except Exception:
            self._count(commit_failures=1)
            raise
        self._acked = None
        self.committed.update(offsets)

    def _heartbeat(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._last_heartbeat < self.cfg.heartbeat_interval_s:
            return
        self._last_heartbeat = now
        self.counters = replace(
            self.counters,
            lag=self.source.lag(self.committed),
            highwaters=_highwaters(self.source),
            schema_registry=_transform_metrics(self.transform),
            msgs_per_s=self.throughput.rate(now),
            batch_latency_p50_ms=self.throughput.latency_ms(0.5),
            batch_latency_p99_ms=self.throughput.latency_ms(0.99),
        )
        self._beat_now(force)
        if self.on_progress:
            report = self.event_time.progress(now)
            if report is not None:
                self.on_progress(report)

    def _send_heartbeat(
        self, status: ConnectorStatus, reason: str | None
    ) -> Directive | bool | None:
        return self.committer.heartbeat(self.counters, status, reason)

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self.sink.cleanup_sink()
            finally:
                self.source.close()
        finally:
            # The run's last word in the UI, even when closing a client failed.
            if self.on_progress:
                try:
                    self.on_progress(self.event_time.final())
                except Exception:  # noqa: BLE001 - never hides the error that ended the loop
                    log.warning(
                        "%s: could not report the final progress", self.cfg.name, exc_info=True
                    )


def run_loop(loop: LoopControl) -> Counters:
    """Run a loop (sink or source) and treat a stop during an outage wait as a clean stop."""
    try:
        return loop.run()
    except Stopping:
        return loop.counters


def _transform_metrics(transform: Transformer) -> dict[str, int] | None:
    """The transform's schema registry lookups (its optional ``registry_metrics()``)."""
    get = getattr(transform, "registry_metrics", None)
    return None if get is None else get()


def _highwaters(source: Source) -> dict[str, int] | None:
    get = getattr(source, "highwaters", None)
    if get is None:
        return None
    hw = get()
    return {str(tp): int(v) for tp, v in sorted(hw.items(), key=lambda kv: str(kv[0]))} or None


def next_offsets_of(table: pa.Table) -> Offsets:
    """Per partition in ``table``: its last offset + 1, what a commit after this table stores
    (grouped by Arrow, not per record)."""
    if table.num_rows == 0:
        return {}
    g = table.group_by([TOPIC_COL, PARTITION_COL]).aggregate([(OFFSET_COL, "max")])
    return {
        TopicPartition(t, p): o + 1
        for t, p, o in zip(
            g.column(TOPIC_COL).to_pylist(),
            g.column(PARTITION_COL).to_pylist(),
            g.column(f"{OFFSET_COL}_max").to_pylist(),
            strict=True,
        )
    }
