"""The sink loop's reads (``core.engine.loop``): the source contract, and reading ahead: the next
batch read (and transformed) on threads of their own while the loop's thread sends, handed
over in source order."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from conveyor.core.engine.batches import SourceBatch, Transformed
from conveyor.core.engine.liveness import Stage, StageClock
from conveyor.core.errors import OUTAGES
from conveyor.core.model import BatchPolicy, Offsets

log = logging.getLogger("conveyor.loop")


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


class ReadPolicy(Protocol):
    """What the reads follow (the loop's ``LoopConfig``, read live)."""

    batch: BatchPolicy
    prefetch: bool  # read the next batch on a thread
    transform_ahead: bool  # with prefetch: also transform it on a thread
    transform_depth: int


class Reader:
    """The loop's reads: on the loop's thread, or ahead on threads (``Prefetcher``). Each read
    is noted in the loop's event time (``noted``); a failed read ahead is read again here
    under the loop's outage retries (``retry``), then reading ahead goes on."""

    def __init__(
        self,
        cfg: ReadPolicy,
        source: Callable[[], Source],
        transform: Transformer,
        *,
        paused: threading.Event,
        stages: StageClock,
        noted: Callable[[float, bool], None],
        retry: Callable[..., Any],
        clock: Callable[[], float],
    ):
        self.cfg, self.source, self.transform = cfg, source, transform
        self.paused, self.stages, self.noted, self.retry, self.clock = (
            paused, stages, noted, retry, clock,
        )  # fmt: skip
        self._ahead: Prefetcher | None = None

    def start(self) -> None:
        self._ahead = self._reader()

    def stop(self) -> None:
        if self._ahead is not None:
            self._ahead.stop()

    def next(self) -> Ahead | None:
        """The next batch (None: nothing came)."""
        try:
            return self._ahead.next() if self._ahead else Ahead.of(self._read())
        except OUTAGES as e:
            # A read failed (on the read-ahead thread, which then ended): read again here
            # under the retry policy, then read ahead again.
            self.stop()
            item = Ahead.of(self.retry("read", lambda: self.noted_read(), failed_first=e))
            self._ahead = self._reader()
            return item

    def _reader(self) -> Prefetcher | None:
        if not self.cfg.prefetch:
            return None
        ahead = self.transform if self.cfg.transform_ahead else None
        return Prefetcher(
            self.source(),
            self.cfg.batch,
            ahead,
            self.paused,
            self.stages,
            depth=self.cfg.transform_depth,
            read=self.noted_read,
        )

    def _read(self) -> SourceBatch | None:
        with self.stages.stage(Stage.READ):
            return self.noted_read()

    def noted_read(self) -> SourceBatch | None:
        """One read of the source (on whichever thread reads), noting whether it found
        nothing: the source was caught up when such a read began (``EventTime.quiet_at``)."""
        started = self.clock()
        batch = self.source().read(self.cfg.batch)
        self.noted(started, batch is not None)
        return batch


@dataclass(frozen=True)
class Ahead:
    """A batch handed to the loop's thread, transformed ahead when that succeeded."""

    batch: SourceBatch
    transformed: Transformed | None = None  # None: the loop's thread transforms it
    outage: Exception | None = None  # the transform ahead hit an outage: the first attempt

    @staticmethod
    def of(batch: SourceBatch | None) -> Ahead | None:
        return None if batch is None else Ahead(batch)


class Prefetcher:
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
        # In source order: ("batch", Ahead | Future[Ahead]) or ("error", exception).
        self._out: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=self._depth)
        self._head: Future[Ahead] | None = None  # taken from _out, its transform not ended
        self._threads = [threading.Thread(target=self._read, name="conveyor-prefetch", daemon=True)]
        self._read_q = self._out
        if transform is not None:
            self._read_q = queue.Queue(maxsize=1)
            self._slots = threading.Semaphore(self._depth)  # batches in the transform
            self._work: queue.Queue[tuple[Ahead, Future[Ahead]]] = queue.Queue()
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
                item: tuple[str, Any] = ("batch", Ahead.of(batch))
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
                future: Future[Ahead] = Future()
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
                    ahead = Ahead(ahead.batch, self._transform(ahead.batch.table))
            except OUTAGES as e:
                ahead = Ahead(ahead.batch, outage=e)
            except Exception as e:  # noqa: BLE001 - run again on the loop's thread
                log.debug("transform ahead failed (the loop runs it again): %s", e)
            finally:
                self._slots.release()
                future.set_result(ahead)

    def next(self) -> Ahead | None:
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
