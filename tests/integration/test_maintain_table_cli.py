"""``conveyor maintain-table NAME``: the lakehouse maintenance job from the CLI, on a connector
applied with ``conveyor connector apply`` whose Iceberg and Delta tables the sinks wrote in many
small commits: the data files go down, the rows and the connector's offsets stay; a connector
without a table, an unknown one and a failing table say so in one line."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from conveyor.control.cli import main
from tests.integration.test_lakehouse_maintenance import ROWS, target_offsets, write_batches

pytest.importorskip("pyiceberg")
pytest.importorskip("deltalake")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_CONNECTORS_DIR", str(tmp_path / "connectors"))
    return tmp_path


def cli(home: Path, *args: str) -> Any:
    return CliRunner(env={"COLUMNS": "200"}).invoke(
        main, ["--meta-url", f"sqlite:///{home / 'meta.db'}", *args], catch_exceptions=False
    )


def apply(home: Path, name: str, sink: dict[str, Any]) -> None:
    spec = {"name": name, "source": {"topics": ["orders"]}, "sink": sink}
    path = home / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = cli(home, "connector", "apply", "-f", str(path))
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("kind", ["iceberg", "delta"])
def test_maintain_table_compacts_and_keeps_rows_and_offsets(home: Path, kind: str) -> None:
    name = f"{kind}_{uuid.uuid4().hex[:6]}"
    sink: dict[str, Any] = (
        {"type": "iceberg", "namespace": "cli", "table": name, "message_columns": True}
        if kind == "iceberg"
        else {"type": "delta", "path": f"lake/{name}", "message_columns": True}
    )
    apply(home, name, sink)
    write_batches(sink, name, 12)  # 12 table commits, as the loop makes them
    offsets = target_offsets(sink, name)
    r = cli(home, "maintain-table", name, "--retention-hours", "0")
    assert r.exit_code == 0, r.output
    assert f"{name}: data files 12 -> 1, {12 * ROWS} rows, compacted" in r.output
    assert target_offsets(sink, name) == offsets
    # Nothing left to compact: it says so.
    r = cli(home, "maintain-table", name, "--no-compact")
    assert r.exit_code == 0 and f"data files 1 -> 1, {12 * ROWS} rows, not compacted" in r.output


def test_maintain_table_refuses_what_has_no_table_in_one_line(home: Path) -> None:
    apply(home, "pg", {"type": "postgres", "url": "postgresql://u@127.0.0.1/x", "table": "t"})
    r = CliRunner().invoke(
        main, ["--meta-url", f"sqlite:///{home / 'meta.db'}", "maintain-table", "pg"]
    )
    assert r.exit_code == 1
    assert "pg: no table to maintain (its sink is postgres; only iceberg and delta)" in r.output
    r = CliRunner().invoke(
        main, ["--meta-url", f"sqlite:///{home / 'meta.db'}", "maintain-table", "nope"]
    )
    assert r.exit_code == 1 and "connector 'nope' not found" in r.output


def test_a_failing_table_is_one_line_without_the_catalogs_password(home: Path) -> None:
    """The catalog is unreachable (a closed port): one line, its password never shown."""
    from tests.sinks.contract import closed_port

    secret_file = home / "secrets" / "pw"
    secret_file.parent.mkdir()
    secret_file.write_text("s3cr3t-pw")
    uri = f"postgresql+psycopg2://lake:${{file:{secret_file}}}@127.0.0.1:{closed_port()}/lake"
    apply(home, "ice", {"type": "iceberg", "namespace": "n", "table": "t", "catalog": {"uri": uri}})
    r = CliRunner().invoke(
        main, ["--meta-url", f"sqlite:///{home / 'meta.db'}", "maintain-table", "ice"]
    )
    assert r.exit_code == 1 and "ice: table maintenance failed:" in r.output, r.output
    assert "s3cr3t-pw" not in r.output and "Traceback" not in r.output
