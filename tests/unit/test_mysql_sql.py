"""MySQL sink without a server: identifier quoting, statements, types, values, config, error mapping."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pymysql
import pytest
from pymysql.cursors import RE_INSERT_VALUES

from conveyor.core.errors import ConfigError
from conveyor.sinks import build_sink, parse_sink_config
from conveyor.sinks.mysql import (
    DATA_ERRORS,
    PERMANENT_ERRORS,
    TRANSIENT_ERRORS,
    MySQLSink,
    MySQLSinkConfig,
    classify_mysql_error,
    column_values,
    create_table_statement,
    error_text,
    headers_json,
    identifier_problem,
    insert_statement,
    mysql_type,
    payload_json,
    quote_identifier,
)
from tests.sinks.contract import HEADERS_TYPE, make_batch

BASE = {"type": "mysql", "url": "mysql://root@127.0.0.1:3306/test", "table": "orders"}


@pytest.fixture(autouse=True)
def _secrets_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the clients' options, not the secrets policy (tests/unit/
    test_secrets.py): the operator lets references read any variable."""
    monkeypatch.setenv("CONVEYOR_SECRET_ENV", "*")


def sink(**over: Any) -> MySQLSink:
    s = build_sink({**BASE, **over})
    assert isinstance(s, MySQLSink)
    return s


# -- identifiers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "quoted"),
    [
        ("orders", "`orders`"),
        ("weird`name", "`weird``name`"),
        ("``", "``````"),
        ("a b.c", "`a b.c`"),
        ("`; DROP TABLE x; --", "```; DROP TABLE x; --`"),
        ("ünï", "`ünï`"),
    ],
)
def test_quote_identifier(name: str, quoted: str) -> None:
    assert quote_identifier(name) == quoted


def test_quote_identifier_matches_sqlalchemys_mysql_dialect() -> None:
    from sqlalchemy.dialects import mysql

    plain = mysql.dialect(
        paramstyle="named"
    ).identifier_preparer  # statements run without parameters
    pyformat = mysql.dialect(
        paramstyle="format"
    ).identifier_preparer  # statements pymysql %-formats
    for name in ("orders", "weird`name", "``", "a b", "x%s", "select", "100%"):
        assert quote_identifier(name) == plain.quote_identifier(name)
        stmt = insert_statement(name, ["c"])
        assert stmt[len("INSERT INTO ") : stmt.index(" (`c`)")] == pyformat.quote_identifier(name)


def test_quote_identifier_refuses_nul() -> None:
    with pytest.raises(ValueError, match="NUL"):
        quote_identifier("a\x00b")


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("a\x00", "NUL"),
        ("x" * 65, "longer than 64"),
        ("trailing ", "end with a space"),
    ],
)
def test_identifier_problems(name: str, problem: str) -> None:
    assert problem in (identifier_problem(name) or "")


def test_identifier_ok() -> None:
    assert identifier_problem("x" * 64) is None and identifier_problem("a`b %s") is None


# -- statements -----------------------------------------------------------------------------------


def test_insert_statement() -> None:
    assert (
        insert_statement("orders", ["id", "name"])
        == "INSERT INTO `orders` (`id`, `name`) VALUES (%s, %s)"
    )


def test_upsert_statement() -> None:
    stmt = insert_statement("orders", ["id", "name", "amount"], ["id"])
    assert stmt == (
        "INSERT INTO `orders` (`id`, `name`, `amount`) VALUES (%s, %s, %s) "
        "ON DUPLICATE KEY UPDATE `name` = VALUES(`name`), `amount` = VALUES(`amount`)"
    )
    assert insert_statement("t", ["a", "b"], ["a", "b"]).endswith(
        "ON DUPLICATE KEY UPDATE `a` = `a`"
    )


@pytest.mark.parametrize("upsert", [(), ("i`d",)])
def test_statements_with_odd_identifiers_stay_multi_row_inserts(upsert: tuple[str, ...]) -> None:
    """pymysql's executemany turns the statement into multi-row INSERTs only if its regex matches,
    and %-formats the prefix: '%' in identifiers must be doubled, backticks doubled."""
    cols = ["i`d", "na%me", "VALUES (%s)", "x"]
    stmt = insert_statement("t`a%b %s", cols, upsert)
    assert stmt.startswith(
        "INSERT INTO `t``a%%b %%s` (`i``d`, `na%%me`, `VALUES (%%s)`, `x`) VALUES (%s, %s, %s, %s)"
    )
    m = RE_INSERT_VALUES.match(stmt)
    assert m is not None
    assert (
        m.group(1) % () == "INSERT INTO `t``a%b %s` (`i``d`, `na%me`, `VALUES (%s)`, `x`) VALUES "
    )
    assert m.group(2) == "(%s, %s, %s, %s)"
    if upsert:
        assert (
            (m.group(3) % ()).strip()
            == "ON DUPLICATE KEY UPDATE `na%me` = VALUES(`na%me`), `VALUES (%s)` = VALUES(`VALUES (%s)`), `x` = VALUES(`x`)"
        )


def test_create_table_statement_is_not_percent_escaped() -> None:
    stmt = create_table_statement("t%x`y", {"id": "BIGINT", "n%": "LONGTEXT"}, ["id"])
    assert (
        stmt
        == "CREATE TABLE IF NOT EXISTS `t%x``y` (`id` BIGINT, `n%` LONGTEXT, PRIMARY KEY (`id`)) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
    )


# -- types and values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arrow", "key", "sql"),
    [
        (pa.bool_(), False, "BOOLEAN"),
        (pa.int8(), False, "TINYINT"),
        (pa.int16(), False, "SMALLINT"),
        (pa.int32(), False, "INT"),
        (pa.int64(), False, "BIGINT"),
        (pa.uint64(), False, "BIGINT UNSIGNED"),
        (pa.uint8(), False, "TINYINT UNSIGNED"),
        (pa.float32(), False, "FLOAT"),
        (pa.float64(), False, "DOUBLE"),
        (pa.decimal128(10, 2), False, "DECIMAL(10,2)"),
        (pa.decimal256(70, 40), False, "DECIMAL(65,30)"),
        (pa.timestamp("s"), False, "DATETIME"),
        (pa.timestamp("ms", tz="UTC"), False, "DATETIME(3)"),
        (pa.timestamp("us"), False, "DATETIME(6)"),
        (pa.timestamp("ns"), False, "DATETIME(6)"),
        (pa.date32(), False, "DATE"),
        (pa.string(), False, "LONGTEXT"),
        (pa.string(), True, "VARCHAR(255)"),
        (pa.large_string(), False, "LONGTEXT"),
        (pa.binary(), False, "LONGBLOB"),
        (pa.binary(), True, "VARBINARY(255)"),
        (pa.list_(pa.int64()), False, "JSON"),
        (pa.struct([("a", pa.int64())]), False, "JSON"),
    ],
)
def test_mysql_type(arrow: pa.DataType, key: bool, sql: str) -> None:
    assert mysql_type(arrow, key=key) == sql


def test_column_values_timestamps_become_naive_utc() -> None:
    paris = pa.array([dt.datetime(2026, 11, 1, 12, 0, 0, 123000)], pa.timestamp("ms")).cast(
        pa.timestamp("ms", tz="Europe/Paris")
    )
    values, bad = column_values(paris)
    assert values == [dt.datetime(2026, 11, 1, 12, 0, 0, 123000)] and bad == {}
    ns = pa.array([1_700_000_000_123_456_789, None], pa.timestamp("ns", tz="UTC"))
    assert column_values(ns)[0] == [dt.datetime(2023, 11, 14, 22, 13, 20, 123456), None]
    naive = pa.array([dt.datetime(2026, 1, 1)], pa.timestamp("us"))
    assert column_values(naive)[0] == [dt.datetime(2026, 1, 1)]


def test_column_values_non_finite_floats_are_row_errors() -> None:
    values, bad = column_values(
        pa.chunked_array([[1.5, float("nan")], [None, float("inf"), -float("inf")]])
    )
    assert values[0] == 1.5 and values[2] is None
    assert bad == {
        1: "nan cannot be stored in MySQL",
        3: "inf cannot be stored in MySQL",
        4: "-inf cannot be stored in MySQL",
    }
    assert column_values(pa.array([], pa.float64())) == ([], {})


def test_column_values_nested_become_json_and_others_pass() -> None:
    nested = pa.array([{"a": [1, 2], "d": dt.date(2026, 1, 2)}, None])
    values, _ = column_values(nested)
    assert json.loads(values[0]) == {"a": [1, 2], "d": "2026-01-02"} and values[1] is None
    assert column_values(pa.array([decimal.Decimal("1.50")], pa.decimal128(5, 2)))[0] == [
        decimal.Decimal("1.50")
    ]
    assert column_values(pa.array([b"\x00\xff"], pa.binary()))[0] == [b"\x00\xff"]
    assert column_values(pa.array(["a", "b", "a"]).dictionary_encode())[0] == ["a", "b", "a"]


def test_headers_and_payload_json() -> None:
    headers = pa.array(
        [
            [
                {"key": "h", "value": b"1"},
                {"key": "h", "value": b"2"},
                {"key": "b", "value": b"\xff"},
            ],
            None,
        ],
        HEADERS_TYPE,
    )
    assert [json.loads(x) for x in headers_json(headers)] == [{"h": "2", "b": "\ufffd"}, {}]
    assert [json.loads(x) for x in payload_json(make_batch(1))] == [
        {"id": 0, "name": "name 0", "amount": 0.0}
    ]
    raw = pa.table({"value": pa.array([b'{"a": 1}', b"not json"])})
    assert [json.loads(x) for x in payload_json(raw)] == [{"a": 1}, "not json"]


# -- config ---------------------------------------------------------------------------------------


def test_defaults_alias_and_asset_key() -> None:
    cfg = parse_sink_config({**BASE, "type": "mariadb"})
    assert isinstance(cfg, MySQLSinkConfig)
    assert cfg.rows_per_statement == 1000 and cfg.upsert_keys == [] and cfg.create_table is False
    assert cfg.connect_timeout_s == 10 and cfg.read_timeout_s == 60 and cfg.write_timeout_s == 60
    assert cfg.asset_key_path() == ["mysql", "test", "orders"]
    assert parse_sink_config(
        {"type": "mysql", "host": "h", "database": "shop", "table": "a-b"}
    ).asset_key_path() == ["mysql", "shop", "a_b"]


def test_url_is_secret_and_parsed(file_root: Path) -> None:
    ca = str(file_root / "ca.pem")
    s = sink(
        url="mysql://us%40er:p%3Ass@db.example:3307/sh%2Fop",
        lock_wait_timeout_s=5,
        tls_ca_file=ca,
    )
    assert "p:ss" not in repr(s.config) and "p%3Ass" not in json.dumps(s.config.redacted())
    assert "p%3Ass" not in s.describe() and "p:ss" not in s.describe()
    kw = s.connect_kwargs()
    assert (kw["host"], kw["port"], kw["user"], kw["password"], kw["database"]) == (
        "db.example",
        3307,
        "us@er",
        "p:ss",
        "sh/op",
    )
    assert kw["autocommit"] is False and kw["charset"] == "utf8mb4"
    assert (kw["connect_timeout"], kw["read_timeout"], kw["write_timeout"]) == (10, 60, 60)
    assert (
        "STRICT_ALL_TABLES" in kw["init_command"] and "time_zone = '+00:00'" in kw["init_command"]
    )
    assert "innodb_lock_wait_timeout = 5" in kw["init_command"]
    assert kw["ssl"] == {"ca": ca}
    assert s.endpoint() == "db.example:3307/sh/op"


def test_host_fields() -> None:
    s = sink(url=None, host="db", user="app", password="pw", database="shop", port=3310)
    kw = s.connect_kwargs()
    assert (kw["host"], kw["port"], kw["user"], kw["password"], kw["database"]) == (
        "db",
        3310,
        "app",
        "pw",
        "shop",
    )
    assert "pw" not in json.dumps(s.config.redacted())


def live_sink(raw: dict[str, Any]) -> MySQLSink:
    """The sink as a run builds it: references resolved, then validated."""
    from conveyor.config.specs import from_mapping, resolved

    ls = from_mapping(
        {"name": "c", "source": {"topics": ["t"]}, "sink": raw}, source="t.yaml", fallback_name="c"
    )
    assert ls.ok, ls.error
    s = build_sink(resolved(ls).sink)
    assert isinstance(s, MySQLSink)
    return s


def test_url_env_is_an_alias_of_an_env_reference_read_only_in_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MYSQL_SINK_URL", "mysql://u:pw@h/shop")
    raw = {k: v for k, v in BASE.items() if k != "url"} | {"url_env": "MYSQL_SINK_URL"}
    cfg = parse_sink_config(raw)
    assert cfg.url is not None and cfg.url.get_secret_value() == "${env:MYSQL_SINK_URL}"
    # Outside the run the variable is not read: the database is unknown to the asset key.
    assert cfg.asset_key_path() == ["mysql", "default", "orders"]
    s = live_sink(raw)
    assert s.connect_kwargs()["database"] == "shop"
    assert s.config.asset_key_path() == ["mysql", "shop", "orders"]


def test_an_unset_url_env_is_reported_in_the_run_naming_the_field() -> None:
    raw = {k: v for k, v in BASE.items() if k != "url"} | {"url_env": "CONVEYOR_SURELY_UNSET_VAR"}
    with pytest.raises(ConfigError) as err:
        live_sink(raw)
    assert "sink.url: ${env:CONVEYOR_SURELY_UNSET_VAR}: environment variable" in str(err.value)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"url": None}, "sink.url"),
        ({"host": "h"}, "sink.url"),
        ({"url_env": "X"}, "url_env"),
        ({"url": "http://h/db"}, "sink.url"),
        ({"url": "mysql:///db"}, "sink.url"),
        ({"url": "mysql://h:99999/db"}, "sink.url"),
        ({"url": "mysql://h:3306"}, "sink.url"),
        ({"url": None, "host": "h"}, "sink.database"),
        ({"url": None, "host": " ", "database": "d"}, "sink.host"),
        ({"password": "pw"}, "sink.password"),
        ({"database": "d"}, "sink.database"),
        ({"port": 3307}, "sink.port"),
        ({"port": 0}, "port"),
        ({"table": ""}, "sink.table"),
        ({"table": "x" * 65}, "sink.table"),
        ({"table": "a\x00"}, "sink.table"),
        ({"columns": {}}, "sink.columns"),
        ({"columns": {"id": "$nope"}}, "sink.columns"),
        ({"columns": {"bad ": "id"}}, "sink.columns"),
        ({"columns": {"id": "id"}, "upsert_keys": ["name"]}, "sink.upsert_keys"),
        ({"upsert_keys": ["id", "id"]}, "sink.upsert_keys"),
        ({"rows_per_statement": 0}, "rows_per_statement"),
        ({"rows_per_statement": 100_001}, "rows_per_statement"),
        ({"max_statement_bytes": 10}, "max_statement_bytes"),
        ({"read_timeout_s": 0}, "read_timeout_s"),
        ({"write_timeout_s": 0}, "write_timeout_s"),
        ({"connect_timeout_s": 301}, "connect_timeout_s"),
        ({"lock_wait_timeout_s": 0}, "lock_wait_timeout_s"),
        ({"charset": "utf8mb4; DROP"}, "sink.charset"),
        ({"nope": 1}, "nope"),
    ],
)
def test_bad_config_names_the_field(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_sink({**BASE, **override})
    assert field in str(err.value)


def test_importing_the_module_does_not_import_pymysql() -> None:
    code = "import sys, conveyor.sinks.mysql; from conveyor.sinks import build_sink; " \
        "build_sink({'type': 'mysql', 'url': 'mysql://h/db', 'table': 't'}); assert 'pymysql' not in sys.modules"  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


# -- error mapping --------------------------------------------------------------------------------


def server_error(code: int, message: str = "message") -> pymysql.err.MySQLError:
    """The exception pymysql raises for an error packet with this code (same class choice)."""
    cls = pymysql.err.error_map.get(
        code, pymysql.err.InternalError if code < 1000 else pymysql.err.OperationalError
    )
    return cls(code, message)


@pytest.mark.parametrize("code", sorted(DATA_ERRORS))
def test_data_error_codes(code: int) -> None:
    assert classify_mysql_error(server_error(code)) == "data"


@pytest.mark.parametrize("code", sorted(TRANSIENT_ERRORS))
def test_transient_error_codes(code: int) -> None:
    assert classify_mysql_error(server_error(code)) == "transient"


@pytest.mark.parametrize("code", sorted(PERMANENT_ERRORS))
def test_permanent_error_codes(code: int) -> None:
    assert classify_mysql_error(server_error(code)) == "permanent"


def test_the_briefs_codes_are_mapped() -> None:
    for code in (1048, 1264, 1406, 1366, 3819, 4025, 1062, 1452):
        assert classify_mysql_error(server_error(code)) == "data", code
    for code in (2003, 2006, 2013, 1205, 1213):
        assert classify_mysql_error(server_error(code)) == "transient", code
    for code in (1045, 1049, 1146):
        assert classify_mysql_error(server_error(code)) == "permanent", code


def test_exceptions_without_a_known_code() -> None:
    assert classify_mysql_error(pymysql.err.IntegrityError(9999, "new integrity error")) == "data"
    assert classify_mysql_error(pymysql.err.DataError(9998, "new data error")) == "data"
    assert classify_mysql_error(pymysql.err.ProgrammingError(9997, "x")) == "permanent"
    assert classify_mysql_error(pymysql.err.NotSupportedError(9996, "x")) == "permanent"
    assert classify_mysql_error(pymysql.err.OperationalError(9995, "x")) == "transient"
    assert classify_mysql_error(pymysql.err.InternalError(0, "x")) == "transient"
    assert classify_mysql_error(pymysql.err.InterfaceError(0, "")) == "transient"
    assert classify_mysql_error(TimeoutError("timed out")) == "transient"
    assert classify_mysql_error(ConnectionResetError(104, "reset")) == "transient"


def test_error_text() -> None:
    assert (
        error_text(server_error(1048, "Column 'name' cannot be null"))
        == "(1048) Column 'name' cannot be null"
    )
    assert error_text(TimeoutError("timed out")) == "TimeoutError: timed out"


def test_the_docs_example_is_a_valid_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import pathlib
    import re

    import yaml

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "sinks" / "mysql.md").read_text()
    (block,) = re.findall(r"```yaml\n(sink:.*?)```", doc, re.S)
    raw = yaml.safe_load(block)["sink"]
    monkeypatch.setenv(raw["url_env"], "mysql://conveyor:pw@db-1:3306/shop")
    s = live_sink(raw)
    assert s.config.asset_key_path() == ["mysql", "shop", "orders"]
