"""Automatic replay of dead letters under a real ``dagster dev`` (daemon, sensors).

Nobody launches anything: the scheduler sensor starts the connector; a poison message
(a CHECK violation) is dead-lettered while the other 199 are delivered; the
constraint is then dropped, and ``conveyor_dead_letter_replay`` launches the replay
job by itself once the connector has been healthy for ``replay_after_s``. The dead
letter is delivered and the store drains.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg2
import pytest
import yaml

from conveyor.core.model import ConnectorStatus
from tests.e2e.conftest import SETTLE_S, produce, wait_for
from tests.e2e.test_scheduler_e2e import dev, spec  # noqa: F401 - the dagster dev fixture
from tests.integration.test_failure_policies import rows

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

N = 200
POISON = 100


def test_dead_letters_are_replayed_by_the_sensor_once_the_connector_is_healthy(
    dev,  # noqa: F811
    tansu,
    pg_url,
    pg_schema,
):
    from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

    from conveyor.spark.deadletters import SparkParquetDeadLetters
    from conveyor.spark.session import spark_session

    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{pg_schema}".orders (id BIGINT PRIMARY KEY, name TEXT, amount DOUBLE PRECISION CHECK (amount >= 0))'
        )
    topic = f"ar_{uuid.uuid4().hex[:8]}"
    produce(
        tansu,
        topic,
        N,
        partitions=1,
        payload=lambda i: json.dumps(
            {"id": i, "name": "n", "amount": -1 if i == POISON else i}
        ).encode(),
    )
    name = f"ar_{uuid.uuid4().hex[:6]}"
    dl_dir = Path(dev.home["home"]) / "dl" / name
    s = spec(
        name,
        topic,
        pg_url,
        pg_schema,
        "orders",
        failure={
            "policy": "dead_letter",
            "retries": 0,
            "dead_letter": {"path": str(dl_dir), "auto_replay": True, "replay_after_s": 20},
        },
    )
    s["sink"]["create_table"] = False
    (Path(dev.home["connectors"]) / f"{name}.yaml").write_text(yaml.safe_dump(s, sort_keys=False))

    h = dev.start()
    wait_for(
        lambda: sum(h.store.committed_offsets(name).values()) == N,
        240,
        "every offset committed, past the poison message",
    )
    wait_for(
        lambda: h.store.get(name).counters.get("dead_lettered") == 1, SETTLE_S, "1 dead letter"
    )
    assert h.store.get(name).status == ConnectorStatus.RUNNING
    assert rows(pg_url, pg_schema) == [i for i in range(N) if i != POISON]
    dead_letters = SparkParquetDeadLetters(
        dl_dir, lambda: spark_session(h.env["CONVEYOR_SPARK_REMOTE"])
    )
    assert [p["offset"] for p in dead_letters.pending().to_pylist()] == [POISON]

    # The cause is fixed; nobody replays by hand. The sensor (30 s interval) launches the
    # replay once the connector has been Running for replay_after_s (20 s).
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'ALTER TABLE "{pg_schema}".orders DROP CONSTRAINT orders_amount_check')
    wait_for(lambda: rows(pg_url, pg_schema) == list(range(N)), 150, "the dead letter replayed")
    wait_for(lambda: dead_letters.count() == 0, SETTLE_S, "the dead-letter store drained")

    instance = DagsterInstance.from_config(h.env["DAGSTER_HOME"])
    replays = instance.get_runs(RunsFilter(job_name=f"replay_dead_letters__{name}"))
    assert len(replays) == 1, [r.run_id for r in replays]
    assert replays[0].tags.get("dagster/sensor_name") == "conveyor_dead_letter_replay"
    wait_for(
        lambda: instance.get_run_by_id(replays[0].run_id).status == DagsterRunStatus.SUCCESS,
        SETTLE_S,
        "the replay run succeeded",
    )
    # The connector kept running throughout, and delivered nothing twice.
    assert h.store.get(name).status == ConnectorStatus.RUNNING
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT count(*) FROM "{pg_schema}".orders')
        assert cur.fetchone()[0] == N
