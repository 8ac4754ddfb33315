"""The sink contract the loop and every sink share (the interface lives here, in core;
conveyor/sinks/ holds the implementations).

A sink writes batches of messages to one external system. The runtime calls it
from a single thread, in this order::

    validate()            # once; config only, no I/O
    init_sink()           # once; connect, check the target exists and is writable
    send_batch(batch)*    # many times
    cleanup_sink()        # always, also after an error or an interrupt; may be called twice

Contract of ``send_batch(batch) -> SendResult``:

- ``batch`` is a ``pyarrow.Table``: the payload columns (decoded by Spark) plus the
  metadata columns of ``conveyor.core.model.META_COLUMNS`` (``__topic``,
  ``__partition``, ``__offset``, ``__timestamp``, ``__key``, ``__headers``,
  ``__destination``). A sink writes the payload columns unless its config maps
  metadata columns too. Rows are in offset order per partition.
- Returning means every row not listed in ``SendResult.failed`` is durably
  acknowledged by the target (flushed, fsynced, confirmed). The runtime commits
  offsets only after that, so a sink must never return before its writes are safe.
- A row the target rejects for its *content* (constraint violation, type error,
  too large, unroutable) is a data error: report it in ``failed`` with its row
  index and keep going with the other rows. If the system can only reject a
  whole request, the sink may raise ``BatchRejected``; the runtime then bisects the
  batch to isolate the bad rows (:func:`send_isolating`).
- A text column holding invalid UTF-8 (Arrow does not check buffers it did not build)
  makes a sink's conversion of the batch raise ``UnicodeDecodeError`` before anything is
  sent; a sink lets it propagate and the runtime bisects it like ``BatchRejected``: the row
  fails with "column 'x' is not valid UTF-8: ... at byte offset N".
- ``fail_fast`` (an attribute the runtime sets to True under the ``fail`` failure
  policy): write nothing after the first row that fails. Report that row in ``failed``
  (rows after it may be left out); rows before it are written and acknowledged as usual.
  A sink that cannot stop midway (its client reports failures only after the whole
  batch went out) may ignore it: the runtime then commits only the rows before the
  failed one, and the rows it wrote after it are written again on resume.
- Partial acknowledgement: when an outage cuts a batch short and the client says which
  rows were acknowledged (per-record futures, confirms), the sink may return instead of
  raising, listing each row *not* acknowledged as a ``RowFailure`` of kind
  ``ErrorKind.TRANSIENT``. The runtime then re-sends only those rows, with the outage
  backoff; they are never data errors.
- An outage (connection refused/reset, timeout, server shutting down, 429/5xx)
  raises ``TransientSinkError``: nothing of the batch counts as acknowledged and
  the runtime retries it later with backoff. Rows written before the outage may
  be written again (at-least-once); idempotent sinks make that harmless.
- A failure no retry can fix (auth refused, table dropped) raises
  ``PermanentSinkError``; the connector goes to ``Error``.
- ``send_batch`` may block for as long as the target takes, bounded by the sink's
  own timeouts.

A sink that **acknowledges at its own commit** (:class:`AcknowledgesAtCommit`: the lakehouse
sinks, which buffer batches into one table commit per interval or size) changes one word of
the above: returning from ``send_batch`` means the rows not listed as failed are *accepted*
(checked and buffered), not yet durable. The runtime then asks ``uncommitted_rows()`` after
each batch: while it is above zero, that batch's offsets and event times are *held* by the
runtime (never committed to the meta store, never in the watermark); once it is zero (a
``send_batch`` made the sink's commit: the buffer and that batch in one), every held batch is
acknowledged at once, in order. While the source is quiet the runtime calls ``commit_held()``
when ``commit_due()`` says so, and once more when it stops (a clean stop, an error, an
interrupt; never after losing its assignment: a fenced run commits nothing). A failed commit
raises as ``send_batch`` would and keeps the buffer; a batch sent again while buffered
(after such a failure) is buffered once. ``cleanup_sink`` never commits: rows still held are
dropped, and as their offsets were never committed they are read again by the next run.
Other callers of a sink (replays, backfills) call :func:`commit_held` before they count rows
as delivered.

Every sink maps its client's exceptions to one :class:`ErrorKind` (its ``classify_*``
function) and turns a kind into the error to raise with :func:`sink_error`: one path
from a client exception to what the loop does.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import pyarrow as pa

from conveyor.core.errors import BatchRejected, PermanentSinkError, SinkError, TransientSinkError
from conveyor.core.model import Offsets, TopicPartition
from conveyor.core.positions import StoredPositions, TargetBinding, split_writer_id


class ErrorKind(str, enum.Enum):
    """What a failure means for the loop."""

    DATA = "data"  # this row's content: the failure policy decides (dead letter, skip, fail)
    TRANSIENT = "transient"  # an outage: retried with backoff, nothing acknowledged
    PERMANENT = "permanent"  # no retry fixes it: the connector goes to Error


@dataclass(frozen=True)
class RowFailure:
    """One row the target rejected: its index in the batch, the error class and message."""

    index: int
    message: str
    kind: ErrorKind = ErrorKind.DATA


@dataclass(frozen=True)
class SendResult:
    """What a sink acknowledged: every row but the failed ones."""

    rows: int
    failed: tuple[RowFailure, ...] = ()

    @property
    def acked(self) -> int:
        return self.rows - len(self.failed)

    @classmethod
    def all_ok(cls, rows: int) -> SendResult:
        return cls(rows=rows)


class SinkProtocol(Protocol):
    """What the loop needs of a sink (conveyor.sinks.base.Sink implements it)."""

    def validate(self) -> None: ...
    def init_sink(self) -> None: ...
    def send_batch(self, batch: pa.Table) -> SendResult: ...
    def cleanup_sink(self) -> None: ...
    def describe(self) -> str: ...


@runtime_checkable
class OffsetsInTarget(Protocol):
    """A sink whose target keeps the offsets with the data, in its own commit (exactly once:
    the SQL sinks' offsets table, Kafka's transactions, Redis' MULTI/EXEC, the lakehouse
    tables). The run binds it to its writer and generation before the loop starts (a commit
    of an older generation is refused by the target), and the offsets the target holds win
    over the meta store's on start: the meta store keeps a mirror.

    Every position a target keeps names what it belongs to (``core/positions.py``): it is kept
    under the writer id ``<writer>@<incarnation>`` (a connector deleted and created again, or
    of the same name in another project, never finds it), with the log id of its topic and the
    destination it describes. ``bind(binding)`` gives the writer id, the generation and that
    scope; ``target_offsets`` returns the writer's positions as stored, with their log ids and
    destination (the run judges them by ``core.positions.judge_positions``). A row the target's
    positions cover is skipped as written only when the position is usable
    (``TargetBinding.usable``): a position of another log or destination covers nothing, and
    the next commit of its partition replaces it (backwards too). A binding with a
    ``legacy_writer`` takes over, once, the positions its target keeps under that bare name (a
    connector migrated from the release before incarnations), in the target transaction that
    claims the writer id.

    A writer is the connector, or one of its partition tasks (``task_writer``); a backfill's
    writers (``<connector>.backfill-<request>``) are not the connector's and never moved.

    ``move_target_offsets`` is an operator's offsets change (the connector stopped), made in
    the target before the meta store (a crash between leaves the target's value, which wins
    on start). ``connector`` is the connector's writer id, ``generations`` keyed by writer ids.
    In one target transaction where the target has one: for every writer of ``connector``
    (those in ``generations`` and those the target holds, a removed task's included) the fence
    is raised to its generation in ``generations`` (the greatest for a writer not named there),
    so a run of an older generation cannot commit afterwards; partitions in ``offsets`` are set
    to that next offset (backwards too, naming no log: range-checked on start) where a writer
    holds them, in the connector's own writer where none does; partitions in ``forget`` (every
    one, with ``replace``) are dropped, so the meta store's value or ``source.start_from``
    applies. ``FencedError`` when a writer's target already holds a newer generation (a run
    started meanwhile): nothing moved. A sink that cannot move them raises
    ``PermanentSinkError`` saying why, before touching the target.

    ``retire_target_offsets`` forgets every position of the connector's writers (``connector``
    its writer id) when the connector is deleted; it returns what it could not remove and why
    (a lakehouse table keeps its commit marks in its history: unusable by a new incarnation,
    never removed)."""

    def bind(self, binding: TargetBinding) -> None: ...
    def target_offsets(self) -> StoredPositions | None: ...
    def move_target_offsets(
        self,
        connector: str,
        generations: Mapping[str, int],
        offsets: Offsets,
        *,
        forget: Collection[TopicPartition] = (),
        replace: bool = False,
    ) -> None: ...
    def retire_target_offsets(self, connector: str) -> str | None: ...


@runtime_checkable
class AcknowledgesAtCommit(Protocol):
    """A sink whose ``send_batch`` accepts rows into a buffer and acknowledges them only at its
    own commit (the module docstring says what the runtime does with it).

    ``uncommitted_rows()``: rows accepted and not yet committed (0: everything accepted so far
    is durable in the target). ``commit_due()``: the buffer's interval or size is reached (the
    runtime asks while the source is quiet; ``send_batch`` checks it itself). ``commit_held()``:
    commit the buffer now (nothing to do when empty); raises like ``send_batch``, and a commit
    that failed keeps the buffer for the next attempt."""

    def uncommitted_rows(self) -> int: ...
    def commit_due(self) -> bool: ...
    def commit_held(self) -> None: ...


def commit_held(sink: object) -> None:
    """Commit what a sink that acknowledges at its own commit holds (nothing for other sinks):
    what a caller does before it counts the rows it sent as delivered."""
    if isinstance(sink, AcknowledgesAtCommit):
        sink.commit_held()


def task_writer(connector: str, task_id: int) -> str:
    """The writer name a partition task's target commits carry (its own generations)."""
    return f"{connector}.task{task_id}"


def is_writer_of(connector: str, writer: str) -> bool:
    """Whether ``writer`` is ``connector``'s own writer or one of its partition tasks' (a
    backfill's writer is not). Writer ids (``<writer>@<incarnation>``) of another incarnation
    are not."""
    (c_name, c_inc), (w_name, w_inc) = split_writer_id(connector), split_writer_id(writer)
    if c_inc != w_inc:
        return False
    if w_name == c_name:
        return True
    head, _, tid = w_name.rpartition(".task")
    return head == c_name and tid.isdigit()


def sink_error(
    kind: ErrorKind | str, message: str, *, data: ErrorKind = ErrorKind.PERMANENT
) -> SinkError:
    """The error to raise for a failure of ``kind`` that is not about one row.

    ``data`` says what a content error outside a row means for this call: usually the
    config's fault (permanent); a sink whose connection errors look like data errors
    passes ``ErrorKind.TRANSIENT``.
    """
    kind = ErrorKind(kind)
    if kind is ErrorKind.DATA:
        kind = data
    if kind is ErrorKind.PERMANENT:
        return PermanentSinkError(message)
    if kind is ErrorKind.TRANSIENT:
        return TransientSinkError(message)
    return BatchRejected(message)


def isolate_rows(
    indexes: Sequence[int],
    attempt: Callable[[Sequence[int]], Sequence[RowFailure]],
    rejection: Callable[[Exception], str | None],
    *,
    fail_fast: bool = False,
) -> list[RowFailure]:
    """Write ``indexes`` with ``attempt``; bisect a whole-request rejection down to the guilty rows.

    ``attempt`` writes the rows it is given and returns the ones the target refused one by
    one. When it raises an exception that ``rejection`` turns into a message (the request
    refused as a whole for its content), the rows are split in halves and tried again,
    down to single rows, which become RowFailures with that message. ``attempt`` must leave
    nothing of a refused request behind (roll back to its savepoint) before raising. Any
    other exception propagates. The one bisection of the loop and the sinks.

    With ``fail_fast`` (the ``fail`` policy) nothing after the first refused row is
    written: once the left half holds a data failure, the right half is not tried.
    """
    if not indexes:
        return []
    try:
        return list(attempt(indexes))
    except Exception as e:
        message = rejection(e)
        if message is None:
            raise
        if len(indexes) == 1:
            return [RowFailure(indexes[0], message)]
    mid = len(indexes) // 2
    left = isolate_rows(indexes[:mid], attempt, rejection, fail_fast=fail_fast)
    if fail_fast and any(f.kind is ErrorKind.DATA for f in left):
        return left
    return left + isolate_rows(indexes[mid:], attempt, rejection, fail_fast=fail_fast)


def first_failure_only(
    failures: list[RowFailure], todo: list[int]
) -> tuple[list[RowFailure], list[int]]:
    """For ``fail_fast``: the first of the failures a sink found before writing, and the
    rows still to write (those before it)."""
    if not failures:
        return failures, todo
    first = min(failures, key=lambda f: f.index)
    return [first], [i for i in todo if i < first.index]


def utf8_reason(e: UnicodeDecodeError, what: str) -> str:
    """``column 'name' is not valid UTF-8: invalid start byte ff at byte offset 2``."""
    bad = bytes(e.object[e.start : e.end])
    return f"{what} is not valid UTF-8: {e.reason} {bad.hex(' ')} at byte offset {e.start}"


def invalid_utf8(table: pa.Table) -> str | None:
    """Which text column of ``table`` first holds invalid UTF-8, and where; None if none."""
    for name in table.schema.names:
        try:
            table.column(name).to_pylist()
        except UnicodeDecodeError as e:
            return utf8_reason(e, f"column {name!r}")
    return None


def send_isolating(
    sink: SinkProtocol, table: pa.Table, *, fail_fast: bool = False
) -> list[RowFailure]:
    """One send; a whole-request rejection (BatchRejected) is bisected down to the guilty rows.

    With ``fail_fast`` the sink is told to stop at its first failed row (``fail_fast``
    attribute) and the bisection sends nothing after it; the result holds that row and
    the rows before it that an outage left unacknowledged.
    """
    if hasattr(sink, "fail_fast"):
        # Both ways: a policy changed at a batch boundary (live configuration) applies.
        setattr(sink, "fail_fast", fail_fast)  # noqa: B010 - optional on the protocol

    def attempt(rows: Sequence[int]) -> list[RowFailure]:
        first = rows[0]  # bisection keeps ranges contiguous
        part = table.slice(first, len(rows))
        try:
            result = sink.send_batch(part)
        except UnicodeDecodeError as e:
            # A text column holding invalid UTF-8 (Arrow does not check buffers it did not
            # build) fails a sink's conversion of the batch, before anything is sent: a
            # whole-request rejection, bisected down to the row like any other.
            raise BatchRejected(invalid_utf8(part) or utf8_reason(e, "a text value")) from None
        return [RowFailure(first + f.index, f.message, f.kind) for f in result.failed]

    failed = sorted(
        isolate_rows(
            range(table.num_rows),
            attempt,
            lambda e: str(e) if isinstance(e, BatchRejected) else None,
            fail_fast=fail_fast,
        ),
        key=lambda f: f.index,
    )
    if fail_fast:
        first = next((f.index for f in failed if f.kind is ErrorKind.DATA), None)
        failed = [f for f in failed if first is None or f.index <= first]
    return failed
