"""Exactly once into Redis (``delivery: exactly_once``, standalone): each batch's commands and
the source offsets they end at in one ``MULTI``/``EXEC``, fenced by ``WATCH``.

The offsets live in the hash ``conveyor:offsets:<writer>`` (field ``<topic>/<partition>``: the
next offset; field ``__generation``: the run's generation) of the sink's database. A batch
``WATCH``es the hash, reads it, drops the rows it already covers (a batch sent again after its
``EXEC``), queues the rest's commands and the new offsets, and runs ``EXEC``: all of it or none
(a connection lost before ``EXEC`` leaves nothing). Another writer that committed in between
makes ``EXEC`` fail (retried as an outage: the rows it wrote are then covered). A run that finds
a greater generation recorded is a zombie: ``FencedError``. So ``XADD``, ``LPUSH`` and ``INCR``
templates apply once per message. A command refused while queued aborts the whole transaction
(``EXECABORT``): the batch is bisected to find it (``BatchRejected``); a command that fails when
it runs (``WRONGTYPE``) fails its row only, as MULTI/EXEC does not roll back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.core.errors import BatchRejected, FencedError, TransientSinkError
from conveyor.core.model import Offsets, TopicPartition

GENERATION_FIELD = "__generation"


def offsets_key(writer: str) -> str:
    return f"conveyor:offsets:{writer}"


def parse_offsets(raw: dict[Any, Any]) -> tuple[Offsets, int]:
    """The hash's offsets and the generation recorded (-1: none)."""
    held: Offsets = {}
    generation = -1
    for k, v in raw.items():
        field = k.decode() if isinstance(k, bytes) else str(k)
        value = int(v)
        if field == GENERATION_FIELD:
            generation = value
            continue
        topic, _, partition = field.rpartition("/")
        if topic and partition.isdigit():
            held[TopicPartition(topic, int(partition))] = value
    return held, generation


def offsets_fields(offsets: Offsets, generation: int) -> dict[str, int]:
    fields = {f"{tp.topic}/{tp.partition}": off for tp, off in offsets.items()}
    fields[GENERATION_FIELD] = generation
    return fields


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
