"""The pgoutput decoder without a server: hand-made protocol-1 messages (and malformed ones,
which raise ProtocolError, never IndexError or struct.error), the value conversions, the
array text parser and the exact JSON numbers."""

from __future__ import annotations

import contextlib
import json
import re
import struct
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.sources.pgoutput import (
    PG_EPOCH_US,
    UNCHANGED_TOAST,
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    Message,
    Origin,
    PgType,
    ProtocolError,
    Relation,
    Truncate,
    TypeMessage,
    Update,
    ValueDecodeError,
    ValueDecoder,
    parse_array,
    parse_json,
    parse_message,
)
from conveyor.sources.strict_json import JsonNumber, dumps

# ---------------------------------------------------------------- building messages


def s(text: str) -> bytes:
    return text.encode() + b"\0"


def tup(*values: Any) -> bytes:
    out = struct.pack(">h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is UNCHANGED_TOAST:
            out += b"u"
        else:
            out += b"t" + struct.pack(">i", len(v)) + v
    return out


BEGIN = b"B" + struct.pack(">Qqi", 0x16B374D848, 1_000_000, 777)
COMMIT = b"C\0" + struct.pack(">QQq", 0x16B374D848, 0x16B374D900, -5)
ORIGIN = b"O" + struct.pack(">Q", 0xABCDEF) + s("elsewhere")
MESSAGE = b"M\x01" + struct.pack(">Q", 42) + s("conveyor") + struct.pack(">i", 5) + b"hello"
RELATION = (
    b"R"
    + struct.pack(">I", 16385)
    + s("public")
    + s("orders")
    + b"d"
    + struct.pack(">h", 3)
    + b"\x01"
    + s("id")
    + struct.pack(">Ii", 23, -1)
    + b"\x00"
    + s("name")
    + struct.pack(">Ii", 1043, 14)
    + b"\x00"
    + s("note")
    + struct.pack(">Ii", 25, -1)
)
TYPE = b"Y" + struct.pack(">I", 16400) + s("public") + s("mood")
INSERT = b"I" + struct.pack(">I", 16385) + b"N" + tup(b"1", "é".encode(), None)
UPDATE_PLAIN = b"U" + struct.pack(">I", 16385) + b"N" + tup(b"1", b"b", UNCHANGED_TOAST)
UPDATE_KEY = (
    b"U" + struct.pack(">I", 16385) + b"K" + tup(b"1", None, None) + b"N" + tup(b"2", b"b", None)
)
UPDATE_OLD = (
    b"U" + struct.pack(">I", 16385) + b"O" + tup(b"1", b"a", None) + b"N" + tup(b"1", b"b", None)
)
DELETE_KEY = b"D" + struct.pack(">I", 16385) + b"K" + tup(b"1", None, None)
DELETE_OLD = b"D" + struct.pack(">I", 16385) + b"O" + tup(b"1", b"a", b"")
TRUNCATE = b"T" + struct.pack(">iB", 2, 3) + struct.pack(">II", 16385, 16390)
ALL = [BEGIN, COMMIT, ORIGIN, MESSAGE, RELATION, TYPE, INSERT, UPDATE_PLAIN, UPDATE_KEY,
       UPDATE_OLD, DELETE_KEY, DELETE_OLD, TRUNCATE]  # fmt: skip
ORDERS = Relation(
    oid=16385,
    namespace="public",
    name="orders",
    replica_identity="d",
    columns=(
        Column("id", 23, -1, True),
        Column("name", 1043, 14, False),
        Column("note", 25, -1, False),
    ),
)


def test_each_message_kind() -> None:
    assert parse_message(BEGIN) == Begin(0x16B374D848, PG_EPOCH_US + 1_000_000, 777)
    assert parse_message(COMMIT) == Commit(0x16B374D848, 0x16B374D900, PG_EPOCH_US - 5)
    assert parse_message(ORIGIN) == Origin(0xABCDEF, "elsewhere")
    assert parse_message(MESSAGE) == Message(True, 42, "conveyor", b"hello")
    assert parse_message(RELATION) == ORDERS
    assert parse_message(TYPE) == TypeMessage(16400, "public", "mood")
    assert parse_message(INSERT) == Insert(16385, (b"1", "é".encode(), None))
    assert parse_message(UPDATE_PLAIN) == Update(16385, None, False, (b"1", b"b", UNCHANGED_TOAST))
    assert parse_message(UPDATE_KEY) == Update(16385, (b"1", None, None), True, (b"2", b"b", None))
    assert parse_message(UPDATE_OLD) == Update(16385, (b"1", b"a", None), False, (b"1", b"b", None))
    assert parse_message(DELETE_KEY) == Delete(16385, (b"1", None, None), True)
    assert parse_message(DELETE_OLD) == Delete(16385, (b"1", b"a", b""), False)
    assert parse_message(TRUNCATE) == Truncate((16385, 16390), cascade=True, restart_identity=True)
    assert parse_message(memoryview(BEGIN)) == parse_message(bytearray(BEGIN))


def test_relation_names() -> None:
    assert ORDERS.qualified == "public.orders"
    assert ORDERS.key_columns == ("id",)
    catalog = Relation(1, "", "pg_x", "n", ())
    assert (catalog.qualified, catalog.key_columns) == ("pg_catalog.pg_x", ())


@pytest.mark.parametrize("msg", ALL, ids=lambda m: chr(m[0]))
def test_every_truncation_is_a_protocol_error(msg: bytes) -> None:
    for n in range(len(msg)):
        with pytest.raises(ProtocolError):
            parse_message(msg[:n])
    with pytest.raises(ProtocolError, match="trailing"):
        parse_message(msg + b"\0")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"Z\0\0", r"unknown pgoutput message tag b'Z' at byte offset 0"),
        (b"S" + b"\0" * 8, "unknown pgoutput message tag"),  # streaming is protocol 2
        (RELATION.replace(b"d\x00\x03", b"x\x00\x03"), "unknown replica identity 'x'"),
        (RELATION.replace(b"d\x00\x03", b"d\xff\xff"), "negative column count"),
        (RELATION.replace(b"orders", b"ord\xffrs"), "relation name: not UTF-8"),
        (b"Y" + struct.pack(">I", 1) + b"no terminator", "terminating zero byte"),
        (INSERT.replace(b"N", b"X", 1), "expected 'N'"),
        (b"I" + struct.pack(">I", 1) + b"N" + struct.pack(">h", -1), "negative tuple column"),
        (b"I" + struct.pack(">I", 1) + b"N" + struct.pack(">h", 1) + b"q", "kind b'q'"),
        (b"I" + struct.pack(">I", 1) + b"N\0\x01b\0\0\0\x01x", "binary value in tuple column 0"),
        (b"I" + struct.pack(">I", 1) + b"N\0\x01t\xff\xff\xff\xff", "truncated column 0"),
        (b"I" + struct.pack(">I", 1) + b"N\0\x01t\0\0\0\x09abc", r"truncated column 0 \(9 bytes"),
        (UPDATE_PLAIN.replace(b"N", b"Q", 1), "expected 'K', 'O' or 'N'"),
        (UPDATE_KEY.replace(b"N\0\x03", b"K\0\x03"), "expected 'K', 'O' or 'N'"),
        (DELETE_KEY.replace(b"K", b"N"), "expected 'K' or 'O'"),
        (b"T" + struct.pack(">iB", 1_000_000, 0), "relation count 1000000 does not fit"),
        (b"T" + struct.pack(">iB", -1, 0), "relation count -1"),
        (b"M\x00" + struct.pack(">Q", 1) + s("p") + struct.pack(">i", -3), "truncated content"),
    ],
)
def test_malformed_messages(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_message(data)


def test_not_bytes() -> None:
    with pytest.raises(ProtocolError, match="must be bytes, not str"):
        parse_message("B")  # type: ignore[arg-type]


@given(st.binary(max_size=64))
def test_random_bytes_parse_or_raise_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_message(data)


@given(st.sampled_from(ALL), st.data())
def test_mutated_messages_parse_or_raise_protocol_error(msg: bytes, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(msg) - 1))
    byte = data.draw(st.integers(0, 255))
    with contextlib.suppress(ProtocolError):
        parse_message(msg[:i] + bytes([byte]) + msg[i + 1 :])


# ---------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("oid", "text", "expected"),
    [
        (21, "-32768", -32768),
        (20, "9223372036854775807", 9223372036854775807),
        (26, "4294967295", 4294967295),
        (5069, "18446744073709551615", 18446744073709551615),
        (700, "1.1", 1.1),
        (701, "-1.5e+300", -1.5e300),
        (701, "5e-324", 5e-324),
        (701, "-0", -0.0),
        (701, "NaN", "NaN"),
        (700, "Infinity", "Infinity"),
        (701, "-Infinity", "-Infinity"),
        (1700, "12345678901234567.89", "12345678901234567.89"),
        (1700, "-0.000000000000000000001", "-0.000000000000000000001"),
        (1700, "NaN", "NaN"),
        (1700, "-Infinity", "-Infinity"),
        (16, "t", True),
        (16, "f", False),
        (17, "\\x", ""),
        (17, "\\x00ff10", "AP8Q"),
        (17, "\\000\\377a\\\\", "AP9hXA=="),  # bytea_output=escape read too
        (1082, "2024-02-29", "2024-02-29"),
        (1082, "0044-03-15 BC", "0044-03-15 BC"),
        (1082, "-infinity", "-infinity"),
        (1082, "275760-09-13", "275760-09-13"),
        (1114, "2024-02-29 12:34:56", "2024-02-29T12:34:56"),
        (1114, "2024-02-29 12:34:56.000001", "2024-02-29T12:34:56.000001"),
        (1114, "0044-03-15 10:00:00 BC", "0044-03-15T10:00:00 BC"),
        (1114, "infinity", "infinity"),
        (1184, "2024-02-29 12:34:56.5+00", "2024-02-29T12:34:56.5Z"),
        (1184, "0044-03-15 10:00:00+00 BC", "0044-03-15T10:00:00Z BC"),
        (1184, "-infinity", "-infinity"),
        (1083, "12:34:56.5", "12:34:56.5"),
        (1266, "12:34:56+05:30", "12:34:56+05:30"),
        (1186, "P1Y2M3DT4H5M6.5S", "P1Y2M3DT4H5M6.5S"),
        (1186, "P-1DT-2H", "P-1DT-2H"),
        (1186, "PT0S", "PT0S"),
        (22, "1 2 -3", [1, 2, -3]),
        (30, "", []),
        (114, '{"a": [1, 2.5, null, true]}', {"a": [1, 2.5, None, True]}),
        (25, "it's\n\t\u00e9", "it's\n\t\u00e9"),
        (1042, "ab   ", "ab   "),
        (2950, "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        (790, "$1,234.50", "$1,234.50"),
        (3904, "[1,5)", "[1,5)"),
        (2249, "(1,x)", "(1,x)"),  # record: as printed
        (99999, "anything", "anything"),  # unknown OID, no lookup: as printed
        (1007, "[0:1]={1,NULL}", [1, None]),
        (1231, "{1.10,NaN}", ["1.10", "NaN"]),
        (1022, "{NaN,1.5,-Infinity}", ["NaN", 1.5, "-Infinity"]),
        (1001, '{"\\\\x00ff",NULL}', ["AP8=", None]),
        (1185, '{"2024-01-01 00:00:00+00"}', ["2024-01-01T00:00:00Z"]),
        (1020, "{(1,1),(0,0);(2,2),(1,1)}", ["(1,1),(0,0)", "(2,2),(1,1)"]),
        (1017, '{"(1,2)","(3,4)"}', ["(1,2)", "(3,4)"]),
        (3807, '{"{\\"a\\": 1}",null}', [{"a": 1}, None]),
        (1000, "{{t,f},{NULL,t}}", [[True, False], [None, True]]),
    ],
)
def test_values(oid: int, text: str, expected: Any) -> None:
    got = ValueDecoder().value(oid, text.encode())
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    ("oid", "text", "match"),
    [
        (23, "1_000", "not an integer"),
        (23, "\u0661\u0662", "not an integer"),  # Arabic-Indic digits int() would take
        (23, " 12", "not an integer"),
        (23, "1" * 30, "not an integer"),
        (701, "nan", "not a float"),
        (701, "1_0.5", "not a float"),
        (1700, "1e5", "not a numeric"),
        (16, "true", "not 't' or 'f'"),
        (17, "\\x0", "malformed hex bytea"),
        (17, "\\xzz", "malformed hex bytea"),
        (17, "\\9", "malformed escape-format bytea"),
        (1082, "02/29/2024", "DateStyle=ISO"),
        (1114, "Thu Feb 29 12:34:56 2024", "DateStyle=ISO"),
        (1184, "2024-02-29 12:34:56+02", r"offset \+02, not UTC \(is TimeZone=UTC\?\)"),
        (1184, "2024-02-29 12:34:56", "DateStyle=ISO"),
        (1186, "1 day 02:00:00", "IntervalStyle=iso_8601"),
        (114, "{", "invalid JSON"),
        (114, "NaN", "NaN is not JSON"),
        (114, "[" * 100_000 + "]" * 100_000, "nested deeper"),
        (1007, "{1,2", "malformed array"),
        (1007, "{1,,2}", "unexpected ','"),
        (1007, "{1,x}", "type 1007: not an integer"),
    ],
)
def test_bad_values_name_the_type_and_the_setting(oid: int, text: str, match: str) -> None:
    with pytest.raises(ValueDecodeError, match=match) as e:
        ValueDecoder().value(oid, text.encode())
    assert f"type {oid}" in str(e.value)


def test_value_that_is_not_utf8() -> None:
    with pytest.raises(ValueDecodeError, match="type 25: value is not UTF-8"):
        ValueDecoder().value(25, b"\xff")


# ---------------------------------------------------------------- types through lookup

TYPES = {
    20000: PgType(20000, "mood", "E", 0, 0),
    20001: PgType(20001, "_mood", "A", 20000, 0),
    20002: PgType(20002, "posint", "D", 0, 23),
    20003: PgType(20003, "_posint", "A", 20002, 0),
    20004: PgType(20004, "boxdom", "D", 0, 603),
    20005: PgType(20005, "_boxdom", "A", 20004, 0),
    20006: PgType(20006, "intarr", "D", 0, 1007),
    20007: PgType(20007, "small", "D", 0, 20002),  # a domain over a domain
    20008: PgType(20008, "loop", "D", 0, 20008),
    20009: PgType(20009, "citext", "S", 0, 0),
    20010: PgType(20010, "pair", "C", 0, 0),
}


def test_user_types_resolved_once_through_lookup() -> None:
    calls: list[int] = []

    def lookup(oid: int) -> PgType | None:
        calls.append(oid)
        return TYPES.get(oid)

    d = ValueDecoder(lookup)
    assert d.value(20000, b"happy") == "happy"
    assert d.value(20001, b'{sad,"happy, \\"really\\""}') == ["sad", 'happy, "really"']
    assert d.value(20002, b"5") == 5
    assert d.value(20003, b"{1,NULL}") == [1, None]
    assert d.value(20004, b"(1,1),(0,0)") == "(1,1),(0,0)"
    assert d.value(20005, b"{(1,1),(0,0);(2,2),(1,1)}") == ["(1,1),(0,0)", "(2,2),(1,1)"]
    assert d.value(20006, b"{{1},{2}}") == [[1], [2]]
    assert d.value(20007, b"7") == 7
    assert d.value(20009, b"MiXeD") == "MiXeD"
    assert d.value(20010, b'(1,"x y")') == '(1,"x y")'
    assert d.value(30000, b"?") == "?"  # the lookup does not know it: as printed
    for _ in range(3):
        d.value(20001, b"{ok}")
        d.value(30000, b"?")
    assert sorted(calls) == sorted(set(calls))  # one lookup per OID, also for unknown ones
    with pytest.raises(ValueDecodeError, match="type 20008: .*too deep"):
        d.value(20008, b"1")


def test_pg_type_from_a_catalog_row() -> None:
    assert PgType.from_row((20002, "posint", "d", "N", 0, 23)) == PgType(
        20002, "posint", "D", 0, 23
    )
    assert PgType.from_row((1007, "_int4", "b", "A", 23, 0)) == PgType(1007, "_int4", "A", 23, 0)
    # a non-domain date/time type keeps category 'D' but has no base type
    assert PgType.from_row((20011, "t", "b", "D", 0, 0)).base_oid == 0
    assert "FROM pg_type WHERE oid = %s" in ValueDecoder.TYPE_QUERY


def test_row_leaves_unchanged_toast_out() -> None:
    d = ValueDecoder()
    (new,) = [parse_message(UPDATE_PLAIN).new]  # type: ignore[union-attr]
    assert d.row(ORDERS, new) == ({"id": 1, "name": "b"}, ("note",))
    assert d.row(ORDERS, (b"1", None, b"")) == ({"id": 1, "name": None, "note": ""}, ())
    with pytest.raises(ProtocolError, match="public.orders: tuple has 2 columns"):
        d.row(ORDERS, (b"1", None))
    with pytest.raises(ValueDecodeError, match=r"public\.orders\.id: type 23: not an integer"):
        d.row(ORDERS, (b"x", None, None))


# ---------------------------------------------------------------- arrays


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{}", []),
        ("{a,b}", ["a", "b"]),
        ('{NULL,null,NuLl,"NULL",\\NULL}', [None, None, None, "NULL", "NULL"]),
        ('{"",""}', ["", ""]),
        ('{"a,b","{x}","q\\"q","back\\\\slash"}', ["a,b", "{x}", 'q"q', "back\\slash"]),
        ("{ a b , c }", ["a b", "c"]),
        ("{a\\ ,\\ b}", ["a ", " b"]),
        ("{{1,2},{3,4}}", [["1", "2"], ["3", "4"]]),
        ("[0:1][-1:0]={{1,2},{3,4}}", [["1", "2"], ["3", "4"]]),
        ("{{{{{{1}}}}}}", [[[[[["1"]]]]]]),
        ("{a\u00a0,\u2003b}", ["a\u00a0", "\u2003b"]),  # not PostgreSQL whitespace
        (' { "x" , NULL } ', ["x", None]),
    ],
)
def test_array_text(text: str, expected: list[Any]) -> None:
    assert parse_array(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "malformed array"),
        ("1,2", "starts with '{'"),
        ("{1,2", "malformed array"),
        ("{1,2}}", "malformed array"),
        ("{1,2} x", "malformed array"),
        ("{,1}", "unexpected ','"),
        ("{1,}", "unexpected '}'"),
        ("{1 {2}}", "unexpected '{'"),
        ('{a"b}', "malformed array"),
        ('{"a}', "malformed array"),
        ("{{1},2}", "mixed"),
        ("{{1,2},{3}}", "different sizes"),
        ("{{{{{{{1}}}}}}}", "deeper than 6"),
        ("[1:2={1}", "starts with '{'"),
        ("}", "starts with '{'"),
    ],
)
def test_bad_array_text(text: str, match: str) -> None:
    with pytest.raises(ValueDecodeError, match=match):
        parse_array(text)


def array_out(value: Any, delim: str = ",") -> str:
    """PostgreSQL's array_out: quote what is empty, NULL, or holds special characters (its
    whitespace is ASCII only: a no-break space stays unquoted)."""
    if isinstance(value, list):
        return "{" + delim.join(array_out(v, delim) for v in value) + "}"
    if value is None:
        return "NULL"
    if value == "" or value.upper() == "NULL" or re.search(rf'[{{}}"\\ \t\n\r\v\f{delim}]', value):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


elements = st.none() | st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=8)


def rectangular(depth: int) -> st.SearchStrategy[list[Any]]:
    if depth == 1:
        return st.lists(elements, min_size=1, max_size=4)
    return st.integers(1, 3).flatmap(
        lambda n: st.lists(rectangular(depth - 1), min_size=n, max_size=n).filter(
            lambda subs: len({json.dumps(_shape(s)) for s in subs}) == 1
        )
    )


def _shape(value: Any) -> list[int]:
    return [len(value), *_shape(value[0])] if isinstance(value, list) else []


@given(st.integers(1, 3).flatmap(rectangular), st.sampled_from([",", ";"]))
def test_array_text_round_trips(value: list[Any], delim: str) -> None:
    assert parse_array(array_out(value, delim), delim) == value


# ---------------------------------------------------------------- exact JSON


@pytest.mark.parametrize(
    ("text", "kinds"),
    [
        ("[1,-7,2.5,0.1,1e+22]", (int, int, float, float, float)),
        ("[1.10,1e5,-0,1E+2,1e400,-0.0e0]", (JsonNumber,) * 6),
        ("[" + "9" * 5000 + "]", (JsonNumber,)),  # past Python's int digits limit
        ("[12345678901234567890123]", (int,)),
    ],
)
def test_json_numbers_are_exact(text: str, kinds: tuple[type, ...]) -> None:
    value = parse_json(text)
    assert tuple(type(v) for v in value) == kinds
    assert dumps(value) == text


def test_json_number_value_and_fallback() -> None:
    n = JsonNumber("1.10")
    assert n == Decimal("1.1") and str(n) == "1.10" and repr(n) == "JsonNumber('1.10')"
    # json.dumps(default=str), as used for other payloads, keeps the literal (as a string)
    assert json.dumps({"a": n}, default=str) == '{"a": "1.10"}'


def test_dumps_is_json_dumps_without_json_numbers() -> None:
    value = {"a": [1, 2.5, None, True, "é\n"], "b": {"c": "x"}, "d": Decimal("1.5")}
    assert dumps(value) == json.dumps(value, separators=(",", ":"), default=str)
    mixed = {"k\u00e9": [JsonNumber("1.0"), {"z": JsonNumber("-0")}, [], {}], "n": None}
    assert dumps(mixed) == '{"k\\u00e9":[1.0,{"z":-0},[],{}],"n":null}'


def test_dumps_deep_nesting_without_recursion() -> None:
    depth = 900
    text = "[" * depth + "1.10" + "]" * depth
    assert dumps(parse_json(text)) == text


json_number = st.from_regex(
    r"-?(0|[1-9][0-9]{0,25})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,3})?", fullmatch=True
)
json_values = st.recursive(
    json_number | st.booleans().map(lambda b: "true" if b else "false") | st.just("null")
    | st.text(max_size=5).map(lambda t: json.dumps(t)),
    lambda inner: st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
    | st.dictionaries(st.text(max_size=4), inner, max_size=4).map(
        lambda d: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in d.items()) + "}"
    ),
    max_leaves=12,
)  # fmt: skip


@given(json_values)
def test_json_text_round_trips_byte_for_byte(text: str) -> None:
    assert dumps(parse_json(text)) == text


def test_json_as_text_keeps_a_json_null_apart_from_sql_null():
    as_value, as_text = ValueDecoder(), ValueDecoder(json_text=True)
    assert as_value.value(3802, b"null") is None  # the parsed value: null, as SQL NULL reads
    assert as_text.value(3802, b"null") == "null"
    assert as_text.value(114, b'{"a": 1.10}') == '{"a": 1.10}'
    assert as_text.value(3807, b'{"{\\"a\\": 1}",null,"null"}') == ['{"a": 1}', None, "null"]
