"""Failure decisions: retry delays, the outage budget, dead-letter records and limits, and
how an error ends a connector's run (:func:`run_outcome`).

Pure: no clock calls (``now`` is passed in), randomness from an injected
``random.Random``. Vocabulary follows Dagster's ``RetryPolicy`` (max_retries,
delay, backoff, jitter) so that the connector's ``retry`` config reads the same
as a Dagster op's.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from conveyor.core.errors import (
    DATA_ERROR_PREFIX,
    ConveyorError,
    DeadLetterLimitError,
    FencedError,
    OutageBudgetExceeded,
)
from conveyor.core.model import DeadLetterSpec, FailurePolicyName, RetrySpec
from conveyor.core.trust.scrubbing import scrub


def retry_delay(spec: RetrySpec, attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based)."""
    if attempt < 1:
        raise ValueError("attempt is 1-based")
    if spec.backoff == "exponential":
        base = spec.delay * (2 ** (attempt - 1))
    elif spec.backoff == "linear":
        base = spec.delay * attempt
    else:
        base = spec.delay
    base = min(base, spec.max_delay)
    rng = rng or random.Random()
    if spec.jitter == "full":
        return rng.uniform(0, base)
    if spec.jitter == "plus_minus":
        return max(0.0, base + rng.uniform(-base / 4, base / 4))
    return base


@dataclass
class OutageTracker:
    """Tracks one outage: when it began and how many attempts it has cost."""

    spec: RetrySpec
    rng: random.Random = field(default_factory=random.Random)
    started_at: float | None = None
    attempts: int = 0

    @property
    def active(self) -> bool:
        return self.started_at is not None

    def failed(self, now: float) -> float:
        """Record a failed attempt; return the delay before the next one."""
        if self.started_at is None:
            self.started_at = now
        self.attempts += 1
        return retry_delay(self.spec, self.attempts, self.rng)

    def exhausted(self, now: float) -> bool:
        """True when the outage outlasted ``max_outage`` or used up ``max_retries``."""
        if self.started_at is None:
            return False
        return (
            now - self.started_at
        ) >= self.spec.max_outage or self.attempts > self.spec.max_retries

    def duration(self, now: float) -> float:
        return 0.0 if self.started_at is None else now - self.started_at

    def recovered(self) -> None:
        self.started_at = None
        self.attempts = 0


@dataclass(frozen=True)
class FailedMessage:
    """A message that could not be delivered: where it came from and why."""

    topic: str
    partition: int
    offset: int
    error: str
    error_class: str  # "data" | "decode"
    attempts: int = 1

    def __post_init__(self) -> None:
        # Dead letters and their asset metadata keep this text: never a resolved secret.
        object.__setattr__(self, "error", scrub(self.error))

    def where(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


def resend_attempts(policy: FailurePolicyName, retries: int) -> int:
    """How many times a data-failed message is re-sent before its final fate."""
    if policy in (FailurePolicyName.DISCARD_AFTER_RETRY, FailurePolicyName.DEAD_LETTER):
        return retries
    return 0


@dataclass
class DeadLetterLimiter:
    """Stops a connector that is dead-lettering (or discarding) everything.

    Raises ``DeadLetterLimitError`` when one batch's failed share exceeds
    ``max_ratio`` (batches of at least ``min_batch`` messages) or when
    ``max_consecutive`` messages in a row failed.
    """

    spec: DeadLetterSpec
    min_batch: int = 10
    consecutive: int = 0

    def check(self, batch_size: int, failed_offsets_in_order: list[bool]) -> None:
        """``failed_offsets_in_order``: per message of the batch, in order, whether it failed."""
        failed = sum(failed_offsets_in_order)
        if batch_size >= self.min_batch and failed / max(batch_size, 1) > self.spec.max_ratio:
            raise DeadLetterLimitError(
                f"{DATA_ERROR_PREFIX}{failed} of {batch_size} messages in one batch failed "
                f"(more than max_ratio={self.spec.max_ratio:.0%}); stopping instead of draining the topic"
            )
        run = self.consecutive
        for bad in failed_offsets_in_order:
            run = run + 1 if bad else 0
            if run >= self.spec.max_consecutive:
                raise DeadLetterLimitError(
                    f"{DATA_ERROR_PREFIX}{run} messages in a row failed (max_consecutive={self.spec.max_consecutive}); "
                    "stopping instead of draining the topic"
                )
        self.consecutive = run


# -- how a run ends ----------------------------------------------------------------------------


class RunEnding(str, enum.Enum):
    """What the run's glue does with an error that ended the loop (Dagster's interrupt aside)."""

    EXIT = "exit"  # fenced: another run owns the connector; leave without writing anything
    RETRY = "retry"  # the outage budget is spent: Degraded, the op retries itself once more
    ERROR = "error"  # the connector goes to Error with the message; the run fails
    CRASH = "crash"  # not ours: Error with the class and message; the exception propagates


@dataclass(frozen=True)
class RunOutcome:
    ending: RunEnding
    reason: str  # for the state history
    error: str | None = None  # for last_error (the UI, `connector list`)


def run_outcome(error: BaseException, *, op_retries_left: int = 0) -> RunOutcome:
    """The outcome table of a connector run, sink or source, as one pure function.

    ==========================  ======================================================
    error                       outcome
    ==========================  ======================================================
    FencedError                 EXIT: another run owns the connector
    OutageBudgetExceeded        RETRY while ``op_retries_left``, then ERROR
    any other ConveyorError     ERROR, reason = its class (ConfigError, PermanentSinkError,
                                PermanentSourceError, DataPolicyError, DeadLetterLimitError,
                                StageHungError, RoutingError...)
    anything else               CRASH: a bug or a library's surprise, with its traceback
    ==========================  ======================================================
    """
    if isinstance(error, FencedError):
        return RunOutcome(RunEnding.EXIT, "fenced")
    if isinstance(error, OutageBudgetExceeded):
        if op_retries_left > 0:
            return RunOutcome(RunEnding.RETRY, "outage budget spent, op retry", str(error))
        return RunOutcome(RunEnding.ERROR, "outage budget spent", str(error))
    if isinstance(error, ConveyorError):
        return RunOutcome(RunEnding.ERROR, type(error).__name__, str(error))
    return RunOutcome(RunEnding.CRASH, "unexpected error", f"{type(error).__name__}: {error}")
