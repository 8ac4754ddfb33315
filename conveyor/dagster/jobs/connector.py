"""The sink connector job: one long-running Dagster run per connector assignment.

The op claims the connector (fencing any older run), builds the source, the
Spark transform and the sink, and runs ``core.loop`` on a thread of its own. The
op's thread is the run's supervisor (``jobs.supervision``): it heartbeats
for the run, watches each stage against its deadline (Degraded with the stage
named, then a self-restart: the run fails and the scheduler relaunches it), and
takes the interrupts. It installs no signal handlers: a terminate from the UI or
the scheduler arrives in the op's thread as Dagster's
``DagsterExecutionInterruptedError``; the loop is asked to stop, commits what was
acknowledged, cleans up, and the run ends CANCELED. Any other error ends the run by
the outcome table (``core.failure.run_outcome``, applied by ``jobs.runs.end_run``).

Around it: ``jobs.runs`` (tags, claim, cancel, spec changes, ending), ``jobs.committer``
(fenced offsets and heartbeats), ``jobs.supervision`` and ``jobs.progress`` (the UI).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dagster import (
    Failure,
    JobDefinition,
    OpExecutionContext,
    in_process_executor,
    job,
    op,
)

from conveyor.config.specs import LoadedSpec, sync_one
from conveyor.core.loop import ConnectorLoop
from conveyor.dagster.jobs.allocators import use_run_allocators
from conveyor.dagster.jobs.runs import (
    claim_run,
    run_until_stopped,
    scrubbed_errors,
)
from conveyor.dagster.jobs.sink_loop import build_sink_loop
from conveyor.dagster.jobs.supervision import supervise
from conveyor.dagster.jobs.tasks import run_task
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_CONNECTOR, TAG_TASK, job_name

# Attempts of the connector op (RetryRequested) after an outage outlasted its budget,
# before the run fails and the scheduler's restart backoff takes over.
OUTAGE_RUN_RETRIES = 2


def run_connector(
    context: OpExecutionContext, conveyor: ConveyorResource, name: str, loaded: LoadedSpec
) -> None:
    """The op body: claim, run the loop (again after each spec change), record the final state.

    ``loaded`` is the spec as this run's process read it from its file; its references
    are resolved here, in the run, and nowhere else.
    """
    store = conveyor.run_store()
    # A run launched before the scheduler saw the file (from the UI, right after a
    # reload) registers the connector itself.
    sync_one(store, loaded)
    if not loaded.ok or loaded.spec is None:
        raise Failure(description=f"connector {name!r} cannot start: {loaded.error}")
    ls = loaded
    assert ls.spec is not None
    if TAG_TASK in context.run.tags:  # a partition task's run (jobs/tasks.py)
        return run_task(context, conveyor, name, ls, store)
    claim = claim_run(context, store, name, ls.spec.heartbeat_timeout_s)
    if claim is None:
        return
    gen = claim.generation
    broker = store.get_broker(claim.broker_id) if claim.broker_id else None
    remote = broker.spark_remote if broker else conveyor.default_remote()
    committed = dict(claim.offsets)
    loop: ConnectorLoop | None = None

    def run_one(
        ls: LoadedSpec, spec_hash: str | None, canceled: Callable[[], bool]
    ) -> ConnectorLoop:
        """One loop for one spec, supervised until it ends; the next starts where it stopped."""
        nonlocal loop, committed
        counters = loop.counters if loop is not None else None
        loop = build_sink_loop(
            context, conveyor, store, ls, spec_hash, gen, claim, remote, committed, counters
        )
        supervise(context, loop, ls, canceled)
        committed = dict(loop.committed)
        return loop

    def final() -> dict[str, Any]:
        return loop.counters.as_dict() if loop is not None else {}

    run_until_stopped(
        context, store, ls, gen, run_one=run_one, final=final,
        terminated="offsets committed up to the last acknowledged batch",
        op_retries=OUTAGE_RUN_RETRIES,
        retry_delay_s=lambda ls: ls.spec.retry.delay if ls.spec is not None else 0.0,
    )  # fmt: skip


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
