"""The run process's allocator settings (conveyor/jobs/allocators.py).

Arena counts are read from ``malloc_info``'s XML in a fresh interpreter whose threads
each allocate once (glibc gives a new thread a new arena while under its limit): with
the limit the process has at most that many arenas, without it more (the control case,
which shows the check can fail). No sizes or timings are asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from conveyor.jobs import allocators

pytestmark = pytest.mark.skipif(allocators.glibc() is None, reason="glibc Linux only")

ARENAS = textwrap.dedent(
    """
    import ctypes, os, sys, tempfile, threading
    import pyarrow as pa
    from conveyor.jobs import allocators

    libc = allocators.glibc()
    libc.malloc.restype = libc.fdopen.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    with allocators.run_allocators() as trimmer:
        go = threading.Barrier(8)
        def work():
            go.wait()
            for _ in range(100):
                libc.free(libc.malloc(64))
            go.wait()
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with tempfile.TemporaryFile() as f:
            out = libc.fdopen(os.dup(f.fileno()), b"w")
            libc.malloc_info(0, ctypes.c_void_p(out))
            libc.fclose(ctypes.c_void_p(out))
            f.seek(0)
            xml = f.read().decode()
        trimming = trimmer is not None and trimmer.running
        pool = pa.default_memory_pool().backend_name
    print(xml.count("<heap nr="), trimming, trimmer is not None and trimmer.running, pool)
    """
)


def arenas_and_trimmer(**env: str) -> tuple[int, bool, bool, str]:
    """Arenas after eight threads allocated, whether the trimmer ran in the block and
    after it, and Arrow's default pool in the block."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", ARENAS],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    return int(out[0]), out[1] == "True", out[2] == "True", out[3]


def test_by_default_two_arenas_a_trimmer_and_arrow_on_malloc() -> None:
    arenas, trimming, after, pool = arenas_and_trimmer()
    assert arenas <= allocators.DEFAULT_ARENA_MAX
    assert trimming  # while the block runs
    assert not after  # stopped with it
    assert pool == "system"


def test_the_defaults_can_be_turned_off() -> None:
    arenas, trimming, _, pool = arenas_and_trimmer(
        CONVEYOR_MALLOC_ARENA_MAX="0",
        CONVEYOR_MALLOC_TRIM_S="0",
        CONVEYOR_ARROW_MEMORY_POOL="arrow",
    )
    assert arenas > allocators.DEFAULT_ARENA_MAX  # eight threads, up to 8 arenas per core
    assert not trimming
    assert pool != "system"  # Arrow's own choice (mimalloc or jemalloc in the wheels)


def test_a_bad_setting_falls_back_to_the_default() -> None:
    arenas, trimming, _, pool = arenas_and_trimmer(
        CONVEYOR_MALLOC_ARENA_MAX="two", CONVEYOR_ARROW_MEMORY_POOL="jemalloc"
    )
    assert arenas <= allocators.DEFAULT_ARENA_MAX
    assert trimming
    assert pool == "system"


def test_the_trimmer_trims_until_stopped() -> None:
    libc = allocators.glibc()
    assert libc is not None
    trimmer = allocators.Trimmer(libc, 0.01).start()
    try:
        for _ in range(500):
            if trimmer.trims >= 2:
                break
            trimmer._stop.wait(0.01)
    finally:
        trimmer.stop()
    trims = trimmer.trims
    assert trims >= 2
    assert not trimmer.running


def test_the_connector_op_runs_its_connector_with_the_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In the run process: the op's body (run_connector) runs with Arrow on malloc and the
    trimmer thread on, and the trimmer ends with it."""
    import pyarrow as pa

    from conveyor.jobs import connector
    from conveyor.resources.conveyor import ConveyorResource
    from conveyor.specs import LoadedSpec

    for env in (allocators.ARENA_MAX_ENV, allocators.TRIM_ENV, allocators.ARROW_POOL_ENV):
        monkeypatch.delenv(env, raising=False)
    seen: dict[str, object] = {}

    def run_connector(context: object, conveyor: object, name: str, ls: object) -> None:
        seen["pool"] = pa.default_memory_pool().backend_name
        seen["trimming"] = any(t.name == "conveyor-malloc-trim" for t in threading.enumerate())

    monkeypatch.setattr(connector, "run_connector", run_connector)
    before = pa.default_memory_pool()
    try:
        job = connector.connector_job(LoadedSpec(name="c1", source="c1.yaml", error="unused"))
        result = job.execute_in_process(
            resources={"conveyor": ConveyorResource(meta_url=f"sqlite:///{tmp_path / 'm.db'}")}
        )
    finally:
        pa.set_memory_pool(before)
    assert result.success
    assert seen == {"pool": "system", "trimming": True}
    assert not any(t.name == "conveyor-malloc-trim" for t in threading.enumerate())
