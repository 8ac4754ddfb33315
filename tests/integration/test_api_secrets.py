"""Issue 34's secrets findings through the REST API (a real server, a real HTTP client).

M2: a config sent back with the mask keeps the stored secret only while the section's
destination is unchanged; pointing ``hosts`` elsewhere must re-enter the secret. L1: a secret
field mixing a reference and literal text is masked when shown and stored. M1: the literal
credentials the review slipped past the rule are refused, and nothing is written.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import yaml

from tests.integration.api_server import Api, served

pytestmark = pytest.mark.integration

SECRET = "es-pass-71c0aa3e"
MASK = "**********"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with served(tmp_path_factory.mktemp("api_secrets_home")) as a:
        yield a


def es(**sink) -> dict:
    return {
        "source": {"topics": ["orders"]},
        "sink": {
            "type": "elasticsearch",
            "hosts": ["http://127.0.0.1:9200"],
            "index": "orders",
            **sink,
        },
        "desired": "stopped",
    }


def test_the_mask_keeps_the_secret_only_for_the_same_destination(api: Api) -> None:
    name = "es_moved"
    r = api.call("PUT", f"/connectors/{name}/config", json=es(username="elastic", password=SECRET))
    assert r.status_code == 201, r.text
    path = api.connectors / f"{name}.yaml"
    try:
        shown = api.call("GET", f"/connectors/{name}/config").json()
        assert shown["sink"]["password"] == MASK
        # Pointed at another server with the mask: refused, the file as it was.
        moved = json.loads(json.dumps(shown))
        moved["sink"]["hosts"] = ["http://attacker.example:9200"]
        r = api.call("PUT", f"/connectors/{name}/config", json=moved)
        assert r.status_code == 400, r.text
        message = r.json()["message"]
        assert "re-enter sink.password: the destination changed (hosts)" in message
        on_disk = yaml.safe_load(path.read_text())
        assert on_disk["sink"]["hosts"] == ["http://127.0.0.1:9200"]
        assert on_disk["sink"]["password"] == SECRET
        # The same server, another index: the stored secret is kept.
        shown["sink"]["index"] = "orders_v2"
        r = api.call("PUT", f"/connectors/{name}/config", json=shown)
        assert r.status_code == 200, r.text
        on_disk = yaml.safe_load(path.read_text())
        assert (on_disk["sink"]["index"], on_disk["sink"]["password"]) == ("orders_v2", SECRET)
        # Another server with the secret entered again (a reference): accepted.
        moved["sink"]["password"] = "${env:CONVEYOR_ES_PW}"
        r = api.call("PUT", f"/connectors/{name}/config", json=moved)
        assert r.status_code == 200, r.text
        on_disk = yaml.safe_load(path.read_text())
        assert on_disk["sink"]["hosts"] == ["http://attacker.example:9200"]
        assert on_disk["sink"]["password"] == "${env:CONVEYOR_ES_PW}"
    finally:
        api.call("DELETE", f"/connectors/{name}")


def test_a_reference_with_literal_text_around_it_is_masked(api: Api) -> None:
    name = "es_half"
    value = "${env:CONVEYOR_X}LITERAL_SUFFIX_9911"
    r = api.call("PUT", f"/connectors/{name}/config", json=es(api_key=value))
    assert r.status_code == 201, r.text
    try:
        shown = api.call("GET", f"/connectors/{name}/config").json()
        assert shown["sink"]["api_key"] == MASK
        listed = api.call("GET", f"/connectors/{name}").text
        assert "LITERAL_SUFFIX" not in listed
        assert "LITERAL_SUFFIX" not in (api.store.get(name).spec_json or "")
        whole = api.call(
            "PUT", f"/connectors/{name}/config", json=es(api_key="${env:CONVEYOR_ES_KEY}")
        )
        assert whole.status_code == 200, whole.text
        shown = api.call("GET", f"/connectors/{name}/config").json()
        assert shown["sink"]["api_key"] == "${env:CONVEYOR_ES_KEY}"
    finally:
        api.call("DELETE", f"/connectors/{name}")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:hunt?er2@127.0.0.1:5432/test",
        "postgresql://app?:hunter2@127.0.0.1/test",
        "postgresql://app@127.0.0.1/test?%70assword=hunter2",
        "host='127.0.0.1'password=hunter2 dbname=test",
    ],
)
def test_literal_passwords_the_review_slipped_through_are_refused(api: Api, url: str) -> None:
    cfg = {
        "source": {"topics": ["orders"]},
        "sink": {"type": "postgres", "url": url, "table": "t"},
        "desired": "stopped",
    }
    r = api.call("PUT", "/connectors/pg_literal/config", json=cfg)
    assert r.status_code == 400, r.text
    assert "sink.url: holds " in r.json()["message"]
    assert "hunter2" not in r.text
    assert not (api.connectors / "pg_literal.yaml").exists()


def test_a_literal_mysql_password_with_a_space_is_refused(api: Api) -> None:
    cfg = {
        "source": {"topics": ["orders"]},
        "sink": {"type": "mysql", "url": "mysql://root:pa ss@127.0.0.1:3306/test", "table": "t"},
        "desired": "stopped",
    }
    r = api.call("PUT", "/connectors/my_literal/config", json=cfg)
    assert r.status_code == 400, r.text
    assert "written literally" in r.json()["message"]
    assert not (api.connectors / "my_literal.yaml").exists()


# Issue 45: secret fields that are also the destination. Each is shown as the mask, so a GET
# then PUT sent it back as the mask, which was refused as "destination changed (url)".
MASKED_DESTINATIONS = {
    "postgres": ({"url": "postgresql://app@127.0.0.1:5432/test", "table": "t"}, "table", "t2"),
    "mysql": ({"url": "mysql://root@127.0.0.1:3306/test", "table": "t"}, "table", "t2"),
    "mongodb": (
        {"url": "mongodb://127.0.0.1:27017/", "database": "d", "collection": "c"},
        "collection",
        "c2",
    ),
    "rabbitmq": ({"url": "amqp://guest@127.0.0.1:5672/%2F", "exchange": "x"}, "exchange", "x2"),
}


@pytest.mark.parametrize("sink_type", sorted(MASKED_DESTINATIONS))
def test_get_then_put_of_a_masked_url_keeps_the_stored_url(api: Api, sink_type: str) -> None:
    sink, field, other = MASKED_DESTINATIONS[sink_type]
    name = f"masked_{sink_type}"
    cfg = {"source": {"topics": ["orders"]}, "sink": {"type": sink_type, **sink}}
    r = api.call("PUT", f"/connectors/{name}/config", json={**cfg, "desired": "stopped"})
    assert r.status_code == 201, r.text
    path = api.connectors / f"{name}.yaml"
    try:
        shown = api.call("GET", f"/connectors/{name}/config").json()
        assert shown["sink"]["url"] == MASK
        # The round trip as it is, then with another field edited: the stored URL stays.
        r = api.call("PUT", f"/connectors/{name}/config", json=shown)
        assert r.status_code == 200, r.text
        shown["sink"][field] = other
        r = api.call("PUT", f"/connectors/{name}/config", json=shown)
        assert r.status_code == 200, r.text
        on_disk = yaml.safe_load(path.read_text())
        assert (on_disk["sink"]["url"], on_disk["sink"][field]) == (sink["url"], other)
        assert MASK not in path.read_text()
        assert api.call("GET", f"/connectors/{name}/config").json()["sink"][field] == other
    finally:
        api.call("DELETE", f"/connectors/{name}")


def test_a_masked_url_with_another_destination_changed_is_still_refused(api: Api) -> None:
    name = "masked_moved"
    sink = {"type": "mongodb", "url": "mongodb://127.0.0.1:27017/", "database": "d"}
    cfg = {"source": {"topics": ["o"]}, "sink": {**sink, "collection": "c"}, "desired": "stopped"}
    assert api.call("PUT", f"/connectors/{name}/config", json=cfg).status_code == 201
    path = api.connectors / f"{name}.yaml"
    try:
        shown = api.call("GET", f"/connectors/{name}/config").json()
        shown["sink"]["database"] = "elsewhere"
        r = api.call("PUT", f"/connectors/{name}/config", json=shown)
        assert r.status_code == 400, r.text
        assert "re-enter sink.url: the destination changed (database)" in r.json()["message"]
        assert yaml.safe_load(path.read_text())["sink"]["database"] == "d"
        # The URL entered again (here the same one, as a reference) with the new database: ok.
        shown["sink"]["url"] = "${env:CONVEYOR_MONGO_URL}"
        r = api.call("PUT", f"/connectors/{name}/config", json=shown)
        assert r.status_code == 200, r.text
        on_disk = yaml.safe_load(path.read_text())
        assert on_disk["sink"]["url"] == "${env:CONVEYOR_MONGO_URL}"
        assert on_disk["sink"]["database"] == "elsewhere"
    finally:
        api.call("DELETE", f"/connectors/{name}")
