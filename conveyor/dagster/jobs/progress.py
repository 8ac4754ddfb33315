"""A sink connector run's progress in the Dagster UI: materializations of the sink asset and
of the dead-letter asset, with the loop's counters, offsets, event-time watermark and the stuck
stage; between them, an observation of the sink asset each time the watermark crosses a minute
or late data arrives (``core.engine.watermarks.report_due``, at most one a second), which
``dagster/landed.py``'s sensor reacts to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dagster import (
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    MetadataValue,
    OpExecutionContext,
)

from conveyor.config.specs import LoadedSpec
from conveyor.core.engine.loop import Progress
from conveyor.core.engine.watermarks import Watermark
from conveyor.dagster.assets.checks import (
    IDLE_PARTITIONS,
    LAG_SECONDS,
    LATE_EVENT_TIMES,
    WATERMARK,
    WATERMARK_BY_PARTITION,
    WATERMARK_TS,
    iso,
)
from conveyor.dagster.assets.lineage import dead_letter_key
from conveyor.dagster.tags import TAG_CONNECTOR


def progress_logger(
    context: OpExecutionContext,
    loaded: LoadedSpec,
    dead_letters: Any = None,
    extra: Callable[[], dict[str, Any]] | None = None,  # more metadata (a partition task's)
    sink: Any = None,
) -> Callable[[Progress], None]:
    """Each progress report of the loop as a materialization of the sink asset (and of the
    dead-letter asset when new dead letters were written); a watermark report as an
    observation of the sink asset."""
    assert loaded.sink is not None
    sink_key = AssetKey(loaded.sink.asset_key_path())
    dead_letters_seen = 0

    def on_progress(p: Progress) -> None:
        nonlocal dead_letters_seen
        if p.watermark_only and p.watermark is not None:
            log_watermark(context, sink_key, loaded.name, p.watermark)
            return
        c = p.counters
        if c.dead_lettered > dead_letters_seen:
            dead_letters_seen = c.dead_lettered
            log_dead_letters(context, loaded.name, dead_letters, c.dead_lettered)
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
        if c.given_up:
            metadata["given_up"] = MetadataValue.json(c.given_up)
        if c.batch_latency_p50_ms is not None:
            metadata["batch_latency_p50_ms"] = MetadataValue.float(c.batch_latency_p50_ms)
        if c.batch_latency_p99_ms is not None:
            metadata["batch_latency_p99_ms"] = MetadataValue.float(c.batch_latency_p99_ms)
        if p.watermark is not None:
            metadata.update(watermark_metadata(p.watermark))
        if extra is not None:
            metadata.update(extra())
        metadata.update(target_commit_metadata(sink))
        context.log_event(
            AssetMaterialization(
                asset_key=sink_key,
                description=f"connector {loaded.name}: {c.messages_out} messages delivered"
                + (" (final)" if p.final else ""),
                metadata=metadata,
                tags={TAG_CONNECTOR: loaded.name},
            )
        )

    return on_progress


def log_watermark(context: OpExecutionContext, key: AssetKey, name: str, wm: Watermark) -> None:
    """The watermark as an observation of the sink asset (tagged with the connector)."""
    through = "unknown" if wm.low is None else iso(wm.low)
    context.log_event(
        AssetObservation(
            asset_key=key,
            description=f"connector {name}: complete through {through}",
            metadata=watermark_metadata(wm),
            tags={TAG_CONNECTOR: name},
        )
    )


def watermark_metadata(wm: Watermark) -> dict[str, Any]:
    """The watermark as sink asset metadata (names in ``assets/checks.py``, which reads them)."""
    out: dict[str, Any] = {
        WATERMARK_BY_PARTITION: MetadataValue.json(
            {name: iso(t) for name, t in wm.by_partition.items()}
        ),
    }
    if wm.low is not None:
        out[WATERMARK] = MetadataValue.text(iso(wm.low))
        out[WATERMARK_TS] = MetadataValue.timestamp(wm.low)
    if wm.lag_seconds is not None:
        out[LAG_SECONDS] = MetadataValue.float(round(wm.lag_seconds, 3))
    if wm.idle:
        out[IDLE_PARTITIONS] = MetadataValue.json(list(wm.idle))
    if wm.late:
        out[LATE_EVENT_TIMES] = MetadataValue.json([[iso(a), iso(b)] for a, b in wm.late])
    return out


def target_commit_metadata(sink: Any) -> dict[str, Any]:
    """As metadata: the delivery a SQL sink writes with in this run (``delivery``: ``auto``
    resolved), and the target's last commit (a lakehouse table's snapshot or version, files and
    rows added: the sink's ``last_commit``); empty for the other sinks."""
    out: dict[str, Any] = {}
    in_effect = getattr(sink, "delivery_in_effect", None)
    if callable(in_effect):
        out["delivery"] = MetadataValue.text(in_effect())
    last = getattr(sink, "last_commit", None)
    if last is None:
        return out
    return out | {
        f"table_{k}": MetadataValue.int(v) if isinstance(v, int) else MetadataValue.text(str(v))
        for k, v in last.metadata().items()
    }


def log_dead_letters(context: OpExecutionContext, name: str, writer: Any, written: int) -> None:
    """Materialize ``dead_letters/<name>`` with the pending count, newest error and a sample."""
    from conveyor.spark.deadletters import SparkParquetDeadLetters, sample_rows

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


def record_stuck_stage(context: OpExecutionContext, loaded: LoadedSpec, reason: str) -> None:
    """The stuck stage on the sink asset's timeline (the run's event log in the UI); a source
    connector's stuck stage is in the run's log only (``supervise`` logs every report)."""
    if loaded.sink is None:
        return
    try:
        context.log_event(
            AssetMaterialization(
                asset_key=AssetKey(loaded.sink.asset_key_path()),
                description=f"connector {loaded.name}: Degraded: {reason}",
                metadata={
                    "status": MetadataValue.text("Degraded"),
                    "reason": MetadataValue.text(reason),
                },
                tags={TAG_CONNECTOR: loaded.name},
            )
        )
    except Exception as e:  # noqa: BLE001 - metadata never stops the supervisor
        context.log.warning(f"could not record the stuck stage: {e}")
