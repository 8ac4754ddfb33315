"""Debezium's encodings, without servers (issue 49): ``postgres_cdc``'s codecs
(``conveyor.sources.debezium``) give the values the real Debezium 3.6 engine wrote for the
same PostgreSQL values (taken from its events; ``test_cdc_debezium_parity.py`` compares
whole events live), the sink side (``conveyor.formats.debezium``) reads each back as the
plain value PostgreSQL reads, hostile encoded values fail with their field named, and the
settings refuse what does not fit their format."""

from __future__ import annotations

import base64
import json
from typing import Any

import pyarrow as pa
import pytest

from conveyor.core.errors import ConfigError
from conveyor.formats import debezium as fdbz
from conveyor.sources import build_source
from conveyor.sources import debezium as dbz
from conveyor.spark.envelopes import plain_payloads

DEFAULT = dbz.Modes()
STRINGS = dbz.Modes(decimal="string", time="isostring", binary="base64", interval="string")
CONNECT = dbz.Modes(decimal="double", time="connect", binary="hex")
NUMERIC_12_3 = 12 << 16 | 3 + 4  # numeric(12,3)'s typmod

# (type, modes, the value as Conveyor decodes it, what Debezium wrote)
GOLDEN: list[tuple[dbz.ColumnType, dbz.Modes, Any, Any]] = [
    (dbz.ColumnType(1700, NUMERIC_12_3), DEFAULT, "12.500", "MNQ="),
    (dbz.ColumnType(1700, NUMERIC_12_3), DEFAULT, "-0.500", "/gw="),
    (dbz.ColumnType(1700, NUMERIC_12_3), DEFAULT, "NaN", None),
    (dbz.ColumnType(1700, NUMERIC_12_3), STRINGS, "NaN", "NAN"),
    (dbz.ColumnType(1700, NUMERIC_12_3), STRINGS, "Infinity", "POSITIVE_INFINITY"),
    (dbz.ColumnType(1700, NUMERIC_12_3), CONNECT, "12.500", 12.5),
    (dbz.ColumnType(1700), DEFAULT, "3.14159", {"scale": 5, "value": "BMsv"}),
    (dbz.ColumnType(1700), DEFAULT, "1.50", {"scale": 1, "value": "Dw=="}),
    (dbz.ColumnType(1700), DEFAULT, "100", {"scale": 0, "value": "ZA=="}),
    (dbz.ColumnType(1700), DEFAULT, "-0.000100", {"scale": 4, "value": "/w=="}),
    (
        dbz.ColumnType(1700),
        DEFAULT,
        "123456789012345678901234567890.123",
        {"scale": 3, "value": "BhY+ZlvrfKai4aZCRMs="},
    ),
    (dbz.ColumnType(1700), DEFAULT, "Infinity", None),
    (dbz.ColumnType(790), DEFAULT, "-$12.34", "+y4="),
    (dbz.ColumnType(790), DEFAULT, "$1,234,567.89", "B1vNFQ=="),
    (dbz.ColumnType(790), STRINGS, "$0.00", "0.00"),
    (dbz.ColumnType(1082), DEFAULT, "2024-01-31", 19753),
    (dbz.ColumnType(1082), DEFAULT, "0044-03-15 BC", -735160),
    (dbz.ColumnType(1082), DEFAULT, "10000-01-01", 2932897),
    (dbz.ColumnType(1082), DEFAULT, "infinity", -2147472692),
    (dbz.ColumnType(1082), DEFAULT, "-infinity", -2147472691),
    (dbz.ColumnType(1082), STRINGS, "0044-03-15 BC", "-0043-03-15Z"),
    (dbz.ColumnType(1082), STRINGS, "10000-01-01", "+10000-01-01Z"),
    (dbz.ColumnType(1082), STRINGS, "infinity", "-5877611-06-21Z"),
    (dbz.ColumnType(1083), DEFAULT, "12:00:00.5", 43200500000),
    (dbz.ColumnType(1083), DEFAULT, "24:00:00", 86400000000),
    (dbz.ColumnType(1083, 3), DEFAULT, "13:14:15.123", 47655123),
    (dbz.ColumnType(1083, 0), dbz.Modes(time="adaptive_time_microseconds"), "12:34:56", 45296000000),
    (dbz.ColumnType(1083), STRINGS, "24:00:00", "00:00:00Z"),
    (dbz.ColumnType(1083), CONNECT, "12:34:56.123456", 45296123),
    (dbz.ColumnType(1266), DEFAULT, "01:00:00+02", "23:00:00Z"),
    (dbz.ColumnType(1266), DEFAULT, "12:00:00.123456-05:30", "17:30:00.123456Z"),
    (dbz.ColumnType(1114), DEFAULT, "2024-01-31T12:00:00.5", 1706702400500000),
    (dbz.ColumnType(1114, 3), DEFAULT, "2024-01-31T12:00:00.123", 1706702400123),
    (dbz.ColumnType(1114), DEFAULT, "0044-03-15T12:00:00 BC", -63517780800000000),
    (dbz.ColumnType(1114), DEFAULT, "infinity", 9223372036825200000),
    (dbz.ColumnType(1114), DEFAULT, "-infinity", -9223372036832400000),
    (dbz.ColumnType(1114), CONNECT, "infinity", 9223372036825200),
    (dbz.ColumnType(1114), STRINGS, "2024-01-31T12:00:00.5", "2024-01-31T12:00:00.5Z"),
    (dbz.ColumnType(1114), STRINGS, "infinity", "+294247-01-10T04:00:25.2Z"),
    (dbz.ColumnType(1114), STRINGS, "-infinity", "-290308-12-21T19:59:27.6Z"),
    (dbz.ColumnType(1184), DEFAULT, "2024-01-31T10:00:00.5Z", "2024-01-31T10:00:00.500000Z"),
    (dbz.ColumnType(1184, 0), DEFAULT, "2024-01-01T01:02:03Z", "2024-01-01T01:02:03Z"),
    (dbz.ColumnType(1184, 3), DEFAULT, "2024-01-01T01:02:03.1Z", "2024-01-01T01:02:03.100Z"),
    (dbz.ColumnType(1184), DEFAULT, "0044-03-15T12:00:00Z BC", "-0043-03-15T12:00:00.000000Z"),
    (dbz.ColumnType(1184), DEFAULT, "infinity", "infinity"),
    (dbz.ColumnType(1186), DEFAULT, "P1Y2M3DT4H5M6.5S", 37091106500000),
    (dbz.ColumnType(1186), DEFAULT, "P-1DT-2H", -93600000000),
    (dbz.ColumnType(1186), DEFAULT, "P-1Y-2M3DT0.000001S", -36557999999999),
    (dbz.ColumnType(1186), DEFAULT, "P1M", 2629800000000),
    (dbz.ColumnType(1186), STRINGS, "P-1DT-2H", "P0Y0M-1DT-2H0M0S"),
    (dbz.ColumnType(1186), STRINGS, "P-1Y-2M3DT0.000001S", "P-1Y-2M3DT0H0M0.000001S"),
    (dbz.ColumnType(1186), STRINGS, "PT0S", "P0Y0M0DT0H0M0S"),
    (dbz.ColumnType(17), DEFAULT, "3q2+7w==", "3q2+7w=="),
    (dbz.ColumnType(17), CONNECT, "3q2+7w==", "deadbeef"),
    (dbz.ColumnType(1560, 4), DEFAULT, "1010", "Cg=="),
    (dbz.ColumnType(1560, 4), DEFAULT, "0000", ""),
    (dbz.ColumnType(1560, 1), DEFAULT, "1", True),
    (dbz.ColumnType(1562), DEFAULT, "101", "BQ=="),
    (
        dbz.ColumnType(600),
        DEFAULT,
        "(1.5,2)",
        {"x": 1.5, "y": 2.0, "wkb": "AQEAAAAAAAAAAAD4PwAAAAAAAABA", "srid": None},
    ),
    (dbz.ColumnType(1231, 6 << 16 | 2 + 4, element=dbz.ColumnType(1700)), DEFAULT, ["1.50", "-2.25", None], ["AJY=", "/x8=", None]),
    (dbz.ColumnType(1182, element=dbz.ColumnType(1082)), DEFAULT, ["2024-01-01", None], [19723, None]),
    (dbz.ColumnType(3802), DEFAULT, '{"a": 1.10}', '{"a": 1.10}'),
]  # fmt: skip


@pytest.mark.parametrize(("column", "modes", "value", "written"), GOLDEN)
def test_a_value_encodes_as_debezium_wrote_it(column, modes, value, written):
    assert dbz.codec(column, modes).encode(value) == written


def test_schemas_as_debezium_wrote_them():
    def schema(t: dbz.ColumnType, modes: dbz.Modes = DEFAULT) -> dict[str, Any]:
        return dbz.codec(t, modes).schema

    assert schema(dbz.ColumnType(1700, NUMERIC_12_3)) == {
        "type": "bytes",
        "name": "org.apache.kafka.connect.data.Decimal",
        "version": 1,
        "parameters": {"scale": "3", "connect.decimal.precision": "12"},
    }
    assert schema(dbz.ColumnType(1700))["name"] == "io.debezium.data.VariableScaleDecimal"
    assert schema(dbz.ColumnType(790))["parameters"] == {"scale": "2"}
    assert schema(dbz.ColumnType(1083, 3))["name"] == "io.debezium.time.Time"
    assert schema(dbz.ColumnType(1083))["name"] == "io.debezium.time.MicroTime"
    assert schema(dbz.ColumnType(1114, 3))["name"] == "io.debezium.time.Timestamp"
    assert schema(dbz.ColumnType(1114), STRINGS)["name"] == "io.debezium.time.IsoTimestamp"
    assert schema(dbz.ColumnType(17), STRINGS) == {"type": "string"}
    assert schema(dbz.ColumnType(1562))["parameters"] == {"length": "2147483647"}
    mood = dbz.ColumnType(99999, labels=("sad", "ok", "happy"))
    assert schema(mood)["parameters"] == {"allowed": "sad,ok,happy"}
    # An enum array's items are not optional, as Debezium builds them; others' are.
    enum_array = dbz.codec(dbz.ColumnType(99998, element=mood), DEFAULT).schema
    assert enum_array["items"]["optional"] is False
    uuid_array = dbz.codec(dbz.ColumnType(2951, element=dbz.ColumnType(2950)), DEFAULT).schema
    assert uuid_array["items"] == {
        "type": "string",
        "optional": True,
        "name": dbz.dbz.UUID,
        "version": 1,
    }


def test_unchanged_toast_placeholders_as_debezium_wrote_them():
    p = "__debezium_unavailable_value"
    bytes_ = list(p.encode())
    assert dbz.codec(dbz.ColumnType(25), DEFAULT).unchanged == p
    assert dbz.codec(dbz.ColumnType(17), DEFAULT).unchanged == base64.b64encode(p.encode()).decode()
    assert dbz.codec(dbz.ColumnType(17), CONNECT).unchanged == p  # hex: the text itself
    assert dbz.codec(dbz.ColumnType(17), STRINGS).unchanged is None  # base64: null
    text_array = dbz.ColumnType(1009, element=dbz.ColumnType(25))
    assert dbz.codec(text_array, DEFAULT).unchanged == [p]
    int_array = dbz.ColumnType(1007, element=dbz.ColumnType(23))
    assert dbz.codec(int_array, DEFAULT).unchanged == bytes_


def test_defaults_are_the_constants_alone():
    assert dbz.default_literal("0") == "0"
    assert dbz.default_literal("'it''s'::text") == "it's"
    assert dbz.default_literal("true") == "t"
    assert dbz.default_literal("'-1'::integer") == "-1"
    assert dbz.default_literal("now()") is None
    assert dbz.default_literal("nextval('t_id_seq'::regclass)") is None
    assert dbz.default_literal(None) is None


# -- the sink side: plain values back ---------------------------------------------------------

# (type, modes, Conveyor's value, the plain value the sink reads back)
PLAIN: list[tuple[dbz.ColumnType, dbz.Modes, Any, Any]] = [
    (dbz.ColumnType(1700, NUMERIC_12_3), DEFAULT, "-0.500", "-0.500"),
    (dbz.ColumnType(1700, 38 << 16 | 10 + 4), DEFAULT, "1234567890123456789012345678.0000000001", "1234567890123456789012345678.0000000001"),
    (dbz.ColumnType(1700), DEFAULT, "123456789012345678901234567890.123", "123456789012345678901234567890.123"),
    (dbz.ColumnType(790), DEFAULT, "-$12.34", "-12.34"),
    (dbz.ColumnType(1082), DEFAULT, "0044-03-15 BC", "0044-03-15 BC"),
    (dbz.ColumnType(1082), DEFAULT, "infinity", "infinity"),
    (dbz.ColumnType(1082), STRINGS, "0044-03-15 BC", "0044-03-15 BC"),
    (dbz.ColumnType(1082), STRINGS, "-infinity", "-infinity"),
    (dbz.ColumnType(1082), CONNECT, "2024-01-31", "2024-01-31"),
    (dbz.ColumnType(1083), DEFAULT, "24:00:00", "24:00:00"),
    (dbz.ColumnType(1083, 3), DEFAULT, "13:14:15.123", "13:14:15.123"),
    (dbz.ColumnType(1083), STRINGS, "12:34:56.123456", "12:34:56.123456"),
    (dbz.ColumnType(1114), DEFAULT, "0044-03-15T12:00:00.25 BC", "0044-03-15T12:00:00.25 BC"),
    (dbz.ColumnType(1114), DEFAULT, "-infinity", "-infinity"),
    (dbz.ColumnType(1114), CONNECT, "infinity", "infinity"),
    (dbz.ColumnType(1114), STRINGS, "10000-01-01T00:00:00", "10000-01-01T00:00:00"),
    (dbz.ColumnType(1114), STRINGS, "infinity", "infinity"),
    (dbz.ColumnType(1184), DEFAULT, "0044-03-15T12:00:00Z BC", "0044-03-15T12:00:00.000000Z BC"),
    (dbz.ColumnType(1184), DEFAULT, "-infinity", "-infinity"),
    (dbz.ColumnType(1184), STRINGS, "10000-01-01T00:00:00Z", "10000-01-01T00:00:00.000000Z"),
    (dbz.ColumnType(1186), DEFAULT, "P-1DT-2H", "PT-93600S"),
    (dbz.ColumnType(1560, 8), DEFAULT, "00000101", "00000101"),
    (dbz.ColumnType(1562), DEFAULT, "0", ""),  # varbit's leading zeros: lost by Debezium
    (dbz.ColumnType(600), DEFAULT, "(-0.5,1e+300)", "(-0.5,1e+300)"),
    (dbz.ColumnType(1182, element=dbz.ColumnType(1082)), DEFAULT, ["2024-01-01", None], ["2024-01-01", None]),
]  # fmt: skip


@pytest.mark.parametrize(("column", "modes", "value", "plain"), PLAIN)
def test_the_sink_reads_an_encoded_value_back_plain(column, modes, value, plain):
    c = dbz.codec(column, modes)
    assert fdbz.plain_value(c.schema, c.encode(value)) == plain


def _event(field: dict[str, Any], value: Any) -> bytes:
    field = {**field, "optional": True, "field": "v"}
    row = {"type": "struct", "fields": [field], "optional": True, "name": "s.public.t.Value"}
    schema = {"type": "struct", "fields": [{**row, "field": "before"}, {**row, "field": "after"}]}
    payload = {"before": None, "after": {"v": value}, "op": "c", "source": {"x": 1}}
    return json.dumps({"schema": schema, "payload": payload}).encode()


def test_plain_payloads_rewrites_debeziums_encodings_and_leaves_the_rest():
    decimal = {"type": "bytes", "name": fdbz.DECIMAL, "parameters": {"scale": "2"}}
    bare = json.dumps({"op": "c", "after": {"v": "AAE="}}).encode()  # no schema: as it is
    not_json = b'{"schema": "org.apache.kafka.connect.data.Decimal" oops'
    values = pa.array([_event(decimal, "AAE="), bare, not_json, None], pa.binary())
    out, failed = plain_payloads(values)
    assert failed == {}
    assert json.loads(out[0].as_py()) == {
        "before": None,
        "after": {"v": "0.01"},
        "op": "c",
        "source": {"x": 1},
    }
    assert out[1:].to_pylist() == [bare, not_json, None]
    untouched = pa.array([bare], pa.binary())
    assert plain_payloads(untouched)[0] is untouched  # nothing to do: the same array


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ({"type": "bytes", "name": fdbz.DECIMAL, "parameters": {"scale": "2"}}, "!!", "after.v"),
        ({"type": "bytes", "name": fdbz.DECIMAL, "parameters": {"scale": "99999"}}, "AAE=", "scale"),
        ({"type": "bytes", "name": fdbz.DECIMAL, "parameters": {}}, "AAE=", "scale"),
        ({"type": "bytes", "name": fdbz.DECIMAL, "parameters": {"scale": "0"}}, base64.b64encode(bytes(9000)).decode(), "bytes"),
        ({"type": "int32", "name": fdbz.DATE}, "2024-01-01", "not an integer"),
        ({"type": "int32", "name": fdbz.DATE}, True, "not an integer"),
        ({"type": "int64", "name": fdbz.MICRO_TIMESTAMP}, 1.5, "not an integer"),
        ({"type": "struct", "name": fdbz.VARIABLE_DECIMAL}, {"scale": 1}, "value"),
        ({"type": "bytes", "name": fdbz.BITS, "parameters": {"length": "x"}}, "AQ==", "Bits"),
    ],
)  # fmt: skip
def test_a_value_that_does_not_fit_its_schema_fails_its_message_naming_it(field, value, why):
    out, failed = plain_payloads(pa.array([_event(field, value)], pa.binary()))
    assert list(failed) == [0]
    assert failed[0].startswith("debezium envelope: after.v: not a ") and why in failed[0]


def test_hostile_payloads_do_not_break_the_batch():
    deep = b'{"schema": {"fields": []}, "payload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    junk = b'"schema" io.debezium.time. \xff\xfe'
    events = [deep, junk, b'{"schema": 1, "payload": 2, "x": "io.debezium.time.Date"}']
    out, failed = plain_payloads(pa.array(events, pa.binary()))
    assert out.to_pylist() == events and failed == {}  # left for the JSON decoding to judge


# -- settings -----------------------------------------------------------------------------


def config(**fields: Any) -> Any:
    return build_source({"type": "postgres_cdc", "url": "postgresql://h/db", **fields}).config


def test_defaults_per_format():
    dbz_config = config(format="debezium")
    assert dbz_config.debezium_values and dbz_config.json_text and dbz_config.skipped == {"t"}
    assert dbz_config.schemas_enable and dbz_config.decimal_handling_mode == "precise"
    plain = config()
    assert not plain.debezium_values and not plain.json_text and plain.skipped == set()
    lossless = config(format="debezium", value_encoding="conveyor")
    assert not lossless.debezium_values and not lossless.json_text
    assert config(format="debezium", skipped_operations=[]).skipped == set()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"decimal_handling_mode": "string"}, "decimal_handling_mode applies to format: debezium"),
        ({"format": "conveyor", "schemas_enable": False}, "schemas_enable applies to format"),
        ({"format": "debezium", "json_as": "value"}, "json_as: value does not fit"),
        (
            {"format": "debezium", "value_encoding": "conveyor", "time_precision_mode": "connect"},
            "time_precision_mode applies to value_encoding: debezium",
        ),
        ({"format": "debezium", "decimal_handling_mode": "exact"}, "decimal_handling_mode"),
        ({"format": "debezium", "skipped_operations": ["x"]}, "skipped_operations"),
        ({"format": "debezium", "unavailable_value_placeholder": "hex:zz"}, "hex digits"),
    ],
)
def test_a_setting_that_does_not_fit_is_refused_naming_it(fields, named):
    with pytest.raises(ConfigError) as e:
        config(**fields)
    assert named in str(e.value) and str(e.value).startswith("source")
