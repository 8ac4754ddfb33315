"""A sink connector's loop for one spec: its Kafka source, Spark transform, sink, fenced
committer and dead-letter store, references resolved in the run. The connector's run
(``jobs/connector.py``) and a partition task's run (``jobs/tasks.py``) both build it here."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

from dagster import AssetKey, AssetObservation, MetadataValue, OpExecutionContext

from conveyor.brokers.kafka import KafkaSource
from conveyor.config.specs import LoadedSpec, resolved
from conveyor.core.engine.loop import ConnectorLoop, LoopConfig
from conveyor.core.errors import ConveyorError
from conveyor.core.model import Counters, FailurePolicyName, Offsets, TopicPartition
from conveyor.core.positions import (
    PositionNote,
    PositionScope,
    StoredPosition,
    StoredPositions,
    TargetBinding,
    given_up_counts,
    judge_positions,
    writer_id,
)
from conveyor.core.sink import OffsetsInTarget
from conveyor.dagster.jobs.committer import StoreCommitter
from conveyor.dagster.jobs.progress import progress_logger
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_CONNECTOR
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
    ``partitions``: a partition task's, the only ones whose stored positions it takes;
    ``writer``: the name its commits carry in a target that keeps offsets (default the
    connector's; a task's own, as tasks have their own generations). Where the run starts is
    decided as the loop starts (``start_positions``): the meta store's positions and the
    target's, judged against the logs as they are (``core/positions.py``)."""
    name = ls.name
    live = resolved(ls)  # holds secrets: used to build clients, never logged or stored
    assert live.spec is not None and live.sink is not None and ls.sink is not None
    spec = live.spec
    source_spec = spec.source.with_default_bootstrap(conveyor.bootstrap())
    context.log.info(
        f"connector {name} generation {gen} on broker {claim.broker_id or '-'} (Spark {remote}); "
        f"sink {'/'.join(ls.sink.asset_key_path())}; spec {(spec_hash or '-')[:12]}; stored "
        + (", ".join(f"{tp}@{off}" for tp, off in sorted(committed.items())) or "nothing")
    )
    only = frozenset(partitions) if partitions is not None else None
    source = KafkaSource(source_spec, group_id=name, only=only)
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
    binding = _binding(ls, claim, gen, writer or name, source)
    start = functools.partial(
        _start_positions, context, store, source, sink, ls, binding, partitions
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
            scope=binding.scope,
            adopted=_adopted(sink) if claim.legacy_positions and writer is None else None,
        ),
        committed=committed,
        dead_letters=dead_letters,
        on_progress=progress_logger(context, ls, dead_letters, sink=sink),
        counters=counters,
        start_positions=start,
        on_positions=functools.partial(report_positions, context, store, ls, gen),
    )


def _binding(
    ls: LoadedSpec, claim: Claim, gen: int, writer: str, source: KafkaSource
) -> TargetBinding:
    """What this run's positions name (``core/positions.py``): its writer id, generation, the
    sink's destination and the logs the source finds (the source fills ``log_ids``)."""
    assert ls.sink is not None
    return TargetBinding(
        writer_id(writer, claim.incarnation),
        gen,
        PositionScope("/".join(ls.sink.asset_key_path()), source.log_ids),
        legacy_writer=writer if claim.legacy_positions else None,
    )


def _adopted(sink: object) -> Callable[[], bool]:
    """When a migrated connector's target holds its positions under its writer id (a lakehouse
    table: once this run has made a table commit; the others: once the run has started)."""
    return lambda: getattr(sink, "last_commit", True) is not None


def _start_positions(
    context: OpExecutionContext,
    store: MetaStore,
    source: KafkaSource,
    sink: object,
    ls: LoadedSpec,
    binding: TargetBinding,
    partitions: Collection[TopicPartition] | None,
) -> tuple[Offsets, list[PositionNote]]:
    """Where the run starts: the meta store's positions (a partition task's own), where its
    target keeps offsets (``OffsetsInTarget``, bound to this run) the target's winning, all
    judged against the logs as the broker describes them now."""
    assert ls.spec is not None
    stored = {
        tp: p
        for tp, p in store.stored_positions(ls.name).items()
        if partitions is None or tp in partitions
    }
    merged = dict(stored)
    if isinstance(sink, OffsetsInTarget):
        sink.bind(binding)
        held = sink.target_offsets() or {}
        if partitions is not None:
            held = _newer_of(held, stored, partitions, binding)
        differ = {tp: p for tp, p in held.items() if stored.get(tp) != p}
        if differ:
            context.log.info(
                f"connector {ls.name}: the target holds other positions than the meta store, "
                "and wins: "
                + ", ".join(
                    f"{tp}@{p.offset} (meta store {_differs(p, stored.get(tp))})"
                    for tp, p in sorted(differ.items(), key=lambda kv: str(kv[0]))
                )
            )
        merged.update(held)
    facts = source.describe_logs({tp: p.offset for tp, p in merged.items()})
    start, notes = judge_positions(
        merged, facts, binding.scope.destination, ls.spec.source.out_of_range
    )
    # A target position outside the log covers nothing; its partition's next commit replaces it.
    binding.void.update({n.tp: n.stored for n in notes if n.resumed_at is not None})
    # Partitions not described (a topic gone): their stored positions stay as they were.
    return start, notes


def _differs(target: StoredPosition, stored: StoredPosition | None) -> str:
    """How the meta store's position differs from the target's: its offset, or (the same
    offset) the log or destination it names."""
    if stored is None or stored.offset != target.offset:
        return str(None if stored is None else stored.offset)
    named = [
        f"{what} {mine!r} where the target names {theirs!r}"
        for what, mine, theirs in (
            ("log", stored.log_id, target.log_id),
            ("destination", stored.destination, target.destination),
        )
        if mine != theirs
    ]
    return f"{stored.offset}, " + " and ".join(named)


def _newer_of(
    held: StoredPositions,
    stored: StoredPositions,
    partitions: Collection[TopicPartition],
    binding: TargetBinding,
) -> StoredPositions:
    """A partition task's target positions: a row for a partition another task wrote after a
    handover is stale (lower than the meta store's mirror of the newer owner's commits, in the
    same log): the higher wins. A reset moves the target and the meta store together, so the
    target is never below it for its own latest writes."""
    out: StoredPositions = {}
    usable = binding.usable(stored)
    for tp, p in held.items():
        if tp not in partitions:
            continue
        mirror = stored.get(tp)
        newer = mirror is not None and tp in usable and binding.usable({tp: p})
        out[tp] = mirror if newer and mirror.offset > p.offset else p  # type: ignore[assignment]
    return out


def report_positions(
    context: OpExecutionContext,
    store: MetaStore,
    ls: LoadedSpec,
    gen: int,
    notes: list[PositionNote],
) -> None:
    """Positions not taken as stored: in the run's log, on the sink asset (an observation), in
    the connector's history and last error (fenced; a meta store that fails here costs the
    record, never the run)."""
    name = ls.name
    for n in notes:
        context.log.warning(f"connector {name}: {n.message}")
    if ls.sink is not None:
        context.log_event(
            AssetObservation(
                asset_key=AssetKey(ls.sink.asset_key_path()),
                description=f"connector {name}: {len(notes)} stored position(s) not taken as stored",
                metadata={
                    "positions": MetadataValue.md("\n".join(f"- {n.message}" for n in notes)),
                    "given_up_now": MetadataValue.json(given_up_counts(notes, None)),
                },
                tags={TAG_CONNECTOR: name},
            )
        )
    try:
        store.record_positions(name, gen, [n.message for n in notes])
    except ConveyorError as e:
        context.log.warning(f"connector {name}: the positions' note was not recorded: {e}")
