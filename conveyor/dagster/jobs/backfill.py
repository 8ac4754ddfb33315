"""Backfills through the connector: a range of the source topics read again, through the
connector's current transform, into its sink, while the live connector keeps running.

``backfill_range`` reads each partition from the offset at ``start`` to the offset at ``end``
(``earliest``, ``latest``, an ISO 8601 time, or ``TOPIC:PARTITION:OFFSET[,...]``), under its own
consumer group, and never touches the connector's offsets. A time is found by reading, not by
asking the broker alone: a partition's range starts at its first record stamped at or after
``start`` and ends before its first record stamped at or after ``end`` (or at its end when the
backfill starts), so it is exact on any Kafka-protocol broker (the broker's ListOffsets by time
only says where to start reading). The rows go to the sink as the
connector would send them (a whole-request rejection bisected to the guilty rows); rows that
fail are counted and named in the log, not dead-lettered. Re-delivered rows are idempotent with
the sink's upsert keys; with a sink that keeps offsets in its target (exactly once), the backfill
is its own writer (``<connector>.backfill-<request>``: ``r<id>`` for a request of the CLI or the
API, the root run id for a run launched by hand; with the connector's incarnation), so a
backfill retried after a crash (the request's run again, or a re-execution of the run) writes
each row of its range once, a backfill requested again delivers its range again, and neither
hides a row from the live connector's marks.
Runs as the Dagster job ``backfill__<connector>``: launched from the UI's launchpad with the
range as run config, or by the backfills sensor for a request of the CLI or the API (its id in
the run config: the run reports its state and counts to the request); progress as observations
of the sink asset.
"""

import contextlib
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
from conveyor.core.errors import TransientStoreError
from conveyor.core.model import (
    OFFSET_COL,
    PARTITION_COL,
    TIMESTAMP_COL,
    TOPIC_COL,
    Offsets,
    TopicPartition,
)
from conveyor.core.positions import PositionScope, TargetBinding, writer_id
from conveyor.core.sink import OffsetsInTarget, commit_held, send_isolating
from conveyor.dagster.jobs.runs import current_spec_resolved, scrubbed_errors
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_BACKFILL, backfill_job_name
from conveyor.sinks import build_sink
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer
from conveyor.store.meta import (
    BACKFILL_FAILED,
    BACKFILL_RUNNING,
    BACKFILL_SUCCEEDED,
    Position,
    parse_backfill_range,
    parse_position,
    position_ms,
)

STALL_S = 120.0  # a backfill that reads nothing for this long while its range is not done fails
REPORT_EVERY_S = 5.0  # a requested backfill's counts in the meta store, at most this often

__all__ = ["BackfillConfig", "backfill_job", "backfill_range", "backfill_writer", "parse_position"]


@dataclass
class BackfillResult:
    read: int = 0
    delivered: int = 0
    failed: int = 0
    filtered: int = 0
    ranges: dict[str, list[int]] = field(default_factory=dict)  # "topic/partition": [from, to)
    failures: list[str] = field(default_factory=list)  # the first few, for the log


def _resolve(source: KafkaSource, at: Position) -> Offsets:
    """Offsets, or where to start looking for a time (the broker's answer is a lower bound:
    the range's own reading finds the record)."""
    if isinstance(at, dict):
        return at
    return source.offsets_at(at)


@dataclass
class TimeBounds:
    """A time range found by reading: per partition, the range starts at the first record
    stamped at or after ``start_ms`` and ends at the first stamped at or after ``end_ms``."""

    start_ms: int | None
    end_ms: int | None
    started: set[TopicPartition] = field(default_factory=set)

    def keep(self, table: pa.Table, hi: Offsets, result: BackfillResult) -> pa.Table:
        """The rows of ``table`` (inside ``hi`` already) inside the range; shortens ``hi``
        where the end is found."""
        if table.num_rows == 0:
            return table
        stamped = table.column(TIMESTAMP_COL).cast(pa.int64())
        parts = table.column(PARTITION_COL).to_pylist()
        topics = table.column(TOPIC_COL).to_pylist()
        if self._all_inside(stamped, set(zip(topics, parts, strict=True))):
            return table  # the common case, in the middle of a range: no row by row
        offs = table.column(OFFSET_COL).to_pylist()
        stamps = stamped.to_pylist()
        mask = []
        for topic, part, off, ts in zip(topics, parts, offs, stamps, strict=True):
            tp = TopicPartition(topic, part)
            mask.append(self._inside(tp, off, ts, hi, result))
        return table.filter(pa.array(mask, pa.bool_()))

    def _all_inside(self, stamped: pa.ChunkedArray, partitions: set[tuple[str, int]]) -> bool:
        """Every row stamped, every partition of the batch started, none at or past the end."""
        if stamped.null_count:
            return False
        if self.start_ms is not None and not all(
            TopicPartition(t, p) in self.started for t, p in partitions
        ):
            return False
        return self.end_ms is None or pc.max(stamped).as_py() < self.end_ms

    def _inside(
        self, tp: TopicPartition, off: int, ts: int | None, hi: Offsets, result: BackfillResult
    ) -> bool:
        if off >= hi.get(tp, 0):
            return False
        if self.end_ms is not None and ts is not None and ts >= self.end_ms:
            hi[tp] = off  # this partition's range ends here
            result.ranges[f"{tp.topic}/{tp.partition}"][1] = off
            return False
        if tp not in self.started:
            if self.start_ms is not None and (ts is None or ts < self.start_ms):
                return False
            self.started.add(tp)
            result.ranges[f"{tp.topic}/{tp.partition}"][0] = off
        return True


def backfill_writer(name: str, request: str) -> str:
    """The writer name a backfill's commits carry in a target that keeps offsets: one per
    request (``r<id>``) or per run launched by hand (its root run id), so the same range
    requested again is delivered again, and a retry of one request resumes it."""
    return f"{name}.backfill-{request}"


def backfill_request_key(request_id: int | None, root_run_id: str) -> str:
    """``r<id>`` for a request, else the run's root run id (a re-execution keeps it)."""
    return f"r{request_id}" if request_id is not None else f"run-{root_run_id[:12]}"


def backfill_range(
    ls: LoadedSpec,
    spark: Callable[[], Any],
    *,
    start: str,
    end: str,
    bootstrap: str | None = None,
    progress: Callable[[BackfillResult], None] | None = None,
    request: str,
    incarnation: str = "",
) -> BackfillResult:
    """Read ``start``..``end`` of the connector's topics again into its sink (``ls`` resolved);
    ``request`` names its writer (``backfill_writer``), ``incarnation`` the connector's."""
    assert ls.spec is not None and ls.sink is not None
    spec = ls.spec
    lo_at, hi_at = parse_backfill_range(start, end, spec.source)
    bounds = TimeBounds(position_ms(lo_at), position_ms(hi_at))
    source_spec = spec.source.with_default_bootstrap(bootstrap)
    group = f"{ls.name}.backfill"
    probe = KafkaSource(source_spec, group_id=group)
    try:
        probe.describe_logs()
        probe.open({})
        lo = _resolve(probe, lo_at)
        # An end in time is found by reading, up to where each partition ends now.
        hi = _resolve(probe, "latest" if bounds.end_ms is not None else hi_at)
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
        scope = PositionScope("/".join(ls.sink.asset_key_path()), dict(probe.log_ids))
        binding = TargetBinding(writer_id(backfill_writer(ls.name, request), incarnation), 1, scope)
        sink.bind(binding)
        done = binding.usable(sink.target_offsets() or {})
        # A partition this writer has delivered from is past its start already.
        bounds.started |= {tp for tp, o in todo.items() if done.get(tp, o) > o}
        todo = {tp: max(o, done.get(tp, o)) for tp, o in todo.items()}
    transform = SparkTransformer(spec.transform, spark)
    source = KafkaSource(source_spec, group_id=group, only=list(todo))
    sink.init_sink()
    try:
        source.open(todo)
        timed = bounds if bounds.start_ms is not None or bounds.end_ms is not None else None
        _drain(source, transform, sink, spec, todo, hi, result, progress, timed)
        commit_held(sink)  # a lakehouse table's last buffer: the range is in it, or this fails
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
    bounds: TimeBounds | None = None,
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
        if bounds is not None:
            table = bounds.keep(table, hi, result)
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
        "starts), an ISO 8601 time (before the first record stamped at or after it), or "
        "TOPIC:PARTITION:OFFSET[,...].",
    )
    request_id: int | None = Field(
        default=None,
        description="The backfill request (conveyor backfill, POST /connectors/{name}/backfills) "
        "this run serves: its state and counts are reported there. Set by the backfills sensor.",
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
        store = conveyor.store()
        report = RequestReport(store, config.request_id, context.run_id)
        report.started()
        try:
            result = _run(context, config, conveyor, ls, sink_key, report)
        except BaseException as e:
            report.failed(e)
            raise
        summary = (
            f"backfill {config.start} .. {config.end}: {result.delivered} delivered, "
            f"{result.failed} failed, {result.filtered} filtered"
        )
        store.record(name, summary, run_id=context.run_id)
        report.ended(BACKFILL_SUCCEEDED, result, summary)
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


def _run(
    context: Any,
    config: BackfillConfig,
    conveyor: ConveyorResource,
    ls: LoadedSpec,
    sink_key: AssetKey,
    report: "RequestReport",
) -> BackfillResult:
    """The backfill of one run: its range read again into the live spec's sink, progress as
    observations of the sink asset (and in the request's counts)."""
    live = current_spec_resolved(ls.name, ls.source)
    store = conveyor.store()
    row = store.get(ls.name)
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
        report.progress(r)

    result = backfill_range(
        live,
        lambda: spark_session(remote),
        start=config.start,
        end=config.end,
        bootstrap=conveyor.bootstrap(),
        progress=observe,
        request=backfill_request_key(config.request_id, context.run.root_run_id or context.run_id),
        incarnation=row.incarnation,
    )
    observe(result)
    return result


class RequestReport:
    """What a run serving a backfill request (``request_id`` in its run config) writes to it:
    running with its run id, counts now and then, its end. Nothing without a request."""

    def __init__(self, store: Any, request_id: int | None, run_id: str):
        self.store, self.request_id, self.run_id = store, request_id, run_id
        self.last = 0.0

    def started(self) -> None:
        if self.request_id is not None:
            self.store.update_backfill(self.request_id, BACKFILL_RUNNING, run_id=self.run_id)

    def progress(self, r: BackfillResult) -> None:
        now = time.monotonic()
        if self.request_id is None or now - self.last < REPORT_EVERY_S:
            return
        self.last = now
        with contextlib.suppress(TransientStoreError):  # reported again, and at the end
            self.store.update_backfill(
                self.request_id, BACKFILL_RUNNING, counts=(r.read, r.delivered, r.failed)
            )

    def failed(self, error: BaseException) -> None:
        """The run fails: so does its request (a store that cannot take it leaves that to the
        backfills sensor, which finds the failed run)."""
        message = getattr(error, "description", None) or str(error)
        with contextlib.suppress(Exception):  # the run's own error is the one raised
            self.ended(BACKFILL_FAILED, None, f"{type(error).__name__}: {message}")

    def ended(self, state: str, r: BackfillResult | None, message: str) -> None:
        if self.request_id is None:
            return
        counts = (r.read, r.delivered, r.failed) if r is not None else None
        self.store.update_backfill(
            self.request_id, state, run_id=self.run_id, counts=counts, message=message
        )
