"""A real PostgreSQL outage of 30 s: Degraded, no dead letters, then Running and zero loss."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg2
import pytest

from conveyor.core.model import ConnectorStatus
from tests.e2e.conftest import SETTLE_S, STOP_S, DagsterHarness, produce, wait_for
from tests.e2e.test_connector_e2e import counts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

N = 6_000


def admin(pg_url: str, sql: str) -> None:
    c = psycopg2.connect(pg_url)
    c.autocommit = True
    with c.cursor() as cur:
        cur.execute(sql)
    c.close()


def test_postgres_outage_is_retried_without_dead_letters_or_loss(
    dagster: DagsterHarness, tansu, topic_name, pg_url, pg_schema
):
    role = f"conveyor_{uuid.uuid4().hex[:8]}"
    admin(pg_url, f'CREATE ROLE "{role}" LOGIN')
    admin(
        pg_url, f'CREATE TABLE "{pg_schema}".orders (id BIGINT, name TEXT, amount DOUBLE PRECISION)'
    )
    admin(
        pg_url,
        f'GRANT USAGE ON SCHEMA "{pg_schema}" TO "{role}"; GRANT INSERT, SELECT ON "{pg_schema}".orders TO "{role}"',
    )
    name = f"outage_{uuid.uuid4().hex[:6]}"
    dl_dir = dagster.home / "dl" / name
    dagster.write_spec(
        {
            "name": name,
            "source": {"topics": [topic_name]},
            "batch": {"max_records": 500, "max_wait_ms": 200},
            "transform": {"decode": "json", "schema": "id BIGINT, name STRING, amount DOUBLE"},
            "sink": {
                "type": "postgres",
                "url": f"postgresql://{role}@127.0.0.1:5432/test",
                "schema": pg_schema,
                "table": "orders",
                "connect_timeout_s": 2,
            },
            "retry": {
                "delay": 0.5,
                "max_delay": 2,
                "max_retries": 1000,
                "max_outage": 300,
                "jitter": "none",
            },
            "failure": {"policy": "dead_letter", "dead_letter": {"path": str(dl_dir)}},
            "heartbeat_timeout_s": 60,
        }
    )
    dagster.reload()
    produce(tansu, topic_name, N // 2)
    run_id = dagster.launch(name)
    try:
        wait_for(lambda: counts(pg_url, pg_schema)[1] == N // 2, 120, "first half delivered")
        # Outage: the connector's role may not connect, and its session is killed.
        admin(pg_url, f'ALTER ROLE "{role}" CONNECTION LIMIT 0')
        admin(
            pg_url,
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'",
        )
        producer = threading.Thread(
            target=produce, args=(tansu, topic_name, N // 2), kwargs={"start": N // 2}
        )
        producer.start()
        started = time.monotonic()
        wait_for(
            lambda: dagster.store.get(name).status == ConnectorStatus.DEGRADED, SETTLE_S, "Degraded"
        )
        assert "PostgreSQL" in (
            dagster.store.get(name).last_error or dagster.store.history(name, 5)[0].reason
        )
        producer.join()
        time.sleep(max(0.0, 30 - (time.monotonic() - started)))
        assert dagster.store.get(name).status == ConnectorStatus.DEGRADED
        assert counts(pg_url, pg_schema)[1] == N // 2  # nothing written, nothing committed past it
        admin(pg_url, f'ALTER ROLE "{role}" CONNECTION LIMIT -1')
        wait_for(lambda: counts(pg_url, pg_schema)[1] == N, 120, "all messages after the outage")
        wait_for(
            lambda: dagster.store.get(name).status == ConnectorStatus.RUNNING,
            SETTLE_S,
            "Running again",
        )
        total, distinct = counts(pg_url, pg_schema)
        assert distinct == N and total - N <= 500
        row = dagster.store.get(name)
        assert row.counters.get("dead_lettered", 0) == 0 and row.counters["retries"] > 0
        assert not dl_dir.exists() or not any(dl_dir.rglob("*.parquet"))
        statuses = [h.to_status for h in dagster.store.history(name, 200)]
        assert "Degraded" in statuses
    finally:
        admin(pg_url, f'ALTER ROLE "{role}" CONNECTION LIMIT -1')
        dagster.terminate(run_id)
        dagster.wait_status(run_id, {"CANCELED", "FAILURE"}, STOP_S)
        admin(pg_url, f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
