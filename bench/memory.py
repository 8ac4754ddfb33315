"""What a run process's RSS is made of: the readings of bench/memprobe/sitecustomize.py.

Set ``CONVEYOR_BENCH_MEMPROBE`` to a folder and the as-users-run-it benchmarks put
bench/memprobe first on the stack's ``PYTHONPATH``: each run process then writes its
readings to ``<folder>/<pid>.jsonl``. ``summary`` gives the readings when the source's
client was created (the run's imports and set-up, before the first message) and at the
peak RSS.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PROBE = os.environ.get("CONVEYOR_BENCH_MEMPROBE")
PROBE_PATH = str(Path(__file__).resolve().parent / "memprobe")


def probe_env() -> None:
    """Make the stack's processes load the probe (when ``CONVEYOR_BENCH_MEMPROBE`` is set)."""
    if PROBE:
        Path(PROBE).mkdir(parents=True, exist_ok=True)
        parts = [PROBE_PATH, *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
        os.environ["PYTHONPATH"] = ":".join(dict.fromkeys(parts))


def set_levers(levers: list[str]) -> None:
    """The levers the next run process applies at start-up (see the probe's docstring)."""
    if PROBE:
        (Path(PROBE) / "levers").write_text(",".join(levers))


def summary(pid: int | None) -> dict[str, Any]:
    if not PROBE or pid is None:
        return {}
    path = Path(PROBE) / f"{pid}.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    head, samples = rows[0], [r for r in rows[1:] if "VmRSS" in r]
    if not samples:
        return {}
    start = next((r for r in samples if "consumer" in r["marks"]), samples[0])
    peak = max(samples, key=lambda r: r["VmRSS"])
    return {"levers": head.get("levers"), "at_consumer": start, "at_peak": peak}


def describe(s: dict[str, Any]) -> str:
    if not s:
        return ""

    def one(r: dict[str, Any]) -> str:
        smaps = ", ".join(f"{k} {v}" for k, v in sorted(r["smaps"].items()) if v)
        return (
            f"RSS {r['VmRSS']} (anon {r['RssAnon']}, file {r['RssFile']}), threads {r['Threads']};"
            f" glibc system {r['glibc_system_mb']} in use {r['glibc_inuse_mb']} free"
            f" {r['glibc_free_mb']} (mmapped {r['glibc_mmapped_mb']}); arrow {r.get('arrow')};"
            f" librdkafka {r.get('rk')}; pymalloc {r.get('pymalloc')}; smaps: {smaps}"
        )

    return (
        f"  memory probe, levers {s['levers']}\n"
        f"    at consumer: {one(s['at_consumer'])}\n    at peak:     {one(s['at_peak'])}"
    )
