"""What every connector run uses around its loop, sink, source or task: its errors scrubbed of
secrets, tags, claim, cancel, spec changes. The lifecycle itself is ``jobs/run_template.py``."""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from dagster import (
    DagsterExecutionInterruptedError,
    DagsterRunStatus,
    Failure,
    OpExecutionContext,
    RetryRequested,
)

from conveyor.config.specs import LoadedSpec, load_source, resolved, sync_one
from conveyor.core.errors import AlreadyClaimedError, ConfigError, FencedError
from conveyor.core.host.processes import pid_alive
from conveyor.core.trust.scrubbing import chain_holds_secret, scrub, scrubbed_exception
from conveyor.dagster.tags import TAG_BROKER, TAG_GENERATION
from conveyor.store.meta import Claim, ConnectorRow, MetaStore

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
ORPHANED = "run {}: its parent process is gone; it stopped itself (fenced)"


def scrubbed_errors(op_fn: F) -> F:
    """An op's body whose exceptions never carry a secret this process resolved to Dagster.

    Dagster records the exception an op raises, with its ``__cause__`` / ``__context__``
    chain, in the event log and the compute logs. An exception whose text (or a cause's)
    quotes a resolved value (libpq's ``role "<user>" does not exist``) is raised again as the
    same kind of exception with the scrubbed text (``core.trust.scrubbing``), outside the handler
    and ``from`` a scrubbed cause or None: the original is in no chain.
    """

    @functools.wraps(op_fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        try:
            return op_fn(*args, **kwargs)
        except BaseException as e:
            if isinstance(e, DagsterExecutionInterruptedError) or not chain_holds_secret(e):
                raise
            error = e
        replacement, cause = _scrubbed(error)
        raise replacement.with_traceback(error.__traceback__) from cause

    return body  # type: ignore[return-value]


def _scrubbed(error: BaseException) -> tuple[BaseException, BaseException | None]:
    """A replacement for ``error`` without a secret, and its scrubbed cause (Dagster's own
    control exceptions keep their kind and settings)."""
    cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    scrubbed_cause = scrubbed_exception(cause) if cause is not None else None
    if isinstance(error, Failure):
        return (
            Failure(
                description=scrub(error.description or ""),
                metadata=error.metadata,
                allow_retries=error.allow_retries,
            ),
            scrubbed_cause,
        )
    if isinstance(error, RetryRequested):
        return (
            RetryRequested(max_retries=error.max_retries, seconds_to_wait=error.seconds_to_wait),
            scrubbed_cause,
        )
    return scrubbed_exception(error), None


def holder_alive(context: OpExecutionContext, timeout_s: float) -> Callable[[ConnectorRow], bool]:
    """Whether the run holding a connector is still alive (its run, its pid, its heartbeat)."""

    def alive(row: ConnectorRow) -> bool:
        if row.run_id:
            other = context.instance.get_run_by_id(row.run_id)
            if other is None or other.is_finished:
                return False
        if row.run_host == socket.gethostname() and row.run_pid and not pid_alive(row.run_pid):
            return False
        if row.heartbeat_at is None:
            # Claimed but no heartbeat yet: alive while its run is not finished (checked above).
            return row.run_id is not None
        return row.heartbeat_fresh(time.time(), timeout_s)

    return alive


def claim_run(
    context: OpExecutionContext, store: MetaStore, name: str, heartbeat_timeout_s: float
) -> Claim | None:
    """Claim the connector for this run at the generation its tags carry; None when fenced."""
    tags = context.run.tags
    expected = int(tags[TAG_GENERATION]) if TAG_GENERATION in tags else None
    try:
        return store.claim(
            name,
            run_id=context.run_id,
            expected_generation=expected,
            holder_alive=holder_alive(context, heartbeat_timeout_s),
            broker_id=tags.get(TAG_BROKER),
        )
    except AlreadyClaimedError as e:
        raise Failure(description=str(e)) from None
    except FencedError as e:
        context.log.warning(f"{e}; this run exits without touching the connector")
        return None


def hold_interrupts() -> None:
    """From now on, an interrupt (SIGINT, SIGTERM) of this run process is logged, not raised.

    Called once the run stops for its terminate (the interrupt arrived, or the cancel poll
    saw the run CANCELING first): a terminate is one request, and its interrupt arriving
    a moment after the poll must not cut short the loop's last commit, its final progress
    event and the connector's release. Dagster puts its own handler back when the step
    ends. A no-op outside the main thread (only it can set handlers).
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def held(signo: int, _frame: Any) -> None:
        log.info(
            "interrupt (signal %s) held: this run is already stopping for its terminate", signo
        )

    for signo in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signo, held)


class CancelWatch:
    """Whether this run should stop as a terminate does (call it): its status is CANCELING or
    CANCELED (read at most every ``every_s``), or its parent process is gone (``orphaned``).

    Dagster delivers a terminate as an exception raised by its signal handler in the
    op's thread. If that handler runs inside a garbage-collection callback (a weakref
    finalizer, say), the interpreter prints "Exception ignored in ..." and swallows it:
    the run would go on until a second terminate. Polling the run's own status makes
    a terminate stop the loop within a batch either way.

    A run's parent is the process that launched it (the code server, with the default run
    launcher). When it is gone (``conveyor dev`` stopped, the code server killed) nobody is
    left to terminate the run, and it would hold its connector and its home forever: the run
    sees its parent change and stops itself (``RunTemplate.orphaned`` then fences it).
    """

    def __init__(self, context: OpExecutionContext, every_s: float = 2.0):
        self.context, self.every_s = context, every_s
        self.parent = os.getppid()
        self.checked = 0.0
        self.seen = False
        self.orphaned = False

    def __call__(self) -> bool:
        if self.seen:
            return True
        if os.getppid() != self.parent:
            self.context.log.warning(
                f"this run's parent process {self.parent} is gone; stopping the run"
            )
            self.orphaned = self.seen = True
        elif time.monotonic() - self.checked >= self.every_s:
            self.checked = time.monotonic()
            self.seen = self._canceling()
        if self.seen:
            hold_interrupts()
        return self.seen

    def _canceling(self) -> bool:
        try:
            run = self.context.instance.get_run_by_id(self.context.run_id)
        except Exception as e:  # noqa: BLE001 - the instance may be briefly unreachable
            self.context.log.debug(f"reading this run's status failed: {e}")
            return False
        return run is not None and run.status in (
            DagsterRunStatus.CANCELING,
            DagsterRunStatus.CANCELED,
        )


def cancel_requested(context: OpExecutionContext, every_s: float = 2.0) -> CancelWatch:
    """True once this run is CANCELING or CANCELED, or its parent is gone (``CancelWatch``)."""
    return CancelWatch(context, every_s)


def next_spec(
    context: OpExecutionContext, store: MetaStore, current: LoadedSpec
) -> tuple[LoadedSpec, str | None]:
    """The connector's spec file as it is now (and its hash); the current spec when the new
    one is invalid, with the stored hash, so that the same change is not taken up again."""
    new = load_source(current.name, current.source)
    if new.ok:
        sync_one(store, new)
        context.log.info(
            f"connector {current.name}: taking on its changed spec ({(new.spec_hash() or '')[:12]}) "
            "at a batch boundary, in this run"
        )
        return new, new.spec_hash()
    context.log.warning(
        f"connector {current.name}: its spec changed but is invalid ({new.error}); "
        "going on with the last valid one"
    )
    return current, store.get(current.name).spec_hash


def current_spec_resolved(name: str, source: str | None) -> LoadedSpec:
    """A one-off job's connector as its spec file says now (replay, backfill, maintenance), its
    references resolved here, in the run; a Dagster Failure naming what is wrong otherwise."""
    from dagster import Failure

    current = load_source(name, source)
    if not current.ok or current.spec is None or current.sink is None:
        raise Failure(description=f"connector {name!r} has an invalid spec: {current.error}")
    try:
        return resolved(current)  # secrets resolved here, in the run, only
    except ConfigError as e:
        raise Failure(description=f"connector {name!r}: {e}") from None
