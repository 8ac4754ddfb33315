"""A source connector under a real ``dagster dev``: the scheduler launches a PostgreSQL
polling source routing rows into three topics; every row arrives exactly once in the
right topic; a ``kill -9`` of its run mid-way duplicates at most one batch; a sink
connector reads one of the topics into PostgreSQL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
import yaml

from conveyor.control.devserver import dagster_yaml
from conveyor.core.host.ports import free_port, port_open
from conveyor.core.model import ConnectorStatus
from conveyor.store.meta import MetaStore
from tests.e2e.conftest import SETTLE_S, kill_processes_of, wait_for
from tests.integration.sources_harness import read_topic

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

BATCH = 100
HEARTBEAT_TIMEOUT = 10
TICK = 5
REGIONS = ["eu", "us", "apac"]


class Dev:
    def __init__(
        self,
        home: Path,
        env: dict[str, str],
        proc: subprocess.Popen[bytes],
        meta_url: str,
        port: int,
    ):
        self.home, self.env, self.proc, self.port = home, env, proc, port
        self.store = MetaStore(meta_url)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        exe = str(Path(sys.executable).parent / "conveyor")
        return subprocess.run(
            [exe, *args], env=self.env, capture_output=True, text=True, timeout=60
        )


@pytest.fixture
def dev_home(
    tmp_path_factory: pytest.TempPathFactory, tansu: str, spark_remote: str
) -> Iterator[dict]:
    home = tmp_path_factory.mktemp("source_home")
    dagster_home, connectors = home / "dagster", home / "connectors"
    for d in (dagster_home, connectors):
        d.mkdir(parents=True)
    (dagster_home / "dagster.yaml").write_text(dagster_yaml([("b1", 4)]))
    (home / "brokers.yaml").write_text(
        yaml.safe_dump({"brokers": [{"id": "b1", "capacity": 4, "spark_remote": spark_remote}]})
    )
    (home / "workspace.yaml").write_text(
        yaml.safe_dump(
            {
                "load_from": [
                    {
                        "python_module": {
                            "module_name": "conveyor.dagster.definitions",
                            "location_name": "conveyor",
                        }
                    }
                ]
            }
        )
    )
    meta_url = f"sqlite:///{home / 'meta.db'}"
    env = {
        **os.environ,
        "CONVEYOR_HOME": str(home),
        "CONVEYOR_META_URL": meta_url,
        "CONVEYOR_CONNECTORS_DIR": str(connectors),
        "CONVEYOR_BROKERS_FILE": str(home / "brokers.yaml"),
        "CONVEYOR_KAFKA_BOOTSTRAP": tansu,
        "CONVEYOR_SPARK_REMOTE": spark_remote,
        "DAGSTER_HOME": str(dagster_home),
    }
    state: dict = {"home": home, "connectors": connectors, "env": env, "meta_url": meta_url}
    try:
        yield state
    finally:
        proc = state.get("proc")
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        kill_processes_of(home)


def start(dev_home: dict) -> Dev:
    home, port = dev_home["home"], free_port()
    exe = str(Path(sys.executable).parent / "dagster")
    log = open(home / "dagster-dev.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [exe, "dev", "-w", str(home / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
        cwd=home,
        env=dev_home["env"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    dev_home["proc"] = proc
    wait_for(lambda: port_open("127.0.0.1", port) or proc.poll() is not None, 180, "dagster dev")
    if proc.poll() is not None:
        raise RuntimeError((home / "dagster-dev.log").read_text()[-3000:])
    return Dev(home, dev_home["env"], proc, dev_home["meta_url"], port)


def insert(pg_url: str, table: str, start: int, n: int, prefix: str) -> None:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.executemany(
            f"INSERT INTO {table} (ref, region, customer) VALUES (%s, %s, %s)",
            [(i, prefix + REGIONS[i % 3], f"c{i % 7}") for i in range(start, start + n)],
        )


def refs(bootstrap: str, topic: str) -> list[int]:
    return [json.loads(m.value)["ref"] for m in read_topic(bootstrap, topic)]


def test_scheduler_runs_a_routing_source_exactly_once_then_survives_kill9(
    dev_home, tansu, pg_url, pg_schema
):
    tag = uuid.uuid4().hex[:6]
    prefix = f"src_{tag}."
    topics = {r: prefix + r for r in REGIONS}
    table = f'"{pg_schema}".orders'
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f"CREATE TABLE {table} (id bigserial PRIMARY KEY, ref int NOT NULL, region text, customer text)"
        )
    insert(pg_url, table, 0, 900, prefix)
    name = f"orders_in_{tag}"
    source = {
        "name": name,
        "kind": "source",
        "source": {
            "type": "postgres_polling",
            "url": pg_url,
            "table": f"{pg_schema}.orders",
            "incrementing_column": "id",
            "destination_column": "region",
            "key_column": "customer",
        },
        "routing": {
            "admission": {"mode": "allowlist", "patterns": [f"src_{tag}.*"]},
            "max_destinations": 3,
        },
        "batch": {"max_records": BATCH, "max_wait_ms": 200},
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
    }
    sink_name = f"eu_out_{tag}"
    sink = {
        "name": sink_name,
        "source": {"topics": [topics["eu"]]},
        "transform": {"schema": "id BIGINT, ref INT, customer STRING"},
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": pg_schema,
            "table": "eu",
            "create_table": True,
        },
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
    }
    (dev_home["connectors"] / f"{name}.yaml").write_text(yaml.safe_dump(source))
    (dev_home["connectors"] / f"{sink_name}.yaml").write_text(yaml.safe_dump(sink))
    dev = start(dev_home)
    store = dev.store

    # 1. The scheduler launches it; 900 rows, exactly once, each in its region's topic.
    wait_for(
        lambda: sum(len(read_topic(tansu, t, 1_000)) for t in topics.values()) >= 900,
        360,
        "900 rows in the three topics",
        interval=2,
    )
    for i, r in enumerate(REGIONS):
        got = refs(tansu, topics[r])
        assert sorted(got) == list(range(i, 900, 3)), r  # exactly once, right topic
    row = store.get(name)
    assert row.status == ConnectorStatus.RUNNING and row.broker_id == "b1"
    assert store.source_state(name) == (2, {"last": {"id": 900}})  # version 2: by key
    out = dev.cli("connector", "destinations", name, "--json")
    assert out.returncode == 0, out.stderr
    wait_for(
        lambda: (
            json.loads(dev.cli("connector", "destinations", name, "--json").stdout)["routed"] >= 900
        ),
        SETTLE_S,
        "heartbeat with 900 routed",
    )

    # 2. kill -9 of the run while rows flow: a new generation resumes from the stored state.
    before = store.get(name)
    insert(pg_url, table, 900, 1_500, prefix)
    os.kill(before.run_pid, signal.SIGKILL)
    insert(pg_url, table, 2_400, 600, prefix)
    wait_for(
        lambda: (
            (r := store.get(name)).generation > before.generation
            and r.status == ConnectorStatus.RUNNING
            and r.heartbeat_at
        ),
        HEARTBEAT_TIMEOUT + 2 * TICK + 120,
        "running again on a new generation",
    )
    wait_for(
        lambda: len({x for t in topics.values() for x in refs(tansu, t)}) == 3_000,
        240,
        "3000 distinct rows after the crash",
        interval=2,
    )
    all_refs = [x for t in topics.values() for x in refs(tansu, t)]
    dupes = sum(n - 1 for n in Counter(all_refs).values())
    assert dupes <= BATCH, dupes  # at most the batch in flight
    for i, r in enumerate(REGIONS):
        assert set(refs(tansu, topics[r])) == set(range(i, 3_000, 3)), r

    # 3. The sink connector read the eu topic into PostgreSQL.
    def eu_rows() -> int:
        with psycopg2.connect(pg_url) as c, c.cursor() as cur:
            cur.execute("SELECT to_regclass(%s)", (f'"{pg_schema}".eu',))
            if cur.fetchone()[0] is None:
                return 0
            cur.execute(f'SELECT count(DISTINCT ref) FROM "{pg_schema}".eu')
            return cur.fetchone()[0]

    wait_for(
        lambda: eu_rows() == 1_000,
        240,
        "the eu rows in PostgreSQL through the sink connector",
        interval=2,
    )

    # 4. Lineage in the code location: the source table -> the topic -> the sink's table.
    from dagster_graphql import DagsterGraphQLClient

    client = DagsterGraphQLClient("127.0.0.1", port_number=dev.port, timeout=60)
    q = """query($k: AssetKeyInput!) { assetNodeOrError(assetKey: $k) {
        ... on AssetNode { dependencyKeys { path } dependedByKeys { path } } } }"""
    node = client._execute(q, {"k": {"path": ["kafka", f"src_{tag}_eu"]}})["assetNodeOrError"]
    assert {"path": ["postgres", pg_schema, "orders"]} in node["dependencyKeys"], node
    assert {"path": ["postgres", pg_schema, "eu"]} in node["dependedByKeys"], node
