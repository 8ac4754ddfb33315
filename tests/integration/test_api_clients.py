"""Kafka Connect clients work unchanged (issue 34, point 3): a third-party Kafka Connect REST
client from PyPI (``kafka-connect-py``, which sends HTTP Basic credentials) and ``curl -u``
drive a connector's whole lifecycle against a real ``conveyor serve``; every step is checked
in the answer and in the meta store or the spec file."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator

import pytest
import requests
import yaml
from kafka_connect import KafkaConnect

from conveyor.core.model import ConnectorStatus, DesiredState, TopicPartition
from tests.integration.api_server import READONLY_TOKEN, TOKEN, Api, served


def config(table: str, max_records: int = 500) -> dict:
    return {
        "source": {"topics": ["orders"]},
        "batch": {"max_records": max_records},
        "sink": {
            "type": "postgres",
            "url": "postgresql://app:${env:CONVEYOR_CLIENTS_PG_PW}@127.0.0.1:5432/test",
            "table": table,
        },
    }


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with served(tmp_path_factory.mktemp("clients_home")) as a:
        yield a


def test_kafka_connect_py_drives_the_lifecycle_with_basic_credentials(api: Api) -> None:
    kc = KafkaConnect(url=api.url, auth=f"ops-team:{TOKEN}")
    name = "kc_client"
    assert kc.get_cluster_info()["version"]
    plugins = kc.list_connector_plugins()
    assert {"postgres", "postgres_polling"} <= {p["class"] for p in plugins}
    checked = kc.validate_connector_config("postgres", config(name))
    assert checked["error_count"] == 0 and checked["name"] == "postgres"
    bad = kc.validate_connector_config("postgres", {**config(name), "batch": {"max_records": 0}})
    assert bad["error_count"] >= 1

    created = kc.create_connector({"name": name, "config": config(name)})
    assert created["name"] == name and created["config"]["sink"]["table"] == name
    assert kc.list_connectors() == [name]
    expanded = kc.list_connectors(expand="status")
    assert expanded[name]["status"]["connector"]["state"] == "UNASSIGNED"
    assert kc.list_connectors(expand="info")[name]["info"]["name"] == name
    assert kc.get_connector(name)["type"] == "sink"
    assert kc.get_connector_config(name)["sink"]["url"] == config(name)["sink"]["url"]
    assert kc.list_connector_tasks(name)[0]["id"] == {"connector": name, "task": 0}

    kc.pause_connector(name)
    assert api.store.get(name).desired == DesiredState.PAUSED
    kc.resume_connector(name)
    assert api.store.get(name).desired == DesiredState.RUNNING
    updated = kc.update_connector(name, config(name, max_records=50))
    assert updated["config"]["batch"] == {"max_records": 50}
    assert yaml.safe_load((api.connectors / f"{name}.yaml").read_text())["batch"] == {
        "max_records": 50
    }

    # A run reads, fails; the client restarts it with its tasks.
    claim = api.store.claim(
        name, run_id="r1", expected_generation=None, holder_alive=lambda r: False
    )
    api.store.commit(name, claim.generation, {TopicPartition("orders", 0): 12})
    assert kc.list_connector_topics(name) == {name: {"topics": ["orders"]}}
    kc.reset_connector_topics(name)
    assert kc.list_connector_topics(name) == {name: {"topics": []}}
    api.store.release(name, claim.generation, ConnectorStatus.ERROR, "boom")
    assert kc.get_connector_status(name)["connector"]["state"] == "FAILED"
    restarted = kc.restart_connector(name, include_tasks=True, only_failed=True)
    assert restarted["connector"]["state"] == "RESTARTING"
    assert api.store.get(name).status != ConnectorStatus.ERROR

    kc.stop_connector(name)
    assert api.store.get(name).desired == DesiredState.STOPPED
    kc.delete_connector(name)
    assert kc.list_connectors() == [] and not (api.connectors / f"{name}.yaml").exists()

    with pytest.raises(requests.HTTPError) as e:
        KafkaConnect(url=api.url, auth="ops-team:wrong").list_connectors()
    assert e.value.response.status_code == 401
    monitor = KafkaConnect(url=api.url, auth=f"grafana:{READONLY_TOKEN}")
    assert monitor.list_connectors() == []
    with pytest.raises(requests.HTTPError) as e:
        monitor.create_connector({"name": "nope", "config": config("nope")})
    assert e.value.response.status_code == 403
    assert not (api.connectors / "nope.yaml").exists()


def curl(
    api: Api, method: str, path: str, *args: str, user: str = f"me:{TOKEN}"
) -> tuple[int, str]:
    out = subprocess.run(
        ["curl", "-sS", "-u", user, "-X", method, "-w", "\n%{http_code}", *args, api.url + path],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    body, _, code = out.rpartition("\n")
    return int(code), body


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_u_drives_the_lifecycle(api: Api) -> None:
    name = "curl_client"
    body = json.dumps({"name": name, "config": config(name)})
    code, out = curl(api, "POST", "/connectors", "-H", "Content-Type: application/json", "-d", body)
    assert code == 201 and json.loads(out)["name"] == name, out
    code, out = curl(api, "GET", f"/connectors/{name}/status")
    assert code == 200 and json.loads(out)["connector"]["state"] == "UNASSIGNED"
    assert curl(api, "PUT", f"/connectors/{name}/pause")[0] == 202
    assert api.store.get(name).desired == DesiredState.PAUSED
    assert curl(api, "PUT", f"/connectors/{name}/resume")[0] == 202
    code, out = curl(api, "POST", f"/connectors/{name}/restart?includeTasks=true&onlyFailed=false")
    assert code == 202 and json.loads(out)["connector"]["state"] == "RESTARTING"
    code, out = curl(api, "GET", f"/connectors/{name}/topics")
    assert code == 200 and json.loads(out) == {name: {"topics": []}}
    code, out = curl(api, "GET", "/connectors", user="me:wrong")
    assert code == 401 and json.loads(out)["message"] == "invalid token"
    code, out = curl(api, "DELETE", f"/connectors/{name}", user=f"ro:{READONLY_TOKEN}")
    assert code == 403
    assert curl(api, "PUT", f"/connectors/{name}/stop")[0] == 204
    assert curl(api, "DELETE", f"/connectors/{name}")[0] == 204
    assert json.loads(curl(api, "GET", "/connectors")[1]) == []
