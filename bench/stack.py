"""Conveyor as a user runs it, for benchmarks: ``dagster dev`` (webserver, daemon, code
server) over a fresh home, the scheduler sensor launching connector runs, the CLI to
start and stop them, and per-process CPU and memory sampled from /proc (psutil).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from conveyor.control.devserver import (
    RUN_SERVER_SOCKET,
    dagster_yaml,
    run_launcher_yaml,
    start_run_server,
    uses_run_server,
)
from conveyor.core.host.ports import free_port, port_open
from conveyor.store.meta import MetaStore
from tests.e2e.conftest import kill_processes_of, wait_for


@dataclass
class DevStack:
    home: Path
    env: dict[str, str]
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def store(self) -> MetaStore:
        return MetaStore(self.env["CONVEYOR_META_URL"])

    def cli(self, *args: str) -> str:
        exe = str(Path(sys.executable).parent / "conveyor")
        r = subprocess.run([exe, *args], env=self.env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"conveyor {' '.join(args)}: {r.stderr}")
        return r.stdout


@contextlib.contextmanager
def dev_stack(
    home: Path, bootstrap: str, spark_remote: str, specs: list[dict[str, Any]]
) -> Iterator[DevStack]:
    """``dagster dev`` with ``specs`` in the connectors directory (written before it starts,
    so the code location has their jobs); one broker executor ``local`` on ``spark_remote``."""
    connectors = home / "connectors"
    dagster_home = home / "dagster"
    connectors.mkdir(parents=True)
    dagster_home.mkdir()
    for spec in specs:
        (connectors / f"{spec['name']}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {
        **os.environ,
        "CONVEYOR_HOME": str(home),
        "CONVEYOR_META_URL": f"sqlite:///{home / 'meta.db'}",
        "CONVEYOR_CONNECTORS_DIR": str(connectors),
        "CONVEYOR_KAFKA_BOOTSTRAP": bootstrap,
        "CONVEYOR_SPARK_REMOTE": spark_remote,
        "DAGSTER_HOME": str(dagster_home),
    }
    # Runs forked from the warm run server, as `conveyor dev` launches them (its server started
    # first, the instance naming its socket); CONVEYOR_RUN_LAUNCHER=default: Dagster's own.
    socket = dagster_home / RUN_SERVER_SOCKET if uses_run_server() else None
    (dagster_home / "dagster.yaml").write_text(
        dagster_yaml([("local", 8)]) + run_launcher_yaml(socket)
    )
    run_server = None
    if socket is not None:
        (home / "logs").mkdir(exist_ok=True)
        run_server = start_run_server(home, socket, env)
    port = free_port()
    log = open(home / "dagster-dev.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "dagster"),
            "dev",
            "-m",
            "conveyor.dagster.definitions",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        cwd=home,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: port_open("127.0.0.1", port) or proc.poll() is not None, 180, "dagster")
        if proc.poll() is not None:
            raise RuntimeError((home / "dagster-dev.log").read_text()[-3000:])
        yield DevStack(home, env, port, proc)
    finally:
        for p in (proc, run_server):
            if p is not None:
                end_group(p, signal.SIGTERM, 60)
        kill_processes_of(home)
        log.close()


def end_group(proc: subprocess.Popen[bytes], signo: int, wait_s: float) -> None:
    """``signo`` to the process group of ``proc`` (started with ``start_new_session``), then
    SIGKILL to it if ``proc`` has not ended within ``wait_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signo)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def listening_pid(port: int) -> int | None:
    """The process listening on a loopback ``port`` (the Spark Connect server's JVM)."""
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


@dataclass
class ProcessMeter:
    """CPU seconds and peak RSS of a set of processes over a window, sampled every 0.2 s."""

    pids: dict[str, int]
    cpu_start: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _cpu(self, pid: int) -> float | None:
        try:
            t = psutil.Process(pid).cpu_times()
            return float(t.user + t.system)
        except psutil.Error:
            return None

    def start(self) -> ProcessMeter:
        for k, pid in self.pids.items():
            self.cpu_start[k] = self._cpu(pid) or 0.0
            self.peak_rss[k] = 0
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            for k, pid in self.pids.items():
                try:
                    p = psutil.Process(pid)
                    self.peak_rss[k] = max(self.peak_rss[k], p.memory_info().rss)
                    c = self._cpu(pid)
                    if c is not None:
                        self.cpu[k] = c - self.cpu_start[k]
                except psutil.Error:
                    pass
            self._stop.wait(0.2)

    def stop(self) -> ProcessMeter:
        self._stop.set()
        if self._thread:
            self._thread.join()
        for k, pid in self.pids.items():  # a last reading where the process still runs
            c = self._cpu(pid)
            if c is not None:
                self.cpu[k] = c - self.cpu_start[k]
        return self
