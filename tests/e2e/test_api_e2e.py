"""The REST API against a running stack: ``conveyor dev`` (dagster dev, the scheduler sensor,
``conveyor serve``), driven with a real HTTP client.

Nobody reloads the code location or launches a run by hand: a connector created over
the API and one written as a file are loaded and launched by the stack itself. A
changed config reaches the running connector in the same run; pause holds the
assignment and reads nothing; offsets altered on a stopped connector are what it
reads next (the rows it delivers again prove it); delete removes the file and the
connector does not come back. Secrets planted as ``${env:...}`` and ``${file:...}``
reach PostgreSQL (seen in ``pg_stat_activity``) and nowhere else: the whole state
directory (meta store, Dagster's storage and compute logs, every log), the CLI's and the
API's output and the sink asset's metadata are searched for them byte for byte.

Figures (resume latency, pick-up times) go to ``$CONVEYOR_E2E_TIMINGS`` when set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import requests
import yaml

from conveyor.core.host.ports import free_port, port_open
from conveyor.store.meta import MetaStore
from tests.conftest import PG_URL
from tests.e2e.conftest import SETTLE_S, kill_processes_of, produce, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

SECRET_ENV = f"envsecret{uuid.uuid4().hex}"  # behind ${env:CONVEYOR_E2E_PG_URL}
SECRET_FILE = f"filesecret{uuid.uuid4().hex}"  # behind ${file:...}
SCHEMA_DDL = "id BIGINT, name STRING, amount DOUBLE"


class Stack:
    def __init__(self, cwd: Path, proc: subprocess.Popen[bytes], ports: dict[str, int], env):
        self.cwd, self.proc, self.ports, self.env = cwd, proc, ports, env
        self.home = cwd / ".conveyor"
        self.connectors = self.home / "connectors"
        self.store = MetaStore(f"sqlite:///{self.home / 'meta.db'}")
        self.token = ""
        self.responses: list[str] = []  # every API answer, searched for secrets at the end
        self.timings: dict[str, float] = {}

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.ports['api']}"

    def call(self, method: str, path: str, *, token: str | None = None, **kw: Any):
        headers = kw.pop("headers", {})
        headers.setdefault("Authorization", f"Bearer {self.token if token is None else token}")
        r = requests.request(method, self.api + path, headers=headers, timeout=60, **kw)
        self.responses.append(r.text)
        return r

    def status(self, name: str) -> dict[str, Any]:
        r = self.call("GET", f"/connectors/{name}/status")
        assert r.status_code == 200, r.text
        return r.json()

    def state(self, name: str) -> str:
        return self.status(name)["connector"]["state"]

    def cli(self, *args: str) -> str:
        exe = str(Path(sys.executable).parent / "conveyor")
        r = subprocess.run(
            [exe, *args], env=self.env, cwd=self.cwd, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout + r.stderr

    def log(self) -> str:
        return (self.cwd / "conveyor-dev.log").read_text(errors="replace")[-4000:]

    def graphql(self, query: str) -> dict[str, Any]:
        r = requests.post(
            f"http://127.0.0.1:{self.ports['ui']}/graphql", json={"query": query}, timeout=30
        )
        return r.json()["data"]

    def jobs(self) -> set[str]:
        data = self.graphql(
            "{ workspaceOrError { ... on Workspace { locationEntries { locationOrLoadError {"
            " ... on RepositoryLocation { repositories { jobs { name } } } } } } } }"
        )
        out: set[str] = set()
        for e in data["workspaceOrError"]["locationEntries"]:
            for repo in (e["locationOrLoadError"] or {}).get("repositories") or []:
                out |= {j["name"] for j in repo["jobs"]}
        return out


@pytest.fixture(scope="module")
def stack(tansu: str, spark_remote: str) -> Iterator[Stack]:
    cwd = Path(tempfile.mkdtemp(prefix="conveyor-api-e2e-"))
    ports = {"kafka": free_port(), "ui": free_port(), "spark": free_port(), "api": free_port()}
    secret_file = Path(tempfile.mkdtemp(prefix="conveyor-secret-")) / "pg_app"
    secret_file.write_text(SECRET_FILE + "\n")
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CONVEYOR_", "DAGSTER_HOME")) or k == "CONVEYOR_TEST_PG_URL"
        },
        "CONVEYOR_HOME": str(cwd / ".conveyor"),
        "CONVEYOR_KAFKA_BOOTSTRAP": tansu,
        "CONVEYOR_SPARK_REMOTE": spark_remote,
        "COLUMNS": "200",
        # The secret the spec refers to; with the machine's trust auth the server ignores the
        # password, so the application name carries it where pg_stat_activity shows it.
        "CONVEYOR_E2E_PG_URL": f"{PG_URL}?application_name={SECRET_ENV}",
        "E2E_SECRET_FILE": str(secret_file),
        # References reach only what the operator allows: this test's secrets directory
        # (CONVEYOR_* variables are allowed by default).
        "CONVEYOR_SECRET_FILES": str(secret_file.parent),
    }
    exe = str(Path(sys.executable).parent / "conveyor")
    log = open(cwd / "conveyor-dev.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [exe, "dev", "--no-demo", "--port", str(ports["ui"]), "--api-port", str(ports["api"])]
        + ["--kafka-port", str(ports["kafka"]), "--spark-port", str(ports["spark"])],
        cwd=cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    s = Stack(cwd, proc, ports, env)
    try:
        wait_for(
            lambda: (
                (port_open("127.0.0.1", ports["ui"]) and port_open("127.0.0.1", ports["api"]))
                or proc.poll() is not None
            ),
            240,
            "the Dagster UI and the REST API",
        )
        assert proc.poll() is None, s.log()
        s.token = (s.home / "api-token").read_text().strip()
        yield s
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        kill_processes_of(s.home)
        log.close()
        out = os.environ.get("CONVEYOR_E2E_TIMINGS")
        if out and s.timings:
            Path(out).write_text(json.dumps(s.timings, indent=2))
        print("api e2e timings:", json.dumps(s.timings))


def pg_rows(pg_url: str, schema: str, table: str) -> list[tuple[int, str]]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{schema}"."{table}"',))
        if cur.fetchone()[0] is None:
            return []
        cur.execute(f'SELECT id, name FROM "{schema}"."{table}" ORDER BY id')
        return cur.fetchall()


def pg_app_connected(pg_url: str, app: str) -> bool:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,))
        return cur.fetchone()[0] > 0


def test_the_api_drives_a_connector_through_its_whole_life(stack, tansu, pg_url, pg_schema):
    s = stack
    name = f"api_{uuid.uuid4().hex[:6]}"
    topic = f"t_{name}"
    produce(tansu, topic, 300)  # two partitions: even ids in 0, odd ids in 1
    config = {
        "source": {"topics": [topic]},
        "batch": {"max_records": 100, "max_wait_ms": 200},
        "transform": {"decode": "json", "schema": SCHEMA_DDL},
        "sink": {
            "type": "postgres",
            "url": "${env:CONVEYOR_E2E_PG_URL}",
            "schema": pg_schema,
            "table": "orders",
            "create_table": True,
        },
    }
    # Refused requests first: no token, a wrong one, malformed JSON, a bad field.
    assert s.call("GET", "/connectors", token="").status_code == 401
    r = s.call("GET", "/connectors", token="not-the-token")
    assert r.status_code == 401 and r.json() == {
        "error_code": 401,
        "message": "invalid bearer token",
    }
    r = s.call(
        "POST", "/connectors", data=b'{"name": ', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["message"].startswith(
        "the request body is not valid JSON"
    )
    bad = {**config, "transform": {"decode": "yaml"}}
    r = s.call("POST", "/connectors", json={"name": name, "config": bad})
    assert r.status_code == 400 and "transform.decode" in r.json()["message"]

    # 1. create: the stack reloads its code location and the scheduler launches the run.
    t0 = time.monotonic()
    r = s.call("POST", "/connectors", json={"name": name, "config": config})
    assert r.status_code == 201, r.text
    assert r.json()["config"]["sink"]["url"] == "${env:CONVEYOR_E2E_PG_URL}"
    wait_for(lambda: s.state(name) == "RUNNING", 180, f"{name} RUNNING\n{s.log()}")
    wait_for(lambda: len(pg_rows(pg_url, pg_schema, "orders")) == 300, 120, "300 rows")
    s.timings["created_to_300_rows_s"] = round(time.monotonic() - t0, 1)
    assert pg_app_connected(pg_url, SECRET_ENV)  # the ${env:...} secret reached the client
    st = s.status(name)
    run_id, generation = st["conveyor"]["run_id"], st["conveyor"]["generation"]
    assert st["tasks"][0]["worker_id"] == "local" and st["tasks"][0]["state"] == "RUNNING"

    # 2. pause: the run stays, heartbeats, reads nothing; resume goes on at once.
    assert s.call("PUT", f"/connectors/{name}/pause").status_code == 202
    wait_for(lambda: s.state(name) == "PAUSED", SETTLE_S, "PAUSED")
    offsets_paused = s.call("GET", f"/connectors/{name}/offsets").json()
    produce(tansu, topic, 200, start=300)
    hb = s.store.get(name).heartbeat_at or 0
    # Heartbeats go on while paused (the assignment is kept); nothing is read meanwhile.
    wait_for(lambda: (s.store.get(name).heartbeat_at or 0) > hb + 2, SETTLE_S, "paused heartbeats")
    assert len(pg_rows(pg_url, pg_schema, "orders")) == 300
    assert s.call("GET", f"/connectors/{name}/offsets").json() == offsets_paused
    st = s.status(name)
    assert st["conveyor"]["run_id"] == run_id and st["conveyor"]["broker"] == "local"
    t_resume = time.monotonic()
    assert s.call("PUT", f"/connectors/{name}/resume").status_code == 202
    wait_for(lambda: len(pg_rows(pg_url, pg_schema, "orders")) > 300, SETTLE_S, "delivery resumed")
    s.timings["resume_to_first_row_s"] = round(time.monotonic() - t_resume, 2)
    wait_for(lambda: len(pg_rows(pg_url, pg_schema, "orders")) == 500, SETTLE_S, "500 rows")

    # 3. a changed config reaches the running connector, in the same run: names upper-cased
    # from now on, and the password now comes from a file.
    changed = json.loads(json.dumps(config))
    changed["transform"]["select"] = ["id", "upper(name) AS name", "amount"]
    changed["sink"]["url"] = pg_url + "?application_name=${file:" + s.env["E2E_SECRET_FILE"] + "}"
    t_change = time.monotonic()
    r = s.call("PUT", f"/connectors/{name}/config", json=changed)
    assert r.status_code == 200, r.text
    assert "${file:" in r.json()["config"]["sink"]["url"]
    # The new sink connection carries the file's secret: the run took the new spec on.
    wait_for(lambda: pg_app_connected(pg_url, SECRET_FILE), SETTLE_S, "the run on its new spec")
    s.timings["config_change_taken_on_s"] = round(time.monotonic() - t_change, 1)
    produce(tansu, topic, 100, start=500)
    wait_for(lambda: len(pg_rows(pg_url, pg_schema, "orders")) == 600, 90, "600 rows")
    s.timings["config_change_to_new_rows_s"] = round(time.monotonic() - t_change, 1)
    rows = dict(pg_rows(pg_url, pg_schema, "orders"))
    assert all(rows[i] == f"NAME {i}" for i in range(500, 600)), "new spec not applied"
    assert all(rows[i] == f"name {i}" for i in range(500))
    st = s.status(name)
    assert st["conveyor"]["run_id"] == run_id and st["conveyor"]["generation"] == generation

    # 4. stop, rewind partition 0 through KIP-875, start: partition 0 is delivered again.
    assert s.call("PUT", f"/connectors/{name}/stop").status_code == 204
    wait_for(lambda: s.state(name) == "STOPPED", SETTLE_S, "STOPPED")
    offsets = s.call("GET", f"/connectors/{name}/offsets").json()["offsets"]
    assert sorted(
        (o["partition"]["kafka_partition"], o["offset"]["kafka_offset"]) for o in offsets
    ) == [
        (0, 300),
        (1, 300),
    ]
    body = {
        "offsets": [
            {
                "partition": {"kafka_topic": topic, "kafka_partition": 0},
                "offset": {"kafka_offset": 250},
            }
        ]
    }
    r = s.call("PATCH", f"/connectors/{name}/offsets", json=body)
    assert r.status_code == 200, r.text
    assert s.call("PUT", f"/connectors/{name}/resume").status_code == 202
    # Partition 0 from offset 250 on: ids 500, 502, ..., 598 (50 rows) delivered again.
    wait_for(lambda: len(pg_rows(pg_url, pg_schema, "orders")) == 650, 120, "650 rows")
    again = [i for i, _ in pg_rows(pg_url, pg_schema, "orders")]
    dupes = sorted({i for i in again if again.count(i) > 1})
    assert dupes == list(range(500, 600, 2))
    new_run = s.status(name)["conveyor"]["run_id"]
    assert new_run != run_id  # a stopped connector starts in a new run

    # 5. delete: refused while running, then the file goes and the connector stays gone.
    r = s.call("DELETE", f"/connectors/{name}")
    assert r.status_code == 409 and "stop it first" in r.json()["message"]
    assert s.call("PUT", f"/connectors/{name}/stop").status_code == 204
    wait_for(lambda: s.state(name) == "STOPPED", SETTLE_S, "STOPPED again")
    assert s.call("DELETE", f"/connectors/{name}").status_code == 204
    assert not (s.connectors / f"{name}.yaml").exists()
    since = time.time()
    # Two scheduler ticks later it has not been created again from a file.

    def ticks_since() -> int:
        data = s.graphql(
            '{ sensorOrError(sensorSelector: {repositoryLocationName: "conveyor.dagster.definitions", '
            'repositoryName: "__repository__", sensorName: "conveyor_scheduler"}) '
            "{ ... on Sensor { sensorState { ticks(limit: 10) { timestamp status } } } } }"
        )
        ticks = data["sensorOrError"]["sensorState"]["ticks"]
        return sum(1 for t in ticks if t["timestamp"] > since and t["status"] != "STARTED")

    wait_for(lambda: ticks_since() >= 2, SETTLE_S, "two scheduler ticks after the delete")
    assert s.call("GET", f"/connectors/{name}").status_code == 404
    assert name not in s.call("GET", "/connectors").json()


def test_a_new_connector_file_runs_with_no_reload_by_hand(stack, tansu):
    s = stack
    name = f"file_{uuid.uuid4().hex[:6]}"
    topic = f"t_{name}"
    out = s.home / f"{name}_out"  # spec paths lie under $CONVEYOR_HOME
    produce(tansu, topic, 250)
    t0 = time.monotonic()
    (s.connectors / f"{name}.yaml").write_text(
        yaml.safe_dump(
            {
                "name": name,
                "source": {"topics": [topic]},
                "batch": {"max_records": 100, "max_wait_ms": 200},
                "sink": {"type": "localfile", "path": str(out)},
            }
        )
    )

    def lines() -> int:
        return sum(len(f.read_text().splitlines()) for f in out.glob("*.jsonl"))

    wait_for(lambda: f"connector__{name}" in s.jobs(), 120, "the job in the code location")
    s.timings["file_to_job_in_location_s"] = round(time.monotonic() - t0, 1)
    wait_for(lambda: lines() == 250, 180, f"250 lines from {name}\n{s.log()}")
    s.timings["file_to_250_lines_s"] = round(time.monotonic() - t0, 1)
    assert s.state(name) == "RUNNING"


def test_planted_secrets_appear_nowhere_but_in_the_run(stack, pg_url):
    s = stack
    # What an operator sees: the CLI and the API (collected during the tests above too).
    outputs = [
        s.cli("connector", "list", "--json"),
        s.cli("connector", "list"),
        *(s.cli("connector", "history", n) for n in s.call("GET", "/connectors").json()),
        *(s.cli("connector", "show", n) for n in s.call("GET", "/connectors").json()),
        s.call("GET", "/connectors?expand=status&expand=info").text,
        s.call("GET", "/metrics").text,
    ]
    # Asset metadata: every materialization the runs logged, and the asset specs.
    from dagster import DagsterInstance

    instance = DagsterInstance.from_config(str(s.home / "dagster"))
    try:
        for key in instance.get_asset_keys():
            for rec in instance.fetch_materializations(key, limit=1000).records:
                outputs.append(repr(rec.asset_materialization))
        nodes = s.graphql("{ assetNodes { assetKey { path } metadataEntries { label } } }")
        outputs.append(json.dumps(nodes))
    finally:
        instance.dispose()
    for secret in (SECRET_ENV, SECRET_FILE):
        for text in outputs + s.responses:
            assert secret not in text
        # Every byte of the state directory: meta store (and its WAL), Dagster's storage,
        # event logs and compute logs, the API's and the servers' logs.
        hits = []
        for f in s.home.rglob("*"):
            if f.is_file() and secret.encode() in f.read_bytes():
                hits.append(str(f))
        log = (s.cwd / "conveyor-dev.log").read_bytes()
        assert hits == [] and secret.encode() not in log, hits
    files_searched = sum(1 for f in s.home.rglob("*") if f.is_file())
    s.timings["state_files_searched"] = files_searched
    assert files_searched > 20  # the search covered a real state directory
