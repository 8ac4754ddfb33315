"""Streams that feed batch, under ``dagster dev`` with the scheduler: a connector delivers orders
with event times across three minutes into PostgreSQL; a user's minute-partitioned asset
(``tests/e2e/landed_defs.py``, a second code location in the same workspace) is run by
``landed_through`` as the connector's watermark passes each minute.

``conveyor dev`` loads only Conveyor's code location, so this test starts ``dagster dev``
itself with a workspace of both (what a user with their own project does), over the session's
broker and Spark Connect server. Nobody launches a run by hand: the scheduler sensor launches
the connector, the ``landed_through`` sensor each downstream run.

Checked against what was produced: each minute runs once, after the watermark passed it, and
counts every message of its minute (a run before the minute had landed would count fewer); a
minute not yet passed does not run; a late message makes its minute run again, counting it.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from conveyor.dagster.assets.checks import iso
from tests.e2e.conftest import SETTLE_S, DevStack, dagster_dev_workspace, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SENSOR = "landed_through__postgres__{schema}__orders"
# A watermark report (an observation of the sink asset) comes as soon as the watermark crosses
# a minute, a progress report (a materialization) once a minute; then a sensor tick (5 s) and
# a run launched by the daemon.
REPORT_S = 60.0 + SETTLE_S


def minute_start(now: float) -> float:
    return float(int(now // 60) * 60)


def produce(bootstrap: str, topic: str, events: list[tuple[int, float]]) -> None:
    """``(id, event time)`` orders, record timestamp = event time, ids alternating partitions."""
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    with contextlib.suppress(TopicAlreadyExistsError):
        admin.create_topics([NewTopic(topic, 2, 1)])
    admin.close()
    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=10)
    sent = [
        p.send(
            topic,
            value=json.dumps({"id": i}).encode(),
            partition=i % 2,
            timestamp_ms=int(t * 1000),
        )
        for i, t in events
    ]
    p.flush()
    for future in sent:
        future.get(timeout=SETTLE_S)
    p.close()


def runs_by_minute(pg_url: str, schema: str) -> dict[str, list[int]]:
    """What each downstream run counted, per minute, in run order."""
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{schema}".per_minute',))
        if cur.fetchone()[0] is None:
            return {}
        cur.execute(f'SELECT minute, n FROM "{schema}".per_minute ORDER BY at')
        out: dict[str, list[int]] = {}
        for minute, n in cur.fetchall():
            out.setdefault(minute, []).append(n)
        return out


def sensor_cursor(stack: DevStack, name: str) -> dict[str, Any]:
    from dagster._core.scheduler.instigation import InstigatorType

    with stack.instance() as instance:
        for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
            if state.name == name and state.instigator_data and state.instigator_data.cursor:
                return json.loads(state.instigator_data.cursor)
    return {}


def late_reports(stack: DevStack, key: list[str]) -> list[list[str]]:
    """Every late event-time range the sink's recent reports (materializations and watermark
    observations) carried."""
    from dagster import AssetKey

    from conveyor.dagster.assets.checks import watermark_events

    with stack.instance() as instance:
        events = watermark_events(instance, AssetKey(key), limit=50, ascending=False)
    out: list[list[str]] = []
    for e in events:
        entry = e.metadata.get("late_event_times")
        out += entry.value if entry is not None else []
    return out


def latest_sink_materialization(stack: DevStack, key: list[str]) -> tuple[int, dict[str, Any]]:
    """The newest report carrying a watermark (a materialization or an observation)."""
    from dagster import AssetKey

    from conveyor.dagster.assets.checks import watermark_events

    with stack.instance() as instance:
        for e in watermark_events(instance, AssetKey(key), limit=50, ascending=False):
            if "watermark_ts" in e.metadata:
                return e.storage_id, {k: v.value for k, v in e.metadata.items()}
    return 0, {}


def test_a_minute_partitioned_asset_runs_once_per_minute_as_the_watermark_passes(
    tansu, spark_remote, pg_url, pg_schema
):
    name = f"landed_{uuid.uuid4().hex[:6]}"
    topic = f"t_{name}"
    m0 = minute_start(time.time()) - 600  # four complete minutes, ten minutes ago
    key = lambda m: time.strftime("%Y-%m-%d-%H:%M", time.gmtime(m0 + 60 * m))  # noqa: E731
    spec = {
        "name": name,
        "source": {"topics": [topic]},
        "batch": {"max_records": 500, "max_wait_ms": 200},
        "transform": {
            "decode": "json",
            "schema": "id BIGINT",
            "select": ["id", "__timestamp AS event_time"],
        },
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": pg_schema,
            "table": "orders",
            "create_table": True,
        },
        # Its events are ten minutes old: quiet partitions would be complete through now (idle
        # means complete), and the minute half landed would run before its other half, late.
        # This test is about the event-time rule while the stream is live: never idle here.
        "watermark": {"idle_after_s": 3600},
    }
    sink_key = ["postgres", pg_schema, "orders"]
    # Wave 1: minute 0 whole (20 orders), minute 1's first half (10): only minute 0 is complete.
    wave1 = [(i, m0 + i * 3) for i in range(20)] + [(20 + i, m0 + 60 + i * 3) for i in range(10)]
    produce(tansu, topic, wave1)
    env = {
        "E2E_LANDED_SINK_KEY": json.dumps(sink_key),
        "E2E_LANDED_PG_URL": pg_url,
        "E2E_LANDED_SCHEMA": pg_schema,
        "E2E_LANDED_START": str(m0),
        "E2E_LANDED_DECLARED_START": "1",  # its events are ten minutes old: begin at minute 0
    }
    with dagster_dev_workspace(
        tansu,
        spark_remote,
        spec,
        extra_locations=[
            {"python_file": {"relative_path": str(ROOT / "tests/e2e/landed_defs.py")}}
        ],
        extra_env=env,
        prefix="conveyor-landed-e2e-",
    ) as s:
        wait_for(lambda: runs_by_minute(pg_url, pg_schema), 240 + REPORT_S, "minute 0's run")
        # The report that let minute 0 run had minute 1 half landed: minute 1 did not run.
        _, meta = latest_sink_materialization(s, sink_key)
        assert meta["watermark_ts"] >= m0 + 60, meta
        assert runs_by_minute(pg_url, pg_schema) == {key(0): [20]}, s.log()
        # Wave 2: minute 1's second half, minute 2 whole, and minute 3 begun on both partitions.
        wave2 = [(30 + i, m0 + 90 + i * 3) for i in range(10)]
        wave2 += [(40 + i, m0 + 120 + i * 3) for i in range(20)]
        wave2 += [(60, m0 + 190), (61, m0 + 190)]
        produce(tansu, topic, wave2)
        wait_for(
            lambda: {key(1), key(2)} <= set(runs_by_minute(pg_url, pg_schema)),
            2 * REPORT_S,
            "minutes 1 and 2",
        )
        assert runs_by_minute(pg_url, pg_schema) == {
            key(0): [20],
            key(1): [20],
            key(2): [20],
        }
        # A late order for minute 1: minute 1 runs again and counts it; nothing else runs.
        produce(tansu, topic, [(62, m0 + 100)])
        wait_for(
            lambda: len(runs_by_minute(pg_url, pg_schema).get(key(1), [])) == 2,
            2 * REPORT_S,
            "minute 1 again",
        )
        storage_id, meta = latest_sink_materialization(s, sink_key)
        assert meta["watermark"] == iso(m0 + 190), meta
        late_at = iso(m0 + 100)
        assert [late_at, late_at] in late_reports(s, sink_key), "no report named the late order"
        # Once the sensor has read past that report, the runs are exactly these.
        wait_for(
            lambda: sensor_cursor(s, SENSOR.format(schema=pg_schema)).get("after", 0) >= storage_id,
            REPORT_S,
            "the sensor to read the last report",
        )
        assert runs_by_minute(pg_url, pg_schema) == {
            key(0): [20],
            key(1): [20, 21],
            key(2): [20],
        }
