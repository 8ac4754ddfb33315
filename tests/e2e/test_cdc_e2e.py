"""A ``postgres_cdc`` source connector under a real ``dagster dev``: the scheduler launches it;
it creates its own slot (``conveyor_<name>``, named in the run from the connector), reads the
table's rows in a snapshot and then the stream into a 3-partition topic; a ``kill -9`` of its
run while changes flow loses nothing (duplicates at most the batch in flight); once stopped,
``conveyor connector delete --drop-slot`` drops its slot and publication.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections import Counter

import psycopg2
import pytest
import yaml

from conveyor.core.model import ConnectorStatus
from tests.e2e.conftest import SETTLE_S, STOP_S, wait_for
from tests.e2e.test_source_e2e import dev_home, start  # noqa: F401 - dev_home is a fixture
from tests.integration.pg_cluster import private_cluster
from tests.integration.sources_harness import read_topic

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

BATCH = 100


def execute(url: str, *sql: str) -> None:
    with psycopg2.connect(url) as c, c.cursor() as cur:
        for q in sql:
            cur.execute(q)


def slots(url: str) -> set[str]:
    with psycopg2.connect(url) as c, c.cursor() as cur:
        cur.execute("SELECT slot_name FROM pg_replication_slots")
        return {r[0] for r in cur.fetchall()}


def ids(bootstrap: str, topic: str) -> list[int]:
    return [json.loads(m.value)["data"]["id"] for m in read_topic(bootstrap, topic, 1_000)]


def test_cdc_connector_snapshots_streams_survives_kill9_and_drops_its_slot(dev_home, tansu):  # noqa: F811
    with private_cluster() as url:
        execute(
            url,
            "CREATE TABLE items (id int PRIMARY KEY, v int)",
            "INSERT INTO items SELECT g, 0 FROM generate_series(1, 300) g",
        )
        name = f"cdc_in_{uuid.uuid4().hex[:6]}"
        topic = f"{name}.items"
        spec = {
            "name": name,
            "kind": "source",
            "source": {"type": "postgres_cdc", "url": url, "tables": ["public.items"]},
            "routing": {"default_destination": topic},
            "kafka": {"partitions": 3},
            "batch": {"max_records": BATCH, "max_wait_ms": 200},
        }
        (dev_home["connectors"] / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        dev = start(dev_home)
        store = dev.store

        # 1. Launched by the scheduler: its own slot, the snapshot of the 300 rows.
        wait_for(lambda: len(set(ids(tansu, topic))) >= 300, 360, "the snapshot", interval=2)
        assert f"conveyor_{name}" in slots(url)

        # 2. kill -9 of the run while changes flow: nothing lost, one batch duplicated at most.
        wait_for(lambda: store.get(name).run_pid, SETTLE_S, "the run's pid")
        before = store.get(name)
        execute(url, *[f"INSERT INTO items VALUES ({i}, 1)" for i in range(301, 801)])
        os.kill(before.run_pid, signal.SIGKILL)
        execute(url, "INSERT INTO items SELECT g, 2 FROM generate_series(801, 1300) g")
        wait_for(
            lambda: (
                (r := store.get(name)).generation > before.generation
                and r.status == ConnectorStatus.RUNNING
            ),
            SETTLE_S + 120,
            "running again on a new generation",
        )
        wait_for(lambda: len(set(ids(tansu, topic))) == 1300, 240, "1300 rows", interval=2)
        got = ids(tansu, topic)
        assert set(got) == set(range(1, 1301))
        dupes = sum(n - 1 for n in Counter(got).values())
        assert dupes <= BATCH, dupes

        # 3. Stopped, then deleted with its slot and publication.
        assert dev.cli("connector", "stop", name).returncode == 0
        wait_for(lambda: store.get(name).status == ConnectorStatus.STOPPED, STOP_S, "stopped")
        out = dev.cli("connector", "delete", name, "--yes", "--drop-slot")
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"conveyor_{name}" not in slots(url)
