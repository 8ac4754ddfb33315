"""The connector job: one long-running Dagster run per connector assignment.

The op claims the connector (fencing any older run), builds the source, the
Spark transform and the sink, and runs ``core.loop`` on a thread of its own. The
op's thread is the run's supervisor (``core.liveness.Supervisor``): it heartbeats
for the run, watches each stage against its deadline (Degraded with the stage
named, then a self-restart: the run fails and the scheduler relaunches it), and
takes the interrupts. It installs no signal handlers: a terminate from the UI or
the scheduler arrives in the op's thread as Dagster's
``DagsterExecutionInterruptedError``; the loop is asked to stop, commits what was
acknowledged, cleans up, and the run ends CANCELED.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from dagster import (
    AssetKey,
    AssetMaterialization,
    DagsterExecutionInterruptedError,
    DagsterRunStatus,
    Failure,
    JobDefinition,
    MetadataValue,
    OpExecutionContext,
    RetryRequested,
    in_process_executor,
    job,
    op,
)

from conveyor.assets.lineage import dead_letter_key
from conveyor.brokers.kafka import KafkaSource
from conveyor.core.errors import (
    AlreadyClaimedError,
    ConfigError,
    ConveyorError,
    DeadLetterLimitError,
    FencedError,
    PermanentSinkError,
    PermanentSourceError,
)
from conveyor.core.liveness import Supervisor
from conveyor.core.loop import (
    ConnectorLoop,
    DataPolicyError,
    Directive,
    LoopConfig,
    OutageBudgetExceeded,
    Progress,
    directive_for,
    run_loop,
)
from conveyor.core.model import ConnectorStatus, Counters, FailurePolicyName, Offsets
from conveyor.core.state import StateChange
from conveyor.processes import pid_alive
from conveyor.resources.conveyor import ConveyorResource
from conveyor.sinks import build_sink
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer
from conveyor.specs import LoadedSpec, load_source, resolved, sync_one
from conveyor.store.meta import Claim, ConnectorRow, MetaStore

TAG_CONNECTOR = "conveyor/connector"
TAG_BROKER = "conveyor/broker"
TAG_GENERATION = "conveyor/generation"

# Attempts of the connector op (RetryRequested) after an outage outlasted its budget,
# before the run fails and the scheduler's restart backoff takes over.
OUTAGE_RUN_RETRIES = 2
# After a stop or a terminate: how long the op waits for the loop to finish its batch.
STOP_GRACE_S = 30.0


class StageHungError(ConveyorError):
    """A stage stayed under way past ``liveness.restart_after_s``: the run restarts itself."""


def job_name(connector: str) -> str:
    return f"connector__{connector}"


class StoreCommitter:
    """The run's fenced writes: offsets to the meta store (mirrored to Kafka), heartbeats.

    ``spec_hash`` is the hash of the spec this run runs with; a heartbeat answered with
    another hash asks the loop to take the new spec on (``Directive.RECONFIGURE``).
    """

    def __init__(
        self,
        store: MetaStore,
        name: str,
        generation: int,
        source: KafkaSource,
        spec_hash: str | None = None,
        on_status: Callable[[ConnectorStatus, str | None], None] | None = None,
    ):
        self.store = store
        self.name = name
        self.generation = generation
        self.source = source
        self.spec_hash = spec_hash
        self.on_status = on_status  # told each status change (the run's log in the UI)
        self._status: ConnectorStatus | None = None

    def commit(self, offsets: Offsets) -> None:
        self.store.commit(self.name, self.generation, offsets)
        self.source.mirror_commit(offsets)

    def ensure_current(self) -> None:
        self.store.ensure_current(self.name, self.generation)

    def heartbeat(
        self, counters: Counters, status: ConnectorStatus, reason: str | None
    ) -> Directive:
        reply = self.store.heartbeat(
            self.name, self.generation, counters.as_dict(), status=status, reason=reason
        )
        if status != self._status and self.on_status is not None:
            self.on_status(status, reason)
        self._status = status
        return directive_for(reply, self.spec_hash)


def _holder_alive(context: OpExecutionContext, timeout_s: float):  # type: ignore[no-untyped-def]
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


def _progress_logger(context: OpExecutionContext, ls: LoadedSpec, dead_letters: Any = None):  # type: ignore[no-untyped-def]
    assert ls.sink is not None
    sink_key = AssetKey(ls.sink.asset_key_path())
    seen_dead = [0]

    def on_progress(p: Progress) -> None:
        c = p.counters
        if c.dead_lettered > seen_dead[0]:
            seen_dead[0] = c.dead_lettered
            _log_dead_letters(context, ls.name, dead_letters, c.dead_lettered)
        offsets = {str(tp): off for tp, off in sorted(p.offsets.items())}
        metadata: dict[str, Any] = {
            "messages_in": MetadataValue.int(c.messages_in),
            "messages_out": MetadataValue.int(c.messages_out),
            "failed": MetadataValue.int(c.failed),
            "dead_lettered": MetadataValue.int(c.dead_lettered),
            "discarded": MetadataValue.int(c.discarded),
            "retries": MetadataValue.int(c.retries),
            "msgs_per_s": MetadataValue.float(float(c.msgs_per_s)),
            "offsets": MetadataValue.json(offsets),
        }
        if c.lag is not None:
            metadata["lag"] = MetadataValue.int(c.lag)
        if c.batch_latency_p50_ms is not None:
            metadata["batch_latency_p50_ms"] = MetadataValue.float(c.batch_latency_p50_ms)
        if c.batch_latency_p99_ms is not None:
            metadata["batch_latency_p99_ms"] = MetadataValue.float(c.batch_latency_p99_ms)
        context.log_event(
            AssetMaterialization(
                asset_key=sink_key,
                description=f"connector {ls.name}: {c.messages_out} messages delivered"
                + (" (final)" if p.final else ""),
                metadata=metadata,
                tags={TAG_CONNECTOR: ls.name},
            )
        )

    return on_progress


def _log_dead_letters(context: OpExecutionContext, name: str, writer: Any, written: int) -> None:
    """Materialize ``dead_letters/<name>`` with the pending count, newest error and a sample."""
    from conveyor.deadletters import SparkParquetDeadLetters, sample_rows

    metadata: dict[str, Any] = {"dead_lettered_by_run": MetadataValue.int(written)}
    if isinstance(writer, SparkParquetDeadLetters):
        try:
            pending = writer.pending()
            metadata["count"] = MetadataValue.int(pending.num_rows)
            if pending.num_rows:
                newest = max(pending.to_pylist(), key=lambda r: r["last_failure_at"])
                metadata["newest_error"] = MetadataValue.text(
                    f"{newest['topic']}[{newest['partition']}]@{newest['offset']}: {newest['error']}"
                )
                rows = sample_rows(pending, 5)
                md = "| where | class | attempts | error |\n|---|---|---|---|\n" + "\n".join(
                    f"| {r['where']} | {r['error_class']} | {r['attempts']} | {r['error'].replace('|', '/')} |"
                    for r in rows
                )
                metadata["sample"] = MetadataValue.md(md)
        except Exception as e:  # noqa: BLE001 - metadata must never stop the connector
            context.log.warning(f"could not summarise dead letters: {e}")
    context.log_event(
        AssetMaterialization(
            asset_key=dead_letter_key(name),
            description=f"{written} dead letters written by this run",
            metadata=metadata,
        )
    )


def cancel_requested(context: OpExecutionContext, every_s: float = 2.0) -> Callable[[], bool]:
    """True once this run is CANCELING or CANCELED (checked at most every ``every_s``).

    Dagster delivers a terminate as an exception raised by its signal handler in the
    op's thread. If that handler runs inside a garbage-collection callback (a weakref
    finalizer, say), the interpreter prints "Exception ignored in ..." and swallows it:
    the run would go on until a second terminate. Polling the run's own status makes
    a terminate stop the loop within a batch either way.
    """
    state = {"checked": 0.0, "seen": False}

    def check() -> bool:
        if state["seen"]:
            return True
        now = time.monotonic()
        if now - state["checked"] < every_s:
            return False
        state["checked"] = now
        try:
            run = context.instance.get_run_by_id(context.run_id)
        except Exception as e:  # noqa: BLE001 - the instance may be briefly unreachable
            context.log.debug(f"reading this run's status failed: {e}")
            return False
        state["seen"] = run is not None and run.status in (
            DagsterRunStatus.CANCELING,
            DagsterRunStatus.CANCELED,
        )
        return bool(state["seen"])

    return check


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
    tags = context.run.tags
    expected = int(tags[TAG_GENERATION]) if TAG_GENERATION in tags else None
    try:
        claim = store.claim(
            name,
            run_id=context.run_id,
            expected_generation=expected,
            holder_alive=_holder_alive(context, ls.spec.heartbeat_timeout_s),
            broker_id=tags.get(TAG_BROKER),
        )
    except AlreadyClaimedError as e:
        raise Failure(description=str(e)) from None
    except FencedError as e:
        context.log.warning(f"{e}; this run exits without touching the connector")
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
            ls, running_hash = _next_spec(context, store, ls)
    except DagsterExecutionInterruptedError:
        store.release(
            name, gen, ConnectorStatus.STOPPED, f"run {context.run_id} terminated", counters=final()
        )
        context.log.info(
            f"connector {name} stopped by terminate; offsets committed up to the last acknowledged batch"
        )
        raise
    except FencedError as e:
        context.log.warning(f"{e}. Another run owns the connector now; exiting without committing.")
        return
    except (
        ConfigError,
        PermanentSinkError,
        PermanentSourceError,
        DataPolicyError,
        DeadLetterLimitError,
        StageHungError,
    ) as e:
        store.release(
            name, gen, ConnectorStatus.ERROR, type(e).__name__, error=str(e), counters=final()
        )
        raise Failure(description=f"connector {name} stopped with an error: {e}") from None
    except OutageBudgetExceeded as e:
        assert ls.spec is not None
        if context.retry_number < OUTAGE_RUN_RETRIES:
            store.apply(
                name,
                gen,
                StateChange(status=ConnectorStatus.DEGRADED, error=str(e)),
                f"outage budget spent, op retry {context.retry_number + 1}",
            )
            raise RetryRequested(
                max_retries=OUTAGE_RUN_RETRIES, seconds_to_wait=ls.spec.retry.delay
            ) from e
        store.release(
            name, gen, ConnectorStatus.ERROR, "outage budget spent", error=str(e), counters=final()
        )
        raise Failure(description=f"connector {name}: {e}") from None
    except ConveyorError as e:
        store.release(name, gen, ConnectorStatus.ERROR, type(e).__name__, error=str(e))
        raise Failure(description=f"connector {name}: {e}") from None
    except Exception as e:
        store.release(
            name, gen, ConnectorStatus.ERROR, "unexpected error", error=f"{type(e).__name__}: {e}"
        )
        raise
    store.release(
        name, gen, ConnectorStatus.STOPPED, "stopped: desired state is stopped", counters=final()
    )
    context.log.info(
        f"connector {name} stopped: {json.dumps(counters.as_dict() if counters else {})}"
    )


def supervise(
    context: OpExecutionContext,
    loop: ConnectorLoop,
    ls: LoadedSpec,
    canceled: Callable[[], bool],
    *,
    clock: Callable[[], float] = time.monotonic,
) -> Counters:
    """Run ``loop`` on its own thread; this thread heartbeats for it and judges its stages.

    Returns the loop's counters or raises its error. A terminate (Dagster's interrupt, or
    the run seen CANCELING) asks the loop to stop and waits up to ``STOP_GRACE_S`` for it
    to commit what was acknowledged, then raises the interrupt. A stage past
    ``liveness.restart_after_s`` raises StageHungError: the run fails and the scheduler
    relaunches it; the stuck call is left behind, fenced by the next generation (it checks
    its generation before any send and commits nothing once fenced).
    """
    assert ls.spec is not None
    spec = ls.spec
    loop.supervised = True
    sup = Supervisor(
        loop,
        spec.liveness,
        read_wait_s=spec.batch.max_wait_ms / 1000,
        interval_s=loop.cfg.heartbeat_interval_s,
        clock=clock,
        on_report=lambda msg: context.log.warning(f"connector {ls.name}: {msg}"),
    )
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["counters"] = run_loop(loop)
        except BaseException as e:  # noqa: BLE001 - handed to the op's thread
            outcome["error"] = e

    worker = threading.Thread(target=body, name=f"conveyor-loop-{ls.name}", daemon=True)
    worker.start()
    interrupted: BaseException | None = None
    reported = None
    try:
        while worker.is_alive():
            worker.join(sup.poll_s)
            if not worker.is_alive():
                break
            if canceled():
                interrupted = DagsterExecutionInterruptedError()
                break
            try:
                v = sup.tick()
            except FencedError:
                continue  # the loop was told; it ends and raises FencedError
            if v.restart:
                loop.request_stop()
                _metadata_stuck(context, ls, v.reason())
                raise StageHungError(v.reason())
            if v.stage != reported:
                reported = v.stage  # once per stuck stage, as it crosses its deadline
                if v.stuck:
                    _metadata_stuck(context, ls, v.reason())
    except DagsterExecutionInterruptedError as e:
        interrupted = e
    if interrupted is not None:
        loop.request_stop()
        deadline = clock() + STOP_GRACE_S
        while worker.is_alive() and clock() < deadline:
            worker.join(sup.poll_s)
            with contextlib.suppress(Exception):  # fenced or store trouble: leaving anyway
                sup.tick()
        raise interrupted
    if "error" in outcome:
        raise outcome["error"]
    return outcome["counters"]  # type: ignore[no-any-return]


def _metadata_stuck(context: OpExecutionContext, ls: LoadedSpec, reason: str) -> None:
    """The stuck stage on the sink asset's timeline (the run's event log in the UI)."""
    assert ls.sink is not None
    try:
        context.log_event(
            AssetMaterialization(
                asset_key=AssetKey(ls.sink.asset_key_path()),
                description=f"connector {ls.name}: Degraded: {reason}",
                metadata={
                    "status": MetadataValue.text("Degraded"),
                    "reason": MetadataValue.text(reason),
                },
                tags={TAG_CONNECTOR: ls.name},
            )
        )
    except Exception as e:  # noqa: BLE001 - metadata never stops the supervisor
        context.log.warning(f"could not record the stuck stage: {e}")


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
        LoopConfig(name=name, batch=spec.batch, retry=spec.retry, failure=spec.failure),
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
        on_progress=_progress_logger(context, ls, dead_letters),
        counters=counters,
    )


def _next_spec(
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
    def run_connector_op(context, conveyor: ConveyorResource) -> None:  # type: ignore[no-untyped-def]
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
