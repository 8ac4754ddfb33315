"""Bad input through Dagster: each ends with a clear message and the connector in Error."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conveyor.core.host.ports import free_port
from conveyor.core.model import ConnectorStatus
from tests.e2e.conftest import SETTLE_S, STOP_S, DagsterHarness, produce, wait_for
from tests.e2e.test_connector_e2e import pg_spec

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


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
    from conveyor.spark.deadletters import SparkParquetDeadLetters
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
    wait_for(
        lambda: dagster.store.get(name).counters.get("dead_lettered") == 1, SETTLE_S, "counter"
    )
    dagster.terminate(run_id)
    dagster.wait_status(run_id, {"CANCELED"}, STOP_S)

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


# -- issue 15: a bad message never halts, loops or duplicates ----------------------------------

HOSTILE_PAYLOADS = [
    json.dumps({"id": 90_001, "name": "nul \u0000 inside", "amount": 1}).encode(),  # PG refuses
    b"\xff\xfe\x00 not UTF-8",  # not JSON
    b"[1, 2, 3]",  # JSON, not an object
    b"null",  # JSON null, not an object
    json.dumps({"id": "not a number", "name": "x", "amount": 1}).encode(),  # wrong type
    ("[" * 3000 + "]" * 3000).encode(),  # deeply nested, not an object
    json.dumps({"id": 90_002, "name": "nul \u0000", "amount": 2}).encode(),  # PG refuses
]


def test_hostile_messages_are_dead_lettered_and_every_valid_one_delivered(
    dagster, tansu, topic_name, pg_url, pg_schema
):
    """The issue's scenario: 2,000 valid JSON messages and a few hostile ones (two with a NUL
    character, which PostgreSQL text refuses) into a PostgreSQL table under dead_letter:
    all 2,000 delivered, the hostile ones dead-lettered, the connector Running, lag 0."""
    import psycopg2

    hostile_at = {100 + 250 * j: p for j, p in enumerate(HOSTILE_PAYLOADS)}
    total = 2000 + len(hostile_at)
    ids = iter(range(2000))
    payloads = [
        hostile_at[i]
        if i in hostile_at
        else json.dumps({"id": (n := next(ids)), "name": f"name {n}", "amount": n * 1.5}).encode()
        for i in range(total)
    ]

    produce(tansu, topic_name, total, partitions=1, payload=payloads.__getitem__)
    name = f"hostile_{uuid.uuid4().hex[:6]}"
    spec = pg_spec(
        name, topic_name, pg_url, pg_schema, batch={"max_records": 500, "max_wait_ms": 500}
    )
    spec["failure"] = {
        "policy": "dead_letter",
        "retries": 0,
        "dead_letter": {"path": str(dagster.home / "dl" / name)},
    }
    dagster.write_spec(spec)
    dagster.reload()
    run_id = dagster.launch(name)
    wait_for(
        lambda: sum(dagster.store.committed_offsets(name).values()) == total,
        240,
        "every message committed",
    )
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f'SELECT count(*), count(DISTINCT id), min(id), max(id) FROM "{pg_schema}".orders'
        )
        assert cur.fetchone() == (2000, 2000, 0, 1999)
    from conveyor.spark.deadletters import SparkParquetDeadLetters
    from conveyor.spark.session import spark_session

    dl = SparkParquetDeadLetters(
        dagster.home / "dl" / name, lambda: spark_session(dagster.env["CONVEYOR_SPARK_REMOTE"])
    )
    pending = dl.pending().to_pylist()
    assert sorted(p["offset"] for p in pending) == sorted(hostile_at)
    by_offset = {p["offset"]: p for p in pending}
    assert by_offset[100]["error_class"] == "data" and "0x00" in by_offset[100]["error"]
    assert by_offset[100 + 250 * 4]["error_class"] == "decode"  # the wrong type is no NULL
    wait_for(
        lambda: (
            dagster.store.get(name).counters.get("dead_lettered") == len(hostile_at)
            and dagster.store.get(name).counters.get("lag") == 0
        ),
        SETTLE_S,
        "dead-letter counter and lag 0",
    )
    row = dagster.store.get(name)
    assert row.status == ConnectorStatus.RUNNING and row.generation == 1, row
    dagster.terminate(run_id)
    dagster.wait_status(run_id, {"CANCELED"}, STOP_S)


def test_fail_policy_stops_at_the_bad_message_and_is_not_restarted(
    dagster, tansu, topic_name, pg_url, pg_schema
):
    """A bad message in the middle of a batch under `fail`: every good row before it exactly
    once, nothing after it, Error naming the message; three scheduler ticks later the same."""
    import time

    from dagster import build_sensor_context

    from conveyor.dagster.resources.conveyor import ConveyorResource
    from conveyor.dagster.sensors.scheduler import tick
    from tests.e2e.test_connector_e2e import counts

    produce(
        tansu,
        topic_name,
        100,
        partitions=1,
        payload=lambda i: json.dumps(
            {"id": i, "name": "nul \u0000" if i == 50 else f"name {i}", "amount": i}
        ).encode(),
    )
    name = f"fail_{uuid.uuid4().hex[:6]}"
    spec = pg_spec(
        name, topic_name, pg_url, pg_schema, batch={"max_records": 100, "max_wait_ms": 1000}
    )
    error, log = run_to_error(dagster, spec)
    where = f"{topic_name}[0]@50"
    assert error.startswith("data error: ") and where in error and "0x00" in error, error
    assert where in log

    def check() -> None:
        import psycopg2

        assert counts(pg_url, pg_schema) == (50, 50)
        with psycopg2.connect(pg_url) as c, c.cursor() as cur:
            cur.execute(f'SELECT min(id), max(id) FROM "{pg_schema}".orders')
            assert cur.fetchone() == (0, 49)  # nothing after the bad message
        assert sum(dagster.store.committed_offsets(name).values()) == 50

    check()
    gen = dagster.store.get(name).generation
    with dagster.instance() as instance:
        for k in range(3):
            ctx = build_sensor_context(
                instance=instance,
                resources={"conveyor": ConveyorResource(meta_url=dagster.meta_url)},
            )
            # Far past any restart backoff: a crash would be restarted by now.
            _, requests = tick(ctx, dagster.store, now=time.time() + 3600 * (k + 1))
            assert not [r for r in requests if r.tags.get("conveyor/connector") == name]
    row = dagster.store.get(name)
    assert row.status == ConnectorStatus.ERROR and row.generation == gen and row.restarts == 0, row
    check()
    listing = subprocess.run(
        [str(Path(sys.executable).parent / "conveyor"), "connector", "list"],
        # A wide terminal: without a tty rich wraps the cells at 80 columns.
        env={**dagster.env, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where in listing.stdout, listing.stdout
