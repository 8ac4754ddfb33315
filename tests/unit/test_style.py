"""Lint, format and type checks run with the tests, so CI enforces them (CONVENTIONS.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = BIN / tool if (BIN / tool).exists() else shutil.which(tool)
    if exe is None:
        pytest.fail(f"{tool} is not installed: pip install -e '.[dev]'")
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_lint() -> None:
    r = run("ruff", "check", "conveyor", "tests", "bench")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format() -> None:
    r = run("ruff", "format", "--check", "conveyor", "tests", "bench")
    assert r.returncode == 0, "run `ruff format conveyor tests bench`:\n" + r.stdout + r.stderr


def test_mypy_core() -> None:
    r = run("mypy", "conveyor/core")
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_module_is_in_the_design_module_map() -> None:
    """docs/DESIGN.md's module map names every module of the package, and nothing that is gone."""
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    section = design.split("## Module map", 1)[1].split("\n## ", 1)[0]
    mapped = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    modules = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "conveyor").rglob("*.py")
        if p.name != "__init__.py"
    }
    assert not modules - mapped, f"add to docs/DESIGN.md's module map: {sorted(modules - mapped)}"
    assert not mapped - modules, f"gone, remove from the module map: {sorted(mapped - modules)}"
