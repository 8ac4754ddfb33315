"""A broker executor in front of a Spark standalone cluster (issue 19, point 4).

The topology of a production broker executor, from the pyspark wheel alone: a
master, two workers, and the Spark Connect server submitting to them
(``conveyor.spark.cluster``, also ``conveyor dev --spark-workers N``). A connector
launched under Dagster delivers the good messages to PostgreSQL and dead-letters the
bad ones as Parquet, written by the executors to a directory the cluster and the replay
share. The backlog is large enough for default batches to reach ``ONE_ROW_FROM`` rows:
those cross to Spark as one row and are decoded by a task on an executor; the rest of
the backlog goes as a plain relation.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conveyor.spark.cluster import SparkCluster, start_spark_cluster
from tests.e2e.conftest import (
    SETTLE_S,
    STOP_S,
    DagsterHarness,
    dagster_webserver,
    produce,
    wait_for,
)
from tests.e2e.test_connector_e2e import counts, pg_spec

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

N = 45_000
BAD = {7, 21_234, 44_999}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    with start_spark_cluster(2, work_dir=tmp_path_factory.mktemp("spark_cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def on_cluster(
    tmp_path_factory: pytest.TempPathFactory, tansu: str, cluster: SparkCluster
) -> Iterator[DagsterHarness]:
    with dagster_webserver(tmp_path_factory.mktemp("cluster_home"), tansu, cluster.remote) as h:
        yield h


def payload(i: int) -> bytes:
    if i in BAD:
        return b'{"id": ' + str(i).encode() + b", not json"
    return json.dumps({"id": i, "name": f"name {i}", "amount": i * 1.5}).encode()


def test_connector_runs_on_the_executors_of_a_standalone_cluster(
    on_cluster: DagsterHarness,
    cluster: SparkCluster,
    tansu: str,
    topic_name: str,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
) -> None:
    assert cluster.status()["aliveworkers"] == 2
    name = f"cluster_{uuid.uuid4().hex[:8]}"
    dlq = on_cluster.home / "dl" / name  # spec paths lie under $CONVEYOR_HOME
    produce(tansu, topic_name, N, payload=payload)
    on_cluster.write_spec(
        pg_spec(
            name,
            topic_name,
            pg_url,
            pg_schema,
            failure={"policy": "dead_letter", "dead_letter": {"path": str(dlq)}},
        )
    )
    on_cluster.reload()
    run = on_cluster.launch(name)
    try:
        wait_for(lambda: counts(pg_url, pg_schema) == (N - len(BAD),) * 2, 240, "good rows")

        # The dead letters are Parquet files the executors wrote into the shared directory.
        def letters() -> set[int]:
            if not (dlq / "letters").exists():
                return set()
            return set(pq.read_table(dlq / "letters").column("offset").to_pylist())

        wait_for(lambda: len(letters()) == len(BAD), SETTLE_S, "three dead letters")
        ids = {json.loads(v.split(b",")[0] + b"}")["id"] for v in _values(dlq)}
        assert ids == BAD
        # The batches ran on the cluster: the Connect server is the master's application,
        # holding executor cores, and the workers launched executors for it.
        apps = cluster.status()["activeapps"]
        assert any(a["name"] == "Spark Connect server" and a["cores"] > 0 for a in apps), apps
        executors = [d for w in cluster.work_dir.glob("worker-*") for d in w.glob("app-*/*")]
        assert executors, "no executor was launched on the workers"
        wait_for(
            lambda: on_cluster.store.get(name).counters.get("dead_lettered") == len(BAD),
            SETTLE_S,
            "the run's counters",
        )
    finally:
        on_cluster.terminate(run)
        on_cluster.wait_status(run, {"CANCELED", "FAILURE", "SUCCESS"}, STOP_S)


def _values(dlq: Path) -> list[bytes]:
    return pq.read_table(dlq / "letters").column("value").to_pylist()
