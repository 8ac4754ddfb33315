"""The Redis sink with ``delivery: exactly_once`` against the machine's Redis: a batch's commands
and the source offsets they end at run in one MULTI/EXEC watching the offsets hash, so XADD and
INCR templates (not idempotent) apply once per message however often a batch is sent; a zombie
(an older generation) writes nothing; a writer that commits between WATCH and EXEC makes the batch
retry, which then writes only what is new; a command that fails when it runs fails its row only."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.core.errors import FencedError, TransientSinkError
from conveyor.core.model import TopicPartition
from conveyor.core.positions import TargetBinding
from conveyor.sinks import redis_transactions as rt
from tests.positions import offsets_of
from tests.sinks.contract import make_batch, unique
from tests.sinks.test_redis import _sink, client, delete_prefix

pytestmark = pytest.mark.integration


@pytest.fixture
def prefix() -> Any:
    p = unique("conveyor_eos")
    yield p
    delete_prefix(client(), p)


def eos(prefix: str, writer: str, generation: int) -> Any:
    s = _sink(
        f"XADD {prefix}:stream * id ${{payload.id}}",
        f"INCR {prefix}:count",
        delivery="exactly_once",
    )
    s.bind(TargetBinding(writer, generation))
    s.init_sink()
    return s


def test_not_idempotent_commands_apply_once_however_often_a_batch_is_sent(prefix):
    writer = f"{prefix}:w"
    s = eos(prefix, writer, 1)
    try:
        assert offsets_of(s.target_offsets()) == {}
        for _ in range(3):  # the batch sent again, as after a crash before the meta store's commit
            assert s.send_batch(make_batch(10)).failed == ()
        assert s.send_batch(make_batch(5, start=8)).failed == ()  # overlaps: 8, 9 covered
        assert offsets_of(s.target_offsets()) == {TopicPartition("orders", 0): 13}
    finally:
        s.cleanup_sink()
    r = client()
    assert r.xlen(f"{prefix}:stream") == 13 and int(r.get(f"{prefix}:count")) == 13
    r.delete(rt.offsets_key(writer))


def test_a_zombie_writes_nothing(prefix):
    writer = f"{prefix}:w"
    new = eos(prefix, writer, 2)
    old = eos(prefix, writer, 1)
    try:
        new.send_batch(make_batch(3))
        with pytest.raises(FencedError, match="generation 2"):
            old.send_batch(make_batch(3, start=3))
        with pytest.raises(FencedError):
            offsets_of(old.target_offsets())
    finally:
        new.cleanup_sink()
        old.cleanup_sink()
    r = client()
    assert r.xlen(f"{prefix}:stream") == 3
    r.delete(rt.offsets_key(writer))


def test_a_commit_between_watch_and_exec_retries_and_writes_only_what_is_new(prefix, monkeypatch):
    writer = f"{prefix}:w"
    s = eos(prefix, writer, 1)
    other = eos(prefix, writer, 1)  # the same writer's batch, committed by another connection
    real = rt.run_transaction
    raced = []

    def racing(pipe, commands, key, fields):
        if not raced:
            raced.append(True)
            other.send_batch(make_batch(4))  # commits 0..3 after this batch's WATCH
        return real(pipe, commands, key, fields)

    try:
        monkeypatch.setattr(rt, "run_transaction", racing)
        with pytest.raises(TransientSinkError, match="another writer committed"):
            s.send_batch(make_batch(6))
        assert s.send_batch(make_batch(6)).failed == ()  # the retry: only 4 and 5
    finally:
        s.cleanup_sink()
        other.cleanup_sink()
    r = client()
    assert r.xlen(f"{prefix}:stream") == 6 and int(r.get(f"{prefix}:count")) == 6
    r.delete(rt.offsets_key(writer))


def test_a_command_failing_when_it_runs_fails_its_row_and_the_offsets_move_on(prefix):
    writer = f"{prefix}:w"
    r = client()
    r.set(f"{prefix}:3", "a string, not a hash")
    s = _sink(f"HSET {prefix}:${{payload.id}} name ${{payload.name}}", delivery="exactly_once")
    s.bind(TargetBinding(writer, 1))
    s.init_sink()
    try:
        res = s.send_batch(make_batch(5))
        assert [f.index for f in res.failed] == [3] and "WRONGTYPE" in res.failed[0].message
        assert offsets_of(s.target_offsets()) == {TopicPartition("orders", 0): 5}
    finally:
        s.cleanup_sink()
    assert r.hget(f"{prefix}:4", "name") == b"name 4"
    r.delete(rt.offsets_key(writer))


def test_exactly_once_is_for_a_standalone_server():
    from conveyor.sinks.redis import RedisSinkConfig

    with pytest.raises(Exception, match="standalone only"):
        RedisSinkConfig.model_validate(
            {
                "type": "redis",
                "mode": "cluster",
                "commands": ["SET k v"],
                "delivery": "exactly_once",
                "startup_nodes": ["127.0.0.1:7000"],
            }
        )
