"""A user's code location beside Conveyor's (tests/e2e/test_watermarks_e2e.py loads both in one
``dagster dev`` workspace): a minute-partitioned asset counting the rows of its minute in a
connector's sink table, run by ``landed_through`` as the connector's watermark passes.

Configured by the environment the test gives ``dagster dev``: ``E2E_LANDED_SINK_KEY`` (the
sink asset key, JSON), ``E2E_LANDED_PG_URL``, ``E2E_LANDED_SCHEMA``, ``E2E_LANDED_START``
(the partitions definition's first minute, Unix seconds), ``E2E_LANDED_DECLARED_START``
(``1``: the sensor begins there; else at the first watermark it sees, the default).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

import psycopg2
from dagster import (
    AssetKey,
    Definitions,
    TimeWindowPartitionsDefinition,
    asset,
    in_process_executor,
)

from conveyor.dagster.landed import landed_through

SINK = AssetKey(json.loads(os.environ.get("E2E_LANDED_SINK_KEY", '["postgres", "x", "orders"]')))
PG_URL = os.environ.get("E2E_LANDED_PG_URL", "")
SCHEMA = os.environ.get("E2E_LANDED_SCHEMA", "")
MINUTES = TimeWindowPartitionsDefinition(
    start=datetime.fromtimestamp(float(os.environ.get("E2E_LANDED_START", "0")), timezone.utc),
    cron_schedule="* * * * *",
    fmt="%Y-%m-%d-%H:%M",
    timezone="UTC",
)


@asset(partitions_def=MINUTES, deps=[SINK])
def orders_per_minute(context) -> None:  # bare: dagster reads an annotation at runtime
    """The sink's rows whose event time falls in this minute, counted into ``per_minute``
    (one row per run, so that the test sees every run and what it counted)."""
    window = context.partition_time_window
    with psycopg2.connect(PG_URL) as conn, conn.cursor() as cur:
        cur.execute(
            f'CREATE TABLE IF NOT EXISTS "{SCHEMA}".per_minute '
            "(minute text, n bigint, run_id text, at timestamptz DEFAULT now())"
        )
        cur.execute(
            f'SELECT count(*) FROM "{SCHEMA}".orders WHERE event_time >= %s AND event_time < %s',
            (window.start, window.end),
        )
        n = cur.fetchone()[0]
        cur.execute(
            f'INSERT INTO "{SCHEMA}".per_minute (minute, n, run_id) VALUES (%s, %s, %s)',
            (context.partition_key, n, context.run_id),
        )
    context.log.info(f"{context.partition_key}: {n} orders")


DECLARED = os.environ.get("E2E_LANDED_DECLARED_START") == "1"

defs = Definitions(
    assets=[orders_per_minute],
    sensors=[
        landed_through(
            SINK, MINUTES, target=orders_per_minute, start=MINUTES.start if DECLARED else None
        )
    ],
    executor=in_process_executor,
)
