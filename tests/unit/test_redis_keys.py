"""``sinks/redis_keys.py``: which arguments of a template are keys (from COMMAND INFO replies as
Redis 7.0 sends them, in RESP3's maps and RESP2's flat lists, and an older server's), and the
reserved prefix applied the same way by ``render_batch`` and the Arrow encoding."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from conveyor.core.errors import ConfigError
from conveyor.sinks import build_sink
from conveyor.sinks.redis import (
    BatchValues,
    TemplateSyntaxError,
    encode_commands,
    parse_command,
    render_batch,
)
from conveyor.sinks.redis_keys import key_positions
from tests.sinks.contract import make_batch


def spec(begin: dict[str, Any], find: dict[str, Any]) -> dict[bytes, Any]:
    def raw(d: dict[str, Any]) -> dict[bytes, Any]:
        return {k.encode(): raw(v) if isinstance(v, dict) else v for k, v in d.items()}

    return raw({"flags": [b"RW"], "begin_search": begin, "find_keys": find})


def index(i: int) -> dict[str, Any]:
    return {"type": b"index", "spec": {"index": i}}


def keyword(word: str, start: int) -> dict[str, Any]:
    return {"type": b"keyword", "spec": {"keyword": word.encode(), "startfrom": start}}


def rng(last: int, step: int = 1, limit: int = 0) -> dict[str, Any]:
    return {"type": b"range", "spec": {"lastkey": last, "keystep": step, "limit": limit}}


def keynum(idx: int, first: int, step: int = 1) -> dict[str, Any]:
    return {"type": b"keynum", "spec": {"keynumidx": idx, "firstkey": first, "keystep": step}}


UNKNOWN = {"type": b"unknown", "spec": {}}


def info(name: str, specs: list[Any], subs: list[Any] | None = None) -> list[Any]:
    """A COMMAND INFO reply of Redis 7 (name, arity, flags, first/last/step, ACL categories,
    tips, key specs, subcommands)."""
    return [[name.encode(), -2, [b"write"], 1, 1, 1, [b"@write"], [], specs, subs or []]]


def flat(v: Any) -> Any:
    """RESP2's shape of a reply: every map a flat list of names and values."""
    if isinstance(v, dict):
        return [x for k, val in v.items() for x in (k, flat(val))]
    if isinstance(v, list):
        return [flat(x) for x in v]
    return v


REPLIES = {  # as Redis 7.0.15 answers (tests/sinks/test_redis_reserved_keys.py runs against it)
    "HSET": info("hset", [spec(index(1), rng(0))]),
    "MSET": info("mset", [spec(index(1), rng(-1, 2))]),
    "RENAME": info("rename", [spec(index(1), rng(0)), spec(index(2), rng(0))]),
    "BITOP": info("bitop", [spec(index(2), rng(0)), spec(index(3), rng(-1))]),
    "ZUNIONSTORE": info("zunionstore", [spec(index(1), rng(0)), spec(index(2), keynum(0, 1))]),
    "XREAD": info("xread", [spec(keyword("STREAMS", 1), rng(-1, 1, 2))]),
    "GEORADIUS": info(
        "georadius",
        [
            spec(index(1), rng(0)),
            spec(keyword("STORE", 6), rng(0)),
            spec(keyword("STOREDIST", 6), rng(0)),
        ],
    ),  # fmt: skip
    "MIGRATE": info("migrate", [spec(index(3), rng(0)), spec(keyword("KEYS", -2), rng(-1))]),
    "SORT": info("sort", [spec(index(1), rng(0)), spec(UNKNOWN, UNKNOWN)]),
    "PUBLISH": info("publish", []),
    "XGROUP": info(
        "xgroup",
        [],
        [["xgroup|create", -5, [b"write"], 2, 2, 1, [], [], [spec(index(2), rng(0))], []]],
    ),
}


KEY_CASES: list[tuple[str, set[int] | None]] = [
    ("HSET h:${key} f ${payload}", {1}),
    ("MSET a ${key} b ${payload} c 1", {1, 3, 5}),
    ("RENAME ${key} ${payload}", {1, 2}),
    ("BITOP AND dest ${key} ${payload}", {2, 3, 4}),
    ("ZUNIONSTORE dest 2 ${key} ${payload} WEIGHTS 1 2", {1, 3, 4}),
    ("ZUNIONSTORE dest ${payload.n} ${key} b", None),  # the key count from the message
    ("XREAD COUNT 10 STREAMS s1 ${key} 0 0", {4, 5}),
    ("XREAD COUNT ${payload.n} STREAMS s1 0", None),  # could be the keyword itself
    ("GEORADIUS g 0 0 5 km STORE ${key}", {1, 7}),
    ("GEORADIUS g 0 0 5 km", {1}),
    ("MIGRATE h 6379 '' 0 5000 KEYS a ${key}", {3, 7, 8}),
    ("SORT l STORE ${key}", None),  # a key spec Redis marks unknown
    ("PUBLISH conv ${payload}", set()),
    ("XGROUP CREATE ${key} g $", {2}),
    ("XGROUP ${payload.sub} s g $", None),  # the subcommand from the message
]


@pytest.mark.parametrize("shape", ["resp3", "resp2"])
@pytest.mark.parametrize(("template", "keys"), KEY_CASES)
def test_key_arguments_from_command_info(template: str, keys: set[int] | None, shape: str):
    t = parse_command(template)
    reply = REPLIES[t.name]
    got = key_positions(flat(reply) if shape == "resp2" else reply, t.args)
    assert got == (None if keys is None else frozenset(keys))


def test_older_servers_and_replies_not_understood() -> None:
    t = parse_command("MSET a 1 ${key} 2")
    redis6 = [[b"mset", -3, [b"write", b"denyoom"], 1, -1, 2, [b"@write"]]]  # no key specs
    assert key_positions(redis6, t.args) == frozenset({1, 3})
    movable = [[b"zunionstore", -4, [b"write", b"movablekeys"], 1, 1, 1, [b"@write"]]]
    assert key_positions(movable, parse_command("ZUNIONSTORE d 1 ${key}").args) is None
    for junk in (None, [None], [], "ERR", [[b"x", -2, [], 1]], info("x", [{b"flags": 1}])):
        assert key_positions(junk, t.args) is None  # every argument checked then


RESERVED = b"conveyor:offsets:other@inc"


def batch_of(names: dict[int, bytes]) -> Any:
    return make_batch(4, names={i: v.decode() for i, v in names.items()})


@pytest.mark.parametrize("argv", [False, True])
def test_only_key_arguments_fail_a_row_and_both_encodings_agree(argv: bool) -> None:
    batch = batch_of({1: RESERVED, 2: b"conv" + RESERVED, 3: b"x"})
    known = parse_command("HSET ${payload.name} f ${payload.name}")
    cases = {
        frozenset({1}): {1: RESERVED},  # the key argument (1): row 1
        frozenset({3}): {1: RESERVED},  # the value (3)
        frozenset(): {},  # no key at all (PUBLISH-like): nothing refused
        None: {1: RESERVED},  # COMMAND INFO not available: every argument
    }
    for keys, refused in cases.items():
        t = dataclasses.replace(known, keys=keys)
        rows, bad = render_batch([t], batch)
        _, errors = encode_commands([t], BatchValues(batch), argv=argv)
        assert errors == bad, keys
        assert sorted(bad) == sorted(refused), keys
        for i, key in refused.items():
            assert bad[i].startswith(f"HSET: the key {key.decode()!r} is under the prefix")
            assert rows[i] is None
    joined = parse_command("SET ${payload.name}:${key} v")  # text around: the value as filled
    rows, bad = render_batch([joined], batch_of({0: b"conveyor:"}))
    _, errors = encode_commands([joined], BatchValues(batch_of({0: b"conveyor:"})), argv=argv)
    assert list(bad) == [0] and errors == bad and "'conveyor::k0'" in bad[0]


def test_a_rows_first_error_wins_in_both_encodings() -> None:
    batch = make_batch(3, names={0: None, 1: RESERVED.decode()})
    templates = [parse_command("SET ${payload.name} 1"), parse_command("SET a ${payload.nope}")]
    _, bad = render_batch(templates, batch)
    _, errors = encode_commands(templates, BatchValues(batch), argv=False)
    assert errors == bad
    assert "is null" in bad[0] and "under the prefix" in bad[1] and "no field" in bad[2]


@pytest.mark.parametrize(
    "template",
    [
        "SET conveyor:offsets:x 1",
        "HSET h f conveyor:x",  # wherever it stands: literal text is checked without the server
        "SET conveyor:${key} 1",
        "EVAL 'return 1' 0",
        "evalsha abc 0",
        "FCALL f 0",
        "FLUSHDB",
        "FLUSHALL ASYNC",
        "SWAPDB 0 1",
    ],
)
def test_literal_reserved_text_and_commands_reaching_any_key_are_refused(template: str) -> None:
    with pytest.raises(TemplateSyntaxError, match="conveyor:"):
        parse_command(template)
    with pytest.raises(ConfigError, match=r"sink\.commands\[0\]"):
        build_sink({"type": "redis", "commands": [template]})


def test_text_that_only_may_become_reserved_is_left_to_the_rows() -> None:
    for template in ("SET conv${key} 1", "SET x:conveyor:y 1", "SET Conveyor:x 1", "GET ${key}"):
        assert parse_command(template).keys is None
    with pytest.raises(ConfigError, match=r"sink\.delete_commands\[0\]: .*conveyor:"):
        build_sink(
            {"type": "redis", "commands": ["SET a 1"], "delete_enabled": True,
             "delete_commands": ["DEL conveyor:offsets:x"]}
        )  # fmt: skip
