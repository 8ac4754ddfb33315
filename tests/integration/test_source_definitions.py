"""Source connectors in the code location, the meta store and the CLI: jobs, lineage
(source system -> topics -> sink connectors), spec validation, destinations view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from dagster import AssetKey

from conveyor.config.specs import from_mapping, scan, sync_files
from conveyor.control.cli import main
from conveyor.core.model import ConnectorStatus, DesiredState
from conveyor.store.meta import MetaStore

SOURCE = """
name: orders_in
kind: source
source:
  type: postgres_polling
  url: postgresql://conveyor:${env:PGPASS}@127.0.0.1:5432/test
  table: shop.orders
  incrementing_column: id
  destination_column: region
routing:
  admission: {mode: allowlist, patterns: ["orders.eu", "orders.*"]}
  default_destination: orders.unrouted
"""

SINK = """
name: eu_out
source: {topics: [orders.eu]}
sink: {type: localfile, path: %s}
"""


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    connectors = tmp_path / "connectors"
    connectors.mkdir()
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_CONNECTORS_DIR", str(connectors))
    monkeypatch.delenv("CONVEYOR_META_URL", raising=False)
    return connectors


def test_jobs_and_lineage_from_the_source_system_to_sink_connectors(env: Path, tmp_path: Path):
    from conveyor.dagster.definitions import build_defs

    (env / "orders_in.yaml").write_text(SOURCE)
    (env / "eu_out.yaml").write_text(SINK % (tmp_path / "out"))
    defs = build_defs()
    jobs = {j.name for j in defs.jobs}
    assert {"connector__orders_in", "connector__eu_out", "replay_dead_letters__eu_out"} <= jobs
    assert "replay_dead_letters__orders_in" not in jobs  # sources have no dead letters
    assert defs.get_job_def("connector__orders_in").tags["conveyor/kind"] == "source"
    deps = {a.key: {d.asset_key for d in a.deps} for a in defs.assets}
    system = AssetKey(["postgres", "shop", "orders"])
    assert deps[system] == set()
    # Destinations the spec names (allowlist literals, default) hang below the system.
    assert deps[AssetKey(["kafka", "orders_eu"])] == {system}
    assert deps[AssetKey(["kafka", "orders_unrouted"])] == {system}
    # ... and a sink connector reading one of them continues the path.
    assert deps[AssetKey(["localfile", "out"])] == {AssetKey(["kafka", "orders_eu"])}
    # A topic a sink reads that only the allowlist's pattern admits hangs below the system too.
    (env / "us_out.yaml").write_text(
        SINK.replace("eu_out", "us_out").replace("orders.eu", "orders.us") % (tmp_path / "us")
    )
    deps = {a.key: {d.asset_key for d in a.deps} for a in build_defs().assets}
    assert deps[AssetKey(["kafka", "orders_us"])] == {system}


def test_spec_sync_stores_the_redacted_source_spec_and_kind(env: Path, tmp_path: Path):
    (env / "orders_in.yaml").write_text(SOURCE)
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    sync_files(store, scan(env))
    row = store.get("orders_in")
    assert row.spec_error is None and row.status == ConnectorStatus.IDLE
    assert row.spec["kind"] == "source" and row.spec["source"]["type"] == "postgres_polling"
    assert "${env:PGPASS}" in row.spec["source"]["url"]  # references kept, never resolved here
    r = CliRunner(env={"COLUMNS": "200"}).invoke(
        main, ["--meta-url", store.url, "connector", "list", "--json"], catch_exceptions=False
    )
    assert r.exit_code == 0, r.output
    assert [x["kind"] for x in json.loads(r.output)] == ["source"]
    r = CliRunner(env={"COLUMNS": "200"}).invoke(
        main, ["--meta-url", store.url, "connector", "list"], catch_exceptions=False
    )
    assert "orders_in" in r.output and "source" in r.output


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"source": {"type": "postgress", "url": "u", "table": "t"}},
            "did you mean 'postgres_polling'",
        ),
        (
            {"routing": {"admission": {"mode": "allowlist", "patterns": ["*.*"]}}},
            "admits every destination",
        ),
        (
            {"routing": {"route": {"path": "a", "mapping": {}, "url": "http://x/m"}}},
            "exactly one of mapping and url",
        ),
        ({"kafka": {"partitions": 0}}, "kafka.partitions"),
        ({"source": {"type": "postgres_polling", "url": "u", "table": "t"}}, "incrementing_column"),
    ],
)
def test_invalid_source_specs_name_the_field(change, message):
    import yaml

    data = {**yaml.safe_load(SOURCE), **change}
    ls = from_mapping(data, source="x.yaml", fallback_name="orders_in")
    assert not ls.ok and message in str(ls.error), ls.error


def test_destinations_view_from_heartbeat_counters(tmp_path: Path):
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    store.sync_spec("src", spec_json='{"kind": "source"}', spec_hash=None, source="t", error=None)
    claim = store.claim("src", run_id="r1", expected_generation=None, holder_alive=lambda r: False)
    routing = {
        "routed": 7,
        "destinations_active": 2,
        "rejected": {"cap": 3},
        "unmatched": {"default": 1},
        "open_breakers": 1,
        "destinations": {
            "a": {
                "routed": 7,
                "breaker": "closed",
                "consecutive_failures": 0,
                "last_error": None,
                "create_ms": 12.0,
            },
            "b": {
                "routed": 0,
                "breaker": "open",
                "consecutive_failures": 5,
                "last_error": "timed out",
                "create_ms": 9.0,
            },
        },
    }
    store.heartbeat("src", claim.generation, {"messages_out": 7, "routing": routing})
    runner = CliRunner(env={"COLUMNS": "200"})
    r = runner.invoke(
        main, ["--meta-url", store.url, "connector", "destinations", "src"], catch_exceptions=False
    )
    assert r.exit_code == 0, r.output
    assert (
        "timed out" in r.output and "rejected: cap 3" in r.output and "open breakers 1" in r.output
    )
    r = runner.invoke(main, ["--meta-url", store.url, "connector", "destinations", "src", "--json"])
    assert json.loads(r.output)["destinations"]["b"]["breaker"] == "open"

    from prometheus_client.core import Metric

    from conveyor.control.metrics import collect

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in collect(store)
        if isinstance(fam, Metric)
        for s in fam.samples
    }
    assert samples[("conveyor_connector_routed_total", (("connector", "src"),))] == 7
    assert (
        samples[("conveyor_connector_rejected_total", (("connector", "src"), ("reason", "cap")))]
        == 3
    )
    assert samples[("conveyor_connector_open_breakers", (("connector", "src"),))] == 1
    assert (
        samples[("conveyor_connector_destination_create_seconds_max", (("connector", "src"),))]
        == 0.012
    )


def test_secrets_of_a_source_are_masked_in_the_stored_spec():
    ls = from_mapping(
        {"name": "h", "kind": "source", "source": {"type": "webhook", "token": "literal-token"}},
        source="x.yaml",
        fallback_name="h",
    )
    assert "literal-token" not in json.dumps(ls.display())
    ls = from_mapping(
        {"name": "h", "kind": "source", "source": {"type": "webhook", "token": "${env:TOK}"}},
        source="x.yaml",
        fallback_name="h",
    )
    assert ls.display()["source"]["token"] == "${env:TOK}"


def test_abandon_batch_and_reset_state_only_on_a_stopped_source(tmp_path: Path):
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    store.sync_spec("src", spec_json='{"kind": "source"}', spec_hash=None, source="t", error=None)
    claim = store.claim("src", run_id="r1", expected_generation=None, holder_alive=lambda r: False)
    store.save_source_state("src", claim.generation, {"last": 5}, version=1)
    runner = CliRunner(env={"COLUMNS": "200"})

    def cli(*args):
        return runner.invoke(main, ["--meta-url", store.url, "connector", *args])

    r = cli("abandon-batch", "src")
    assert r.exit_code != 0 and "stop it first" in r.output  # a run could be using the state
    store.release("src", claim.generation, ConnectorStatus.STOPPED, "test")
    store.set_desired("src", DesiredState.STOPPED)
    r = cli("abandon-batch", "src")
    assert r.exit_code == 0, r.output
    info = store.source_state_info("src")
    assert info["abandon_requested"] and info["state"] == {"last": 5}
    # The next run stores the position after its first batch with abandoned=True.
    store.save_source_state("src", claim.generation, {"last": 9}, version=1, abandoned=True)
    info = store.source_state_info("src")
    assert not info["abandon_requested"] and info["last_abandon_at"] is not None
    r = cli("destinations", "src")
    assert "last abandon: " in r.output and "last abandon: -" not in r.output
    assert any("abandoned" in h.reason for h in store.history("src"))
    r = cli("reset-state", "src")
    assert r.exit_code == 0 and "source state reset" in r.output
    assert store.source_state("src") is None


def test_config_reference_documents_source_connectors():
    from conveyor import sources
    from conveyor.control import configdoc

    doc = configdoc.render()
    for name in sources.source_types():
        assert f"### source `{name}`" in doc
    for title, model in configdoc._source_sections():
        assert f"### `{title}`" in doc
        for fname, field in model.model_fields.items():
            assert f"| `{field.alias or fname}` |" in doc, f"{title}.{fname}"


def test_rest_api_creates_a_source_connector_and_shows_its_destinations(tmp_path: Path):
    from starlette.testclient import TestClient

    from conveyor.control.api import create_app
    from conveyor.control.operations import Operations

    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    ops = Operations(store=store, directory=tmp_path / "connectors")
    client = TestClient(create_app(lambda: ops, "tok"), base_url="http://localhost")
    auth = {"Authorization": "Bearer tok"}
    body = {
        "name": "hook_in",
        "kind": "source",
        "source": {"type": "webhook", "port": 18088, "auth": "none"},
        "routing": {"route": {"path": "k", "mapping": {"a": "t.a"}, "default": "t.rest"}},
    }
    r = client.post("/connectors", json={"name": "hook_in", "config": body}, headers=auth)
    assert r.status_code == 201, r.text
    assert (tmp_path / "connectors" / "hook_in.yaml").exists()
    r = client.get("/connectors/hook_in/status", headers=auth)
    assert r.json()["type"] == "source"
    r = client.get("/connectors/hook_in/destinations", headers=auth)
    assert r.status_code == 200 and r.json()["kind"] == "source" and r.json()["destinations"] == {}
    bad = {
        **body,
        "name": "bad_in",
        "source": {
            "type": "postgres_polling",
            "url": "u",
            "table": "t",
            "incrementing_column": "id",
            "delete_after_read": True,
        },
    }
    r = client.post("/connectors", json={"name": "bad_in", "config": bad}, headers=auth)
    assert r.status_code == 400 and "destructive" in r.text
    r = client.post("/connectors/hook_in/abandon-batch", headers=auth)
    assert r.status_code == 409  # not stopped
    plugins = client.get("/connector-plugins", headers=auth).json()
    assert {(p["class"], p["type"]) for p in plugins} >= {
        ("postgres_cdc", "source"),
        ("webhook", "source"),
        ("postgres", "sink"),
    }


def test_a_crash_in_the_middle_of_a_state_write_leaves_the_previous_state(tmp_path: Path):
    """The fencing check and the state row are one transaction: a failure between them
    (here: a state that cannot be serialised, raised after the fencing UPDATE) changes nothing."""
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    store.sync_spec("src", spec_json='{"kind": "source"}', spec_hash=None, source="t", error=None)
    claim = store.claim("src", run_id="r1", expected_generation=None, holder_alive=lambda r: False)
    store.save_source_state("src", claim.generation, {"last": 5}, version=1)
    before = store.get("src").updated_at
    with pytest.raises(TypeError):
        store.save_source_state("src", claim.generation, {"last": object()}, version=1)
    assert store.source_state("src") == (1, {"last": 5})
    assert store.get("src").updated_at == before  # the fencing UPDATE was rolled back too
    # A stale generation stores nothing.
    from conveyor.core.errors import FencedError

    with pytest.raises(FencedError):
        store.save_source_state("src", claim.generation - 1, {"last": 9}, version=1)
    assert store.source_state("src") == (1, {"last": 5})


def test_a_source_connector_as_a_dg_component_attribute_set():
    from conveyor.dagster.components import ConnectorComponent

    c = ConnectorComponent(
        name="orders_in",
        kind="source",
        source={"type": "webhook", "port": 18089, "auth": "none"},
        routing={"default_destination": "orders.all"},
    )
    ls = from_mapping(c.spec_mapping(), source="defs.yaml", fallback_name="orders_in")
    assert ls.ok and ls.is_source, ls.error


def test_route_mapping_fetched_over_http_once_and_a_bad_fetch_refuses_to_start():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from conveyor.core.engine.routing import Route, RouteSpec
    from conveyor.core.errors import ConfigError
    from conveyor.dagster.jobs.source_connector import fetch_mapping

    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            hits.append(self.path)
            body, code = {
                "/map.json": (b'{"eu": "orders.eu", "us": "orders.us"}', 200),
                "/broken.json": (b'{"eu": ', 200),
                "/empty.json": (b"{}", 200),
            }.get(self.path, (b"no", 404))
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        route = Route.build(RouteSpec(path="region", url=f"{base}/map.json"), fetch_mapping)
        assert [route.destination({"region": r}) for r in ("eu", "us", "eu")] == [
            "orders.eu",
            "orders.us",
            "orders.eu",
        ]
        assert hits == ["/map.json"]  # fetched once, at start
        for path, message in [
            ("/broken.json", "not JSON"),
            ("/empty.json", "non-empty JSON object"),
            ("/missing.json", "404"),
        ]:
            with pytest.raises(ConfigError, match=message):
                Route.build(RouteSpec(path="region", url=f"{base}{path}"), fetch_mapping)
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ConfigError, match="cannot fetch the mapping"):
        Route.build(RouteSpec(path="region", url=f"{base}/map.json"), fetch_mapping)  # server gone
