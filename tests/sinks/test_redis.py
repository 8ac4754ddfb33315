"""Redis sink: the contract suite and Redis-specific behaviour against real servers.

The machine's Redis (127.0.0.1:6379, ``CONVEYOR_TEST_REDIS_HOST`` / ``_PORT`` override
it) for standalone mode. For cluster mode and TLS the tests start their own
``redis-server`` processes (a one-node cluster owning every slot; a TLS server with
certificates made by ``openssl``), skipped only when those binaries are missing.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import redis

from conveyor.core.errors import ConfigError, PermanentSinkError, TransientSinkError
from conveyor.sinks import build_sink
from conveyor.sinks.redis import STOP_AT_FIRST_ERROR_SHA, RedisSink
from tests.sinks.contract import (
    BASE_TS,
    HEADERS_TYPE,
    SinkContract,
    closed_port,
    make_batch,
    unique,
)
from tests.sinks.relay import CuttingRelay

pytestmark = pytest.mark.integration

HOST = os.environ.get("CONVEYOR_TEST_REDIS_HOST", "127.0.0.1")
PORT = int(os.environ.get("CONVEYOR_TEST_REDIS_PORT", "6379"))

HASH_TEMPLATE = "HSET {t}:${{payload.id}} id ${{payload.id}} name ${{payload.name}} key ${{key}} ts ${{timestamp}} headers ${{headers}}"


def client(**kw: Any) -> redis.Redis:
    return redis.Redis(host=HOST, port=PORT, **kw)


def delete_prefix(r: Any, prefix: str) -> None:
    keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
    for k in keys:
        r.delete(k)


def hash_read_back(r: Any, target: str) -> list[dict[str, Any]]:
    out = []
    for k in r.scan_iter(match=f"{target}:*", count=1000, _type="hash"):
        h = r.hgetall(k)
        out.append(
            {
                "id": int(h[b"id"]),
                "name": h[b"name"].decode(),
                "key": h[b"key"],
                "headers": {a: b.encode() for a, b in json.loads(h[b"headers"]).items()},
                "timestamp": dt.datetime.fromtimestamp(int(h[b"ts"]) / 1000, tz=dt.timezone.utc),
            }
        )
    return out


class TestRedisContract(SinkContract):
    sink_type = "redis"
    idempotent = True  # HSET on a key per id
    # fail_fast stops at a command that cannot be built (row 250 of the poison batch), and
    # runs each chunk in one Lua script that stops at a refused command (WRONGTYPE, row 400).
    stops_at_first_failure = True
    keeps_keys = keeps_headers = keeps_timestamps = True

    def redis(self) -> Any:
        return client()

    def make_target(self) -> Iterator[str]:
        prefix = unique("conveyor_contract")
        yield prefix
        delete_prefix(self.redis(), prefix)

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "redis",
            "host": HOST,
            "port": PORT,
            "commands": [HASH_TEMPLATE.format(t=target)],
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        return hash_read_back(self.redis(), target)

    def poison_batch(self, target: str):
        # Row 400: its key already holds a string, Redis answers WRONGTYPE to that HSET.
        # Row 250: its name is null, so ${payload.name} cannot be filled (nothing is sent).
        self.redis().set(f"{target}:400", b"not a hash")
        return make_batch(500, names={250: None}), {250, 400}

    def outage_config(self, target: str) -> dict[str, Any]:
        return {**self.config(target), "port": closed_port(), "socket_connect_timeout_s": 2}

    #: A command Redis refuses (not one that cannot be built) stops fail_fast exactly: the
    #: Lua script path. Cluster mode pipelines (a script cannot span slots).
    stops_at_refused_command = True

    def test_fail_fast_stops_at_a_command_redis_refuses(self, sink: Any, target: str) -> None:
        """WRONGTYPE on row 400 (the first failure): nothing after it is written."""
        from conveyor.core.sink import send_isolating

        self.redis().set(f"{target}:400", b"not a hash")
        batch = make_batch(500)
        failed = send_isolating(sink, batch, fail_fast=True)
        assert [f.index for f in failed] == [400]
        assert "WRONGTYPE" in failed[0].message
        stored = sorted(r["id"] for r in self.read_back(target))
        if self.stops_at_refused_command:
            assert stored == list(range(400))
        else:  # the rest of row 400's pipeline is written; the next pipelines are not sent
            assert set(range(400)) <= set(stored)
        # without fail_fast the pipelines write every other row
        sink.fail_fast = False
        assert [f.index for f in send_isolating(sink, batch)] == [400]
        assert sorted(r["id"] for r in self.read_back(target)) == [
            i for i in range(500) if i != 400
        ]

    bad_fields = [
        ({"commands": []}, "commands"),
        ({"commands": ["HSET k ${nope}"]}, "commands[0]"),
        ({"commands": ["HSET k f v", "HSET 'unclosed"]}, "commands[1]"),
        ({"commands": ["MULTI"]}, "commands[0]"),
        ({"commands": ["${payload.cmd} k v"]}, "commands[0]"),
        ({"commands": ["SET k ${payload.}"]}, "commands[0]"),
        ({"commands": ["SET k ${unclosed"]}, "commands[0]"),
        ({"port": 0}, "port"),
        ({"mode": "sentinel"}, "mode"),
        ({"pipeline_size": 0}, "pipeline_size"),
        ({"socket_timeout_s": 0}, "socket_timeout_s"),
        ({"mode": "cluster", "db": 1}, "db"),
        ({"mode": "cluster", "transaction": True}, "transaction"),
        ({"startup_nodes": ["127.0.0.1:7000"]}, "startup_nodes"),
        ({"mode": "cluster", "startup_nodes": ["no-port"]}, "startup_nodes"),
        ({"tls_ca_file": "/etc/ssl/ca.pem"}, "tls_ca_file"),
        ({"tls": True, "tls_cert_file": "/c.pem"}, "tls_cert_file"),
        ({"password": ""}, "password"),
    ]


class TestRedisTransactionContract(TestRedisContract):
    """The same in MULTI/EXEC: WRONGTYPE is a runtime error inside EXEC, still one row's."""

    def config(self, target: str) -> dict[str, Any]:
        return {**super().config(target), "transaction": True, "pipeline_size": 64}

    bad_fields = [b for b in TestRedisContract.bad_fields if b[0].get("mode") != "cluster"] + [
        ({"mode": "cluster"}, "transaction")
    ]


class TestRedisStreamContract(TestRedisContract):
    """XADD with '*': every run appends, so a replay duplicates (documented)."""

    idempotent = False

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "redis",
            "host": HOST,
            "port": PORT,
            "commands": [
                [
                    "XADD",
                    target,
                    "*",
                    "id",
                    "${payload.id}",
                    "name",
                    "${payload.name}",
                    "key",
                    "${key}",
                    "ts",
                    "${timestamp}",
                    "headers",
                    "${headers}",
                ]
            ],
        }

    def test_fail_fast_stops_at_a_command_redis_refuses(self, sink: Any, target: str) -> None:
        """An XADD with '*' is refused for one row only when it cannot be built; Redis
        refuses it when the key holds another type, then for every row: under fail_fast
        the first row fails and nothing after it is sent (the key is untouched); without
        it every row fails with WRONGTYPE."""
        from conveyor.core.sink import send_isolating

        self.redis().set(target, b"not a stream")
        batch = make_batch(50)
        failed = send_isolating(sink, batch, fail_fast=True)
        assert [f.index for f in failed] == [0]
        assert "WRONGTYPE" in failed[0].message
        assert self.redis().get(target) == b"not a stream"
        sink.fail_fast = False
        failed = send_isolating(sink, batch)
        assert [f.index for f in failed] == list(range(50))
        assert all("WRONGTYPE" in f.message for f in failed)
        assert self.redis().get(target) == b"not a stream"

    def read_back(self, target: str) -> list[dict[str, Any]]:
        out = []
        for _, h in self.redis().xrange(target):
            out.append(
                {
                    "id": int(h[b"id"]),
                    "name": h[b"name"].decode(),
                    "key": h[b"key"],
                    "headers": {a: b.encode() for a, b in json.loads(h[b"headers"]).items()},
                    "timestamp": dt.datetime.fromtimestamp(
                        int(h[b"ts"]) / 1000, tz=dt.timezone.utc
                    ),
                }
            )
        return out

    def poison_batch(self, target: str):
        return make_batch(500, names={250: None, 400: None}), {250, 400}


# -- a one-node Redis Cluster (a real redis-server with cluster-enabled) -------------------------------


def _free_port_pair() -> int:
    """A port p with p and p + 10000 (the cluster bus) both free."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair")


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not come up in {timeout}s")


def _start_redis(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["redis-server", *args], stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


CLUSTER: dict[str, int] = {}


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed: cannot start a cluster node")
    d = tmp_path_factory.mktemp("redis-cluster")
    port = _free_port_pair()
    proc = _start_redis(
        ["--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
         "--dir", str(d), "--save", "", "--appendonly", "no"],
        d / "redis.log",
    )  # fmt: skip
    try:
        node = redis.Redis(host="127.0.0.1", port=port)
        _wait(node.ping, 20, "redis cluster node")
        node.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        _wait(
            lambda: b"cluster_state:ok" in node.execute_command("CLUSTER", "INFO"),
            30,
            "cluster state ok",
        )
        node.close()
        CLUSTER["port"] = port
        yield port
    finally:
        _stop(proc)


class TestRedisClusterContract(TestRedisContract):
    """Cluster mode (redis.cluster.RedisCluster) against a one-node cluster started for the session."""

    @pytest.fixture
    def target(self, redis_cluster: int) -> Iterator[str]:
        yield from self.make_target()

    def redis(self) -> Any:
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=CLUSTER["port"])

    def make_target(self) -> Iterator[str]:
        prefix = unique("conveyor_contract")
        yield prefix
        r = self.redis()
        for k in list(r.scan_iter(match=f"{prefix}*", count=1000)):
            r.delete(k)
        r.close()

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "redis",
            "mode": "cluster",
            "host": "127.0.0.1",
            "port": CLUSTER.get("port", 7000),
            "commands": [HASH_TEMPLATE.format(t=target)],
        }

    def outage_config(self, target: str) -> dict[str, Any]:
        return {**self.config(target), "port": closed_port(), "socket_connect_timeout_s": 2}

    stops_at_refused_command = False  # pipelines per node: documented in docs/sinks/redis.md

    bad_fields = [b for b in TestRedisContract.bad_fields if b[1] != "startup_nodes"] + [
        ({"db": 2}, "db"),
        ({"startup_nodes": ["127.0.0.1"]}, "startup_nodes"),
        ({"startup_nodes": ["127.0.0.1:99999"]}, "startup_nodes"),
    ]


# -- TLS (a real redis-server with --tls-port and openssl-made certificates) -------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not shutil.which("redis-server") or not shutil.which("openssl"):
        pytest.skip("redis-server or openssl is not installed: cannot start a TLS server")
    d = tmp_path_factory.mktemp("redis-tls")
    for name in ("ca", "other-ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN=conveyor test {name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.crt",
            cwd=d,
        )
    for name, cn in (("server", "localhost"), ("client", "conveyor-client")):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={cn}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        ext = d / f"{name}.ext"
        ext.write_text(
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
            if name == "server"
            else "extendedKeyUsage=clientAuth\n"
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            ext.name,
            "-out",
            f"{name}.crt",
            cwd=d,
        )
    port = _free_port_pair()
    proc = _start_redis(
        ["--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", str(d / "server.crt"),
         "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "yes",
         "--save", "", "--appendonly", "no", "--dir", str(d)],
        d / "redis.log",
    )  # fmt: skip
    try:
        probe = redis.Redis(
            host="127.0.0.1",
            port=port,
            ssl=True,
            ssl_ca_certs=str(d / "ca.crt"),
            ssl_certfile=str(d / "client.crt"),
            ssl_keyfile=str(d / "client.key"),
        )
        _wait(probe.ping, 20, "TLS redis")
        probe.close()
        yield {"port": port, "dir": d}
    finally:
        _stop(proc)


def test_tls_with_client_certificate(tls_redis: dict[str, Any], temp_root: Path) -> None:
    d, port = tls_redis["dir"], tls_redis["port"]
    prefix = unique("tls")
    cfg = {
        "type": "redis",
        "host": "127.0.0.1",
        "port": port,
        "tls": True,
        "tls_ca_file": str(d / "ca.crt"),
        "tls_cert_file": str(d / "client.crt"),
        "tls_key_file": str(d / "client.key"),
        "commands": [f"SET {prefix}:${{payload.id}} ${{payload.name}}"],
    }
    s = build_sink(cfg)
    s.init_sink()
    try:
        assert s.send_batch(make_batch(10)).failed == ()
    finally:
        s.cleanup_sink()
    r = redis.Redis(
        host="127.0.0.1",
        port=port,
        ssl=True,
        ssl_ca_certs=str(d / "ca.crt"),
        ssl_certfile=str(d / "client.crt"),
        ssl_keyfile=str(d / "client.key"),
    )
    assert r.get(f"{prefix}:7") == b"name 7"
    r.close()

    # A server certificate from another CA is refused, and that is permanent.
    bad = build_sink({**cfg, "tls_ca_file": str(d / "other-ca.crt")})
    with pytest.raises(PermanentSinkError, match="(?i)certificate verify failed"):
        bad.init_sink()
    bad.cleanup_sink()
    # Without TLS the TLS port does not answer as Redis: an outage-like failure, not a hang.
    plain = build_sink(
        {
            "type": "redis",
            "host": "127.0.0.1",
            "port": port,
            "commands": cfg["commands"],
            "socket_timeout_s": 2,
        }
    )
    with pytest.raises((TransientSinkError, PermanentSinkError)):
        plain.init_sink()
    plain.cleanup_sink()


# -- standalone Redis specifics ----------------------------------------------------------------------


@pytest.fixture
def prefix() -> Iterator[str]:
    p = unique("conveyor_t")
    yield p
    delete_prefix(client(), p)


def _sink(*commands: Any, **over: Any) -> RedisSink:
    s = build_sink(
        {"type": "redis", "host": HOST, "port": PORT, "commands": list(commands), **over}
    )
    assert isinstance(s, RedisSink)
    return s


def _send(s: RedisSink, batch: pa.Table) -> Any:
    s.init_sink()
    try:
        return s.send_batch(batch)
    finally:
        s.cleanup_sink()


TRICKY = "a \"quoted\" value\nwith spaces,\ttabs, 'single' quotes, ${payload.id} and ünïcödé"


def test_values_never_split_into_two_arguments(prefix: str) -> None:
    batch = make_batch(3, names={1: TRICKY, 2: ""})
    result = _send(
        _sink(
            f"HSET {prefix}:${{payload.id}} name ${{payload.name}} label 'fixed text with spaces'"
        ),
        batch,
    )
    assert result.failed == ()
    r = client()
    assert r.hgetall(f"{prefix}:1") == {
        b"name": TRICKY.encode(),
        b"label": b"fixed text with spaces",
    }
    assert r.hget(f"{prefix}:2", "name") == b""


def test_text_around_placeholders_concatenates(prefix: str) -> None:
    s = _sink(
        [
            "SET",
            f"{prefix}:${{topic}}/${{partition}}/${{offset}}:${{payload.name}}",
            "v=${payload.amount};k=${key}",
        ]
    )
    assert _send(s, make_batch(2, names={1: TRICKY})).failed == ()
    r = client()
    assert r.get(f"{prefix}:orders/0/0:name 0") == b"v=0.0;k=k0"
    assert r.get(f"{prefix}:orders/0/1:{TRICKY}") == b"v=1.5;k=k1"


def test_raw_bytes_payload_is_stored_as_is(prefix: str) -> None:
    raw = [b"\x00\xff binary \n payload", b'{"id": 5, "inner": {"deep": "x y"}}', None]
    batch = pa.table(
        {
            "value": pa.array(raw, pa.binary()),
            "__offset": pa.array([10, 11, 12], pa.int64()),
            "__key": pa.array([b"\xfe\x01", b"k", None], pa.binary()),
            "__timestamp": pa.array([BASE_TS] * 3, pa.timestamp("ms", tz="UTC")),
        }
    )
    s = _sink(f"SET {prefix}:${{offset}} ${{payload}}", f"SET {prefix}:key:${{offset}} ${{key}}")
    result = _send(s, batch)
    assert [(f.index, f.message) for f in result.failed] == [(2, "payload is null (${payload})")]
    r = client()
    assert r.get(f"{prefix}:10") == raw[0] and r.get(f"{prefix}:11") == raw[1]
    assert r.get(f"{prefix}:key:10") == b"\xfe\x01"
    # Nested fields of a JSON payload; a raw payload has none: a data error for its row only.
    s = _sink(f"SET {prefix}:deep:${{offset}} ${{payload.inner.deep}}")
    result = _send(s, batch)
    assert {f.index for f in result.failed} == {0, 2}
    assert "payload has no field 'inner.deep'" in result.failed[0].message
    assert r.get(f"{prefix}:deep:11") == b"x y"


def test_nested_struct_fields_and_headers(prefix: str) -> None:
    batch = pa.table(
        {
            "order": pa.array(
                [{"id": 1, "customer": {"name": "Ann Lee"}}, {"id": 2, "customer": None}]
            ),
            "__headers": pa.array([[{"key": "trace.id", "value": b"t 1"}], []], HEADERS_TYPE),
        }
    )
    s = _sink(
        f"HSET {prefix}:${{payload.order.id}} customer ${{payload.order.customer.name}} trace ${{headers.trace.id}}"
    )
    result = _send(s, batch)
    assert [f.index for f in result.failed] == [1]
    assert "payload has no field 'order.customer.name'" in result.failed[0].message
    assert client().hgetall(f"{prefix}:1") == {b"customer": b"Ann Lee", b"trace": b"t 1"}


def test_per_command_errors_map_to_their_rows(prefix: str) -> None:
    """HINCRBYFLOAT with a non-numeric increment: Redis rejects exactly those rows' commands."""
    names = {i: str(i) for i in range(100)}
    names.update({3: "three", 50: "1e", 99: "nan"})
    for transaction in (False, True):
        key = f"{prefix}:{transaction}"
        s = _sink(
            ["HINCRBYFLOAT", key, "total", "${payload.name}"],
            pipeline_size=16,
            transaction=transaction,
        )
        result = _send(s, make_batch(100, names=names))
        assert {f.index for f in result.failed} == {3, 50, 99}
        assert all(
            f.message.startswith("HINCRBYFLOAT: ERR value is not a valid float")
            for f in result.failed
        )
        assert float(client().hget(key, "total")) == sum(
            i for i in range(100) if i not in (3, 50, 99)
        )


def test_pipeline_replies_are_redis_pys_pipeline_replies(prefix: str) -> None:
    """The sink's own pipeline (one write, every reply read) answers as redis-py's
    ``pipeline(transaction=False).execute(raise_on_error=False)``: the same replies in the
    same places, error replies as the same errors, and leaves the same data. Values: CR/LF,
    NUL, non-UTF-8, 1 MB."""
    from conveyor.sinks import redis as redis_sink

    big = b"\x00\r\n\xff" * 262_144

    def commands(p: str) -> list[list[bytes | str]]:
        return [
            ["SET", f"{p}:a".encode(), b"one\r\n*2\r\n$3\r\nDEL"],
            ["INCR", f"{p}:a".encode()],  # a string: refused, the rest still runs
            ["HSET", f"{p}:h".encode(), b"f\x00", b"\xff\xfe", b"g", big],
            ["SADD", f"{p}:h".encode(), b"x"],  # WRONGTYPE
            ["RPUSH", f"{p}:l".encode(), b"1", b"2", b"3"],
            ["HINCRBYFLOAT", f"{p}:n".encode(), b"t", b"nan"],
            ["GET", f"{p}:a".encode()],
        ]

    s = _sink(f"SET {prefix}:x y")
    s.init_sink()
    r = client()
    try:

        def ours_of(cmds: list[list[bytes | str]]) -> list[Any]:
            return redis_sink.pipeline_packed(
                s._client, lambda conn: conn.pack_commands(cmds), len(cmds)
            )

        ours = ours_of(commands(f"{prefix}:ours"))
        pipe = r.pipeline(transaction=False)
        for cmd in commands(f"{prefix}:theirs"):
            pipe.execute_command(*cmd)
        theirs = pipe.execute(raise_on_error=False)
        assert len(ours) == len(theirs) == 7
        for mine, other in zip(ours, theirs, strict=True):
            if isinstance(other, Exception):
                assert type(mine) is type(other)
                assert redis_sink.redis_error_text(mine) == redis_sink.redis_error_text(other)
            else:
                assert not isinstance(mine, Exception), mine
        assert [type(x).__name__ for x in ours] == [
            "bytes", "ResponseError", "int", "ResponseError", "int", "ResponseError", "bytes"
        ]  # fmt: skip
        for k in ("a", "l"):
            assert r.dump(f"{prefix}:ours:{k}") == r.dump(f"{prefix}:theirs:{k}")
        assert r.hgetall(f"{prefix}:ours:h") == r.hgetall(f"{prefix}:theirs:h")
        assert r.hget(f"{prefix}:ours:h", b"g") == big
        # The connection is in step: the next pipeline's replies are its own.
        assert ours_of([["GET", f"{prefix}:ours:a".encode()]]) == [b"one\r\n*2\r\n$3\r\nDEL"]
    finally:
        s.cleanup_sink()


def test_several_commands_per_row(prefix: str) -> None:
    """A row fails once even when it has several commands; its earlier commands stay written (documented)."""
    client().set(f"{prefix}:idx", b"a string, not a set")
    s = _sink(
        f"HSET {prefix}:${{payload.id}} name ${{payload.name}}",
        f"EXPIRE {prefix}:${{payload.id}} 3600",
        f"SADD {prefix}:idx:${{payload.amount}} ${{payload.id}}",
    )
    result = _send(s, make_batch(4, amounts={2: None}))
    assert [f.index for f in result.failed] == [2]
    r = client()
    assert 0 < r.ttl(f"{prefix}:1") <= 3600
    assert r.smembers(f"{prefix}:idx:1.5") == {b"1"}
    assert not r.exists(f"{prefix}:2")  # row 2 could not fill its templates: nothing was sent
    # WRONGTYPE in the last command of a row: the row fails, its HSET stays.
    s = _sink(
        f"HSET {prefix}:w${{payload.id}} name ${{payload.name}}",
        f"SADD {prefix}:idx ${{payload.id}}",
    )
    result = _send(s, make_batch(2))
    assert [f.index for f in result.failed] == [0, 1]
    assert all(f.message.startswith("SADD: WRONGTYPE") for f in result.failed)
    assert r.hget(f"{prefix}:w0", "name") == b"name 0"


def test_transactions_use_multi_exec(prefix: str) -> None:
    r = client()

    def execs() -> int:
        return int(r.info("commandstats").get("cmdstat_exec", {}).get("calls", 0))

    before = execs()
    s = _sink(
        f"SET {prefix}:${{payload.id}} ${{payload.name}}", transaction=True, pipeline_size=100
    )
    assert _send(s, make_batch(450)).failed == ()
    assert execs() - before >= 5  # one MULTI/EXEC per chunk of 100 rows
    assert len(list(r.scan_iter(match=f"{prefix}:*", count=1000))) == 450


def test_pipeline_size_chunks(prefix: str) -> None:
    s = _sink(f"SET {prefix}:${{payload.id}} ${{payload.name}}", pipeline_size=7)
    assert _send(s, make_batch(500, names={13: None})).failed[0].index == 13
    assert len(list(client().scan_iter(match=f"{prefix}:*", count=1000))) == 499


def test_db_number(prefix: str) -> None:
    s = _sink(f"SET {prefix}:${{payload.id}} ${{payload.name}}", db=3)
    assert _send(s, make_batch(2)).failed == ()
    r3 = client(db=3)
    try:
        assert r3.get(f"{prefix}:1") == b"name 1"
        assert client().get(f"{prefix}:1") is None
    finally:
        delete_prefix(r3, prefix)


def test_unknown_command_or_wrong_arity_fails_at_start() -> None:
    with pytest.raises(
        PermanentSinkError, match=r"commands\[1\]: Redis does not know the command 'HSETX'"
    ):
        _sink("SET a b", "HSETX k f v").init_sink()
    with pytest.raises(PermanentSinkError, match=r"commands\[0\]: HSET takes at least 4 words"):
        _sink("HSET k f").init_sink()
    with pytest.raises(PermanentSinkError, match=r"GET takes exactly 2 words"):
        _sink("GET k extra").init_sink()


@pytest.fixture
def acl_user() -> Iterator[tuple[str, str]]:
    user, pw = f"conveyor_{uuid.uuid4().hex[:8]}", "pw with spaces"
    r = client()
    # No HSET, and no COMMAND either: the sink then skips its start-up check of the templates.
    r.execute_command("ACL", "SETUSER", user, "on", f">{pw}", "~*", "+@all", "-hset", "-command")
    try:
        yield user, pw
    finally:
        r.execute_command("ACL", "DELUSER", user)


def test_acl_user_password_and_permissions(prefix: str, acl_user: tuple[str, str]) -> None:
    user, pw = acl_user
    ok = _sink(f"SET {prefix}:${{payload.id}} ${{payload.name}}", username=user, password=pw)
    assert (
        pw not in repr(ok.config)
        and pw not in json.dumps(ok.config.redacted())
        and pw not in ok.describe()
    )
    assert _send(ok, make_batch(3)).failed == ()
    assert client().get(f"{prefix}:2") == b"name 2"

    wrong = _sink(f"SET {prefix}:${{payload.id}} x", username=user, password="wrong")
    with pytest.raises(PermanentSinkError, match="(?i)(WRONGPASS|invalid username-password)"):
        wrong.init_sink()
    wrong.cleanup_sink()

    for transaction in (False, True):  # NOPERM: per command in a pipeline, at queueing in MULTI
        denied = _sink(
            f"HSET {prefix}:${{payload.id}} n ${{payload.name}}",
            username=user,
            password=pw,
            transaction=transaction,
        )
        denied.init_sink()
        try:
            with pytest.raises(
                PermanentSinkError,
                match="NOPERM this user has no permissions to run the 'hset' command",
            ):
                denied.send_batch(make_batch(3))
        finally:
            denied.cleanup_sink()


def test_fail_fast_without_permission_to_run_scripts_pipelines(prefix: str) -> None:
    """An ACL user without EVALSHA/EVAL: fail_fast falls back to pipelines (logged), the
    batch is still written and a refused command is still that row's failure."""
    user, pw = f"conveyor_{uuid.uuid4().hex[:8]}", "pw"
    r = client()
    r.execute_command("ACL", "SETUSER", user, "on", f">{pw}", "~*", "+@all", "-@scripting")
    try:
        client().set(f"{prefix}:5", b"a string")
        s = _sink(f"HSET {prefix}:${{payload.id}} n ${{payload.name}}", username=user, password=pw)
        s.init_sink()
        s.fail_fast = True
        try:
            assert [f.index for f in s.send_batch(make_batch(3)).failed] == []
            assert [f.index for f in s.send_batch(make_batch(10)).failed] == [5]
            assert s._noscript
        finally:
            s.cleanup_sink()
        assert r.hget(f"{prefix}:2", "n") == b"name 2"
    finally:
        r.execute_command("ACL", "DELUSER", user)


def test_fail_fast_sends_no_chunk_after_a_refused_command(prefix: str) -> None:
    """Under fail_fast the next chunk's script call is built while the server runs the
    current one, but it is sent only after that one ran whole: with chunks of 100 rows and
    row 250 refused, rows 0..249 are written and nothing from the chunks after it."""
    client().set(f"{prefix}:250", b"a string")
    s = _sink(f"HSET {prefix}:${{payload.id}} n ${{payload.name}}", pipeline_size=100)
    s.init_sink()
    s.fail_fast = True
    try:
        failed = s.send_batch(make_batch(1_000)).failed
        assert [f.index for f in failed] == [250]
        assert "WRONGTYPE" in failed[0].message
        written = {int(k.split(b":")[-1]) for k in client().scan_iter(match=f"{prefix}:*")}
        assert written == set(range(251))  # 250 is the string set above, untouched
        assert client().type(f"{prefix}:250") == b"string"
        assert client().type(f"{prefix}:251") == b"none"
        # A row that cannot be built (null name) in a later chunk: the chunks before it and
        # its chunk's rows before it are written, nothing after it.
        client().delete(f"{prefix}:250")
        failed = s.send_batch(make_batch(1_000, names={650: None})).failed
        assert [f.index for f in failed] == [650]
        written = {int(k.split(b":")[-1]) for k in client().scan_iter(match=f"{prefix}:*")}
        assert written == set(range(650))
    finally:
        s.cleanup_sink()


def test_fail_fast_loads_its_script_again_after_a_script_flush(prefix: str) -> None:
    """The server forgets scripts (a restart, SCRIPT FLUSH): the next batch loads it again
    and still writes every row, stopping exactly at a refused command."""
    s = _sink(f"HSET {prefix}:${{payload.id}} n ${{payload.name}}", pipeline_size=50)
    s.init_sink()
    s.fail_fast = True
    try:
        assert s.send_batch(make_batch(120)).failed == ()
        client().script_flush()
        client().set(f"{prefix}:130", b"a string")
        failed = s.send_batch(make_batch(200)).failed
        assert [f.index for f in failed] == [130]
        assert client().hget(f"{prefix}:129", "n") == b"name 129"
        assert client().type(f"{prefix}:131") == b"none"
        assert client().script_exists(STOP_AT_FIRST_ERROR_SHA) == [True]
    finally:
        s.cleanup_sink()


def test_fail_fast_with_a_slow_or_vanishing_server_sends_no_chunk_unacknowledged(
    prefix: str,
) -> None:
    """Under fail_fast (the script path, the default policy's), a server whose reply does
    not come within socket_timeout_s is a transient error, and the chunk after the
    unanswered one was never sent (built ahead, sent only after a reply): the server holds
    the first chunk's rows only. A connection cut mid-call is transient too. Each time the
    batch sent again writes every row (at-least-once: the first chunk again)."""
    proxy = CuttingRelay((HOST, PORT))
    s = _sink(
        f"HSET {prefix}:${{payload.id}} n ${{payload.name}}",
        port=proxy.port,
        pipeline_size=500,
        socket_timeout_s=1,
    )
    s.init_sink()
    s.fail_fast = True
    batch = make_batch(2_000)

    def written() -> set[int]:
        return {int(k.split(b":")[-1]) for k in client().scan_iter(match=f"{prefix}:*")}

    try:
        # slow: the script runs, its reply is held back; then the server vanishes while a
        # reply is due
        for fail, error in ((None, "timeout|timed out"), (proxy.cut, "connection|closed")):
            client().delete(*[f"{prefix}:{i}" for i in range(2_000)])
            proxy.replies.clear()
            if fail is not None:
                threading.Timer(0.3, fail).start()
            with pytest.raises(TransientSinkError, match=f"(?i){error}"):
                s.send_batch(batch)
            assert written() == set(range(500))
            proxy.replies.set()
            assert s.send_batch(batch).failed == ()
            assert written() == set(range(2_000))
        assert client().hget(f"{prefix}:1999", "n") == b"name 1999"
    finally:
        proxy.replies.set()
        s.cleanup_sink()
        proxy.cut(listener=True)


def test_timeout_is_transient(prefix: str) -> None:
    s = _sink(f"BLPOP {prefix}:never 5", socket_timeout_s=0.5)
    s.init_sink()
    try:
        with pytest.raises(TransientSinkError, match="(?i)timeout|timed out"):
            s.send_batch(make_batch(1))
    finally:
        s.cleanup_sink()


def test_connection_killed_mid_batch_is_transient_then_recovers(prefix: str) -> None:
    s = _sink(
        f"SET {prefix}:${{payload.id}} ${{payload.name}}",
        f"BLPOP {prefix}:never 3",
        client_name="conveyor-kill-me",
    )
    s.init_sink()
    r = client()

    def kill() -> None:
        time.sleep(0.5)
        for c in r.client_list():
            if c.get("name") == "conveyor-kill-me":
                r.client_kill_filter(_id=c["id"])

    t = threading.Thread(target=kill)
    t.start()
    try:
        with pytest.raises(TransientSinkError, match="(?i)connection|closed"):
            s.send_batch(make_batch(1))
        t.join()
        s2 = _sink(f"SET {prefix}:${{payload.id}} ${{payload.name}}")
        s2.init_sink()
        assert s2.send_batch(make_batch(2)).failed == ()
        s2.cleanup_sink()
    finally:
        t.join()
        s.cleanup_sink()


def test_idle_connection_closed_by_the_server_is_reopened(prefix: str) -> None:
    s = _sink(f"SET {prefix}:${{payload.id}} ${{payload.name}}", client_name="conveyor-idle")
    s.init_sink()
    try:
        assert s.send_batch(make_batch(1)).failed == ()
        r = client()
        for c in r.client_list():
            if c.get("name") == "conveyor-idle":
                r.client_kill_filter(_id=c["id"])
        assert s.send_batch(make_batch(2, start=1)).failed == ()
    finally:
        s.cleanup_sink()
    assert client().get(f"{prefix}:2") == b"name 2"


def test_unknown_field_names_are_config_errors() -> None:
    with pytest.raises(
        ConfigError, match=r"sink.commands\[0\]: unknown placeholder \$\{paylod.id\}"
    ):
        _sink("SET ${paylod.id} x")
