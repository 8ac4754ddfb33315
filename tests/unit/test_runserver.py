"""The run server's pure parts: the code location loaded again when the spec files change,
and the launcher's reading of the server's status replies."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster._core.launcher import WorkerStatus

from conveyor.dagster.launcher import health
from conveyor.dagster.runserver import CodeLocation


@pytest.fixture
def location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CodeLocation]:
    specs = tmp_path / "connectors"
    specs.mkdir()
    monkeypatch.setenv("CONVEYOR_CONNECTORS_DIR", str(specs))
    name = f"location_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(
        "import os\nFILES = sorted(os.listdir(os.environ['CONVEYOR_CONNECTORS_DIR']))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield CodeLocation(name)
    finally:
        sys.modules.pop(name, None)


def test_the_location_is_loaded_again_only_when_a_spec_file_changes(
    location: CodeLocation, tmp_path: Path
) -> None:
    assert location.module is not None
    location.refresh()
    first = sys.modules[location.module]
    assert first.FILES == []
    location.refresh()
    assert sys.modules[location.module] is first
    (tmp_path / "connectors" / "orders.yaml").write_text("name: orders\n")
    location.refresh()
    assert sys.modules[location.module] is not first
    assert sys.modules[location.module].FILES == ["orders.yaml"]


@pytest.mark.parametrize(
    ("reply", "status"),
    [
        ({"state": "running", "pid": 7}, WorkerStatus.RUNNING),
        ({"state": "exited", "code": 0}, WorkerStatus.SUCCESS),
        ({"state": "exited", "code": -9}, WorkerStatus.FAILED),
        ({"state": "unknown"}, WorkerStatus.NOT_FOUND),
    ],
)
def test_the_servers_status_as_dagsters_run_monitoring_reads_it(
    reply: dict[str, object], status: WorkerStatus
) -> None:
    assert health(reply).status == status
