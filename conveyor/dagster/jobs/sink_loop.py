"""A sink connector's loop for one spec: its Kafka source, Spark transform, sink, fenced
committer and dead-letter store, references resolved in the run. The connector's run
(``jobs/connector.py``) and a partition task's run (``jobs/tasks.py``) both build it here."""

from __future__ import annotations

import functools
from collections.abc import Collection

from dagster import OpExecutionContext

from conveyor.brokers.kafka import KafkaSource
from conveyor.config.specs import LoadedSpec, resolved
from conveyor.core.loop import ConnectorLoop, LoopConfig
from conveyor.core.model import Counters, FailurePolicyName, Offsets, TopicPartition
from conveyor.core.sink import OffsetsInTarget
from conveyor.dagster.jobs.committer import StoreCommitter
from conveyor.dagster.jobs.progress import progress_logger
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.sinks import build_sink
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer
from conveyor.store.meta import Claim, MetaStore


def build_sink_loop(
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
    partitions: Collection[TopicPartition] | None = None,
    writer: str | None = None,
) -> ConnectorLoop:
    """Source, transform, sink and committer for one spec, its references resolved (in the run).
    ``partitions``: a partition task's, the only ones whose target-held offsets it takes;
    ``writer``: the name its commits carry in a target that keeps offsets (default the
    connector's; a task's own, as tasks have their own generations)."""
    name = ls.name
    live = resolved(ls)  # holds secrets: used to build clients, never logged or stored
    assert live.spec is not None and live.sink is not None and ls.sink is not None
    spec = live.spec
    source_spec = spec.source.with_default_bootstrap(conveyor.bootstrap())
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
        from conveyor.spark.deadletters import dead_letter_writer

        dead_letters = dead_letter_writer(
            spec, gen, spark=lambda: spark_session(remote), connection=source_spec
        )
    try:
        sink = build_sink(live.sink)
    except Exception:
        source.close()
        raise
    start_offsets = None
    if isinstance(sink, OffsetsInTarget):
        # Read by the loop as it initialises the sink, under its outage retries.
        start_offsets = functools.partial(
            _target_offsets_win, context, sink, writer or name, gen, dict(committed), partitions
        )
    return ConnectorLoop(
        LoopConfig(
            name=name,
            batch=spec.batch,
            retry=spec.retry,
            failure=spec.failure,
            destinations=spec.destinations,
            transform_depth=spec.transform.pipeline_depth,
            watermark=spec.watermark,
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
        on_progress=progress_logger(context, ls, dead_letters, sink=sink),
        counters=counters,
        start_offsets=start_offsets,
    )


def _target_offsets_win(
    context: OpExecutionContext,
    sink: object,
    name: str,
    gen: int,
    committed: Offsets,
    partitions: Collection[TopicPartition] | None,
) -> Offsets:
    """A sink whose target keeps the offsets with the data (``OffsetsInTarget``): bound to this
    run, and where its target's offsets differ from the meta store's, the target's win."""
    if not isinstance(sink, OffsetsInTarget):
        return committed
    sink.bind(name, gen)
    held = sink.target_offsets() or {}
    if partitions is not None:
        # A partition task's row for a partition another task wrote after a handover is stale
        # (lower than the meta store's mirror of the newer owner's commits): the higher wins. A
        # reset moves the target and the meta store together, so the target is never below it
        # for its own latest writes.
        held = {tp: max(o, committed.get(tp, o)) for tp, o in held.items() if tp in partitions}
    differ = {tp: o for tp, o in held.items() if committed.get(tp) != o}
    if differ:
        context.log.info(
            f"connector {name}: the target holds other offsets than the meta store, and wins: "
            + ", ".join(
                f"{tp}@{o} (meta store {committed.get(tp)})" for tp, o in sorted(differ.items())
            )
        )
    return {**committed, **held}
