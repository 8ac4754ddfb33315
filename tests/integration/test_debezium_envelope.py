"""Debezium envelopes in JSON unwrapped by Spark SQL (``conveyor/spark/envelopes.py``) on a real
Spark Connect server, decoded as the transformer decodes JSON (``from_json`` with the
corrupt-record column and its options): events bare and inside Kafka Connect's
``{schema, payload}`` wrapper, c/r/u/d/t, an unknown op, a tombstone; then the messages the
``postgres_cdc`` source produces in ``format: debezium`` from a private ``wal_level=logical``
cluster (snapshot, inserts, updates, a key change, deletes with their tombstones, a truncate)
applied by the postgres sink (upsert by id, delete_enabled, truncate_enabled) to a replica on
the machine's PostgreSQL, which must equal the source table."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg2
import pyarrow as pa
import pytest

from conveyor.core.model import KEY_COL, VALUE_COL
from conveyor.sinks import build_sink
from conveyor.sources import build_source
from conveyor.sources.postgres_cdc import PostgresCDCSource
from conveyor.spark.envelopes import (
    OP_COL,
    debezium_json_columns,
    debezium_json_schema,
    debezium_row_fields,
    plain_payloads,
)
from conveyor.spark.session import spark_session
from conveyor.spark.transform import BAD_COL, CORRUPT_COL
from tests.conftest import PG_URL
from tests.integration.pg_cluster import private_cluster
from tests.integration.sources_harness import wait_for

pytestmark = pytest.mark.integration

ROW_DDL = "id BIGINT, name STRING, price STRING, `odd``name` INT"
OPTS = (
    f"map('columnNameOfCorruptRecord', '{CORRUPT_COL}', "
    "'allowNonNumericNumbers', 'false', 'allowSingleQuotes', 'false')"
)


@pytest.fixture(scope="module")
def spark(spark_remote: str) -> Any:
    return spark_session(spark_remote)


def unwrapped(spark: Any, batch: pa.Table, row_ddl: str) -> pa.Table:
    """``batch`` (``__value`` and ``__key``) decoded and unwrapped as the transformer would:
    Debezium's encodings as plain values by their schema part (none failing), one from_json
    with the envelope's schema, then the envelope's columns and its why."""
    values, failed = plain_payloads(batch.column(VALUE_COL).combine_chunks())
    assert not failed
    batch = batch.set_column(batch.schema.get_field_index(VALUE_COL), VALUE_COL, values)
    schema = f"{debezium_json_schema(row_ddl)}, {CORRUPT_COL} STRING".replace("'", "\\'")
    df = spark.createDataFrame(batch).selectExpr(
        KEY_COL, f"from_json(CAST({VALUE_COL} AS STRING), '{schema}', {OPTS}) AS __d"
    )
    fields = debezium_row_fields(df.schema["__d"].dataType)
    env = debezium_json_columns("__d", fields)
    return df.selectExpr(KEY_COL, f"{env.why} AS {BAD_COL}", *env.columns).toArrow()


def messages(values: list[Any], keys: list[bytes | None] | None = None) -> pa.Table:
    payloads = [v if v is None or isinstance(v, bytes) else json.dumps(v).encode() for v in values]
    return pa.table(
        {
            VALUE_COL: pa.array(payloads, pa.binary()),
            KEY_COL: pa.array(keys or [None] * len(values), pa.binary()),
        }
    )


def wrapped(event: dict[str, Any]) -> dict[str, Any]:
    """An event as Kafka Connect's JsonConverter writes it with schemas.enable."""
    schema = {"type": "struct", "name": "dbserver1.public.items.Envelope", "fields": []}
    return {"schema": schema, "payload": event}


def test_json_events_bare_and_wrapped(spark: Any) -> None:
    one = {"id": 1, "name": "a", "price": "1.10", "odd`name": 7}
    two = {"id": 2, "name": "b", "price": "2.20", "odd`name": None}
    source = {"connector": "postgresql", "table": "items"}
    events = [
        {"op": "r", "before": None, "after": one, "source": source},
        wrapped({"op": "c", "before": None, "after": two, "source": source}),
        {"op": "u", "before": two, "after": {**two, "name": "B"}, "source": source},
        wrapped({"op": "u", "before": None, "after": {**one, "price": "9.99"}}),
        wrapped({"op": "d", "before": {"id": 1}, "after": None}),
        {"op": "d", "before": two, "after": None},
        {"op": "t", "before": None, "after": None, "source": source},
        None,  # the tombstone after a delete (null_values: pass)
        {"op": "m", "before": None, "after": None},
        {"before": None, "after": one},  # no op
        {"op": "c", "before": None, "after": None},
        wrapped({"op": "d", "before": None, "after": None}),
    ]
    out = unwrapped(spark, messages(events), ROW_DDL)
    assert out.column_names == [
        KEY_COL, BAD_COL, "id", "name", "price", "odd`name", "__op", "__tombstone", "__truncate",
    ]  # fmt: skip
    got = [(r["id"], r["name"], r["price"], r["odd`name"]) for r in out.to_pylist()]
    assert got[:7] == [
        (1, "a", "1.10", 7),  # r: after
        (2, "b", "2.20", None),  # c (wrapped): after
        (2, "B", "2.20", None),  # u: after
        (1, "a", "9.99", 7),  # u (wrapped, no before image): after
        (1, None, None, None),  # d (wrapped): before, the key only
        (2, "b", "2.20", None),  # d: before, the whole row (REPLICA IDENTITY FULL)
        (None, None, None, None),  # t
    ]
    flags = [(r["__op"], r["__tombstone"], r["__truncate"]) for r in out.to_pylist()]
    assert flags[:8] == [
        ("r", False, False),
        ("c", False, False),
        ("u", False, False),
        ("u", False, False),
        ("d", True, False),
        ("d", True, False),
        ("t", False, True),
        (None, True, False),  # a tombstone deletes by its message key
    ]
    assert out.column(BAD_COL).to_pylist() == [None] * 8 + [
        'debezium envelope: unknown op "m" (c, r, u, d or t)',
        "debezium envelope: no op (not a Debezium change event)",
        "debezium envelope: op c without after",
        "debezium envelope: op d without before (the row to delete)",
    ]


# -- the postgres_cdc source's Debezium messages, applied to a replica ------------------------


@pytest.fixture(scope="module")
def cdc_url() -> Iterator[str]:
    with private_cluster() as url:
        yield url


def execute(url: str, *sql: str) -> None:
    with psycopg2.connect(url) as c, c.cursor() as cur:
        for q in sql:
            cur.execute(q)


def query(url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg2.connect(url) as c, c.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


def changes(
    url: str, table: str, connector: str, work: list[list[str]], count: int, snapshot: str
) -> pa.Table:
    """The source's messages (format debezium; ``snapshot`` initial or never) for ``work``,
    each group of statements one transaction, until ``count`` have come, as a batch of values
    and keys."""
    spec = {"type": "postgres_cdc", "url": url, "tables": [f"public.{table}"], "snapshot": snapshot}
    # Debezium's defaults (its encodings, schema part), truncates written too.
    config = build_source({**spec, "format": "debezium", "skipped_operations": []}).config
    src = build_source(config.for_connector(connector))
    assert isinstance(src, PostgresCDCSource)
    got: list[Any] = []
    try:
        src.init(None)
        for statements in work:
            execute(url, *statements)
        state = None
        for _ in range(60):  # each poll waits up to 1 s for changes
            polled = src.poll(state, 100, 1.0)
            if polled is not None:
                got += polled.messages
                state = polled.state
                src.commit(state)
            if len(got) >= count:
                break
    finally:
        src.close()
        wait_for(
            lambda: not query(url, "SELECT 1 FROM pg_replication_slots WHERE active"),
            what="the stream ended",
        )
        execute(url, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots")
    assert len(got) == count, [m.payload for m in got]
    return pa.table(
        {
            VALUE_COL: pa.array([m.payload for m in got], pa.binary()),
            KEY_COL: pa.array([m.key for m in got], pa.binary()),
        }
    )


@pytest.mark.slow  # a private wal_level=logical cluster: in the long suite, as the CDC corpus
@pytest.mark.parametrize("identity", ["default", "full"])
def test_postgres_cdc_debezium_into_a_replica(
    spark: Any, cdc_url: str, pg_schema: str, identity: str
) -> None:
    tag = uuid.uuid4().hex[:6]
    table = f"items_{tag}"
    ddl = "(id int PRIMARY KEY, name text, price numeric(10,2))"
    execute(
        cdc_url,
        f"CREATE TABLE {table} {ddl}",
        f"INSERT INTO {table} VALUES (1, 'one', 1.10), (2, 'two', 2.20), (3, 'three', NULL)",
    )
    if identity == "full":
        execute(cdc_url, f"ALTER TABLE {table} REPLICA IDENTITY FULL")
    execute(PG_URL, f'CREATE TABLE "{pg_schema}".replica {ddl}')
    work = [
        [f"INSERT INTO {table} VALUES (4, 'four', 4.40), (5, 'five', 5.50)"],
        [f"UPDATE {table} SET name = 'ONE', price = 1.11 WHERE id = 1"],
        [f"UPDATE {table} SET id = 20 WHERE id = 2"],  # a key change: d + tombstone + c
        [f"DELETE FROM {table} WHERE id IN (3, 4)"],  # 2 x (d + tombstone)
        [f"UPDATE {table} SET price = NULL WHERE id = 5"],
    ]
    # 3 snapshot reads + 2 c + 1 u + 3 (key change) + 4 (deletes) + 1 u
    batch = changes(cdc_url, table, f"dbz_{tag}", work, count=14, snapshot="initial")
    out = unwrapped(spark, batch, "id INT, name STRING, price STRING")
    assert out.column(BAD_COL).null_count == out.num_rows
    ops = out.column(OP_COL).to_pylist()
    assert ops == ["r", "r", "r", "c", "c", "u", "d", None, "c", "d", None, "d", None, "u"]
    # Deletes carry their key from before (the key only with the default identity).
    deletes = [r for r in out.to_pylist() if r["__op"] == "d"]
    assert [r["id"] for r in deletes] == [2, 3, 4]
    full = identity == "full"
    assert [r["name"] for r in deletes] == (["two", "three", "four"] if full else [None] * 3)
    assert all(r["__tombstone"] for r in out.to_pylist() if r["__op"] in ("d", None))
    replicate(out.drop_columns([BAD_COL, OP_COL]), pg_schema)
    assert sorted(query(PG_URL, f'SELECT * FROM "{pg_schema}".replica')) == sorted(
        query(cdc_url, f"SELECT * FROM {table}")
    )
    # A truncate, then a row: the replica follows.
    execute(PG_URL, f"INSERT INTO \"{pg_schema}\".replica VALUES (99, 'stale', NULL)")
    work = [[f"TRUNCATE {table}"], [f"INSERT INTO {table} VALUES (7, 'seven', 7.70)"]]
    batch = changes(cdc_url, table, f"dbz2_{tag}", work, count=2, snapshot="never")
    out = unwrapped(spark, batch, "id INT, name STRING, price STRING")
    assert out.column(OP_COL).to_pylist() == ["t", "c"]
    assert out.column("__truncate").to_pylist() == [True, False]
    replicate(out.drop_columns([BAD_COL, OP_COL]), pg_schema)
    assert query(PG_URL, f'SELECT * FROM "{pg_schema}".replica') == query(
        cdc_url, f"SELECT * FROM {table}"
    )
    assert [r[0] for r in query(PG_URL, f'SELECT id FROM "{pg_schema}".replica')] == [7]


def replicate(rows: pa.Table, pg_schema: str) -> None:
    """The unwrapped rows through the postgres sink: upserts by id, deletes, truncates."""
    sink = build_sink(
        {
            "type": "postgres",
            "url": PG_URL,
            "schema": pg_schema,
            "table": "replica",
            "upsert_keys": ["id"],
            "delete_enabled": True,
            "truncate_enabled": True,
        }
    )
    sink.init_sink()
    try:
        assert sink.send_batch(rows).failed == ()
    finally:
        sink.cleanup_sink()
