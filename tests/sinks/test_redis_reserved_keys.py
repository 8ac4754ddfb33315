"""The reserved prefix ``conveyor:`` of the Redis sink (issue 45), against the machine's Redis
and a one-node cluster: a key argument filled from a message with a key under it fails that row
(a data error) naming the key, on every write path (pipelined and Arrow-encoded, MULTI/EXEC,
the fail_fast script, exactly once, cluster), and the key it named is left as it was; the same
text in an argument COMMAND INFO says is not a key is written; a literal one is refused when
the config is validated."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from conveyor.core.errors import ConfigError
from conveyor.core.model import TopicPartition
from conveyor.core.positions import TargetBinding
from conveyor.core.sink import ErrorKind
from conveyor.sinks import build_sink
from conveyor.sinks import redis_transactions as rt
from tests.positions import offsets_of
from tests.sinks.contract import make_batch, unique
from tests.sinks.test_redis import CLUSTER, HOST, PORT, client, delete_prefix
from tests.sinks.test_redis import redis_cluster as redis_cluster  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration

ATTACK = "HSET ${payload.name} orders/0 999999 __generation 99"  # advance and fence


@pytest.fixture
def prefix() -> Iterator[str]:
    p = unique("conveyor_rk")
    yield p
    delete_prefix(client(), p)


@pytest.fixture
def victim() -> Iterator[tuple[str, dict[bytes, bytes]]]:
    """Another connector's exactly-once offsets hash, as its own sink wrote it."""
    writer = f"{unique('victim')}@inc1"
    s = build_sink(
        {"type": "redis", "host": HOST, "port": PORT, "delivery": "exactly_once",
         "commands": [f"SET {writer}:${{payload.id}} ${{payload.name}}"]}
    )  # fmt: skip
    s.bind(TargetBinding(writer, 4))
    s.init_sink()
    try:
        assert s.send_batch(make_batch(7)).failed == ()
    finally:
        s.cleanup_sink()
    key = rt.offsets_key(writer)
    before = client().hgetall(key)
    assert before[b"orders/0"] == b"7" and before[b"__generation"] == b"4"
    yield key, before
    r = client()
    r.delete(key, *[f"{writer}:{i}" for i in range(7)])


def rows_naming(prefix: str, key: str, at: int = 3, n: int = 6) -> Any:
    """``n`` messages whose ``name`` is a key of ``prefix``, but row ``at``'s: ``key``."""
    return make_batch(n, names={i: key if i == at else f"{prefix}:n{i}" for i in range(n)})


PATHS = {
    "pipelined": {},  # Arrow-encoded commands, one write per chunk
    "transaction": {"transaction": True},  # redis-py's MULTI/EXEC pipeline
    "scripted": {"fail_fast": True},  # STOP_AT_FIRST_ERROR over Arrow-encoded ARGV
    "exactly_once": {"delivery": "exactly_once"},  # MULTI/EXEC watching its own hash
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_key_under_the_reserved_prefix_from_a_message_fails_its_row_only(
    prefix: str, victim: tuple[str, dict[bytes, bytes]], path: str
) -> None:
    key, before = victim
    over = dict(PATHS[path])
    fail_fast = over.pop("fail_fast", False)
    s = build_sink({"type": "redis", "host": HOST, "port": PORT, "commands": [ATTACK], **over})
    writer = f"{prefix}:w@inc"
    s.bind(TargetBinding(writer, 1))
    s.init_sink()
    s.fail_fast = fail_fast
    try:
        failed = s.send_batch(rows_naming(prefix, key)).failed
        assert [(f.index, f.kind) for f in failed] == [(3, ErrorKind.DATA)]
        assert failed[0].message == (
            f"HSET: the key {key!r} is under the prefix 'conveyor:', where Conveyor keeps its "
            "own keys (the exactly-once offsets): not written"
        )
        if path == "exactly_once":
            assert offsets_of(s.target_offsets()) == {TopicPartition("orders", 0): 6}
    finally:
        s.cleanup_sink()
        client().delete(rt.offsets_key(writer))
    assert client().hgetall(key) == before  # neither advanced nor fenced
    written = {i for i in range(6) if client().exists(f"{prefix}:n{i}")}
    assert written == ({0, 1, 2} if fail_fast else {0, 1, 2, 4, 5})


def test_in_cluster_mode_too(prefix: str, redis_cluster: int) -> None:  # noqa: F811
    from redis.cluster import RedisCluster

    node = RedisCluster(host="127.0.0.1", port=CLUSTER["port"])
    key = f"conveyor:offsets:{unique('victim')}@x"
    node.hset(key, mapping={"orders/0": 5, "__generation": 1})
    s = build_sink(
        {"type": "redis", "mode": "cluster", "host": "127.0.0.1", "port": CLUSTER["port"],
         "commands": [ATTACK]}
    )  # fmt: skip
    s.init_sink()
    try:
        failed = s.send_batch(rows_naming(prefix, key)).failed
        assert [f.index for f in failed] == [3] and repr(key) in failed[0].message
        assert node.hgetall(key) == {b"orders/0": b"5", b"__generation": b"1"}
        assert sum(node.exists(f"{prefix}:n{i}") for i in range(6)) == 5
    finally:
        s.cleanup_sink()
        node.delete(key, *[f"{prefix}:n{i}" for i in range(6)])
        node.close()


def test_only_key_arguments_are_checked_where_command_info_names_them(prefix: str) -> None:
    """HSET's field and value, MSET's values: not keys (COMMAND INFO key specs), so the same
    text is written there; MSET's third argument, RENAME's second: keys, so the row fails."""
    reserved = f"conveyor:offsets:{unique('someone')}@x"
    s = build_sink(
        {"type": "redis", "host": HOST, "port": PORT, "commands": [
            f"HSET {prefix}:h:${{payload.id}} ${{payload.name}} ${{payload.name}}",
            f"MSET {prefix}:m:${{payload.id}} ${{payload.name}} ${{headers.k}} 1",
        ]}
    )  # fmt: skip
    s.init_sink()
    try:
        batch = make_batch(3, names={i: reserved for i in range(3)})
        batch = batch.set_column(
            batch.schema.get_field_index("__headers"),
            "__headers",
            [[[{"key": "k", "value": f"{prefix}:other{i}".encode()}] for i in range(2)]
             + [[{"key": "k", "value": reserved.encode()}]]],
        )  # fmt: skip
        failed = s.send_batch(batch).failed
        assert [f.index for f in failed] == [2] and failed[0].message.startswith("MSET: the key")
        assert client().hget(f"{prefix}:h:0", reserved) == reserved.encode()
        assert client().get(f"{prefix}:m:1") == reserved.encode()
        assert not client().exists(f"{prefix}:h:2")  # none of the failed row's commands ran
        assert not client().exists(reserved)
    finally:
        s.cleanup_sink()
        client().delete(reserved)


@pytest.mark.parametrize(
    "commands",
    [
        ["HSET conveyor:offsets:other@x orders/0 99"],
        ["SET ok:${key} 1", ["RENAME", "x", "conveyor:offsets:${payload.name}"]],
        ["EVAL \"return redis.call('del', KEYS[1])\" 1 x"],
        ["FLUSHDB"],
    ],
)
def test_a_literal_reserved_key_or_a_command_reaching_any_key_is_a_config_error(commands) -> None:
    with pytest.raises(ConfigError, match=r"sink\.commands\[\d\]: .*(conveyor:|reaches keys)"):
        build_sink({"type": "redis", "host": HOST, "port": PORT, "commands": commands})


def test_key_positions_read_the_servers_own_command_info() -> None:
    """The unit tests' COMMAND INFO replies are what this server answers: the same key
    arguments found from its real replies (the sink's raw call: a bytes command name)."""
    from conveyor.sinks.redis import parse_command
    from conveyor.sinks.redis_keys import key_positions
    from tests.unit.test_redis_keys import KEY_CASES

    r = client()
    for template, keys in KEY_CASES:
        t = parse_command(template)
        reply = r.execute_command(b"COMMAND", b"INFO", t.name)
        want = None if keys is None else frozenset(keys)
        assert key_positions(reply, t.args) == want, template
