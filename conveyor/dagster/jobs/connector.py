"""The sink connector job: one long-running Dagster run per connector assignment.

The op's body is ``SinkRun``, the sink kind of the one run template
(``jobs/run_template.py``, as Kafka Connect's ``WorkerSinkTask`` under ``WorkerTask``): it
claims the connector (fencing any older run), builds the Kafka source, the Spark transform
and the sink (``jobs/sink_loop.py``), and the template supervises ``core.engine.loop`` on a thread
of its own (``jobs.supervision``: heartbeats, stage deadlines, the terminate), again after
each spec change, and ends the run by the outcome table (``core.engine.failure.run_outcome``). A
run with task tags is a partition task's (``TaskRun``, ``jobs/tasks.py``).

Around it: ``jobs.runs`` (tags, claim, cancel, spec changes), ``jobs.committer``
(fenced offsets and heartbeats), ``jobs.progress`` (the UI).
"""

from __future__ import annotations

from collections.abc import Callable

from dagster import (
    Failure,
    JobDefinition,
    OpExecutionContext,
    in_process_executor,
    job,
    op,
)

from conveyor.config.specs import LoadedSpec, sync_one
from conveyor.core.engine.loop import ConnectorLoop
from conveyor.core.engine.stopping import LoopControl
from conveyor.core.model import Offsets
from conveyor.dagster.jobs.allocators import use_run_allocators
from conveyor.dagster.jobs.run_template import RunTemplate
from conveyor.dagster.jobs.runs import claim_run, scrubbed_errors
from conveyor.dagster.jobs.sink_loop import build_sink_loop
from conveyor.dagster.jobs.tasks import TaskRun
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_CONNECTOR, TAG_TASK, job_name
from conveyor.store.meta import Claim


class SinkRun(RunTemplate):
    """A sink connector's run (``WorkerSinkTask``): claims the connector, builds the sink loop
    (Kafka source, transform, sink, fenced committer) and carries its committed offsets from
    one loop to the next."""

    terminated = "offsets committed up to the last acknowledged batch"

    def claim(self) -> bool:
        spec = self.ls.spec
        assert spec is not None
        claim = claim_run(self.context, self.store, self.name, spec.heartbeat_timeout_s)
        if claim is None:
            return False
        self.claimed: Claim = claim
        self.generation = claim.generation
        broker = self.store.get_broker(claim.broker_id) if claim.broker_id else None
        self.remote = broker.spark_remote if broker else self.conveyor.default_remote()
        self.committed: Offsets = dict(claim.offsets)
        return True

    def build_loop(
        self, ls: LoadedSpec, spec_hash: str | None, canceled: Callable[[], bool]
    ) -> LoopControl:
        counters = self.loop.counters if self.loop is not None else None
        return build_sink_loop(
            self.context, self.conveyor, self.store, ls, spec_hash, self.generation,
            self.claimed, self.remote, self.committed, counters,
        )  # fmt: skip

    def loop_ended(self, loop: LoopControl) -> None:
        assert isinstance(loop, ConnectorLoop)
        self.committed = dict(loop.committed)  # the next loop starts where it stopped


def run_connector(
    context: OpExecutionContext, conveyor: ConveyorResource, name: str, loaded: LoadedSpec
) -> None:
    """The op body: the sink connector's run, or a partition task's (``jobs/tasks.py``).

    ``loaded`` is the spec as this run's process read it from its file; its references
    are resolved here, in the run, and nowhere else.
    """
    store = conveyor.run_store()
    # A run launched before the scheduler saw the file (from the UI, right after a
    # reload) registers the connector itself.
    sync_one(store, loaded)
    if not loaded.ok or loaded.spec is None:
        raise Failure(description=f"connector {name!r} cannot start: {loaded.error}")
    kind = TaskRun if TAG_TASK in context.run.tags else SinkRun
    kind(context, conveyor, loaded, store).execute()


def connector_job(ls: LoadedSpec) -> JobDefinition:
    """``connector__<name>``: one op, in-process executor, no retries (the scheduler relaunches)."""
    name = ls.name
    target = "/".join(ls.sink.asset_key_path()) if ls.sink else "?"
    topics = ls.spec.source.describe_topics() if ls.spec else "?"
    desc = (
        ls.spec.description if ls.spec and ls.spec.description else None
    ) or f"Connector {name}: {topics} -> {target}"
    if ls.error:
        desc = f"Connector {name} has an invalid spec: {ls.error}"

    @op(name=f"run_connector__{name}", description=desc, tags={"kind": "spark"})
    @scrubbed_errors
    def run_connector_op(context, conveyor: ConveyorResource) -> None:  # type: ignore[no-untyped-def]
        use_run_allocators()  # the run's RSS (conveyor/dagster/jobs/allocators.py)
        run_connector(context, conveyor, name, ls)

    @job(
        name=job_name(name),
        description=desc,
        executor_def=in_process_executor,
        tags={TAG_CONNECTOR: name, "dagster/max_retries": "0"},
    )
    def connector_job_def() -> None:
        run_connector_op()

    return connector_job_def
