"""The memory allocators of a connector's run process (issue 18: its RSS).

Measured during a 400,000-message drain (docs/BENCHMARKS.md, "Run-process memory"):

- the run has a dozen threads allocating at once (the loop, the reader, the transform
  workers, librdkafka's and gRPC's threads); glibc gives each its own arena, up to 8
  per core, and what is freed in an arena stays in the process: glibc held 145 MB of
  which 53 MB free. Two arenas and ``malloc_trim(0)`` every second give it back;
- Arrow's default pool (mimalloc) held about 60 MB of RSS for at most 15 MB of live
  Arrow buffers. The system pool (glibc malloc) holds what is live.

Environment settings of the run process (docs/OPERATIONS.md):
``CONVEYOR_MALLOC_ARENA_MAX`` (2; 0 keeps glibc's default), ``CONVEYOR_MALLOC_TRIM_S``
(1; 0: never) and ``CONVEYOR_ARROW_MEMORY_POOL`` (``system``; ``arrow`` keeps Arrow's
default, or ``ARROW_DEFAULT_MEMORY_POOL``). The glibc ones do nothing elsewhere than
glibc Linux.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import platform
import threading
from collections.abc import Iterator

log = logging.getLogger("conveyor.allocators")

ARENA_MAX_ENV = "CONVEYOR_MALLOC_ARENA_MAX"
TRIM_ENV = "CONVEYOR_MALLOC_TRIM_S"
ARROW_POOL_ENV = "CONVEYOR_ARROW_MEMORY_POOL"
DEFAULT_ARENA_MAX = 2
DEFAULT_TRIM_S = 1.0
DEFAULT_ARROW_POOL = "system"
ARROW_POOLS = ("system", "arrow")
M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)


def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (Linux), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _number(env: str, default: float) -> float:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number: using %s", env, raw, default)
        return default
    return max(0.0, value)


def limit_arenas(n: int) -> bool:
    """At most ``n`` malloc arenas for threads that allocate from now on; False where
    this is not glibc (or ``n`` is 0)."""
    libc = glibc()
    if libc is None or n <= 0:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, int(n)))


def use_arrow_pool(name: str) -> str:
    """Arrow's default memory pool from now on: ``system`` (malloc) or ``arrow`` (left as
    Arrow chose it); the name of the pool in use."""
    import pyarrow as pa

    if name not in ARROW_POOLS:
        log.warning(
            "%s=%r is not one of %s: using %s",
            ARROW_POOL_ENV,
            name,
            ARROW_POOLS,
            DEFAULT_ARROW_POOL,
        )
        name = DEFAULT_ARROW_POOL
    if name == "system":
        pa.set_memory_pool(pa.system_memory_pool())
    return str(pa.default_memory_pool().backend_name)


class Trimmer:
    """A daemon thread returning glibc's free memory to the system every ``interval_s``."""

    def __init__(self, libc: ctypes.CDLL, interval_s: float):
        self._libc = libc
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-malloc-trim", daemon=True)
        self.trims = 0

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._libc.malloc_trim(0)
            self.trims += 1

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> Trimmer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def run_allocators() -> Iterator[Trimmer | None]:
    """The run's allocator settings (from the environment) while the block runs: Arrow's
    pool and glibc's arena limit set before the loop's threads start, a trimmer thread
    (yielded; None when off or not glibc) until the block ends."""
    use_arrow_pool(os.environ.get(ARROW_POOL_ENV, "").strip() or DEFAULT_ARROW_POOL)
    libc = glibc()
    if libc is None:
        yield None
        return
    arenas = int(_number(ARENA_MAX_ENV, DEFAULT_ARENA_MAX))
    if arenas:
        limit_arenas(arenas)
    interval = _number(TRIM_ENV, DEFAULT_TRIM_S)
    trimmer = Trimmer(libc, interval).start() if interval > 0 else None
    try:
        yield trimmer
    finally:
        if trimmer is not None:
            trimmer.stop()
