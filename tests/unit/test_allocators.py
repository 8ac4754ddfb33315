"""The run process's allocator (conveyor/dagster/jobs/allocators.py): Arrow on the system pool
unless told otherwise, and glibc's mmap threshold fixed, set by the connector op before
its connector runs. Pools are read
in a fresh interpreter (the setting is process-wide). No sizes or timings are asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.dagster.jobs import allocators

POOL = (
    "import pyarrow as pa\n"
    "from conveyor.dagster.jobs import allocators\n"
    "before = pa.default_memory_pool().backend_name\n"
    "print(before, allocators.use_arrow_pool(), pa.default_memory_pool().backend_name)\n"
)


def fresh(script: str, **env: str) -> list[str]:
    """What ``script`` prints in a fresh interpreter, with the run's allocator settings
    only as in ``env``."""
    unset = (allocators.ARROW_POOL_ENV, allocators.MMAP_THRESHOLD_ENV)
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()


def pools(**env: str) -> tuple[str, str, str]:
    """Arrow's pool before, the one use_arrow_pool reports, and the one in use after."""
    out = fresh(POOL, **env)
    return out[0], out[1], out[2]


def test_arrow_goes_on_the_system_pool_by_default() -> None:
    before, reported, after = pools()
    assert before != "system"  # the wheels' own default (mimalloc or jemalloc)
    assert reported == after == "system"


def test_arrow_keeps_its_own_pool_when_told() -> None:
    before, reported, after = pools(CONVEYOR_ARROW_MEMORY_POOL="arrow")
    assert reported == after == before != "system"


# After a 1 MiB block is freed, glibc's own rule raises its mmap threshold to 1 MiB and
# serves a 512 KiB block from its heap; with the threshold fixed at 128 KiB that block is
# mapped on its own (mallinfo2's hblkhd: bytes in mapped blocks).
MMAP = (
    "import ctypes\n"
    "from conveyor.dagster.jobs import allocators\n"
    "class Info(ctypes.Structure):\n"
    "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks',"
    " 'hblkhd', 'usmblks', 'fsmblks', 'uordblks', 'fordblks', 'keepcost')]\n"
    "libc = ctypes.CDLL('libc.so.6')\n"
    "libc.malloc.restype = ctypes.c_void_p\n"
    "libc.free.argtypes = [ctypes.c_void_p]\n"
    "libc.mallinfo2.restype = Info\n"
    "print(allocators.fix_mmap_threshold())\n"
    "libc.free(libc.malloc(1 << 20))\n"
    "before = libc.mallinfo2().hblkhd\n"
    "block = libc.malloc(512 << 10)\n"
    "print(libc.mallinfo2().hblkhd - before >= 512 << 10)\n"
)


def large_block_mapped(**env: str) -> tuple[str, bool]:
    """What fix_mmap_threshold returned, and whether a 512 KiB block was then mapped."""
    out = fresh(MMAP, **env)
    return out[0], out[1] == "True"


def test_large_blocks_are_mapped_and_returned_after_a_larger_one_was_freed() -> None:
    assert large_block_mapped() == ("128", True)


def test_glibcs_own_rule_is_kept_when_told_and_serves_them_from_its_heap() -> None:
    assert large_block_mapped(CONVEYOR_MALLOC_MMAP_THRESHOLD_KIB="0") == ("None", False)


@pytest.mark.parametrize("raw", ["lots", "-1", "99999999"])
def test_a_bad_mmap_threshold_falls_back_to_the_default(raw: str) -> None:
    assert large_block_mapped(CONVEYOR_MALLOC_MMAP_THRESHOLD_KIB=raw) == ("128", True)


def test_an_unknown_pool_falls_back_to_the_system_one() -> None:
    _, reported, after = pools(CONVEYOR_ARROW_MEMORY_POOL="jemalloc")
    assert reported == after == "system"


@pytest.mark.parametrize(
    ("module", "builder", "body"),
    [
        ("connector", "connector_job", "run_connector"),
        ("source_connector", "source_connector_job", "run_source_connector"),
    ],
    ids=["sink connector", "source connector"],
)
def test_the_connector_op_sets_the_pool_before_its_connector_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, module: str, builder: str, body: str
) -> None:
    import importlib

    import pyarrow as pa

    from conveyor.config.specs import LoadedSpec
    from conveyor.dagster.resources.conveyor import ConveyorResource

    jobs = importlib.import_module(f"conveyor.dagster.jobs.{module}")
    monkeypatch.delenv(allocators.ARROW_POOL_ENV, raising=False)
    seen: list[str] = []
    thresholds: list[int | None] = []
    fix = allocators.fix_mmap_threshold
    monkeypatch.setattr(allocators, "fix_mmap_threshold", lambda: thresholds.append(fix()))

    def run(context: object, conveyor: object, name: str, ls: object) -> None:
        seen.append(pa.default_memory_pool().backend_name)
        assert thresholds == [128]  # before the connector runs

    monkeypatch.setattr(jobs, body, run)
    before = pa.default_memory_pool()
    try:
        job = getattr(jobs, builder)(LoadedSpec(name="c1", source="c1.yaml", error="unused"))
        result = job.execute_in_process(
            resources={"conveyor": ConveyorResource(meta_url=f"sqlite:///{tmp_path / 'm.db'}")}
        )
    finally:
        pa.set_memory_pool(before)
    assert result.success
    assert seen == ["system"]
