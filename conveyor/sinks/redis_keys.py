"""Which arguments of a Redis command template are keys, and the prefix no template may write.

Conveyor keeps keys of its own in the sink's Redis under ``conveyor:`` (``RESERVED_PREFIX``):
the exactly-once offsets hashes ``conveyor:offsets:<writer id>`` (``redis_transactions``). A
template naming one could fence or advance another connector, so (pure rules, applied by
``redis.parse_command``, ``redis.render_batch`` and ``redis.encode_commands``, which every write
path uses: pipelined, Arrow-encoded, scripted, MULTI/EXEC, exactly once, cluster):

- an argument whose literal text starts with ``conveyor:`` is refused when the config is
  validated, wherever it stands (``reserved_literal``: checked without asking the server);
- a key argument whose value, filled from a message, starts with ``conveyor:`` fails that row
  (a data error for ``failure.policy``) naming the key (``reserved_key_error``);
- commands that reach keys their arguments do not name (``UNCHECKABLE_COMMANDS``: scripts,
  functions, ``FLUSHDB``...) are refused when the config is validated.

The key arguments of a template come from the server's ``COMMAND INFO`` at start
(``key_positions``): its key specifications (Redis 7: ``begin_search`` by index or keyword,
``find_keys`` by range or key count, a container command's subcommand), or the first/last/step
of an older server. The documented fallback: where they cannot be told (no ``COMMAND INFO``: a
proxy, an ACL user without it; a key specification marked unknown; a keyword or key count
filled from the message) every argument of that command is taken as a key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from conveyor.sinks.templates import Placeholder

#: Keys Conveyor keeps in a sink's Redis start with this; no template may write them.
RESERVED_PREFIX = b"conveyor:"

#: Commands that reach keys their arguments do not name (a script, a function, the whole
#: database, a replication source): the reserved prefix could not be kept.
UNCHECKABLE_COMMANDS = frozenset(
    {"EVAL", "EVALSHA", "FCALL", "FLUSHDB", "FLUSHALL", "SWAPDB", "DEBUG", "REPLICAOF", "SLAVEOF", "MODULE"}
)  # fmt: skip

Arg = Sequence[bytes | Placeholder]
Positions = frozenset[int] | None  # argument indexes (0: the command name); None: every one


def literal_lead(arg: Arg) -> bytes:
    """The literal text an argument starts with (up to its first placeholder)."""
    lead = b""
    for part in arg:
        if not isinstance(part, bytes):
            break
        lead += part
    return lead


def reserved_literal(args: Sequence[Arg]) -> int | None:
    """The index of the first argument whose literal text starts with the reserved prefix."""
    for i, arg in enumerate(args[1:], 1):
        if literal_lead(arg).startswith(RESERVED_PREFIX):
            return i
    return None


def reserved_key_error(command: str, key: bytes) -> str:
    """The failure of a row whose key argument was filled with a reserved key."""
    shown = key[:120].decode(errors="replace")
    return (
        f"{command}: the key {shown!r} is under the prefix {RESERVED_PREFIX.decode()!r}, where "
        "Conveyor keeps its own keys (the exactly-once offsets): not written"
    )


def key_positions(info: Any, args: Sequence[Arg]) -> Positions:
    """The indexes of ``args`` (a template's words, 0 the command name) that are keys, from
    a raw ``COMMAND INFO`` reply for its command; None when they cannot be told."""
    try:
        return _positions(info, args)
    except (KeyError, IndexError, TypeError, ValueError):  # a reply of a shape not known here
        return None


def _positions(info: Any, args: Sequence[Arg]) -> Positions:
    entry = _entry(info)
    if entry is None:
        return None
    subcommands = entry[9] if len(entry) > 9 and entry[9] else []
    if subcommands:  # a container (XGROUP, OBJECT...): its subcommand's entry
        sub = _literal(args[1]) if len(args) > 1 else None
        full = f"{_text(entry[0])}|{sub.decode(errors='replace')}".lower() if sub else None
        entry = next((s for s in subcommands if full and _text(s[0]).lower() == full), None)
        if entry is None:
            return None
    if len(entry) > 8 and isinstance(entry[8], (list, tuple)):
        found: set[int] = set()
        for spec in entry[8]:
            keys = _spec_positions(_mapping(spec), args)
            if keys is None:
                return None
            found |= keys
        return frozenset(found)
    return _legacy_positions(entry, len(args))


def _entry(info: Any) -> list[Any] | None:
    if isinstance(info, (list, tuple)) and info and isinstance(info[0], (list, tuple)):
        return list(info[0]) if len(info[0]) > 5 else None
    return None


def _legacy_positions(entry: list[Any], argc: int) -> Positions:
    """From a server without key specs (before Redis 7): first key, last key, step."""
    flags = {_text(f).lower() for f in entry[2] or []}
    if "movablekeys" in flags:
        return None
    first, last, step = int(entry[3]), int(entry[4]), int(entry[5])
    if first <= 0:
        return frozenset()
    last = argc + last if last < 0 else last
    return frozenset(range(first, min(last, argc - 1) + 1, max(step, 1)))


def _spec_positions(spec: Mapping[str, Any], args: Sequence[Arg]) -> Positions:
    """The keys one key specification finds in ``args``; None when they depend on a value not
    known before the row (or the specification is of a kind not known here)."""
    search, find = _mapping(spec.get("begin_search")), _mapping(spec.get("find_keys"))
    how, where = _text(search.get("type")), _mapping(search.get("spec"))
    argc = len(args)
    if how == "index":
        begin: int | None = int(where["index"])
    elif how == "keyword":
        begin = _after_keyword(args, _text(where["keyword"]), int(where["startfrom"]))
        if begin == -1:
            return None
    else:
        return None
    if begin is None or begin >= argc:
        return frozenset()  # an optional part the template does not have
    kind, rule = _text(find.get("type")), _mapping(find.get("spec"))
    if kind == "range":
        lastkey, step, limit = int(rule["lastkey"]), int(rule["keystep"]), int(rule["limit"])
        last = begin + lastkey if lastkey >= 0 else argc + lastkey
        if lastkey < 0 and limit > 1:
            last = begin + (last - begin + 1) // limit - 1
        return frozenset(range(begin, min(last, argc - 1) + 1, max(step, 1)))
    if kind == "keynum":
        at, first = begin + int(rule["keynumidx"]), begin + int(rule["firstkey"])
        count = _literal(args[at]) if at < argc else None
        if count is None or not count.isdigit():
            return None
        step = max(int(rule["keystep"]), 1)
        return frozenset(range(first, min(first + int(count) * step, argc), step))
    return None


def _after_keyword(args: Sequence[Arg], keyword: str, start: int) -> int | None:
    """The index after ``keyword`` searched from ``start`` (negative: from the end, backwards);
    None when absent, -1 when an argument filled from the message could be it (and arguments
    follow it)."""
    argc = len(args)
    order = range(start, argc) if start >= 0 else range(argc + start, 0, -1)
    for i in order:
        word = _literal(args[i])
        if word is None:
            if i + 1 < argc:
                return -1
            continue
        if word.decode(errors="replace").upper() == keyword.upper():
            return i + 1
    return None


def _literal(arg: Arg) -> bytes | None:
    """The argument's text when it holds no placeholder."""
    return literal_lead(arg) if all(isinstance(p, bytes) for p in arg) else None


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _mapping(v: Any) -> dict[str, Any]:
    """A key specification's map: a dict (RESP3) or a flat list of names and values (RESP2)."""
    if isinstance(v, Mapping):
        return {_text(k): x for k, x in v.items()}
    if isinstance(v, (list, tuple)) and len(v) % 2 == 0:
        return {_text(v[i]): v[i + 1] for i in range(0, len(v), 2)}
    return {}
