"""The run server: one warm process that has imported Dagster, Conveyor and the code location
once and forks a child per Dagster run (issue 47, light runs).

A forked run shares the server's imported pages copy-on-write (about 160 MB of modules a
connector run needs: dagster, pandas, pyarrow, pyspark's Connect client, Conveyor), so
its proportional set size is what it writes after the fork, and it starts in milliseconds
instead of the seconds a spawned interpreter spends importing. The server is
single-threaded and forks from its main thread only (a child's parent-death signal is tied
to the thread that forked it). ``launcher.ForkServerRunLauncher`` talks to it over a Unix
socket, one JSON line each way:

- ``{"op": "start", "run_id", "instance_ref"}`` -> ``{"ok": true, "pid"}``
- ``{"op": "terminate", "run_id"}`` -> ``{"ok"}``: SIGINT to that run's child only (Dagster's
  interrupt: the run drains, commits what was acknowledged and ends CANCELED)
- ``{"op": "status", "run_id"}`` -> ``{"state": "running" | "exited" | "unknown", "code"}``
- ``{"op": "ping"}`` -> ``{"ok": true, "pid"}``

A child whose server is gone stops itself: the kernel sends it SIGINT when the server dies
(``PR_SET_PDEATHSIG``), the same interrupt as a terminate. SIGINT or SIGTERM to the server
interrupts its runs, waits for them (``STOP_GRACE_S``) and exits.

    python -m conveyor.dagster.runserver --socket PATH
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

# What a run imports, imported once here (CONVEYOR_RUNSERVER_PRELOAD, comma-separated,
# replaces it). Each child's line in the server's log says what it imported after the fork
# (``imported_after_fork``): a module there is private to every run that imports it. The
# second group is what a PostgreSQL connector run still imported (68 modules; 11 for any run).
PRELOAD = (
    "dagster._cli.api",
    "dagster._core.storage.runs.sqlite",
    "dagster._core.storage.event_log.sqlite",
    "dagster._core.storage.schedules.sqlite",
    "conveyor.dagster.jobs.connector",
    "conveyor.dagster.jobs.source_connector",
    "pyspark.sql.connect.session",
    "confluent_kafka",
    "conveyor.sinks.postgres",
    # Imported by every run as it executes: the plan, the executor, the compute logs.
    "dagster._core.execution.plan.active",
    "dagster._core.executor.in_process",
    "dagster._core.storage.local_compute_log_manager",
    "dagster._core.system_config.composite_descent",
    "dagster._core.utility_ops",
    "dagster._core.workspace.autodiscovery",
    "dagster._utils.test.definitions",
    "watchdog.observers.polling",
    # By a connector's loop: its Spark session (through dagster-pyspark), the Kafka admin
    # client, Arrow's grouping (acero, dataset) and pandas conversion, psycopg2's extras.
    "dagster_pyspark",
    "grpc._channel",
    "confluent_kafka.admin",
    "pyarrow.acero",
    "pyarrow.dataset",
    "pyarrow.pandas_compat",
    "psycopg2.extras",
    "psycopg2.sql",
)
# Conveyor's code location: built here, with its jobs, so a run neither rebuilds it (seconds
# for a few dozen connectors) nor holds a copy of its own; built again here when the spec
# files change, so a run always finds the jobs of the files as they are.
CODE_LOCATION = "conveyor.dagster.definitions"
STOP_GRACE_S = 40.0
TICK_S = 0.2
_PR_SET_PDEATHSIG = 1
_KEEP_EXITED = 1000


def preload(modules: tuple[str, ...] | None = None) -> None:
    """Import what runs import, Arrow's default pool set as runs set it."""
    arrow_pool_as_runs()
    names = modules
    if names is None:
        env = os.environ.get("CONVEYOR_RUNSERVER_PRELOAD")
        names = tuple(filter(None, env.split(","))) if env is not None else PRELOAD
    for name in names:
        importlib.import_module(name)
    if "dagster" in sys.modules:
        warm_instance()


def arrow_pool_as_runs() -> None:
    """Runs put Arrow on the system pool (``jobs/allocators.py``); the server does so before
    pyarrow is imported, so that nothing a child inherits or writes lives in mimalloc's
    arenas, which a run then abandons."""
    from conveyor.dagster.jobs.allocators import ARROW_POOL_ENV, DEFAULT_ARROW_POOL

    if os.environ.get(ARROW_POOL_ENV, DEFAULT_ARROW_POOL) == "system":
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")


class CodeLocation:
    """Conveyor's code location, loaded in the server and loaded again when the spec files
    change (``refresh``, before each fork)."""

    def __init__(self, module: str | None) -> None:
        self.module = module
        self._seen: object = None

    def fingerprint(self) -> object:
        from conveyor.config.specs import connectors_dir

        try:
            entries = sorted(os.scandir(connectors_dir()), key=lambda e: e.name)
            return [(e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in entries]
        except OSError:
            return None

    def refresh(self) -> None:
        """(Re)load the location if its spec files changed, then freeze the collector's view
        of everything loaded: objects made so far are never scanned again, so collections
        in a child do not write to the pages it shares with the server."""
        if self.module is None:
            if self._seen is None:
                self._seen = True
                gc.collect()
                gc.freeze()
            return
        now = self.fingerprint()
        if now == self._seen and self.module in sys.modules:
            return
        print(
            f"conveyor run server: loading the code location {self.module} "
            + ("(its spec files changed)" if self._seen is not None else ""),
            file=sys.stderr, flush=True,
        )  # fmt: skip
        gc.unfreeze()
        sys.modules.pop(self.module, None)
        module = importlib.import_module(self.module)
        for value in vars(module).values():
            if type(value).__name__ == "Definitions":
                value.get_repository_def().get_all_jobs()
        self._seen = now
        gc.collect()
        gc.freeze()


def warm_instance() -> None:
    """Open and close a throwaway Dagster instance: its first opening imports a few dozen
    modules more (fsspec, upath, compressors) and costs a child about 3 s."""
    import tempfile

    from dagster import DagsterInstance
    from dagster._core.instance.ref import InstanceRef

    with (
        tempfile.TemporaryDirectory() as home,
        DagsterInstance.from_ref(InstanceRef.from_dir(home)) as instance,
    ):
        instance.get_run_by_id("warm-up")


class RunServer:
    """Accepts requests on ``socket_path`` and forks a child per run; reaps its children."""

    def __init__(self, socket_path: Path, location: CodeLocation | None = None) -> None:
        self.socket_path = socket_path
        self.location = location or CodeLocation(None)
        self.pid = os.getpid()
        self.running: dict[str, int] = {}  # run id -> pid
        self.exited: dict[str, int] = {}  # run id -> exit code (negative: the signal)
        self._stopping = False
        self._listener = _listen(socket_path)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)

    def serve(self) -> None:
        """Serve until SIGINT or SIGTERM, then interrupt the runs and wait for them."""
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        try:
            while not self._stopping:
                if self._selector.select(TICK_S):
                    self._accept()
                self.reap()
        finally:
            self._selector.close()
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            self._stop_runs()

    def _stop(self, *_: object) -> None:
        self._stopping = True

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        with conn:
            conn.settimeout(2.0)
            try:
                request = json.loads(_read_line(conn))
                reply = self.handle(request, conn)
            except Exception as e:  # noqa: BLE001 - a bad request must not stop the server
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def handle(self, request: dict[str, Any], conn: socket.socket) -> dict[str, Any]:
        op = request.get("op")
        if op == "ping":
            return {"ok": True, "pid": self.pid}
        run_id = str(request["run_id"])
        if op == "start":
            return self._start(run_id, str(request["instance_ref"]), conn)
        if op == "terminate":
            self.reap()  # a child that has ended is no longer running (not a zombie to signal)
            pid = self.running.get(run_id)
            if pid is None:
                return {"ok": False}
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
            return {"ok": True, "pid": pid}
        if op == "status":
            return self.status(run_id)
        raise ValueError(f"unknown op {op!r}")

    def status(self, run_id: str) -> dict[str, Any]:
        self.reap()
        if run_id in self.running:
            return {"state": "running", "pid": self.running[run_id]}
        if run_id in self.exited:
            return {"state": "exited", "code": self.exited[run_id]}
        return {"state": "unknown"}

    def _start(self, run_id: str, instance_ref: str, conn: socket.socket) -> dict[str, Any]:
        if run_id in self.running:
            return {
                "ok": False,
                "error": f"run {run_id} is already running (pid {self.running[run_id]})",
            }
        self.location.refresh()
        pid = os.fork()
        if pid == 0:
            conn.close()
            self._selector.close()
            self._listener.close()
            run_child(run_id, instance_ref, self.pid)  # never returns
        self.running[run_id] = pid
        return {"ok": True, "pid": pid}

    def reap(self) -> None:
        """Collect the exit status of every child that ended."""
        for run_id, pid in list(self.running.items()):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                del self.running[run_id]
                self.exited[run_id] = os.waitstatus_to_exitcode(status)
        while len(self.exited) > _KEEP_EXITED:
            del self.exited[next(iter(self.exited))]

    def _stop_runs(self) -> None:
        for pid in self.running.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.running and time.monotonic() < deadline:
            time.sleep(TICK_S)
            self.reap()
        for pid in self.running.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _listen(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is the server's door: its owner only
    try:
        s.bind(str(path))
    finally:
        os.umask(old)
    s.listen(64)
    s.setblocking(False)
    return s


def _read_line(conn: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGINT when the parent dies; if it is already gone, interrupt now."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGINT, 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGINT)


def run_child(run_id: str, instance_ref: str, server_pid: int) -> None:
    """The forked child: execute the run as ``dagster api execute_run`` does, then exit."""
    code = 1
    inherited = frozenset(sys.modules)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        die_with_parent(server_pid)
        compute_logs_to_files_only()
        code = execute_run(run_id, instance_ref)
    except BaseException:  # noqa: BLE001 - a child never returns into the server's loop
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            print(imported_after_fork(run_id, inherited), file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def compute_logs_to_files_only() -> None:
    """Dagster's local compute logs (the UI's stdout/stderr of a run) written to their files
    only. Dagster mirrors each stream to the process's own as well, with a ``tail -F`` and a
    Python watcher process per stream (four processes, about 15 MB PSS and a fifth of a second
    of CPU per run); a forked run's own streams are the server's log, which needs no copy."""
    from dagster._core.execution import compute_logs
    from dagster._core.storage import local_compute_log_manager as local
    from dagster._utils import ensure_file

    if not hasattr(local, "mirror_stream_to_file"):
        return  # another Dagster: its own capture stands

    @contextlib.contextmanager
    def to_file(stream: Any, filepath: str) -> Any:
        ensure_file(filepath)
        with compute_logs.redirect_to_file(stream, filepath):
            yield (None, None)

    local.mirror_stream_to_file = to_file  # type: ignore[assignment]


def imported_after_fork(run_id: str, inherited: frozenset[str]) -> str:
    """The server log's line on what a run imported itself (its own pages, not shared: what
    ``PRELOAD`` would move into the server), by top-level package with module counts."""
    by_package: dict[str, int] = {}
    for name in set(sys.modules) - inherited:
        top = name.partition(".")[0]
        by_package[top] = by_package.get(top, 0) + 1
    listed = ", ".join(f"{p} {n}" for p, n in sorted(by_package.items(), key=lambda x: -x[1]))
    return (
        f"conveyor run server: run {run_id} imported {sum(by_package.values())} modules "
        f"after the fork{': ' + listed if listed else ''}"
    )


def execute_run(run_id: str, instance_ref: str) -> int:
    """Run ``run_id`` in this process, Dagster's interrupts captured; 0 when it succeeded."""
    from dagster import DagsterInstance
    from dagster._cli.api import _execute_run_command_body  # what `dagster api execute_run` runs
    from dagster._core.instance.ref import InstanceRef
    from dagster._serdes import deserialize_value
    from dagster._utils.interrupts import capture_interrupts

    with capture_interrupts():
        ref = deserialize_value(instance_ref, InstanceRef)
        with DagsterInstance.from_ref(ref) as instance:
            try:
                return _execute_run_command_body(
                    run_id, instance, lambda _: None, set_exit_code_on_failure=True
                )
            finally:
                end_if_canceling(instance, run_id)


def end_if_canceling(instance: Any, run_id: str) -> None:
    """A run still CANCELING as its process ends is reported CANCELED: a terminate that raced
    the run's own end (its op had returned, its last event written, then the launcher marked
    it CANCELING) would otherwise leave it CANCELING with no process, holding its run slot
    until the scheduler's grace passed (a minute)."""
    from dagster import DagsterRunStatus

    with contextlib.suppress(Exception):
        run = instance.get_run_by_id(run_id)
        if run is not None and run.status == DagsterRunStatus.CANCELING:
            instance.report_run_canceled(run, message="The run process ended while canceling.")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m conveyor.dagster.runserver")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument(
        "--code-location",
        default=os.environ.get("CONVEYOR_RUNSERVER_CODE_LOCATION", CODE_LOCATION),
        help="the module loaded here for runs ('' for none)",
    )
    args = parser.parse_args(argv)
    preload()
    location = CodeLocation(args.code_location or None)
    location.refresh()
    server = RunServer(args.socket, location)
    print(f"conveyor run server: pid {server.pid} on {args.socket}", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
