"""Stopping ``conveyor dev``: the daemon's run queue first, then the runs, then whatever still
belongs to its home.

The order matters. While the daemon runs it dequeues and launches queued runs, and its
scheduler sensor assigns connectors again: runs stopped before it would be replaced by new
ones that nobody stops (their code server then waits for them and outlives ``dagster dev``).
So the daemon is paused first (SIGSTOP: it launches nothing from then on, and ``dagster dev``
does not notice), the queued runs are canceled and their connectors unassigned, the connector
runs are interrupted by pid (they commit, clean up and release) and any other run still active
is terminated through the run launcher while the code servers are up; only then is the daemon
killed and ``dagster dev`` stopped. Last, every process still holding the home (a run, a code
server, a log tail: ``core.host.processes.holds``) gets SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from conveyor.core.host.processes import children_of, cmdline, pid_alive, processes_holding

# How long the runs have to commit and exit once interrupted.
RUN_STOP_S = 30.0
# How long a process still holding the home has between SIGTERM and SIGKILL.
SWEEP_GRACE_S = 10.0


def daemon_of(dagster_pid: int) -> int | None:
    """The ``dagster-daemon`` process that ``dagster dev`` (``dagster_pid``) started."""
    for pid in children_of(dagster_pid):
        if "dagster._daemon" in cmdline(pid) or any("dagster-daemon" in a for a in cmdline(pid)):
            return pid
    return None


def pause_daemon(dagster_pid: int | None, say: Callable[[str], None]) -> int | None:
    """SIGSTOP the daemon: from now on no queued run is launched and no sensor ticks."""
    pid = daemon_of(dagster_pid) if dagster_pid else None
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            say(f"dagster-daemon (pid {pid}) paused: no queued run starts from now on")
    return pid


def kill_daemon(pid: int | None) -> None:
    """The paused daemon goes (SIGKILL: a stopped process acts on nothing else)."""
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_until(done: Callable[[], bool], timeout_s: float, every_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
    return True


class RunQueue:
    """The Dagster instance of ``conveyor dev``'s home, as its stop sees it."""

    def __init__(self, dagster_home: Path, say: Callable[[str], None]):
        from dagster import DagsterInstance

        self.instance = DagsterInstance.from_config(str(dagster_home))
        self.say = say

    def close(self) -> None:
        self.instance.dispose()

    def _runs(self, *statuses: str) -> list[Any]:
        from dagster import DagsterRunStatus, RunsFilter

        wanted = [DagsterRunStatus(s) for s in statuses]
        return list(self.instance.get_runs(filters=RunsFilter(statuses=wanted)))

    def cancel_queued(self) -> int:
        """Every queued run is canceled (the daemon, paused, cannot launch it meanwhile)."""
        queued = self._runs("QUEUED")
        for run in queued:
            self.instance.report_run_canceled(run, message="conveyor dev stopped: canceled queued")
        if queued:
            self.say(f"{len(queued)} queued run(s) canceled")
        return len(queued)

    def terminate_active(self, timeout_s: float = RUN_STOP_S) -> None:
        """Every run still active (launched but not claimed, a backfill, a user's job) is
        terminated through the run launcher (its code server is still up), and waited for."""
        active = self._runs("NOT_STARTED", "STARTING", "STARTED")
        for run in active:
            self.say(f"terminating run {run.run_id} ({run.job_name})")
            try:
                self.instance.run_launcher.terminate(run.run_id)
            except Exception as e:  # noqa: BLE001 - the sweep stops what is left
                self.say(f"run {run.run_id}: terminate failed: {type(e).__name__}: {e}")
        ids = [r.run_id for r in active]

        def finished() -> bool:
            runs = (self.instance.get_run_by_id(i) for i in ids)
            return all(r is None or r.is_finished for r in runs)

        if ids and not _wait_until(finished, timeout_s):
            self.say(f"runs still active after {timeout_s:g} s; their processes are stopped below")


def reset_unstarted(store: Any, say: Callable[[str], None]) -> None:
    """Connectors assigned whose run never started (it was queued) lose the assignment now, so
    the next ``conveyor dev`` assigns them at once instead of after the launch timeout."""
    from conveyor.core.model import ConnectorStatus
    from conveyor.core.planning.state import StateChange

    for r in store.list():
        if r.status == ConnectorStatus.IDLE and r.broker_id is not None and r.run_pid is None:
            store.apply(
                r.name,
                r.generation,
                StateChange.reset(),
                "conveyor dev stopped before its run started; assigned again at the next start",
            )
            say(f"connector {r.name}: its run never started; unassigned")


def stop_connector_runs(
    store: Any, say: Callable[[str], None], timeout_s: float = RUN_STOP_S
) -> None:
    """Interrupt the connector runs of this machine; they commit, clean up and exit.

    A run that stops this way records its connector as Stopped (as a terminate from
    the UI does); the ones that were meant to run are set back to desired running, so
    the next ``conveyor dev`` resumes them from their last commit.
    """
    host = socket.gethostname()
    rows = store.list()
    live = [r for r in rows if r.run_pid and (r.run_host in (None, host)) and pid_alive(r.run_pid)]
    for r in live:
        say(f"stopping connector {r.name} (run {r.run_id}, pid {r.run_pid})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.run_pid, signal.SIGINT)
    _wait_until(lambda: not any(pid_alive(r.run_pid) for r in live if r.run_pid), timeout_s)
    for r in live:
        if r.run_pid and pid_alive(r.run_pid):
            say(f"connector {r.name}: run did not stop in {timeout_s:g} s; killing pid {r.run_pid}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.run_pid, signal.SIGKILL)
        if r.desired.wants_run:
            try:
                store.set_desired(
                    r.name, r.desired, reason="conveyor dev stopped; resumes at the next start"
                )
            except Exception as e:  # noqa: BLE001
                say(f"connector {r.name}: could not keep it desired running: {e}")


def sweep(home: Path, say: Callable[[str], None], grace_s: float = SWEEP_GRACE_S) -> list[int]:
    """SIGTERM every process still holding ``home``, SIGKILL what is left after ``grace_s``;
    returns the pids found."""
    left = processes_holding(home.resolve())
    for pid in left:
        say(f"pid {pid} still holds {home}: {' '.join(cmdline(pid))[:160]}; stopping it")
        _signal(pid, signal.SIGTERM)
    if left and not _wait_until(lambda: not any(pid_alive(p) for p in left), grace_s):
        for pid in _alive(left):
            say(f"pid {pid} did not stop in {grace_s:g} s; killing it")
            _signal(pid, signal.SIGKILL)
    return left


def _alive(pids: Iterable[int]) -> list[int]:
    return [p for p in pids if pid_alive(p)]


def _signal(pid: int, signo: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signo)
        if signo == signal.SIGTERM:
            os.kill(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once resumed
