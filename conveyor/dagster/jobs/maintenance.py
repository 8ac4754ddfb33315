"""Lakehouse table maintenance: the Dagster job ``maintain_table__<connector>`` of a connector
whose sink is an Iceberg or a Delta Lake table (issue 39, small files).

Iceberg (pyiceberg 0.12): compaction rewrites the whole table in one transaction (pyiceberg has
no ``rewrite_data_files``; ``scan().to_arrow()`` then ``overwrite``, into files of the table's
``write.target-file-size-bytes``, the newest ``CommitMark`` carried on), only when it holds more
than ``compact_min_files`` data files and at most ``compact_max_rows`` rows (it is read into
memory); then snapshots older than
``retention_hours`` are expired, except the chain from the current snapshot back to the newest
snapshot carrying each connector's ``CommitMark`` (the sink finds its offsets by walking that
chain: ``sinks.lakehouse``), and the files only expired snapshots referenced are deleted
(pyiceberg's ``expire_snapshots`` removes metadata only). Delta Lake (delta-rs):
``optimize.compact()`` then ``vacuum()``; the commit log, which holds the marks, is not touched.

A commit racing the connector's own commit fails one of them (optimistic concurrency on the
table's snapshot / version): the connector retries as an outage, the job fails and runs again
later; rows are never lost or doubled.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dagster import (
    AssetKey,
    AssetObservation,
    Config,
    JobDefinition,
    MetadataValue,
    OpExecutionContext,
    in_process_executor,
    job,
    op,
)
from pydantic import Field

from conveyor.config.specs import LoadedSpec
from conveyor.dagster.jobs.runs import current_spec_resolved, scrubbed_errors
from conveyor.dagster.tags import TAG_MAINTENANCE
from conveyor.sinks.base import SinkConfig
from conveyor.sinks.lakehouse import CommitMark

log = logging.getLogger("conveyor.dagster.jobs.maintenance")

LAKEHOUSE_SINKS = ("iceberg", "delta")
COMPACTION_PROP = "conveyor.maintenance"


def maintenance_job_name(connector: str) -> str:
    """The Dagster job that maintains a lakehouse connector's table."""
    return f"maintain_table__{connector}"


def maintenance_op_name(connector: str) -> str:
    """The job's one op (its run config's key: ``ops: {<this>: {config: ...}}``)."""
    return f"maintain__{connector}"


def is_lakehouse(ls: LoadedSpec) -> bool:
    """A valid sink connector writing an Iceberg or Delta table (it gets a maintenance job)."""
    return ls.ok and not ls.is_source and getattr(ls.sink, "type", None) in LAKEHOUSE_SINKS


class MaintenanceConfig(Config):
    """What one maintenance run does (the job's run config, ops.maintain__<name>.config)."""

    retention_hours: int = Field(
        default=168,
        ge=0,
        description="Iceberg: expire snapshots committed longer ago than this; Delta: vacuum files "
        "removed from the table longer ago than this (below the table's retention too: no check). "
        "A reader's query running longer than this may lose its files.",
    )
    compact: bool = Field(
        default=True, description="Rewrite small files into files of the target size first."
    )
    compact_min_files: int = Field(
        default=10,
        ge=1,
        description="Iceberg: compact only a table holding more data files than this.",
    )
    compact_max_rows: int = Field(
        default=20_000_000,
        ge=1,
        description="Iceberg: skip compaction of a table holding more rows than this (pyiceberg "
        "rewrites the whole table in memory).",
    )
    delete_files: bool = Field(
        default=True,
        description="Iceberg: delete the data and manifest files only expired snapshots referenced.",
    )


@dataclass(frozen=True)
class MaintenanceResult:
    """What one maintenance run did to a table."""

    files_before: int
    files_after: int
    rows: int
    compacted: bool
    snapshots_expired: int = 0
    files_deleted: int = 0

    def metadata(self) -> dict[str, Any]:
        return {
            "data_files_before": MetadataValue.int(self.files_before),
            "data_files_after": MetadataValue.int(self.files_after),
            "rows": MetadataValue.int(self.rows),
            "compacted": MetadataValue.bool(self.compacted),
            "snapshots_expired": MetadataValue.int(self.snapshots_expired),
            "files_deleted": MetadataValue.int(self.files_deleted),
        }


# -- Iceberg -------------------------------------------------------------------------------------


def open_iceberg(config: Any) -> Any:
    """The sink's table, through a catalog of the sink's properties (secrets resolved)."""
    from pyiceberg.catalog import load_catalog

    from conveyor.sinks.iceberg import catalog_properties, confined_table

    catalog = load_catalog(config.catalog.name, **catalog_properties(config))
    ident = (*config.namespace.split("."), config.table)
    return confined_table(catalog.load_table(ident), ident)  # its files under a root


def _totals(table: Any) -> tuple[int, int]:
    """(data files, rows) of the table's current snapshot."""
    snap = table.current_snapshot()
    summary = snap.summary.additional_properties if snap is not None else {}
    return int(summary.get("total-data-files", 0)), int(summary.get("total-records", 0))


def ancestry(table: Any) -> list[Any]:
    """The current snapshot and its ancestors, newest first (as far as they are kept)."""
    by_id = {s.snapshot_id: s for s in table.metadata.snapshots}
    chain: list[Any] = []
    seen: set[int] = set()
    snap = table.current_snapshot()
    while snap is not None and snap.snapshot_id not in seen:
        chain.append(snap)
        seen.add(snap.snapshot_id)
        parent = snap.parent_snapshot_id
        snap = by_id.get(parent) if parent is not None else None
    return chain


def newest_mark(table: Any) -> CommitMark | None:
    """The newest ``CommitMark`` on the current snapshot's ancestry (any connector's)."""
    for snap in ancestry(table):
        mark = CommitMark.of(snap.summary.additional_properties)
        if mark is not None:
            return mark
    return None


def snapshots_to_keep(table: Any) -> set[int]:
    """The current snapshot and its ancestors back to the newest snapshot carrying each
    connector's mark (the ones a sink walks to find its offsets), and every ref's head."""
    keep = {ref.snapshot_id for ref in table.metadata.refs.values()}
    chain, seen, needed = ancestry(table), set(), 1
    for i, snap in enumerate(chain):
        mark = CommitMark.of(snap.summary.additional_properties)
        if mark is not None and mark.connector not in seen:
            seen.add(mark.connector)
            needed = i + 1
    return keep | {s.snapshot_id for s in chain[:needed]}


def files_of(
    table: Any, snapshots: list[Any], cache: dict[tuple[str, bool], set[str]], *, live: bool
) -> set[str]:
    """The files the snapshots reference: manifest lists, manifests, and the data and delete
    files of their entries (``live``: only entries not marked deleted, the files a snapshot
    holds; else every entry, a superset)."""
    out: set[str] = set()
    for snap in snapshots:
        out.add(snap.manifest_list)
        for manifest in snap.manifests(table.io):
            key = (manifest.manifest_path, live)
            if key not in cache:
                entries = manifest.fetch_manifest_entry(table.io, discard_deleted=live)
                cache[key] = {key[0], *(e.data_file.file_path for e in entries)}
            out |= cache[key]
    return out


def expire_iceberg(table: Any, cutoff_ms: int, delete_files: bool) -> tuple[int, int]:
    """Expire the snapshots older than ``cutoff_ms`` outside ``snapshots_to_keep``; delete the
    files only they referenced. (expired, files deleted)."""
    keep = snapshots_to_keep(table)
    old = [s for s in table.metadata.snapshots if s.snapshot_id not in keep]
    old = [s for s in old if s.timestamp_ms < cutoff_ms]
    if not old:
        return 0, 0
    kept = [
        s for s in table.metadata.snapshots if s.snapshot_id not in {o.snapshot_id for o in old}
    ]
    cache: dict[tuple[str, bool], set[str]] = {}
    if delete_files:
        gone = files_of(table, old, cache, live=False) - files_of(table, kept, cache, live=True)
    else:
        gone = set()
    table.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in old]).commit()
    for path in sorted(gone):
        with contextlib.suppress(FileNotFoundError):  # an earlier run failed after its commit
            table.io.delete(path)
    return len(old), len(gone)


def compact_iceberg(table: Any, settings: MaintenanceConfig) -> bool:
    """Rewrite the table's rows into files of its target size (one transaction); False when
    it holds ``compact_min_files`` files or fewer, or more than ``compact_max_rows`` rows."""
    files, rows = _totals(table)
    if files <= settings.compact_min_files:
        return False
    if rows > settings.compact_max_rows:
        log.warning(
            "Iceberg table %s: %d rows, over compact_max_rows %d: not compacted",
            table.name(),
            rows,
            settings.compact_max_rows,
        )
        return False
    from pyiceberg.expressions import AlwaysTrue

    data = table.scan().to_arrow()  # the current snapshot: the transaction's base
    # Two snapshots (pyiceberg's overwrite is a delete, then an append): the newest mark rides
    # on the append only, the one holding the rows it covers (so that expiry may drop the
    # snapshots of the small files); the delete, a table without those rows, carries none.
    mark = newest_mark(table)
    props = {**(mark.properties() if mark is not None else {}), COMPACTION_PROP: "compaction"}
    with table.transaction() as tx:
        tx.delete(AlwaysTrue(), snapshot_properties={COMPACTION_PROP: "compaction"})
        tx.append(data, snapshot_properties=props)
    table.refresh()
    after_files, after_rows = _totals(table)
    if after_rows != rows:  # the transaction's base is the snapshot read: this cannot happen
        raise RuntimeError(f"compaction changed the row count: {rows} -> {after_rows}")
    log.info("Iceberg table %s: %d data files rewritten into %d", table.name(), files, after_files)
    return True


def maintain_iceberg(
    config: Any, settings: MaintenanceConfig, now: Callable[[], float] = time.time
) -> MaintenanceResult:
    """Compact (when due), then expire snapshots and delete their files (nothing to do while
    the connector has not created the table)."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    try:
        table = open_iceberg(config)
    except (NoSuchTableError, NoSuchNamespaceError):
        log.info("Iceberg table %s.%s does not exist yet", config.namespace, config.table)
        return MaintenanceResult(0, 0, 0, compacted=False)
    files_before, _ = _totals(table)
    compacted = settings.compact and compact_iceberg(table, settings)
    cutoff_ms = int((now() - settings.retention_hours * 3600) * 1000)
    expired, deleted = expire_iceberg(table, cutoff_ms, settings.delete_files)
    table.refresh()
    files_after, rows = _totals(table)
    return MaintenanceResult(files_before, files_after, rows, compacted, expired, deleted)


# -- Delta Lake ----------------------------------------------------------------------------------


def open_delta(config: Any) -> Any:
    """The sink's Delta table at its newest version (secrets resolved)."""
    from deltalake import DeltaTable

    from conveyor.sinks.delta import credential_options
    from conveyor.sinks.lakehouse import local_location

    options = {**config.storage_options}
    secret = config.storage_credentials
    options.update(credential_options(secret.get_secret_value() if secret else None))
    return DeltaTable(local_location(config.path), storage_options=options or None)


def maintain_delta(config: Any, settings: MaintenanceConfig) -> MaintenanceResult:
    """``optimize.compact()`` to the sink's target file size, then ``vacuum()`` (nothing to
    do while the connector has not created the table)."""
    from deltalake.exceptions import TableNotFoundError

    try:
        table = open_delta(config)
    except TableNotFoundError:
        log.info("Delta table %s does not exist yet", config.path)
        return MaintenanceResult(0, 0, 0, compacted=False)
    files_before = len(table.file_uris())
    compacted = False
    if settings.compact:
        metrics = table.optimize.compact(target_size=config.target_file_size_mb << 20)
        compacted = int(metrics.get("numFilesRemoved", 0)) > 0
        table.update_incremental()
    deleted = table.vacuum(
        retention_hours=settings.retention_hours,
        dry_run=False,
        enforce_retention_duration=False,
    )
    return MaintenanceResult(
        files_before=files_before,
        files_after=len(table.file_uris()),
        rows=int(table.count()),
        compacted=compacted,
        files_deleted=len(deleted),
    )


def maintain_table(
    sink: SinkConfig, settings: MaintenanceConfig, now: Callable[[], float] = time.time
) -> MaintenanceResult:
    """One maintenance run on a lakehouse sink's table (its config's secrets resolved)."""
    kind = getattr(sink, "type", None)
    if kind == "iceberg":
        return maintain_iceberg(sink, settings, now)
    if kind == "delta":
        return maintain_delta(sink, settings)
    raise ValueError(f"sink type {kind!r} has no table maintenance (only {LAKEHOUSE_SINKS})")


# -- the job -------------------------------------------------------------------------------------


def maintenance_job(ls: LoadedSpec) -> JobDefinition:
    """``maintain_table__<name>``: one op, reading the connector's spec file when it runs."""
    name = ls.name

    def maintain(context: OpExecutionContext, config: MaintenanceConfig) -> None:
        live = current_spec_resolved(name, ls.source)
        assert live.sink is not None
        result = maintain_table(live.sink, config)
        context.log.info(f"table maintenance of {name}: {result}")
        context.log_event(
            AssetObservation(
                asset_key=AssetKey(live.sink.asset_key_path()),
                description="table maintenance",
                metadata=result.metadata(),
            )
        )

    # Dagster reads the config class from the annotation: as a class, not the text
    # ``from __future__ import annotations`` leaves, which it resolves in no namespace.
    maintain.__annotations__.update(context=OpExecutionContext, config=MaintenanceConfig)
    maintain_op = op(
        name=maintenance_op_name(name),
        description=f"Compact connector {name}'s table and expire old snapshots / vacuum.",
        tags={"kind": getattr(ls.sink, "type", "table")},
    )(scrubbed_errors(maintain))

    @job(
        name=maintenance_job_name(name),
        executor_def=in_process_executor,
        tags={TAG_MAINTENANCE: name, "dagster/max_retries": "0"},
        description=f"Table maintenance of connector {name} (run by hand or on a schedule).",
    )
    def maintenance_job_def() -> None:
        maintain_op()

    return maintenance_job_def
