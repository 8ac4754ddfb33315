"""The code location loads from specs, broken ones included, and builds the lineage graph."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import AssetKey

from conveyor.core.model import ConnectorStatus
from conveyor.store.meta import MetaStore

GOOD = """
name: {name}
source: {{topics: [{topic}]}}
sink: {{type: localfile, path: {path}}}
"""


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    connectors = tmp_path / "connectors"
    connectors.mkdir()
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_CONNECTORS_DIR", str(connectors))
    monkeypatch.delenv("CONVEYOR_META_URL", raising=False)
    return connectors


def build():
    from conveyor.dagster.definitions import build_defs

    return build_defs()


def test_code_location_loads_with_broken_specs_and_reports_them(env: Path, tmp_path: Path):
    (env / "orders.yaml").write_text(
        GOOD.format(name="orders", topic="orders", path=tmp_path / "out1")
    )
    (env / "clicks.yaml").write_text(
        GOOD.format(name="clicks", topic="clicks", path=tmp_path / "out2")
    )
    (env / "broken_yaml.yaml").write_text("name: broken_yaml\nsource: {topics: [x]\n")
    (env / "missing_field.yaml").write_text(
        "name: missing_field\nsink: {type: localfile, path: x}\n"
    )
    (env / "unknown_sink.yaml").write_text(
        "name: unknown_sink\nsource: {topics: [x]}\nsink: {type: postgress, table: t}\n"
    )
    defs = build()
    jobs = {j.name for j in defs.resolve_all_job_defs()}
    assert {"connector__orders", "connector__clicks"} <= jobs
    # Loading the code location reads files only: no meta store yet.
    assert not (tmp_path / "meta.db").exists()
    # The scheduler sensor syncs the files into the store on its next tick.
    from conveyor.config.specs import sync_files
    from conveyor.dagster.sensors.scheduler import SpecSources

    store = MetaStore()
    sync_files(store, SpecSources(env).scan())
    rows = {r.name: r for r in store.list()}
    assert rows["orders"].status == ConnectorStatus.IDLE
    bad = {n: rows[n] for n in ("broken_yaml", "missing_field", "unknown_sink")}
    assert all(r.status == ConnectorStatus.ERROR for r in bad.values())
    assert "broken_yaml.yaml: invalid YAML at line" in bad["broken_yaml"].last_error
    assert (
        "missing_field.yaml" in bad["missing_field"].last_error
        and "source: Field required" in bad["missing_field"].last_error
    )
    assert (
        "unknown sink type 'postgress'; did you mean 'postgres'?" in bad["unknown_sink"].last_error
    )


def test_asset_graph_for_two_connectors(env: Path, tmp_path: Path):
    (env / "orders.yaml").write_text(
        GOOD.format(name="orders", topic="orders", path=tmp_path / "o")
    )
    (env / "clicks.yaml").write_text(
        GOOD.format(name="clicks", topic="clicks", path=tmp_path / "c")
    )
    defs = build()
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert {"kafka/orders", "kafka/clicks", "dead_letters/orders", "dead_letters/clicks"} <= keys
    sink_keys = [k for k in graph.get_all_asset_keys() if k.path[0] == "localfile"]
    assert len(sink_keys) == 2
    for sk in sink_keys:
        node = graph.get(sk)
        [dep] = node.parent_keys
        assert dep.path[0] == "kafka"
        connector = dep.path[1]
        assert node.group_name == f"connector_{connector}"
        assert graph.get(AssetKey(["dead_letters", connector])).parent_keys == {sk}


def test_settings_from_the_environment_are_dagster_env_vars(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from dagster import EnvVar

    monkeypatch.setenv("CONVEYOR_META_URL", f"sqlite:///{tmp_path / 'other.db'}")
    monkeypatch.setenv("CONVEYOR_KAFKA_BOOTSTRAP", "k1:9092")
    monkeypatch.delenv("CONVEYOR_SPARK_REMOTE", raising=False)
    defs = build()
    resource = defs.resources["conveyor"]
    # The UI shows the variable's name, not the URL (it may hold a password).
    assert (
        isinstance(resource.meta_url, EnvVar)
        and resource.meta_url.env_var_name == "CONVEYOR_META_URL"
    )
    assert isinstance(resource.kafka_bootstrap, EnvVar)
    assert resource.spark_remote is None  # unset variables stay unset
    assert not (tmp_path / "other.db").exists()  # and loading opened no store
