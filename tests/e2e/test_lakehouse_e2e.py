"""Issue 39 under a real Dagster instance: JSON orders into an Apache Iceberg table partitioned
by day (its SQL catalog on the machine's PostgreSQL, the warehouse on local disk) and into a Delta
table partitioned by a day column, each by a connector with default settings; both runs are
killed with -9 mid-stream and relaunched; at the end each table, read back with pyiceberg /
deltalake and with DuckDB's Parquet reader over the files the table lists, holds every id
exactly once (count = distinct = produced): the table's own commits carry the offsets, which
win over the meta store's on start, and a replayed batch adds nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from tests.conftest import PG_URL
from tests.e2e.conftest import FINISHED, DagsterHarness, produce, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

N = int(os.environ.get("CONVEYOR_E2E_LAKEHOUSE_N", "400000"))
PG_CATALOG = "postgresql+psycopg2://" + PG_URL.split("://", 1)[1]
TRANSFORM = {
    "decode": "json",
    "schema": "id BIGINT, name STRING, amount DOUBLE, ordered_at STRING",
    "select": [
        "id",
        "name",
        "amount",
        "CAST(ordered_at AS TIMESTAMP) AS ordered_at",
        "to_date(CAST(ordered_at AS TIMESTAMP)) AS day",
    ],
}


def order(i: int) -> bytes:
    day = 1 + i % 3
    return json.dumps(
        {"id": i, "name": f"n{i}", "amount": i * 0.5, "ordered_at": f"2026-11-0{day}T12:00:00Z"}
    ).encode()


def iceberg_ids(home: Path, namespace: str) -> list[int]:
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    catalog = load_catalog(
        "conveyor", type="sql", uri=PG_CATALOG, warehouse=f"file://{home / 'warehouse'}"
    )
    try:
        table = catalog.load_table((namespace, "orders"))
    except (NoSuchTableError, NoSuchNamespaceError):
        return []
    return table.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist()


def delta_ids(path: Path) -> list[int]:
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return DeltaTable(str(path)).to_pyarrow_table(columns=["id"]).column("id").to_pylist()
    except TableNotFoundError:
        return []


def duckdb_count(files: list[str]) -> tuple[int, int]:
    import duckdb

    listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    return duckdb.sql(
        f"SELECT count(*), count(DISTINCT id) FROM read_parquet([{listed}])"
    ).fetchall()[0]


def kill_run(dagster: DagsterHarness, name: str, run_id: str) -> None:
    """kill -9 of the connector's run process; the run is marked failed (no daemon here)."""
    row = dagster.store.get(name)
    assert row.run_id == run_id and row.run_pid, row
    os.kill(row.run_pid, signal.SIGKILL)
    with dagster.instance() as inst:
        run = inst.get_run_by_id(run_id)
        assert run is not None
        wait_for(lambda: not _alive(row.run_pid), 30, "the run process gone")
        inst.report_run_failed(run, message="test: kill -9")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_kill_9_mid_stream_leaves_every_order_once_in_iceberg_and_delta(
    dagster: DagsterHarness, tansu: str
) -> None:
    tag = uuid.uuid4().hex[:6]
    topic, namespace = f"lake_{tag}", f"e2e_{tag}"
    delta_path = dagster.home / "delta" / f"orders_{tag}"
    first = N // 2  # the rest after the kills: each relaunched run commits rows of its own
    produce(tansu, topic, first, partitions=3, payload=order)
    specs = {
        f"ice_{tag}": {
            "type": "iceberg",
            "catalog": {"type": "sql", "uri": PG_CATALOG},
            "warehouse": str(dagster.home / "warehouse"),
            "namespace": namespace,
            "table": "orders",
            "partition_by": [{"column": "ordered_at", "transform": "day"}],
        },
        f"dl_{tag}": {"type": "delta", "path": str(delta_path), "partition_by": ["day"]},
    }
    for name, sink in specs.items():
        dagster.write_spec(
            {"name": name, "source": {"topics": [topic]}, "transform": TRANSFORM, "sink": sink}
        )
    dagster.reload()
    ids = {
        f"ice_{tag}": lambda: iceberg_ids(dagster.home, namespace),
        f"dl_{tag}": lambda: delta_ids(delta_path),
    }
    runs = {name: dagster.launch(name) for name in specs}
    try:
        # kill -9 of each run once its table holds some of the stream, then relaunch
        for name in specs:
            wait_for(lambda n=name: len(ids[n]()) >= N // 8, 300, f"{name}: an eighth landed")
            kill_run(dagster, name, runs[name])
            runs[name] = dagster.launch(name)
            dagster.wait_status(runs[name], {"STARTED", *FINISHED})
        produce(tansu, topic, N - first, partitions=3, start=first, payload=order)
        for name in specs:
            wait_for(lambda n=name: len(ids[n]()) >= N, 600, f"{name}: every order landed")
        for name in specs:
            got = ids[name]()
            assert len(got) == N and len(set(got)) == N and min(got) == 0 and max(got) == N - 1, (
                name
            )
    finally:
        for run in runs.values():
            # A run still starting cannot be terminated: once it has started, it can.
            with contextlib.suppress(AssertionError):
                dagster.wait_status(run, {"STARTED", *FINISHED})
            with contextlib.suppress(Exception):  # ended already
                dagster.terminate(run)
        for run in runs.values():
            dagster.wait_status(run, FINISHED)
    # The sink assets' materializations carry the table's last commit (snapshot / version): a
    # run reports the commits it made (the killed run may have made its one commit, of all it
    # had read, just before the kill: the relaunched runs had the second half to commit).
    from dagster import AssetKey

    with dagster.instance() as inst:
        for key, field in (
            (["iceberg", namespace, "orders"], "table_snapshot"),
            (["delta", f"orders_{tag}"], "table_snapshot"),
        ):
            records = inst.fetch_materializations(AssetKey(key), limit=10_000).records
            seen = [r.asset_materialization.metadata for r in records if r.asset_materialization]
            assert any(field in m and "table_rows_added" in m for m in seen), (key, seen[:2])
    # The files each table lists, read by another engine: the same rows, once each.
    from deltalake import DeltaTable
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog(
        "conveyor", type="sql", uri=PG_CATALOG, warehouse=f"file://{dagster.home / 'warehouse'}"
    )
    table = catalog.load_table((namespace, "orders"))
    files = [t.file.file_path.removeprefix("file://") for t in table.scan().plan_files()]
    assert duckdb_count(files) == (N, N)
    spec_fields = [f.name for f in table.spec().fields]
    assert spec_fields == ["ordered_at_day"], spec_fields
    dt = DeltaTable(str(delta_path))
    assert dt.metadata().partition_columns == ["day"]
    assert duckdb_count(dt.file_uris()) == (N, N)
