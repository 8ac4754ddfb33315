"""A terminated run ends within a bound, whatever its op's thread is doing (issue 47: no run
left behind).

On a terminate the op's thread stops the loop (``supervision.supervise``: up to its grace,
then it leaves the loop behind) and ends the run. If that thread is itself stuck (a call that
never returns, a lock an interrupted call left held), nothing else would end the run: it would
stay CANCELING, holding its connector and its slot in the run queue. ``StopDeadline`` watches
from a thread of its own: once the run has been CANCELING (or CANCELED) for ``END_DEADLINE_S``
with the op still going, it writes every thread's stack to the run's stderr (``faulthandler``,
which needs no lock and no interpreter time, so it works when native code holds the
interpreter), reports the run canceled with a message saying so, and ends the process. The
scheduler's lost-run rule then finds the connector's heartbeat gone and acts on its desired
state.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

# A terminate's grace for the loop is 30 s (supervision.STOP_GRACE_S); the release and Dagster's
# own events follow it. Past this, the run is stuck.
END_DEADLINE_S = 90.0
POLL_S = 5.0
REPORT_S = 10.0  # how long reporting the run canceled may take before the process ends anyway
STOPPING = frozenset({"CANCELING", "CANCELED"})


class StopDeadline:
    """Ends the process when the run has been stopping for ``deadline_s`` and ``finished()``
    was not called (``start()`` once, ``finished()`` when the op ends, however it ends)."""

    def __init__(
        self,
        status: Callable[[], str | None],
        report: Callable[[str], None],
        *,
        deadline_s: float = END_DEADLINE_S,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
        exit_process: Callable[[int], Any] = os._exit,
        stream: IO[str] | None = None,
    ):
        self.status, self.report = status, report
        self.deadline_s, self.poll_s, self.clock = deadline_s, poll_s, clock
        self.exit_process = exit_process
        self.stream = stream
        self.ended = False  # the deadline passed and the process was ended
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="conveyor-stop-deadline")
        self._thread.daemon = True

    @classmethod
    def for_run(cls, context: Any) -> StopDeadline:
        """The deadline of the run ``context`` executes, read from and reported to its instance."""
        run_id = context.run_id

        def status() -> str | None:
            run = context.instance.get_run_by_id(run_id)
            return None if run is None else str(run.status.value)

        def report(message: str) -> None:
            run = context.instance.get_run_by_id(run_id)
            if run is not None:
                context.instance.report_run_canceled(run, message=message)

        return cls(status, report)

    def start(self) -> StopDeadline:
        self._thread.start()
        return self

    def finished(self) -> None:
        self._done.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _watch(self) -> None:
        since: float | None = None
        while not self._done.wait(self.poll_s):
            try:
                stopping = self.status() in STOPPING
            except Exception:  # noqa: BLE001 - the instance may be briefly unreachable
                continue
            if not stopping:
                since = None
                continue
            since = self.clock() if since is None else since
            if self.clock() - since >= self.deadline_s and not self._done.is_set():
                self._end()
                return

    def _end(self) -> None:
        message = (
            f"this run did not end within {self.deadline_s:.0f}s of its terminate: its threads' "
            "stacks are in its stderr; the process ends now"
        )
        stream = self.stream or sys.stderr
        try:
            print(f"conveyor: {message}", file=stream, flush=True)
            if stream is sys.stderr:
                faulthandler.dump_traceback(file=stream, all_threads=True)
            else:  # a stream without a file descriptor (tests)
                for ident, frame in sys._current_frames().items():
                    import traceback

                    stream.write(f"Thread {ident:#x}:\n{''.join(traceback.format_stack(frame))}")
        except Exception:  # noqa: BLE001 - the end must come
            pass
        # Reporting goes through the instance, which the stuck thread may hold: bounded.
        reporter = threading.Thread(target=self._report, args=(message,), daemon=True)
        reporter.start()
        reporter.join(REPORT_S)
        self.ended = True
        self.exit_process(1)

    def _report(self, message: str) -> None:
        try:
            self.report(message)
        except Exception as e:  # noqa: BLE001 - the end must come
            print(f"conveyor: reporting the run canceled failed: {e}", file=sys.stderr, flush=True)
