"""Connectors as Dagster components, through the real ``dg`` CLI on a fresh project.

``dg scaffold defs`` writes the two component types, ``dg check defs`` validates them
with Conveyor's rules (a bad field fails naming it), ``dg list defs`` shows the
connector's job, assets and the scheduler; the scheduler's rescan and a run's reload of
its own spec read the same ``defs.yaml``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conveyor.config.specs import load_source
from conveyor.dagster.sensors.scheduler import SpecSources

PYPROJECT = """\
[project]
name = "dgdemo"
version = "0.1.0"
requires-python = ">=3.10"

[tool.dg]
directory_type = "project"

[tool.dg.project]
root_module = "dgdemo"
"""

DEFINITIONS = """\
from pathlib import Path

from dagster import definitions, load_from_defs_folder


@definitions
def defs():
    return load_from_defs_folder(path_within_project=Path(__file__).parent)
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "dgdemo"
    pkg = root / "src" / "dgdemo"
    (pkg / "defs").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "__init__.py").write_text("")
    (pkg / "defs" / "__init__.py").write_text("")
    (pkg / "definitions.py").write_text(DEFINITIONS)
    return root


def dg(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")},
        "CONVEYOR_HOME": str(project / ".conveyor"),
        "PYTHONPATH": str(project / "src"),
        "COLUMNS": "250",
        "NO_COLOR": "1",
    }
    exe = str(Path(sys.executable).parent / "dg")
    return subprocess.run(
        [exe, *args], cwd=project, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # runs `dg` scaffold and check in subprocesses (about 35 s): CI's -m slow run
def test_scaffold_check_and_list_connectors_declared_as_components(project: Path) -> None:
    defs = project / "src" / "dgdemo" / "defs"
    r = dg(
        project, "scaffold", "defs", "conveyor.dagster.components.ConnectorComponent", "orders_out"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # Without the platform component the connector would do nothing: said, not silent.
    r = dg(project, "check", "defs")
    assert r.returncode != 0
    assert "has no conveyor.dagster.components.ConveyorComponent" in r.stdout + r.stderr

    r = dg(project, "scaffold", "defs", "conveyor.dagster.components.ConveyorComponent", "conveyor")
    assert r.returncode == 0, r.stdout + r.stderr
    spec_file = defs / "orders_out" / "defs.yaml"
    doc = yaml.safe_load(spec_file.read_text())
    assert doc["type"] == "conveyor.dagster.components.ConnectorComponent"
    # A secret as a reference: it stays one in the definitions.
    doc["attributes"]["sink"] = {
        "type": "postgres",
        "url": "${env:ORDERS_PG_URL}",
        "table": "orders",
    }
    spec_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = dg(project, "check", "defs")
    assert r.returncode == 0, r.stdout + r.stderr

    r = dg(project, "list", "defs")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in (
        "connector__orders_out",
        "conveyor_scheduler",
        "kafka/orders_out",
        "postgres/public/orders",
    ):
        assert name in r.stdout, name

    # The scheduler rescans the defs folder; a run reads its spec from the same file.
    [found] = SpecSources(None, (defs,)).scan()
    assert found.ok and found.name == "orders_out" and found.source == str(spec_file)
    again = load_source("orders_out", str(spec_file))
    assert again.ok and again.spec_hash() == found.spec_hash()
    assert (again.display() or {})["sink"]["url"] == "${env:ORDERS_PG_URL}"
    assert not (project / ".conveyor" / "meta.db").exists()  # loading touched no meta store

    # A bad field fails `dg check defs`, naming the file and the field.
    doc["attributes"]["batch"] = {"max_records": 0}
    spec_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = dg(project, "check", "defs")
    assert r.returncode != 0
    assert "batch.max_records: Input should be greater than or equal to 1" in r.stdout + r.stderr
