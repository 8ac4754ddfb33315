"""Stopping a loop: the sleep a stop request cuts short, the exception that unwinds an outage wait,
a heartbeat's directive, and ``LoopControl``, the skeleton both loops share.

The sink loop (``core.engine.loop``) and the source loop (``core.engine.source_loop``) wait out outages the same
way: they sleep in short ticks on their stop event, so a stop request (the event, a fenced run, the
desired state) ends the wait within a tick; a wait that ended on a stop raises :class:`Stopping`,
which ``run`` treats as a clean stop.

Both loops are also supervised the same way (``core.engine.liveness``, ``jobs/supervision.py``): every
stage runs inside ``stages``; the run's supervisor heartbeats for the loop from another thread
(``beat``), so a supervised loop only queues its status changes; an unsupervised loop beats from
its own thread. A loop supplies ``_send_heartbeat`` (what it reports and to whom).
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from conveyor.core.engine.failure import OutageTracker
from conveyor.core.engine.liveness import StageClock
from conveyor.core.errors import FencedError, OutageBudgetExceeded
from conveyor.core.model import ConnectorStatus, Counters, DesiredState, HeartbeatReply

log = logging.getLogger(__name__)

# The longest a stop request waits for a sleeping loop to notice it.
TICK_S = 0.5


class Stopping(BaseException):
    """A stop was requested while waiting out an outage (internal to the loops: a clean stop)."""


def sleep_unless_stopped(
    seconds: float,
    stop_event: threading.Event,
    should_stop: Callable[[], bool],
    *,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Sleep ``seconds``, returning early once ``should_stop()`` is true (checked every tick; the
    wait on ``stop_event`` returns at once when it is set)."""
    deadline = clock() + seconds
    while not should_stop():
        left = deadline - clock()
        if left <= 0:
            return
        stop_event.wait(min(left, TICK_S))


class Directive(str, enum.Enum):
    """What the connector should do, as the answer to a heartbeat."""

    RUN = "run"
    PAUSE = "pause"  # hold the assignment, read nothing, keep heartbeating
    STOP = "stop"  # finish cleanly
    RECONFIGURE = "reconfigure"  # the spec changed: end run() at a batch boundary


def directive_for(reply: HeartbeatReply, running_spec_hash: str | None) -> Directive:
    """The directive a run takes from the store's answer, given the spec it runs with."""
    if reply.desired == DesiredState.STOPPED:
        return Directive.STOP
    if running_spec_hash and reply.spec_hash and reply.spec_hash != running_spec_hash:
        return Directive.RECONFIGURE
    if reply.desired == DesiredState.PAUSED:
        return Directive.PAUSE
    return Directive.RUN


class LoopControl(abc.ABC):
    """What the sink loop and the source loop share around their step: stop and pause events
    (set by a heartbeat's directive from any thread), the interruptible sleep, the counters,
    the status and its queued changes, the stage clock and the heartbeat a supervisor sends
    (``beat``), the fence. Each loop's step order is its own (the pipelined sink, the strict
    source); a loop supplies ``_heartbeat`` (its own pace, used while paused) and
    ``_send_heartbeat`` (one heartbeat to the meta store), and may widen ``_should_stop``."""

    name: str
    cfg: Any  # the loop's config: its ``heartbeat_interval_s`` paces a supervisor's beats
    status: ConnectorStatus
    counters: Counters
    clock: Callable[[], float]
    _outage: OutageTracker

    @abc.abstractmethod
    def run(self) -> Counters:
        """Run until stopped (once). Returns the final counters; raises on a connector error."""

    def _init_control(
        self,
        name: str,
        stop_requested: Callable[[], bool],
        sleep: Callable[[float], None] | None,
        counters: Counters | None,
        paused_poll_s: float,
    ) -> None:
        self.name = name
        self.stop_requested = stop_requested
        self._stop_event = threading.Event()
        self._pause_event = threading.Event()
        self._sleep = sleep or self._interruptible_sleep
        self.counters = counters or Counters()  # a reconfigured loop goes on counting
        self.reconfigure_requested = False
        self.status = ConnectorStatus.RUNNING
        self._paused_poll_s = paused_poll_s
        # Liveness: every stage runs inside self.stages; a supervisor (jobs/supervision.py)
        # heartbeats for a supervised loop, which then only queues its status changes.
        self.stages = StageClock(time.monotonic)
        self.supervised = False
        self.beat_requested = threading.Event()
        self._beat_lock = threading.Lock()
        self._transitions: deque[tuple[ConnectorStatus, str | None]] = deque(
            [(ConnectorStatus.RUNNING, "first heartbeat")]
        )
        self._fenced: FencedError | None = None

    def request_stop(self) -> None:
        self._stop_event.set()

    def apply(self, directive: Directive | bool | None) -> None:
        """Act on a heartbeat's answer: only sets events, so any thread may call it."""
        if directive is False or directive == Directive.STOP:
            if not self._stop_event.is_set():
                log.info("%s: desired state is stopped; stopping", self.name)
            self._stop_event.set()
        elif directive == Directive.RECONFIGURE:
            if not self.reconfigure_requested:
                log.info("%s: the spec changed; taking it on at the batch boundary", self.name)
            self.reconfigure_requested = True
            self._stop_event.set()
        elif directive == Directive.PAUSE:
            self._pause_event.set()
        else:
            self._pause_event.clear()

    def _paused(self) -> None:
        """Hold until resumed or stopped, heartbeating; reads nothing meanwhile."""
        log.info("%s: paused", self.name)
        before = self.status
        self._set_status(ConnectorStatus.PAUSED, "paused")
        while self._pause_event.is_set() and not self._should_stop():
            self._heartbeat(force=True)
            self._stop_event.wait(self._paused_poll_s)
        if not self._should_stop():
            log.info("%s: resumed", self.name)
            resumed = ConnectorStatus.RUNNING if before == ConnectorStatus.PAUSED else before
            self._set_status(resumed, "resumed")
            self._heartbeat(force=True)

    @abc.abstractmethod
    def _heartbeat(self, force: bool = False) -> None:
        """Report to the meta store (each loop its own way; ``force`` ignores the interval):
        gather what the heartbeat carries, then ``_beat_now``."""

    @abc.abstractmethod
    def _send_heartbeat(
        self, status: ConnectorStatus, reason: str | None
    ) -> Directive | bool | None:
        """One heartbeat with this status: the loop's counters to its committer or writer;
        returns the store's answer. FencedError when superseded."""

    def _beat_now(self, force: bool) -> None:
        """Heartbeat from the loop's thread, or (supervised) ask the supervisor to beat at
        once when ``force`` (a status change)."""
        if self.supervised:
            if force:
                self.beat_requested.set()
        else:
            self.beat()

    def beat(self, override: ConnectorStatus | None = None) -> None:
        """Heartbeat once (any thread): each queued status change in order, else the current
        status; ``override`` (the supervisor's verdict, whose reason was queued once with
        ``report``) replaces a Running status.

        FencedError stops the loop (``fence``) and is re-raised; other errors leave the
        queued changes for the next beat.
        """
        with self._beat_lock:
            try:
                if not self._transitions:
                    status, reason = self.status, None
                    if override is not None and status == ConnectorStatus.RUNNING:
                        status = override
                    self._transitions.append((status, reason))
                while self._transitions:
                    status, reason = self._transitions[0]
                    answer = self._send_heartbeat(status, reason)
                    self._transitions.popleft()
                    self.apply(answer)
            except FencedError as e:
                self.fence(e)
                raise

    def report(self, status: ConnectorStatus, reason: str) -> None:
        """Queue a status for the next heartbeat (the supervisor's verdicts, store trouble)."""
        with self._beat_lock:
            self._transitions.append((status, reason))

    def _set_status(self, status: ConnectorStatus, reason: str) -> None:
        if status != self.status:
            self.status = status
            with self._beat_lock:
                self._transitions.append((status, reason))

    def fence(self, error: FencedError) -> None:
        """This run lost the connector (seen by a heartbeat on any thread): stop, commit nothing."""
        if self._fenced is None:
            self._fenced = error
        self._stop_event.set()

    def _count(self, **inc: int) -> None:
        self.counters = replace(
            self.counters, **{k: getattr(self.counters, k) + v for k, v in inc.items()}
        )

    def _outage_wait(self, what: str, e: Exception) -> None:
        """``what`` ran into an outage ``e``: a retry counted; past the outage budget
        OutageBudgetExceeded; else Degraded, reported at once, and a sleep of the backoff
        (a stop cuts it short and raises Stopping)."""
        now = self.clock()
        delay = self._outage.failed(now)
        self._count(retries=1)
        if self._outage.exhausted(now):
            raise OutageBudgetExceeded(
                f"{what} kept failing for {self._outage.duration(now):.0f}s "
                f"({self._outage.attempts} attempts): {e}"
            ) from e
        self._set_status(ConnectorStatus.DEGRADED, f"{what} failed, retrying in {delay:.1f}s: {e}")
        log.warning(
            "%s: %s failed (attempt %d), retrying in %.1fs: %s",
            self.name,
            what,
            self._outage.attempts,
            delay,
            e,
        )
        self._heartbeat(force=True)
        self._sleep(delay)
        if self._should_stop():
            raise Stopping() from e

    def _should_stop(self) -> bool:
        return self._stop_event.is_set() or self.stop_requested() or self._fenced is not None

    def _interruptible_sleep(self, seconds: float) -> None:
        sleep_unless_stopped(seconds, self._stop_event, self._should_stop)
