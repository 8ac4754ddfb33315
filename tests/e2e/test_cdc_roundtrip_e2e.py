"""Issue 33's round trip under a real Dagster instance: a type corpus in a private
``wal_level=logical`` cluster -> a ``postgres_cdc`` source connector (format debezium) -> a
3-partition topic -> a ``postgres`` sink connector (upsert by the primary key, tombstones
delete, truncates truncate) -> a replica table of the same definition on the machine's PostgreSQL. The replica
must equal the source column by column (``col::text``), after a snapshot, inserts, updates
(one touching only a non-TOASTed column of a row with a 128 KB TOASTed value), a key change,
deletes and a truncate; and again after kill -9 of the source connector's run during the
snapshot and during the stream, the slot never confirming a change the topic does not hold.

The sink's configuration is what a user replicating into PostgreSQL writes: every column
decoded as STRING and cast by PostgreSQL from its text form (exact for numerics of any
precision, NaN, infinities, dates BC; Spark's DECIMAL stops at 38 digits), bytea from base64
by ``unbase64``, json as VARIANT written back by ``to_json``, arrays built into PostgreSQL's
array literal (``pg_array``), and the source table in REPLICA IDENTITY FULL so that an update
carries its unchanged TOASTed values (the sink's upsert writes every column: with the default
identity they would become NULL), and ``op = 't'`` selected as ``__truncate`` with
``truncate_enabled``. Not carried, so not compared: a json value's text (spaces, key order;
numbers as Spark writes them: compared as JSON values), array lower bounds.
``test_a_json_null_is_not_sql_null`` checks that a JSON null in a json column arrives apart
from SQL NULL (``json_as: text``).

A truncate's message has no key, so it lands on any partition of the topic: it is ordered
with the changes of its own partition only. The test writes the rows after the truncate once
the replica shows it applied (as a user would need a one-partition topic for the guarantee).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from conveyor.sources.postgres_cdc import parse_lsn
from tests.e2e.conftest import FINISHED, DagsterHarness, wait_for
from tests.integration.pg_cluster import private_cluster
from tests.integration.sources_harness import read_topic

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

# A 128 KB value that does not compress: stored out of line (TOASTed).
BIG = "(SELECT string_agg(md5(i::text || random()::text), '') FROM generate_series(1, 4096) i)"

# (column, type, how the sink decodes it): "s" a scalar read as its text, "b" bytea (base64),
# "j" JSON (a VARIANT written back as JSON: a JSON string keeps its quotes), "a" a
# one-dimensional array, "a2" a two-dimensional one.
COLUMNS: list[tuple[str, str, str]] = [
    ("c_int2", "smallint", "s"),
    ("c_int4", "integer", "s"),
    ("c_int8", "bigint", "s"),
    ("c_num20", "numeric(20,2)", "s"),
    ("c_num", "numeric", "s"),
    ("c_float4", "real", "s"),
    ("c_float8", "double precision", "s"),
    ("c_bool", "boolean", "s"),
    ("c_text", "text", "s"),
    ("c_varchar", "varchar(20)", "s"),
    ("c_char", "char(5)", "s"),
    ("c_bytea", "bytea", "b"),
    ("c_date", "date", "s"),
    ("c_time", "time", "s"),
    ("c_timetz", "timetz", "s"),
    ("c_ts", "timestamp", "s"),
    ("c_tstz", "timestamptz", "s"),
    ("c_interval", "interval", "s"),
    ("c_uuid", "uuid", "s"),
    ("c_json", "json", "j"),
    ("c_jsonb", "jsonb", "j"),
    ("c_inet", "inet", "s"),
    ("c_cidr", "cidr", "s"),
    ("c_macaddr", "macaddr", "s"),
    ("c_money", "money", "s"),
    ("c_bit", "bit(4)", "s"),
    ("c_varbit", "varbit(16)", "s"),
    ("c_xml", "xml", "s"),
    ("c_point", "point", "s"),
    ("c_range", "int4range", "s"),
    ("c_tsrange", "tstzrange", "s"),
    ("c_mood", "{schema}.mood", "s"),
    ("c_pos", "{schema}.posint", "s"),
    ("a_int", "integer[]", "a"),
    ("a_text", "text[]", "a"),
    ("a_num", "numeric[]", "a"),
    ("a_float8", "double precision[]", "a"),
    ("a_bool", "boolean[]", "a"),
    ("a_date", "date[]", "a"),
    ("a_tstz", "timestamptz[]", "a"),
    ("a_uuid", "uuid[]", "a"),
    ("a_mood", "{schema}.mood[]", "a"),
    ("a_int2d", "integer[]", "a2"),
    ("c_big", "text", "s"),
    ("note", "text", "s"),
]
NAMES = [c for c, _, _ in COLUMNS]
# json keeps its text as written (spaces, key order, duplicate keys) and the change carries the
# parsed value, whose numbers Spark's JSON reader (and VARIANT) writes back in its own form
# (1.10 -> 1.1, 1e5 -> 100000.0): equal as JSON values, numbers compared exactly as decimals,
# not as text. A JSON null in a json column is not in the corpus: the change carries it as null,
# like SQL NULL.
AS_JSON = {"c_json", "c_jsonb"}

# Row literals (SQL expressions in column order, after id). {big} is the TOASTed value.
FULL_ROW = [
    "-32768",
    "-2147483648",
    "-9223372036854775808",
    "12345678901234567.89",
    "'3.14159265358979323846264338327950288419716939937510582097494459230781640628620899'",
    "'3.4028235e+38'",
    "'1.7976931348623157e+308'",
    "true",
    "E'unicode \u00e9\u4e2d\U0001f600, quotes '' \" and \\\\ tab\\t newline\\n end'",
    "'varchar \"v\"'",
    "'ab'",
    "'\\x00ff10275c22'::bytea",
    "'0044-03-15 BC'",
    "'23:59:59.999999'",
    "'12:00:00.5+05:30'",
    "'2024-02-29 12:34:56.123456'",
    "'1999-12-31 23:59:59.5-08'",
    "'1 year 2 mons -3 days 04:05:06.5'",
    "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'",
    """'{"b": 1, "a": [1, 2.50, "x\\"y"], "n": null, "u": "\u00e9"}'""",
    """'{"k": {"deep": [true, false, null]}, "num": 1.10, "big": 123456789012345678901234567890}'""",
    "'192.168.0.1/24'",
    "'10.0.0.0/8'",
    "'08:00:2b:01:02:03'",
    "'1234.56'",
    "B'1010'",
    "B'110'",
    "'<a b=\"c\">text &amp; more</a>'",
    "'(1.5,-2.25)'",
    "'[1,10)'",
    "'[2024-01-01 00:00:00+00,2024-02-01 00:00:00+02)'",
    "'happy \"quoted\"'",
    "42",
    "'{1,NULL,-3}'",
    """'{a,"b c",NULL,"NULL","quo\\"te","back\\\\slash","",{curly}}'""",
    "'{12345678901234567890.123456789,NaN,NULL}'",
    "'{1.5,NaN,Infinity,-Infinity,NULL}'",
    "'{t,f,NULL}'",
    "'{2024-01-31,infinity,NULL}'",
    "'{\"2024-01-31 12:00:00+02\",NULL}'",
    "'{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}'",
    r"""'{sad,"happy \"quoted\""}'""",
    "'{{1,2},{3,NULL}}'",
    "{big}",
    "'n'",
]
EXTREME_ROW = [
    "32767",
    "2147483647",
    "9223372036854775807",
    "-99999999999999999.99",
    "'NaN'",
    "'-Infinity'",
    "'-0'",
    "false",
    "''",
    "''",
    "'abcde'",
    "''::bytea",
    "'infinity'",
    "'00:00:00'",
    "'00:00:00-12'",
    "'-infinity'",
    "'infinity'",
    "'-178000000 years'",
    "'00000000-0000-0000-0000-000000000000'",
    "'[]'",
    "'\"just a string\"'",
    "'::1'",
    "'2001:db8::/32'",
    "'ff:ff:ff:ff:ff:ff'",
    "'-92233720368547758.08'",
    "B'0000'",
    "B''",
    "''",
    "'(0,0)'",
    "'empty'",
    "'(,)'",
    "'sad'",
    "2147483647",
    "'{}'",
    "'{}'",
    "'{Infinity,-Infinity}'",
    "'{}'",
    "'{}'",
    "'{}'",
    "'{}'",
    "'{}'",
    "'{}'",
    "'{{NULL}}'",
    "'short'",
    "NULL",
]
assert len(FULL_ROW) == len(EXTREME_ROW) == len(COLUMNS)


# ------------------------------------------------------------------------------- the sink side


def pg_array(expr: str, var: str = "x") -> str:
    """Spark SQL: a JSON array read as ARRAY<STRING> -> PostgreSQL's array literal (each
    element double-quoted with its quotes and backslashes escaped, NULL unquoted)."""
    quoted = f"""concat('"', replace(replace({var}, '\\\\', '\\\\\\\\'), '"', '\\\\"'), '"')"""
    element = f"CASE WHEN {var} IS NULL THEN 'NULL' ELSE {quoted} END"
    return f"concat('{{', array_join(transform({expr}, {var} -> {element}), ','), '}}')"


def pg_array_2d(expr: str) -> str:
    return f"concat('{{', array_join(transform({expr}, r -> {pg_array('r', 'y')}), ','), '}}')"


def sink_transform() -> dict[str, Any]:
    """The sink connector's transform for the corpus: the Debezium envelope's ``after``."""
    spark_type = {
        "s": "STRING",
        "b": "STRING",
        "j": "VARIANT",
        "a": "ARRAY<STRING>",
        "a2": "ARRAY<ARRAY<STRING>>",
    }
    fields = ", ".join(["id BIGINT", *(f"{c} {spark_type[k]}" for c, _, k in COLUMNS)])
    select = ["`after`.id AS id"]
    for c, _, kind in COLUMNS:
        value = f"`after`.{c}"
        if kind == "b":
            value = f"unbase64({value})"
        elif kind == "j":  # a JSON null is SQL NULL: the change does not tell them apart
            value = f"CASE WHEN is_variant_null({value}) THEN NULL ELSE to_json({value}) END"
        elif kind == "a":
            value = pg_array(value)
        elif kind == "a2":
            value = pg_array_2d(value)
        select.append(f"{value} AS {c}")
    return {
        "null_values": "pass",  # the tombstone after each delete deletes by the message key
        "schema": f"op STRING, `after` STRUCT<{fields}>",
        # A delete's own message is left out (its tombstone deletes); a truncate truncates.
        "filter": "__tombstone OR op IN ('r', 'c', 'u', 't')",
        "select": [*select, "coalesce(op = 't', false) AS __truncate"],
    }


# ------------------------------------------------------------------------------------ tables


def table_ddl(qualified: str, schema: str) -> str:
    cols = ", ".join(f"{c} {t.format(schema=schema)}" for c, t, _ in COLUMNS)
    return f"CREATE TABLE {qualified} (id bigint PRIMARY KEY, {cols})"


def types_ddl(schema: str) -> list[str]:
    return [
        f"CREATE TYPE {schema}.mood AS ENUM ('sad', 'ok', 'happy \"quoted\"')",
        f"CREATE DOMAIN {schema}.posint AS integer CHECK (VALUE > 0)",
    ]


def execute(url: str, *statements: str) -> None:
    with psycopg2.connect(url) as c, c.cursor() as cur:
        for s in statements:
            cur.execute(s)


def query(url: str, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg2.connect(url, options="-c TimeZone=UTC") as c, c.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchall()


def insert(url: str, table: str, row_id: int, row: list[str]) -> None:
    values = ", ".join(v.replace("{big}", BIG).replace("{curly}", '"{x}"') for v in row)
    execute(url, f"INSERT INTO {table} (id, {', '.join(NAMES)}) VALUES ({row_id}, {values})")


def as_text(url: str, table: str) -> dict[int, tuple[Any, ...]]:
    """Every row as the text of each column (json columns as their JSON value, numbers as
    Decimal: 1.10 equals 1.1), by id."""
    rows = query(
        url, f"SELECT id, {', '.join(f'{c}::text' for c in NAMES)} FROM {table} ORDER BY id"
    )
    json_at = [i for i, c in enumerate(NAMES) if c in AS_JSON]
    out = {}
    for r in rows:
        values = list(r[1:])
        for i in json_at:
            if values[i] is not None:
                values[i] = typed(json.loads(values[i], parse_float=Decimal))
        out[r[0]] = tuple(values)
    return out


def typed(value: Any) -> Any:
    """A JSON value whose numbers and booleans cannot compare equal (True == 1 in Python)."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, Decimal)):
        return ("number", Decimal(value))
    return value


def differences(src: dict[int, tuple], dst: dict[int, tuple]) -> list[str]:
    out = [f"id {i}: missing in the replica" for i in sorted(src.keys() - dst.keys())]
    out += [f"id {i}: in the replica only" for i in sorted(dst.keys() - src.keys())]
    for i in sorted(src.keys() & dst.keys()):
        for name, a, b in zip(NAMES, src[i], dst[i], strict=True):
            if a != b:
                out.append(f"id {i} {name}: source {str(a)[:80]!r} replica {str(b)[:80]!r}")
    return out


def messages_in(bootstrap: str, topic: str) -> list[tuple[Any, Any]]:
    """(key, value) of every message in the topic, as JSON (a tombstone's value None)."""
    return [
        (json.loads(m.key) if m.key is not None else None, json.loads(m.value) if m.value else None)
        for m in read_topic(bootstrap, topic)
    ]


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cdc_url() -> Iterator[str]:
    with private_cluster() as url:
        yield url


def specs(
    tag: str, cdc_url: str, table: str, topic: str, pg_url: str, schema: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    source = {
        "name": f"corpus_in_{tag}",
        "kind": "source",
        "source": {
            "type": "postgres_cdc",
            "url": cdc_url,
            "tables": [table],
            "format": "debezium",
            # Conveyor's exact values (Debezium's encodings lose NaN numerics, numeric
            # infinities, interval months, bit lengths), truncates written.
            "value_encoding": "conveyor",
            "skipped_operations": [],
        },
        "kafka": {"partitions": 3},
        "routing": {"default_destination": topic},
        "transform": {"null_values": "pass"},  # the tombstones after deletes
        "batch": {"max_records": 20, "max_wait_ms": 200},
        "heartbeat_timeout_s": 10,
    }
    sink = {
        "name": f"corpus_out_{tag}",
        "source": {"topics": [topic]},
        "transform": sink_transform(),
        "batch": {"max_records": 20, "max_wait_ms": 200},
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": schema,
            "table": "replica",
            "upsert_keys": ["id"],
            "delete_enabled": True,
            "truncate_enabled": True,
        },
        "heartbeat_timeout_s": 10,
    }
    return source, sink


# ------------------------------------------------------------------------------------- tests


@dataclass
class Pipeline:
    """A corpus table in the private cluster, its replica, and the two connectors."""

    dagster: DagsterHarness
    cdc_url: str
    pg_url: str
    tag: str
    topic: str
    table: str  # in the private cluster
    replica: str  # on the machine's PostgreSQL
    source: dict[str, Any]
    sink: dict[str, Any]

    def launch(self) -> list[str]:
        """Write both specs, load them, launch both connectors; their run ids."""
        for spec in (self.source, self.sink):
            self.dagster.write_spec(spec)
        self.dagster.reload()
        for spec in (self.source, self.sink):
            row = self.dagster.store.get(spec["name"])
            assert row.spec_error is None, (spec["name"], row.spec_error)
        return [self.dagster.launch(self.source["name"]), self.dagster.launch(self.sink["name"])]

    def differences(self) -> list[str]:
        return differences(as_text(self.cdc_url, self.table), as_text(self.pg_url, self.replica))

    def wait_equal(self, runs: list[str], what: str) -> None:
        """Until the replica equals the source; fails at once when a run ends."""

        def equal_while_running() -> bool:
            ended = [r for r in runs if self.dagster.run_status(r) in FINISHED]
            if ended:
                log = self.dagster.run_log(ended[0], tail=20)
                raise AssertionError(f"{what}: run {ended} ended:\n{log}")
            return not self.differences()

        try:
            wait_for(equal_while_running, 240, what, interval=1)
        except AssertionError as e:
            if "ended" in str(e):
                raise
            logs = "\n".join(self.dagster.run_log(r, tail=15) for r in runs)
            raise AssertionError(f"{what}: {self.differences()[:20]}\n{logs}") from None


@pytest.fixture
def pipeline(dagster: DagsterHarness, cdc_url: str, pg_url: str, pg_schema: str) -> Pipeline:
    tag = uuid.uuid4().hex[:6]
    topic, source_schema = f"cdc_{tag}.corpus", f"s_{tag}"
    table, replica = f"{source_schema}.corpus", f'"{pg_schema}".replica'
    execute(
        cdc_url,
        f"CREATE SCHEMA {source_schema}",
        *types_ddl(source_schema),
        table_ddl(table, source_schema),
        f"ALTER TABLE {table} REPLICA IDENTITY FULL",
    )
    execute(pg_url, *types_ddl(f'"{pg_schema}"'), table_ddl(replica, f'"{pg_schema}"'))
    source, sink = specs(tag, cdc_url, table, topic, pg_url, pg_schema)
    return Pipeline(dagster, cdc_url, pg_url, tag, topic, table, replica, source, sink)


def stream_changes(url: str, table: str) -> tuple[str, int]:
    """Inserts (one with a TOASTed value), updates (one of only a non-TOASTed column), a key
    change, deletes, several changes of one row in one transaction; the md5 and length of the
    TOASTed value of row 10."""
    insert(url, table, 10, FULL_ROW)
    insert(url, table, 11, EXTREME_ROW)
    execute(url, f"INSERT INTO {table} (id) VALUES (12)")
    big = query(url, f"SELECT md5(c_big), length(c_big) FROM {table} WHERE id = 10")[0]
    assert big[1] == 4096 * 32
    execute(url, f"UPDATE {table} SET note = 'only the note' WHERE id = 10")
    execute(
        url,
        f"UPDATE {table} SET c_num = '-0.000000000000000000000000000000000001', "
        "c_float8 = 'NaN', c_text = NULL, a_text = '{\"x,y\",\"}{\"}', c_mood = 'ok', "
        "c_ts = '0044-03-15 12:00:00.5 BC', c_tstz = '0044-03-15 12:00:00.5+00 BC' WHERE id = 1",
        f'UPDATE {table} SET c_int2 = 7, c_json = \'{{"set": "later"}}\', '
        "c_bytea = '\\x00'::bytea, a_int2d = '{{5}}' WHERE id = 3",
        f"UPDATE {table} SET id = 1000 WHERE id = 2",  # a key change
        f"DELETE FROM {table} WHERE id IN (101, 102, 103)",
        f"UPDATE {table} SET c_text = 'after ' || id WHERE id BETWEEN 140 AND 149",
    )
    with psycopg2.connect(url) as c, c.cursor() as cur:  # one transaction
        cur.execute(f"INSERT INTO {table} (id, c_text) VALUES (20, 'first'), (21, 'gone')")
        cur.execute(f"UPDATE {table} SET c_text = 'second' WHERE id = 20")
        cur.execute(f"DELETE FROM {table} WHERE id = 21")
        cur.execute(f"UPDATE {table} SET c_text = 'third', c_int8 = 1 WHERE id = 20")
    return big


def test_type_corpus_round_trip_through_cdc_topic_and_sink(
    pipeline: Pipeline, tansu: str, cdc_url: str, pg_url: str
) -> None:
    source_table, replica, topic = pipeline.table, pipeline.replica, pipeline.topic
    # Rows before the slot: read by the snapshot (op r).
    insert(cdc_url, source_table, 1, FULL_ROW)
    insert(cdc_url, source_table, 2, EXTREME_ROW)
    execute(cdc_url, f"INSERT INTO {source_table} (id) VALUES (3)")  # NULL in every column
    execute(
        cdc_url,
        f"INSERT INTO {source_table} (id, c_int4, c_num20, c_text, a_int) "
        "SELECT g, g, g * 1.01, 'row ' || g, ARRAY[g, NULL] FROM generate_series(100, 159) g",
    )
    runs = pipeline.launch()
    pipeline.wait_equal(runs, "the snapshot in the replica")

    big = stream_changes(cdc_url, source_table)
    pipeline.wait_equal(runs, "the stream's changes in the replica")

    # The unchanged TOASTed value survived the update of the note: not NULL, not a marker.
    got = query(pg_url, f"SELECT md5(c_big), length(c_big), note FROM {replica} WHERE id = 10")
    assert got == [(big[0], big[1], "only the note")]
    messages = messages_in(tansu, topic)
    ten = [v for k, v in messages if k == {"id": 10} and v is not None]
    assert [v["op"] for v in ten] == ["c", "u"]
    assert len(ten[1]["after"]["c_big"]) == 4096 * 32  # from the before image (FULL)
    # The key change: a delete and its tombstone under the old key, a create under the new.
    assert [v and v["op"] for k, v in messages if k == {"id": 2}] == ["r", "d", None]
    assert [v["op"] for k, v in messages if k == {"id": 1000}] == ["c"]

    # A truncate reaches the topic and empties the replica, and the stream goes on after it.
    execute(cdc_url, f"TRUNCATE {source_table}")
    wait_for(
        lambda: any(
            m.value is not None and json.loads(m.value)["op"] == "t"
            for m in read_topic(tansu, topic)
        ),
        120,
        "the truncate in the topic",
    )
    # Keyless, the truncate is ordered only within its partition: the rows after it are
    # written once the replica shows it (see the module's docstring).
    wait_for(
        lambda: query(pg_url, f"SELECT count(*) FROM {replica}") == [(0,)],
        240,
        "the truncate applied to the replica",
    )
    insert(cdc_url, source_table, 1, FULL_ROW)
    execute(cdc_url, f"INSERT INTO {source_table} (id, c_text) VALUES (2000, 'after truncate')")
    pipeline.wait_equal(runs, "the whole replica after the truncate")
    assert set(as_text(pg_url, replica)) == {1, 2000}

    # The slot advances over the last change once its batch is stored.
    last = [v for k, v in messages_in(tansu, topic) if k == {"id": 2000} and v is not None]
    slot = f"conveyor_{pipeline.source['name']}"
    wait_for(lambda: (slot_lsn(cdc_url, slot) or 0) >= last[0]["source"]["lsn"], 60, "the slot")


def slot_lsn(url: str, slot: str) -> int | None:
    rows = query(
        url,
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    )
    return parse_lsn(rows[0][0]) if rows and rows[0][0] else None


def kill_source_run(pipeline: Pipeline, run_id: str) -> None:
    """kill -9 of the source connector's run process; the run is then marked failed (no
    daemon watches runs here) so that the relaunch and the teardown do not wait on it."""
    row = pipeline.dagster.store.get(pipeline.source["name"])
    assert row.run_id == run_id and row.run_pid, row
    os.kill(row.run_pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(row.run_pid), 30, "the run process gone")
    with pipeline.dagster.instance() as inst:
        run = inst.get_run_by_id(run_id)
        assert run is not None
        inst.report_run_failed(run, message="test: kill -9")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def write_transactions(url: str, table: str, committed: list[tuple[int, range]]) -> None:
    """40 transactions of 25 inserts and an update; each recorded with the WAL insert
    position after its commit."""
    for t in range(40):
        ids = range(10_000 + t * 25, 10_000 + (t + 1) * 25)
        execute(
            url,
            f"INSERT INTO {table} (id, c_text, c_int8) SELECT g, 'stream ' || g, g "
            f"FROM generate_series({ids.start}, {ids.stop - 1}) g",
            f"UPDATE {table} SET c_text = 'touched' WHERE id = {t + 1}",
        )
        committed.append(
            (parse_lsn(query(url, "SELECT pg_current_wal_insert_lsn()::text")[0][0]), ids)
        )
        time.sleep(0.05)  # pacing only: the kill lands among the commits


def test_kill_9_during_snapshot_and_stream_loses_nothing(
    pipeline: Pipeline, tansu: str, cdc_url: str
) -> None:
    """kill -9 of the source connector's run during the snapshot, then during the stream
    (a writer committing meanwhile), each followed by a relaunch: the replica equals the
    source; the slot never confirmed a change the topic did not hold; duplicates at most the
    batches in flight."""
    table, name = pipeline.table, pipeline.source["name"]
    slot, batch = f"conveyor_{name}", pipeline.source["batch"]["max_records"]
    execute(
        cdc_url,
        f"INSERT INTO {table} (id, c_int4, c_num20, c_text, a_text) SELECT g, g, g * 1.01, "
        "'snap ' || g, ARRAY['x' || g, NULL] FROM generate_series(1, 3000) g",
    )
    runs = pipeline.launch()
    store = pipeline.dagster.store
    wait_for(
        lambda: (st := store.source_state(name)) is not None and st[1].get("snapshot"),
        120,
        "a snapshot batch stored",
        interval=0.1,
    )
    kill_source_run(pipeline, runs[0])
    assert store.source_state(name)[1].get("snapshot"), "the snapshot ended before the kill"
    runs[0] = pipeline.dagster.launch(name)
    pipeline.wait_equal(runs, "the snapshot after the kill")

    # The stream: a writer commits 40 transactions; the run is killed among them.
    committed: list[tuple[int, range]] = []  # (WAL insert position after the commit, ids)

    writer = threading.Thread(
        target=write_transactions, args=(cdc_url, table, committed), daemon=True
    )
    writer.start()
    wait_for(lambda: len(committed) >= 10, 60, "ten transactions committed", interval=0.1)
    kill_source_run(pipeline, runs[0])
    at_kill = len(committed)
    flushed = slot_lsn(cdc_url, slot)
    in_topic = {k["id"] for k, v in messages_in(tansu, pipeline.topic) if k and v}
    confirmed = [ids for lsn, ids in list(committed) if flushed is not None and lsn <= flushed]
    missing = [i for ids in confirmed for i in ids if i not in in_topic]
    assert not missing, f"the slot confirmed changes not in the topic: {missing[:10]}"
    writer.join(120)
    assert len(committed) == 40
    runs[0] = pipeline.dagster.launch(name)
    pipeline.wait_equal(runs, "the stream after the kill")

    inserted = Counter(
        k["id"] for k, v in messages_in(tansu, pipeline.topic) if k and v and v["op"] in "rc"
    )
    assert set(inserted) == set(range(1, 3001)) | set(range(10_000, 11_000))
    dupes = sum(n - 1 for n in inserted.values())
    assert dupes <= 2 * batch, dupes
    print(
        f"stream kill after {len(confirmed)} of {at_kill} committed transactions confirmed by "
        f"the slot, all in the topic; {dupes} duplicates"
    )


def test_a_json_null_is_not_sql_null(pipeline: Pipeline, tansu: str, cdc_url: str) -> None:
    """A jsonb column holding the JSON value null and one holding SQL NULL must arrive as
    different changes, or no sink can write each back as it was (issue 33: values exact for
    every built-in type). Encoding-neutral: only that the two ``after`` values differ."""
    table = pipeline.table
    execute(
        cdc_url,
        f"INSERT INTO {table} (id, c_jsonb, c_json) VALUES (1, 'null', 'null'), (2, NULL, NULL)",
    )
    # json_as: value (the default) embeds the parsed JSON, where null is null; text keeps
    # the JSON text, as Debezium's JSON converter does.
    pipeline.source["source"]["json_as"] = "text"
    pipeline.launch()
    wait_for(lambda: len(messages_in(tansu, pipeline.topic)) >= 2, 120, "both rows in the topic")
    after = {k["id"]: v["after"] for k, v in messages_in(tansu, pipeline.topic)}
    for column in ("c_jsonb", "c_json"):
        a, b = (after[1].get(column, "absent"), after[2].get(column, "absent"))
        assert a != b, f"{column}: JSON null and SQL NULL both arrive as {a!r}"
        assert (a, b) == ("null", None)


def test_envelope_debezium_replicates_a_table_with_no_hand_written_select(
    dagster: DagsterHarness, cdc_url: str, pg_url: str, pg_schema: str
) -> None:
    """Issue 36 point 3: the sink's ``transform.envelope: debezium`` replaces the selects above.
    The source's Debezium topic (default settings: the tombstone after a delete is skipped, the
    delete event itself deletes) replicates inserts, updates, a key change and deletes; the
    replica equals the source at the end."""
    tag = uuid.uuid4().hex[:6]
    src_schema, topic = f"e_{tag}", f"env_{tag}.items"
    table, replica = f"{src_schema}.items", f'"{pg_schema}".items'
    ddl = "(id bigint PRIMARY KEY, name text, amount numeric(12,2), at timestamptz)"
    execute(cdc_url, f"CREATE SCHEMA {src_schema}", f"CREATE TABLE {table} {ddl}")
    execute(pg_url, f"CREATE TABLE {replica} {ddl}")
    execute(
        cdc_url,
        f"INSERT INTO {table} SELECT g, 'item ' || g, g * 1.25, "
        "'2026-01-01 00:00:00+00'::timestamptz + g * interval '1 minute' FROM generate_series(1, 40) g",
    )
    source = {
        "name": f"env_in_{tag}",
        "kind": "source",
        "source": {"type": "postgres_cdc", "url": cdc_url, "tables": [table], "format": "debezium"},
        "kafka": {"partitions": 2},
        "routing": {"default_destination": topic},
        "batch": {"max_records": 20, "max_wait_ms": 200},
    }
    sink = {
        "name": f"env_out_{tag}",
        "source": {"topics": [topic]},
        "transform": {
            "decode": "json",
            # The row's fields as the source writes them (numerics and times as text, cast by
            # PostgreSQL exactly), not the envelope's.
            "schema": "id BIGINT, name STRING, amount STRING, at STRING",
            "envelope": "debezium",
        },
        "batch": {"max_records": 20, "max_wait_ms": 200},
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": pg_schema,
            "table": "items",
            "upsert_keys": ["id"],
            "delete_enabled": True,
        },
    }
    for spec in (source, sink):
        dagster.write_spec(spec)
    dagster.reload()
    runs = [dagster.launch(source["name"]), dagster.launch(sink["name"])]

    def rows(url: str, t: str) -> list[tuple[Any, ...]]:
        return query(url, f"SELECT id, name, amount::text, at FROM {t} ORDER BY id")

    try:
        wait_for(
            lambda: rows(pg_url, replica) == rows(cdc_url, table), 240, "the snapshot replicated"
        )
        execute(
            cdc_url,
            f"UPDATE {table} SET name = 'renamed ' || id, amount = amount + 0.01 WHERE id <= 10",
            f"DELETE FROM {table} WHERE id BETWEEN 30 AND 34",
            f"UPDATE {table} SET id = 1000 WHERE id = 20",  # a key change: a delete and a create
            f"INSERT INTO {table} VALUES (41, NULL, NULL, NULL)",
        )
        wait_for(
            lambda: rows(pg_url, replica) == rows(cdc_url, table), 240, "the changes replicated"
        )
        got = rows(pg_url, replica)
        assert len(got) == 36 and got[0][1] == "renamed 1" and got[0][2] == "1.26"
        assert 20 not in {r[0] for r in got} and 1000 in {r[0] for r in got}
        counters = dagster.store.get(sink["name"]).counters or {}
        assert counters.get("failed", 0) == 0
    finally:
        for run in runs:
            dagster.terminate(run)
        for run in runs:
            dagster.wait_status(run, FINISHED)
