"""Delivering a sink loop's batch (``core.engine.loop``): sending its rows with outage retries and
data-error isolation, re-sending failed rows per the failure policy, then the policy for the
messages that still failed: discard, dead letters (durable before the batch may commit), the
dead-letter limit, and the ``fail`` policy's cut at the first failed message."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa

from conveyor.core.engine.batches import (
    DeadLetter,
    DeadLetterWriter,
    SourceBatch,
    Transformed,
    all_coords,
    coords,
    offsets_before,
)
from conveyor.core.engine.failure import DeadLetterLimiter, FailedMessage, resend_attempts
from conveyor.core.errors import DATA_ERROR_PREFIX, DataPolicyError, TransientSinkError
from conveyor.core.model import FailurePolicyName, FailureSpec, Offsets
from conveyor.core.sink import ErrorKind, RowFailure, SinkProtocol, send_isolating

log = logging.getLogger("conveyor.loop")


@dataclass(frozen=True)
class FailFast:
    """What the ``fail`` policy delivered of a batch: the rows sent (``table``), those before
    the first failed message (``first``, at source index ``cut``) and the offsets to commit."""

    table: pa.Table
    done: int  # source messages handled: all, or those before the failed one
    sent_before: int
    acked: Offsets
    cut: int | None = None
    first: FailedMessage | None = None

    def error(self) -> DataPolicyError:
        """The stop at the first failed message, with its coordinates."""
        first = self.first
        assert first is not None
        return DataPolicyError(
            f"{DATA_ERROR_PREFIX}message {first.where()} failed ({first.error_class}): "
            f"{first.error}; failure policy is 'fail': the connector stops at it "
            "(the messages before it are delivered and committed, nothing after it is "
            "written); fix the target or choose discard, discard_after_retry or "
            "dead_letter, then start the connector",
            topic=first.topic,
            partition=first.partition,
            offset=first.offset,
        )


class Delivery:
    """Sends a batch's rows to the sink and applies the failure policy. ``retry(what, fn)``
    runs ``fn`` under the loop's outage retries (in its stage); ``count`` adds to its counters."""

    def __init__(
        self,
        name: str,
        failure: FailureSpec,
        sink: SinkProtocol,
        dead_letters: DeadLetterWriter | None,
        *,
        retry: Callable[[str, Callable[[], Any]], Any],
        count: Callable[..., None],
        clock: Callable[[], float],
    ):
        self.name = name
        self.failure = failure
        self.sink = sink
        self.dead_letters = dead_letters
        self.retry = retry
        self.count = count
        self.clock = clock
        self.limiter = DeadLetterLimiter(failure.dead_letter)
        self._first_failure: dict[tuple[str, int, int], float] = {}

    def before_first_failure(
        self,
        sb: SourceBatch,
        tr: Transformed,
        decode_failed: list[FailedMessage],
        record: Callable[[pa.Table, list[FailedMessage]], None],
    ) -> FailFast:
        """The ``fail`` policy: deliver the rows before the first failed message and nothing
        after it (``record``: each destination's outcome)."""
        # Each message's index in the source batch, built only once a message failed (a
        # Python tuple per message: 6% of the run process's busy time otherwise).
        positions: dict[tuple[str, int, int], int] = {}

        def position() -> dict[tuple[str, int, int], int]:
            if not positions:
                positions.update((c, i) for i, c in enumerate(all_coords(sb.table)))
            return positions

        cut: int | None = None  # source index of the first failed message
        first: FailedMessage | None = None
        for f in decode_failed:
            i = position()[(f.topic, f.partition, f.offset)]
            if cut is None or i < cut:
                cut, first = i, f
        table = tr.table
        if cut is not None and table.num_rows:
            at = position()
            keep = [at[c] < cut for c in all_coords(table)]
            table = table.filter(pa.array(keep, pa.bool_()))
        sent, data_failed = self.deliver(table)
        record(table, data_failed)
        for f in data_failed:
            i = position()[(f.topic, f.partition, f.offset)]
            if cut is None or i < cut:
                cut, first = i, f
        if first is None or cut is None:
            return FailFast(table, sb.table.num_rows, sent, sb.next_offsets)
        # Only the rows before the failed message count (a sink without fail_fast may
        # have written rows after it: they are not committed and are sent again later).
        at = position()
        sent_before = sum(1 for c in all_coords(table) if at[c] < cut)
        acked = offsets_before(sb.table, cut, sb.next_offsets)
        return FailFast(table, cut, sent_before, acked, cut, first)

    def deliver(self, table: pa.Table) -> tuple[int, list[FailedMessage]]:
        """Send with outage retries and data-error isolation; re-send failed rows per policy."""
        if table.num_rows == 0:
            return 0, []
        failed = self._send_until_acknowledged(table)
        sent = table.num_rows - len(failed)
        attempts = 1
        budget = resend_attempts(self.failure.policy, self.failure.retries)
        while failed and attempts <= budget:
            subset = table.take(pa.array([f.index for f in failed], pa.int64()))
            attempts += 1
            self.count(retries=len(failed))
            again = self.retry("resend", partial(self._send_isolating, subset))
            by_index = {f.index: f for f in again}
            sent += subset.num_rows - len(again)
            failed = [RowFailure(failed[i].index, by_index[i].message) for i in sorted(by_index)]
        return sent, [
            FailedMessage(
                *coords(table, f.index), error=f.message, error_class="data", attempts=attempts
            )
            for f in failed
        ]

    def _send_until_acknowledged(self, table: pa.Table) -> list[RowFailure]:
        """Send with outage retries. Rows a sink reports as not acknowledged because of an
        outage (``RowFailure`` of kind ``transient``: a partial acknowledgement) are the only
        ones sent again; the rows it acknowledged are not. Returns the data failures."""
        data: list[RowFailure] = []
        remaining: list[int] | None = None  # indexes of ``table`` still to send; None: all

        def attempt() -> None:
            nonlocal remaining
            part = table if remaining is None else table.take(pa.array(remaining, pa.int64()))
            back = remaining if remaining is not None else list(range(table.num_rows))
            failed = self._send_isolating(part)
            data.extend(
                RowFailure(back[f.index], f.message, f.kind)
                for f in failed
                if f.kind is not ErrorKind.TRANSIENT
            )
            unacked = [f for f in failed if f.kind is ErrorKind.TRANSIENT]
            if unacked:
                remaining = [back[f.index] for f in unacked]
                raise TransientSinkError(
                    f"{len(unacked)} of {part.num_rows} row(s) not acknowledged: {unacked[0].message}"
                )

        self.retry("send", attempt)
        return sorted(data, key=lambda f: f.index)

    def _send_isolating(self, table: pa.Table) -> list[RowFailure]:
        return send_isolating(
            self.sink, table, fail_fast=self.failure.policy == FailurePolicyName.FAIL
        )

    def apply_policy(self, source: pa.Table, failures: list[FailedMessage]) -> tuple[int, int]:
        """Returns (discarded, dead_lettered). Raises when the policy says stop."""
        if not failures:
            self.limiter.consecutive = 0
            return 0, 0
        policy = self.failure.policy
        bad = {(f.topic, f.partition, f.offset) for f in failures}
        flags = [c in bad for c in all_coords(source)]
        self.limiter.check(source.num_rows, flags)
        if policy in (FailurePolicyName.DISCARD, FailurePolicyName.DISCARD_AFTER_RETRY):
            for f in failures:
                log.warning(
                    "%s: discarded %s after %d attempt(s): %s",
                    self.name,
                    f.where(),
                    f.attempts,
                    f.error,
                )
            return len(failures), 0
        letters = self._dead_letters(source, failures)
        assert self.dead_letters is not None
        self.retry("dead-letter store", lambda: self.dead_letters.write(letters))  # type: ignore[union-attr]
        for f in failures:
            log.warning(
                "%s: dead-lettered %s after %d attempt(s): %s",
                self.name,
                f.where(),
                f.attempts,
                f.error,
            )
        return 0, len(failures)

    def _dead_letters(self, source: pa.Table, failures: list[FailedMessage]) -> list[DeadLetter]:
        now = self.clock()
        index = {c: i for i, c in enumerate(all_coords(source))}
        cols = source.to_pydict()
        out = []
        for f in failures:
            i = index[(f.topic, f.partition, f.offset)]
            ts = cols.get("__timestamp", [None] * (i + 1))[i]
            out.append(
                DeadLetter(
                    failed=f,
                    key=cols.get("__key", [None] * (i + 1))[i],
                    value=cols.get("__value", [None] * (i + 1))[i],
                    headers=[
                        (h["key"], h["value"])
                        for h in (cols.get("__headers", [None] * (i + 1))[i] or [])
                    ],
                    timestamp_ms=int(ts.timestamp() * 1000) if ts is not None else None,
                    first_failure_at=self._first_failure.pop((f.topic, f.partition, f.offset), now),
                    last_failure_at=now,
                )
            )
        return out
