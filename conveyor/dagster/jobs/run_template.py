"""The one run template of every connector run, sink, source or partition task (as Kafka
Connect's ``WorkerTask`` under ``WorkerSinkTask`` and ``WorkerSourceTask``).

``RunTemplate.execute`` is the whole lifecycle, the same for each kind::

    claim         the connector at the run's generation (a task: its grant)    kind: claim()
    build         the loop for the spec, the counters carried over             kind: build_loop()
    supervise     the loop on its own thread; the op's thread heartbeats for
                  it, judges its stages (status, Degraded, self-restart) and
                  takes the terminate                                         jobs/supervision.py
    again         after a spec change (a task: a grant change too), at a batch
                  boundary, in the same run                                    kind: reconfigure()
    close         the loop closed its clients; what the kind reports after it  kind: loop_ended()
    end           a terminate ends the run within a bound, even with the op's
                  thread stuck                                                jobs/stop_deadline.py
    outcome       a terminate: Stopped (re-raised); an error: the outcome
                  table (``core.engine.failure.run_outcome``); the desired
                  state: Stopped                                               kind: release()

The loops share the rest (``core.engine.stopping.LoopControl``): heartbeat, status changes, rate,
stop and pause, outage retries over one set of errors (``core.errors.OUTAGES``). A kind
supplies only what differs: how it claims, builds its loop (its counters, its fence: the
committer or state writer it gives the loop) and records its ending.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from typing import Any

from dagster import (
    DagsterExecutionInterruptedError,
    Failure,
    OpExecutionContext,
    RetryRequested,
)

from conveyor.config.specs import LoadedSpec
from conveyor.core.engine.failure import RunEnding, run_outcome
from conveyor.core.engine.stopping import LoopControl
from conveyor.core.model import ConnectorStatus
from conveyor.core.planning.state import StateChange
from conveyor.dagster.jobs.runs import ORPHANED, CancelWatch, cancel_requested, next_spec
from conveyor.dagster.jobs.stop_deadline import StopDeadline
from conveyor.dagster.jobs.supervision import supervise
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.store.meta import MetaStore

# Attempts of a connector op (RetryRequested) after an outage outlasted its budget, before
# the run fails and the scheduler's restart backoff takes over.
OUTAGE_RUN_RETRIES = 2


class RunTemplate(abc.ABC):
    """One connector run around its loops; ``execute()`` once, from the op's body."""

    label = "connector"  # the run's name in its log lines: "<label> <name>"
    terminated = "offsets committed up to the last acknowledged batch"  # what a terminate kept
    op_retries = OUTAGE_RUN_RETRIES  # op retries after a spent outage budget
    fenced = "Another run owns the connector now"  # what a fenced run's exit says

    def __init__(
        self,
        context: OpExecutionContext,
        conveyor: ConveyorResource,
        loaded: LoadedSpec,
        store: MetaStore,
    ):
        self.context = context
        self.conveyor = conveyor
        self.store = store
        self.name = loaded.name
        self.ls = loaded  # the spec the run goes on with (after each spec change)
        self.generation = 0  # set by claim()
        self.loop: LoopControl | None = None  # the latest loop

    # -- what each kind supplies -----------------------------------------------------------

    @abc.abstractmethod
    def claim(self) -> bool:
        """Claim what the run serves (sets ``generation``); False: fenced, the run exits."""

    @abc.abstractmethod
    def build_loop(
        self, ls: LoadedSpec, spec_hash: str | None, canceled: Callable[[], bool]
    ) -> LoopControl | None:
        """The loop for this spec (``spec_hash``: the one it runs with), its counters carried
        over from ``self.loop``; None: nothing left to run, the run ends."""

    def loop_ended(self, loop: LoopControl) -> None:  # noqa: B027 - optional hook
        """After a loop ended (closed) without an error: what the kind keeps or reports."""

    def reconfigure(
        self, ls: LoadedSpec, running_hash: str | None
    ) -> tuple[LoadedSpec, str | None]:
        """The spec for the next loop after a loop ended for a reconfigure."""
        return next_spec(self.context, self.store, ls)

    def final_counters(self) -> dict[str, Any]:
        """The counters the run ends with (its last heartbeat's)."""
        return self.loop.counters.as_dict() if self.loop is not None else {}

    def release(
        self,
        status: ConnectorStatus,
        reason: str,
        *,
        error: str | None = None,
        counters: dict[str, Any] | None = None,
    ) -> None:
        """The run's ending, fenced by its generation: the connector released in ``status``."""
        self.store.release(
            self.name, self.generation, status, reason, error=error, counters=counters
        )

    def orphaned(self) -> None:
        """The run stopped itself because its parent is gone (``CancelWatch.orphaned``):
        nobody stopped it, so the connector stays meant to run; fenced (its generation bumped,
        nothing of this run commits from now on) and assigned again by the scheduler."""
        self.store.apply(
            self.name, self.generation, StateChange.reset(), ORPHANED.format(self.context.run_id)
        )

    def retry_delay_s(self) -> float:
        """How long an op retry waits (the spec's ``retry.delay``)."""
        spec = self.ls.any_spec
        return spec.retry.delay if spec is not None else 0.0

    # -- the template ----------------------------------------------------------------------

    @property
    def title(self) -> str:
        return f"{self.label} {self.name}"

    def execute(self) -> None:
        """Claim, run the loops (one per spec), end the run by what ended it."""
        if not self.claim():
            return
        canceled = cancel_requested(self.context)
        deadline = StopDeadline.for_run(self.context).start()
        try:
            self._execute(canceled)
        finally:
            deadline.finished()

    def _execute(self, canceled: CancelWatch) -> None:
        try:
            self._run_loops(canceled)
        except DagsterExecutionInterruptedError:
            if canceled.orphaned:
                self.orphaned()
            else:
                self.release(
                    ConnectorStatus.STOPPED, f"run {self.context.run_id} terminated",
                    counters=self.final_counters(),
                )  # fmt: skip
            self.context.log.info(f"{self.title} stopped by terminate; {self.terminated}")
            raise
        except Exception as e:
            self._end(e)
            return
        counters = self.final_counters()
        self.release(
            ConnectorStatus.STOPPED, "stopped: desired state is stopped", counters=counters
        )
        self.context.log.info(f"{self.title} stopped: {json.dumps(counters)}")

    def _run_loops(self, canceled: Callable[[], bool]) -> None:
        """A supervised loop for the spec; a loop that ended for a reconfigure is followed by
        the next. Raises DagsterExecutionInterruptedError for a terminate whose interrupt never
        reached the op (see ``cancel_requested``)."""
        running_hash = self.ls.spec_hash()
        while True:
            loop = self.build_loop(self.ls, running_hash, canceled)
            if loop is None:
                return
            self.loop = loop
            supervise(self.context, loop, self.ls, canceled)
            self.loop_ended(loop)
            if canceled():
                raise DagsterExecutionInterruptedError()
            if not loop.reconfigure_requested:
                return
            self.ls, running_hash = self.reconfigure(self.ls, running_hash)

    def _end(self, error: BaseException) -> None:
        """End the run for ``error`` by the outcome table: returns only when fenced."""
        context = self.context
        outcome = run_outcome(error, op_retries_left=self.op_retries - context.retry_number)
        match outcome.ending:
            case RunEnding.EXIT:
                context.log.warning(f"{error}. {self.fenced}; exiting without committing.")
                return
            case RunEnding.RETRY:
                self.store.apply(
                    self.name,
                    self.generation,
                    StateChange(status=ConnectorStatus.DEGRADED, error=outcome.error),
                    f"{outcome.reason} {context.retry_number + 1}",
                )
                raise RetryRequested(
                    max_retries=self.op_retries, seconds_to_wait=self.retry_delay_s()
                ) from error
            case RunEnding.ERROR:
                self.release(
                    ConnectorStatus.ERROR, outcome.reason, error=outcome.error,
                    counters=self.final_counters(),
                )  # fmt: skip
                raise Failure(description=f"{self.title} stopped with an error: {error}") from None
            case RunEnding.CRASH:
                self.release(ConnectorStatus.ERROR, outcome.reason, error=outcome.error)
                raise error
