"""Lakehouse tables a query engine likes, under a real Dagster instance: 150,000 JSON orders
(1,500 before, then the rest produced live at 1,500/s) into an Iceberg table (its SQL catalog on
the machine's PostgreSQL) and a Delta table, both partitioned by day (three days), by connectors
whose sinks keep their default cadence (a table commit a minute). Each run is killed with -9 once
mid-stream, with rows buffered after a commit of the stream's, and relaunched.

At the end each table holds every order exactly once (pyiceberg / deltalake, and DuckDB's
Parquet reader over the files the table lists), in at most a few dozen data files (one a day
partition a commit: about three commits, against one a batch before), and its commits are
counted; the figures are printed for docs/BENCHMARKS.md."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from typing import Any

import pytest

from tests.e2e.conftest import FINISHED, DagsterHarness, produce, wait_for
from tests.e2e.test_lakehouse_e2e import (
    PG_CATALOG,
    TRANSFORM,
    delta_ids,
    duckdb_count,
    iceberg_ids,
    kill_run,
    order,
)

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1500)]

N = 150_000
WARM = 1_500  # produced before: the first table commit holds them (the runs are up)
RATE = 1_500.0
MAX_FILES = 36  # "a few dozen"


def produce_live(bootstrap: str, topic: str, done: threading.Event, errors: list[Any]) -> None:
    """Orders ``WARM`` to ``N`` at ``RATE`` a second over three partitions (0.1 s slices)."""
    from kafka import KafkaProducer

    try:
        p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20)
        began, i = time.monotonic(), WARM
        while i < N:
            due = min(N, WARM + int((time.monotonic() - began) * RATE) + 150)
            for j in range(i, due):
                p.send(topic, key=str(j).encode(), value=order(j), partition=j % 3)
            i = due
            time.sleep(0.1)
        p.flush()
        p.close()
    except BaseException as e:  # noqa: BLE001 - handed to the test's thread
        errors.append(e)
    finally:
        done.set()


def iceberg_table(dagster: DagsterHarness, namespace: str) -> Any:
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog(
        "conveyor", type="sql", uri=PG_CATALOG, warehouse=f"file://{dagster.home / 'warehouse'}"
    )
    return catalog.load_table((namespace, "orders"))


def test_150000_rows_at_1500_a_second_make_a_few_dozen_files_once_each_through_kill_9(
    dagster: DagsterHarness, tansu: str
) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    tag = uuid.uuid4().hex[:6]
    topic, namespace = f"cadence_{tag}", f"cad_{tag}"
    delta_path = dagster.home / "delta" / f"cadence_{tag}"
    admin = KafkaAdminClient(bootstrap_servers=tansu)
    admin.create_topics([NewTopic(topic, 3, 1)])
    admin.close()
    produce(tansu, topic, WARM, partitions=3, payload=order)
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
    done, errors = threading.Event(), []
    began = float("nan")
    producer = threading.Thread(target=produce_live, args=(tansu, topic, done, errors))
    at_kill: dict[str, int] = {}
    try:
        for name in specs:  # the runs are up: their first commit holds the orders produced before
            wait_for(lambda n=name: len(ids[n]()) >= WARM, 420, f"{name}: a first table commit")
        began = time.monotonic()
        producer.start()
        # kill -9 of each run once its table has had a commit of the stream's (about a minute
        # into it), while later rows are buffered
        for name in specs:
            wait_for(lambda n=name: len(ids[n]()) > WARM, 300, f"{name}: a commit of the stream")
            at_kill[name] = len(ids[name]())
            kill_run(dagster, name, runs[name])
            runs[name] = dagster.launch(name)
            dagster.wait_status(runs[name], {"STARTED", *FINISHED})
        assert all(n < N for n in at_kill.values()), at_kill  # killed mid-stream
        done.wait(600)
        assert not errors, errors
        for name in specs:
            wait_for(lambda n=name: len(ids[n]()) >= N, 600, f"{name}: every order landed")
        landed_s = time.monotonic() - began
        for name in specs:
            got = ids[name]()
            assert len(got) == N and len(set(got)) == N, (name, len(got), len(set(got)))
    finally:
        for run in runs.values():
            with contextlib.suppress(AssertionError):
                dagster.wait_status(run, {"STARTED", *FINISHED})
            with contextlib.suppress(Exception):  # ended already
                dagster.terminate(run)
        for run in runs.values():
            dagster.wait_status(run, FINISHED)
    figures = check_files(dagster, namespace, delta_path)
    print(
        f"\nlakehouse cadence: {N} rows ({WARM} before, then {RATE:g}/s), killed at {at_kill}, "
        f"every order landed {landed_s:.0f} s after the stream began"
    )
    print(json.dumps(figures, indent=1))


def check_files(dagster: DagsterHarness, namespace: str, delta_path: Any) -> dict[str, Any]:
    """Few files, each order once in the files the tables list (DuckDB); the figures."""
    from deltalake import DeltaTable

    table = iceberg_table(dagster, namespace)
    summary = table.current_snapshot().summary.additional_properties
    ice_files = [t.file.file_path.removeprefix("file://") for t in table.scan().plan_files()]
    assert duckdb_count(ice_files) == (N, N)
    dt = DeltaTable(str(delta_path))
    delta_files = dt.file_uris()
    assert duckdb_count(delta_files) == (N, N)
    figures = {
        "iceberg": {
            "data_files": int(summary["total-data-files"]),
            "snapshots": len(table.metadata.snapshots),
            "mean_file_kib": int(summary["total-files-size"]) // max(len(ice_files), 1) // 1024,
        },
        "delta": {
            "data_files": len(delta_files),
            "versions": dt.version() + 1,
        },
    }
    assert len(ice_files) <= MAX_FILES and len(delta_files) <= MAX_FILES, figures
    return figures
