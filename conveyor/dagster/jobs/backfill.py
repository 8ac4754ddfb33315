"""Backfills through the connector: a range of the source topics read again, through the
connector's current transform, into its sink, while the live connector keeps running.

``backfill_range`` reads each partition from the offset at ``start`` to the offset at ``end``
(``earliest``, ``latest``, an ISO 8601 time, or ``TOPIC:PARTITION:OFFSET[,...]``), under its own
consumer group, and never touches the connector's offsets. The rows go to the sink as the
connector would send them (a whole-request rejection bisected to the guilty rows); rows that
fail are counted and named in the log, not dead-lettered. Re-delivered rows are idempotent with
the sink's upsert keys; with a sink that keeps offsets in its target (exactly once), the backfill
is its own writer (``<connector>.backfill-<range digest>``), so a backfill retried after a crash
writes each row of its range once, and never hides a row from the live connector's marks.
Runs as the Dagster job ``backfill__<connector>`` (launched from the UI's launchpad with the
range as run config), progress as observations of the sink asset.
"""

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from dagster import (
    AssetKey,
    AssetObservation,
    Config,
    Failure,
    JobDefinition,
    MetadataValue,
    in_process_executor,
    job,
    op,
)
from pydantic import Field

from conveyor.brokers.kafka import KafkaSource
from conveyor.config.specs import LoadedSpec
from conveyor.core.errors import ConfigError
from conveyor.core.model import OFFSET_COL, PARTITION_COL, TOPIC_COL, Offsets, TopicPartition
from conveyor.core.sink import OffsetsInTarget, send_isolating
from conveyor.dagster.jobs.runs import current_spec_resolved, scrubbed_errors
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_BACKFILL, backfill_job_name
from conveyor.sinks import build_sink
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer

STALL_S = 120.0  # a backfill that reads nothing for this long while its range is not done fails


@dataclass
class BackfillResult:
    read: int = 0
    delivered: int = 0
    failed: int = 0
    filtered: int = 0
    ranges: dict[str, list[int]] = field(default_factory=dict)  # "topic/partition": [from, to)
    failures: list[str] = field(default_factory=list)  # the first few, for the log


def parse_position(text: str) -> str | Offsets:
    """``earliest``, ``latest``, an ISO time (kept as text), or explicit offsets."""
    text = text.strip()
    if ":" in text and not text[:4].isdigit():
        out: Offsets = {}
        for item in text.split(","):
            try:
                topic, part, off = item.strip().rsplit(":", 2)
                out[TopicPartition(topic, int(part))] = int(off)
            except ValueError:
                raise ConfigError(
                    f"{item!r} is not TOPIC:PARTITION:OFFSET", field="backfill"
                ) from None
        return out
    return text


def _resolve(source: KafkaSource, at: str | Offsets) -> Offsets:
    if isinstance(at, dict):
        return at
    return source.offsets_at(at)


def backfill_writer(name: str, lo: Offsets, hi: Offsets) -> str:
    """The writer name a backfill's commits carry in a target that keeps offsets."""
    text = ",".join(f"{tp.topic}/{tp.partition}:{lo.get(tp)}-{hi[tp]}" for tp in sorted(hi))
    return f"{name}.backfill-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def backfill_range(
    ls: LoadedSpec,
    spark: Callable[[], Any],
    *,
    start: str,
    end: str,
    bootstrap: str | None = None,
    progress: Callable[[BackfillResult], None] | None = None,
) -> BackfillResult:
    """Read ``start``..``end`` of the connector's topics again into its sink (``ls`` resolved)."""
    assert ls.spec is not None and ls.sink is not None
    spec = ls.spec
    source_spec = spec.source.with_default_bootstrap(bootstrap)
    group = f"{ls.name}.backfill"
    probe = KafkaSource(source_spec, group_id=group)
    try:
        probe.open({})
        lo = _resolve(probe, parse_position(start))
        hi = _resolve(probe, parse_position(end))
    finally:
        probe.close()
    todo = {tp: lo.get(tp, 0) for tp in hi if lo.get(tp, 0) < hi[tp]}
    result = BackfillResult(
        ranges={f"{tp.topic}/{tp.partition}": [o, hi[tp]] for tp, o in todo.items()}
    )
    if not todo:
        return result
    sink = build_sink(ls.sink)
    if isinstance(sink, OffsetsInTarget):
        sink.bind(backfill_writer(ls.name, lo, hi), 1)
        done = sink.target_offsets() or {}
        todo = {tp: max(o, done.get(tp, o)) for tp, o in todo.items()}
    transform = SparkTransformer(spec.transform, spark)
    source = KafkaSource(source_spec, group_id=group, only=list(todo))
    sink.init_sink()
    try:
        source.open(todo)
        _drain(source, transform, sink, spec, todo, hi, result, progress)
    finally:
        sink.cleanup_sink()
        source.close()
    return result


def _drain(
    source: KafkaSource,
    transform: SparkTransformer,
    sink: Any,
    spec: Any,
    positions: Offsets,
    hi: Offsets,
    result: BackfillResult,
    progress: Callable[[BackfillResult], None] | None,
) -> None:
    positions = dict(positions)
    last_read = time.monotonic()
    while any(positions[tp] < hi[tp] for tp in positions):
        batch = source.read(spec.batch)
        if batch is None or batch.table.num_rows == 0:
            if time.monotonic() - last_read > STALL_S:
                raise Failure(description=f"the backfill read nothing for {STALL_S:.0f} s")
            continue
        last_read = time.monotonic()
        positions.update({tp: o for tp, o in batch.next_offsets.items() if tp in positions})
        table = _within(batch.table, hi)
        result.read += table.num_rows
        if table.num_rows == 0:
            continue
        out = transform(table)
        failures = send_isolating(sink, out.table) if out.table.num_rows else []
        result.failed += len(failures) + len(out.rejected)
        result.delivered += out.table.num_rows - len(failures)
        result.filtered += out.filtered
        result.failures += [f.message for f in failures][: max(0, 5 - len(result.failures))]
        result.failures += [r.message for r in out.rejected][: max(0, 5 - len(result.failures))]
        if progress is not None:
            progress(result)


def _within(table: pa.Table, hi: Offsets) -> pa.Table:
    """The rows of ``table`` below their partition's end of the range."""
    topics = table.column(TOPIC_COL).to_pylist()
    parts = table.column(PARTITION_COL).to_pylist()
    ends = pa.array(
        [hi.get(TopicPartition(t, p), 0) for t, p in zip(topics, parts, strict=True)], pa.int64()
    )
    return table.filter(pc.less(table.column(OFFSET_COL).cast(pa.int64()), ends))


class BackfillConfig(Config):
    """The range a backfill reads again (run config of ``backfill__<connector>``)."""

    start: str = Field(
        description="Where each partition starts: earliest, an ISO 8601 time (the first record "
        "stamped at or after it), or TOPIC:PARTITION:OFFSET[,...]."
    )
    end: str = Field(
        default="latest",
        description="Where each partition ends (excluded): latest (its end when the backfill "
        "starts), an ISO 8601 time, or TOPIC:PARTITION:OFFSET[,...].",
    )


def backfill_job(ls: LoadedSpec) -> JobDefinition:
    name = ls.name
    assert ls.sink is not None
    sink_key = AssetKey(ls.sink.asset_key_path())

    @op(
        name=f"backfill_range__{name}",
        description=f"Read a range of connector {name}'s topics again into its sink.",
        tags={"kind": "spark"},
    )
    @scrubbed_errors
    def backfill_op(context, config: BackfillConfig, conveyor: ConveyorResource) -> None:  # type: ignore[no-untyped-def]
        live = current_spec_resolved(name, ls.source)
        store = conveyor.store()
        row = store.get(name)
        broker = store.get_broker(row.broker_id) if row.broker_id else None
        remote = broker.spark_remote if broker else conveyor.default_remote()

        def observe(r: BackfillResult) -> None:
            context.log_event(
                AssetObservation(
                    asset_key=sink_key,
                    description=f"backfill {config.start} .. {config.end}: {r.delivered} delivered",
                    metadata={
                        "backfill_delivered": MetadataValue.int(r.delivered),
                        "backfill_failed": MetadataValue.int(r.failed),
                        "backfill_ranges": MetadataValue.json(r.ranges),
                    },
                )
            )

        result = backfill_range(
            live,
            lambda: spark_session(remote),
            start=config.start,
            end=config.end,
            bootstrap=conveyor.bootstrap(),
            progress=observe,
        )
        observe(result)
        store.record(
            name,
            f"backfill {config.start} .. {config.end}: {result.delivered} delivered, "
            f"{result.failed} failed, {result.filtered} filtered",
            run_id=context.run_id,
        )
        if result.failed:
            context.log.warning(f"{result.failed} row(s) failed, e.g.: {result.failures}")

    @job(
        name=backfill_job_name(name),
        executor_def=in_process_executor,
        tags={TAG_BACKFILL: name},
    )
    def backfill_job_def() -> None:
        backfill_op()

    return backfill_job_def
