"""Issue 33's lifecycle findings on a private wal_level=logical cluster: a newcomer naming a
running connector's slot is refused (specs, REST, CLI) and the owner keeps its spec; a slot
left by a deleted connector is never reused silently (initial refuses, never resumes from it,
when_needed drops it and snapshots again); delete warns that a slot remains, and the REST
DELETE drops it with ?drop_slot=true; debezium tombstones reach the topic with the defaults."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
import yaml
from click.testing import CliRunner

from conveyor.config.specs import dedupe, from_mapping, scan, sync_files
from conveyor.control.cli import main
from conveyor.core.errors import PermanentSourceError
from conveyor.core.model import ConnectorStatus
from conveyor.sources import build_source
from conveyor.sources.postgres_cdc import PostgresCDCSource
from conveyor.store.meta import MetaStore
from tests.integration.api_server import Api, served
from tests.integration.pg_cluster import private_cluster
from tests.integration.sources_harness import (
    build_loop,
    claimed_store,
    read_topic,
    running,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cdc_url() -> Iterator[str]:
    with private_cluster() as url:
        yield url


@pytest.fixture(autouse=True)
def _slots_dropped(cdc_url: str) -> Iterator[None]:
    yield
    wait_for(
        lambda: not query(cdc_url, "SELECT 1 FROM pg_replication_slots WHERE active"),
        what="every stream ended",
    )
    execute(cdc_url, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots")


def execute(url: str, *sql: str) -> None:
    with psycopg2.connect(url) as c, c.cursor() as cur:
        for q in sql:
            cur.execute(q)


def query(url: str, sql: str, args: tuple = ()) -> list:
    with psycopg2.connect(url) as c, c.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchall()


def slots(url: str) -> set[str]:
    return {r[0] for r in query(url, "SELECT slot_name FROM pg_replication_slots")}


def source_for(url: str, connector: str, **fields) -> PostgresCDCSource:
    config = build_source({"type": "postgres_cdc", "url": url, **fields}).config
    src = build_source(config.for_connector(connector))
    assert isinstance(src, PostgresCDCSource)
    return src


def drain(src: PostgresCDCSource, until, polls: int = 60) -> list:
    got: list = []
    state = None
    for _ in range(polls):
        p = src.poll(state, 100, 1.0)
        if p is not None:
            got.extend(p.messages)
            state = p.state
            src.commit(state)
        if until(got):
            break
    return got


def cdc_spec(name: str, url: str, table: str, **source) -> dict:
    return {
        "name": name,
        "kind": "source",
        "desired": "stopped",
        "source": {"type": "postgres_cdc", "url": url, "tables": [f"public.{table}"], **source},
        "routing": {"default_destination": f"{name}.t"},
    }


# -- 1. a newcomer cannot take a running connector's slot ------------------------------------


def loaded(name: str, **src):
    data = {"name": name, "kind": "source", "source": {"type": "postgres_cdc", "url": "x", **src}}
    return from_mapping(data, source=f"{name}.yaml", fallback_name=name)


def test_the_reviewers_newcomer_sorting_first_does_not_take_the_slot():
    # aa_steal.yaml sorts before items_cdc.yaml and names items_cdc's default slot.
    out = dedupe([loaded("aa_steal", slot="conveyor_items_cdc"), loaded("items_cdc")])
    assert out[1].ok, out[1].error
    assert not out[
        0
    ].ok and "replication slot conveyor_items_cdc is already used by connector 'items_cdc'" in str(
        out[0].error
    )
    # Neither named after the slot: the one created first in the meta store owns it ...
    two = [loaded("aa_new", slot="shared"), loaded("zz_old", slot="shared")]
    out = dedupe(two, created={"zz_old": 100.0, "aa_new": 200.0})
    assert out[1].ok and not out[0].ok and "connector 'zz_old'" in str(out[0].error)
    # ... and only then the file order.
    out = dedupe(two)
    assert out[0].ok and not out[1].ok


def test_a_newcomer_is_refused_at_the_door_and_the_owner_keeps_its_spec(tmp_path, cdc_url):
    home = tmp_path / "home"
    with served(home) as api:
        owner = cdc_spec("items_cdc", cdc_url, "items")
        r = api.call("POST", "/connectors", json={"name": "items_cdc", "config": owner})
        assert r.status_code == 201, r.text
        running_owner(api.store, "items_cdc")
        steal = cdc_spec("aa_steal", cdc_url, "items", slot="conveyor_items_cdc")
        r = api.call("POST", "/connectors", json={"name": "aa_steal", "config": steal})
        assert r.status_code == 409, r.text
        assert r.json()["message"] == (
            "replication slot conveyor_items_cdc is used by connector 'items_cdc'"
        )
        r = api.call("PUT", "/connectors/aa_steal/config", json=steal)
        assert r.status_code == 409 and "used by connector 'items_cdc'" in r.text
        # An existing connector changed to name the owner's slot: refused too.
        other = cdc_spec("zz_other", cdc_url, "items")
        assert api.call("POST", "/connectors", json={"name": "zz_other", "config": other}).ok
        other["source"]["slot"] = "conveyor_items_cdc"
        r = api.call("PUT", "/connectors/zz_other/config", json=other)
        assert r.status_code == 409 and "used by connector 'items_cdc'" in r.text
        # The owner may still change its own spec.
        owner["source"]["heartbeat_interval_s"] = 20
        assert api.call("PUT", "/connectors/items_cdc/config", json=owner).status_code == 200
        cli = cli_for(home)
        path = tmp_path / "aa_steal.yaml"
        path.write_text(yaml.safe_dump(steal))
        r = cli("connector", "apply", "-f", str(path))
        assert (
            r.exit_code != 0
            and "replication slot conveyor_items_cdc is used by connector 'items_cdc'" in r.output
        ), r.output
        assert not (api.connectors / "aa_steal.yaml").exists()
        assert {x.name for x in api.store.list()} == {"items_cdc", "zz_other"}
        # A file written by hand in the connectors directory: the scan gives it the error.
        (api.connectors / "aa_steal.yaml").write_text(yaml.safe_dump(steal))
        sync_files(api.store, scan(api.connectors))
        assert "already used by connector 'items_cdc'" in str(api.store.get("aa_steal").spec_error)
        row = api.store.get("items_cdc")
        assert row.status == ConnectorStatus.RUNNING and row.spec_error is None
        assert json.loads(row.spec_json)["source"]["heartbeat_interval_s"] == 20


def running_owner(store: MetaStore, name: str) -> None:
    """The owner as a run holds it: claimed, status Running."""
    from conveyor.core.model import DesiredState

    store.set_desired(name, DesiredState.RUNNING, reason="test")
    claim = store.claim(name, run_id="run-1", expected_generation=None, holder_alive=lambda r: True)
    store.heartbeat(name, claim.generation, {})
    assert store.get(name).status == ConnectorStatus.RUNNING


def cli_for(home: Path):
    def cli(*args: str):
        env = {"CONVEYOR_HOME": str(home), "CONVEYOR_CONNECTORS_DIR": str(home / "connectors")}
        meta = f"sqlite:///{home / 'meta.db'}"
        return CliRunner().invoke(main, ["--meta-url", meta, *args], env=env)

    return cli


# -- 2. a slot left by a deleted connector -------------------------------------------------


def test_delete_warns_and_a_recreated_connector_never_reuses_the_slot_silently(tmp_path, cdc_url):
    tag = uuid.uuid4().hex[:6]
    name = table = f"re_{tag}"
    slot = f"conveyor_{name}"
    execute(
        cdc_url, f"CREATE TABLE {table} (id int PRIMARY KEY)", f"INSERT INTO {table} VALUES (1)"
    )
    home = tmp_path / "home"
    (home / "connectors").mkdir(parents=True)
    cli = cli_for(home)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cdc_spec(name, cdc_url, table)))
    assert cli("connector", "apply", "-f", str(path)).exit_code == 0
    first = source_for(cdc_url, name, tables=[f"public.{table}"])
    try:  # its first run: the slot, the snapshot, a change streamed
        first.init(None)
        execute(cdc_url, f"INSERT INTO {table} VALUES (2)")
        assert len(drain(first, lambda g: len(g) >= 2)) == 2
    finally:
        first.close()
    r = cli("connector", "delete", name, "--yes")
    assert r.exit_code == 0, r.output
    assert f"warning: replication slot {slot} remains" in r.stderr
    assert f"SELECT pg_drop_replication_slot('{slot}')" in r.stderr
    assert slot in slots(cdc_url)
    execute(cdc_url, f"INSERT INTO {table} VALUES (3)")  # while no connector reads
    assert cli("connector", "apply", "-f", str(path)).exit_code == 0
    again = source_for(cdc_url, name, tables=[f"public.{table}"])
    try:
        with pytest.raises(PermanentSourceError) as e:
            again.init(None)
    finally:
        again.close()
    for words in (
        f"replication slot {slot} already exists",
        "--drop-slot",
        "snapshot: never",
        "snapshot: when_needed",
    ):
        assert words in str(e.value)
    assert slot in slots(cdc_url)  # refused: nothing dropped
    ids_ops = stream_ids(cdc_url, name, table, "never", until=1)
    assert ids_ops == [(3, "insert")]  # from the slot: the row since, no snapshot
    execute(cdc_url, f"INSERT INTO {table} VALUES (4)")
    ids_ops = stream_ids(cdc_url, name, table, "when_needed", until=4)
    # Dropped and created again: a fresh snapshot of every row once, nothing streamed twice.
    assert sorted(ids_ops) == [(1, "read"), (2, "read"), (3, "read"), (4, "read")]


def stream_ids(url: str, name: str, table: str, snapshot: str, until: int) -> list:
    """A connector with no stored state on the leftover slot: (id, op) of what it reads."""
    src = source_for(url, name, tables=[f"public.{table}"], snapshot=snapshot)
    try:
        src.init(None)
        got = drain(src, lambda g: len(g) >= until, polls=8)
    finally:
        src.close()
    values = [json.loads(m.payload) for m in got]
    return [(v["data"]["id"], v["op"]) for v in values]


def test_rest_delete_says_the_slot_remains_or_drops_it(tmp_path, cdc_url):
    tag = uuid.uuid4().hex[:6]
    table = f"rd_{tag}"
    execute(cdc_url, f"CREATE TABLE {table} (id int PRIMARY KEY)")
    with served(tmp_path / "home") as api:
        for name, drop in ((f"keep_{tag}", None), (f"drop_{tag}", "true")):
            create_with_slot(api, cdc_url, name, table)
            if drop is None:
                r = api.call("DELETE", f"/connectors/{name}")
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["slot_dropped"] is False
                assert f"replication slot conveyor_{name} remains" in body["remains"][0]
                assert f"conveyor_{name}" in slots(cdc_url)
            else:
                r = api.call("DELETE", f"/connectors/{name}?drop_slot=maybe")
                assert r.status_code == 400 and "drop_slot" in r.text
                assert api.store.get(name) is not None
                r = api.call("DELETE", f"/connectors/{name}?drop_slot={drop}")
                assert r.status_code == 200, r.text
                assert r.json() == {
                    "name": name,
                    "deleted": True,
                    "slot_dropped": True,
                    "remains": [],
                }
                assert f"conveyor_{name}" not in slots(cdc_url)
                assert not query(
                    cdc_url,
                    "SELECT 1 FROM pg_publication WHERE pubname = %s",
                    (f"conveyor_{name}",),
                )
            assert api.call("GET", f"/connectors/{name}").status_code == 404


def create_with_slot(api: Api, url: str, name: str, table: str) -> None:
    spec = cdc_spec(name, url, table)
    assert api.call("POST", "/connectors", json={"name": name, "config": spec}).status_code == 201
    src = source_for(url, name, tables=[f"public.{table}"])
    src.init(None)  # what its first run does: the slot and the publication
    src.close()
    assert f"conveyor_{name}" in slots(url)


# -- 3. tombstones with the defaults ------------------------------------------------------


def test_debezium_tombstones_reach_the_topic_with_the_defaults(
    tmp_path, tansu, spark_remote, cdc_url
):
    tag = uuid.uuid4().hex[:6]
    table = name = f"tomb_{tag}"
    execute(cdc_url, f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    spec = {  # no transform section: its defaults
        "name": name,
        "source": {
            "type": "postgres_cdc",
            "url": cdc_url,
            "tables": [f"public.{table}"],
            "format": "debezium",
        },
        "routing": {"default_destination": f"{name}.t"},
        "batch": {"max_records": 50, "max_wait_ms": 200},
    }
    store, gen = claimed_store(tmp_path, name)
    source = source_for(cdc_url, name, tables=[f"public.{table}"], format="debezium")
    loop = build_loop(
        spec, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote, source=source
    )
    with running(loop):
        wait_for(lambda: f"conveyor_{name}" in slots(cdc_url), what="the slot (the stream's start)")
        execute(
            cdc_url, f"INSERT INTO {table} VALUES (7, 'x')", f"DELETE FROM {table} WHERE id = 7"
        )
        wait_for(lambda: loop.counters.messages_out >= 3, what="create, delete, tombstone")
    records = read_topic(tansu, f"{name}.t")
    assert len(records) == 3 and loop.counters.filtered == 0
    create, delete, tomb = records
    create_v, delete_v = (json.loads(r.value)["payload"] for r in (create, delete))
    assert create_v["op"] == "c" and delete_v["op"] == "d"
    assert delete_v["before"]["id"] == 7
    assert tomb.value is None and tomb.key == delete.key
    assert json.loads(tomb.key)["payload"] == {"id": 7}


def test_a_first_run_killed_after_creating_its_slot_resumes_its_snapshot(cdc_url):
    """The first poll stores the plan (slot and snapshot) before any row: a run that dies
    right after it is relaunched from that state, not refused as a leftover slot."""
    tag = uuid.uuid4().hex[:6]
    name = table = f"first_{tag}"
    execute(
        cdc_url,
        f"CREATE TABLE {table} (id int PRIMARY KEY)",
        f"INSERT INTO {table} SELECT generate_series(1, 5)",
    )
    first = source_for(cdc_url, name, tables=[f"public.{table}"])
    try:
        first.init(None)
        planned = first.poll(None, 100, 1.0)
        assert planned is not None and planned.messages == []
        assert planned.state["snapshot"]["tables"] == [f"public.{table}"]
    finally:
        first.close()  # killed: the state stored, nothing read, nothing committed
    assert f"conveyor_{name}" in slots(cdc_url)
    execute(cdc_url, f"INSERT INTO {table} VALUES (6)")  # after the slot: streamed, or read
    again = source_for(cdc_url, name, tables=[f"public.{table}"])
    got: list = []
    try:
        again.init(planned.state)
        state = planned.state
        for _ in range(20):
            p = again.poll(state, 100, 1.0)
            if p is not None:
                got.extend(json.loads(m.payload) for m in p.messages)
                state = p.state
                again.commit(state)
            if {v["data"]["id"] for v in got} >= set(range(1, 7)):
                break
    finally:
        again.close()
    # Every row once at least: the snapshot resumed at a newer snapshot, then the stream.
    assert {v["data"]["id"] for v in got} == set(range(1, 7))
