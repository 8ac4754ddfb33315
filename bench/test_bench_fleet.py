"""Benchmark: a fleet of idle connectors under ``conveyor dev`` (issue 47, light runs).

``N`` connectors (one empty topic each, PostgreSQL sink, defaults) in a fresh home, with
``CONVEYOR_BROKER_CAPACITY=N``; ``conveyor dev --no-demo`` starts its own Spark Connect
server and uses the test session's tansu (``CONVEYOR_KAFKA_BOOTSTRAP``, so the topics exist
before the code location loads). Once every connector is Running:

- **memory**: the proportional set size (PSS, ``/proc/<pid>/smaps_rollup``) of each run
  process with its descendants (Dagster's compute-log tails, when a run has them), and of
  the run server they are forked from (``CONVEYOR_RUN_LAUNCHER=forkserver``, ``conveyor
  dev``'s default; ``default`` for Dagster's own launcher); **per connector** is the runs'
  PSS plus the run server's, divided by ``N``;
- **launch to first commit**: for ``SAMPLES`` connectors, stopped, 10 messages produced,
  then ``conveyor connector start``: the time until their offsets are committed;
- **kill -9 to first commit**: for ``SAMPLES`` other connectors, SIGKILL to the run
  process, 10 messages produced: the time until the scheduler's relaunch committed them.

    CONVEYOR_BENCH_FLEET_N=50 .venv/bin/python -m pytest bench/test_bench_fleet.py -m bench -s -n 0

``CONVEYOR_BENCH_FLEET_N`` (50), ``CONVEYOR_BENCH_FLEET_SAMPLES`` (5),
``CONVEYOR_BENCH_OUT`` (the figures as JSON). Results go to docs/BENCHMARKS.md by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from bench.stack import end_group
from bench.test_bench_as_users_run_it import SCHEMA, create_table
from conveyor.core.host.ports import free_port, port_open
from conveyor.core.host.processes import pid_alive
from conveyor.store.meta import MetaStore
from tests.e2e.conftest import kill_processes_of, produce, wait_for

pytestmark = [pytest.mark.bench, pytest.mark.timeout(7200)]

N = int(os.environ.get("CONVEYOR_BENCH_FLEET_N", "50"))
SAMPLES = int(os.environ.get("CONVEYOR_BENCH_FLEET_SAMPLES", "5"))
OUT = os.environ.get("CONVEYOR_BENCH_OUT")
MESSAGES = 10
# Every run reading its topic: a connector is Running once its run claimed it.
ALL_RUNNING_S = 300 + 12 * N
FIRST_COMMIT_S = 180.0
# The runs forked from the warm run server unless CONVEYOR_RUN_LAUNCHER says otherwise.
LAUNCHER = os.environ.get("CONVEYOR_RUN_LAUNCHER", "forkserver")


@dataclass
class Fleet:
    cwd: Path
    home: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    names: list[str]
    topics: dict[str, str]

    @property
    def store(self) -> MetaStore:
        return MetaStore(f"sqlite:///{self.home / 'meta.db'}")

    def cli(self, *args: str) -> str:
        exe = str(Path(sys.executable).parent / "conveyor")
        r = subprocess.run(
            [exe, *args], env=self.env, cwd=self.cwd, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, f"conveyor {' '.join(args)}: {r.stderr}"
        return r.stdout

    def log(self) -> str:
        return (self.cwd / "conveyor-dev.log").read_text(errors="replace")[-4000:]

    def live(self) -> list[Any]:
        """Connectors whose run process is alive (Running, or Degraded by a late stage)."""
        rows = [r for r in self.store.list() if r.name in self.topics]
        return [r for r in rows if r.run_pid and pid_alive(r.run_pid)]

    def running(self) -> list[Any]:
        return [r for r in self.live() if r.status.value == "Running"]

    def committed(self, name: str) -> int:
        return sum(self.store.committed_offsets(name).values())


def spec(name: str, topic: str, pg_url: str, schema: str) -> dict[str, Any]:
    return {
        "name": name,
        "source": {"topics": [topic]},
        "transform": {"decode": "json", "schema": SCHEMA},
        "sink": {"type": "postgres", "url": pg_url, "schema": schema, "table": name},
    }


@contextlib.contextmanager
def fleet(tansu: str, pg_url: str, pg_schema: str) -> Iterator[Fleet]:
    cwd = Path(tempfile.mkdtemp(prefix="conveyor-fleet-"))
    home = cwd / ".conveyor"
    (home / "connectors").mkdir(parents=True)
    run = uuid.uuid4().hex[:6]
    topics = {f"fleet_{i:03d}": f"fleet_{run}_{i:03d}" for i in range(N)}
    for name, topic in topics.items():
        produce(tansu, topic, 0, partitions=1)
        create_table(pg_url, pg_schema, name)
        text = yaml.safe_dump(spec(name, topic, pg_url, pg_schema), sort_keys=False)
        (home / "connectors" / f"{name}.yaml").write_text(text)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CONVEYOR_", "DAGSTER_HOME")) or k == "CONVEYOR_RUN_LAUNCHER"
    }
    env |= {"CONVEYOR_KAFKA_BOOTSTRAP": tansu, "CONVEYOR_BROKER_CAPACITY": str(N)}
    env["CONVEYOR_RUN_LAUNCHER"] = LAUNCHER
    ports = [free_port() for _ in range(4)]
    exe = str(Path(sys.executable).parent / "conveyor")
    cmd = [exe, "dev", "--no-demo", "--port", str(ports[0]), "--spark-port", str(ports[1])]
    cmd += ["--api-port", str(ports[2]), "--kafka-port", str(ports[3])]
    log = open(cwd / "conveyor-dev.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    f = Fleet(cwd, home, {**env, "CONVEYOR_HOME": str(home), "COLUMNS": "200"}, proc, [], topics)
    f.names = list(topics)
    try:
        wait_for(lambda: port_open("127.0.0.1", ports[0]) or proc.poll() is not None, 300, "UI")
        assert proc.poll() is None, f.log()
        yield f
    finally:
        end_group(proc, signal.SIGINT, 120)
        kill_processes_of(home)
        log.close()


def pss_mb(pid: int) -> float:
    try:
        return float(psutil.Process(pid).memory_full_info().pss) / 2**20
    except psutil.Error:
        return 0.0


def run_pss_mb(pid: int) -> float:
    """A run process's PSS with its descendants' (Dagster's compute-log tails and watchers
    when it has them): what the connector costs beyond what it shares."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        children = []
    return pss_mb(pid) + sum(pss_mb(c.pid) for c in children)


def private_by_kind(pid: int) -> dict[str, float]:
    """A process's private memory (not shared with the server or anyone) by mapping kind, MB."""
    out: dict[str, float] = {}
    kind = "anon"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if not line[0].isupper() or not head[0].endswith(":"):
                path = head[5] if len(head) > 5 else ""
                kind = path if path.startswith("[") else ("file" if path else "anon")
            elif head[0] in ("Private_Clean:", "Private_Dirty:"):
                out[kind] = out.get(kind, 0.0) + int(head[1]) / 1024
    return {k: round(v, 1) for k, v in sorted(out.items()) if v >= 0.1}


def run_server_pid(home: Path) -> int | None:
    """The run server of ``home``: of the processes with its command line (its forked runs
    have it too), the one whose parent does not."""
    found: dict[int, int] = {}  # pid -> parent pid
    for p in psutil.process_iter(["cmdline", "environ", "ppid"]):
        with contextlib.suppress(psutil.Error):
            cmd = p.info["cmdline"] or []
            env = p.info["environ"] or {}
            if "conveyor.dagster.runserver" in cmd and env.get("CONVEYOR_HOME") == str(home):
                found[int(p.pid)] = int(p.info["ppid"])
    roots = [pid for pid, parent in found.items() if parent not in found]
    return roots[0] if len(roots) == 1 else None


def parent_pid(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).ppid())
    except psutil.Error:
        return None


def memory(f: Fleet) -> dict[str, Any]:
    rows = f.live()
    runs = [run_pss_mb(r.run_pid) for r in rows]
    rss = [psutil.Process(r.run_pid).memory_info().rss / 2**20 for r in rows]
    server = run_server_pid(f.home)
    server_pss = pss_mb(server) if server else 0.0
    return {
        "runs": len(rows),
        # Forked from the run server (its children), not spawned by Dagster's own launcher: a
        # server that no run came from only adds its PSS (how run B of docs/BENCHMARKS.md 11
        # came to measure spawned runs under the fork server's name).
        "runs_forked": sum(parent_pid(r.run_pid) == server for r in rows) if server else 0,
        "run_pss_median_mb": statistics.median(runs),
        "run_pss_max_mb": max(runs),
        "run_rss_median_mb": statistics.median(rss),
        "run_server_pss_mb": server_pss,
        "pss_per_connector_mb": (sum(runs) + server_pss) / N,
        "one_run_private_mb": private_by_kind(rows[0].run_pid),
        "available_mb": psutil.virtual_memory().available / 2**20,
    }


def launch_to_first_commit(f: Fleet, tansu: str, name: str) -> float:
    f.cli("connector", "stop", name)
    wait_for(lambda: f.store.get(name).status.value == "Stopped", 120, f"{name} stopped")
    before = f.committed(name)
    produce(tansu, f.topics[name], MESSAGES, partitions=1, start=1000)
    t0 = time.monotonic()
    f.cli("connector", "start", name)
    wait_for(lambda: f.committed(name) >= before + MESSAGES, FIRST_COMMIT_S, f"{name}", 0.1)
    return time.monotonic() - t0


def kill_to_first_commit(f: Fleet, tansu: str, name: str) -> float:
    pid = f.store.get(name).run_pid
    assert pid and pid_alive(pid), f"{name} has no live run"
    before = f.committed(name)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    produce(tansu, f.topics[name], MESSAGES, partitions=1, start=2000)
    wait_for(lambda: f.committed(name) >= before + MESSAGES, FIRST_COMMIT_S, f"{name}", 0.1)
    return time.monotonic() - t0


def all_running(f: Fleet) -> tuple[float | None, int]:
    """Seconds until all ``N`` were Running at once (None: not within ``ALL_RUNNING_S``), and
    the most that were; the figures are measured either way."""
    t0 = time.monotonic()
    most = 0
    while time.monotonic() - t0 < ALL_RUNNING_S:
        live = f.live()
        most = max(most, sum(r.status.value == "Running" for r in live))
        print(
            f"{time.monotonic() - t0:6.0f} s: {most} Running at most, {len(live)} live", flush=True
        )
        if most == N:
            return time.monotonic() - t0, most
        time.sleep(2.0)
    return None, most


def test_a_fleet_of_idle_connectors(tansu: str, pg_url: str, pg_schema: str) -> None:
    launcher = LAUNCHER
    with fleet(tansu, pg_url, pg_schema) as f:
        all_running_s, most = all_running(f)
        mem = memory(f)
        names = [r.name for r in f.running()]
        launches = [launch_to_first_commit(f, tansu, n) for n in names[:SAMPLES]]
        kills = [kill_to_first_commit(f, tansu, n) for n in names[SAMPLES : 2 * SAMPLES]]
    result = {
        "n": N,
        "launcher": launcher,
        "all_running_s": all_running_s,
        "most_running_at_once": most,
        "loadavg": os.getloadavg(),
        **mem,
        "launch_to_first_commit_s": launches,
        "kill9_to_first_commit_s": kills,
        "launch_median_s": statistics.median(launches),
        "kill9_median_s": statistics.median(kills),
    }
    print("\n" + json.dumps(result, indent=1))
    if OUT:
        Path(OUT).write_text(json.dumps(result, indent=1))
    assert all_running_s is not None, f"at most {most} of {N} Running at once"
    if launcher == "forkserver":
        assert mem["runs_forked"] == mem["runs"], "runs not forked from the run server"
