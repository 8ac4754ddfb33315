"""The REST API (``conveyor serve``) as a real server, through a real HTTP client.

uvicorn in a subprocess over a SQLite meta store and a connectors directory; no Dagster
here (tests/e2e/test_api_e2e.py runs it against a whole stack). Each answer is checked
for its status, its JSON and what it did to the files and the store.
"""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conveyor.core.host.ports import free_port
from conveyor.core.model import ConnectorStatus, DesiredState, TopicPartition
from tests.integration.api_server import READONLY_TOKEN, TOKEN, Api, conveyor_exe, served

SECRET = "pg-pass-4cb1e07d"  # behind ${file:...} in the secrets directory
PW_REF = "${env:CONVEYOR_TEST_PG_PW}"


def conveyor(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [conveyor_exe(), *args], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    home = tmp_path_factory.mktemp("api_home")
    (home / "secrets").mkdir()
    (home / "secrets" / "pg").write_text(SECRET + "\n")
    with served(home) as a:
        yield a


def spec(name: str, **over) -> dict:
    return {
        "source": {"topics": ["orders"]},
        "sink": {
            "type": "postgres",
            "url": f"postgresql://app:{PW_REF}@127.0.0.1:5432/test",
            "table": name,
            # A user the server does not know (the API's shapes are tested, not the target's):
            # an offsets change cannot reach an offsets table there.
            "delivery": "at_least_once",
        },
        **over,
    }


def basic(password: str, user: str = "any-user") -> dict[str, str]:
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {raw}"}


def test_probes_need_no_token_and_show_details_only_to_a_token(api: Api) -> None:
    r = api.call("GET", "/health", token=None)
    assert r.status_code == 200 and r.json()["status"] == "healthy"
    r = api.call("GET", "/ready", token=None)
    assert r.status_code == 200 and r.json() == {"status": "ready"}
    for token in (TOKEN, READONLY_TOKEN):
        r = api.call("GET", "/ready", token=token)
        assert r.status_code == 200 and r.json() == {
            "status": "ready",
            "checks": {"meta_store": "ok", "connectors_dir": "ok"},
        }
    r = api.call("GET", "/connectors", token=None)
    assert r.status_code == 401 and "Bearer" in r.headers["WWW-Authenticate"]
    assert "Basic" in r.headers["WWW-Authenticate"]
    assert r.json() == {
        "error_code": 401,
        "message": "missing credentials: send the header 'Authorization: Bearer <token>' "
        "(or HTTP Basic with the token as the password)",
    }
    r = api.call("GET", "/connectors", token="wrong")
    assert r.status_code == 401 and r.json()["message"] == "invalid bearer token"
    r = api.call("GET", "/metrics", token=None)
    assert r.status_code == 401
    r = api.call("GET", "/connectors", headers={"Authorization": f"Digest {TOKEN}"}, token=None)
    assert r.status_code == 401 and "unsupported Authorization scheme" in r.json()["message"]


def test_http_basic_carries_the_token_as_its_password_any_user(api: Api) -> None:
    for user in ("admin", "", "kafka-connect-ui"):
        r = api.call("GET", "/connectors", headers=basic(TOKEN, user), token=None)
        assert r.status_code == 200 and r.json() == [], r.text
    r = api.call("GET", "/connectors", headers=basic("wrong"), token=None)
    assert r.status_code == 401 and r.json()["message"] == "invalid token"
    r = api.call("GET", "/connectors", headers={"Authorization": "Basic !!!"}, token=None)
    assert r.status_code == 401
    # requests' own auth= sends Basic, as Kafka Connect clients do.
    r = api.call("GET", "/connectors", auth=("u", TOKEN), token=None)
    assert r.status_code == 200


def test_the_read_only_token_reads_and_may_not_write(api: Api) -> None:
    name = "ro_check"
    assert api.call("POST", "/connectors", json={"name": name, "config": spec(name)}).ok
    try:
        for path in ("/connectors", f"/connectors/{name}/status", f"/connectors/{name}/config"):
            assert api.call("GET", path, token=READONLY_TOKEN).status_code == 200
        assert api.call("GET", "/connectors", headers=basic(READONLY_TOKEN), token=None).ok
        writes = [
            ("POST", "/connectors", {"name": "ro_new", "config": spec("ro_new")}),
            ("PUT", f"/connectors/{name}/config", spec(name)),
            ("PUT", f"/connectors/{name}/pause", None),
            ("PUT", f"/connectors/{name}/stop", None),
            ("POST", f"/connectors/{name}/restart", None),
            ("DELETE", f"/connectors/{name}", None),
            ("DELETE", f"/connectors/{name}/offsets", None),
            ("PUT", f"/connectors/{name}/topics/reset", None),
        ]
        for method, path, body in writes:
            r = api.call(method, path, token=READONLY_TOKEN, json=body)
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["message"].startswith("the read-only token may only read (GET)")
        row = api.store.get(name)
        assert row.desired == DesiredState.RUNNING and not (api.connectors / "ro_new.yaml").exists()
    finally:
        assert api.call("DELETE", f"/connectors/{name}").status_code == 204


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
    # The spec is a file in the connectors directory; the reference is kept and shown.
    path = api.connectors / f"{name}.yaml"
    assert yaml.safe_load(path.read_text())["sink"]["url"] == spec(name)["sink"]["url"]
    assert info["config"]["sink"]["url"] == spec(name)["sink"]["url"]
    r = api.call("POST", "/connectors", json={"name": name, "config": spec(name)})
    assert r.status_code == 409 and r.json()["message"] == f"connector '{name}' already exists"

    r = api.call("GET", f"/connectors/{name}/status")
    assert r.status_code == 200
    st = r.json()
    assert st["connector"]["state"] == "UNASSIGNED" and st["conveyor"]["status"] == "Idle"
    assert api.call("GET", "/connectors").json() == [name]
    expanded = api.call("GET", "/connectors?expand=status&expand=info").json()
    assert expanded[name]["status"]["name"] == name and expanded[name]["info"]["name"] == name

    # A secret by reference (a file): stored and shown as the reference.
    cfg = spec(name)
    ref = "${file:" + str(api.home / "secrets" / "pg") + "}"
    cfg["sink"]["url"] = f"postgresql://app:{ref}@127.0.0.1:5432/test"
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
    assert r.status_code == 200 and "altered successfully" in r.json()["message"], r.text
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


def claimed(api: Api, name: str, offsets: dict[TopicPartition, int]) -> int:
    """A run claims the connector and commits ``offsets`` (as the connector op does)."""
    claim = api.store.claim(
        name, run_id=f"run-{name}", expected_generation=None, holder_alive=lambda r: False
    )
    api.store.commit(name, claim.generation, offsets)
    return claim.generation


ROUND_TRIPS = {
    "redis_sink": (
        {
            "source": {"topics": ["orders"]},
            "sink": {
                "type": "redis",
                "password": SECRET,  # a literal secret field: masked when shown
                "commands": ["SET o:${payload.id} ${payload.status}"],
            },
        },
        "sink",
        "password",
        "username",
    ),
    "webhook_source": (  # the case: a webhook's token written back as the mask
        {"kind": "source", "source": {"type": "webhook", "auth": "token", "token": SECRET}},
        "source",
        "token",
        "secret",
    ),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_get_then_put_back_keeps_a_literal_secret_and_never_stores_the_mask(
    api: Api, case: str
) -> None:
    cfg, section, field, unset = ROUND_TRIPS[case]
    name = f"roundtrip_{case}"
    r = api.call("POST", "/connectors", json={"name": name, "config": cfg})
    assert r.status_code == 201, r.text
    # Kafka Connect's type: a source connector is not reported as a sink.
    assert r.json()["type"] == section
    assert api.call("GET", f"/connectors/{name}").json()["type"] == section
    path = api.connectors / f"{name}.yaml"
    try:
        shown = api.call("GET", f"/connectors/{name}/config").json()
        assert shown[section][field] == "**********" and SECRET not in json_text(shown)
        shown["batch"] = {"max_records": 50}  # the usual edit
        r = api.call("PUT", f"/connectors/{name}/config", json=shown)
        assert r.status_code == 200, r.text
        on_disk = yaml.safe_load(path.read_text())
        assert on_disk[section][field] == SECRET and on_disk["batch"] == {"max_records": 50}
        assert "**********" not in path.read_text()
        assert SECRET not in (api.store.get(name).spec_json or "")
        # A mask where nothing is stored: refused, naming the field; nothing written.
        if unset == "username":
            shown[section][unset] = "**********"
        else:
            shown[section] = {**shown[section], "auth": "hmac_sha256", unset: "**********"}
            shown[section].pop(field)
        r = api.call("PUT", f"/connectors/{name}/config", json=shown)
        assert r.status_code == 400 and f"{section}.{unset}" in r.json()["message"], r.text
        assert "mask" in r.json()["message"]
        masked = {**cfg, section: {**cfg[section], field: "**********"}}
        r = api.call("POST", "/connectors", json={"name": f"{name}_new", "config": masked})
        assert r.status_code == 400, r.text
        assert f"{section}.{field}: holds the mask" in r.json()["message"]
        assert yaml.safe_load(path.read_text())[section][field] == SECRET
        assert not (api.connectors / f"{name}_new.yaml").exists()
    finally:
        api.call("DELETE", f"/connectors/{name}")


def json_text(value: object) -> str:
    import json

    return json.dumps(value)


@pytest.mark.parametrize(
    ("sink", "field"),
    [
        ({"type": "postgres", "url": "postgresql://app:hunter2@127.0.0.1/test"}, "sink.url"),
        ({"type": "postgres", "url": "postgresql://127.0.0.1/test?password=hunter2"}, "sink.url"),
        ({"type": "postgres", "url": "host=127.0.0.1 password=hunter2 dbname=test"}, "sink.url"),
        ({"type": "mysql", "url": "mysql://root:hunter2@127.0.0.1:3306/test"}, "sink.url"),
        ({"type": "mongodb", "url": "mongodb://u:hunter2@h1,h2/?replicaSet=rs"}, "sink.url"),
        ({"type": "rabbitmq", "url": "amqp://guest:hunter2@127.0.0.1:5672/%2F"}, "sink.url"),
    ],
)
def test_literal_credentials_in_connection_strings_are_refused(
    api: Api, sink: dict, field: str
) -> None:
    extra = {
        "postgres": {"table": "t"},
        "mysql": {"table": "t"},
        "mongodb": {"database": "d", "collection": "c"},
        "rabbitmq": {"exchange": "x"},
    }[sink["type"]]
    cfg = {"source": {"topics": ["orders"]}, "sink": {**sink, **extra}}
    r = api.call("POST", "/connectors", json={"name": "literal_cred", "config": cfg})
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert f"{field}: holds " in message and "written literally" in message, message
    assert "reference" in message and "hunter2" not in message
    assert not (api.connectors / "literal_cred.yaml").exists()


def test_active_topics_and_their_reset_kip_558(api: Api) -> None:
    name = "topics_api"
    assert api.call("POST", "/connectors", json={"name": name, "config": spec(name)}).ok
    try:
        assert api.call("GET", f"/connectors/{name}/topics").json() == {name: {"topics": []}}
        gen = claimed(api, name, {TopicPartition("orders", 0): 5, TopicPartition("audit", 1): 2})
        r = api.call("GET", f"/connectors/{name}/topics")
        assert r.status_code == 200 and r.json() == {name: {"topics": ["audit", "orders"]}}
        assert api.call("PUT", f"/connectors/{name}/topics/reset").status_code == 202
        assert api.call("GET", f"/connectors/{name}/topics").json() == {name: {"topics": []}}
        api.store.commit(name, gen, {TopicPartition("orders", 0): 9})  # read on after the reset
        assert api.call("GET", f"/connectors/{name}/topics").json() == {
            name: {"topics": ["orders"]}
        }
        history = api.call("GET", f"/connectors/{name}/history").json()
        assert any("active topics reset from the REST API" in h["reason"] for h in history)
        assert api.call("GET", "/connectors/nope/topics").status_code == 404
    finally:
        api.store.release(name, gen, ConnectorStatus.STOPPED, "test over")
        api.call("PUT", f"/connectors/{name}/stop")
        api.call("DELETE", f"/connectors/{name}")


def test_config_validate_answers_kafka_connects_shape(api: Api) -> None:
    good = {
        "source": {"topics": ["orders"]},
        "sink": {"url": spec("x")["sink"]["url"], "table": "t"},
    }
    r = api.call("PUT", "/connector-plugins/postgres/config/validate", json=good)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["name"] == "postgres" and body["error_count"] == 0 and "sink" in body["groups"]
    by_name = {c["definition"]["name"]: c for c in body["configs"]}
    assert by_name["sink.table"]["value"] == {
        "name": "sink.table",
        "value": "t",
        "recommended_values": [],
        "errors": [],
        "visible": True,
    }
    assert by_name["sink.table"]["definition"]["required"] is True
    assert by_name["sink.url"]["definition"]["type"] == "PASSWORD"
    assert by_name["sink.url"]["value"]["value"] == "**********"  # never echoed
    bad = {
        "source": {"topics": ["orders"]},
        "batch": {"max_records": 0},
        "sink": {"url": "${env:CONVEYOR_X}"},
    }
    body = api.call("PUT", "/connector-plugins/postgres/config/validate", json=bad).json()
    errors = {
        c["value"]["name"]: c["value"]["errors"] for c in body["configs"] if c["value"]["errors"]
    }
    assert body["error_count"] == sum(len(e) for e in errors.values()) >= 1
    assert any(k.startswith("sink.table") or k.startswith("batch") for k in errors), errors
    body = api.call(
        "PUT",
        "/connector-plugins/postgres/config/validate",
        json={
            "source": {"topics": ["o"]},
            "sink": {"table": "${file:/etc/passwd}", "url": "postgresql://h/x"},
        },
    ).json()
    table = next(c for c in body["configs"] if c["value"]["name"] == "sink.table")
    assert body["error_count"] == 1 and "reference" in table["value"]["errors"][0]
    r = api.call("PUT", "/connector-plugins/postgress/config/validate", json=good)
    assert r.status_code == 400 and "did you mean 'postgres'" in r.json()["message"]
    assert list(api.connectors.iterdir()) == []  # validating writes nothing


def test_restart_include_tasks_and_only_failed_kip_745(api: Api) -> None:
    name = "restart_api"
    assert api.call("POST", "/connectors", json={"name": name, "config": spec(name)}).ok
    try:
        before = api.store.get(name).generation
        # Nothing failed: onlyFailed restarts nothing and answers the status as it is.
        r = api.call("POST", f"/connectors/{name}/restart?onlyFailed=true&includeTasks=true")
        assert r.status_code == 202 and r.json()["connector"]["state"] == "UNASSIGNED"
        assert api.store.get(name).generation == before
        # Failed: restarted, the answer shows it RESTARTING.
        gen = claimed(api, name, {TopicPartition("orders", 0): 1})
        api.store.release(name, gen, ConnectorStatus.ERROR, "boom")
        r = api.call("POST", f"/connectors/{name}/restart?onlyFailed=true")
        assert r.status_code == 202 and r.json()["connector"]["state"] == "RESTARTING"
        assert api.store.get(name).status != ConnectorStatus.ERROR
        history = api.call("GET", f"/connectors/{name}/history").json()
        assert history[0]["reason"].startswith("restart from the REST API")
        r = api.call("POST", f"/connectors/{name}/restart?includeTasks=true")
        assert r.status_code == 202 and r.json()["connector"]["state"] == "RESTARTING"
        assert all(t["state"] == "RESTARTING" for t in r.json()["tasks"])
        assert api.call("POST", f"/connectors/{name}/restart").status_code == 204
        r = api.call("POST", f"/connectors/{name}/restart?onlyFailed=maybe")
        assert r.status_code == 400 and "onlyFailed" in r.json()["message"]
    finally:
        api.call("PUT", f"/connectors/{name}/stop")
        api.call("DELETE", f"/connectors/{name}")


def test_limit_is_bounded(api: Api) -> None:
    name = "limits"
    assert api.call("POST", "/connectors", json={"name": name, "config": spec(name)}).ok
    try:
        assert api.call("GET", f"/connectors/{name}/history?limit=1000").status_code == 200
        for bad in ("1001", "0", "-1", "9" * 40):
            r = api.call("GET", f"/connectors/{name}/history?limit={bad}")
            assert r.status_code == 400 and r.json()["message"].startswith("limit:"), r.text
    finally:
        api.call("DELETE", f"/connectors/{name}")


def test_offsets_a_target_keeps_are_not_changed_behind_its_back(api: Api) -> None:
    """A sink that keeps the offsets in its target (exactly once: their offsets win on start)
    and cannot move them there (a lakehouse table) refuses a change made only in the meta store,
    naming why; an at-least-once one takes it. (The sinks that move them: tests/integration/
    test_offsets_in_target.py.)"""
    body = {
        "offsets": [
            {
                "partition": {"kafka_topic": "orders", "kafka_partition": 0},
                "offset": {"kafka_offset": 7},
            }
        ]
    }
    sinks = {
        "eos_delta": {"type": "delta", "path": "delta/eos_delta"},
        "eos_kafka": {
            "type": "kafka",
            "bootstrap_servers": "127.0.0.1:9",
            "topic": "out",
            "delivery": "exactly_once",
        },
    }
    name = "eos_delta"
    r = api.call(
        "POST", "/connectors", json={"name": name, "config": {**spec(name), "sink": sinks[name]}}
    )
    assert r.status_code == 201, r.text
    assert api.call("PUT", f"/connectors/{name}/stop").status_code == 204
    for method, kw in (("PATCH", {"json": body}), ("DELETE", {})):
        r = api.call(method, f"/connectors/{name}/offsets", **kw)
        assert r.status_code == 409, (name, method, r.text)
        assert "keeps its offsets in its target" in r.json()["message"]
        assert "commit without rows" in r.json()["message"]
    assert api.store.committed_offsets(name) == {}
    name = "alo_kafka"
    sink = {**sinks["eos_kafka"], "delivery": "at_least_once"}
    assert (
        api.call(
            "POST", "/connectors", json={"name": name, "config": {**spec(name), "sink": sink}}
        ).status_code
        == 201
    )
    assert api.call("PUT", f"/connectors/{name}/stop").status_code == 204
    assert api.call("PATCH", f"/connectors/{name}/offsets", json=body).status_code == 200
    assert api.store.committed_offsets(name) == {TopicPartition("orders", 0): 7}


def kip875(topic: object, partition: object, offset: object) -> dict:
    return {
        "offsets": [
            {
                "partition": {"kafka_topic": topic, "kafka_partition": partition},
                "offset": offset if offset is None else {"kafka_offset": offset},
            }
        ]
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            kip875("orders", 0, 2**70),
            f"offsets[0].offset.kafka_offset: {2**70} is out of range: an offset (int64) is "
            f"from 0 to {2**63 - 1}",
        ),
        (kip875("orders", 0, 2**63), "offsets[0].offset.kafka_offset: 9223372036854775808 is out"),
        (kip875("orders", 0, -5), "offsets[0].offset.kafka_offset: -5 is out of range"),
        (kip875("orders", -1, 3), "offsets[0].partition.kafka_partition: -1 is out of range"),
        (kip875("orders", 2**31, 3), "offsets[0].partition.kafka_partition: 2147483648 is out"),
        (kip875("orders", 0, "x"), "offsets[0].offset.kafka_offset: 'x' is not an offset"),
        (kip875("orders", 0.5, 3), "offsets[0].partition.kafka_partition: 0.5 is not a partition"),
        (
            kip875("clicks", 0, 1),
            "offsets[0].partition.kafka_topic: the connector does not read topic 'clicks' "
            "(it reads orders, /ord[0-9]+/)",
        ),
        (kip875("clicks", 0, None), "offsets[0].partition.kafka_topic: the connector does not"),
        (
            {
                "offsets": [
                    {**kip875("orders", 0, 1)["offsets"][0], "offset": {"kafka_offset": None}}
                ]
            },
            "offsets[0].offset.kafka_offset: missing",
        ),
    ],
)
def test_offsets_patch_refuses_what_kafka_cannot_hold_or_the_connector_does_not_read(
    api: Api, body: dict, message: str
) -> None:
    """KIP-875's rules through the shared validator (core.positions): a 400 naming the item
    and the rule, never a 500 from the store; nothing changed."""
    name = "patch_bounds"
    if api.call("GET", f"/connectors/{name}").status_code == 404:
        cfg = spec(name, source={"topics": ["orders"], "topics_regex": "ord[0-9]+"})
        assert api.call("POST", "/connectors", json={"name": name, "config": cfg}).ok
        assert api.call("PUT", f"/connectors/{name}/stop").status_code == 204
        ok = {"offsets": [*kip875("orders", 0, 7)["offsets"], *kip875("ord1", "2", "9")["offsets"]]}
        r = api.call("PATCH", f"/connectors/{name}/offsets", json=ok)  # "2": as Kafka Connect
        assert r.status_code == 200, r.text
    r = api.call("PATCH", f"/connectors/{name}/offsets", json=body)
    assert r.status_code == 400, r.text
    assert r.json() == {"error_code": 400, "message": r.json()["message"]}
    assert r.json()["message"].startswith(message), r.json()["message"]
    assert api.store.committed_offsets(name) == {
        TopicPartition("orders", 0): 7,
        TopicPartition("ord1", 2): 9,
    }
