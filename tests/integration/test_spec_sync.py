"""What the scheduler sensor does with the spec files each tick (``specs.sync_files``), on a
real meta store: new, changed, invalid, removed and restored files, and old CLI rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conveyor.config.specs import REMOVED, sync_files
from conveyor.core.model import ConnectorStatus, DesiredState, TopicPartition
from conveyor.dagster.sensors.scheduler import SpecSources, location_fingerprint
from conveyor.store.meta import MetaStore

TP = TopicPartition("orders", 0)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, MetaStore]:
    connectors = tmp_path / "connectors"
    connectors.mkdir()
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_CONNECTORS_DIR", str(connectors))
    return connectors, MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")


def write(d: Path, name: str, **over) -> Path:
    spec = {
        "name": name,
        "source": {"topics": ["orders"]},
        "sink": {
            "type": "postgres",
            "url": "postgresql://app@db/x?application_name=hunter2",
            "table": "orders",
        },
        **over,
    }
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def tick(d: Path, store: MetaStore) -> list[str]:
    return sync_files(store, SpecSources(d).scan())


def test_a_removed_file_stops_the_connector_keeps_its_offsets_and_a_restored_one_resumes(env):
    d, store = env
    path = write(d, "orders")
    tick(d, store)
    row = store.get("orders")
    assert row.status == ConnectorStatus.IDLE and row.desired == DesiredState.RUNNING
    assert "hunter2" not in (row.spec_json or "") and row.spec_source == str(path)
    g = store.claim("orders", run_id="r1", expected_generation=None, holder_alive=lambda r: False)
    store.commit("orders", g.generation, {TP: 42})
    store.heartbeat("orders", g.generation, {})

    path.unlink()
    notes = tick(d, store)
    row = store.get("orders")
    assert notes == [f"orders: spec file {path} removed, connector stopped"]
    assert row.status == ConnectorStatus.STOPPED and row.desired == DesiredState.STOPPED
    assert REMOVED in (row.spec_error or "")
    assert row.generation == g.generation + 1  # the run is fenced
    assert store.committed_offsets("orders") == {TP: 42}  # never a start from the beginning
    assert tick(d, store) == []  # said once

    write(d, "orders")
    tick(d, store)
    row = store.get("orders")
    assert row.desired == DesiredState.RUNNING and row.status == ConnectorStatus.IDLE
    assert row.spec_error is None and store.committed_offsets("orders") == {TP: 42}


def test_an_invalid_change_leaves_a_live_connector_running_on_its_last_valid_spec(env):
    d, store = env
    write(d, "orders")
    tick(d, store)
    good_hash = store.get("orders").spec_hash
    g = store.claim("orders", run_id="r1", expected_generation=None, holder_alive=lambda r: False)
    store.heartbeat("orders", g.generation, {})
    write(d, "orders", batch={"max_records": 0})
    tick(d, store)
    row = store.get("orders")
    assert row.status == ConnectorStatus.RUNNING and "batch.max_records" in (row.spec_error or "")
    assert row.spec_hash == good_hash  # the run is not asked to take anything on
    write(d, "orders", batch={"max_records": 50})
    tick(d, store)
    row = store.get("orders")
    assert row.spec_error is None and row.spec_hash != good_hash  # the run takes this one on


def test_a_connector_an_older_conveyor_kept_only_in_the_store_gets_a_file(env):
    d, store = env
    spec = {
        "name": "legacy",
        "source": {"topics": ["t"]},
        "sink": {"type": "localfile", "path": "x"},
    }
    store.sync_spec("legacy", spec_json=json.dumps(spec), spec_hash="old", source="cli", error=None)
    notes = tick(d, store)
    assert notes == [f"legacy: spec moved from the meta store to {d / 'legacy.yaml'}"]
    assert yaml.safe_load((d / "legacy.yaml").read_text()) == spec
    tick(d, store)
    assert store.get("legacy").spec_source == str(d / "legacy.yaml")


def test_only_changes_the_code_location_shows_call_for_a_reload(env):
    d, _ = env
    write(d, "orders")
    before = location_fingerprint(SpecSources(d).scan())
    write(d, "orders", batch={"max_records": 10}, transform={"filter": "amount > 0"})
    assert location_fingerprint(SpecSources(d).scan()) == before  # taken on by the run itself
    write(d, "orders", sink={"type": "postgres", "url": "${env:PG}", "table": "orders"})
    assert location_fingerprint(SpecSources(d).scan()) != before  # the sink asset's metadata
    write(d, "clicks")
    assert location_fingerprint(SpecSources(d).scan()) != before  # a new job
