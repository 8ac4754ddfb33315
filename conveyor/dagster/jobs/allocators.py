"""The memory allocator of a connector's run process (issue 18: its RSS).

Measured during a 400,000-message drain (docs/BENCHMARKS.md, "Run-process memory"):
Arrow's default pool (mimalloc in the wheels) held about 40 MB more RSS at the run's peak
than the system pool (malloc), for at most 15 MB of live Arrow buffers, at the same rate.
glibc's arena limit (2) and ``malloc_trim(0)`` every second were measured too and did
not lower the peak: they are not set.

glibc's mmap threshold is fixed at 128 KiB: a block that large is mapped on its own and
returned to the system when freed. glibc's own rule raises the threshold after such a
block is freed (up to 32 MiB), and serves later large blocks from its heap, where they
stay: with 40,000-record batches (a batch's Arrow columns, the Spark Connect request and
its result, the sink's buffers are such blocks) the run's peak held 127 MB of free heap
and was 451-456 MB; with the threshold fixed, 28 MB and 395-410 MB, at the same rate and
CPU (docs/BENCHMARKS.md, run V).

``CONVEYOR_ARROW_MEMORY_POOL`` (docs/OPERATIONS.md): ``system`` (the default) or
``arrow`` (Arrow's own choice: mimalloc, or ``ARROW_DEFAULT_MEMORY_POOL``).
``CONVEYOR_MALLOC_MMAP_THRESHOLD_KIB``: the threshold in KiB (default 128), ``0`` for
glibc's own rule.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("conveyor.allocators")

ARROW_POOL_ENV = "CONVEYOR_ARROW_MEMORY_POOL"
DEFAULT_ARROW_POOL = "system"
ARROW_POOLS = ("system", "arrow")
MMAP_THRESHOLD_ENV = "CONVEYOR_MALLOC_MMAP_THRESHOLD_KIB"
DEFAULT_MMAP_THRESHOLD_KIB = 128
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_MAX_MMAP_THRESHOLD_KIB = 32 * 1024  # glibc's HEAP_MAX / 2 on 64-bit: larger is refused


def use_run_allocators() -> None:
    """What a connector's run process sets before its connector runs: Arrow's pool and
    glibc's mmap threshold (this module's docstring says why)."""
    use_arrow_pool()
    fix_mmap_threshold()


def fix_mmap_threshold(kib: int | None = None) -> int | None:
    """glibc's mmap threshold from now on: ``kib``, else the environment's, else 128 KiB.
    Returns the threshold set in KiB, or None when none was (``0``: glibc's own rule
    kept; not glibc)."""
    if kib is None:
        raw = os.environ.get(MMAP_THRESHOLD_ENV, "").strip()
        kib = DEFAULT_MMAP_THRESHOLD_KIB
        if raw:
            try:
                kib = int(raw)
                if not 0 <= kib <= _MAX_MMAP_THRESHOLD_KIB:
                    raise ValueError(raw)
            except ValueError:
                log.warning(
                    "%s=%r is not a size in KiB from 0 to %d: using %d",
                    MMAP_THRESHOLD_ENV,
                    raw,
                    _MAX_MMAP_THRESHOLD_KIB,
                    DEFAULT_MMAP_THRESHOLD_KIB,
                )
                kib = DEFAULT_MMAP_THRESHOLD_KIB
    if kib == 0:
        return None
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        if not libc.mallopt(_M_MMAP_THRESHOLD, kib * 1024):
            log.warning("glibc refused an mmap threshold of %d KiB", kib)
            return None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return None
    return kib


def use_arrow_pool(name: str | None = None) -> str:
    """Arrow's default memory pool from now on: ``name``, else the environment's, else
    ``system``; returns the backend in use (``system``, ``mimalloc``, ``jemalloc``).
    Buffers already allocated stay with the pool that allocated them."""
    import pyarrow as pa

    name = name or os.environ.get(ARROW_POOL_ENV, "").strip() or DEFAULT_ARROW_POOL
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
