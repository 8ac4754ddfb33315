"""Exactly once into Redis (``delivery: exactly_once``, standalone): each batch's commands and
the source offsets they end at in one ``MULTI``/``EXEC``, fenced by ``WATCH``.

The offsets live in the hash ``conveyor:offsets:<writer id>`` (``<writer>@<incarnation>``,
``core/positions.py``; field ``<topic>/<partition>``: the next offset, then ``|`` and the log id
of the topic it is a position in; field ``__destination``: the destination; field
``__generation``: the run's generation) of the sink's database. A batch
``WATCH``es the hash, reads it, drops the rows it already covers (a batch sent again after its
``EXEC``), queues the rest's commands and the new offsets, and runs ``EXEC``: all of it or none
(a connection lost before ``EXEC`` leaves nothing). Another writer that committed in between
makes ``EXEC`` fail (retried as an outage: the rows it wrote are then covered). A run that finds
a greater generation recorded is a zombie: ``FencedError``. So ``XADD``, ``LPUSH`` and ``INCR``
templates apply once per message. A command refused while queued aborts the whole transaction
(``EXECABORT``): the batch is bisected to find it (``BatchRejected``); a command that fails when
it runs (``WRONGTYPE``) fails its row only, as MULTI/EXEC does not roll back.

An operator's offsets change (``move_offsets``) rewrites every writer's hash of the connector in
one ``MULTI``/``EXEC`` watching them all, each ``__generation`` raised to the writer's new one.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from conveyor.core.errors import BatchRejected, FencedError, TransientSinkError
from conveyor.core.model import Offsets, TopicPartition
from conveyor.core.positions import PositionScope, StoredPosition, StoredPositions, split_writer_id
from conveyor.core.sink import is_writer_of

GENERATION_FIELD = "__generation"
DESTINATION_FIELD = "__destination"


def offsets_key(writer: str) -> str:
    return f"conveyor:offsets:{writer}"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def parse_positions(raw: dict[Any, Any]) -> tuple[StoredPositions, int]:
    """The hash's positions and the generation recorded (-1: none). A field of the release
    before issue 44 (an offset alone) names no log, a hash without ``__destination`` none."""
    held: StoredPositions = {}
    generation = -1
    fields = {_text(k): _text(v) for k, v in raw.items()}
    destination = fields.pop(DESTINATION_FIELD, None) or None
    for field, value in fields.items():
        if field == GENERATION_FIELD:
            generation = int(value)
            continue
        topic, _, partition = field.rpartition("/")
        offset, _, log_id = value.partition("|")
        if topic and partition.isdigit():
            held[TopicPartition(topic, int(partition))] = StoredPosition(
                int(offset), log_id or None, destination
            )
    return held, generation


def parse_offsets(raw: dict[Any, Any]) -> tuple[Offsets, int]:
    """The hash's offsets (whatever they are positions of) and the generation recorded."""
    held, generation = parse_positions(raw)
    return {tp: p.offset for tp, p in held.items()}, generation


def offsets_fields(
    offsets: Offsets, generation: int, scope: PositionScope | None = None
) -> dict[str, int | str]:
    """The fields of ``offsets`` committed by ``generation``, naming ``scope``'s logs and
    destination (none: an operator's offsets, range-checked on start)."""
    fields: dict[str, int | str] = {}
    for tp, off in offsets.items():
        log_id = scope.log_ids.get(tp.topic) if scope is not None else None
        fields[f"{tp.topic}/{tp.partition}"] = f"{off}|{log_id}" if log_id else off
    if scope is not None and scope.destination:
        fields[DESTINATION_FIELD] = scope.destination
    fields[GENERATION_FIELD] = generation
    return fields


def adopt_legacy(client: Any, legacy: str, writer: str, generation: int) -> None:
    """A migrated connector's offsets kept under its bare writer name move to its writer id's
    hash (naming no log: range-checked on start), unless that hash holds offsets already; one
    MULTI/EXEC watching both."""
    from redis import exceptions as rx

    old, new = offsets_key(legacy), offsets_key(writer)
    with client.pipeline(transaction=True) as pipe:
        pipe.watch(old, new)
        mine, _ = parse_offsets(pipe.hgetall(new))
        theirs, _ = parse_offsets(pipe.hgetall(old))
        if mine or not theirs:
            return
        pipe.multi()
        pipe.hset(new, mapping=offsets_fields(theirs, generation))
        pipe.delete(old)
        try:
            pipe.execute()
        except rx.WatchError:
            raise TransientSinkError(f"{old}: changed while being taken over; retrying") from None


def retire(client: Any, connector: str) -> None:
    """Delete the hash of every writer of ``connector`` (a writer id)."""
    keys = writer_keys(client, connector, {})
    found = [k for k in keys.values() if client.exists(k)]
    if found:
        client.delete(*found)


def check_generation(writer: str, recorded: int, mine: int) -> None:
    if recorded > mine:
        raise FencedError(
            f"{writer}: generation {recorded} has committed to Redis; this run is generation "
            f"{mine} and stops without writing"
        )


def run_transaction(
    pipe: Any,
    commands: Sequence[Sequence[Any]],
    key: str,
    fields: dict[str, int],
) -> list[Any]:
    """Queue ``commands`` and the offsets, then ``EXEC`` (the pipeline is watching ``key``):
    the replies of ``commands`` (an error reply in a failed command's place)."""
    from redis import exceptions as rx

    pipe.multi()
    for cmd in commands:
        pipe.execute_command(*cmd)
    pipe.hset(key, mapping=fields)
    try:
        replies = pipe.execute(raise_on_error=False)
    except rx.WatchError:
        raise TransientSinkError(
            f"{key}: another writer committed while this batch was queued; retrying"
        ) from None
    except rx.ExecAbortError as e:
        raise BatchRejected(f"Redis refused a command of the batch: {e}") from None
    if replies and isinstance(replies[0], rx.ExecAbortError):
        raise BatchRejected(f"Redis refused a command of the batch: {replies[0]}")
    return list(replies[: len(commands)])


def writer_keys(client: Any, connector: str, generations: Mapping[str, int]) -> dict[str, str]:
    """Every writer of ``connector`` (a writer id; those named and those with a hash) -> its
    hash's key."""
    prefix = offsets_key(split_writer_id(connector)[0])
    found = client.scan_iter(match=re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*", count=1000)
    keys = {k.decode() if isinstance(k, bytes) else str(k) for k in found}
    writers = {k[len(offsets_key("")) :] for k in keys}
    writers = {w for w in writers if is_writer_of(connector, w)} | set(generations) | {connector}
    return {w: offsets_key(w) for w in sorted(writers)}


def move_offsets(
    client: Any,
    connector: str,
    generations: Mapping[str, int],
    offsets: Offsets,
    *,
    forget: Collection[TopicPartition] = (),
    replace: bool = False,
) -> None:
    """``OffsetsInTarget.move_target_offsets`` on the hashes: one MULTI/EXEC watching every
    writer's hash (a batch committed meanwhile: ``TransientSinkError``, nothing moved)."""
    from redis import exceptions as rx

    keys = writer_keys(client, connector, generations)
    top = max(generations.values())
    with client.pipeline(transaction=True) as pipe:
        pipe.watch(*keys.values())
        held: dict[str, Offsets] = {}
        for writer, key in keys.items():
            held[writer], recorded = parse_offsets(pipe.hgetall(key))
            if recorded > generations.get(writer, top):
                raise FencedError(
                    f"{key} holds generation {recorded}, newer than "
                    f"{generations.get(writer, top)}: a run started meanwhile; nothing moved"
                )
        pipe.multi()
        for writer, key in keys.items():
            gone = list(held[writer]) if replace else [tp for tp in forget if tp in held[writer]]
            if gone:
                pipe.hdel(key, *[f"{tp.topic}/{tp.partition}" for tp in gone])
            mine = {
                tp: off
                for tp, off in offsets.items()
                if tp in held[writer] or (writer == connector and not _held_by_any(held, tp))
            }
            pipe.hset(key, mapping=offsets_fields(mine, generations.get(writer, top)))
        try:
            pipe.execute()
        except rx.WatchError:
            raise TransientSinkError(
                f"{connector}: a writer committed while its offsets were being moved; try again"
            ) from None


def _held_by_any(held: Mapping[str, Offsets], tp: TopicPartition) -> bool:
    return any(tp in known for known in held.values())
