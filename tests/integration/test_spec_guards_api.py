"""Issue 34 through the REST API (a real ``conveyor serve``): a transform expression that
reaches beyond the batch (C1) and a client option that reaches the run's host (H2) are
refused with 400 naming the field, reported as errors by ``config/validate``, and nothing
is written; a spec file holding them is refused at load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conveyor.config.specs import load_file
from tests.integration.api_server import Api, served

C1_SELECT = "java_method('java.lang.System', 'getenv', 'CONVEYOR_CANARY') AS env_canary"
C1_SUBQUERY = "(SELECT first(value) FROM text.`/etc/passwd`) AS passwd"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with served(tmp_path_factory.mktemp("guards_home")) as a:
        yield a


def spec(**over: object) -> dict:
    return {
        "source": {"topics": ["rv_in"]},
        "sink": {"type": "localfile", "path": "never-written", "rotation": "none"},
        "desired": "stopped",
        **over,
    }


def test_the_review_specs_are_refused_with_400_naming_the_field(api: Api) -> None:
    c1 = spec(transform={"schema": "id BIGINT", "select": ["id", C1_SELECT, C1_SUBQUERY]})
    r = api.call("PUT", "/connectors/sqlleak/config", json=c1)
    assert r.status_code == 400, r.text
    assert "transform.select[1]: function java_method() is not allowed" in r.json()["message"]
    c1["transform"]["select"] = ["id", C1_SUBQUERY]
    r = api.call("POST", "/connectors", json={"name": "sqlleak", "config": c1})
    assert r.status_code == 400 and "transform.select[1]: a subquery" in r.json()["message"]
    h2 = spec()
    h2["source"]["client_options"] = {"plugin.library.paths": "/tmp/review34/evil.so"}
    r = api.call("PUT", "/connectors/pluginload/config", json=h2)
    assert r.status_code == 400, r.text
    assert "source.client_options" in r.json()["message"]
    assert "loads native code" in r.json()["message"]
    assert list(api.connectors.iterdir()) == []
    assert api.call("GET", "/connectors").json() == []


def test_config_validate_reports_them_as_errors(api: Api) -> None:
    config = spec(transform={"filter": "reflect('java.lang.System', 'getenv', 'X') = ''"})
    config["source"]["client_options"] = {"sasl.kerberos.kinit.cmd": "touch /tmp/pwned"}
    body = api.call("PUT", "/connector-plugins/localfile/config/validate", json=config).json()
    errors = {
        c["value"]["name"]: " ".join(c["value"]["errors"])
        for c in body["configs"]
        if c["value"]["errors"]
    }
    assert body["error_count"] == 2, body
    assert "is a shell command the client runs" in errors["source.client_options"]
    assert errors["transform.filter"].startswith("function reflect() is not allowed")
    sink = {
        "source": {"topics": ["o"]},
        "sink": {
            "type": "kafka",
            "bootstrap_servers": "127.0.0.1:9092",
            "topic": "out",
            "client_options": {"ssl.engine.location": "/tmp/engine.so"},
        },
    }
    body = api.call("PUT", "/connector-plugins/kafka/config/validate", json=sink).json()
    opts = next(c for c in body["configs"] if c["value"]["name"] == "sink.client_options")
    assert body["error_count"] == 1 and "loads native code" in opts["value"]["errors"][0]
    assert list(api.connectors.iterdir()) == []


def test_a_spec_file_holding_them_is_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "sqlleak.yaml"
    path.write_text(yaml.safe_dump({"name": "sqlleak", **spec(transform={"select": [C1_SELECT]})}))
    loaded = load_file(path)
    assert loaded.spec is None and loaded.error is not None
    assert "transform.select[0]: function java_method() is not allowed" in loaded.error


# Issue 45: texts the earlier lexer passed (PUT answered 201) that Spark reads as calls.
BYPASSES_45 = [
    "/* /*+ */ concat(reflect('java.lang.System','getenv','HOME'), '*/') AS leaked /* ' */",
    "\"reflect\"('java.lang.System', 'getenv', 'HOME')",
    "from_xml('<a>1</a>', 'a INT', map('rowValidationXSDPath', '/etc/passwd')) AS x",
]


@pytest.mark.parametrize("expr", BYPASSES_45)
def test_the_issue_45_bypasses_are_refused_with_400(api: Api, expr: str) -> None:
    config = spec(transform={"schema": "id BIGINT", "select": ["id", expr]})
    r = api.call("PUT", "/connectors/bypass45/config", json=config)
    assert r.status_code == 400, r.text
    assert "transform.select[1]: " in r.json()["message"], r.text
    assert api.call("GET", "/connectors/bypass45").status_code == 404
    # The same connector with a legit select is created: the guard refuses what it must only.
    config["transform"]["select"] = ["id", "upper(CAST(id AS STRING)) /* c */ AS s"]
    r = api.call("PUT", "/connectors/bypass45/config", json=config)
    assert r.status_code == 201, r.text
    assert api.call("DELETE", "/connectors/bypass45").status_code in (200, 204)
