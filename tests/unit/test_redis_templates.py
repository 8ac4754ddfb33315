"""Redis sink without a server: template parsing and substitution, client construction, error mapping."""

from __future__ import annotations

import datetime as dt
import decimal
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from redis import exceptions as rx
from redis._parsers.base import BaseParser

from conveyor.core.errors import ConfigError
from conveyor.sinks import build_sink, parse_sink_config
from conveyor.sinks.redis import (
    CommandTemplate,
    Placeholder,
    RedisSink,
    RedisSinkConfig,
    TemplateSyntaxError,
    arrow_value_array,
    classify_redis_error,
    client_kwargs,
    make_client,
    parse_argument,
    parse_command,
    redis_error_code,
    redis_error_text,
    render_batch,
    value_bytes,
)
from tests.sinks.contract import BASE_TS, HEADERS_TYPE, closed_port, make_batch

BASE = {"type": "redis", "commands": ["SET k:${payload.id} ${payload.name}"]}


def arrow_value_bytes(col: pa.ChunkedArray | pa.Array) -> list[bytes | None] | None:
    arr = arrow_value_array(col)
    return None if arr is None else arr.to_pylist()


def sink(**over: Any) -> RedisSink:
    s = build_sink({**BASE, **over})
    assert isinstance(s, RedisSink)
    return s


def render(template: str | list[str], batch: pa.Table) -> tuple[list[Any], dict[int, str]]:
    return render_batch([parse_command(template)], batch)


# -- parsing --------------------------------------------------------------------------------------


def test_string_template_is_split_once_with_shlex() -> None:
    t = parse_command(
        "HSET orders:${payload.id} status ${payload.status} note 'two words' \"${payload.a} and ${key}\""
    )
    assert t.name == "HSET"
    assert t.args == (
        (b"HSET",),
        (b"orders:", Placeholder("payload.id")),
        (b"status",),
        (Placeholder("payload.status"),),
        (b"note",),
        (b"two words",),
        (Placeholder("payload.a"), b" and ", Placeholder("key")),
    )
    assert t.placeholders() == {"payload.id", "payload.status", "payload.a", "key"}


def test_list_template_is_not_split() -> None:
    t = parse_command(["xadd", "stream one", "*", "data", "${payload}"])
    assert t.name == "XADD"
    assert t.args[1] == (b"stream one",)
    assert t.args[4] == (Placeholder("payload"),)
    assert t.source == "xadd 'stream one' '*' data '${payload}'"


def test_parse_argument() -> None:
    assert parse_argument("") == (b"",)
    assert parse_argument("plain") == (b"plain",)
    assert parse_argument("${offset}") == (Placeholder("offset"),)
    assert parse_argument("a${topic}b${partition}") == (
        b"a",
        Placeholder("topic"),
        b"b",
        Placeholder("partition"),
    )
    assert parse_argument("${ payload.x }") == (Placeholder("payload.x"),)
    assert parse_argument("${headers.trace.id}") == (Placeholder("headers.trace.id"),)
    assert Placeholder("headers.trace.id").rest == "trace.id"
    assert Placeholder("payload.a.b").path == ("a", "b")


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("", "empty command"),
        ("SET 'open", "No closing quotation"),
        ("${payload.cmd} k v", "is not a command name"),
        ("SET k ${nope}", "unknown placeholder"),
        ("SET k ${payload.}", "empty field name"),
        ("SET k ${payload.a..b}", "empty field name"),
        ("SET k ${headers.}", "empty field name"),
        ("SET k ${key.x}", "only payload and headers have fields"),
        ("SET k ${unclosed", "unclosed"),
        ("SET k a${b", "unclosed"),
        ("MULTI", "MULTI cannot be used"),
        ("exec", "EXEC cannot be used"),
        ("select 1", "SELECT cannot be used"),
        ("SUBSCRIBE ch", "SUBSCRIBE cannot be used"),
    ],
)
def test_bad_templates(template: str, message: str) -> None:
    with pytest.raises(TemplateSyntaxError, match=message):
        parse_command(template)


# -- substitution -------------------------------------------------------------------------------------


NASTY = "He said \"hi\"\nthen 'left'  \t with  spaces; ${payload.id} $(rm -rf) `x` \\ end"


def test_a_value_never_splits_into_two_arguments() -> None:
    rows, bad = render(
        "HSET k:${payload.id} name ${payload.name} tag x${payload.name}y",
        make_batch(2, names={1: NASTY}),
    )
    assert bad == {}
    assert rows[1] == [
        ["HSET", b"k:1", b"name", NASTY.encode(), b"tag", b"x" + NASTY.encode() + b"y"]
    ]
    assert len(rows[0][0]) == len(rows[1][0]) == 6


def test_substitution_is_one_pass() -> None:
    """A value that looks like a placeholder stays literal text."""
    rows, _ = render("SET k ${payload.name}", make_batch(1, names={0: "${payload.id}"}))
    assert rows[0][0][2] == b"${payload.id}"


def test_metadata_placeholders() -> None:
    rows, bad = render(
        [
            "X",
            "${topic}",
            "${partition}",
            "${offset}",
            "${timestamp}",
            "${key}",
            "${headers}",
            "${headers.h}",
        ],
        make_batch(3, start=5, partition=2),
    )
    assert bad == {}
    ts = int((BASE_TS - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)).total_seconds() * 1000) + 6
    assert rows[1][0] == ["X", b"orders", b"2", b"6", str(ts).encode(), b"k6", b'{"h":"6"}', b"6"]


@pytest.mark.parametrize(
    ("unit", "value"),
    [
        ("s", 1_700_000_000),
        ("ms", 1_700_000_000_123),
        ("us", 1_700_000_000_123_456),
        ("ns", 1_700_000_000_123_456_789),
    ],
)
def test_timestamp_is_epoch_milliseconds_for_every_unit(unit: str, value: int) -> None:
    for tz in (None, "UTC", "Europe/Paris"):
        batch = pa.table(
            {"value": pa.array([b"x"]), "__timestamp": pa.array([value], pa.timestamp(unit, tz=tz))}
        )
        rows, _ = render("SET k ${timestamp}", batch)
        expected = {"s": value * 1000, "ms": value, "us": value // 1000, "ns": value // 1_000_000}[
            unit
        ]
        assert rows[0][0][2] == str(expected).encode()


def test_payload_whole() -> None:
    # Decoded columns: compact JSON.
    rows, _ = render("SET k ${payload}", make_batch(1))
    assert json.loads(rows[0][0][2]) == {"id": 0, "name": "name 0", "amount": 0.0}
    # A raw value: bytes as they are, text as UTF-8.
    raw = pa.table({"value": pa.array([b"\x00\xff raw", None], pa.binary())})
    rows, bad = render("SET k ${payload}", raw)
    assert rows[0][0][2] == b"\x00\xff raw" and bad == {1: "payload is null (${payload})"}
    text = pa.table({"value": pa.array(["ünï text"], pa.string())})
    assert render("SET k ${payload}", text)[0][0][0][2] == "ünï text".encode()


def test_nested_fields_from_struct_columns_and_json_values() -> None:
    structs = pa.table(
        {
            "order": pa.array(
                [{"id": 1, "c": {"n": "A B"}}, {"id": 2, "c": None}, {"id": 3, "c": {"n": None}}]
            )
        }
    )
    rows, bad = render("SET o:${payload.order.id} ${payload.order.c.n}", structs)
    assert rows[0][0][1:] == [b"o:1", b"A B"]
    assert bad == {
        1: "payload has no field 'order.c.n' (${payload.order.c.n})",
        2: "payload field 'order.c.n' is null (${payload.order.c.n})",
    }
    js = pa.table({"value": pa.array([b'{"a": {"b": [1, 2]}}', b"not json", b'{"a": 1}'])})
    rows, bad = render("SET k ${payload.a.b}", js)
    assert rows[0][0][2] == b"[1,2]"
    assert set(bad) == {1, 2}


def test_missing_top_level_field_fails_every_row_with_its_index() -> None:
    rows, bad = render("SET k ${payload.nope}", make_batch(3))
    assert rows == [None, None, None] and set(bad) == {0, 1, 2}
    assert bad[0] == "payload has no field 'nope' (${payload.nope})"


def test_missing_key_header_destination_and_metadata_defaults() -> None:
    batch = pa.table(
        {
            "value": pa.array([b"a", b"b"]),
            "__key": pa.array([None, b"k"], pa.binary()),
            "__headers": pa.array(
                [[{"key": "x", "value": b"1"}, {"key": "x", "value": b"2"}], None], HEADERS_TYPE
            ),
            "__destination": pa.array([None, "dest"], pa.string()),
        }
    )
    assert render("SET ${key} v", batch)[1] == {0: "message has no key (${key})"}
    rows, bad = render("SET k ${headers.x}", batch)
    assert rows[0][0][2] == b"2" and bad == {
        1: "message has no header 'x' (${headers.x})"
    }  # the last x wins
    assert render("SET k ${destination}", batch)[1] == {
        0: "message has no destination (${destination})"
    }
    assert render("SET k ${timestamp}", batch)[1] == {
        0: "message has no timestamp (${timestamp})",
        1: "message has no timestamp (${timestamp})",
    }
    rows, bad = render(
        "SET ${topic}:${partition}:${offset} ${headers}", batch
    )  # hand-made batch: defaults
    assert bad == {} and rows[1][0][1:] == [b":0:1", b"{}"]


def test_several_templates_and_a_failing_row() -> None:
    templates = [
        parse_command("HSET h:${payload.id} n ${payload.name}"),
        parse_command("SADD s ${payload.id}"),
    ]
    rows, bad = render_batch(templates, make_batch(3, names={1: None}))
    assert rows[1] is None and set(bad) == {1}
    assert rows[2] == [["HSET", b"h:2", b"n", b"name 2"], ["SADD", b"s", b"2"]]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"\x00", b"\x00"),
        ("é", "é".encode()),
        (True, b"true"),
        (False, b"false"),
        (42, b"42"),
        (1.5, b"1.5"),
        (0.1 + 0.2, b"0.30000000000000004"),
        (1e20, b"1e+20"),
        (decimal.Decimal("1.50"), b"1.50"),
        (dt.date(2026, 1, 2), b"2026-01-02"),
        (dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc), b"2026-01-02T03:04:05+00:00"),
        ({"a": [1, "é"]}, '{"a":[1,"é"]}'.encode()),
    ],
)
def test_value_bytes(value: Any, expected: bytes) -> None:
    assert value_bytes(value) == expected


# -- config ----------------------------------------------------------------------------------------


def test_defaults_and_asset_key() -> None:
    cfg = parse_sink_config(BASE)
    assert isinstance(cfg, RedisSinkConfig)
    assert (cfg.mode, cfg.host, cfg.port, cfg.db, cfg.pipeline_size, cfg.transaction, cfg.tls) == (
        "standalone",
        "127.0.0.1",
        6379,
        0,
        1000,
        False,
        False,
    )
    assert (cfg.socket_timeout_s, cfg.socket_connect_timeout_s) == (10.0, 5.0)
    assert cfg.asset_key_path() == ["redis", "k"]
    assert parse_sink_config(
        {**BASE, "commands": ["XADD orders.stream * d ${payload}"]}
    ).asset_key_path() == ["redis", "orders_stream"]
    assert parse_sink_config({**BASE, "commands": ["SET ${key} v"], "db": 2}).asset_key_path() == [
        "redis",
        "db2",
    ]


def test_templates_are_parsed_at_validation() -> None:
    s = sink(commands=["HSET a:${payload.id} f ${payload.name}", ["SET", "b", "${payload}"]])
    assert [t.name for t in s.templates()] == ["HSET", "SET"]
    assert all(isinstance(t, CommandTemplate) for t in s.templates())


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"commands": []}, "commands"),
        ({"commands": ["SET k ${x}"]}, "sink.commands[0]"),
        ({"commands": ["SET a b", ["MULTI"]]}, "sink.commands[1]"),
        ({"commands": "SET a b"}, "commands"),
        ({"host": ""}, "sink.host"),
        ({"port": 70000}, "port"),
        ({"db": -1}, "db"),
        ({"mode": "cluster", "db": 1}, "sink.db"),
        ({"mode": "cluster", "transaction": True}, "sink.transaction"),
        ({"mode": "cluster", "startup_nodes": ["h:0"]}, "sink.startup_nodes"),
        ({"startup_nodes": ["h:7000"]}, "sink.startup_nodes"),
        ({"tls_ca_file": "ca.pem"}, "sink.tls_ca_file"),
        ({"tls_cert_file": "c.pem", "tls_key_file": "k.pem"}, "sink.tls_cert_file"),
        ({"tls": True, "tls_key_file": "k.pem"}, "sink.tls_cert_file"),
        ({"password": ""}, "sink.password"),
        ({"pipeline_size": 0}, "pipeline_size"),
        ({"socket_timeout_s": 0}, "socket_timeout_s"),
        ({"socket_connect_timeout_s": -1}, "socket_connect_timeout_s"),
        ({"mode": "sentinel"}, "mode"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_bad_config_names_the_field(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_sink({**BASE, **override})
    assert field in str(err.value)


def test_password_is_secret() -> None:
    s = sink(username="app", password="s3cret")
    assert (
        "s3cret" not in repr(s.config)
        and "s3cret" not in json.dumps(s.config.redacted())
        and "s3cret" not in s.describe()
    )
    assert client_kwargs(s.config)["password"] == "s3cret"


def test_importing_the_module_does_not_import_redis() -> None:
    code = "import sys, conveyor.sinks.redis; from conveyor.sinks import build_sink; " \
        "build_sink({'type': 'redis', 'commands': ['SET a b']}); assert 'redis' not in sys.modules"  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


# -- client construction ------------------------------------------------------------------------------


def test_standalone_client_kwargs_and_no_retries() -> None:
    cfg = sink(
        host="r1",
        port=6380,
        db=4,
        username="u",
        password="p",
        socket_timeout_s=3,
        socket_connect_timeout_s=1,
        client_name="c",
    ).config
    kw = client_kwargs(cfg)
    assert kw == {
        "host": "r1",
        "port": 6380,
        "db": 4,
        "username": "u",
        "password": "p",
        "socket_timeout": 3,
        "socket_connect_timeout": 1,
        "socket_keepalive": True,
        "client_name": "c",
        "health_check_interval": 30,
    }
    client = make_client(cfg)  # redis.Redis connects lazily
    pool_kw = client.connection_pool.connection_kwargs
    assert (
        pool_kw["host"],
        pool_kw["port"],
        pool_kw["db"],
        pool_kw["username"],
        pool_kw["password"],
    ) == ("r1", 6380, 4, "u", "p")
    assert pool_kw["retry"].get_retries() == 0
    client.close()


def test_tls_kwargs(file_root: Path) -> None:
    ca, cert, key = (str(file_root / n) for n in ("ca.pem", "c.pem", "k.pem"))
    cfg = sink(
        tls=True,
        tls_ca_file=ca,
        tls_cert_file=cert,
        tls_key_file=key,
        tls_check_hostname=False,
    ).config
    kw = client_kwargs(cfg)
    assert (
        kw["ssl"],
        kw["ssl_cert_reqs"],
        kw["ssl_ca_certs"],
        kw["ssl_certfile"],
        kw["ssl_keyfile"],
        kw["ssl_check_hostname"],
    ) == (True, "required", ca, cert, key, False)
    client = make_client(cfg)
    from redis.connection import SSLConnection

    assert client.connection_pool.connection_class is SSLConnection
    client.close()
    assert "ssl" not in client_kwargs(sink().config)


@pytest.mark.parametrize("field", ["tls_ca_file", "tls_cert_file", "tls_key_file"])
def test_a_tls_file_outside_the_roots_is_refused_naming_its_field(
    field: str, file_root: Path
) -> None:
    """The one path rule (``core.trust.paths``): a TLS file outside ``$CONVEYOR_HOME`` and
    ``$CONVEYOR_FILE_ROOTS`` is refused when the config is validated."""
    files = {n: str(file_root / f"{n}.pem") for n in ("tls_cert_file", "tls_key_file")}
    with pytest.raises(ConfigError) as err:
        build_sink({**BASE, "tls": True, **files, field: "/etc/ssl/outside.pem"})
    assert f"sink.{field}" in str(err.value) and "CONVEYOR_FILE_ROOTS" in str(err.value)


@pytest.mark.parametrize("field", ["tls_ca_file", "tls_cert_file", "tls_key_file"])
def test_tls_files_are_resolved_again_when_the_client_is_built(
    field: str, file_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The client opens the real path under a root; a link swapped to point out of the roots
    after validation is refused then (the check at the time of use), naming the field."""
    real = file_root / "real"
    real.mkdir()
    names = ("tls_ca_file", "tls_cert_file", "tls_key_file")
    for n in names:
        (real / f"{n}.pem").write_text("-----BEGIN CERTIFICATE-----\n")
        (file_root / f"{n}.pem").symlink_to(real / f"{n}.pem")
    cfg = sink(tls=True, **{n: str(file_root / f"{n}.pem") for n in names}).config
    kw = client_kwargs(cfg)
    want = {"tls_ca_file": "ssl_ca_certs", "tls_cert_file": "ssl_certfile"}
    want["tls_key_file"] = "ssl_keyfile"
    assert {kw[k] for k in want.values()} == {str(real / f"{n}.pem") for n in names}
    outside = tmp_path_factory.mktemp("outside") / "evil.pem"
    outside.write_text("x")
    (file_root / f"{field}.pem").unlink()
    (file_root / f"{field}.pem").symlink_to(outside)
    with pytest.raises(ConfigError) as err:
        client_kwargs(cfg)
    assert f"sink.{field}" in str(err.value) and "symbolic link" in str(err.value)


def test_cluster_kwargs_are_all_accepted_by_redis_cluster() -> None:
    from redis.cluster import KWARGS_DISABLED_KEYS, REDIS_ALLOWED_KEYS, RedisCluster

    cfg = sink(
        mode="cluster",
        host="n1",
        port=7000,
        startup_nodes=["n2:7001", "[::1]:7002"],
        tls=True,
        tls_ca_file="tls/ca.pem",
        username="u",
        password="p",
    ).config
    kw = client_kwargs(cfg)
    assert kw["startup_nodes_spec"] == [("n1", 7000), ("n2", 7001), ("::1", 7002)]
    assert "db" not in kw and "health_check_interval" not in kw
    named = set(inspect.signature(RedisCluster.__init__).parameters)
    for key in set(kw) - {"startup_nodes_spec", "host", "port"}:
        # Anything else would be dropped silently by redis-py's cleanup_kwargs.
        assert key in named or (key in REDIS_ALLOWED_KEYS and key not in KWARGS_DISABLED_KEYS), key


def test_cluster_client_connects_at_construction_and_an_outage_is_transient() -> None:
    cfg = sink(mode="cluster", port=closed_port(), socket_connect_timeout_s=1).config
    with pytest.raises((rx.RedisClusterException, rx.ConnectionError)) as err:
        make_client(cfg)
    assert classify_redis_error(err.value) == "transient"


# -- error mapping ----------------------------------------------------------------------------------


def reply(text: str) -> rx.RedisError:
    """The exception redis-py builds from this error reply (its own parser)."""
    return BaseParser.parse_error(text)


@pytest.mark.parametrize(
    "text",
    [
        "WRONGTYPE Operation against a key holding the wrong kind of value",
        "ERR value is not a valid float",
        "ERR value is not an integer or out of range",
        "ERR hash value is not an integer",
        "ERR The ID specified in XADD is equal or smaller than the target stream top item",
        "ERR syntax error",
        "ERR increment or decrement would overflow",
        "ERR string exceeds maximum allowed size (proto-max-bulk-len)",
        "CROSSSLOT Keys in request don't hash to the same slot",
        "BUSYGROUP Consumer Group name already exists",
    ],
)
def test_data_replies(text: str) -> None:
    assert classify_redis_error(reply(text)) == "data"


@pytest.mark.parametrize(
    "text",
    [
        "LOADING Redis is loading the dataset in memory",
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk",
        "OOM command not allowed when used memory > 'maxmemory'.",
        "READONLY You can't write against a read only replica.",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "NOREPLICAS Not enough good replicas to write.",
        "TRYAGAIN Multiple keys request during rehashing of slot",
        "CLUSTERDOWN The cluster is down",
        "MOVED 3999 127.0.0.1:6381",
        "ASK 3999 127.0.0.1:6381",
        "EXECABORT Transaction discarded because of previous errors.",
        "UNBLOCKED client unblocked via CLIENT UNBLOCK",
        "ERR max number of clients reached",
    ],
)
def test_transient_replies(text: str) -> None:
    assert classify_redis_error(reply(text)) == "transient"


@pytest.mark.parametrize(
    "text",
    [
        "NOPERM this user has no permissions to run the 'hset' command",
        "NOAUTH Authentication required.",
        "WRONGPASS invalid username-password pair or user is disabled.",
        "NOSCRIPT No matching script. Please use EVAL.",
        "ERR unknown command 'HSETX', with args beginning with: ",
        "ERR wrong number of arguments for 'hset' command",
        "ERR unknown subcommand 'FOO'. Try XINFO HELP.",
        "ERR invalid password",
    ],
)
def test_permanent_replies(text: str) -> None:
    assert classify_redis_error(reply(text)) == "permanent"


def test_client_side_exceptions() -> None:
    from redis.cluster import ClusterNode  # noqa: F401 - the cluster module defines the cluster errors

    transient = [
        rx.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."),
        rx.ConnectionError("Connection closed by server."),
        rx.TimeoutError("Timeout reading from socket"),
        rx.BusyLoadingError("Redis is loading the dataset in memory"),
        rx.MaxConnectionsError("Too many connections"),
        rx.ClusterDownError("The cluster is down"),
        rx.MasterDownError("Link with MASTER is down"),
        rx.TryAgainError("TRYAGAIN"),
        rx.MovedError("3999 127.0.0.1:6381"),
        rx.AskError("3999 127.0.0.1:6381"),
        rx.SlotNotCoveredError("Command # 1 (SET) requested a slot that is not covered"),
        rx.RedisClusterException(
            "Redis Cluster cannot be connected. Please provide at least one reachable node"
        ),
        rx.ClusterError("TTL exhausted."),
        rx.ExecAbortError("Transaction discarded because of previous errors."),
        rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        rx.ReadOnlyError("You can't write against a read only replica."),
        ConnectionResetError(104, "Connection reset by peer"),
        OSError("network unreachable"),
    ]
    for e in transient:
        assert classify_redis_error(e) == "transient", repr(e)
    permanent = [
        rx.AuthenticationError("invalid username-password pair"),
        rx.AuthorizationError("not allowed"),
        rx.AuthenticationWrongNumberOfArgsError("wrong number of arguments for 'auth' command"),
        rx.NoPermissionError("this user has no permissions"),
        rx.NoScriptError("No matching script"),
        rx.CrossSlotTransactionError(
            "All keys involved in a cluster transaction must map to the same slot"
        ),
        rx.ConnectionError(
            "Error 1 connecting to r:6380. [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate."
        ),
    ]
    for e in permanent:
        assert classify_redis_error(e) == "permanent", repr(e)
    assert classify_redis_error(rx.DataError("Invalid input of type: 'dict'")) == "data"
    assert classify_redis_error(rx.ResponseError("WRONGTYPE Operation against a key")) == "data"


def test_error_code_and_text() -> None:
    e = reply("ERR value is not a valid float")
    assert redis_error_code(e) == "ERR" and redis_error_text(e) == "ERR value is not a valid float"
    w = reply("WRONGTYPE Operation against a key holding the wrong kind of value")
    assert redis_error_code(w) == "WRONGTYPE" and redis_error_text(w) == str(w)
    n = reply("NOPERM this user has no permissions to run the 'hset' command")
    n.args = (
        f"Command # 1 (HSET k:1 n {NASTY}) of pipeline caused error: {n.args[0]}",
    )  # what redis-py does in MULTI
    assert redis_error_text(n) == "NOPERM this user has no permissions to run the 'hset' command"
    assert (
        redis_error_text(rx.TimeoutError("Timeout reading from socket"))
        == "TimeoutError: Timeout reading from socket"
    )
    assert redis_error_code(rx.ConnectionError("Connection closed by server.")) is None


def test_the_docs_examples_are_valid_configs() -> None:
    import pathlib
    import re

    import yaml

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "sinks" / "redis.md").read_text()
    blocks = [yaml.safe_load(b)["sink"] for b in re.findall(r"```yaml\n(sink:.*?)```", doc, re.S)]
    assert len(blocks) == 2
    for raw in blocks:
        s = build_sink(raw)
        assert isinstance(s, RedisSink) and s.templates()
    cluster = build_sink(blocks[1])
    assert cluster.templates()[0].args[1] == (b"session:{", Placeholder("payload.user"), b"}:last")


@pytest.mark.parametrize(
    "array",
    [
        pa.array([0, -1, None, 127, -128], pa.int8()),
        pa.array([0, 65535, None], pa.uint16()),
        pa.array([-(2**63), 2**63 - 1, None, 0], pa.int64()),
        pa.array([0, 2**64 - 1, None], pa.uint64()),
        pa.array(["", "plain", None, "é ✓ 🚀", "quote ' \" back \\ nul \x00 crlf \r\n", "%s"]),
        pa.array(["large", None, "🚀"], pa.large_string()),
        pa.array([b"", b"\x00\xff\r\n", None, b"bytes"], pa.binary()),
        pa.array([b"x" * 70_000, None], pa.large_binary()),
    ],
    ids=lambda a: str(a.type),
)
def test_arrow_value_bytes_are_value_bytes(array: pa.Array) -> None:
    """Integers and text converted by Arrow give exactly the bytes ``value_bytes`` gives
    each Python value (nulls stay None), also over a chunked column."""
    expected = [None if v is None else value_bytes(v) for v in array.to_pylist()]
    assert arrow_value_bytes(array) == expected
    chunked = pa.chunked_array([array.slice(0, 1), array.slice(1)])
    assert arrow_value_bytes(chunked) == expected


@pytest.mark.parametrize(
    "array",
    [
        pa.array([1.5, 100.0, None]),  # Arrow writes 100 where repr writes 100.0
        pa.array([True, False]),
        pa.array([dt.datetime(2024, 1, 1)], pa.timestamp("us")),
        pa.array([decimal.Decimal("1.10")]),
        pa.array([{"a": 1}]),
    ],
    ids=lambda a: str(a.type),
)
def test_arrow_value_bytes_leaves_other_types_to_python(array: pa.Array) -> None:
    assert arrow_value_bytes(array) is None


def test_arrow_value_bytes_leaves_invalid_utf8_to_the_row_path() -> None:
    """A string column with invalid UTF-8 (Spark's cast of bytes) is not passed through as
    bytes: the row path fails that row and names UTF-8 (issue 15)."""
    from tests.hostile import with_invalid_utf8

    batch = with_invalid_utf8(pa.table({"name": ["ab", "cd", "ef"]}), "name", {1})
    assert arrow_value_bytes(batch.column("name")) is None
    assert arrow_value_bytes(batch.column("name").slice(2)) == [b"ef"]


# -- the Redis protocol built by Arrow (the fail_fast script path) -------------------------------


def _hostile_batch() -> pa.Table:
    """Nulls in every kind of column, invalid UTF-8 text, empty values, a missing header."""
    b = make_batch(6, names={1: None, 3: ""}, amounts={2: None, 4: 1e20})
    return b.set_column(
        b.schema.get_field_index("__key"),
        "__key",
        pa.array([b"k0", None, b"", b"k\r\n3", b"k4", b"k5"], pa.binary()),
    )


ENCODED_TEMPLATES = [
    "HSET orders:${payload.id} name ${payload.name} amount ${payload.amount} ts ${timestamp}",
    "SET k:${payload.id}:${key} ${payload}",
    "XADD s * t ${topic} p ${partition} o ${offset} h ${headers.h} all ${headers}",
    "SADD fixed member",
    "SET ${payload.name} x${payload.id}y${payload.amount}z",
]


@pytest.mark.parametrize("argv", [True, False], ids=["argv", "command"])
@pytest.mark.parametrize(
    "batch",
    [
        make_batch(50),
        _hostile_batch(),
        pa.table({"value": pa.array([b'{"a": 1}', None, b"\x00\xff raw", b""], pa.binary())}),
        pa.table({"value": pa.array(["ünï", None, "x"], pa.string())}),
        pa.table({"n": pa.array([b"\xff\xfe", b"ok"], pa.binary()), "s": pa.array(["a", None])}),
    ],
    ids=["plain", "hostile", "raw-bytes", "raw-text", "binary-field"],
)
def test_arrow_encoding_is_hiredis_packing_of_the_rendered_rows(
    batch: pa.Table, argv: bool
) -> None:
    """``encode_commands`` gives, row by row, exactly what hiredis packs from
    ``render_batch``'s rows (the script's ARGV: each command's word count, then its
    words), and the same failures with the same messages."""
    from hiredis import pack_command

    from conveyor.sinks.redis import BatchValues, encode_commands

    for source in [*ENCODED_TEMPLATES, "HSET h ${payload.n} ${payload.s}", "SET k ${payload.a}"]:
        templates = [parse_command(source)]
        rows, bad = render_batch(templates, batch)
        encoded, errors = encode_commands(templates, BatchValues(batch), argv=argv)
        assert errors == bad, source
        got = encoded.to_pylist()
        for i, row in enumerate(rows):
            if row is None:
                assert got[i] is None, (source, i)
                continue
            want = b"".join(
                (
                    pack_command((len(c), *c))[len(b"*%d\r\n" % (len(c) + 1)) :]
                    if argv
                    else pack_command(tuple(c))
                )
                for c in row
            )
            assert got[i] == want, (source, i)
    # several templates per row: their commands in order, a row failing in any of them
    templates = [parse_command(t) for t in ENCODED_TEMPLATES]
    rows, bad = render_batch(templates, batch)
    encoded, errors = encode_commands(templates, BatchValues(batch), argv=argv)
    assert errors == bad
    for i, row in enumerate(rows):
        expected = (
            None
            if row is None
            else b"".join(
                pack_command((len(c), *c))[len(b"*%d\r\n" % (len(c) + 1)) :]
                if argv
                else pack_command(tuple(c))
                for c in row
            )
        )
        assert encoded[i].as_py() == expected
