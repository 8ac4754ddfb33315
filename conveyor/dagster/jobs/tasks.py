"""A partition task's run (``TaskRun``, the task kind of ``jobs/run_template.py``): the sink
connector loop over the partitions the scheduler granted it, supervised as every run.

A run launched for a task carries ``conveyor/task`` and ``conveyor/task_generation``
(plus ``conveyor/connector`` and ``conveyor/broker``). It reads only the partitions its
grant names (``KafkaSource(only=...)``, an explicit ``assign``), commits through the
per-partition fenced ``TaskStore.commit``, and reports per-partition rate and lag in its
heartbeats (``TaskSample``), which the scheduler's planner splits and merges on.

**Handover.** When its grant changes (partitions to release, partitions handed to it)
the heartbeat answers ``RECONFIGURE``: the loop ends at the batch boundary, committing
the acknowledged batch, drops what it read ahead (uncommitted), and the run then
``release``s the moving partitions (their offsets are the ones just committed) and
builds a new loop over its new partitions, from their committed offsets. So a clean
handover reads nothing twice; a run killed before releasing is overtaken by the
scheduler after the heartbeat timeout, from the last committed offsets.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dagster import DagsterExecutionInterruptedError, OpExecutionContext

from conveyor.brokers.kafka import KafkaSource
from conveyor.config.specs import LoadedSpec
from conveyor.core.engine.loop import ConnectorLoop
from conveyor.core.engine.stopping import Directive, LoopControl, directive_for
from conveyor.core.errors import FencedError
from conveyor.core.model import (
    ConnectorStatus,
    Counters,
    DesiredState,
    HeartbeatReply,
    Offsets,
    TopicPartition,
)
from conveyor.core.planning.tasks import TaskSample
from conveyor.core.positions import PositionScope
from conveyor.core.sink import task_writer
from conveyor.dagster.jobs.progress import progress_logger
from conveyor.dagster.jobs.run_template import RunTemplate
from conveyor.dagster.jobs.runs import ORPHANED, next_spec
from conveyor.dagster.jobs.sink_loop import build_sink_loop
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_BROKER, TAG_TASK, TAG_TASK_GENERATION
from conveyor.store.meta import Claim, MetaStore
from conveyor.store.tasks import Grant, TaskStore

WAIT_FOR_PARTITIONS_S = 0.5


class TaskCommitter:
    """A task run's fenced writes: per-partition commits, heartbeats with load samples."""

    def __init__(
        self,
        tasks: TaskStore,
        name: str,
        task_id: int,
        generation: int,
        source: KafkaSource,
        grant: Grant,
        *,
        spec_hash: str | None,
        run_id: str | None,
        sample_interval_s: float,
        committed: Offsets,
        clock: Any = time.time,
    ):
        self.tasks = tasks
        self.name = name
        self.task_id = task_id
        self.generation = generation
        self.source = source
        self.grant = grant
        self.reading = frozenset(grant.owned) - grant.releasing
        self.spec_hash = spec_hash
        self.run_id = run_id
        self.sample_interval_s = sample_interval_s
        self.clock = clock
        self.committed: Offsets = dict(committed)
        self._snapshot: tuple[float, Offsets] = (clock(), dict(committed))
        self.refused: set[TopicPartition] = set()
        self.last_sample: TaskSample | None = None
        self.scope: PositionScope | None = None  # the loop's (core/positions.py), set on build

    def commit(self, offsets: Offsets) -> None:
        res = self.tasks.commit(
            self.name, self.task_id, self.generation, offsets, self.grant.owned, self.scope
        )
        self.committed.update(res.committed)
        if res.refused:
            # Moved away under a forced handover: the next heartbeat ends this loop.
            self.refused |= res.refused
        self.source.mirror_commit(res.committed)

    def ensure_current(self) -> None:
        self.tasks.ensure_current(self.name, self.task_id, self.generation)

    def sample(self, now: float) -> TaskSample | None:
        then, before = self._snapshot
        if now - then < self.sample_interval_s:
            return None
        dt = max(now - then, 1e-6)
        # A copy: the supervisor's thread samples while the loop's thread commits.
        committed = dict(self.committed)
        rates = {
            tp: max(0, off - before.get(tp, off)) / dt
            for tp, off in committed.items()
            if tp in self.reading
        }
        highwaters = self.source.highwaters()
        lags = {
            tp: max(0, hw - committed.get(tp, hw))
            for tp, hw in highwaters.items()
            if tp in self.reading
        }
        for tp in self.reading:
            rates.setdefault(tp, 0.0)
        self._snapshot = (now, committed)
        self.last_sample = TaskSample(now, rates, lags)
        return self.last_sample

    def heartbeat(
        self, counters: Counters, status: ConnectorStatus, reason: str | None
    ) -> Directive:
        grant = self.tasks.heartbeat(
            self.name,
            self.task_id,
            self.generation,
            self.sample(self.clock()),
            run_id=self.run_id,
            pid=os.getpid(),
            sample_interval_s=self.sample_interval_s,
            discovered=self.source.discovered or None,
        )
        self.grant = grant
        if grant.desired == DesiredState.STOPPED or grant.ending:
            return Directive.STOP
        if (frozenset(grant.owned) - grant.releasing) != self.reading or self.refused:
            return Directive.RECONFIGURE
        stored = self.tasks.meta.get(self.name).spec_hash
        return directive_for(HeartbeatReply(grant.desired, stored), self.spec_hash)


@dataclass(frozen=True)
class _TaskRun:
    """Which task a run serves (from its tags) and the task store it answers to."""

    name: str
    task_id: int
    generation: int
    tasks: TaskStore
    run_id: str | None
    broker_id: str | None

    @classmethod
    def of(
        cls, context: OpExecutionContext, name: str, store: MetaStore, broker_id: str | None
    ) -> _TaskRun:
        """The task named by the run's tags (``broker_id``: its broker tag)."""
        tags = context.run.tags
        return cls(
            name,
            int(tags[TAG_TASK]),
            int(tags[TAG_TASK_GENERATION]),
            TaskStore(store),
            context.run_id,
            broker_id,
        )


class TaskRun(RunTemplate):
    """A partition task's run, the task kind of the one run template (``jobs/run_template.py``):
    its claim is its grant (a task has its own generation), its loop the sink loop over the
    granted partitions committing per partition (``TaskCommitter``: its fence), a reconfigure
    a handover; it owns no connector row, so its ending is a history line, never a release."""

    op_retries = 0
    fenced = "This task was replaced or removed"

    def claim(self) -> bool:
        spec = self.ls.spec
        assert spec is not None
        self.run = _TaskRun.of(
            self.context, self.name, self.store, self.context.run.tags.get(TAG_BROKER)
        )
        self.generation = self.run.generation
        self.interval = spec.tasks.sample_interval_s
        first = _first_grant(self.context, self.run)
        if first is None:
            return False
        self.grant: Grant = first
        self.remote = _spark_remote(self.conveyor, self.store, self.run.broker_id)
        return True

    @property
    def title(self) -> str:
        return f"connector {self.name} task {self.run.task_id}"

    def build_loop(
        self, ls: LoadedSpec, spec_hash: str | None, canceled: Callable[[], bool]
    ) -> LoopControl | None:
        """The loop over the task's partitions once they are handed over; None: it ends."""
        run, name = self.run, self.name
        ready = _partitions_to_read(self.context, run, self.grant, canceled)
        if ready is None:
            return None
        self.grant = ready
        mine = frozenset(ready.owned)
        committed = {tp: o for tp, o in self.store.committed_offsets(name).items() if tp in mine}
        row = self.store.get(name)
        claim = Claim(
            name, run.generation, run.broker_id, committed, row.incarnation, row.legacy_positions
        )
        counters = self.loop.counters if self.loop is not None else None
        built = (self.context, self.conveyor, self.store, ls, spec_hash, run.generation, claim)
        loop = build_sink_loop(
            *built, self.remote, committed, counters, partitions=mine,
            writer=task_writer(name, run.task_id),
        )  # fmt: skip
        committer = _read_only_mine(loop, run, ready, committed, spec_hash, self.interval)
        extra = _task_metadata(run.task_id, committer)
        loop.on_progress = progress_logger(
            self.context, ls, loop.dead_letters, extra=extra, sink=loop.sink
        )
        _log_reads(self.context, run, mine, committed)
        return loop

    def reconfigure(
        self, ls: LoadedSpec, running_hash: str | None
    ) -> tuple[LoadedSpec, str | None]:
        """A new grant (a handover) and, when the stored spec changed, the new spec."""
        self.grant = self.run.tasks.grant(self.name, self.run.task_id, self.generation)
        if _spec_changed(self.store, self.name, running_hash):
            return next_spec(self.context, self.store, ls)
        return ls, running_hash

    def orphaned(self) -> None:
        """A task whose parent is gone stops itself and says so; its grant lapses with its
        heartbeat and the task sensor hands its partitions over (the connector row is not a
        task's to reset)."""
        self.store.record(
            self.name, f"task {self.run.task_id}: " + ORPHANED.format(self.context.run_id),
            run_id=self.context.run_id,
        )  # fmt: skip

    def release(
        self,
        status: ConnectorStatus,
        reason: str,
        *,
        error: str | None = None,
        counters: dict[str, Any] | None = None,
    ) -> None:
        """A task's error is a line in its connector's history (the connector stays as it is)."""
        if error is not None:
            self.store.record(
                self.name, f"task {self.run.task_id}: {reason}: {error}", run_id=self.context.run_id
            )


def _first_grant(context: OpExecutionContext, run: _TaskRun) -> Grant | None:
    """The run's first heartbeat: its grant, or None when its task was replaced (it exits)."""
    try:
        return run.tasks.heartbeat(
            run.name, run.task_id, run.generation, run_id=run.run_id, pid=os.getpid()
        )
    except FencedError as e:
        context.log.warning(f"{e}; this task run exits")
        return None


def _spark_remote(conveyor: ConveyorResource, store: MetaStore, broker_id: str | None) -> str:
    """The Spark Connect endpoint of the run's broker (the default one without a broker)."""
    broker = store.get_broker(broker_id) if broker_id else None
    return broker.spark_remote if broker else conveyor.default_remote()


def _partitions_to_read(
    context: OpExecutionContext, run: _TaskRun, grant: Grant, canceled: Callable[[], bool]
) -> Grant | None:
    """The grant to read under, once the partitions it releases are handed over and it owns
    some (a new task waits for its partitions' handover); None: the task ends (stopped, or
    merged away with nothing left to hand over)."""
    while True:
        if canceled():
            raise DagsterExecutionInterruptedError()
        if grant.desired == DesiredState.STOPPED or grant.ending:
            return None
        if grant.releasing:
            grant = _hand_over(context, run, grant)
            continue
        if not grant.owned:  # a new task waits for its partitions' handover
            time.sleep(WAIT_FOR_PARTITIONS_S)
            grant = run.tasks.heartbeat(run.name, run.task_id, run.generation, run_id=run.run_id)
            continue
        return grant


def _hand_over(context: OpExecutionContext, run: _TaskRun, grant: Grant) -> Grant:
    """Release the partitions the grant moves away (none was read yet); the grant after."""
    handed = run.tasks.release(run.name, run.task_id, run.generation, {}, grant.owned)
    context.log.info(
        f"connector {run.name} task {run.task_id}: handed over "
        + ", ".join(f"{tp}@{off}" for tp, off in sorted(handed.items()))
    )
    return run.tasks.grant(run.name, run.task_id, run.generation)


def _read_only_mine(
    loop: ConnectorLoop,
    run: _TaskRun,
    grant: Grant,
    committed: Offsets,
    running_hash: str | None,
    interval: float,
) -> TaskCommitter:
    """The same loop (its source reads only this task's partitions: ``build_sink_loop``),
    committing per partition."""
    source = loop.source
    assert isinstance(source, KafkaSource)
    scope = getattr(loop.committer, "scope", None)
    committer = TaskCommitter(
        run.tasks,
        run.name,
        run.task_id,
        run.generation,
        source,
        grant,
        spec_hash=running_hash,
        run_id=run.run_id,
        sample_interval_s=interval,
        committed=committed,
    )
    committer.scope = scope
    loop.committer = committer
    return committer


def _spec_changed(store: MetaStore, name: str, running_hash: str | None) -> bool:
    """Whether the stored spec differs from the one the run reads with (then it reloads it)."""
    stored = store.get(name).spec_hash
    return bool(stored and running_hash and stored != running_hash)


def _log_reads(
    context: OpExecutionContext,
    run: _TaskRun,
    mine: frozenset[TopicPartition],
    committed: Offsets,
) -> None:
    """Which partitions the run reads, and from which offsets."""
    context.log.info(
        f"connector {run.name} task {run.task_id} (generation {run.generation}) reads "
        + ", ".join(f"{tp}@{committed.get(tp, '-')}" for tp in sorted(mine))
    )


def _task_metadata(task_id: int, committer: TaskCommitter) -> Any:
    """The task's part of its sink asset's materializations: its partitions, rate and lag."""
    from dagster import MetadataValue

    def extra() -> dict[str, Any]:
        last = committer.last_sample
        by_partition = {
            str(tp): {
                "msgs_per_s": round(last.rates.get(tp, 0.0), 1) if last else None,
                "lag": last.lags.get(tp) if last else None,
            }
            for tp in sorted(committer.reading)
        }
        return {
            "task": MetadataValue.int(task_id),
            "task_partitions": MetadataValue.json(by_partition),
        }

    return extra
