"""Lakehouse table maintenance (``conveyor.dagster.jobs.maintenance``) on real tables: an Iceberg
table (SQLite catalog, warehouse on local disk) and a Delta table written by the sinks in many
small commits, then the job ``maintain_table__<name>`` run by Dagster: compaction lowers the data
file count, expiring / vacuuming deletes files from disk, the rows are unchanged, and the offsets
the table's commits carry (``target_offsets``) are the same before and after, so a replayed batch
is still dropped and the next batch still appends."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml
from dagster import DagsterInstance

from conveyor.config.specs import load_file
from conveyor.core.positions import TargetBinding
from conveyor.core.sink import commit_held
from conveyor.dagster.jobs.maintenance import (
    MaintenanceConfig,
    is_lakehouse,
    maintain_table,
    maintenance_job,
    maintenance_job_name,
    maintenance_op_name,
)
from conveyor.sinks import build_sink
from tests.positions import offsets_of
from tests.sinks.contract import make_batch

pytest.importorskip("pyiceberg")
pytest.importorskip("deltalake")

BATCHES = 12
ROWS = 50


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    return tmp_path


def started(sink_cfg: dict[str, Any], connector: str, generation: int = 1) -> Any:
    sink = build_sink(sink_cfg)
    sink.bind(TargetBinding(connector, generation))  # type: ignore[attr-defined]
    sink.init_sink()
    return sink


def write_batches(sink_cfg: dict[str, Any], connector: str, batches: int, start: int = 0) -> None:
    """``batches`` commits of ``ROWS`` rows each (each batch committed as the loop would,
    ``commit_held``), over 2 partitions of topic ``orders``."""
    sink = started(sink_cfg, connector)
    try:
        for b in range(start, start + batches):
            batch = make_batch(ROWS, start=b * ROWS, partition=b % 2)
            assert sink.send_batch(batch).failed == ()
            commit_held(sink)
    finally:
        sink.cleanup_sink()


def target_offsets(sink_cfg: dict[str, Any], connector: str) -> Any:
    sink = build_sink(sink_cfg)
    sink.bind(TargetBinding(connector, 1))  # type: ignore[attr-defined]
    try:
        return offsets_of(sink.target_offsets())  # type: ignore[attr-defined]
    finally:
        sink.cleanup_sink()


def run_job(home: Path, name: str, sink_cfg: dict[str, Any], **config: Any) -> dict[str, Any]:
    """The maintenance job of a connector spec file, run by Dagster; its observation's metadata."""
    spec = {
        "name": name,
        "source": {"topics": ["orders"]},
        "transform": {"decode": "json", "schema": "id BIGINT, name STRING, amount DOUBLE"},
        "sink": sink_cfg,
    }
    path = home / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_file(path)
    assert loaded.ok, loaded.error
    assert is_lakehouse(loaded)
    op_name = maintenance_op_name(name)
    with DagsterInstance.ephemeral() as instance:
        result = maintenance_job(loaded).execute_in_process(
            instance=instance, run_config={"ops": {op_name: {"config": config}}}
        )
        assert result.success and result.dagster_run.job_name == maintenance_job_name(name)
        observations = [
            e.dagster_event.event_specific_data.asset_observation  # type: ignore[union-attr]
            for e in instance.all_logs(result.run_id)
            if e.is_dagster_event and e.dagster_event.event_type_value == "ASSET_OBSERVATION"  # type: ignore[union-attr]
        ]
    assert len(observations) == 1
    assert list(observations[0].asset_key.path) == build_sink(sink_cfg).config.asset_key_path()
    return {k: v.value for k, v in observations[0].metadata.items()}


def parquet_files(root: Path) -> set[Path]:
    return set(root.rglob("*.parquet"))


# -- Iceberg -------------------------------------------------------------------------------------


def iceberg_cfg() -> dict[str, Any]:
    return {
        "type": "iceberg",
        "namespace": "maint",
        "table": f"orders_{uuid.uuid4().hex[:6]}",
        "message_columns": True,
        "partition_by": [{"column": "id", "transform": "bucket[3]"}],
    }


def iceberg_table(sink_cfg: dict[str, Any]) -> Any:
    from pyiceberg.catalog import load_catalog

    from conveyor.sinks.iceberg import catalog_properties

    config = build_sink(sink_cfg).config
    catalog = load_catalog(config.catalog.name, **catalog_properties(config))  # type: ignore[attr-defined]
    return catalog.load_table((sink_cfg["namespace"], sink_cfg["table"]))


def iceberg_rows(sink_cfg: dict[str, Any]) -> list[tuple[int, str, float, int]]:
    data = iceberg_table(sink_cfg).scan().to_arrow()
    rows = zip(
        *(data.column(c).to_pylist() for c in ("id", "name", "amount", "__offset")), strict=True
    )
    return sorted(rows)


def data_files(sink_cfg: dict[str, Any]) -> int:
    snap = iceberg_table(sink_cfg).current_snapshot()
    return int(snap.summary.additional_properties["total-data-files"])


def test_iceberg_compaction_and_expiry_keep_the_rows_and_the_offsets(home: Path) -> None:
    cfg, name = iceberg_cfg(), f"ice_{uuid.uuid4().hex[:6]}"
    write_batches(cfg, name, BATCHES)
    rows, offsets = iceberg_rows(cfg), target_offsets(cfg, name)
    files, snapshots = data_files(cfg), len(iceberg_table(cfg).snapshots())
    on_disk = parquet_files(home / "iceberg")
    assert len(rows) == BATCHES * ROWS and snapshots == BATCHES and files > 3
    assert offsets is not None and sum(offsets.values()) > 0

    meta = run_job(home, name, cfg, retention_hours=0, compact_min_files=3)

    assert meta["compacted"] is True
    assert (meta["data_files_before"], meta["data_files_after"]) == (files, 3)  # one per bucket
    assert data_files(cfg) == 3 and meta["rows"] == len(rows)
    assert iceberg_rows(cfg) == rows
    assert target_offsets(cfg, name) == offsets
    # Expired: every snapshot but the compaction's last, which carries the connector's mark on.
    table = iceberg_table(cfg)
    assert meta["snapshots_expired"] == snapshots + 1  # the commits and the compaction's delete
    assert [s.snapshot_id for s in table.snapshots()] == [table.current_snapshot().snapshot_id]
    # The files only expired snapshots held are gone from disk: the small files, their
    # manifests and manifest lists; the table's files are there.
    held = {Path(p.removeprefix("file://")) for p in table.inspect.files()["file_path"].to_pylist()}
    assert parquet_files(home / "iceberg") == held and len(held) == 3
    assert meta["files_deleted"] >= len(on_disk) + snapshots
    # The sink still reads its offsets: a replayed batch adds nothing, the next one appends.
    write_batches(cfg, name, 1, start=BATCHES - 1)
    assert iceberg_rows(cfg) == rows
    write_batches(cfg, name, 1, start=BATCHES)
    assert len(iceberg_rows(cfg)) == len(rows) + ROWS
    assert target_offsets(cfg, name) != offsets


def test_iceberg_compaction_marks_only_its_append_snapshot(home: Path) -> None:
    """pyiceberg's overwrite is two snapshots: a delete (no rows) and an append (the rows).
    Only the append carries the connector's offsets; the delete is marked as maintenance."""
    from conveyor.dagster.jobs.maintenance import COMPACTION_PROP
    from conveyor.sinks.lakehouse import CommitMark

    cfg, name = iceberg_cfg(), f"ice_{uuid.uuid4().hex[:6]}"
    write_batches(cfg, name, 5)
    offsets = target_offsets(cfg, name)
    sink = build_sink(cfg)
    try:
        result = maintain_table(sink.config, MaintenanceConfig(compact_min_files=2))
    finally:
        sink.cleanup_sink()
    assert result.compacted and result.snapshots_expired == 0
    table = iceberg_table(cfg)
    append = table.current_snapshot()
    delete = table.snapshot_by_id(append.parent_snapshot_id)
    props = [s.summary.additional_properties for s in (delete, append)]
    assert [p.get(COMPACTION_PROP) for p in props] == ["compaction", "compaction"]
    assert [s.summary.operation.value for s in (delete, append)] == ["delete", "append"]
    assert CommitMark.of(props[0]) is None
    mark = CommitMark.of(props[1])
    assert mark is not None and mark.connector == name and mark.offsets == offsets
    assert target_offsets(cfg, name) == offsets


def test_iceberg_expiry_keeps_every_connectors_newest_mark(home: Path) -> None:
    """Two connectors on one table: B commits after A's last commit; A's mark is older than
    B's commits, and is still found after expiry (the chain back to it is kept)."""
    cfg = iceberg_cfg()
    write_batches(cfg, "a", 3)
    write_batches(cfg, "b", 4, start=100)
    before = {c: target_offsets(cfg, c) for c in "ab"}
    assert all(before.values())
    sink = build_sink(cfg)
    settings = MaintenanceConfig(retention_hours=0, compact=False)
    try:
        result = maintain_table(sink.config, settings)
    finally:
        sink.cleanup_sink()
    assert result.snapshots_expired == 2  # A's first two commits; A's third and B's four stay
    assert len(iceberg_table(cfg).snapshots()) == 5
    assert {c: target_offsets(cfg, c) for c in "ab"} == before
    assert len(iceberg_rows(cfg)) == 7 * ROWS


def test_iceberg_snapshots_younger_than_the_retention_stay(home: Path) -> None:
    cfg, name = iceberg_cfg(), f"ice_{uuid.uuid4().hex[:6]}"
    write_batches(cfg, name, 4)
    meta = run_job(home, name, cfg, compact=False)  # retention 168 h
    assert (meta["snapshots_expired"], meta["files_deleted"], meta["compacted"]) == (0, 0, False)
    assert len(iceberg_table(cfg).snapshots()) == 4


# -- Delta Lake ----------------------------------------------------------------------------------


def delta_cfg() -> dict[str, Any]:
    return {"type": "delta", "path": f"lake/{uuid.uuid4().hex[:6]}", "message_columns": True}


def delta_rows(home: Path, sink_cfg: dict[str, Any]) -> list[tuple[int, str, float, int]]:
    from deltalake import DeltaTable

    data: pa.Table = DeltaTable(str(home / sink_cfg["path"])).to_pyarrow_table()
    rows = zip(
        *(data.column(c).to_pylist() for c in ("id", "name", "amount", "__offset")), strict=True
    )
    return sorted(rows)


def test_delta_compaction_and_vacuum_keep_the_rows_and_the_offsets(home: Path) -> None:
    from deltalake import DeltaTable

    cfg, name = delta_cfg(), f"delta_{uuid.uuid4().hex[:6]}"
    write_batches(cfg, name, BATCHES)
    table_dir = home / cfg["path"]
    rows, offsets = delta_rows(home, cfg), target_offsets(cfg, name)
    assert len(rows) == BATCHES * ROWS and offsets is not None
    assert len(DeltaTable(str(table_dir)).file_uris()) == BATCHES
    assert len(parquet_files(table_dir)) == BATCHES

    meta = run_job(home, name, cfg, retention_hours=0)

    assert meta["compacted"] is True
    assert (meta["data_files_before"], meta["data_files_after"]) == (BATCHES, 1)
    assert meta["files_deleted"] == BATCHES and len(parquet_files(table_dir)) == 1
    assert meta["rows"] == len(rows) and delta_rows(home, cfg) == rows
    assert target_offsets(cfg, name) == offsets
    write_batches(cfg, name, 1, start=BATCHES - 1)  # a replay: dropped
    assert delta_rows(home, cfg) == rows
    write_batches(cfg, name, 1, start=BATCHES)
    assert len(delta_rows(home, cfg)) == len(rows) + ROWS


@pytest.mark.parametrize("make_cfg", [iceberg_cfg, delta_cfg])
def test_a_table_not_created_yet_is_nothing_to_do(home: Path, make_cfg: Any) -> None:
    cfg = make_cfg()
    meta = run_job(home, f"new_{uuid.uuid4().hex[:6]}", cfg, retention_hours=0)
    assert meta == {
        "data_files_before": 0,
        "data_files_after": 0,
        "rows": 0,
        "compacted": False,
        "snapshots_expired": 0,
        "files_deleted": 0,
    }


def test_a_sink_without_tables_has_no_maintenance(home: Path) -> None:
    sink = build_sink({"type": "postgres", "url": "postgresql://127.0.0.1/test", "table": "t"})
    with pytest.raises(ValueError, match="no table maintenance"):
        maintain_table(sink.config, MaintenanceConfig())


def test_maintenance_jobs_load_beside_the_connector_jobs(home: Path) -> None:
    """Conveyor's code location has a maintenance job per lakehouse connector (none for
    another sink) beside the connector jobs: no job or op name collides."""
    from conveyor.dagster.definitions import conveyor_defs
    from conveyor.dagster.sensors.scheduler import SpecSources

    sinks = {
        "lk": {"type": "iceberg", "namespace": "ns", "table": "t"},
        "dl": {"type": "delta", "path": "lake/t"},
        "pg": {"type": "postgres", "url": "postgresql://127.0.0.1/test", "table": "t"},
    }
    folder = home / "connectors"
    folder.mkdir()
    for name, sink in sinks.items():
        spec = {
            "name": name,
            "source": {"topics": ["orders"]},
            "transform": {"decode": "json", "schema": "id BIGINT"},
            "sink": sink,
        }
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    sources = SpecSources(folder)
    specs = sources.scan()
    defs = conveyor_defs(specs, sources)  # registers a maintenance job per lakehouse sink
    names = {j.name for j in defs.resolve_all_job_defs()}
    assert {"maintain_table__lk", "maintain_table__dl", "connector__pg"} <= names
    assert "maintain_table__pg" not in names
