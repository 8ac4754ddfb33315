"""GreptimeDB sink without a server: InfluxDB line protocol escaping, types, precision,
the exact write request (as ``requests`` prepares it), the mapping of responses and
``requests`` exceptions, and config validation. One test uses a closed loopback port
(no server) to check that an unreachable server is transient."""

from __future__ import annotations

import datetime as dt
import decimal
import subprocess
import sys
from typing import Any

import pyarrow as pa
import pytest
import requests

from conveyor.core.errors import BatchRejected, ConfigError, PermanentSinkError, TransientSinkError
from conveyor.sinks import build_sink
from conveyor.sinks.base import iter_records
from conveyor.sinks.greptimedb import (
    GreptimeDBSinkConfig,
    basic_auth,
    build_lines,
    convert_epoch,
    escape_key,
    escape_measurement,
    field_value,
    format_float,
    map_request_error,
    map_response,
    string_field,
    timestamp_value,
    to_precision,
    write_request,
)
from tests.sinks.contract import BASE_TS, closed_port, make_batch

BASE: dict[str, Any] = {
    "type": "greptimedb",
    "url": "http://127.0.0.1:4000",
    "measurement": "orders",
}


def cfg(**kw: Any) -> GreptimeDBSinkConfig:
    return GreptimeDBSinkConfig.model_validate({**BASE, **kw})


def test_importing_the_module_does_not_import_requests() -> None:
    code = "import sys, conveyor.sinks.greptimedb; assert 'requests' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- escaping -------------------------------------------------------------------------------------


def test_measurement_escapes_commas_spaces_and_backslashes_not_equals() -> None:
    assert escape_measurement("cpu load,total=1") == "cpu\\ load\\,total=1"
    assert escape_measurement("a\\b") == "a\\\\b"
    assert escape_measurement("ends with\\") == "ends\\ with\\\\"


def test_keys_and_tag_values_escape_commas_equals_spaces_and_backslashes() -> None:
    assert escape_key("host name") == "host\\ name"
    assert escape_key("a,b=c") == "a\\,b\\=c"
    assert escape_key("C:\\path\\") == "C:\\\\path\\\\"
    assert escape_key('say "hi"') == 'say\\ "hi"'  # quotes are literal in keys and tags


def test_string_fields_escape_quotes_and_backslashes_only() -> None:
    assert string_field('say "hi", a=b c') == '"say \\"hi\\", a=b c"'
    assert string_field("back\\slash\\") == '"back\\\\slash\\\\"'
    assert string_field("") == '""'
    assert string_field("tab\there") == '"tab\there"'  # a tab is fine inside quotes


@pytest.mark.parametrize("text", ["two\nlines", "cr\rhere", "crlf\r\nhere"])
def test_newlines_are_rejected_by_default(text: str) -> None:
    with pytest.raises(ValueError, match="line break"):
        string_field(text)
    with pytest.raises(ValueError, match="line break"):
        escape_key(text)
    with pytest.raises(ValueError, match="line break"):
        escape_measurement(text)


def test_newlines_replaced_or_kept() -> None:
    assert string_field("a\r\nb\nc", "replace") == '"a b c"'
    assert escape_key("a\nb\tc", "replace") == "a\\ b\\ c"
    assert string_field('a\n"b"', "keep") == '"a\n\\"b\\""'
    with pytest.raises(ValueError):
        escape_key("a\nb", "keep")  # a tag can never hold a raw newline
    with pytest.raises(ValueError):
        escape_key("a\tb")  # tabs end a tag in GreptimeDB's parser


# -- types ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (True, "true"),
        (False, "false"),
        (0, "0i"),
        (-42, "-42i"),
        (2**63 - 1, "9223372036854775807i"),
        (1.5, "1.5"),
        (2.0, "2.0"),
        (-0.25, "-0.25"),
        (1e16, "1.0e+16"),
        (-1e-07, "-1.0e-07"),
        (1.5e-07, "1.5e-07"),
        (decimal.Decimal("12.50"), "12.5"),
        ("x", '"x"'),
        (b"\xff\x00", '"base64:/wA="'),
        (dt.date(2026, 1, 2), '"2026-01-02"'),
        ({"a": [1, "b"]}, '"{\\"a\\":[1,\\"b\\"]}"'),
    ],
)
def test_field_value_types(value: Any, text: str) -> None:
    assert field_value(value) == text


def test_unrepresentable_field_values() -> None:
    assert field_value(None) is None
    for bad in (float("nan"), float("inf"), 2**63, decimal.Decimal("NaN")):
        with pytest.raises(ValueError):
            field_value(bad)
    assert format_float(3.0) == "3.0"


# -- precision --------------------------------------------------------------------------------------


def test_datetime_to_each_precision() -> None:
    ts = dt.datetime(2026, 11, 1, 12, 0, 0, 123456, tzinfo=dt.timezone.utc)
    assert to_precision(ts, "s") == 1793534400
    assert to_precision(ts, "ms") == 1793534400123
    assert to_precision(ts, "us") == 1793534400123456
    assert to_precision(ts, "ns") == 1793534400123456000
    assert to_precision(ts.replace(tzinfo=None), "ms") == 1793534400123  # naive = UTC
    before_epoch = dt.datetime(1969, 12, 31, 23, 59, 59, 500000, tzinfo=dt.timezone.utc)
    assert to_precision(before_epoch, "s") == -1  # floor, not toward zero


def test_numeric_timestamps_between_units() -> None:
    assert convert_epoch(1793534400123, "ms", "ns") == 1793534400123000000
    assert convert_epoch(1793534400123456789, "ns", "ms") == 1793534400123
    assert convert_epoch(1793534400, "s", "us") == 1793534400000000
    assert convert_epoch(1793534400.5, "s", "ms") == 1793534400500
    assert timestamp_value("2026-11-01T12:00:00.007Z", "ms", "ms") == 1793534400007
    assert timestamp_value(dt.date(1970, 1, 2), "ms", "s") == 86400
    with pytest.raises(ValueError):
        timestamp_value(None, "ms", "ms")


# -- whole lines --------------------------------------------------------------------------------


def test_exact_lines_for_a_batch() -> None:
    config = cfg(tags={"topic": "$topic", "msg key": "$key"})
    plan = build_lines(iter_records(make_batch(2, start=7)), config, ["id", "name", "amount"])
    assert plan.lines == [
        'orders,msg\\ key=k7,topic=orders id=7i,name="name 7",amount=10.5 1793534400007',
        'orders,msg\\ key=k8,topic=orders id=8i,name="name 8",amount=12.0 1793534400008',
    ]
    assert plan.rows == [0, 1]
    assert plan.body().endswith(b"\n") and plan.body().count(b"\n") == 2


def test_fields_timestamp_column_and_precision() -> None:
    batch = pa.table(
        {
            "host": pa.array(["a b", ""]),
            "load": pa.array([0.5, None]),
            "ok": pa.array([True, False]),
            "at": pa.array([1793534400123, 1793534400124], pa.int64()),
        }
    )
    config = cfg(
        measurement="cpu,1",
        tags={"host": "host"},
        fields={"load": "load", "up": "ok", "off": "$offset"},
        timestamp="at",
        timestamp_unit="ms",
        precision="s",
    )
    plan = build_lines(iter_records(batch), config, ["host", "load", "ok", "at"])
    assert plan.lines == [
        "cpu\\,1,host=a\\ b load=0.5,up=true,off=0i 1793534400",
        "cpu\\,1 up=false,off=1i 1793534400",  # empty tag left out, null field left out
    ]


def test_default_fields_skip_tags_and_timestamp_column() -> None:
    batch = pa.table({"host": ["h"], "v": [1], "at": [5]})
    plan = build_lines(
        iter_records(batch),
        cfg(tags={"host": "host"}, timestamp="at", timestamp_unit="s", precision="ms"),
        ["host", "v", "at"],
    )
    assert plan.lines == ["orders,host=h v=1i 5000"]


def test_bad_rows_are_data_errors_and_the_rest_is_sent() -> None:
    batch = make_batch(4, names={1: "two\nlines"}, amounts={2: float("nan")})
    plan = build_lines(iter_records(batch), cfg(), ["id", "name", "amount"])
    assert plan.rows == [0, 3]
    assert [f.index for f in plan.failures] == [1, 2]
    assert "line break" in plan.failures[0].message and "NaN" in plan.failures[1].message


def test_a_row_without_fields_is_a_data_error() -> None:
    batch = pa.table(
        {
            "v": pa.array([None], pa.int64()),
            "__timestamp": pa.array([BASE_TS], pa.timestamp("ms", tz="UTC")),
        }
    )
    plan = build_lines(iter_records(batch), cfg(), ["v"])
    assert plan.lines == [] and "at least one field" in plan.failures[0].message


def test_measurement_template() -> None:
    plan = build_lines(
        iter_records(make_batch(1, topic="web logs")), cfg(measurement="{topic}_m"), ["id"]
    )
    assert plan.lines[0].startswith("web\\ logs_m ")


# -- the request ----------------------------------------------------------------------------------


def test_write_request_as_requests_prepares_it() -> None:
    config = cfg(
        url="https://greptime.example.com:4000/",
        precision="us",
        username="writer",
        password="pw:1",
    ).model_copy(update={"database": "metrics db"})  # a name the rules refuse: the query encodes it
    prepared = write_request(config, b"m v=1i 1\n").prepare()
    assert prepared.method == "POST"
    assert (
        prepared.url
        == "https://greptime.example.com:4000/v1/influxdb/api/v2/write?db=metrics+db&precision=us"
    )
    assert prepared.headers["Authorization"] == "token writer:pw:1"
    assert prepared.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert prepared.body == b"m v=1i 1\n"


def test_token_auth_and_basic_auth_for_the_sql_check() -> None:
    config = cfg(token="writer:s3cret")
    assert write_request(config, b"").prepare().headers["Authorization"] == "token writer:s3cret"
    assert basic_auth(config) == ("writer", "s3cret")
    assert basic_auth(cfg(username="u", password="p")) == ("u", "p")
    assert basic_auth(cfg()) is None
    assert "Authorization" not in write_request(cfg(), b"").prepare().headers


# -- responses and errors ----------------------------------------------------------------------------


def test_success() -> None:
    assert map_response(204, {}, "") is None


def test_parse_errors_are_bisected() -> None:
    e = map_response(
        400,
        {"x-greptime-err-code": "1004"},
        '{"error":"Failed to parse line protocol: invalid field value"}',
    )
    assert isinstance(e, BatchRejected) and "invalid field value" in str(e)
    assert isinstance(map_response(413, {}, "payload too large"), BatchRejected)


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        (401, {"x-greptime-err-code": "7002"}, '{"error":"Username and password does not match"}'),
        (403, {}, '{"error":"Access denied"}'),
        (400, {"x-greptime-err-code": "4004"}, '{"error":"Database not found: greptime.nope"}'),
        (400, {}, '{"code":4004,"error":"Database not found: greptime.nope"}'),
        (404, {}, "Not Found"),
    ],
)
def test_refusals_are_permanent(status: int, headers: dict[str, str], body: str) -> None:
    assert isinstance(map_response(status, headers, body), PermanentSinkError)


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (429, {}),
        (500, {}),
        (502, {}),
        (503, {}),
        (504, {}),
        (503, {"x-greptime-err-code": "4008"}),
        (401, {"x-greptime-err-code": "4007"}),
    ],
)
def test_overload_and_server_errors_are_transient(status: int, headers: dict[str, str]) -> None:
    assert isinstance(map_response(status, headers, '{"error":"busy"}'), TransientSinkError)


def test_requests_exceptions() -> None:
    assert isinstance(map_request_error(requests.ConnectionError("refused")), TransientSinkError)
    assert isinstance(map_request_error(requests.Timeout("read timed out")), TransientSinkError)
    assert isinstance(
        map_request_error(
            requests.exceptions.SSLError(
                "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"
            )
        ),
        PermanentSinkError,
    )
    assert isinstance(map_request_error(requests.exceptions.InvalidURL("bad")), PermanentSinkError)
    assert map_request_error(KeyError("x")) is None


def test_an_unreachable_server_is_transient() -> None:
    sink = build_sink({**BASE, "url": f"http://127.0.0.1:{closed_port()}", "timeout_s": 2})
    try:
        with pytest.raises(TransientSinkError):
            sink.init_sink()
            sink.send_batch(make_batch(3))
    finally:
        sink.cleanup_sink()
        sink.cleanup_sink()


# -- config ------------------------------------------------------------------------------------------


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"url": "127.0.0.1:4000"}, "url"),
    ({"url": "http://u:p@127.0.0.1:4000"}, "url"),
    ({"measurement": ""}, "measurement"),
    ({"measurement": "m_{partition}"}, "measurement"),
    ({"precision": "m"}, "precision"),
    ({"timestamp_unit": "h"}, "timestamp_unit"),
    ({"newlines": "escape"}, "newlines"),
    ({"tags": {"t": "$headers"}}, "tags"),
    ({"fields": {}}, "fields"),
    ({"tags": {"x": "a"}, "fields": {"x": "a"}}, "fields"),
    ({"timestamp": "$offset"}, "timestamp"),
    ({"username": "u"}, "password"),
    ({"username": "u", "password": "p", "token": "u:p"}, "token"),
    ({"tls_ca_file": "/ca.pem"}, "tls_ca_file"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"database": "a&b"}, "database"),
]


@pytest.mark.parametrize(("override", "field_name"), BAD_FIELDS)
def test_validate_rejects_each_bad_field(override: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_sink({**BASE, **override})
    assert field_name in str(err.value)


def test_rejects_unknown_field() -> None:
    with pytest.raises(ConfigError, match="no_such_option"):
        build_sink({**BASE, "no_such_option": 1})


def test_secrets_are_redacted() -> None:
    sink = build_sink({**BASE, "username": "u", "password": "s3cret"})
    assert "s3cret" not in str(sink.config.redacted())
    assert sink.config.asset_key_path() == ["greptimedb", "public", "orders"]
