"""Liveness of a run, judged from the progress of its stages, not from the loop's thread.

Every stage of the pipeline (read, transform, send, commit, dead-letter, init) runs
inside ``StageClock.stage(name)``, whichever thread runs it (the read-ahead thread,
the transform-ahead thread, the loop's thread). A supervisor (the op's thread, see
``jobs/supervision.py``) heartbeats for the run at a steady pace and asks ``verdict``
what the stages say:

- nothing under way for longer than its deadline: the run is healthy, whatever the
  loop is doing (a long send within its deadline, a 60 s wait between outage retries:
  waiting is not a stage, the loop reports the outage itself);
- a stage under way past ``stage_deadline_s`` (the read stage: plus the batch's
  ``max_wait_ms``): ``Degraded`` with the stage named, the run keeps heartbeating, so
  the scheduler does not declare it lost;
- past ``restart_after_s``: the run restarts itself (the op fails the run; the
  scheduler relaunches it under its restart budget; the stuck call is abandoned and
  fenced by the next generation).

Pure: no clock of its own, no I/O.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from conveyor.core.errors import FencedError
from conveyor.core.model import ConnectorStatus, LivenessSpec


class Stage(str, enum.Enum):
    INIT = "init"  # validate, prepare the transform, init the sink, open the source
    READ = "read"
    TRANSFORM = "transform"
    SEND = "send"
    DEAD_LETTER = "dead-letter"
    COMMIT = "commit"


# The loop's names of its retried operations -> the stage they belong to.
_STAGE_OF = {
    "prepare transform": Stage.INIT,
    "init sink": Stage.INIT,
    "open source": Stage.INIT,
    "connect producer": Stage.INIT,  # a source loop's (core/engine/source_loop.py)
    "init source": Stage.INIT,
    "read": Stage.READ,
    "poll": Stage.READ,
    "transform": Stage.TRANSFORM,
    "send": Stage.SEND,
    "resend": Stage.SEND,
    "dead-letter store": Stage.DEAD_LETTER,
    "commit": Stage.COMMIT,
    "store state": Stage.COMMIT,
}


def stage_of(what: str) -> Stage:
    return _STAGE_OF.get(what, Stage.SEND)


class StageClock:
    """Which stages are under way, and since when. Any thread enters; the supervisor reads."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._lock = threading.Lock()
        self._active: dict[int, tuple[Stage, float]] = {}
        self._ids = itertools.count()

    @contextmanager
    def stage(self, stage: Stage) -> Iterator[None]:
        token = next(self._ids)
        with self._lock:
            self._active[token] = (stage, self._clock())
        try:
            yield
        finally:
            with self._lock:
                self._active.pop(token, None)

    def active(self) -> list[tuple[Stage, float]]:
        """(stage, started_at) of every stage under way, oldest first."""
        with self._lock:
            return sorted(self._active.values(), key=lambda s: s[1])


@dataclass(frozen=True)
class Verdict:
    """What the supervisor reports: healthy (``stage`` None), stuck, or restart."""

    stage: Stage | None = None
    age_s: float = 0.0
    deadline_s: float = 0.0
    restart: bool = False

    @property
    def stuck(self) -> bool:
        return self.stage is not None

    def reason(self) -> str:
        if self.stage is None:
            return "all stages within their deadlines"
        if self.restart:
            return (
                f"stage {self.stage.value} has been under way for {self.age_s:.0f}s, past the "
                f"{self.deadline_s:.0f}s restart limit (liveness.restart_after_s): the run "
                "restarts itself"
            )
        return (
            f"stage {self.stage.value} has been under way for {self.age_s:.0f}s, past its "
            f"{self.deadline_s:.0f}s deadline (liveness.stage_deadline_s)"
        )


def deadline(stage: Stage, spec: LivenessSpec, read_wait_s: float) -> float:
    """The stage's deadline: a read may also wait the batch's ``max_wait_ms`` for records."""
    return spec.stage_deadline_s + (read_wait_s if stage == Stage.READ else 0.0)


def verdict(
    active: list[tuple[Stage, float]], now: float, spec: LivenessSpec, read_wait_s: float = 0.0
) -> Verdict:
    """The worst stage under way: past the restart limit, else past its deadline, else none."""
    worst = Verdict()
    for stage, started in active:
        age = now - started
        limit = spec.restart_after_s + (read_wait_s if stage == Stage.READ else 0.0)
        if age >= limit:
            return Verdict(stage, age, limit, restart=True)
        d = deadline(stage, spec, read_wait_s)
        if age >= d and (worst.stage is None or age - d > worst.age_s - worst.deadline_s):
            worst = Verdict(stage, age, d)
    return worst


class Supervised(Protocol):
    """What the supervisor needs of a loop (``core.engine.stopping.LoopControl``: the sink loop, the
    source loop)."""

    stages: StageClock
    status: ConnectorStatus
    beat_requested: threading.Event

    def beat(self, override: ConnectorStatus | None = None) -> None: ...
    def report(self, status: ConnectorStatus, reason: str) -> None: ...


class Supervisor:
    """Heartbeats for a supervised loop from another thread, judging its stages.

    ``tick()`` is called every ``poll_s`` by the thread that owns the run (the op's
    thread). It heartbeats every ``interval_s`` (every tick while paused, so that a
    resume is seen soon, and at once when the loop asks), reports a stage past its
    deadline as ``Degraded`` (queued as a status change, so it lands in the history),
    and returns the verdict: the caller restarts the run on ``restart``.

    A heartbeat that fails for any reason but fencing (the meta store locked or
    unreachable) is reported ``Degraded`` once the store answers again; the loop goes
    on meanwhile. FencedError is raised: the loop has been told to stop (``fence``).
    """

    poll_s = 0.25

    def __init__(
        self,
        loop: Supervised,
        spec: LivenessSpec,
        *,
        read_wait_s: float = 0.0,
        interval_s: float = 1.0,
        clock: Callable[[], float],
        on_report: Callable[[str], None] | None = None,
    ):
        self.loop = loop
        self.spec = spec
        self.read_wait_s = read_wait_s
        self.interval_s = interval_s
        self.clock = clock
        self.on_report = on_report or (lambda _msg: None)
        self.last: Verdict = Verdict()
        self._last_beat: float | None = None
        self.store_trouble: str | None = None  # the last heartbeat's error, until one succeeds

    def tick(self) -> Verdict:
        now = self.clock()
        v = verdict(self.loop.stages.active(), now, self.spec, self.read_wait_s)
        changed = (v.stage, v.restart) != (self.last.stage, self.last.restart)
        if changed and v.stuck:
            self.loop.report(ConnectorStatus.DEGRADED, v.reason())
            self.on_report(v.reason())
        elif changed and self.last.stuck and self.last.stage is not None:
            msg = (
                f"stage {self.last.stage.value} finished (under way {self.last.age_s:.0f}s or more)"
            )
            self.loop.report(self.loop.status, msg)
            self.on_report(msg)
        self.last = v
        interval = self.poll_s if self.loop.status == ConnectorStatus.PAUSED else self.interval_s
        due = (
            changed
            or self._last_beat is None
            or now - self._last_beat >= interval
            or self.loop.beat_requested.is_set()
        )
        if due:
            self.loop.beat_requested.clear()
            self._last_beat = now
            override = ConnectorStatus.DEGRADED if v.stuck else None
            try:
                self.loop.beat(override)
            except FencedError:
                raise
            except Exception as e:  # noqa: BLE001 - the store's trouble is reported, not fatal
                if self.store_trouble is None:
                    self.loop.report(
                        ConnectorStatus.DEGRADED, f"meta store unavailable, heartbeat failed: {e}"
                    )
                    self.on_report(f"meta store unavailable, heartbeat failed: {e}")
                self.store_trouble = str(e)
            else:
                if self.store_trouble is not None:
                    self.store_trouble = None
                    self.loop.report(self.loop.status, "meta store reachable again")
                    self.on_report("meta store reachable again")
                    self.loop.beat(override)
        return v
