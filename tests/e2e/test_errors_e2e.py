"""Bad input through Dagster: each ends with a clear message and the connector in Error."""

from __future__ import annotations

import json
import uuid

import pytest

from conveyor.core.model import ConnectorStatus
from conveyor.ports import free_port
from tests.e2e.conftest import DagsterHarness, produce, wait_for
from tests.e2e.test_connector_e2e import pg_spec

pytestmark = pytest.mark.e2e


def run_to_error(dagster: DagsterHarness, spec: dict) -> tuple[str, str]:
    dagster.write_spec(spec)
    dagster.reload()
    run_id = dagster.launch(spec["name"])
    assert dagster.wait_status(run_id, {"FAILURE", "SUCCESS", "CANCELED"}, 120) == "FAILURE"
    row = dagster.store.get(spec["name"])
    assert row.status == ConnectorStatus.ERROR
    return row.last_error or "", dagster.failure_message(run_id)


def test_missing_table(dagster, tansu, topic_name, pg_url, pg_schema):
    produce(tansu, topic_name, 10)
    spec = pg_spec(f"err_{uuid.uuid4().hex[:6]}", topic_name, pg_url, pg_schema)
    spec["sink"]["create_table"] = False
    error, log = run_to_error(dagster, spec)
    assert f'table "{pg_schema}"."orders" does not exist' in error
    assert "create_table: true" in error and error in log


def test_postgres_unreachable(dagster, tansu, topic_name, pg_schema):
    produce(tansu, topic_name, 10)
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/test"
    spec = pg_spec(
        f"err_{uuid.uuid4().hex[:6]}",
        topic_name,
        dead,
        pg_schema,
        retry={"delay": 0.2, "max_outage": 2, "jitter": "none"},
    )
    dagster.write_spec(spec)
    dagster.reload()
    run_id = dagster.launch(spec["name"])
    # Degraded while it retries, then Error once the outage budget (and the op's retries) are spent.
    assert dagster.wait_status(run_id, {"FAILURE", "SUCCESS", "CANCELED"}, 120) == "FAILURE"
    row = dagster.store.get(spec["name"])
    assert row.status == ConnectorStatus.ERROR
    assert "PostgreSQL unreachable" in row.last_error and "init sink kept failing" in row.last_error
    history = [h.to_status for h in dagster.store.history(spec["name"], 100)]
    assert "Degraded" in history


def test_non_json_payload_with_json_decoding(dagster, tansu, topic_name, pg_url, pg_schema):
    produce(
        tansu,
        topic_name,
        20,
        partitions=1,
        payload=lambda i: (
            b"<xml/>" if i == 7 else json.dumps({"id": i, "name": "n", "amount": 1}).encode()
        ),
    )
    spec = pg_spec(f"err_{uuid.uuid4().hex[:6]}", topic_name, pg_url, pg_schema)
    error, _ = run_to_error(dagster, spec)
    assert (
        f"message {topic_name}[0]@7 failed (decode): undecodable payload: not valid JSON" in error
    )
    assert "failure policy is 'fail'" in error
    # Nothing after the bad message was committed.
    assert sum(dagster.store.committed_offsets(spec["name"]).values()) <= 7


def test_bad_filter_expression_is_a_config_error(dagster, tansu, topic_name, pg_url, pg_schema):
    produce(tansu, topic_name, 5)
    spec = pg_spec(
        f"err_{uuid.uuid4().hex[:6]}",
        topic_name,
        pg_url,
        pg_schema,
        transform={"filter": "no_such_column > 1"},
    )
    error, _ = run_to_error(dagster, spec)
    assert "transform: Spark rejected the transform" in error and "no_such_column" in error


def test_poison_message_under_dead_letter_policy(dagster, tansu, topic_name, pg_url, pg_schema):
    """999 rows delivered, 1 dead letter with the exact offset and error, offsets advance."""
    import psycopg2

    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{pg_schema}".orders (id BIGINT PRIMARY KEY, name TEXT NOT NULL, amount DOUBLE PRECISION CHECK (amount >= 0))'
        )
    produce(
        tansu,
        topic_name,
        1000,
        partitions=1,
        payload=lambda i: json.dumps(
            {"id": i, "name": "n", "amount": -1 if i == 500 else i}
        ).encode(),
    )
    name = f"dl_{uuid.uuid4().hex[:6]}"
    spec = pg_spec(
        name, topic_name, pg_url, pg_schema, batch={"max_records": 1000, "max_wait_ms": 1000}
    )
    spec["failure"] = {
        "policy": "dead_letter",
        "retries": 1,
        "dead_letter": {"path": str(dagster.home / "dl" / name)},
    }
    dagster.write_spec(spec)
    dagster.reload()
    run_id = dagster.launch(name)
    wait_for(
        lambda: sum(dagster.store.committed_offsets(name).values()) == 1000,
        120,
        "offsets past the poison message",
    )
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT count(*), bool_or(id = 500) FROM "{pg_schema}".orders')
        assert cur.fetchone() == (999, False)
    from conveyor.deadletters import SparkParquetDeadLetters
    from conveyor.spark.session import spark_session

    dl = SparkParquetDeadLetters(
        dagster.home / "dl" / name, lambda: spark_session(dagster.env["CONVEYOR_SPARK_REMOTE"])
    )
    pending = dl.pending().to_pylist()
    assert [(p["topic"], p["partition"], p["offset"], p["attempts"]) for p in pending] == [
        (topic_name, 0, 500, 2)
    ]
    assert "orders_amount_check" in pending[0]["error"] and pending[0]["error_class"] == "data"
    assert json.loads(pending[0]["value"]) == {"id": 500, "name": "n", "amount": -1}
    wait_for(lambda: dagster.store.get(name).counters.get("dead_lettered") == 1, 10, "counter")
    dagster.terminate(run_id)
    dagster.wait_status(run_id, {"CANCELED"}, 60)

    # Replay after fixing the constraint: the dead letter is delivered and the store drains.
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'ALTER TABLE "{pg_schema}".orders DROP CONSTRAINT orders_amount_check')
    replay = dagster.client.submit_job_execution(
        f"replay_dead_letters__{name}", repository_location_name="conveyor"
    )
    assert dagster.wait_status(replay, {"SUCCESS", "FAILURE"}, 120) == "SUCCESS", dagster.run_log(
        replay
    )
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT count(*), bool_or(id = 500) FROM "{pg_schema}".orders')
        assert cur.fetchone() == (1000, True)
    assert dl.count() == 0
    from dagster import AssetKey

    ev = dagster.instance().get_latest_materialization_event(AssetKey(["dead_letters", name]))
    assert ev.asset_materialization.metadata["count"].value == 0
