"""PostgreSQL CDC source on a private wal_level=logical cluster: destination per table,
the slot advancing only in commit, Degraded after failed commits and back, no
duplicates across a restart, a state of another version refused."""

from __future__ import annotations

import uuid

import psycopg2
import pytest

from conveyor.core.model import ConnectorStatus
from conveyor.core.source_loop import SourceStateVersionError, checked_state
from conveyor.sources import build_source
from conveyor.sources.postgres_cdc import parse_change, parse_lsn
from tests.integration.pg_cluster import private_cluster
from tests.integration.sources_harness import (
    build_loop,
    claimed_store,
    running,
    topic_values,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cdc_url():
    with private_cluster() as url:
        yield url


def execute(url, *sql):
    with psycopg2.connect(url) as c, c.cursor() as cur:
        for q in sql:
            cur.execute(q)


def slot_flush(url, slot):
    with psycopg2.connect(url) as c, c.cursor() as cur:
        cur.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        )
        return parse_lsn(cur.fetchone()[0])


def test_parse_test_decoding_lines():
    c = parse_change(
        "table public.o: INSERT: id[integer]:1 name[text]:'it''s a b' amount[numeric]:1.5 "
        "ok[boolean]:true j[jsonb]:'{\"a\": 1}' note[text]:null"
    )
    assert c == {
        "table": "public.o",
        "op": "insert",
        "data": {
            "id": 1,
            "name": "it's a b",
            "amount": 1.5,
            "ok": True,
            "j": {"a": 1},
            "note": None,
        },
    }
    assert parse_change("table public.o: DELETE: id[integer]:7") == {
        "table": "public.o",
        "op": "delete",
        "data": {"id": 7},
    }
    assert parse_change("BEGIN 725") is None


def test_cdc_by_table_slot_advances_only_in_commit(tmp_path, tansu, spark_remote, cdc_url):
    tag = uuid.uuid4().hex[:6]
    orders, customers = f"orders_{tag}", f"customers_{tag}"
    execute(
        cdc_url,
        f"CREATE TABLE {orders} (id int PRIMARY KEY, amount int)",
        f"CREATE TABLE {customers} (id int PRIMARY KEY, name text)",
    )
    name = f"cdc_{tag}"
    slot = f"slot_{tag}"
    topics = {f"public.{orders}": f"{name}.orders", f"public.{customers}": f"{name}.customers"}
    spec = {
        "name": name,
        "source": {
            "type": "postgres_cdc",
            "url": cdc_url,
            "slot": slot,
            "tables": list(topics),
            "destinations": topics,
        },
        "batch": {"max_records": 7, "max_wait_ms": 200},
        "commit_failure_threshold": 3,
    }
    store, gen = claimed_store(tmp_path, name)
    source = build_source(spec["source"])
    source.init(None)  # creates the slot
    start = slot_flush(cdc_url, slot)
    execute(cdc_url, *[f"INSERT INTO {orders} VALUES ({i}, {i * 10})" for i in range(20)])
    execute(cdc_url, *[f"INSERT INTO {customers} VALUES ({i}, 'c{i}')" for i in range(5)])
    execute(
        cdc_url,
        f"UPDATE {orders} SET amount = -1 WHERE id = 3",
        f"DELETE FROM {customers} WHERE id = 4",
    )
    execute(
        cdc_url,
        "CREATE TABLE other_table_ignored (x int)",
        "INSERT INTO other_table_ignored VALUES (1)",
    )

    # Commits fail: rows are produced once (polls drop what the stored state covers), the
    # slot stays where it was, and after 3 failures in a row the connector is Degraded.
    fail = {"on": True}
    orig = source.commit

    def commit(state):
        if fail["on"]:
            raise RuntimeError("could not advance the slot: lock timeout")
        orig(state)

    source.commit = commit
    loop = build_loop(
        spec, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote, source=source
    )
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 27, what="27 changes")
        wait_for(lambda: loop.status == ConnectorStatus.DEGRADED, what="Degraded")
        assert slot_flush(cdc_url, slot) == start  # nothing advanced without a successful commit
        fail["on"] = False
        wait_for(lambda: loop.status == ConnectorStatus.RUNNING, what="back to Running")
        wait_for(lambda: slot_flush(cdc_url, slot) > start, what="slot advanced")
    got_orders = topic_values(tansu, f"{name}.orders")
    got_customers = topic_values(tansu, f"{name}.customers")
    assert [(c["op"], c["data"]["id"]) for c in got_orders] == [
        ("insert", i) for i in range(20)
    ] + [("update", 3)]
    assert [(c["op"], c["data"]["id"]) for c in got_customers] == [
        ("insert", i) for i in range(5)
    ] + [("delete", 4)]
    assert got_orders[-1]["data"]["amount"] == -1
    stored = store.source_state(name)
    assert stored is not None and parse_lsn(stored[1]["safe_lsn"]) == slot_flush(cdc_url, slot)

    # A restart from the stored state: only new changes.
    execute(cdc_url, f"INSERT INTO {orders} VALUES (100, 1)")
    loop2 = build_loop(
        spec, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote
    )
    with running(loop2):
        wait_for(lambda: loop2.counters.messages_out >= 1, what="the new change")
    assert [c["data"]["id"] for c in topic_values(tansu, f"{name}.orders")][-2:] == [3, 100]
    assert len(topic_values(tansu, f"{name}.orders")) == 22


def test_a_state_of_another_version_refuses_to_start(tmp_path, cdc_url):
    store, gen = claimed_store(tmp_path, "v")
    store.save_source_state("v", gen, {"commit_lsn": "0/0", "index": 0}, version=99)
    source = build_source({"type": "postgres_cdc", "url": cdc_url})
    with pytest.raises(SourceStateVersionError, match="version 99.*reset-state"):
        checked_state("v", store.source_state("v"), source.state_version)
    store.save_source_state(
        "v", gen, {"commit_lsn": "0/0", "index": 0}, version=source.state_version
    )
    assert checked_state("v", store.source_state("v"), source.state_version) == {
        "commit_lsn": "0/0",
        "index": 0,
    }
