"""Liveness under a real ``dagster dev`` (daemon, scheduler sensor) with the DEFAULT settings.

- A PostgreSQL target down longer than ``retry.max_outage``: the run keeps heartbeating
  through 30-60 s retry waits (no heartbeat failover, no relaunch with a fresh outage
  budget), fails, and the connector ends in Error; back up, the scheduler's restart
  delivers everything.
- A target that takes 40 s per batch (a statement trigger doing ``pg_sleep``), longer than
  the 30 s heartbeat timeout: no failover, Degraded naming the send stage, nothing written
  twice.
- A hung Spark call (the Spark Connect server SIGSTOPped): Degraded naming the stage
  within its deadline, then the run restarts itself; after SIGCONT everything is delivered.

Only ``max_outage`` (the thing under test) and, for the hung Spark call, the liveness
limits are set; heartbeat timeouts and retry delays are the defaults. The Spark Connect
server is this module's own (so that stopping it disturbs no other test), in a working
directory of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg2
import pytest
import yaml

from conveyor.core.model import ConnectorStatus
from conveyor.spark.server import SparkConnectServer, start_spark_connect
from tests.e2e.conftest import produce, wait_for
from tests.e2e.test_scheduler_e2e import DevHarness, dev, table_counts  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1500)]

SCHEMA_DDL = "id BIGINT, name STRING, amount DOUBLE"
NAMES = {k: f"{k}_{uuid.uuid4().hex[:6]}" for k in ("outage", "slow", "hung")}
TOPICS = {k: f"lv_{k}_{uuid.uuid4().hex[:8]}" for k in NAMES}
ROLE = f"conveyor_lv_{uuid.uuid4().hex[:8]}"


def admin(pg_url: str, sql: str) -> None:
    c = psycopg2.connect(pg_url)
    c.autocommit = True
    with c.cursor() as cur:
        cur.execute(sql)
    c.close()


def signal_group(server: SparkConnectServer, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, sig)


@pytest.fixture(scope="module")
def private_spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkConnectServer]:
    server = start_spark_connect(work_dir=tmp_path_factory.mktemp("spark_private"))
    try:
        yield server
    finally:
        signal_group(server, signal.SIGCONT)  # a stopped JVM ignores SIGTERM
        server.stop()


@pytest.fixture(scope="module")
def spark_remote(private_spark: SparkConnectServer) -> str:
    """Overrides the session's Spark endpoint for this module's brokers."""
    return private_spark.remote


@pytest.fixture(scope="module")
def schema() -> Iterator[str]:
    from tests.conftest import PG_URL

    name = f"lv_{uuid.uuid4().hex[:10]}"
    admin(PG_URL, f'CREATE SCHEMA "{name}"')
    admin(PG_URL, f'CREATE ROLE "{ROLE}" LOGIN')
    admin(PG_URL, f'GRANT USAGE, CREATE ON SCHEMA "{name}" TO "{ROLE}"')
    try:
        yield name
    finally:
        admin(PG_URL, f'DROP SCHEMA "{name}" CASCADE')
        admin(PG_URL, f'DROP OWNED BY "{ROLE}"; DROP ROLE "{ROLE}"')


@pytest.fixture(scope="module")
def h(dev, schema) -> DevHarness:  # noqa: F811
    """dagster dev with the three connectors created stopped; each test starts its own."""
    from tests.conftest import PG_URL as pg_url

    role_url = f"postgresql://{ROLE}@127.0.0.1:5432/test"
    for key, table in (("outage", "outage"), ("slow", "slow"), ("hung", "hung")):
        admin(
            pg_url,
            f'CREATE TABLE "{schema}".{table} (id BIGINT, name TEXT, amount DOUBLE PRECISION); '
            f'GRANT INSERT, SELECT ON "{schema}".{table} TO "{ROLE}"',
        )
        s: dict = {
            "name": NAMES[key],
            "source": {"topics": [TOPICS[key]]},
            "transform": {"decode": "json", "schema": SCHEMA_DDL},
            "sink": {
                "type": "postgres",
                "url": role_url if key == "outage" else pg_url,
                "schema": schema,
                "table": table,
            },
            "desired": "stopped",
        }
        if key == "outage":
            s["retry"] = {"max_outage": 60}  # the thing under test; delays stay the defaults
        if key == "hung":
            s["liveness"] = {"stage_deadline_s": 10, "restart_after_s": 40}
        (dev.home["connectors"] / f"{NAMES[key]}.yaml").write_text(yaml.safe_dump(s))
    harness: DevHarness = dev.start()
    wait_for(
        lambda: all(n in {r.name for r in harness.store.list()} for n in NAMES.values()),
        120,
        "connectors synced",
    )
    return harness


def start(h: DevHarness, name: str) -> int:
    out = h.cli("connector", "start", name)
    assert out.returncode == 0, out.stderr
    row = wait_for(
        lambda: (r := h.store.get(name)).status == ConnectorStatus.RUNNING and r.heartbeat_at and r,
        240,
        f"{name} running",
    )
    return row.generation


def stop(h: DevHarness, name: str) -> None:
    h.cli("connector", "stop", name)


def reasons(h: DevHarness, name: str) -> str:
    return " | ".join(f"{x.to_status}: {x.reason}" for x in h.store.history(name, 500))


def assert_never_failed_over(h: DevHarness, name: str) -> None:
    """Since the run's first heartbeat, the connector never went back to Idle (no failover)
    and a long stage left a few history lines, not one per heartbeat."""
    history = list(reversed(h.store.history(name, 500)))  # oldest first
    first = next(i for i, x in enumerate(history) if x.reason == "first heartbeat")
    after = history[first:]
    assert all(x.to_status != "Idle" for x in after), reasons(h, name)
    assert len(after) < 30, reasons(h, name)


def test_a_target_down_past_max_outage_ends_in_error_with_default_settings(
    h, tansu, pg_url, schema
):
    name, topic = NAMES["outage"], TOPICS["outage"]
    produce(tansu, topic, 1_000)
    gen = start(h, name)
    try:
        wait_for(lambda: table_counts(pg_url, schema, "outage")[1] == 1_000, 180, "first 1000")
        admin(pg_url, f'ALTER ROLE "{ROLE}" CONNECTION LIMIT 0')
        admin(
            pg_url,
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{ROLE}'",
        )
        produce(tansu, topic, 500, start=1_000)
        seen: set[str] = set()
        stale: list[float] = []

        def errored() -> bool:
            row = h.store.get(name)
            seen.add(row.status.value)
            # The run holds on: the same generation, heartbeats fresh through every retry wait.
            assert row.generation == gen, reasons(h, name)
            # (heartbeat_at is None for a moment while the op's retry claims it again:
            # the scheduler's launch timeout, 60 s, covers that, not the heartbeat rule)
            if (
                row.status in (ConnectorStatus.RUNNING, ConnectorStatus.DEGRADED)
                and row.heartbeat_at
            ):
                age = time.time() - row.heartbeat_at
                if age > row_timeout:
                    stale.append(age)
            return row.status == ConnectorStatus.ERROR

        row_timeout = 30.0  # the default heartbeat_timeout_s
        # 3 op attempts (the run's own retries) of ~60 s each, with the default delays.
        wait_for(errored, 600, "Error after max_outage", interval=1.0)
        row = h.store.get(name)
        assert "kept failing" in (row.last_error or ""), row.last_error
        assert "Degraded" in seen and not stale, (seen, stale)
        assert_never_failed_over(h, name)
        assert table_counts(pg_url, schema, "outage")[1] == 1_000  # nothing past the outage
        # Back up: the scheduler's restart (restart budget, backoff) delivers the rest.
        admin(pg_url, f'ALTER ROLE "{ROLE}" CONNECTION LIMIT -1')
        wait_for(
            lambda: table_counts(pg_url, schema, "outage")[1] == 1_500, 300, "all after restart"
        )
        total, distinct = table_counts(pg_url, schema, "outage")
        assert distinct == 1_500 and total == 1_500
    finally:
        admin(pg_url, f'ALTER ROLE "{ROLE}" CONNECTION LIMIT -1')
        stop(h, name)


def test_a_slow_target_is_degraded_not_failed_over_and_nothing_is_written_twice(
    h, tansu, pg_url, schema
):
    name, topic = NAMES["slow"], TOPICS["slow"]
    admin(
        pg_url,
        f"""CREATE FUNCTION "{schema}".slow() RETURNS trigger LANGUAGE plpgsql AS
        $$ BEGIN PERFORM pg_sleep(40); RETURN NULL; END $$;
        CREATE TRIGGER slow BEFORE INSERT ON "{schema}".slow
        FOR EACH STATEMENT EXECUTE FUNCTION "{schema}".slow()""",
    )
    produce(tansu, topic, 600)
    gen = start(h, name)
    try:

        def delivered() -> bool:
            row = h.store.get(name)
            assert row.generation == gen, reasons(h, name)  # never failed over
            return table_counts(pg_url, schema, "slow")[1] == 600

        wait_for(delivered, 600, "all 600 through the slow target", interval=1.0)
        history = reasons(h, name)
        assert "Degraded: stage send has been under way" in history, history
        assert_never_failed_over(h, name)
        total, distinct = table_counts(pg_url, schema, "slow")
        assert total == distinct == 600
        wait_for(lambda: h.store.get(name).status == ConnectorStatus.RUNNING, 120, "Running again")
    finally:
        stop(h, name)


def test_a_hung_spark_call_is_degraded_then_restarts_and_resumes_without_loss(
    h, tansu, pg_url, schema, private_spark
):
    name, topic = NAMES["hung"], TOPICS["hung"]
    produce(tansu, topic, 500)
    start(h, name)
    stopped = threading.Event()
    try:
        wait_for(lambda: table_counts(pg_url, schema, "hung")[1] == 500, 180, "first 500")
        signal_group(private_spark, signal.SIGSTOP)
        stopped.set()
        produce(tansu, topic, 500, start=500)
        wait_for(
            lambda: "under way" in reasons(h, name) and "past its 10s deadline" in reasons(h, name),
            120,
            "Degraded naming the stuck stage",
        )
        history = reasons(h, name)
        assert "stage transform" in history or "stage init" in history, history
        wait_for(lambda: "restarts itself" in reasons(h, name), 180, "a self-restart")
        signal_group(private_spark, signal.SIGCONT)
        stopped.clear()
        wait_for(lambda: table_counts(pg_url, schema, "hung")[1] == 1_000, 400, "all after SIGCONT")
        total, distinct = table_counts(pg_url, schema, "hung")
        assert distinct == 1_000 and total - 1_000 <= 500, (total, distinct)
        wait_for(lambda: h.store.get(name).status == ConnectorStatus.RUNNING, 120, "Running again")
    finally:
        signal_group(private_spark, signal.SIGCONT)
        stop(h, name)
