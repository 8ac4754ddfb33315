"""A backfill of a time range, requested through the REST API while the live connector runs,
under ``dagster dev`` with the scheduler (issue 38's "Done when").

The live connector, launched by the scheduler sensor, keeps consuming a stream with event
times (record timestamps) into an append-only PostgreSQL table with ``delivery: exactly_once``.
While the stream goes on, ``POST /connectors/{name}/backfills`` asks for the range
[100 s, 200 s) of the stream's time; the backfills sensor launches ``backfill__<name>``, which is
its own writer in the table. Checked against what was produced: every message stamped inside
the range is in the table exactly twice, every other exactly once; the request ends
``succeeded`` with read and delivered equal to the range's message count; the live connector
is still running in the same run and generation, and its own offsets (its writer's, in the
table) cover exactly what was produced, as if no backfill had run.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import uuid
from collections import Counter
from typing import Any

import psycopg2
import pytest
from dagster import DagsterInstance

from conveyor.core.positions import writer_id
from conveyor.store.meta import MetaStore
from tests.e2e.conftest import SETTLE_S, STOP_S, dagster_dev_workspace, wait_for
from tests.integration.api_server import served

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

RANGE = (100, 200)  # seconds after the stream's start: ids 100..199, one message a second
FIRST = 300  # messages before dagster dev starts


class Stream:
    """Messages ``{"id": i}`` stamped ``base + i`` seconds, ids alternating two partitions."""

    def __init__(self, bootstrap: str, topic: str, base: float):
        from kafka import KafkaProducer
        from kafka.admin import KafkaAdminClient, NewTopic

        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([NewTopic(topic, 2, 1)])
        admin.close()
        self.topic, self.base, self.produced = topic, base, 0
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def send(self, n: int) -> None:
        """The next ``n`` messages, each acknowledged."""
        sent = [
            self.producer.send(
                self.topic,
                value=json.dumps({"id": i}).encode(),
                partition=i % 2,
                timestamp_ms=int((self.base + i) * 1000),
            )
            for i in range(self.produced, self.produced + n)
        ]
        self.producer.flush()
        for future in sent:
            future.get(timeout=SETTLE_S)
        self.produced += n

    def run(self) -> None:
        """Keep the stream going (10 messages every 0.2 s) until ``stop``."""
        try:
            while not self.stop.wait(0.2):
                self.send(10)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def counts(pg_url: str, schema: str) -> Counter[int]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{schema}".orders',))
        if cur.fetchone()[0] is None:
            return Counter()
        cur.execute(f'SELECT id FROM "{schema}".orders')
        return Counter(r[0] for r in cur.fetchall())


def writer_offsets(pg_url: str, schema: str) -> dict[str, dict[tuple[str, int], int]]:
    """Each writer's next offsets in the sink's offsets table (exactly once)."""
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            "SELECT table_schema, table_name FROM information_schema.columns "
            "WHERE column_name = 'next_offset' AND table_schema = %s",
            (schema,),
        )
        tables = cur.fetchall()
        assert len(tables) == 1, tables
        cur.execute(f'SELECT * FROM "{tables[0][0]}"."{tables[0][1]}"')
        cols = [d[0] for d in cur.description]
        out: dict[str, dict[tuple[str, int], int]] = {}
        for row in cur.fetchall():
            r = dict(zip(cols, row, strict=True))
            if r["partition"] is not None and r["partition"] >= 0:
                out.setdefault(r["writer"], {})[(r["topic"], r["partition"])] = r["next_offset"]
        return out


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


def test_a_backfill_of_a_time_range_re_delivers_exactly_that_range_while_the_connector_runs(
    tansu, spark_remote, pg_url, pg_schema
):
    name = f"bf_{uuid.uuid4().hex[:6]}"
    topic = f"t_{name}"
    spec = {
        "name": name,
        "source": {"topics": [topic]},
        "batch": {"max_records": 200, "max_wait_ms": 200},
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
            "delivery": "exactly_once",
        },
    }
    base = float(int(time.time()) // 60 * 60 - 3600)  # an hour ago, one message a second
    stream = Stream(tansu, topic, base)
    stream.send(FIRST)
    producer = threading.Thread(target=stream.run, daemon=True)
    with dagster_dev_workspace(tansu, spark_remote, spec, prefix="conveyor-backfill-e2e-") as stack:
        home = stack.home
        store = MetaStore(f"sqlite:///{home / 'meta.db'}")
        wait_for(
            lambda: sum(counts(pg_url, pg_schema).values()) >= FIRST, 300, "the live connector"
        )
        live = wait_for(
            lambda: (r := store.get(name)).status.value == "Running" and r.run_id and r,
            SETTLE_S,
            "the live connector to show Running",
        )
        producer.start()  # the stream goes on while the backfill runs
        try:
            with served(home) as api:
                r = api.call(
                    "POST",
                    f"/connectors/{name}/backfills",
                    json={"start": iso(base + RANGE[0]), "end": iso(base + RANGE[1])},
                )
                assert r.status_code == 202, r.text
                request_id = r.json()["id"]

                def ended() -> dict[str, Any] | None:
                    got = api.call("GET", f"/connectors/{name}/backfills/{request_id}").json()
                    return got if got["state"] in ("succeeded", "failed") else None

                done = wait_for(ended, 2 * STOP_S + SETTLE_S, "the backfill request to end")
        finally:
            stream.stop.set()
            producer.join(60)
        assert stream.error is None, stream.error
        assert done["state"] == "succeeded", done
        in_range = RANGE[1] - RANGE[0]
        assert (done["read"], done["delivered"], done["failed"]) == (in_range, in_range, 0), done
        assert done["run_id"] and done["requested_by"] == "the REST API"
        # The live connector delivers the rest of the stream: every message produced is in.
        produced = stream.produced
        wait_for(
            lambda: set(counts(pg_url, pg_schema)) == set(range(produced)),
            SETTLE_S,
            f"the live connector to deliver all {produced} messages",
        )
        got = counts(pg_url, pg_schema)
        twice = sorted(i for i, n in got.items() if n == 2)
        assert twice == list(range(*RANGE))
        assert all(n == 1 for i, n in got.items() if not RANGE[0] <= i < RANGE[1])
        assert sum(got.values()) == produced + in_range
        # The live connector: the same run, still running, and its offsets its own.
        after = store.get(name)
        assert (after.status.value, after.run_id, after.generation) == (
            "Running",
            live.run_id,
            live.generation,
        ), after
        # Writers are named ``<writer>@<incarnation>`` (core/positions.py): the connector's and
        # its backfill's, both of this incarnation.
        writers = writer_offsets(pg_url, pg_schema)
        evens = (produced + 1) // 2  # ids on partition 0
        own = writer_id(name, after.incarnation)
        assert writers[own] == {(topic, 0): evens, (topic, 1): produced - evens}, writers
        backfill_writers = [w for w in writers if w.startswith(f"{name}.backfill-")]
        assert len(backfill_writers) == 1, writers
        assert backfill_writers[0].endswith(f"@{after.incarnation}"), writers
        # The run the sensor launched is linked to the request.
        with DagsterInstance.from_config(str(home / "dagster")) as instance:
            run = instance.get_run_by_id(done["run_id"])
            assert run is not None and run.job_name == f"backfill__{name}"
            assert run.status.value == "SUCCESS"
            assert run.tags["conveyor/backfill_request"].startswith(f"{request_id}.")
