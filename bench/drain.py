"""One contender's drain of a backlog, sampled: the figures both as-users-run-it benchmarks report.

A ``Sample`` is the target's row count with each process's CPU seconds and RSS at one
moment; a ``Result`` turns a drain's samples into the steady rate (20% to 90% of the
``n`` rows), the start-up-included rate, CPU seconds per 100,000 rows over the steady
window, and peak RSS, per process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.stack import DevStack

Pids = Callable[[], dict[str, int]]
# Processes that were there before a drain and serve every connector (the Spark Connect
# server's JVM): their start-up-included CPU is what they spent from the drain's start.
SHARED = ("spark_jvm",)


@dataclass
class Sample:
    t: float
    rows: int
    cpu: dict[str, float]
    rss: dict[str, int]


@dataclass
class Result:
    contender: str
    started: float
    n: int
    sink: str = "postgres"
    samples: list[Sample] = field(default_factory=list)
    loadavg: tuple[float, float, float] = (0.0, 0.0, 0.0)
    rows: int = 0
    run_pid: int | None = None  # Conveyor's run process
    memory: dict[str, Any] = field(default_factory=dict)  # bench/memory.py's summary
    batches: int | None = None  # Conveyor's batches for the drain (its run's counters)

    def _at(self, rows: float) -> Sample:
        return next(s for s in self.samples if s.rows >= rows)

    def steady_rate(self) -> float:
        a, b = self._at(0.2 * self.n), self._at(0.9 * self.n)
        if a is b:
            raise AssertionError(
                f"{self.sink} {self.contender}: 20% to 90% of {self.n} rows in one write: raise n"
            )
        return (b.rows - a.rows) / (b.t - a.t)

    def total_rate(self) -> float:
        return self.n / (self._at(self.n).t - self.started)

    def cpu_per_100k(self) -> dict[str, float]:
        a, b = self._at(0.2 * self.n), self._at(0.9 * self.n)
        return {
            k: (b.cpu.get(k, 0.0) - a.cpu.get(k, 0.0)) * 100_000 / (b.rows - a.rows) for k in b.cpu
        }

    def cpu_per_100k_total(self) -> dict[str, float]:
        """CPU seconds per 100,000 rows, start-up included: a process the drain started (the
        run, a peer's script) from its own start to the last row (a forked run's imports are
        its server's, paid once, not here); a ``SHARED`` one (the Spark JVM) from the drain's
        first sample, right after the start command, to the last row: what the run's start
        and its rows cost it (its session, the first analyses and compilations included)."""
        first, last = self.samples[0], self._at(self.n)
        return {
            k: (v - (first.cpu.get(k, 0.0) if k in SHARED else 0.0)) * 100_000 / self.n
            for k, v in last.cpu.items()
        }

    def cpu_total(self) -> float:
        """``cpu_per_100k_total`` summed over the processes: the contender's CPU per 100,000
        rows, start-up and the Spark JVM's part included."""
        return sum(self.cpu_per_100k_total().values())

    def peak_rss_mb(self) -> dict[str, float]:
        keys = {k for s in self.samples for k in s.rss}
        return {k: max(s.rss.get(k, 0) for s in self.samples) / 2**20 for k in keys}


def sample_until_done(
    result: Result, count: Callable[[], int], pids: Pids, timeout: float = 900
) -> Result:
    """Sample the target's row count (``count``) and each process's CPU seconds and RSS
    every 0.2 s until all ``result.n`` rows are in; fails after ``timeout`` seconds."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = count()
        cpu, rss = {}, {}
        for k, pid in pids().items():
            try:
                p = psutil.Process(pid)
                ct = p.cpu_times()
                cpu[k] = ct.user + ct.system
                rss[k] = p.memory_info().rss
            except psutil.Error:
                pass
        result.samples.append(Sample(time.monotonic(), rows, cpu, rss))
        if rows >= result.n:
            return result
        time.sleep(0.2)
    last = result.samples[-1].rows if result.samples else 0
    raise AssertionError(f"{result.sink} {result.contender}: only {last} of {result.n} rows")


def drain_connector(
    stack: DevStack,
    result: Result,
    name: str,
    jvm: int | None,
    watch: Callable[[Result, Pids], object],
    profile: str | None = None,
) -> Result:
    """Start connector ``name`` with ``conveyor connector start`` (the scheduler launches its
    run), ``watch`` the drain with the run process's pid (and the Spark JVM's), py-spy on the
    run from 20% of the rows when ``profile`` names a folder, then stop it."""
    from tests.e2e.conftest import wait_for

    stack.cli("connector", "start", name)
    run_pid: dict[str, int] = {}
    spy: list[subprocess.Popen[bytes]] = []

    def pids() -> dict[str, int]:
        if "run" not in run_pid:
            row = stack.store.get(name)
            if row.run_pid:
                run_pid["run"] = result.run_pid = row.run_pid
        # The profile covers the steady part: from 20% of the rows to the end.
        steady = bool(result.samples) and result.samples[-1].rows >= 0.2 * result.n
        if profile and "run" in run_pid and not spy and steady:
            spy.append(start_profile(run_pid["run"], Path(profile) / f"{name}.txt"))
        return {**run_pid, **({"spark_jvm": jvm} if jvm else {})}

    try:
        watch(result, pids)
    finally:
        for p in spy:
            p.send_signal(signal.SIGINT)
            p.wait(60)
    if spy:
        print(summarize_profile(Path(profile or ".") / f"{name}.txt"))
    if os.environ.get("CONVEYOR_BENCH_SAMPLES"):  # a folder: each drain's samples, as JSON
        out = Path(os.environ["CONVEYOR_BENCH_SAMPLES"]) / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([[s.t - result.started, s.rows, s.cpu] for s in result.samples]))
    stack.cli("connector", "stop", name)
    wait_for(lambda: stack.store.get(name).status.value == "Stopped", 120, f"{name} stopped")
    result.batches = stack.store.get(name).counters.get("batches")
    if result.batches:
        print(f"{name}: {result.batches} batches, {result.n / result.batches:,.0f} messages each")
    return result


def start_profile(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` at 100 Hz into collapsed stacks: every thread, idle ones
    too (where a pipeline stage waits is the point), thread ids kept. With
    ``CONVEYOR_BENCH_PROFILE_CPU=1`` only busy samples (where the run's CPU goes; the time
    in a C call is its Python caller's)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    exe = str(Path(sys.executable).parent / "py-spy")
    how = [] if os.environ.get("CONVEYOR_BENCH_PROFILE_CPU") == "1" else ["--idle"]
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--format", "raw", "-r", "100", "-o", str(out),
         "--nonblocking", *how, "--threads"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


def summarize_profile(path: Path, top: int = 6) -> str:
    """Per pipeline thread (the loop, the reader, the transform), the share of its wall
    time in each of Conveyor's functions (the deepest ``conveyor/`` frame of a sample:
    ``_Prefetcher.next`` on the loop's thread is waiting for the transform, say)."""
    from collections import Counter, defaultdict

    roots = {
        "ConnectorLoop.run": "loop (send, commit)",
        "_Prefetcher._read": "reader (source.read)",
        "_Prefetcher._transform_worker": "transform (Spark)",
    }
    per: dict[str, Counter[str]] = defaultdict(Counter)
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        stage = next((v for k, v in roots.items() for f in frames if f.startswith(k)), None)
        if stage is None:
            continue
        own = [f for f in frames if "conveyor/" in f]
        per[stage][own[-1].split(" (")[0] if own else "?"] += int(n)
    lines = [f"{path.name}: share of each pipeline thread's wall time (100 Hz samples)"]
    for stage, counts in per.items():
        total = sum(counts.values())
        lines.append(f"  {stage}: {total} samples")
        lines += [f"    {c / total:6.1%}  {f}" for f, c in counts.most_common(top)]
    return "\n".join(lines)
