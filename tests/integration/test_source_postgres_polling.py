"""PostgreSQL polling source end to end: table -> Spark -> routing -> tansu topics, state in the meta store."""

from __future__ import annotations

import json
import uuid

import psycopg2
import pytest

from conveyor.core.engine.routing import RoutingError
from conveyor.core.errors import ConfigError
from conveyor.core.model import ConnectorStatus
from conveyor.sources import build_source
from tests.integration.sources_harness import (
    build_loop,
    claimed_store,
    read_topic,
    running,
    topic_values,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def table(pg_url, pg_schema):
    name = f"{pg_schema}.orders"
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{pg_schema}".orders (id serial PRIMARY KEY, region text, customer text, '
            "amount int, done boolean NOT NULL DEFAULT false)"
        )
    yield name, conn
    conn.close()


def insert(conn, table, rows):
    with conn.cursor() as cur:
        for region, customer, amount in rows:
            cur.execute(
                f"INSERT INTO {table} (region, customer, amount) VALUES (%s, %s, %s)",
                (region, customer, amount),
            )


def spec(name, pg_url, table, **source):
    return {
        "name": name,
        "source": {
            "type": "postgres_polling",
            "url": pg_url,
            "table": table,
            "incrementing_column": "id",
            **source,
        },
        "batch": {"max_records": 50, "max_wait_ms": 200},
    }


def test_column_routing_into_three_topics_with_keys_and_state(
    tmp_path, tansu, spark_remote, pg_url, table
):
    tname, conn = table
    name = f"src_{uuid.uuid4().hex[:6]}"
    prefix = f"{name}."
    regions = ["eu", "us", "apac"]
    insert(
        conn, tname, [(prefix + regions[i % 3], f"c{i}" if i % 5 else None, i) for i in range(120)]
    )
    store, gen = claimed_store(tmp_path, name)
    s = spec(name, pg_url, tname, destination_column="region", key_column="customer")
    loop = build_loop(s, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 120, what="120 rows produced")
    for r in regions:
        got = read_topic(tansu, prefix + r)
        values = [m.value for m in got]
        assert len(got) == 40, r
        decoded = [json.loads(v) for v in values]
        assert all("region" not in d for d in decoded)  # the routing column is stripped
        assert sorted(d["id"] for d in decoded) == list(range(1 + regions.index(r), 121, 3))
        for m, d in zip(got, decoded, strict=True):
            # A NULL partition key means no key.
            assert m.key == (None if d["customer"] is None else d["customer"].encode())
    assert store.source_state(name) == (2, {"last": {"id": 120}})
    stats = loop.heartbeat_payload()["routing"]
    assert stats["routed"] == 120 and stats["destinations_active"] == 3

    # A new run resumes after the stored state: only new rows are produced.
    insert(conn, tname, [(prefix + "eu", "late", 999)])
    loop2 = build_loop(s, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop2):
        wait_for(lambda: loop2.counters.messages_out >= 1, what="the new row")
    assert len(read_topic(tansu, prefix + "eu")) == 41
    assert store.source_state(name) == (2, {"last": {"id": 121}})


def test_delete_after_read_runs_in_commit_and_needs_destructive(
    tmp_path, tansu, spark_remote, pg_url, table
):
    tname, conn = table
    name = f"src_{uuid.uuid4().hex[:6]}"
    topic = f"{name}.all"
    with pytest.raises(ConfigError, match="destructive"):
        build_source(spec(name, pg_url, tname, destination=topic, delete_after_read=True)["source"])
    insert(conn, tname, [("x", "a", i) for i in range(30)])
    store, gen = claimed_store(tmp_path, name)
    s = spec(name, pg_url, tname, destination=topic, delete_after_read=True, destructive=True)
    loop = build_loop(s, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 30, what="30 rows")

        def left() -> int:
            with conn.cursor() as cur:
                cur.execute(f"SELECT count(*) FROM {tname}")
                return cur.fetchone()[0]

        wait_for(lambda: left() == 0, what="rows deleted in commit")
    assert len(topic_values(tansu, topic)) == 30


def test_processed_column_marks_rows_in_commit(tmp_path, tansu, spark_remote, pg_url, table):
    tname, conn = table
    name = f"src_{uuid.uuid4().hex[:6]}"
    topic = f"{name}.all"
    insert(conn, tname, [("x", "a", i) for i in range(10)])
    store, gen = claimed_store(tmp_path, name)
    s = spec(name, pg_url, tname, destination=topic, processed_column="done", destructive=True)
    loop = build_loop(s, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):

        def marked() -> int:
            with conn.cursor() as cur:
                cur.execute(f"SELECT count(*) FROM {tname} WHERE done")
                return cur.fetchone()[0]

        wait_for(lambda: marked() == 10, what="rows marked in commit")
    assert len(topic_values(tansu, topic)) == 10


def test_select_sets_the_destination_and_route_with_column_routing_refuses(
    tmp_path, tansu, spark_remote, pg_url, table
):
    tname, conn = table
    name = f"src_{uuid.uuid4().hex[:6]}"
    insert(conn, tname, [("r", "a", i) for i in range(12)])
    store, gen = claimed_store(tmp_path, name)
    s = spec(name, pg_url, tname)
    s["transform"] = {
        "schema": "id INT, amount INT",
        "select": [
            "id",
            "amount",
            f"CASE WHEN amount % 2 = 0 THEN '{name}.even' ELSE '{name}.odd' END AS __destination",
        ],
    }
    loop = build_loop(s, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 12, what="12 rows")
    assert sorted(d["amount"] for d in topic_values(tansu, f"{name}.even")) == [0, 2, 4, 6, 8, 10]
    assert len(topic_values(tansu, f"{name}.odd")) == 6

    # Both routing kinds at once refuse to start.
    s["routing"] = {"route": {"path": "amount", "mapping": {"1": f"{name}.one"}}}
    loop = build_loop(s, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with pytest.raises(ConfigError, match="both column-derived routing"):
        loop.run()


def test_cap_drops_under_polling_and_errors_when_asked(
    tmp_path, tansu, spark_remote, pg_url, table
):
    tname, conn = table
    name = f"src_{uuid.uuid4().hex[:6]}"
    insert(conn, tname, [(f"{name}.{r}", "a", i) for i, r in enumerate(["a", "b", "c"] * 4)])
    store, gen = claimed_store(tmp_path, name)
    s = spec(name, pg_url, tname, destination_column="region")
    s["routing"] = {"max_destinations": 2}
    loop = build_loop(s, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(lambda: loop.counters.batches >= 1, what="a batch")
    stats = loop.heartbeat_payload()["routing"]
    assert stats["destinations_active"] == 2 and stats["rejected"] == {"cap": 4}
    assert len(read_topic(tansu, f"{name}.c")) == 0
    assert len(read_topic(tansu, f"{name}.a")) == 4 and len(read_topic(tansu, f"{name}.b")) == 4

    (tmp_path / "b").mkdir()
    store2, gen2 = claimed_store(tmp_path / "b", name)
    s["routing"] = {"max_destinations": 2, "on_admission_failure": "error"}
    loop = build_loop(s, store=store2, generation=gen2, bootstrap=tansu, spark_remote=spark_remote)
    with pytest.raises(RoutingError, match="cap"):
        loop.run()
    assert store2.source_state(name) is None  # nothing stored for the refused batch


def test_breaker_opens_on_a_failing_destination_while_others_flow_then_closes(
    tmp_path, tansu, spark_remote, pg_url, table
):
    """A destination that cannot be produced into (missing, and topic creation is off)
    fails its batches until its breaker opens; then the other destinations flow and its
    rows are dropped (polling, not destructive); once it exists, the half-open probe after
    the cool-down closes the breaker."""
    from kafka.admin import KafkaAdminClient, NewTopic

    tname, conn = table
    name = f"src_{uuid.uuid4().hex[:6]}"
    good, hole = f"{name}.good", f"{name}.hole"
    admin = KafkaAdminClient(bootstrap_servers=tansu)
    admin.create_topics([NewTopic(good, 1, 1)])
    insert(conn, tname, [(good if i % 2 else hole, "a", i) for i in range(20)])
    store, gen = claimed_store(tmp_path, name)
    s = spec(name, pg_url, tname, destination_column="region")
    s["kafka"] = {"create_topics": False}
    s["batch"] = {"max_records": 4, "max_wait_ms": 100}
    s["retry"] = {"delay": 0.05, "max_delay": 0.1, "max_retries": 1000}
    loop = build_loop(
        s,
        store=store,
        generation=gen,
        bootstrap=tansu,
        spark_remote=spark_remote,
        breaker_cooldown_s=3.0,
    )
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 10, what="the good rows flow")
        stats = loop.heartbeat_payload()["routing"]
        assert loop.status == ConnectorStatus.DEGRADED  # flowing, but a destination is refused
        assert stats["destinations"][hole]["breaker"] in ("open", "half_open")
        assert stats["rejected"].get("circuit_open", 0) > 0
        assert "does not exist" in stats["destinations"][hole]["last_error"]
        admin.create_topics([NewTopic(hole, 1, 1)])

        def breaker() -> str:
            return loop.heartbeat_payload()["routing"]["destinations"][hole]["breaker"]

        wait_for(lambda: breaker() == "half_open", what="the cool-down")
        insert(conn, tname, [(hole, "b", 100 + i) for i in range(3)])
        wait_for(
            lambda: (
                loop.heartbeat_payload()["routing"]["destinations"][hole]["breaker"] == "closed"
            ),
            what="breaker closed after the cool-down",
        )
        wait_for(
            lambda: len(read_topic(tansu, hole)) >= 3, what="rows in the recovered destination"
        )
        wait_for(lambda: loop.status == ConnectorStatus.RUNNING, what="Running again")
    admin.close()
    goods = sorted(json.loads(m.value)["amount"] for m in read_topic(tansu, good))
    assert sorted(set(goods)) == list(range(1, 20, 2))  # every good row, while the hole failed
    # The probe after the cool-down went through, and what followed it.
    assert sorted(json.loads(m.value)["amount"] for m in read_topic(tansu, hole)) == [100, 101, 102]


def test_timestamp_column_reads_in_time_order_and_resumes(
    tmp_path, tansu, spark_remote, pg_url, pg_schema
):
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    tname = f"{pg_schema}.events"
    with conn.cursor() as cur:
        cur.execute(
            f"CREATE TABLE {tname} (id serial PRIMARY KEY, name text, at timestamptz NOT NULL)"
        )
        for i in range(6):
            cur.execute(
                f"INSERT INTO {tname} (name, at) VALUES (%s, timestamptz '2026-01-01 00:00:00+00' + %s * interval '1 minute')",
                (f"e{i}", 5 - i),  # inserted newest first: read in time order
            )
    name = f"src_{uuid.uuid4().hex[:6]}"
    topic = f"{name}.events"
    store, gen = claimed_store(tmp_path, name)
    s = spec(name, pg_url, tname, destination=topic)
    s["source"].pop("incrementing_column")
    s["source"]["timestamp_column"] = "at"
    loop = build_loop(s, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 6, what="6 events")
    assert [v["name"] for v in topic_values(tansu, topic)] == ["e5", "e4", "e3", "e2", "e1", "e0"]
    with conn.cursor() as cur:
        cur.execute(
            f"INSERT INTO {tname} (name, at) VALUES ('late', timestamptz '2026-01-02 00:00:00+00')"
        )
    loop = build_loop(s, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 1, what="the late event")
    assert [v["name"] for v in topic_values(tansu, topic)][-2:] == ["e0", "late"]
    assert len(topic_values(tansu, topic)) == 7
    conn.close()


def test_partition_id_out_of_range_rejects_only_that_row(
    tmp_path, tansu, spark_remote, pg_url, table
):
    tname, conn = table
    name = f"src_{uuid.uuid4().hex[:6]}"
    topic = f"{name}.p"
    insert(conn, tname, [("x", "a", i) for i in range(9)])
    store, gen = claimed_store(tmp_path, name)
    s = spec(name, pg_url, tname, destination=topic)
    s["kafka"] = {"partitions": 2}  # the destination is created with two partitions
    s["transform"] = {
        "schema": "id INT, amount INT",
        "select": ["id", "amount", "CAST(amount % 3 AS INT) AS __partition"],
    }
    loop = build_loop(s, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(
            lambda: loop.counters.batches >= 1 and store.source_state(name) is not None,
            what="a batch",
        )
    got = read_topic(tansu, topic)
    by_partition = sorted((m.partition, json.loads(m.value)["amount"]) for m in got)
    assert by_partition == [(0, 0), (0, 3), (0, 6), (1, 1), (1, 4), (1, 7)]
    assert loop.heartbeat_payload()["routing"]["rejected"] == {"partition_id_out_of_range": 3}
    assert store.source_state(name) == (
        2,
        {"last": {"id": 9}},
    )  # the batch went on without those rows
