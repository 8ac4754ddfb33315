"""Secrets cannot be exfiltrated through the REST API (issue 34, point 1).

A canary secret sits in a file outside the secrets directory, in a file inside it, and in
environment variables (one allowed by the policy, one not). Specs are posted through the
real app (Starlette's TestClient) with a reference to a canary in EVERY non-secret text
field of several sink and source types: each is refused, naming the field. Secret fields
pointing outside what the operator allows are accepted as written (references are read only
in the run) and refused when the run resolves them. Then the canary is searched for, byte
by byte, in every HTTP answer, every log record (caplog), every spec file and the meta
store's database: it is nowhere.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from starlette.testclient import TestClient

from conveyor.config.specs import load_source, model_secret_paths, resolved
from conveyor.control.api import create_app
from conveyor.control.operations import Operations
from conveyor.core.errors import ConfigError
from conveyor.core.model import ConnectorSpec
from conveyor.core.planning.state import StateChange
from conveyor.sinks import sink_class
from conveyor.sources import source_class
from conveyor.store.meta import MetaStore

TOKEN = "canary-test-token"
CANARY_OUTSIDE = b"canary-outside-0c9e51d2"  # a file anywhere on the host
CANARY_ALLOWED = b"canary-allowed-7a41be03"  # a file in the secrets directory
CANARY_ENV = b"canary-env-5d2f88a1"  # $CONVEYOR_CANARY (allowed by the default patterns)
CANARY_HOST_ENV = b"canary-hostenv-e613c4f7"  # $HOST_CANARY (not allowed)
CANARIES = (CANARY_OUTSIDE, CANARY_ALLOWED, CANARY_ENV, CANARY_HOST_ENV)

SINKS: dict[str, dict[str, Any]] = {
    "postgres": {"url": "postgresql://app@127.0.0.1/test", "table": "t"},
    "mysql": {"url": "mysql://root@127.0.0.1:3306/test", "table": "t"},
    "redis": {"commands": ["SET a b"]},
    "rabbitmq": {"url": "amqp://127.0.0.1/%2F", "exchange": "x"},
    "localfile": {"path": "conveyor-canary-out"},
    "kafka": {"bootstrap_servers": "127.0.0.1:9092", "topic": "t"},
    "mongodb": {"url": "mongodb://127.0.0.1/", "database": "d", "collection": "c"},
    "elasticsearch": {"hosts": ["http://127.0.0.1:9200"], "index": "i"},
}
SOURCES: dict[str, dict[str, Any]] = {
    "webhook": {"auth": "none"},
    "mqtt": {"topics": ["a/#"], "client_id": "c"},
}


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    home = tmp_path / "home"
    (home / "secrets").mkdir(parents=True)
    (home / "connectors").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_bytes(CANARY_OUTSIDE + b"\n")
    (home / "secrets" / "allowed").write_bytes(CANARY_ALLOWED + b"\n")
    (home / "secrets" / "escape").symlink_to(outside / "canary")
    monkeypatch.setenv("CONVEYOR_HOME", str(home))
    monkeypatch.delenv("CONVEYOR_SECRET_FILES", raising=False)
    monkeypatch.delenv("CONVEYOR_SECRET_ENV", raising=False)
    monkeypatch.setenv("CONVEYOR_CANARY", CANARY_ENV.decode())
    monkeypatch.setenv("HOST_CANARY", CANARY_HOST_ENV.decode())
    store = MetaStore(f"sqlite:///{home / 'meta.db'}")
    ops = Operations(store=store, directory=home / "connectors", actor="the REST API")
    client = TestClient(create_app(lambda: ops, TOKEN), base_url="http://127.0.0.1")
    client.headers["Authorization"] = f"Bearer {TOKEN}"
    refs = {
        "outside": "${file:" + str(outside / "canary") + "}",
        "allowed": "${file:" + str(home / "secrets" / "allowed") + "}",
        "escape": "${file:" + str(home / "secrets" / "escape") + "}",
        "dotdot": "${file:" + str(home / "secrets") + "/../../outside/canary}",
        "env": "${env:CONVEYOR_CANARY}",
        "hostenv": "${env:HOST_CANARY}",
    }
    yield {"home": home, "store": store, "ops": ops, "client": client, "refs": refs}
    store.close()


def text_fields(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, str]]:
    """(dotted path, shape) of every text field of a config model, nested models included."""
    for name, f in model.model_fields.items():
        path = f"{prefix}{f.alias or name}"
        kinds = typing.get_args(f.annotation) or (f.annotation,)
        for k in kinds:
            origin = typing.get_origin(k)
            if k is str:
                yield path, "str"
                break
            if origin is list and str in _flat_args(k):
                yield path, "list"
                break
            if origin is dict and str in typing.get_args(k)[1:]:
                yield path, "dict"
                break
            if isinstance(k, type) and issubclass(k, BaseModel) and k is not model:
                yield from text_fields(k, f"{path}.")
                break


def _flat_args(t: Any) -> set[Any]:
    out: set[Any] = set()
    for a in typing.get_args(t):
        out |= _flat_args(a) if typing.get_args(a) else {a}
    return out


def planted(config: dict[str, Any], path: str, shape: str, ref: str) -> dict[str, Any]:
    """A deep copy of ``config`` with ``ref`` planted at ``path``."""
    import copy

    out = copy.deepcopy(config)
    if path.endswith(".url_env"):  # the alias of url: ${env:NAME}, one or the other
        out["sink"].pop("url", None)
    *parents, leaf = path.split(".")
    node = out
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = {"str": ref, "list": [ref], "dict": {"k": ref}}[shape]
    return out


def cases() -> Iterator[tuple[str, dict[str, Any], str, str]]:
    """(connector kind/type, base config, field path, shape) for every non-secret text field."""
    spec_fields = [
        (p, s)
        for p, s in text_fields(ConnectorSpec, "")
        if not p.startswith("sink.") and p not in model_secret_paths(ConnectorSpec)
    ]
    for t, extra in SINKS.items():
        base = {"source": {"topics": ["orders"]}, "sink": {"type": t, **extra}}
        model = sink_class(t).config_class
        secret = {f"sink.{p}" for p in model_secret_paths(model)}
        fields = [(p, s) for p, s in text_fields(model, "sink.") if p not in secret]
        for path, shape in fields + (spec_fields if t == "postgres" else []):
            if path != "sink.type":
                yield f"sink/{t}", base, path, shape
    for t, extra in SOURCES.items():
        base = {"kind": "source", "source": {"type": t, **extra}}
        model = source_class(t).config_class
        secret = {f"source.{p}" for p in model_secret_paths(model)}
        for path, shape in text_fields(model, "source."):
            if path not in secret and path != "source.type":
                yield f"source/{t}", base, path, shape


def test_a_reference_in_any_non_secret_field_is_refused_and_no_canary_leaks(
    world: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    client: TestClient = world["client"]
    answers: list[bytes] = []
    refused = 0
    for i, (kind, base, path, shape) in enumerate(cases()):
        for which, ref in world["refs"].items():
            name = f"c{i}_{which}"
            body = {"name": name, "config": planted(base, path, shape, ref)}
            for method, url, payload in (
                ("POST", "/connectors", body),
                ("PUT", f"/connectors/{name}/config", body["config"]),
            ):
                r = client.request(method, url, json=payload)
                answers.append(r.content)
                assert r.status_code == 400, (kind, path, which, r.text)
                named = "sink.url" if path.endswith(".url_env") else path.split("[")[0]
                assert named in r.json()["message"], (kind, path, r.text)
                refused += 1
    assert refused > 400  # every text field of 8 sinks and 2 sources, 6 references each
    assert list((world["home"] / "connectors").iterdir()) == []
    # Validation answers never echo a resolved value either.
    r = client.put(
        "/connector-plugins/postgres/config/validate",
        json=planted(
            {"source": {"topics": ["o"]}, "sink": SINKS["postgres"]},
            "sink.table",
            "str",
            world["refs"]["allowed"],
        ),
    )
    answers.append(r.content)
    assert r.status_code == 200 and r.json()["error_count"] == 1
    leaks = _find(answers, caplog, world["home"])
    assert not leaks, leaks


def test_secret_fields_read_only_what_the_operator_allows(
    world: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A secret field's reference is stored as written; the run resolves it only inside the
    policy, and its error (shown by status, list, history) names the reference, never the value."""
    caplog.set_level(logging.DEBUG)
    client: TestClient = world["client"]
    store: MetaStore = world["store"]
    answers: list[bytes] = []
    for which in ("outside", "escape", "dotdot", "hostenv"):
        name = f"secret_{which}"
        ref = world["refs"][which]
        cfg = {
            "source": {"topics": ["orders"]},
            "sink": {
                "type": "postgres",
                "url": f"postgresql://app:{ref}@127.0.0.1/test",
                "table": "t",
            },
        }
        r = client.post("/connectors", json={"name": name, "config": cfg})
        answers.append(r.content)
        assert r.status_code == 201, r.text
        loaded = load_source(name, store.get(name).spec_source)
        with pytest.raises(ConfigError) as e:
            resolved(loaded)  # as the connector's run does first
        message = str(e.value)
        assert "sink.url" in message and ref in message
        assert "outside the directories" in message or "may not be referenced" in message
        logging.getLogger("conveyor.dagster.jobs").error(
            "run failed: %s", message
        )  # as the op logs it
        store.apply(name, None, StateChange.mark_error(message), f"run failed: {message}")
        for path in (
            f"/connectors/{name}/status",
            "/connectors?expand=status&expand=info",
            f"/connectors/{name}/history",
            f"/connectors/{name}",
            f"/connectors/{name}/config",
        ):
            r = client.get(path)
            answers.append(r.content)
            assert r.status_code == 200, r.text
        assert ref in client.get(f"/connectors/{name}/status").text  # the error is there
    # url_env names a variable: the same policy holds.
    cfg = {
        "source": {"topics": ["orders"]},
        "sink": {"type": "postgres", "url_env": "HOST_CANARY", "table": "t"},
    }
    r = client.post("/connectors", json={"name": "url_env_host", "config": cfg})
    answers.append(r.content)
    assert r.status_code == 201, r.text
    with pytest.raises(
        ConfigError, match=r"sink\.url: \$\{env:HOST_CANARY\}: variable HOST_CANARY may not"
    ):
        resolved(load_source("url_env_host", store.get("url_env_host").spec_source))
    # Allowed ones resolve (in the run only), and are still never shown.
    for which, canary in (("allowed", CANARY_ALLOWED), ("env", CANARY_ENV)):
        name = f"secret_{which}"
        ref = world["refs"][which]
        cfg = {
            "source": {"topics": ["orders"]},
            "sink": {
                "type": "postgres",
                "url": f"postgresql://app:{ref}@127.0.0.1/test",
                "table": "t",
            },
        }
        r = client.post("/connectors", json={"name": name, "config": cfg})
        answers.append(r.content)
        assert r.status_code == 201, r.text
        live = resolved(load_source(name, store.get(name).spec_source))
        assert live.sink is not None
        url = live.sink.url.get_secret_value()  # type: ignore[attr-defined]
        assert url == f"postgresql://app:{canary.decode()}@127.0.0.1/test"
        answers.append(client.get(f"/connectors/{name}/config").content)
    r = client.get("/ready")
    answers.append(r.content)
    leaks = _find(answers, caplog, world["home"])
    assert not leaks, leaks


def _find(answers: list[bytes], caplog: pytest.LogCaptureFixture, home: Path) -> list[str]:
    """Where any canary shows up: answers, log records, and every file under home except the
    secrets directory (spec files, the meta store's database)."""
    found = []
    logs = "\n".join(r.getMessage() for r in caplog.records).encode()
    places = [(f"answer {i}", a) for i, a in enumerate(answers)] + [("log", logs)]
    for f in sorted(home.rglob("*")):
        if f.is_file() and "secrets" not in f.relative_to(home).parts:
            places.append((str(f), f.read_bytes()))
    for where, data in places:
        for canary in CANARIES:
            if canary in data:
                found.append(f"{canary.decode()} in {where}")
    return found
