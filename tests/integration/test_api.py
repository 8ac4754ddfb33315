"""The REST API (``conveyor serve``) as a real server, through a real HTTP client.

uvicorn in a subprocess over a SQLite meta store and a connectors directory; no Dagster
here (tests/e2e/test_api_e2e.py runs it against a whole stack). Each answer is checked
for its status, its JSON and what it did to the files and the store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from conveyor.core.model import ConnectorStatus, DesiredState, TopicPartition
from conveyor.ports import free_port, port_open
from conveyor.store.meta import MetaStore
from tests.e2e.conftest import wait_for

TOKEN = "t0ken-for-tests"
SECRET = "pg-pass-4cb1e07d"


@dataclass
class Api:
    url: str
    connectors: Path
    store: MetaStore
    proc: subprocess.Popen[bytes]
    log: Path

    def call(self, method: str, path: str, *, token: str | None = TOKEN, **kw) -> requests.Response:
        headers = kw.pop("headers", {})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return requests.request(method, self.url + path, headers=headers, timeout=30, **kw)


def conveyor(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "conveyor")
    return subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    home = tmp_path_factory.mktemp("api_home")
    connectors = home / "connectors"
    connectors.mkdir()
    token_file = home / "token"
    token_file.write_text(TOKEN + "\n")
    meta_url = f"sqlite:///{home / 'meta.db'}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")},
        "CONVEYOR_HOME": str(home),
        "CONVEYOR_META_URL": meta_url,
        "CONVEYOR_CONNECTORS_DIR": str(connectors),
    }
    port = free_port()
    log = home / "api.log"
    exe = str(Path(sys.executable).parent / "conveyor")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [exe, "serve", "--port", str(port), "--token-file", str(token_file)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: port_open("127.0.0.1", port) or proc.poll() is not None, 60, "the API")
        assert proc.poll() is None, log.read_text()
        yield Api(f"http://127.0.0.1:{port}", connectors, MetaStore(meta_url), proc, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)


def spec(name: str, **over) -> dict:
    return {
        "source": {"topics": ["orders"]},
        "sink": {
            "type": "postgres",
            "url": f"postgresql://app:{SECRET}@127.0.0.1:5432/test",
            "table": name,
        },
        **over,
    }


def test_probes_need_no_token_everything_else_does(api: Api) -> None:
    r = api.call("GET", "/health", token=None)
    assert r.status_code == 200 and r.json()["status"] == "healthy"
    r = api.call("GET", "/ready", token=None)
    assert r.status_code == 200 and r.json()["checks"] == {
        "meta_store": "ok",
        "connectors_dir": "ok",
    }
    r = api.call("GET", "/connectors", token=None)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    assert r.json() == {
        "error_code": 401,
        "message": "missing credentials: send the header 'Authorization: Bearer <token>'",
    }
    r = api.call("GET", "/connectors", token="wrong")
    assert r.status_code == 401 and r.json()["message"] == "invalid bearer token"
    r = api.call("GET", "/metrics", token=None)
    assert r.status_code == 401
    r = api.call("GET", "/connectors", headers={"Authorization": f"Basic {TOKEN}"}, token=None)
    assert r.status_code == 401 and "unsupported Authorization scheme" in r.json()["message"]


def test_malformed_and_invalid_requests_get_400_naming_the_problem(api: Api) -> None:
    r = api.call(
        "POST", "/connectors", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["message"].startswith(
        "the request body is not valid JSON"
    )
    r = api.call("POST", "/connectors", json={"config": spec("x")})
    assert r.status_code == 400 and r.json()["message"] == (
        "name: missing; expected the connector's name"
    )
    r = api.call(
        "POST",
        "/connectors",
        json={"name": "bad_sink", "config": {**spec("x"), "sink": {"type": "postgress"}}},
    )
    assert r.status_code == 400
    assert (
        "sink.type: unknown sink type 'postgress'; did you mean 'postgres'?" in r.json()["message"]
    )
    r = api.call(
        "POST",
        "/connectors",
        json={"name": "bad_batch", "config": spec("x", batch={"max_records": 0})},
    )
    assert r.status_code == 400 and "batch.max_records" in r.json()["message"]
    r = api.call("PUT", "/connectors/other/config", json={**spec("x"), "name": "mismatch"})
    assert r.status_code == 400 and "differs from the connector name 'other'" in r.json()["message"]
    r = api.call("GET", "/connectors?expand=nope")
    assert r.status_code == 400 and "expand" in r.json()["message"]
    r = api.call("GET", "/connectors/nope/status")
    assert r.status_code == 404 and r.json() == {
        "error_code": 404,
        "message": "connector 'nope' not found",
    }
    r = api.call("GET", "/no/such/route")
    assert r.status_code == 404 and r.json()["error_code"] == 404
    r = api.call("POST", "/connectors/x/pause")
    assert r.status_code == 405 and "not allowed" in r.json()["message"]
    assert list(api.connectors.iterdir()) == []  # nothing written by a refused request


def test_create_status_config_update_pause_stop_offsets_delete(api: Api) -> None:
    name = "orders_api"
    r = api.call("POST", "/connectors", json={"name": name, "config": spec(name)})
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["name"] == name and info["type"] == "sink"
    assert info["tasks"] == [{"connector": name, "task": 0}]
    # The spec is a file in the connectors directory; the answer and the store mask the password.
    path = api.connectors / f"{name}.yaml"
    assert yaml.safe_load(path.read_text())["sink"]["url"].endswith(f"{SECRET}@127.0.0.1:5432/test")
    assert SECRET not in r.text
    assert info["config"]["sink"]["url"] == "**********"
    assert SECRET not in (api.store.get(name).spec_json or "")
    r = api.call("POST", "/connectors", json={"name": name, "config": spec(name)})
    assert r.status_code == 409 and r.json()["message"] == f"connector '{name}' already exists"

    r = api.call("GET", f"/connectors/{name}/status")
    assert r.status_code == 200
    st = r.json()
    assert st["connector"]["state"] == "UNASSIGNED" and st["conveyor"]["status"] == "Idle"
    assert api.call("GET", "/connectors").json() == [name]
    expanded = api.call("GET", "/connectors?expand=status&expand=info").json()
    assert expanded[name]["status"]["name"] == name and expanded[name]["info"]["name"] == name

    # A secret by reference: stored and shown as the reference.
    cfg = spec(name)
    cfg["sink"]["url"] = "postgresql://app:${env:ORDERS_PG_PASSWORD}@127.0.0.1:5432/test"
    cfg["batch"] = {"max_records": 100}
    r = api.call("PUT", f"/connectors/{name}/config", json=cfg)
    assert r.status_code == 200, r.text
    assert r.json()["config"]["sink"]["url"] == cfg["sink"]["url"]
    assert api.call("GET", f"/connectors/{name}/config").json()["batch"] == {"max_records": 100}
    assert SECRET not in path.read_text()

    # A run claims it (as the op does), then pause / resume / stop through the API.
    claim = api.store.claim(
        name, run_id="r1", expected_generation=None, holder_alive=lambda r: False
    )
    api.store.commit(name, claim.generation, {TopicPartition("orders", 0): 42})
    api.store.heartbeat(name, claim.generation, {"messages_out": 42})
    assert api.call("PUT", f"/connectors/{name}/pause").status_code == 202
    assert api.store.get(name).desired == DesiredState.PAUSED
    assert (
        api.store.heartbeat(name, claim.generation, {}, status=ConnectorStatus.PAUSED).desired
        == DesiredState.PAUSED
    )
    assert api.call("GET", f"/connectors/{name}/status").json()["connector"]["state"] == "PAUSED"
    assert api.call("PUT", f"/connectors/{name}/resume").status_code == 202
    assert api.store.get(name).desired == DesiredState.RUNNING

    # Offsets change only when stopped; deleting a running connector is refused.
    body = {
        "offsets": [
            {
                "partition": {"kafka_topic": "orders", "kafka_partition": 0},
                "offset": {"kafka_offset": 7},
            }
        ]
    }
    r = api.call("PATCH", f"/connectors/{name}/offsets", json=body)
    assert (
        r.status_code == 409
        and "offsets can be changed only when it is stopped" in r.json()["message"]
    )
    r = api.call("DELETE", f"/connectors/{name}")
    assert r.status_code == 409 and "stop it first" in r.json()["message"]
    assert api.call("PUT", f"/connectors/{name}/stop").status_code == 204
    # The run sees the stop in its heartbeat and releases the connector, as the op does.
    assert api.store.heartbeat(name, claim.generation, {}).desired == DesiredState.STOPPED
    api.store.release(name, claim.generation, ConnectorStatus.STOPPED, "stopped")
    assert api.call("GET", f"/connectors/{name}/status").json()["connector"]["state"] == "STOPPED"

    assert api.call("GET", f"/connectors/{name}/offsets").json() == {
        "offsets": [
            {
                "partition": {"kafka_topic": "orders", "kafka_partition": 0},
                "offset": {"kafka_offset": 42},
            }
        ]
    }
    bad = {
        "offsets": [
            {
                "partition": {"kafka_topic": "orders", "kafka_partition": -1},
                "offset": {"kafka_offset": 7},
            }
        ]
    }
    r = api.call("PATCH", f"/connectors/{name}/offsets", json=bad)
    assert r.status_code == 400 and r.json()["message"].startswith(
        "offsets[0].partition.kafka_partition"
    )
    other = {
        "offsets": [
            {
                "partition": {"kafka_topic": "clicks", "kafka_partition": 0},
                "offset": {"kafka_offset": 1},
            }
        ]
    }
    r = api.call("PATCH", f"/connectors/{name}/offsets", json=other)
    assert r.status_code == 400 and "does not read topic 'clicks'" in r.json()["message"]
    body["offsets"].append(
        {
            "partition": {"kafka_topic": "orders", "kafka_partition": 1},
            "offset": {"kafka_offset": 3},
        }
    )
    r = api.call("PATCH", f"/connectors/{name}/offsets", json=body)
    assert r.status_code == 200 and "altered successfully" in r.json()["message"]
    assert api.store.committed_offsets(name) == {
        TopicPartition("orders", 0): 7,
        TopicPartition("orders", 1): 3,
    }
    forget = {
        "offsets": [{"partition": {"kafka_topic": "orders", "kafka_partition": 1}, "offset": None}]
    }
    assert api.call("PATCH", f"/connectors/{name}/offsets", json=forget).status_code == 200
    assert api.store.committed_offsets(name) == {TopicPartition("orders", 0): 7}
    assert api.call("DELETE", f"/connectors/{name}/offsets").status_code == 200
    assert api.store.committed_offsets(name) == {}
    history = api.call("GET", f"/connectors/{name}/history").json()
    assert any("offsets altered from the REST API" in h["reason"] for h in history)

    r = api.call("GET", "/metrics")
    assert (
        r.status_code == 200
        and f'conveyor_connector_state{{connector="{name}",state="Stopped"}} 1.0' in r.text
    )
    dest = api.call("GET", f"/connectors/{name}/destination").json()
    assert dest["type"] == "postgres" and dest["asset_key"] == f"postgres/public/{name}"

    assert api.call("DELETE", f"/connectors/{name}").status_code == 204
    assert not path.exists()
    assert api.call("GET", f"/connectors/{name}").status_code == 404
    assert api.call("GET", "/connectors").json() == []


def test_serve_refuses_to_start_without_a_token_or_open_without_one(tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")},
        "CONVEYOR_HOME": str(tmp_path),
    }
    r = conveyor("serve", "--port", str(free_port()), env=env)
    assert r.returncode == 1 and "no API token: set CONVEYOR_API_TOKEN" in r.stderr
    r = conveyor("serve", "--no-auth", "--host", "0.0.0.0", "--port", str(free_port()), env=env)
    assert r.returncode == 1 and "--no-auth is refused on 0.0.0.0" in r.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = conveyor("serve", "--token-file", str(empty), "--port", str(free_port()), env=env)
    assert r.returncode == 1 and "is empty" in r.stderr
