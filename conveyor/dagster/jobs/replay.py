"""Replay of dead letters: re-send them through the connector's transform and sink.

Delivered letters are marked replayed; letters that fail again stay, appended
with ``attempts`` raised and the new error. Runs as the Dagster job
``replay_dead_letters__<connector>`` or from ``conveyor dead-letters replay``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from dagster import (
    AssetMaterialization,
    JobDefinition,
    MetadataValue,
    in_process_executor,
    job,
    op,
)

from conveyor.config.specs import LoadedSpec
from conveyor.core.sink import commit_held, send_isolating
from conveyor.dagster.assets.lineage import dead_letter_key
from conveyor.dagster.jobs.runs import current_spec_resolved, scrubbed_errors
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_CONNECTOR, TAG_REPLAY, replay_job_name
from conveyor.sinks import build_sink
from conveyor.spark.deadletters import (
    DEAD_LETTER_SCHEMA,
    SparkParquetDeadLetters,
    dead_letter_location,
    letter_id,
    letters_as_source_batch,
    sample_rows,
)
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer


@dataclass(frozen=True)
class ReplayResult:
    attempted: int
    delivered: int
    failed_again: int
    filtered: int
    remaining: int


def replay_dead_letters(
    ls: LoadedSpec,
    spark: Callable[[], Any],
    *,
    batch_size: int = 1_000,
    progress: Callable[[int, int], None] | None = None,
    now: Callable[[], float] = time.time,
) -> ReplayResult:
    """Replay every pending dead letter of a connector (Parquet store)."""
    assert ls.spec is not None and ls.sink is not None
    store = SparkParquetDeadLetters(dead_letter_location(ls.spec), spark, connector=ls.name)
    pending = store.pending()
    total = pending.num_rows
    if total == 0:
        return ReplayResult(0, 0, 0, 0, 0)
    sink = build_sink(ls.sink)
    transform = SparkTransformer(ls.spec.transform, spark)
    delivered = failed_again = filtered = 0
    sink.init_sink()
    try:
        for start in range(0, total, batch_size):
            letters = pending.slice(start, batch_size)
            source = letters_as_source_batch(letters)
            transformed = transform(source)
            failures = {
                letters.column("id")[r.index].as_py(): r.message for r in transformed.rejected
            }
            for f in send_isolating(sink, transformed.table) if transformed.table.num_rows else []:
                row = transformed.table.slice(f.index, 1).to_pylist()[0]
                failures[letter_id(row["__topic"], row["__partition"], row["__offset"])] = f.message
            commit_held(sink)  # a lakehouse table: the letters are in it before marked replayed
            ids = letters.column("id").to_pylist()
            ok_ids = [i for i in ids if i not in failures]
            # Filtered out on replay counts as done: the current transform does not want it.
            filtered += len(ids) - transformed.table.num_rows - len(transformed.rejected)
            if failures:
                t = now()
                mask = pc.is_in(letters.column("id"), pa.array(list(failures), pa.string()))
                again = letters.filter(mask)
                again = again.set_column(
                    again.schema.get_field_index("attempts"),
                    "attempts",
                    pc.add(again.column("attempts"), pa.scalar(1, pa.int32())),
                )
                again = again.set_column(
                    again.schema.get_field_index("error"),
                    "error",
                    pa.array([failures[i] for i in again.column("id").to_pylist()], pa.string()),
                )
                again = again.set_column(
                    again.schema.get_field_index("last_failure_at"),
                    "last_failure_at",
                    pa.array([t] * again.num_rows, pa.float64()),
                )
                store.append(again.cast(DEAD_LETTER_SCHEMA))
            store.mark_replayed(ok_ids, at=now())
            delivered += len(ok_ids)
            failed_again += len(failures)
            if progress:
                progress(min(start + batch_size, total), total)
    finally:
        sink.cleanup_sink()
    return ReplayResult(total, delivered, failed_again, filtered, store.count())


def replay_job(ls: LoadedSpec) -> JobDefinition:
    name = ls.name

    @op(
        name=f"replay__{name}",
        description=f"Re-send connector {name}'s dead letters through its sink.",
        tags={"kind": "spark"},
    )
    @scrubbed_errors
    def replay_op(context, conveyor: ConveyorResource) -> None:  # type: ignore[no-untyped-def]
        store = conveyor.store()
        row = store.get(name)
        live = current_spec_resolved(name, ls.source)
        assert live.spec is not None  # current_spec_resolved fails the op otherwise
        broker = store.get_broker(row.broker_id) if row.broker_id else None
        remote = broker.spark_remote if broker else conveyor.default_remote()
        result = replay_dead_letters(
            live,
            lambda: spark_session(remote),
            progress=lambda done, total: context.log.info(f"replayed {done}/{total}"),
        )
        store.record(
            name,
            f"dead letters replayed: {result.delivered} delivered, {result.failed_again} failed again, {result.remaining} remain",
            run_id=context.run_id,
        )
        dl = SparkParquetDeadLetters(
            dead_letter_location(live.spec), lambda: spark_session(remote), connector=name
        )
        sample = sample_rows(dl.pending(limit=5)) if result.remaining else []
        context.log_event(
            AssetMaterialization(
                asset_key=dead_letter_key(name),
                description=f"replay: {result.delivered} delivered, {result.failed_again} failed again",
                metadata={
                    "count": MetadataValue.int(result.remaining),
                    "replayed": MetadataValue.int(result.delivered),
                    "failed_again": MetadataValue.int(result.failed_again),
                    "sample": MetadataValue.json(sample),
                },
            )
        )

    @job(
        name=replay_job_name(name),
        executor_def=in_process_executor,
        tags={TAG_REPLAY: name, TAG_CONNECTOR: name},
    )
    def replay_job_def() -> None:
        replay_op()

    return replay_job_def
