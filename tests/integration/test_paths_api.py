"""Issue 45 point 3 through the REST API (a real ``conveyor serve``) and a real run: the review's
specs naming files outside ``$CONVEYOR_HOME`` or in its secrets are refused with 400 naming the
field, nothing is created outside the home; two connectors cannot share a dead-letter place
(409); and a schema file that is not a schema fails the run with a ``last_error`` (read with the
read-only token) that names the field and never quotes the file."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dagster import DagsterInstance

from conveyor.config.specs import load_source
from conveyor.core.model import ConnectorStatus
from conveyor.dagster.jobs.connector import connector_job
from conveyor.dagster.resources.conveyor import ConveyorResource
from tests.e2e.conftest import produce
from tests.integration.api_server import READONLY_TOKEN, Api, served

pytestmark = pytest.mark.integration

CANARY = "canary-9d41"
KEY = {"type": "service_account", "private_key": f"-----BEGIN PRIVATE KEY-----{CANARY}-----END"}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    root = tmp_path_factory.mktemp("paths")
    home = root / "home"
    (home / "secrets").mkdir(parents=True)
    (home / "secrets" / "sa.json").write_text(json.dumps(KEY))
    (root / "outside").mkdir()
    with served(home) as a:
        yield a


def spec(sink: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {"source": {"topics": ["o"]}, "sink": sink, "desired": "stopped", **over}


def localfile(path: str = "out") -> dict[str, Any]:
    return {"type": "localfile", "path": path, "rotation": "none"}


def outside(api: Api) -> Path:
    return api.home.parent / "outside"


def refused(api: Api, name: str, config: dict[str, Any]) -> str:
    r = api.call("PUT", f"/connectors/{name}/config", json=config)
    assert r.status_code == 400, r.text
    return str(r.json()["message"])


def test_the_review_specs_are_refused_with_400_naming_the_field(api: Api) -> None:
    iceberg = {"type": "iceberg", "namespace": "lake", "table": "../../../../escaped"}
    assert "sink.table:" in refused(api, "escape", spec(iceberg))
    anywhere = outside(api) / "anywhere.db"
    catalog = {**iceberg, "table": "orders", "catalog": {"uri": f"sqlite:///{anywhere}"}}
    message = refused(api, "catalog", spec(catalog))
    assert "sink.catalog.uri:" in message and f"$CONVEYOR_HOME ({api.home})" in message
    message = refused(api, "lf", spec(localfile(str(outside(api) / "out"))))
    assert "sink.path:" in message and "CONVEYOR_FILE_ROOTS" in message
    theirs = {"policy": "dead_letter", "dead_letter": {"path": "dead_letters/payments"}}
    assert "failure.dead_letter.path:" in refused(api, "orders", spec(localfile(), failure=theirs))
    avro = {"decode": "avro", "schema_file": "secrets/sa.json"}
    message = refused(api, "keyread", spec(localfile(), transform=avro))
    assert "transform.schema_file:" in message and "secrets directory" in message
    assert CANARY not in message
    tls = {"topics": ["o"], "security_protocol": "SSL", "ssl_keyfile": "secrets/sa.json"}
    tls["ssl_certfile"] = "tls/c.pem"
    assert "source.ssl_keyfile" in refused(api, "tls", {**spec(localfile()), "source": tls})
    assert list(outside(api).iterdir()) == []
    assert list(api.connectors.iterdir()) == []
    assert api.call("GET", "/connectors").json() == []


def test_config_validate_reports_the_paths_as_errors(api: Api) -> None:
    config = spec(
        localfile(str(outside(api))), transform={"decode": "avro", "schema_file": "/etc/hostname"}
    )
    body = api.call("PUT", "/connector-plugins/localfile/config/validate", json=config).json()
    errors = {
        c["value"]["name"]: c["value"]["errors"] for c in body["configs"] if c["value"]["errors"]
    }
    assert "outside the roots" in " ".join(errors.get("transform.schema_file", [])), errors
    config["transform"] = {}
    body = api.call("PUT", "/connector-plugins/localfile/config/validate", json=config).json()
    errors = {
        c["value"]["name"]: c["value"]["errors"] for c in body["configs"] if c["value"]["errors"]
    }
    assert body["error_count"] == 1 and "outside the roots" in errors["sink.path"][0], errors
    assert list(outside(api).iterdir()) == []


def test_a_second_connector_on_a_dead_letter_place_is_a_conflict(api: Api) -> None:
    shared = {"policy": "dead_letter", "dead_letter": {"path": "dl/shared"}}
    r = api.call("PUT", "/connectors/dl_a/config", json=spec(localfile("out_a"), failure=shared))
    assert r.status_code == 201, r.text
    r = api.call("PUT", "/connectors/dl_b/config", json=spec(localfile("out_b"), failure=shared))
    assert r.status_code == 409, r.text
    assert "overlaps connector 'dl_a'" in r.json()["message"]
    inside = {"policy": "dead_letter", "dead_letter": {"path": "dl/shared/b"}}
    r = api.call("PUT", "/connectors/dl_b/config", json=spec(localfile("out_b"), failure=inside))
    assert r.status_code == 409, r.text
    own = {"policy": "dead_letter", "dead_letter": {"path": "dl/b"}}
    r = api.call("PUT", "/connectors/dl_b/config", json=spec(localfile("out_b"), failure=own))
    assert r.status_code == 201, r.text
    for name in ("dl_a", "dl_b"):
        assert api.call("DELETE", f"/connectors/{name}").status_code == 204


def test_a_schema_file_that_is_not_a_schema_fails_the_run_without_quoting_it(
    api: Api, tansu: str, spark_remote: str, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's second finding, past validation: a file under the home (not a secret, so
    accepted) whose content is a key. The run fails on it; the error the read-only token sees
    names the field and the kind of problem, not a byte of the file."""
    monkeypatch.setenv("CONVEYOR_HOME", str(api.home))
    (api.home / "schemas").mkdir(exist_ok=True)
    (api.home / "schemas" / "orders.avsc").write_text(json.dumps(KEY))
    produce(tansu, topic_name, 3, partitions=1, payload=lambda i: b"\x02")
    name = f"avro_{uuid.uuid4().hex[:6]}"
    config = {
        "source": {"topics": [topic_name], "bootstrap_servers": tansu},
        "transform": {"decode": "avro", "schema_file": "schemas/orders.avsc"},
        "sink": localfile(f"out_{name}"),
    }
    r = api.call("PUT", f"/connectors/{name}/config", json=config)
    assert r.status_code == 201, r.text
    resource = ConveyorResource(
        meta_url=f"sqlite:///{api.home / 'meta.db'}",
        kafka_bootstrap=tansu,
        spark_remote=spark_remote,
    )
    loaded = load_source(name, str(api.connectors / f"{name}.yaml"))
    assert loaded.ok, loaded.error
    with DagsterInstance.ephemeral() as instance:
        result = connector_job(loaded).execute_in_process(
            instance=instance, resources={"conveyor": resource}, raise_on_error=False
        )
    assert not result.success
    row = api.store.get(name)
    assert row.status == ConnectorStatus.ERROR
    assert row.last_error is not None and "transform.schema_file" in row.last_error
    assert "not an Avro schema" in row.last_error and CANARY not in row.last_error
    status = api.call("GET", f"/connectors/{name}/status", token=READONLY_TOKEN)
    assert status.status_code == 200, status.text
    assert "transform.schema_file" in status.json()["connector"]["trace"]
    assert CANARY not in status.text
    assert not (api.home / f"out_{name}").exists() or not any((api.home / f"out_{name}").iterdir())
