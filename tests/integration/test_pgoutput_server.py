"""The pgoutput decoder on REAL pgoutput bytes from a private wal_level=logical cluster:
every built-in type and arrays of them, an enum, domains, a composite, NULLs, NaN and
infinities, numeric at full precision, an unchanged TOASTed value, REPLICA IDENTITY FULL
before images, a truncate, a logical decoding message and a replication origin. Each value is
checked against an exact expectation or against what PostgreSQL prints for the same value."""

from __future__ import annotations

import json
import random
import string
import time
from contextlib import closing
from typing import Any

import psycopg2
import pytest

from conveyor.sources.pgoutput import (
    BOX_OID,
    BUILTIN_ARRAYS,
    UNCHANGED_TOAST,
    Begin,
    Commit,
    Delete,
    Insert,
    Message,
    Origin,
    PgType,
    Relation,
    Truncate,
    TypeMessage,
    Update,
    ValueDecodeError,
    ValueDecoder,
    parse_message,
)
from conveyor.sources.strict_json import dumps
from tests.integration.pg_cluster import private_cluster

pytestmark = pytest.mark.integration

SESSION = (
    "SET TimeZone = 'UTC'",
    "SET DateStyle = 'ISO'",
    "SET IntervalStyle = 'iso_8601'",
    "SET extra_float_digits = 3",
    "SET bytea_output = 'hex'",
)
PRINTED = object()  # expected: what PostgreSQL prints for the value (col::text)


class Dumped(str):
    """Expected: ``dumps(decoded)`` is this text, byte for byte."""


BIG_NUMERIC = "1234567890" * 60 + "." + "0987654321" * 40  # 1000 digits
TRICKY = ["", " ", "NULL", "null", "a,b", "a;b", "{x}", '"q"', "back\\slash", " lead", "tab\t"]
TRICKY_SQL = "ARRAY[" + ",".join("'" + s.replace("'", "''") + "'" for s in TRICKY) + ",NULL]"
JSON_TEXT = '{"a":1.10,"b":[1e5,-0,2.5,1E+2,12345678901234567890],"c":"x\\u00e9","d":{"e":null}}'
JSONB_TEXT = '{"a":1.10,"b":[100000,0,2.5,100,12345678901234567890],"c":"x\\u00e9","d":{"e":null}}'

# (column, type, SQL value of row 1, expected decoded value)
COLUMNS: list[tuple[str, str, str, Any]] = [
    ("i2", "int2", "32767", 32767),
    ("i4", "int4", "-2147483648", -2147483648),
    ("i8", "int8", "9223372036854775807", 9223372036854775807),
    ("o", "oid", "4294967295", 4294967295),
    ("x8", "xid8", "'18446744073709551615'", 18446744073709551615),
    ("f4", "float4", "1.1", 1.1),
    ("f8", "float8", "0.1", 0.1),
    ("f8big", "float8", "-1.5e300", -1.5e300),
    ("n20", "numeric(20,2)", "12345678901234567.89", "12345678901234567.89"),
    ("nbig", "numeric", f"'{BIG_NUMERIC}'", BIG_NUMERIC),
    ("b", "bool", "true", True),
    ("t", "text", "E'it''s \"q\"\\n\\ttab \u00e9 \U0001f600'", "it's \"q\"\n\ttab \u00e9 \U0001f600"),
    ("vc", "varchar(10)", "'abc'", "abc"),
    ("bp", "char(5)", "'ab'", "ab   "),
    ("nm", "name", "'a name'", "a name"),
    ("ch", '"char"', "'x'", "x"),
    ("ci", "citext", "'MiXeD'", "MiXeD"),
    ("xm", "xml", "'<a>1</a>'", "<a>1</a>"),
    ("u", "uuid", "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    ("ip", "inet", "'192.168.0.1/24'", "192.168.0.1/24"),
    ("net", "cidr", "'10.0.0.0/8'", "10.0.0.0/8"),
    ("mac", "macaddr", "'08:00:2b:01:02:03'", "08:00:2b:01:02:03"),
    ("mac8", "macaddr8", "'08:00:2b:01:02:03:04:05'", "08:00:2b:01:02:03:04:05"),
    ("m", "money", "12.34", PRINTED),
    ("bt", "bit(4)", "B'1010'", "1010"),
    ("vb", "varbit", "B'101'", "101"),
    ("tsv", "tsvector", "'a fat cat'", PRINTED),
    ("tsq", "tsquery", "'fat & cat'", PRINTED),
    ("pt", "point", "'(1,2)'", "(1,2)"),
    ("ln", "line", "'{1,2,3}'", "{1,2,3}"),
    ("ls", "lseg", "'[(0,0),(1,1)]'", "[(0,0),(1,1)]"),
    ("bx", "box", "'(1,1),(0,0)'", "(1,1),(0,0)"),
    ("pa", "path", "'[(0,0),(1,1),(2,0)]'", "[(0,0),(1,1),(2,0)]"),
    ("pg", "polygon", "'((0,0),(1,1),(1,0))'", "((0,0),(1,1),(1,0))"),
    ("ci2", "circle", "'<(1,1),2>'", "<(1,1),2>"),
    ("r", "int4range", "'[1,5)'", "[1,5)"),
    ("tr", "tstzrange", "'[2024-01-01 00:00+00,2024-01-02 00:00+00)'", PRINTED),
    ("mr", "int4multirange", "'{[1,3),[5,7)}'", "{[1,3),[5,7)}"),
    ("cp", "pair", "ROW(1, 'x y')", '(1,"x y")'),
    ("lsn", "pg_lsn", "'16/B374D848'", "16/B374D848"),
    ("rc", "regclass", "'pg_class'", "pg_class"),
    ("js", "json", f"'{JSON_TEXT}'", Dumped(JSON_TEXT)),
    ("jb", "jsonb", f"'{JSON_TEXT}'", Dumped(JSONB_TEXT)),
    ("by", "bytea", "'\\x00ff10'::bytea", "AP8Q"),
    ("d", "date", "'2024-02-29'", "2024-02-29"),
    ("dbc", "date", "'0044-03-15 BC'", "0044-03-15 BC"),
    ("ts", "timestamp", "'2024-02-29 12:34:56.789'", "2024-02-29T12:34:56.789"),
    ("tsbc", "timestamp", "'0044-03-15 10:00:00 BC'", "0044-03-15T10:00:00 BC"),
    ("tz", "timestamptz", "'2024-02-29 12:34:56.000789+02'", "2024-02-29T10:34:56.000789Z"),
    ("tm", "time", "'12:34:56.5'", "12:34:56.5"),
    ("ttz", "timetz", "'12:34:56+02'", "12:34:56+02"),
    ("iv", "interval", "'1 year 2 months 3 days 04:05:06.5'", "P1Y2M3DT4H5M6.5S"),
    ("ivn", "interval", "'-1 day -2 hours'", "P-1DT-2H"),
    ("mo", "mood", "'happy, \"really\"'", 'happy, "really"'),
    ("pos", "posint", "5", 5),
    ("bd", "boxdom", "'(2,2),(0,0)'", "(2,2),(0,0)"),
    ("ia", "intarr", "'{1,2}'", [1, 2]),
    ("a_i4", "int4[]", "'[0:2]={1,NULL,3}'", [1, None, 3]),
    ("a_i8", "int8[]", "'{{1,2},{3,4}}'", [[1, 2], [3, 4]]),
    ("a_3d", "int2[]", "'{{{1},{2}},{{3},{4}}}'", [[[1], [2]], [[3], [4]]]),
    ("a_empty", "int4[]", "'{}'", []),
    ("a_t", "text[]", TRICKY_SQL, [*TRICKY, None]),
    ("a_n", "numeric[]", "'{1.10,NaN,-Infinity}'", ["1.10", "NaN", "-Infinity"]),
    ("a_f", "float8[]", "'{NaN,Infinity,-Infinity,1.5}'", ["NaN", "Infinity", "-Infinity", 1.5]),
    ("a_b", "bool[]", "'{t,f,NULL}'", [True, False, None]),
    ("a_by", "bytea[]", "ARRAY['\\x00ff'::bytea, NULL]", ["AP8=", None]),
    ("a_d", "date[]", "'{2024-01-01,infinity}'", ["2024-01-01", "infinity"]),
    ("a_tz", "timestamptz[]", "'{\"2024-01-01 00:00:00.5+01\"}'", ["2023-12-31T23:00:00.5Z"]),
    ("a_iv", "interval[]", "'{1 day,PT1S}'", ["P1D", "PT1S"]),
    ("a_u", "uuid[]", "'{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}'", ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
    ("a_jb", "jsonb[]", "ARRAY['{\"a\": 1.10}'::jsonb, 'null'::jsonb]", Dumped('[{"a":1.10},null]')),
    ("a_bx", "box[]", "'{(1,1),(0,0);(2,2),(1,1)}'", ["(1,1),(0,0)", "(2,2),(1,1)"]),
    ("a_mo", "mood[]", "'{sad,\"happy, \\\"really\\\"\"}'", ["sad", 'happy, "really"']),
    ("a_pos", "posint[]", "'{1,2}'", [1, 2]),
    ("a_bd", "boxdom[]", "'{(1,1),(0,0);(3,3),(2,2)}'", ["(1,1),(0,0)", "(3,3),(2,2)"]),
    ("a_cp", "pair[]", "ARRAY[ROW(1, 'x y')::pair, ROW(NULL, '\"')::pair]", ['(1,"x y")', '(,"""")']),
    ("a_r", "int4range[]", "'{\"[1,2)\",empty}'", ["[1,2)", "empty"]),
    ("a_ci", "citext[]", "'{A,b}'", ["A", "b"]),
    ("a_ia", "intarr[]", "ARRAY['{1}'::intarr, '{2}'::intarr]", [[1], [2]]),
]  # fmt: skip
SPECIAL = {  # row 3: NaN and the infinities
    "f4": ("'Infinity'", "Infinity"),
    "f8": ("'NaN'", "NaN"),
    "f8big": ("'-Infinity'", "-Infinity"),
    "n20": ("'NaN'", "NaN"),
    "nbig": ("'-Infinity'", "-Infinity"),
    "d": ("'-infinity'", "-infinity"),
    "dbc": ("'infinity'", "infinity"),
    "ts": ("'infinity'", "infinity"),
    "tz": ("'-infinity'", "-infinity"),
}


def connect(url: str) -> Any:
    conn = psycopg2.connect(url)
    conn.autocommit = True
    return conn


def run(url: str, *sql: str) -> None:
    with closing(connect(url)) as conn, conn.cursor() as cur:
        for q in sql:
            cur.execute(q)


@pytest.fixture(scope="module")
def server():
    """The cluster after every change of the test's story; yields (url, decoded messages, big)."""
    with private_cluster() as url:
        big = "".join(random.Random(7).choices(string.ascii_letters, k=128 * 1024))
        cols = ", ".join(f"{name} {typ}" for name, typ, _, _ in COLUMNS)
        run(
            url,
            "CREATE EXTENSION citext",
            "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy, \"really\"')",
            "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
            "CREATE DOMAIN boxdom AS box",
            "CREATE DOMAIN intarr AS int[]",
            "CREATE TYPE pair AS (a int, b text)",
            f"CREATE TABLE everything (id int PRIMARY KEY, {cols})",
            "ALTER TABLE everything REPLICA IDENTITY FULL",
            "CREATE TABLE toasted (id serial PRIMARY KEY, big text, n int)",
            "ALTER TABLE toasted ALTER COLUMN big SET STORAGE EXTERNAL",
            "CREATE PUBLICATION p FOR TABLE everything, toasted",
            "SELECT pg_create_logical_replication_slot('s', 'pgoutput')",
        )
        names = ", ".join(name for name, _, _, _ in COLUMNS)
        row1 = ", ".join(sql for _, _, sql, _ in COLUMNS)
        row3 = ", ".join(SPECIAL[n][0] if n in SPECIAL else "NULL" for n, _, _, _ in COLUMNS)
        run(
            url,
            f"INSERT INTO everything (id, {names}) VALUES (1, {row1})",
            "INSERT INTO everything (id) VALUES (2)",
            f"INSERT INTO everything (id, {names}) VALUES (3, {row3})",
            "UPDATE everything SET i2 = 7 WHERE id = 1",
            "DELETE FROM everything WHERE id = 2",
            f"INSERT INTO toasted (big, n) VALUES ('{big}', 1)",
            "UPDATE toasted SET n = 2",
            "DELETE FROM toasted",
            "SELECT pg_logical_emit_message(true, 'conveyor', 'hello')",
            "SELECT pg_replication_origin_create('elsewhere')",
            "SELECT pg_replication_origin_session_setup('elsewhere')",
            "BEGIN",
            "SELECT pg_replication_origin_xact_setup('0/ABCDEF', now())",
            "INSERT INTO toasted (big, n) VALUES ('o', 9)",
            "COMMIT",
            "SELECT pg_replication_origin_session_reset()",
            "TRUNCATE toasted RESTART IDENTITY CASCADE",
        )
        with closing(connect(url)) as conn, conn.cursor() as cur:
            for q in SESSION:
                cur.execute(q)
            cur.execute(
                "SELECT data FROM pg_logical_slot_peek_binary_changes('s', NULL, NULL, "
                "'proto_version', '1', 'publication_names', 'p', 'messages', 'true')"
            )
            messages = [parse_message(bytes(r[0])) for r in cur.fetchall()]
            yield url, messages, big


def lookup_for(url: str):
    conn = connect(url)
    calls: list[int] = []

    def lookup(oid: int) -> PgType | None:
        calls.append(oid)
        with conn.cursor() as cur:
            cur.execute(ValueDecoder.TYPE_QUERY, (oid,))
            row = cur.fetchone()
        return PgType.from_row(row) if row else None

    return conn, lookup, calls


def printed(url: str, row_id: int) -> dict[str, str | None]:
    """What PostgreSQL prints for row ``row_id``'s columns under the session settings."""
    with closing(connect(url)) as conn, conn.cursor() as cur:
        for q in SESSION:
            cur.execute(q)
        cur.execute(
            "SELECT "
            + ", ".join(f"{n}::text" for n, _, _, _ in COLUMNS)
            + f" FROM everything WHERE id = {row_id}"
        )
        values = cur.fetchone()
    return dict(zip([n for n, _, _, _ in COLUMNS], values, strict=True))


def of(messages: list[Any], kind: type) -> list[Any]:
    return [m for m in messages if isinstance(m, kind)]


def relation(messages: list[Any], name: str) -> Relation:
    return next(m for m in of(messages, Relation) if m.name == name)


def expected_row1(url: str) -> dict[str, Any]:
    text = printed(url, 1)
    return {n: text[n] if exp is PRINTED else exp for n, _, _, exp in COLUMNS}


def assert_row(decoded: dict[str, Any], expected: dict[str, Any]) -> None:
    for name, exp in expected.items():
        got = decoded[name]
        if isinstance(exp, Dumped):
            assert dumps(got) == exp, name
        else:
            assert got == exp and type(got) is type(exp), (name, got, exp)


def test_transactions_relations_and_types(server) -> None:
    url, messages, _ = server
    begins, commits = of(messages, Begin), of(messages, Commit)
    assert len(begins) == len(commits) == 11
    now_us = time.time() * 1e6
    for b, c in zip(begins, commits, strict=True):
        assert b.final_lsn == c.commit_lsn < c.end_lsn
        assert b.commit_time_us == c.commit_time_us
        assert now_us - 600e6 < c.commit_time_us <= now_us + 1e6
        assert b.xid > 0
    everything = relation(messages, "everything")
    assert (everything.namespace, everything.qualified) == ("public", "public.everything")
    assert everything.replica_identity == "f"
    assert [c.name for c in everything.columns] == ["id"] + [n for n, _, _, _ in COLUMNS]
    assert all(c.key for c in everything.columns)  # FULL: every column identifies the row
    toasted = relation(messages, "toasted")
    assert (toasted.replica_identity, toasted.key_columns) == ("d", ("id",))
    with closing(connect(url)) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT attname, atttypid, atttypmod FROM pg_attribute WHERE attnum > 0 "
            "AND attrelid = 'everything'::regclass ORDER BY attnum"
        )
        assert [(c.name, c.type_oid, c.type_modifier) for c in everything.columns] == list(
            cur.fetchall()
        )
        cur.execute("SELECT 'everything'::regclass::oid, 'toasted'::regclass::oid")
        assert (everything.oid, toasted.oid) == cur.fetchone()
    types = {(t.namespace, t.name) for t in of(messages, TypeMessage)}
    assert {("public", n) for n in ("mood", "pair", "citext")} <= types


def test_every_value_of_a_row_is_exact(server) -> None:
    url, messages, _ = server
    conn, lookup, calls = lookup_for(url)
    try:
        decoder = ValueDecoder(lookup)
        inserts = [
            m
            for m in of(messages, Insert)
            if m.relation_oid == relation(messages, "everything").oid
        ]
        values, unchanged = decoder.row(relation(messages, "everything"), inserts[0].new)
        assert unchanged == ()
        assert values["id"] == 1
        assert_row(values, expected_row1(url))
        assert len(calls) == len(set(calls))  # each OID looked up once
    finally:
        conn.close()


def test_as_printed_values_equal_what_postgres_prints(server) -> None:
    url, messages, _ = server
    conn, lookup, _ = lookup_for(url)
    try:
        rel = relation(messages, "everything")
        values, _ = ValueDecoder(lookup).row(rel, of(messages, Insert)[0].new)
    finally:
        conn.close()
        text = printed(url, 1)
    as_printed = "vc nm ch ci xm u ip net mac mac8 m bt vb tsv tsq pt ln ls bx pa pg ci2 r tr mr"
    as_printed += " cp lsn rc d dbc tm ttz iv ivn mo bd n20 nbig"
    for name in as_printed.split():
        assert values[name] == text[name], name


def test_nulls_and_special_values(server) -> None:
    url, messages, _ = server
    conn, lookup, _ = lookup_for(url)
    try:
        decoder = ValueDecoder(lookup)
        rel = relation(messages, "everything")
        inserts = [m for m in of(messages, Insert) if m.relation_oid == rel.oid]
        nulls, _ = decoder.row(rel, inserts[1].new)
        special, _ = decoder.row(rel, inserts[2].new)
    finally:
        conn.close()
        assert nulls == {"id": 2, **{n: None for n, _, _, _ in COLUMNS}}
    assert special == {
        "id": 3,
        **{n: SPECIAL[n][1] if n in SPECIAL else None for n, _, _, _ in COLUMNS},
    }


def test_full_replica_identity_before_images(server) -> None:
    url, messages, _ = server
    conn, lookup, _ = lookup_for(url)
    try:
        decoder = ValueDecoder(lookup)
        rel = relation(messages, "everything")
        update = next(m for m in of(messages, Update) if m.relation_oid == rel.oid)
        delete = next(m for m in of(messages, Delete) if m.relation_oid == rel.oid)
        assert update.old is not None and not update.old_is_key and not delete.old_is_key
        old, _ = decoder.row(rel, update.old)
        new, unchanged = decoder.row(rel, update.new)
        gone, _ = decoder.row(rel, delete.old)
    finally:
        conn.close()
        expected = expected_row1(url)
    assert_row(old, {**expected, "i2": 32767})
    # the row is wider than a page's share: its largest values went out of line (TOAST) and,
    # untouched by the update, come as unchanged: absent, and named
    assert unchanged and not set(new) & set(unchanged)
    assert set(new) | set(unchanged) == {"id", *expected}
    assert_row(new, {k: v for k, v in {**expected, "i2": 7}.items() if k not in unchanged})
    assert gone == {"id": 2, **{n: None for n, _, _, _ in COLUMNS}}


def test_unchanged_toast_is_absent(server) -> None:
    _, messages, big = server
    decoder = ValueDecoder()
    rel = relation(messages, "toasted")
    insert = next(m for m in of(messages, Insert) if m.relation_oid == rel.oid)
    update = next(m for m in of(messages, Update) if m.relation_oid == rel.oid)
    delete = next(m for m in of(messages, Delete) if m.relation_oid == rel.oid)
    assert decoder.row(rel, insert.new) == ({"id": 1, "big": big, "n": 1}, ())
    assert update.old is None and update.new[1] is UNCHANGED_TOAST
    assert decoder.row(rel, update.new) == ({"id": 1, "n": 2}, ("big",))
    assert delete.old_is_key
    assert decoder.row(rel, delete.old) == ({"id": 1, "big": None, "n": None}, ())


def test_truncate_message_and_origin(server) -> None:
    _, messages, _ = server
    toasted = relation(messages, "toasted")
    (truncate,) = of(messages, Truncate)
    assert truncate == Truncate(relation_oids=(toasted.oid,), cascade=True, restart_identity=True)
    (message,) = of(messages, Message)
    assert (message.transactional, message.prefix, message.content) == (True, "conveyor", b"hello")
    (origin,) = of(messages, Origin)
    assert (origin.name, origin.commit_lsn) == ("elsewhere", 0xABCDEF)
    # the origin's transaction: Begin, Origin, Insert, Commit
    i = messages.index(origin)
    assert isinstance(messages[i - 1], Begin) and isinstance(messages[i + 1], Insert)


def test_builtin_tables_match_the_catalog(server) -> None:
    url, _, _ = server
    with closing(connect(url)) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT oid::int, typelem::int FROM pg_type WHERE oid < 10000 AND typcategory = 'A'"
            " AND typelem <> 0 AND typlen = -1 AND typname NOT IN ('int2vector', 'oidvector')"
        )
        assert dict(cur.fetchall()) == BUILTIN_ARRAYS
        cur.execute(
            "SELECT oid::int FROM pg_type WHERE oid < 10000 AND typdelim <> ','"
            " AND typcategory <> 'A'"
        )
        assert cur.fetchall() == [(BOX_OID,)]


def test_random_text_arrays_parse_as_postgres_builds_them(server) -> None:
    """PostgreSQL's array_out text of random strings, parsed, equals its array_to_json."""
    url, _, _ = server
    rng = random.Random(11)
    alphabet = ' ,;{}"\\\tNUL\u00e9xa\n'
    arrays = [
        [[None if rng.random() < 0.1 else "".join(rng.choices(alphabet, k=rng.randrange(6)))
          for _ in range(3)] for _ in range(2)]
        for _ in range(100)
    ]  # fmt: skip
    decoder = ValueDecoder()
    with closing(connect(url)) as conn, conn.cursor() as cur:
        for arr in arrays:
            cur.execute(
                "SELECT a::text, array_to_json(a)::text FROM (SELECT %s::text[] a) x", (arr,)
            )
            text, as_json = cur.fetchone()
            assert decoder.value(1009, text.encode()) == arr == json.loads(as_json)


@pytest.mark.parametrize(
    ("setting", "column", "match"),
    [
        ("TimeZone = 'Asia/Kolkata'", "tz", r"offset \+05:30, not UTC \(is TimeZone=UTC\?\)"),
        ("DateStyle = 'SQL, DMY'", "d", "DateStyle=ISO"),
        ("IntervalStyle = 'postgres'", "iv", "IntervalStyle=iso_8601"),
    ],
)
def test_other_session_settings_are_refused_by_name(server, setting, column, match) -> None:
    url, _, _ = server
    with closing(connect(url)) as conn, conn.cursor() as cur:
        for q in (*SESSION, f"SET {setting}"):
            cur.execute(q)
        cur.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes('s', NULL, NULL, "
            "'proto_version', '1', 'publication_names', 'p')"
        )
        messages = [parse_message(bytes(r[0])) for r in cur.fetchall()]
    rel = relation(messages, "everything")
    insert = next(m for m in of(messages, Insert) if m.relation_oid == rel.oid)
    i = [c.name for c in rel.columns].index(column)
    with pytest.raises(ValueDecodeError, match=match):
        ValueDecoder().value(rel.columns[i].type_oid, insert.new[i])
