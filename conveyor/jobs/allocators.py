"""The memory allocator of a connector's run process (issue 18: its RSS).

Measured during a 400,000-message drain (docs/BENCHMARKS.md, "Run-process memory"):
Arrow's default pool (mimalloc in the wheels) held about 40 MB more RSS at the run's peak
than the system pool (malloc), for at most 15 MB of live Arrow buffers, at the same rate.
glibc's arena limit (2) and ``malloc_trim(0)`` every second were measured too and did
not lower the peak: they are not set.

``CONVEYOR_ARROW_MEMORY_POOL`` (docs/OPERATIONS.md): ``system`` (the default) or
``arrow`` (Arrow's own choice: mimalloc, or ``ARROW_DEFAULT_MEMORY_POOL``).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("conveyor.allocators")

ARROW_POOL_ENV = "CONVEYOR_ARROW_MEMORY_POOL"
DEFAULT_ARROW_POOL = "system"
ARROW_POOLS = ("system", "arrow")


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
