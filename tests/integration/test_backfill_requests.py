"""Backfill requests from the CLI and the REST API (issue 38 point 3): rows in the meta store
(SQLite and PostgreSQL, migrated onto a version 2 store), checked at the door by the parser the
job uses; the backfills sensor, evaluated against a real Dagster instance, launches each new
request once with its range and id as run config and a tag linking it, and marks the request
of a failed run failed. Hostile bodies get 400s, as on the other routes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from dagster import DagsterInstance, RunRequest, build_sensor_context, instance_for_test, job, op

from conveyor.control.cli import main
from conveyor.core.errors import ConfigError
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.sensors.backfills import (
    LAUNCH_TIMEOUT_S,
    backfill_decisions,
    backfill_requests_sensor,
    request_key,
)
from conveyor.dagster.tags import TAG_BACKFILL, TAG_BACKFILL_REQUEST
from conveyor.store import schema as t
from conveyor.store.meta import MetaStore, UnknownConnectorError, parse_backfill_range
from tests.integration.api_server import READONLY_TOKEN, Api, served
from tests.integration.test_store import store  # noqa: F401 - the SQLite/PostgreSQL fixture

pytestmark = pytest.mark.integration

T0 = "2026-11-27T10:00:00Z"
T1 = "2026-11-27T10:05:00Z"


def add(s: MetaStore, name: str, spec: dict | None = None) -> None:
    s.sync_spec(
        name,
        spec_json=json.dumps(spec or {"name": name}),
        spec_hash="h",
        source="test",
        error=None,
    )


# -- the store --------------------------------------------------------------------------------


def test_requests_are_stored_listed_newest_first_and_a_finished_one_stays_finished(store):  # noqa: F811
    add(store, "orders")
    add(store, "other")
    a = store.request_backfill("orders", T0, T1, requested_by="the CLI")
    b = store.request_backfill("orders", "orders:0:5", "orders:0:9", requested_by="the REST API")
    store.request_backfill("other", "earliest", "latest", requested_by="the CLI")
    assert (a.state, a.start, a.end, a.requested_by, a.run_id) == (
        "requested",
        T0,
        T1,
        "the CLI",
        None,
    )
    assert [r.id for r in store.backfills("orders")] == [b.id, a.id]
    assert store.update_backfill(a.id, "launched")
    assert store.update_backfill(a.id, "running", run_id="run-1")
    assert store.update_backfill(
        a.id, "succeeded", counts=(100, 99, 1), message="backfill done: 99 delivered"
    )
    # A late failure report (the sensor, a retried write) does not undo the end.
    assert not store.update_backfill(a.id, "failed", message="run failed")
    got = store.backfill(a.id)
    assert (got.state, got.run_id, got.read, got.delivered, got.failed) == (
        "succeeded",
        "run-1",
        100,
        99,
        1,
    )
    assert [r.id for r in store.backfills(states=["requested"])][-1] == b.id
    reasons = [h.reason for h in store.history("orders")]
    assert f"backfill {a.id} requested by the CLI: {T0} .. {T1}" in reasons
    with pytest.raises(UnknownConnectorError):
        store.request_backfill("nope", T0, T1, requested_by="x")
    with pytest.raises(ConfigError, match="end: .* is not after the start"):
        store.request_backfill("orders", T1, T0, requested_by="x")
    add(store, "reads", {"name": "reads", "source": {"topics": ["orders"], "topics_regex": "c.*"}})
    with pytest.raises(
        ConfigError, match="start: 'other_topic:0:5': topic: the connector does not"
    ):
        store.request_backfill("reads", "other_topic:0:5", "latest", requested_by="x")
    with pytest.raises(ConfigError, match="end: 'other:0:9': topic: the connector does not read"):
        store.request_backfill("reads", "orders:0:5", "orders:0:9,other:0:9", requested_by="x")
    assert store.backfills("reads") == []
    assert store.request_backfill("reads", "clicks:0:5", "orders:1:2", requested_by="x").id
    assert len(store.backfills("orders")) == 2  # the refused ones left nothing


@pytest.mark.parametrize(
    ("start", "end", "error"),
    [
        ("", "latest", "start: empty"),
        ("latest", "latest", "start: latest is the end of the log"),
        ("earliest", "earliest", "end: earliest is the start of the log"),
        ("yesterday", "latest", "start: 'yesterday' is not earliest, latest, an ISO 8601 time"),
        ("orders:x:5", "latest", "start: 'orders:x:5': partition: 'x' is not a partition number"),
        ("orders:0:-1", "latest", "start: 'orders:0:-1': offset: -1 is out of range"),
        (f"orders:0:{2**70}", "latest", f"start: 'orders:0:{2**70}': offset: {2**70} is out"),
        ("orders:-1:0", "latest", "start: 'orders:-1:0': partition: -1 is out of range"),
        ("earliest", "orders:0:5,orders:0:6", "end: 'orders:0:6': partition orders[0] is given"),
        ("orders:0", "latest", "start: 'orders:0' is not TOPIC:PARTITION:OFFSET"),
        ("orders:0:9", "orders:0:5", "end: before the start on orders"),
        (T1, T0, "end: 2026-11-27T10:00:00Z is not after the start"),
        ("x" * 20_000, "latest", "start: longer than"),
    ],
)
def test_a_range_that_cannot_hold_anything_is_refused_with_its_field(start, end, error):
    with pytest.raises(ConfigError) as e:
        parse_backfill_range(start, end)
    assert str(e.value).startswith(error), str(e.value)


def test_ranges_the_job_reads_are_accepted():
    lo, hi = parse_backfill_range(" earliest ", "2026-11-27T10:00:00")
    assert (lo, hi) == ("earliest", "2026-11-27T10:00:00")
    lo, hi = parse_backfill_range("orders:0:5,orders:1:7", "latest")
    assert len(lo) == 2 and hi == "latest"


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_version_2_store_is_migrated_to_hold_backfill_requests(dialect, tmp_path, pg_url):
    """A store made by the previous Conveyor (schema 2, no backfills table, a connector in it)
    is migrated in place: to the current version, its connector kept, requests taken."""
    if dialect == "sqlite":
        url, drop = f"sqlite:///{tmp_path / 'meta.db'}", None
    else:
        db = f"conveyor_{uuid.uuid4().hex[:10]}"
        admin = sa.create_engine(
            pg_url.replace("postgresql://", "postgresql+psycopg2://"), isolation_level="AUTOCOMMIT"
        )
        with admin.connect() as c:
            c.exec_driver_sql(f'CREATE DATABASE "{db}"')
        url = sa.make_url(pg_url).set(database=db).render_as_string(hide_password=False)
        drop = (admin, db)
    try:
        old = MetaStore(url)
        with old.engine.begin() as c:
            for table in t.metadata.sorted_tables:
                if table is not t.backfills:
                    table.create(c)
            c.execute(t.schema_version.insert().values(id=1, version=2, migrated_at=0.0))
            c.execute(
                t.connectors.insert().values(
                    name="orders", status_since=0.0, created_at=0.0, updated_at=0.0
                )
            )
        assert not sa.inspect(old.engine).has_table(t.backfills.name)
        old.close()
        assert 2 in t.MIGRATIONS
        new = MetaStore(url)
        new.ensure_schema()
        assert new.schema_version() == t.SCHEMA_VERSION
        assert sa.inspect(new.engine).has_table(t.backfills.name)
        assert new.get("orders").name == "orders"
        r = new.request_backfill("orders", T0, T1, requested_by="the CLI")
        assert new.backfills("orders") == [r]
        new.close()
    finally:
        if drop is not None:
            admin, db = drop
            with admin.connect() as c:
                c.exec_driver_sql(f'DROP DATABASE "{db}" WITH (FORCE)')
            admin.dispose()


# -- the REST API -----------------------------------------------------------------------------


def sink_spec(name: str) -> dict:
    return {
        "source": {"topics": ["orders"]},
        "transform": {"decode": "json", "schema": "id BIGINT"},
        "sink": {
            "type": "postgres",
            "url": "postgresql://app@127.0.0.1:5432/test",
            "table": name,
            "delivery": "exactly_once",
        },
    }


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with served(tmp_path_factory.mktemp("backfill_api")) as a:
        r = a.call("POST", "/connectors", json={"name": "bf_orders", "config": sink_spec("o")})
        assert r.status_code == 201, r.text
        yield a


def test_a_backfill_is_requested_listed_and_followed_through_the_api(api: Api) -> None:
    r = api.call("POST", "/connectors/bf_orders/backfills", json={"start": T0, "end": T1})
    assert r.status_code == 202, r.text
    made = r.json()
    assert (made["connector"], made["start"], made["end"], made["state"]) == (
        "bf_orders",
        T0,
        T1,
        "requested",
    )
    assert made["requested_by"] == "the REST API" and made["run_id"] is None
    r2 = api.call("POST", "/connectors/bf_orders/backfills", json={"start": "earliest"})
    assert r2.status_code == 202 and r2.json()["end"] == "latest"
    listed = api.call("GET", "/connectors/bf_orders/backfills").json()
    assert [x["id"] for x in listed[:2]] == [r2.json()["id"], made["id"]]
    one = api.call("GET", f"/connectors/bf_orders/backfills/{made['id']}")
    assert one.status_code == 200 and one.json() == made
    # What the store holds is what the API said.
    assert api.store.backfill(made["id"]).as_json() == made
    ro = api.call("GET", "/connectors/bf_orders/backfills", token=READONLY_TOKEN)
    assert ro.status_code == 200
    ro = api.call(
        "POST", "/connectors/bf_orders/backfills", json={"start": T0}, token=READONLY_TOKEN
    )
    assert ro.status_code == 403


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ("not json", 400, "the request body is not valid JSON"),
        ([T0, T1], 400, 'expected {"start": ..., "end": ...}'),
        ({"end": T1}, 400, "start: missing"),
        ({"start": 5}, 400, "start: expected a string, got int"),
        ({"start": T0, "end": ["latest"]}, 400, "end: expected a string, got list"),
        ({"start": T0, "end": None}, 400, "end: missing"),
        ({"start": T0, "stop": T1}, 400, "unknown field(s) ['stop']"),
        ({"start": "x" * 100_000}, 400, "start: longer than 16384 characters"),
        ({"start": "yesterday"}, 400, "invalid backfill range: start: 'yesterday' is not"),
        ({"start": T1, "end": T0}, 400, "invalid backfill range: end: 2026-11-27T10:00:00Z"),
        ({"start": "latest"}, 400, "invalid backfill range: start: latest is the end"),
        (
            {"start": "other_topic:0:5"},
            400,
            "invalid backfill range: start: 'other_topic:0:5': topic: the connector does not "
            "read topic 'other_topic' (it reads orders)",
        ),
        (
            {"start": "earliest", "end": f"orders:0:{2**70}"},
            400,
            f"invalid backfill range: end: 'orders:0:{2**70}': offset: {2**70} is out of range",
        ),
    ],
)
def test_hostile_bodies_get_400_json_errors_and_store_nothing(api: Api, body, status, message):
    before = len(api.store.backfills("bf_orders"))
    kw = {"data": body, "headers": {"Content-Type": "application/json"}}
    r = api.call(
        "POST",
        "/connectors/bf_orders/backfills",
        **(kw if isinstance(body, str) else {"json": body}),
    )
    assert r.status_code == status, r.text
    assert r.json()["error_code"] == status and r.json()["message"].startswith(message), r.json()
    assert len(api.store.backfills("bf_orders")) == before


def test_unknown_connectors_and_requests_are_404(api: Api) -> None:
    r = api.call("POST", "/connectors/nope/backfills", json={"start": T0})
    assert r.status_code == 404 and r.json()["message"] == "connector 'nope' not found"
    assert api.call("GET", "/connectors/nope/backfills").status_code == 404
    r = api.call("GET", "/connectors/bf_orders/backfills/999999")
    assert r.status_code == 404 and "no backfill request 999999" in r.json()["message"]
    assert api.call("GET", "/connectors/bf_orders/backfills/abc").status_code == 404
    assert api.call("DELETE", "/connectors/bf_orders/backfills").status_code == 405


# -- the CLI ----------------------------------------------------------------------------------


def cli(meta_url: str, *args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(
        main, ["--meta-url", meta_url, *args], catch_exceptions=False
    )


def test_the_cli_requests_lists_and_shows_a_backfill(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    s = MetaStore(url)
    add(s, "orders", {"name": "orders", "source": {"topics": ["orders"]}})
    r = cli(url, "backfill", "orders", "--start", T0, "--end", T1)
    assert r.exit_code == 0, r.output
    made = s.backfills("orders")[0]
    assert (made.start, made.end, made.state, made.requested_by) == (
        T0,
        T1,
        "requested",
        "the CLI",
    )
    assert r.output.startswith(f"backfill {made.id} of orders requested: {T0} .. {T1}")
    assert f"conveyor backfills orders {made.id}" in r.output
    listed = cli(url, "backfills", "orders")
    assert listed.exit_code == 0 and T0 in listed.output and "requested" in listed.output
    one = cli(url, "backfills", "orders", str(made.id), "--json")
    assert one.exit_code == 0 and json.loads(one.output) == made.as_json()
    bad = cli(url, "backfill", "orders", "--start", T1, "--end", T0)
    assert bad.exit_code == 2 and "is not after the start" in bad.output
    other = cli(url, "backfill", "orders", "--start", "other_topic:0:5")
    assert other.exit_code == 2 and "does not read topic 'other_topic'" in other.output
    gone = cli(url, "backfill", "nope", "--start", T0)
    assert gone.exit_code == 1 and "connector 'nope' not found" in gone.output
    assert len(s.backfills()) == 1


def test_a_source_connector_has_no_backfill(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    s = MetaStore(url)
    add(s, "cdc", {"name": "cdc", "kind": "source"})
    r = cli(url, "backfill", "cdc", "--start", T0)
    assert r.exit_code == 1 and "is a source connector" in r.output
    assert s.backfills() == []


# -- the sensor -------------------------------------------------------------------------------


@op
def noop() -> None:
    pass


@job(name="backfill__orders")
def fake_backfill() -> None:
    noop()


@pytest.fixture
def dagster_env(tmp_path: Path) -> Iterator[tuple[DagsterInstance, MetaStore, str]]:
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    s = MetaStore(url)
    add(s, "orders")
    with instance_for_test() as instance:
        yield instance, s, url


def tick(instance: DagsterInstance, url: str, jobs=None):
    ctx = build_sensor_context(
        instance=instance, resources={"conveyor": ConveyorResource(meta_url=url)}
    )
    return backfill_requests_sensor(jobs)(ctx)


def test_the_sensor_launches_each_request_once_and_fails_the_request_of_a_failed_run(dagster_env):
    instance, s, url = dagster_env
    a = s.request_backfill("orders", T0, T1, requested_by="the CLI")
    out = tick(instance, url)
    assert isinstance(out, list) and len(out) == 1
    req = out[0]
    assert isinstance(req, RunRequest)
    assert req.job_name == "backfill__orders" and req.run_key == f"backfill:{request_key(a)}"
    assert req.run_config == {
        "ops": {"backfill_range__orders": {"config": {"start": T0, "end": T1, "request_id": a.id}}}
    }
    assert req.tags[TAG_BACKFILL] == "orders" and req.tags[TAG_BACKFILL_REQUEST] == request_key(a)
    assert s.backfill(a.id).state == "launched"
    # Launched: not launched again (the run does not exist yet: it is on its way).
    assert not isinstance(tick(instance, url), list)
    # The run exists and fails before it could report.
    run = instance.create_run_for_job(
        fake_backfill, tags={TAG_BACKFILL_REQUEST: request_key(a), TAG_BACKFILL: "orders"}
    )
    instance.report_run_failed(run)
    assert not isinstance(tick(instance, url), list)
    got = s.backfill(a.id)
    assert got.state == "failed" and got.run_id == run.run_id
    assert got.message == f"run {run.run_id} failed"
    # A second request is a new run; a request whose run reported success is left as it is.
    b = s.request_backfill("orders", "earliest", "latest", requested_by="the REST API")
    out = tick(instance, url)
    assert [r.run_config["ops"]["backfill_range__orders"]["config"]["request_id"] for r in out] == [
        b.id
    ]


def test_a_request_waits_for_its_job_and_fails_when_it_never_comes(dagster_env):
    instance, s, url = dagster_env
    a = s.request_backfill("orders", T0, T1, requested_by="the CLI")
    # The code location has backfill jobs, but not this connector's (not reloaded yet).
    out = tick(instance, url, jobs=[])
    assert not isinstance(out, list) and s.backfill(a.id).state == "requested"
    r = s.backfill(a.id)
    launch, marks = backfill_decisions([r], {}, set(), r.updated_at + LAUNCH_TIMEOUT_S + 1)
    assert launch == [] and [(m.state, m.message) for m in marks] == [
        (
            "failed",
            "the code location has no job backfill__orders (a source connector, an invalid "
            "spec, or not reloaded) in 600 s",
        )
    ]
    launch, marks = backfill_decisions([r], {}, {"backfill__orders"}, r.updated_at)
    assert launch == [r] and [m.state for m in marks] == ["launched"]
