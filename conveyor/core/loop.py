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
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import pyarrow as pa

from conveyor.core.batches import (
    DeadLetter,
    DeadLetterWriter,
    Rejected,
    SourceBatch,
    Transformed,
    coords,
    offsets_before,
)
from conveyor.core.delivery import Delivery
from conveyor.core.destination_screen import DestinationScreen
from conveyor.core.errors import (
    OUTAGES,
    ConveyorError,
    DataPolicyError,
    FencedError,
)
from conveyor.core.event_time import EventTime, Progress
from conveyor.core.failure import FailedMessage, OutageTracker
from conveyor.core.liveness import Stage, StageClock, stage_of
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
from conveyor.core.routing import DestinationRulesSpec
from conveyor.core.sink import (
    AcknowledgesAtCommit,
    SinkProtocol,
)
from conveyor.core.stopping import Directive, LoopControl, Stopping

log = logging.getLogger("conveyor.loop")

# Names other modules import from here (defined in ``core.batches``).
__all__ = [
    "ConnectorLoop",
    "DataPolicyError",
    "DeadLetter",
    "DeadLetterWriter",
    "LoopConfig",
    "Progress",
    "Rejected",
    "SourceBatch",
    "Transformed",
    "next_offsets_of",
    "offsets_before",
    "run_loop",
]


class Source(Protocol):
    """Reads the log from the committed offsets. Used from one thread at a time."""

    def read(self, policy: BatchPolicy) -> SourceBatch | None:
        """Block up to ``policy.max_wait_ms`` (long poll); None when nothing arrived.

        A batch without rows only moves offsets (past transaction markers): the loop
        commits it without transforming or sending anything. TransientSourceError is an
        outage (retried); PermanentSourceError stops the connector.

        A source may also define ``open(committed: Offsets)``, called once (with outage
        retries) before the first read, to assign partitions and seek.
        """

    def lag(self, committed: Offsets) -> int | None:
        """Messages behind the log's high watermark, from the last fetch's metadata."""

    # Optional: ``highwaters() -> Offsets``, the high watermark per partition (per-partition lag).

    def close(self) -> None: ...


class Transformer(Protocol):
    def __call__(self, batch: pa.Table) -> Transformed:
        """Decode, filter and project a source batch (Spark). Raises TransientSinkError on outage.

        A transformer may also define ``prepare()``, called once before the first batch,
        to check its expressions (raising ConfigError), and ``registry_metrics()``, its schema
        registry lookups as counters (reported with the heartbeat; None without a registry). It is called from one thread at a
        time, but not always the same one (see ``LoopConfig.transform_ahead``).
        """


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
    # The event-time watermark's rule (core/watermarks.py), reported with each progress.
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
        self._latencies: deque[float] = deque(maxlen=256)
        self._rate_window: deque[tuple[float, int]] = deque(maxlen=64)
        # A sink that acknowledges at its own commit (AcknowledgesAtCommit): the offsets of
        # the batches it accepted and has not committed yet (their rows: ``event_time.rows``).
        self._held: Offsets = {}
        self.event_time = EventTime(
            config, self.clock,
            committed=lambda: self.committed, counters=lambda: self.counters,
            held=lambda: self._held,
        )  # fmt: skip
        self._closed = False
        if config.failure.policy == FailurePolicyName.DEAD_LETTER and dead_letters is None:
            raise ConveyorError("failure policy dead_letter needs a dead-letter store")

    # -- public ---------------------------------------------------------------

    def run(self) -> Counters:
        """Run until stopped. Returns the final counters; raises on a connector error."""
        reader: _Prefetcher | None = None
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
            reader = self._reader()
            while not self._should_stop():
                if self._pause_event.is_set():
                    self._paused()
                    continue
                item, reader = self._next_item(reader)
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
            if reader:
                reader.stop()
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

    def _next_item(self, reader: _Prefetcher | None) -> tuple[_Ahead | None, _Prefetcher | None]:
        """The next batch (None: nothing came), and the read-ahead to go on with."""
        try:
            return (reader.next() if reader else _Ahead.of(self._read())), reader
        except OUTAGES as e:
            # A read failed (on the read-ahead thread, which then ended): read again here
            # under the retry policy, then read ahead again.
            if reader:
                reader.stop()
            item = _Ahead.of(
                self._with_outage_retry("read", lambda: self._noted_read(), failed_first=e)
            )
            return item, self._reader()

    def _reader(self) -> _Prefetcher | None:
        if not self.cfg.prefetch:
            return None
        ahead = self.transform if self.cfg.transform_ahead else None
        return _Prefetcher(
            self.source,
            self.cfg.batch,
            ahead,
            self._pause_event,
            self.stages,
            depth=self.cfg.transform_depth,
            read=self._noted_read,
        )

    def _read(self) -> SourceBatch | None:
        with self.stages.stage(Stage.READ):
            return self._noted_read()

    def _noted_read(self) -> SourceBatch | None:
        """One read of the source (on whichever thread reads), noting whether it found
        nothing: the source was caught up when such a read began (``EventTime.quiet_at``)."""
        started = self.clock()
        batch = self.source.read(self.cfg.batch)
        self.event_time.read(started, found=batch is not None)
        return batch

    def _ensure_current(self) -> None:
        """Before a batch is sent: stop if this run's generation is no longer current."""
        if self._fenced is not None:
            raise self._fenced
        check = getattr(self.committer, "ensure_current", None)
        if check is not None:
            self._with_outage_retry("check generation", check)

    # -- one batch --------------------------------------------------------------

    def _process(self, item: _Ahead) -> None:
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
        self._latencies.append(now - started)
        self._rate_window.append((now, messages_out))
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
        already ran into elsewhere (a transform ahead), counted as the first attempt."""
        pending = failed_first
        while True:
            try:
                if pending is not None:
                    error, pending = pending, None
                    raise error
                with self.stages.stage(stage_of(what)):
                    return fn()
            except OUTAGES as e:
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
            msgs_per_s=self._rate(now),
            batch_latency_p50_ms=_pct(self._latencies, 0.5),
            batch_latency_p99_ms=_pct(self._latencies, 0.99),
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

    def _rate(self, now: float) -> float:
        window = [(t, n) for t, n in self._rate_window if now - t <= 60]
        if not window:
            return 0.0
        span = max(now - window[0][0], 1e-3)
        return sum(n for _, n in window) / span if len(window) > 1 else 0.0

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
                    self.on_progress(
                        Progress(
                            self.counters,
                            dict(self.committed),
                            final=True,
                            watermark=self.event_time.reported(self.event_time.watermark()),
                        )
                    )
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


@dataclass(frozen=True)
class _Ahead:
    """A batch handed to the loop's thread, transformed ahead when that succeeded."""

    batch: SourceBatch
    transformed: Transformed | None = None  # None: the loop's thread transforms it
    outage: Exception | None = None  # the transform ahead hit an outage: the first attempt

    @staticmethod
    def of(batch: SourceBatch | None) -> _Ahead | None:
        return None if batch is None else _Ahead(batch)


class _Prefetcher:
    """Reads ahead on one thread and, given a transform, transforms ahead on others.

    Up to ``depth`` batches are in the transform at once (each on its own worker thread;
    Spark runs their queries side by side), and the loop's thread takes them in the
    order they were read, whatever order their transforms end in: sends and commits stay
    in source order. Besides those, one batch waits in the reader and up to ``depth``
    transformed ones wait for the loop's thread. Reading errors are handed to the loop's
    thread (and end the reading). A transform that fails ahead is not reported from
    here: the batch goes on untransformed, in its place, and the loop's thread runs the
    transform again under its retry policy, where every error is handled as usual (an
    error there ends the run after the batches before it, and nothing past it, were
    committed). An outage met ahead counts there as the first failed attempt, so that
    detecting one does not take twice as long.
    """

    def __init__(
        self,
        source: Source,
        policy: BatchPolicy,
        transform: Callable[[pa.Table], Transformed] | None = None,
        paused: threading.Event | None = None,
        stages: StageClock | None = None,
        depth: int = 1,
        read: Callable[[], SourceBatch | None] | None = None,
    ):
        self._stages = stages or StageClock(time.monotonic)
        self._source = source
        self._policy = policy
        # One read (the loop's, which notes quiet reads); default the source's own.
        self._read_once = read or (lambda: source.read(policy))
        self._transform = transform
        self._paused = paused or threading.Event()  # set: no new read starts
        self._stop = threading.Event()
        self._depth = max(1, depth)
        # In source order: ("batch", _Ahead | Future[_Ahead]) or ("error", exception).
        self._out: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=self._depth)
        self._head: Future[_Ahead] | None = None  # taken from _out, its transform not ended
        self._threads = [threading.Thread(target=self._read, name="conveyor-prefetch", daemon=True)]
        self._read_q = self._out
        if transform is not None:
            self._read_q = queue.Queue(maxsize=1)
            self._slots = threading.Semaphore(self._depth)  # batches in the transform
            self._work: queue.Queue[tuple[_Ahead, Future[_Ahead]]] = queue.Queue()
            self._threads.append(
                threading.Thread(target=self._dispatch, name="conveyor-dispatch", daemon=True)
            )
            self._threads.extend(
                threading.Thread(
                    target=self._transform_worker, name="conveyor-transform", daemon=True
                )
                for _ in range(self._depth)
            )
        for t in self._threads:
            t.start()

    def _put(self, q: queue.Queue[tuple[str, Any]], item: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> None:
        while not self._stop.is_set():
            if self._paused.is_set():
                self._stop.wait(0.05)
                continue
            try:
                with self._stages.stage(Stage.READ):
                    batch = self._read_once()
                item: tuple[str, Any] = ("batch", _Ahead.of(batch))
            except BaseException as e:  # handed to the consumer thread
                item = ("error", e)
            if not self._put(self._read_q, item) or item[0] == "error":
                return

    def _dispatch(self) -> None:
        """Hands each batch to a transform worker, in order, when fewer than ``depth``
        are in the transform; its future takes the batch's place in ``_out``."""
        while not self._stop.is_set():
            try:
                kind, value = self._read_q.get(timeout=0.2)
            except queue.Empty:
                continue
            if kind == "batch" and value is not None and value.batch.table.num_rows:
                while not self._slots.acquire(timeout=0.2):
                    if self._stop.is_set():
                        return
                future: Future[_Ahead] = Future()
                self._work.put((value, future))
                value = future
            if not self._put(self._out, (kind, value)) or kind == "error":
                return

    def _transform_worker(self) -> None:
        assert self._transform is not None
        while not self._stop.is_set():
            try:
                ahead, future = self._work.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                with self._stages.stage(Stage.TRANSFORM):
                    ahead = _Ahead(ahead.batch, self._transform(ahead.batch.table))
            except OUTAGES as e:
                ahead = _Ahead(ahead.batch, outage=e)
            except Exception as e:  # noqa: BLE001 - run again on the loop's thread
                log.debug("transform ahead failed (the loop runs it again): %s", e)
            finally:
                self._slots.release()
                future.set_result(ahead)

    def next(self) -> _Ahead | None:
        wait = max(self._policy.max_wait_ms / 1000 * 2, 1.0)
        if self._head is None:
            try:
                kind, value = self._out.get(timeout=wait)
            except queue.Empty:
                return None
            if kind == "error":
                raise value
            if not isinstance(value, Future):
                return value
            self._head = value
        try:
            ahead = self._head.result(timeout=wait)
        except FutureTimeout:
            return None  # still in the transform: the loop heartbeats and asks again
        self._head = None
        return ahead

    def stop(self) -> None:
        self._stop.set()
        # One bound for all the threads (the reader first), however deep the pipeline.
        deadline = time.monotonic() + max(self._policy.max_wait_ms / 1000 * 2, 5.0)
        for t in self._threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.0))


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


def _pct(values: deque[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))] * 1000, 2)


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
