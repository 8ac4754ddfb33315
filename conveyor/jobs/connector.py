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

import json
from typing import Any

from dagster import (
    DagsterExecutionInterruptedError,
    Failure,
    JobDefinition,
    OpExecutionContext,
    in_process_executor,
    job,
    op,
)

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.errors import ConfigError
from conveyor.core.loop import ConnectorLoop, LoopConfig
from conveyor.core.model import ConnectorStatus, Counters, FailurePolicyName, Offsets
from conveyor.jobs.allocators import use_run_allocators
from conveyor.jobs.committer import StoreCommitter
from conveyor.jobs.progress import progress_logger
from conveyor.jobs.runs import (
    cancel_requested,
    claim_run,
    end_run,
    next_spec,
    scrubbed_errors,
)
from conveyor.jobs.supervision import supervise
from conveyor.jobs.tags import TAG_CONNECTOR, TAG_TASK, job_name
from conveyor.resources.conveyor import ConveyorResource
from conveyor.sinks import build_sink
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer
from conveyor.specs import LoadedSpec, resolved, sync_one
from conveyor.store.meta import Claim, MetaStore

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
        from conveyor.jobs.tasks import run_task

        return run_task(context, conveyor, name, ls, store)
    claim = claim_run(context, store, name, ls.spec.heartbeat_timeout_s)
    if claim is None:
        return
    gen = claim.generation
    broker = store.get_broker(claim.broker_id) if claim.broker_id else None
    remote = broker.spark_remote if broker else conveyor.default_remote()
    committed = dict(claim.offsets)
    running_hash = ls.spec_hash()
    counters: Counters | None = None
    loop: ConnectorLoop | None = None
    canceled = cancel_requested(context)

    def final() -> dict[str, Any]:
        return loop.counters.as_dict() if loop is not None else {}

    try:
        while True:
            loop = _build_loop(
                context, conveyor, store, ls, running_hash, gen, claim, remote, committed, counters
            )
            counters = supervise(context, loop, ls, canceled)
            # A terminate whose interrupt never reached the op (see cancel_requested).
            if canceled():
                raise DagsterExecutionInterruptedError()
            if not loop.reconfigure_requested:
                break
            committed = dict(loop.committed)
            ls, running_hash = next_spec(context, store, ls)
    except DagsterExecutionInterruptedError:
        store.release(
            name, gen, ConnectorStatus.STOPPED, f"run {context.run_id} terminated", counters=final()
        )
        context.log.info(
            f"connector {name} stopped by terminate; offsets committed up to the last acknowledged batch"
        )
        raise
    except Exception as e:
        assert ls.spec is not None
        end_run(
            context,
            store,
            name,
            gen,
            e,
            counters=final,
            op_retries=OUTAGE_RUN_RETRIES,
            retry_delay_s=ls.spec.retry.delay,
        )
        return
    store.release(
        name, gen, ConnectorStatus.STOPPED, "stopped: desired state is stopped", counters=final()
    )
    context.log.info(
        f"connector {name} stopped: {json.dumps(counters.as_dict() if counters else {})}"
    )


def _build_loop(
    context: OpExecutionContext,
    conveyor: ConveyorResource,
    store: MetaStore,
    ls: LoadedSpec,
    spec_hash: str | None,
    gen: int,
    claim: Claim,
    remote: str,
    committed: Offsets,
    counters: Counters | None,
) -> ConnectorLoop:
    """Source, transform, sink and committer for one spec, its references resolved (in the run)."""
    name = ls.name
    live = resolved(ls)  # holds secrets: used to build clients, never logged or stored
    assert live.spec is not None and live.sink is not None and ls.sink is not None
    spec = live.spec
    source_spec = spec.source
    if source_spec.bootstrap_servers is None and conveyor.bootstrap():
        source_spec = source_spec.model_copy(update={"bootstrap_servers": conveyor.bootstrap()})
    context.log.info(
        f"connector {name} generation {gen} on broker {claim.broker_id or '-'} (Spark {remote}); "
        f"sink {'/'.join(ls.sink.asset_key_path())}; spec {(spec_hash or '-')[:12]}; resuming from "
        + (
            ", ".join(f"{tp}@{off}" for tp, off in sorted(committed.items()))
            or spec.source.start_from
        )
    )
    source = KafkaSource(source_spec, group_id=name)
    dead_letters = None
    if spec.failure.policy == FailurePolicyName.DEAD_LETTER:
        from conveyor.deadletters import dead_letter_writer

        dead_letters = dead_letter_writer(
            spec, gen, spark=lambda: spark_session(remote), connection=source_spec
        )
    try:
        sink = build_sink(live.sink)
    except ConfigError:
        source.close()
        raise
    return ConnectorLoop(
        LoopConfig(
            name=name,
            batch=spec.batch,
            retry=spec.retry,
            failure=spec.failure,
            destinations=spec.destinations,
            transform_depth=spec.transform.pipeline_depth,
        ),
        source=source,
        transform=SparkTransformer(spec.transform, lambda: spark_session(remote)),
        sink=sink,
        committer=StoreCommitter(
            store,
            name,
            gen,
            source,
            spec_hash=spec_hash,
            on_status=lambda status, reason: context.log.info(
                f"connector {name}: {status.value}" + (f" ({reason})" if reason else "")
            ),
        ),
        committed=committed,
        dead_letters=dead_letters,
        on_progress=progress_logger(context, ls, dead_letters),
        counters=counters,
    )


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
        use_run_allocators()  # the run's RSS (conveyor/jobs/allocators.py)
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
