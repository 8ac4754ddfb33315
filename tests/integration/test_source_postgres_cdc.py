"""PostgreSQL CDC source (pgoutput over the replication protocol) on a private wal_level=logical
cluster: the issue's scenario through the loop into a 3-partition topic (exact values, keys,
order per row, unchanged TOAST), the Debezium envelope and tombstones, batches bounded inside
a 50,000-row transaction, owned slots (two connectors, release, a spec claiming another's
slot), keyless tables refused, the heartbeat on an idle table, kill -9 during the snapshot
and during the stream, a state of another version refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psycopg2
import pytest
from click.testing import CliRunner

from conveyor.config.specs import dedupe, from_mapping
from conveyor.control.cli import main
from conveyor.core.engine.source_loop import SourceStateVersionError, checked_state
from conveyor.core.errors import PermanentSourceError
from conveyor.sources import build_source
from conveyor.sources.postgres_cdc import PostgresCDCSource, parse_lsn
from tests.integration.pg_cluster import private_cluster
from tests.integration.sources_harness import (
    build_loop,
    claimed_store,
    read_topic,
    running,
    wait_for,
)

pytestmark = pytest.mark.integration

# 128 KB that does not compress: stored out of line (TOASTed), so an update that does not
# touch it sends it as "unchanged".
BIG = "(SELECT string_agg(md5(i::text || random()::text), '') FROM generate_series(1, 4096) i)"


@pytest.fixture(scope="module")
def cdc_url():
    with private_cluster() as url:
        yield url


@pytest.fixture(autouse=True)
def _slots_dropped(cdc_url):
    """The cluster has 8 slots: each test's are dropped after it (once their streams end)."""
    yield
    wait_for(
        lambda: not query(cdc_url, "SELECT 1 FROM pg_replication_slots WHERE active"),
        what="every stream ended",
    )
    execute(cdc_url, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots")


def execute(url, *sql):
    with psycopg2.connect(url) as c, c.cursor() as cur:
        for q in sql:
            cur.execute(q)


def query(url, sql, args=()):
    with psycopg2.connect(url) as c, c.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchall()


def slot_flush(url, slot):
    rows = query(
        url,
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    )
    return parse_lsn(rows[0][0]) if rows else None


def source_for(url, connector, **fields) -> PostgresCDCSource:
    config = build_source({"type": "postgres_cdc", "url": url, **fields}).config
    src = build_source(config.for_connector(connector))
    assert isinstance(src, PostgresCDCSource)
    return src


def drain(src, state, max_records=100, until=None, polls=60):
    """Poll (and commit) until ``until(messages)`` holds; returns (messages, state, batch sizes)."""
    got, sizes = [], []
    for _ in range(polls):
        p = src.poll(state, max_records, 1.0)
        if p is not None:
            got.extend(p.messages)
            sizes.append(len(p.messages))
            state = p.state
            src.commit(state)
        if until is not None and until(got):
            break
    return got, state, sizes


def values(messages):
    return [json.loads(m.payload) if m.payload is not None else None for m in messages]


def test_issue_scenario_into_three_partitions(tmp_path, tansu, spark_remote, cdc_url):
    tag = uuid.uuid4().hex[:6]
    table = f"items_{tag}"
    execute(
        cdc_url,
        f"CREATE TABLE {table} (id int PRIMARY KEY, price numeric(20,2), tags text[], "
        "body text, note text)",
        f"INSERT INTO {table} VALUES (1, 1.10, '{{old}}', 'b', 'n'), (2, 2.20, NULL, 'b', 'n')",
    )
    name = f"cdc_{tag}"
    spec = {
        "name": name,
        "source": {"type": "postgres_cdc", "url": cdc_url, "tables": [f"public.{table}"]},
        "routing": {"default_destination": f"{name}.items"},
        "kafka": {"partitions": 3},
        "batch": {"max_records": 50, "max_wait_ms": 200},
    }
    store, gen = claimed_store(tmp_path, name)
    source = source_for(cdc_url, name, tables=[f"public.{table}"])
    loop = build_loop(
        spec, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote, source=source
    )
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 2, what="the snapshot")
        execute(
            cdc_url,
            f"INSERT INTO {table} VALUES (10, 12345678901234567.89, '{{a,\"b c\"}}', {BIG}, 'n')",
        )
        execute(cdc_url, f"UPDATE {table} SET note = 'changed' WHERE id = 10")
        execute(cdc_url, f"DELETE FROM {table} WHERE id = 2")
        execute(
            cdc_url,
            f"INSERT INTO {table} SELECT g, g, NULL, 'x', 'n' FROM generate_series(100, 599) g",
        )
        wait_for(lambda: loop.counters.messages_out >= 2 + 3 + 500, what="every change")
        stored = store.source_state(name)
        wait_for(
            lambda: (
                slot_flush(cdc_url, f"conveyor_{name}")
                == parse_lsn(store.source_state(name)[1]["safe_lsn"])
            ),
            what="the slot at the stored state",
        )
        # The slot's gauges reach a heartbeat (connector list's lag column, the metrics server):
        # measured at the first poll, after the loop's first heartbeat, so waited for (in CI a
        # run stopped before another heartbeat carried them).
        wait_for(
            lambda: "replication_lag_bytes" in (store.get(name).counters or {}),
            what="the slot's gauges in a heartbeat",
        )
    counters = store.get(name).counters
    assert counters["replication_lag_bytes"] >= 0 and counters["retained_wal_bytes"] >= 0
    wide = {"CONVEYOR_META_URL": store.url, "COLUMNS": "250"}  # a table never folded
    listed = CliRunner(env=wide).invoke(main, ["connector", "list"])
    # The gauges move with every heartbeat: the shape, not this moment's figures.
    assert listed.exit_code == 0 and re.search(r"\b\d+ B, WAL \d+ B\b", listed.output), (
        listed.output
    )
    records = read_topic(tansu, f"{name}.items")
    assert len(records) == 505 and {r.partition for r in records} == {0, 1, 2}
    by_key: dict[bytes, list] = {}
    for r in records:
        assert r.key is not None
        by_key.setdefault(r.key, []).append(r)
    for key, rs in by_key.items():  # one row's changes: one partition, in commit order
        assert len({r.partition for r in rs}) == 1, key
        assert [r.offset for r in rs] == sorted(r.offset for r in rs)
    ten = [json.loads(r.value) for r in by_key[b'{"id":10}']]
    assert [c["op"] for c in ten] == ["insert", "update"]
    assert ten[0]["data"]["price"] == "12345678901234567.89"
    assert ten[0]["data"]["tags"] == ["a", "b c"]
    assert len(ten[0]["data"]["body"]) == 4096 * 32
    assert "body" not in ten[1]["data"] and ten[1]["unchanged"] == ["body"]
    assert ten[1]["data"]["note"] == "changed"
    assert [json.loads(r.value)["op"] for r in by_key[b'{"id":2}']] == ["read", "delete"]
    assert json.loads(by_key[b'{"id":1}'][0].value)["data"] == {
        "id": 1,
        "price": "1.10",
        "tags": ["old"],
        "body": "b",
        "note": "n",
    }
    assert stored is not None and stored[1]["snapshot"] is None


def test_debezium_envelope_tombstones_key_change_and_truncate(cdc_url):
    tag = uuid.uuid4().hex[:6]
    table = f"dbz_{tag}"
    execute(cdc_url, f"CREATE TABLE {table} (id int PRIMARY KEY, v jsonb, at timestamptz)")
    execute(cdc_url, f"ALTER TABLE {table} REPLICA IDENTITY FULL")
    src = source_for(
        cdc_url,
        f"dbz_{tag}",
        tables=[f"public.{table}"],
        format="debezium",
        snapshot="never",
        skipped_operations=[],  # truncates too (Debezium's default skips them)
    )
    try:
        src.init(None)
        execute(
            cdc_url,
            f"INSERT INTO {table} VALUES (1, '{{\"n\": 1.10}}', '2024-01-31 12:00:00+02')",
            f"UPDATE {table} SET v = '[]' WHERE id = 1",
            f"UPDATE {table} SET id = 2 WHERE id = 1",
            f"DELETE FROM {table} WHERE id = 2",
        )
        execute(cdc_url, f"TRUNCATE {table}")
        # Batches of 3: a change's messages (delete + tombstone + create) are never split,
        # and no batch is larger.
        got, _, sizes = drain(src, None, max_records=3, until=lambda g: len(g) >= 8)
    finally:
        src.close()
    assert len(got) == 8 and max(sizes) <= 3
    docs = values(got)  # JsonConverter's {schema, payload}, as Debezium's default
    assert all(d is None or set(d) == {"schema", "payload"} for d in docs)
    c, u, moved_d, moved_tomb, moved_c, d, tomb, t = (x and x["payload"] for x in docs)
    assert [x["op"] for x in (c, u, moved_d, moved_c, d, t)] == ["c", "u", "d", "c", "d", "t"]
    assert c["before"] is None and c["after"]["id"] == 1
    assert c["after"]["at"] == "2024-01-31T10:00:00.000000Z"  # io.debezium.time.ZonedTimestamp
    assert c["after"]["v"] == '{"n": 1.10}'  # io.debezium.data.Json: the text, numbers exact
    assert u["before"]["v"] == '{"n": 1.10}' and u["after"]["v"] == "[]"  # FULL: before image
    # The key changed: a delete (and tombstone) under the old key, a create under the new,
    # each naming the other key in Debezium's headers.
    keys = [json.loads(m.key)["payload"] for m in got[2:5]]
    assert keys == [{"id": 1}, {"id": 1}, {"id": 2}]
    assert [[(h, json.loads(v)["payload"]) for h, v in m.headers] for m in got[2:5]] == [
        [("__debezium.newkey", {"id": 2})],
        [("__debezium.newkey", {"id": 2})],
        [("__debezium.oldkey", {"id": 1})],
    ]
    assert moved_tomb is None and moved_d["before"]["id"] == 1 and moved_c["after"]["id"] == 2
    assert d["before"]["id"] == 2 and d["after"] is None
    assert tomb is None and got[6].key == got[5].key
    assert t["before"] is None and t["after"] is None and got[7].key is None
    source = c["source"]
    assert source["connector"] == "postgresql" and source["name"] == f"dbz_{tag}"
    assert (source["db"], source["schema"], source["table"]) == ("postgres", "public", table)
    assert source["snapshot"] == "false" and isinstance(source["txId"], int)
    assert source["sequence"] == json.dumps([None, str(source["lsn"])]).replace(" ", "")
    assert isinstance(source["lsn"], int) and isinstance(c["ts_ms"], int)
    # The first transaction streamed follows no commit seen; the truncate's (the next one)
    # follows the end of its commit, as Debezium's sequence.
    assert json.loads(u["source"]["sequence"])[0] is None
    assert int(json.loads(t["source"]["sequence"])[0]) > c["source"]["lsn"]


def test_debezium_envelope_with_conveyors_exact_values(cdc_url):
    """value_encoding: conveyor: Debezium's envelope without a schema part, Conveyor's values
    (numeric as written, NaN kept, json parsed, dates as printed), truncates skipped as with
    Debezium's encodings."""
    tag = uuid.uuid4().hex[:6]
    table = f"exact_{tag}"
    execute(cdc_url, f"CREATE TABLE {table} (id int PRIMARY KEY, n numeric, d date, j jsonb)")
    src = source_for(
        cdc_url,
        f"exact_{tag}",
        tables=[f"public.{table}"],
        format="debezium",
        value_encoding="conveyor",
        snapshot="never",
    )
    try:
        src.init(None)
        execute(
            cdc_url, f"INSERT INTO {table} VALUES (1, 'NaN', '0044-03-15 BC', '{{\"a\": 1.10}}')"
        )
        execute(cdc_url, f"TRUNCATE {table}", f"INSERT INTO {table} VALUES (2, 1.50, NULL, NULL)")
        got, _, _ = drain(src, None, until=lambda g: len(g) >= 2)
    finally:
        src.close()
    first, second = values(got)
    assert "schema" not in first and first["op"] == "c" and got[0].key == b'{"id":1}'
    assert first["after"] == {"id": 1, "n": "NaN", "d": "0044-03-15 BC", "j": {"a": 1.1}}
    assert b'"j":{"a":1.10}' in got[0].payload  # the JSON numbers as written
    assert second["op"] == "c" and second["after"]["n"] == "1.50"  # the truncate: skipped


def test_unchanged_toast_absent_by_default_and_filled_with_replica_identity_full(cdc_url):
    tag = uuid.uuid4().hex[:6]
    plain, full = f"toast_{tag}", f"toastfull_{tag}"
    for t in (plain, full):
        execute(cdc_url, f"CREATE TABLE {t} (id int PRIMARY KEY, body text, note text)")
    execute(cdc_url, f"ALTER TABLE {full} REPLICA IDENTITY FULL")
    src = source_for(cdc_url, f"toast_{tag}", tables=[f"public.{plain}", f"public.{full}"])
    try:
        src.init(None)
        for t in (plain, full):
            execute(cdc_url, f"INSERT INTO {t} VALUES (1, {BIG}, 'a')")
            execute(cdc_url, f"UPDATE {t} SET note = 'b'")
        got, _, _ = drain(src, None, until=lambda g: len(g) >= 4)
    finally:
        src.close()
    ins, upd, ins_full, upd_full = values(got)
    body = ins["data"]["body"]
    assert len(body) == 4096 * 32 and upd["unchanged"] == ["body"] and "body" not in upd["data"]
    assert "old" not in upd  # the default identity: no before image
    assert upd_full["data"] == {"id": 1, "body": ins_full["data"]["body"], "note": "b"}
    assert "unchanged" not in upd_full and upd_full["old"]["note"] == "a"


def test_a_table_is_read_again_on_request_then_the_stream_goes_on(cdc_url):
    tag = uuid.uuid4().hex[:6]
    table, name = f"again_{tag}", f"again_{tag}"
    execute(cdc_url, f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
    execute(cdc_url, f"INSERT INTO {table} SELECT g, 0 FROM generate_series(1, 5) g")
    tables = [f"public.{table}"]
    src = source_for(cdc_url, name, tables=tables)
    try:
        src.init(None)
        execute(cdc_url, f"UPDATE {table} SET v = 1 WHERE id = 1")
        got, state, _ = drain(src, None, until=lambda g: len(g) >= 6)
    finally:
        src.close()
    assert [c["op"] for c in values(got)] == ["read"] * 5 + ["update"]
    execute(cdc_url, f"UPDATE {table} SET v = 2 WHERE id = 2")  # while nobody reads
    src = source_for(cdc_url, name, tables=tables, resnapshot={table: "r1"})
    try:
        src.init(state)
        got, state, sizes = drain(src, state, max_records=2, until=lambda g: len(g) >= 6)
    finally:
        src.close()
    assert [(c["op"], c["data"]["id"], c["data"]["v"]) for c in values(got)] == [
        ("read", 1, 1),
        ("read", 2, 2),
        ("read", 3, 0),
        ("read", 4, 0),
        ("read", 5, 0),
        ("update", 2, 2),  # the stream goes on from where it was: duplicates, converging
    ]
    assert max(sizes) <= 2 and state["resnapshots"] == [f"public.{table}=r1"]
    execute(cdc_url, f"UPDATE {table} SET v = 3 WHERE id = 3")
    src = source_for(cdc_url, name, tables=tables, resnapshot={table: "r1"})  # taken on once
    try:
        src.init(state)
        got, _, _ = drain(src, state, until=lambda g: len(g) >= 1)
        src.release()
    finally:
        src.close()
    assert [(c["op"], c["data"]["id"]) for c in values(got)] == [("update", 3)]


def test_batches_bounded_inside_a_50000_row_transaction(cdc_url):
    tag = uuid.uuid4().hex[:6]
    table = f"big_{tag}"
    execute(cdc_url, f"CREATE TABLE {table} (id int PRIMARY KEY, pad text)")
    src = source_for(cdc_url, f"big_{tag}", tables=[f"public.{table}"], snapshot="never")
    try:
        src.init(None)
        start = slot_flush(cdc_url, f"conveyor_big_{tag}")
        execute(
            cdc_url,
            f"INSERT INTO {table} SELECT g, repeat('p', 100) FROM generate_series(1, 50000) g",
        )
        plan = src.poll(None, 1000, 5.0)  # a first start stores its plan before any change
        assert plan is not None and plan.messages == []
        first = src.poll(plan.state, 1000, 5.0)
        assert first is not None and len(first.messages) == 1000
        # A failed batch: polled again from the older state, the same changes come back, and
        # nothing was confirmed meanwhile.
        again = src.poll(plan.state, 1000, 5.0)
        assert again is not None and values(again.messages) == values(first.messages)
        assert slot_flush(cdc_url, f"conveyor_big_{tag}") == start
        # Mid-transaction states confirm nothing: the slot stays until the transaction is done.
        src.commit(again.state)
        assert again.state["safe_lsn"] is None
        ids = [v["data"]["id"] for v in values(again.messages)]
        got, state, sizes = drain(
            src, again.state, max_records=1000, until=lambda g: len(g) >= 49000, polls=200
        )
        assert max(sizes) <= 1000
        ids += [v["data"]["id"] for v in values(got)]
        assert ids == list(range(1, 50001))
        if state["safe_lsn"] is None:  # the last batch ended at the last change: Commit next
            p = src.poll(state, 1000, 5.0)
            assert p is not None and p.messages == []
            state = p.state
        src.commit(state)
        wait_for(
            lambda: slot_flush(cdc_url, f"conveyor_big_{tag}") == parse_lsn(state["safe_lsn"]),
            what="the transaction confirmed",
        )
    finally:
        src.close()


def test_two_connectors_own_two_slots_and_release_drops_them(cdc_url):
    tag = uuid.uuid4().hex[:6]
    table = f"two_{tag}"
    execute(
        cdc_url, f"CREATE TABLE {table} (id int PRIMARY KEY)", f"INSERT INTO {table} VALUES (1)"
    )
    a = source_for(cdc_url, f"a_{tag}", tables=[f"public.{table}"])
    b = source_for(cdc_url, f"b_{tag}", tables=[f"public.{table}"])
    try:
        a.init(None)
        b.init(None)
        execute(cdc_url, f"INSERT INTO {table} VALUES (2)")
        got_a, _, _ = drain(a, None, until=lambda g: len(g) >= 2)
        got_b, _, _ = drain(b, None, until=lambda g: len(g) >= 2)
        assert [v["data"]["id"] for v in values(got_a)] == [1, 2]
        assert [v["data"]["id"] for v in values(got_b)] == [1, 2]
        slots = {r[0] for r in query(cdc_url, "SELECT slot_name FROM pg_replication_slots")}
        assert {f"conveyor_a_{tag}", f"conveyor_b_{tag}"} <= slots
        a.release()
    finally:
        a.close()
        b.close()
    slots = {r[0] for r in query(cdc_url, "SELECT slot_name FROM pg_replication_slots")}
    pubs = {r[0] for r in query(cdc_url, "SELECT pubname FROM pg_publication")}
    assert f"conveyor_a_{tag}" not in slots and f"conveyor_a_{tag}" not in pubs
    assert f"conveyor_b_{tag}" in slots and f"conveyor_b_{tag}" in pubs
    b.release()
    b.close()
    assert f"conveyor_b_{tag}" not in {
        r[0] for r in query(cdc_url, "SELECT slot_name FROM pg_replication_slots")
    }


def test_a_slot_claimed_by_two_specs_is_refused():
    def spec(name, **src):
        return from_mapping(
            {"name": name, "kind": "source", "source": {"type": "postgres_cdc", "url": "x", **src}},
            source=f"{name}.yaml",
            fallback_name=name,
        )

    out = dedupe([spec("one", slot="shared"), spec("two", slot="shared"), spec("three")])
    assert out[0].ok and out[2].ok
    assert not out[1].ok and "replication slot shared is already used by connector 'one'" in str(
        out[1].error
    )
    # The default slot is named after the connector: naming another's default is refused too.
    out = dedupe([spec("one"), spec("two", slot="conveyor_one")])
    assert out[0].ok and not out[1].ok


def test_the_managed_publication_follows_the_tables(cdc_url):
    tag = uuid.uuid4().hex[:6]
    a, b = f"pa_{tag}", f"pb_{tag}"
    execute(
        cdc_url, f"CREATE TABLE {a} (id int PRIMARY KEY)", f"CREATE TABLE {b} (id int PRIMARY KEY)"
    )
    pub = f"conveyor_pub_{tag}"

    def published():
        rows = query(
            cdc_url, "SELECT tablename FROM pg_publication_tables WHERE pubname = %s", (pub,)
        )
        return sorted(r[0] for r in rows)

    for tables in ([a], [a, b], [b]):
        # Started again without a stored state: on its own slot only with snapshot: never.
        again = {"snapshot": "never"} if tables != [a] else {}
        src = source_for(cdc_url, f"pub_{tag}", tables=[f"public.{t}" for t in tables], **again)
        try:
            src.init(None)
        finally:
            src.close()
        assert published() == sorted(tables)
    named = source_for(cdc_url, f"pub2_{tag}", publication="no_such_publication")
    with pytest.raises(
        PermanentSourceError, match="publication no_such_publication does not exist"
    ):
        named.init(None)
    named.close()


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"tables": ["public.a;drop"]}, "not a plain 'schema.table' name"),
        ({"slot": "Bad-Slot"}, "a slot or publication name"),
        ({"tables": ["public.a"], "key_columns": {"public.b": ["id"]}}, "not among the tables"),
        ({"resnapshot": {"public.a": "no spaces"}}, "a request id"),
        ({"tables": ["public.a"], "destinations": {"public.b": "t"}}, "not among the tables"),
    ],
)
def test_bad_config_names_the_field(fields, error):
    from conveyor.core.errors import ConfigError

    with pytest.raises(ConfigError, match=error):
        build_source({"type": "postgres_cdc", "url": "postgresql://x", **fields})


def test_a_table_without_a_key_is_refused_unless_configured(cdc_url):
    tag = uuid.uuid4().hex[:6]
    table = f"nokey_{tag}"
    execute(
        cdc_url, f"CREATE TABLE {table} (a int, b text)", f"INSERT INTO {table} VALUES (1, 'x')"
    )
    src = source_for(cdc_url, f"nk_{tag}", tables=[f"public.{table}"])
    with pytest.raises(
        PermanentSourceError, match=f"public.{table} has no primary key.*key_columns"
    ):
        src.init(None)
    src.close()
    keyed = source_for(
        cdc_url, f"nk2_{tag}", tables=[f"public.{table}"], key_columns={table: ["a"]}
    )
    with pytest.raises(PermanentSourceError, match="REPLICA IDENTITY FULL"):
        keyed.init(None)  # a delete would not carry column a
    execute(cdc_url, f"ALTER TABLE {table} REPLICA IDENTITY FULL")
    try:
        keyed.init(None)
        execute(cdc_url, f"DELETE FROM {table}")
        got, _, _ = drain(keyed, None, until=lambda g: len(g) >= 2)
    finally:
        keyed.close()
    assert [(m.key, json.loads(m.payload)["op"]) for m in got] == [
        (b'{"a":1}', "read"),
        (b'{"a":1}', "delete"),
    ]


def test_heartbeat_advances_the_slot_of_an_idle_table(cdc_url):
    tag = uuid.uuid4().hex[:6]
    idle, busy = f"idle_{tag}", f"busy_{tag}"
    execute(cdc_url, f"CREATE TABLE {idle} (id int PRIMARY KEY)", f"CREATE TABLE {busy} (id int)")
    slot = f"conveyor_hb_{tag}"
    src = source_for(
        cdc_url, f"hb_{tag}", tables=[f"public.{idle}"], snapshot="never", heartbeat_interval_s=0.5
    )
    try:
        src.init(None)
        start = slot_flush(cdc_url, slot)
        execute(cdc_url, f"INSERT INTO {busy} SELECT g FROM generate_series(1, 1000) g")
        end = parse_lsn(query(cdc_url, "SELECT pg_current_wal_lsn()::text")[0][0])
        state = None
        for _ in range(60):
            p = src.poll(state, 100, 1.0)
            if p is not None:
                assert p.messages == []  # nothing of ours
                state = p.state
                src.commit(state)
            if slot_flush(cdc_url, slot) >= end:
                break
        assert slot_flush(cdc_url, slot) >= end > start
        assert state is not None and parse_lsn(state["safe_lsn"]) > start
        gauges = src.metrics()  # measured at the first poll: the WAL written since the slot
        assert gauges["retained_wal_bytes"] >= gauges["replication_lag_bytes"] > 0
    finally:
        src.close()


WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    from conveyor.sources import build_source
    url, name, table, state_file, out_file, die_after, die_op = sys.argv[1:8]
    config = build_source({"type": "postgres_cdc", "url": url, "tables": [table]}).config
    src = build_source(config.for_connector(name))
    state = json.load(open(state_file)) if os.path.exists(state_file) else None
    src.init(state)
    seen = 0
    while True:
        p = src.poll(state, 100, 1.0)
        if p is None:
            continue
        with open(out_file, "a") as f:  # "produced" before the state is stored
            for m in p.messages:
                f.write(m.payload.decode() + "\\n")
        if any(json.loads(m.payload)["op"] == die_op or not die_op for m in p.messages):
            seen += 1
            if seen == int(die_after):  # produced, not stored: the worst moment
                os.kill(os.getpid(), signal.SIGKILL)
        with open(state_file + ".tmp", "w") as f:
            json.dump(p.state, f)
        os.replace(state_file + ".tmp", state_file)
        state = p.state
        src.commit(state)
    """
)


def _worker(url, name, table, tmp: Path, die_after: int = 0, die_op: str = "") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    args = [url, name, f"public.{table}", str(tmp / "state.json"), str(tmp / "out.jsonl")]
    return subprocess.Popen([sys.executable, "-c", WORKER, *args, str(die_after), die_op], env=env)


def test_kill_9_during_snapshot_and_stream_loses_nothing(tmp_path, cdc_url):
    tag = uuid.uuid4().hex[:6]
    table, name = f"k9_{tag}", f"k9_{tag}"
    execute(
        cdc_url,
        f"CREATE TABLE {table} (id int PRIMARY KEY, v int)",
        f"INSERT INTO {table} SELECT g, 0 FROM generate_series(1, 3000) g",
    )
    slot = f"conveyor_{name}"
    proc = _worker(cdc_url, name, table, tmp_path, die_after=5)  # inside the snapshot
    try:
        assert proc.wait(120) == -signal.SIGKILL
        state = json.loads((tmp_path / "state.json").read_text())
        assert state["snapshot"]["after"] == ["400"]  # the 5th batch produced, not stored
        assert slot_flush(cdc_url, slot) == parse_lsn(state["lsn"])  # the consistent point
        execute(cdc_url, f"UPDATE {table} SET v = 1 WHERE id % 10 = 0")  # after the slot
        proc = _worker(cdc_url, name, table, tmp_path, die_after=2, die_op="update")
        assert proc.wait(120) == -signal.SIGKILL  # in the stream: 2 of 3 batches of updates
        stored = json.loads((tmp_path / "state.json").read_text())
        assert stored["snapshot"] is None and stored["index"] == 99
        assert slot_flush(cdc_url, slot) <= parse_lsn(stored["lsn"])  # not past the stored
        execute(cdc_url, *[f"INSERT INTO {table} VALUES ({i}, 2)" for i in range(3001, 3301)])
        proc = _worker(cdc_url, name, table, tmp_path)
        wait_for(
            lambda: any(
                json.loads(line)["data"]["id"] == 3300
                for line in (tmp_path / "out.jsonl").read_text().splitlines()[-300:]
            ),
            what="the last insert",
        )
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        release = source_for(cdc_url, name, tables=[f"public.{table}"])
        release.release()
        release.close()
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    final: dict[int, int] = {}
    for c in lines:  # replayed in order, duplicates included, the last value wins
        final[c["data"]["id"]] = c["data"]["v"]
    expected = {i: (1 if i % 10 == 0 else 0) for i in range(1, 3001)}
    expected.update({i: 2 for i in range(3001, 3301)})
    assert final == expected
    # Duplicates at most the batches in flight at the kills (2 x 100).
    assert len(lines) <= 3000 + 300 + 300 + 200


def test_a_state_of_another_version_refuses_to_start(tmp_path, cdc_url):
    store, gen = claimed_store(tmp_path, "v")
    store.save_source_state("v", gen, {"commit_lsn": "0/0", "index": 0}, version=1)
    source = build_source({"type": "postgres_cdc", "url": cdc_url, "slot": "v"})
    assert source.state_version == 2
    with pytest.raises(SourceStateVersionError, match="version 1.*reset-state"):
        checked_state("v", store.source_state("v"), source.state_version)
    state = {"lsn": "0/0", "index": -1, "safe_lsn": None, "snapshot": None}
    store.save_source_state("v", gen, state, version=source.state_version)
    assert checked_state("v", store.source_state("v"), source.state_version) == state


def test_cli_delete_with_drop_slot_drops_the_slot_and_publication(tmp_path, cdc_url, monkeypatch):
    from click.testing import CliRunner

    from conveyor.control.cli import main

    monkeypatch.setenv("CONVEYOR_CONNECTORS_DIR", str(tmp_path / "connectors"))
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    tag = uuid.uuid4().hex[:6]
    name, table = f"del_{tag}", f"del_{tag}"
    execute(cdc_url, f"CREATE TABLE {table} (id int PRIMARY KEY)")
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"name: {name}\nkind: source\ndesired: stopped\n"
        f"source: {{type: postgres_cdc, url: '{cdc_url}', tables: [public.{table}]}}\n"
    )
    meta = f"sqlite:///{tmp_path / 'meta.db'}"

    def cli(*args: str):
        return CliRunner().invoke(main, ["--meta-url", meta, *args], catch_exceptions=False)

    assert cli("connector", "apply", "-f", str(spec)).exit_code == 0
    src = source_for(cdc_url, name, tables=[f"public.{table}"])
    src.init(None)  # what its first run does: the slot and the publication
    src.close()
    slot = f"conveyor_{name}"
    assert slot_flush(cdc_url, slot) is not None
    r = cli("connector", "delete", name, "--yes", "--drop-slot")
    assert r.exit_code == 0 and "slot dropped" in r.output, r.output
    assert slot_flush(cdc_url, slot) is None
    assert not query(cdc_url, "SELECT 1 FROM pg_publication WHERE pubname = %s", (slot,))
    assert not (tmp_path / "connectors" / f"{name}.yaml").exists()
