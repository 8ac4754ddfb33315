"""Bench-only memory probe of Conveyor's run process (issue 18: what its RSS is made of).

Active only when ``CONVEYOR_BENCH_MEMPROBE`` names a folder and this folder is first on
``PYTHONPATH`` (so that Python imports this file at start-up, as ``sitecustomize``), and
only in a process started by multiprocessing's spawn (Dagster's run processes; the
webserver, daemon, code server and CLI are not). Every 0.25 s it appends one JSON line to
``<folder>/<pid>.jsonl``: the process's RSS by kind (/proc/self/status), its mappings by
kind (/proc/self/smaps), glibc malloc's totals (``mallinfo2``), the Arrow memory pool's
bytes, and librdkafka's queued fetches (its statistics, when the ``rkstats`` lever is on).

Levers, for attributing the RSS one part at a time: ``<folder>/levers`` (written by the
benchmark before it starts a connector; comma-separated) is read at start-up:

- ``arena2``: glibc ``mallopt(M_ARENA_MAX, 2)`` before any thread starts;
- ``mmapN``: glibc ``mallopt(M_MMAP_THRESHOLD, N KiB)``: blocks from N KiB on are mapped
  and unmapped on free (a fixed threshold; glibc otherwise raises it up to 32 MiB after
  freeing a large block, and then serves such blocks from its heap);
- ``sysmem``: ``ARROW_DEFAULT_MEMORY_POOL=system`` (Arrow on glibc malloc, not mimalloc);
- ``trim``: ``malloc_trim(0)`` every second;
- ``rkstats``: librdkafka statistics every second (the fetch queue's size);
- ``swN``: ``sys.setswitchinterval(N / 1000)``: the interpreter lock handed between threads
  every N ms instead of 5 (not memory: the latency of the threads waiting on I/O);
- ``olda``: the run's allocators as before issue 18's settings: Arrow's own pool
  (``CONVEYOR_ARROW_MEMORY_POOL=arrow``; also glibc's arenas and no trimming, settings of
  commits b42536a-8023ed4 that were measured and dropped); one of them off: ``arrowpool``,
  ``noarena``, ``notrim`` (the last two: no-ops since they were dropped).

pymalloc's arenas are read every second with ``sys._debugmallocstats`` (which writes to
fd 2: the process's stderr goes to a temporary file for that moment).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import threading
import time

FOLDER = os.environ.get("CONVEYOR_BENCH_MEMPROBE")
M_ARENA_MAX = -8
M_MMAP_THRESHOLD = -3


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) // 1024
            elif k == "Threads":
                out[k] = int(v)
    return out


def _pymalloc() -> dict[str, int]:
    """pymalloc's arenas (MB): ``sys._debugmallocstats`` writes to fd 2, taken for a moment."""
    import tempfile

    out = {}
    with tempfile.TemporaryFile("w+") as f:
        saved = os.dup(2)
        try:
            os.dup2(f.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        for line in f:
            k, _, v = line.partition("=")
            k = k.strip()
            if k == "# bytes in allocated blocks":
                out["blocks"] = int(v.replace(",", "")) >> 20
            elif k == "Total" and "arenas" not in out:  # the arenas' (the next: the map's)
                out["arenas"] = int(v.replace(",", "")) >> 20
    return out


def _smaps() -> dict[str, int]:
    """RSS (MB) by kind of mapping: shared objects and other files, [heap] (glibc's main
    arena), [stack], anonymous mappings by size (1 MiB: pymalloc's arenas; 64 MiB-aligned
    glibc thread arenas and the rest are told apart by the allocators' own counters)."""
    kinds: dict[str, int] = {}
    name = ""
    size = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                size = (hi - lo) >> 10
                name = head[5].strip() if len(head) > 5 else ""
            elif head[0] == "Rss:":
                kb = int(head[1])
                if name.startswith("/"):
                    kind = "so" if ".so" in name else "file"
                elif name:
                    kind = name
                elif size == 1024:
                    kind = "anon_1MiB"
                elif size < 1024:
                    kind = "anon_small"
                else:
                    kind = "anon_big"
                kinds[kind] = kinds.get(kind, 0) + kb
    return {k: v // 1024 for k, v in kinds.items()}


class Probe:
    def __init__(self, folder: str, levers: set[str]):
        self.folder = folder
        self.levers = levers
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = _MallInfo2
        self.rk: dict[str, int] = {}
        self.marks: list[str] = []
        self.pymalloc: dict[str, int] = {}
        self.out = open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a")  # noqa: SIM115

    def stats_cb(self, raw: str) -> None:
        s = json.loads(raw)
        q = {"fetchq_cnt": 0, "fetchq_size": 0}
        for t in s.get("topics", {}).values():
            for pid, p in t.get("partitions", {}).items():
                if pid != "-1":
                    q["fetchq_cnt"] += p.get("fetchq_cnt", 0)
                    q["fetchq_size"] += p.get("fetchq_size", 0)
        q["replyq"] = s.get("replyq", 0)
        q["msg_size"] = s.get("msg_size", 0)
        self.rk = q

    def patch_confluent(self) -> None:
        mod = sys.modules["conveyor.brokers.confluent"]
        original = mod.consumer_config

        def consumer_config(*a, **kw):  # type: ignore[no-untyped-def]
            self.marks.append("consumer")
            conf = original(*a, **kw)
            if "rkstats" in self.levers:
                conf["statistics.interval.ms"] = 1000
                conf["stats_cb"] = self.stats_cb
            return conf

        mod.consumer_config = consumer_config

    def sample(self) -> dict[str, object]:
        mi = self.libc.mallinfo2()
        row: dict[str, object] = {
            "t": time.time(),
            **_status(),
            "smaps": _smaps(),
            "glibc_system_mb": (mi.arena + mi.hblkhd) >> 20,
            "glibc_inuse_mb": (mi.uordblks + mi.hblkhd) >> 20,
            "glibc_free_mb": mi.fordblks >> 20,
            "glibc_mmapped_mb": mi.hblkhd >> 20,
            "rk": self.rk,
            "pymalloc": self.pymalloc,
            "marks": list(self.marks),
        }
        pa = sys.modules.get("pyarrow")
        if pa is not None:
            with contextlib.suppress(Exception):
                pool = pa.default_memory_pool()
                row["arrow"] = {
                    "backend": pool.backend_name,
                    "allocated_mb": pool.bytes_allocated() >> 20,
                    "max_mb": pool.max_memory() >> 20,
                }
        return row

    def run(self) -> None:
        patched = False
        last_trim = last_py = 0.0
        while True:
            mod = sys.modules.get("conveyor.brokers.confluent")
            if not patched and mod is not None and hasattr(mod, "ConfluentSource"):
                with contextlib.suppress(Exception):
                    self.patch_confluent()
                patched = True
            if "trim" in self.levers and time.monotonic() - last_trim >= 1:
                self.libc.malloc_trim(0)
                last_trim = time.monotonic()
            if patched and time.monotonic() - last_py >= 1:
                with contextlib.suppress(Exception):
                    self.pymalloc = _pymalloc()
                last_py = time.monotonic()
            with contextlib.suppress(Exception):
                self.out.write(json.dumps(self.sample()) + "\n")
                self.out.flush()
            time.sleep(0.25 if patched else 0.01)


def _start() -> None:
    if not FOLDER or "--multiprocessing-fork" not in sys.argv:
        return
    levers: set[str] = set()
    with contextlib.suppress(OSError), open(os.path.join(FOLDER, "levers")) as f:
        levers = {x.strip() for x in f.read().split(",") if x.strip()}
    for lever in levers:
        if lever.startswith("sw") and lever[2:].isdigit():
            sys.setswitchinterval(int(lever[2:]) / 1000)
    if "arena2" in levers:
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 2)
    for lever in levers:
        if lever.startswith("mmap") and lever[4:].isdigit():
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, int(lever[4:]) * 1024)
    if levers & {"olda", "noarena"}:
        os.environ["CONVEYOR_MALLOC_ARENA_MAX"] = "0"
    if levers & {"olda", "notrim"}:
        os.environ["CONVEYOR_MALLOC_TRIM_S"] = "0"
    if levers & {"olda", "arrowpool"}:
        os.environ["CONVEYOR_ARROW_MEMORY_POOL"] = "arrow"
    if "sysmem" in levers:
        os.environ["ARROW_DEFAULT_MEMORY_POOL"] = "system"
    probe = Probe(FOLDER, levers)
    probe.out.write(json.dumps({"levers": sorted(levers), "argv": sys.argv[:3]}) + "\n")
    threading.Thread(target=probe.run, name="conveyor-bench-memprobe", daemon=True).start()


_start()
