"""What the lakehouse sinks (Iceberg, Delta Lake) share: exactly once through the table's own
commits, buffering to a commit interval or a file size, the warehouse path rule and the rows a
table commit holds.

Cadence: batches are buffered in memory and committed as one table commit once
``commit_interval_s`` (default 60 s) has passed since the first buffered batch, or the buffer
holds ``target_file_size_mb`` MiB of Arrow data; one commit writes one data file per table
partition (more only past the target file size), so the defaults make a file a minute per
partition instead of one per batch. The sinks acknowledge at that commit
(``core.sink.AcknowledgesAtCommit``): the loop holds the buffered batches' offsets and event
times until it is made, so the meta store never gets ahead of the table and the watermark
never claims a row the table does not hold. ``commit_interval_s: 0`` commits every batch
before ``send_batch`` returns.

Every table commit of a sink carries a ``CommitMark`` in its properties (Iceberg: the snapshot
summary; Delta: the commit info's custom metadata): ``conveyor.connector`` (the writer id,
``<writer>@<incarnation>``, ``core/positions.py``), ``conveyor.generation``,
``conveyor.offsets``, the next offset per topic-partition of every row this connector has in
the table (cumulative: a commit holds the offsets of the commits before it), and
``conveyor.logs``, the log id of each topic those offsets are positions in (a position of
another log covers nothing and is dropped from the next mark; the table is the destination). Before committing, the sink reads the table's latest mark of its connector: a
greater generation means this run is a zombie (``FencedError``), and rows whose offsets the
mark already covers are dropped (a replay after a crash between the table commit and the meta
store's commit, or a batch sent twice, is written once). A table commit that loses a race
with another writer is an outage: the retry reads the marks again.
"""

from __future__ import annotations

import abc
import json
import logging
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import pyarrow as pa
from pydantic import Field

from conveyor.core.errors import FencedError, rule
from conveyor.core.model import (
    DESTINATION_COL,
    META_COLUMNS,
    Offsets,
    TopicPartition,
)
from conveyor.core.positions import StoredPosition, StoredPositions, TargetBinding
from conveyor.core.sink import RowFailure, SendResult, first_failure_only, invalid_utf8, utf8_reason
from conveyor.core.trust import paths
from conveyor.sinks.base import Sink, SinkConfig, batch_offsets, payload_columns, unseen_rows

log = logging.getLogger("conveyor.sinks.lakehouse")

CONNECTOR_PROP = "conveyor.connector"
GENERATION_PROP = "conveyor.generation"
OFFSETS_PROP = "conveyor.offsets"
LOGS_PROP = "conveyor.logs"

#: The message columns ``message_columns`` writes next to the payload (``__destination`` is
#: a routing decision, not data).
MESSAGE_COLUMNS = [c for c in META_COLUMNS if c != DESTINATION_COL]

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


# -- config shared by both sinks -----------------------------------------------------------------

DEFAULT_COMMIT_INTERVAL_S = 60.0

CommitIntervalS = Annotated[
    float,
    Field(
        default=DEFAULT_COMMIT_INTERVAL_S,
        ge=0,
        le=86_400,
        description="Seconds to buffer batches in memory before one table commit: at most one data file per "
        "table partition per interval (Kafka Connect's Iceberg sink: 300). The offsets reach the meta store and "
        "the watermark moves only at that commit, so this is also how far behind the table (and the "
        "downstream runs) may be. 0: one commit per batch (small files; run the maintenance job).",
    ),
]
TargetFileSizeMb = Annotated[
    int,
    Field(
        default=128,
        ge=1,
        le=4096,
        description="Commit the buffer early once it holds this many MiB of Arrow data; also the writer's "
        "target data file size (Iceberg's write.target-file-size-bytes, delta-rs's target_file_size).",
    ),
]
AutoEvolveTable = Annotated[
    bool,
    Field(
        default=False,
        description="A payload field the table lacks is added as a nullable column (never dropped or "
        "retyped). Off: a batch with a column the table lacks is refused, naming the column.",
    ),
]
UpsertKeys = Annotated[
    list[str],
    Field(
        default_factory=list,
        description="Key columns: a row replaces the table's rows with the same key (within a batch the "
        "last one by position wins).",
    ),
]
MessageColumnsFlag = Annotated[
    bool,
    Field(
        default=False,
        description="Also write the message columns __topic, __partition, __offset, __timestamp, __key "
        "and __headers next to the payload.",
    ),
]


class LakehouseSinkConfig(SinkConfig):
    """The fields both lakehouse sinks share (their rules are ``lakehouse_rules``)."""

    commit_interval_s: CommitIntervalS = DEFAULT_COMMIT_INTERVAL_S
    target_file_size_mb: TargetFileSizeMb = 128
    auto_evolve: AutoEvolveTable = False
    upsert_keys: UpsertKeys
    message_columns: MessageColumnsFlag = False

    def offsets_in_target(self) -> bool:
        return True  # every commit carries the offsets (``CommitMark``)

    def lakehouse_rules(self) -> None:
        """Rules every lakehouse config checks in its model validator."""
        rule(
            len(set(self.upsert_keys)) == len(self.upsert_keys),
            "a key column is named twice",
            field="upsert_keys",
        )
        rule(
            not any(k in META_COLUMNS for k in self.upsert_keys) or self.message_columns,
            "a message column as a key needs message_columns: true",
            field="upsert_keys",
        )


def location_problem(value: str) -> str | None:
    """Why a table location is refused, or None: another scheme's URL (s3://, gs://, abfss://)
    passes as written; a path or a ``file://`` URL lies under a root (``core.trust.paths``: a
    relative one from ``$CONVEYOR_HOME``), so a spec cannot make a run write anywhere on its
    host."""
    return paths.location_problem(value)


def local_location(value: str, *, field: str = "sink.path") -> str:
    """A location ``location_problem`` accepted, as the writers take it, resolved now (at
    use): an absolute real local path, or the URL as written; ConfigError naming ``field``
    when it is refused."""
    return paths.resolve_location(value, field=field)


def is_local(location: str) -> bool:
    return not _SCHEME.match(location)


# -- the mark each commit carries ----------------------------------------------------------------


@dataclass(frozen=True)
class CommitMark:
    """What a table commit says about the connector that made it."""

    connector: str
    generation: int
    offsets: Offsets
    log_ids: Mapping[str, str] = field(default_factory=dict)  # topic -> log id (known ones)

    def positions(self) -> StoredPositions:
        """The mark's offsets as positions of their logs (the table is their destination)."""
        return {tp: StoredPosition(o, self.log_ids.get(tp.topic)) for tp, o in self.offsets.items()}

    def properties(self) -> dict[str, str]:
        """The commit's properties (text values, as Iceberg's snapshot summary holds them)."""
        return {
            CONNECTOR_PROP: self.connector,
            GENERATION_PROP: str(self.generation),
            OFFSETS_PROP: json.dumps(
                {f"{tp.topic}/{tp.partition}": o for tp, o in sorted(self.offsets.items())},
                separators=(",", ":"),
            ),
            LOGS_PROP: json.dumps(dict(sorted(self.log_ids.items())), separators=(",", ":")),
        }

    @classmethod
    def of(cls, props: Mapping[str, Any]) -> CommitMark | None:
        """The mark in a commit's properties; None for a commit without one (another writer's)."""
        if CONNECTOR_PROP not in props or OFFSETS_PROP not in props:
            return None
        try:
            raw = json.loads(str(props[OFFSETS_PROP]))
            offsets = {}
            for tp, o in raw.items():
                topic, partition = str(tp).rsplit("/", 1)
                offsets[TopicPartition(topic, int(partition))] = int(o)
            logs = json.loads(str(props.get(LOGS_PROP) or "{}"))
            return cls(
                str(props[CONNECTOR_PROP]),
                int(props.get(GENERATION_PROP, 0)),
                offsets,
                {str(t): str(i) for t, i in logs.items() if i},
            )
        except (ValueError, TypeError, AttributeError):
            log.warning("a table commit's %s is not Conveyor's: ignored", OFFSETS_PROP)
            return None


# -- rows ---------------------------------------------------------------------------------------


def utf8_failures(batch: pa.Table) -> list[RowFailure]:
    """The rows holding text that is not valid UTF-8 (Arrow does not check buffers it did not
    build; a Parquet writer would store them as they are), each naming the column and byte."""
    bad: dict[int, str] = {}
    for name in batch.schema.names:
        column = batch.column(name)
        try:
            column.validate(full=True)
            continue
        except pa.ArrowInvalid:
            pass
        for i in range(batch.num_rows):
            if i in bad:
                continue
            try:
                column.slice(i, 1).to_pylist()
            except UnicodeDecodeError as e:
                row = batch.slice(i, 1)
                bad[i] = invalid_utf8(row) or utf8_reason(e, f"column {name!r}")
    return [RowFailure(i, bad[i]) for i in sorted(bad)]


def writable_rows(batch: pa.Table, fail_fast: bool) -> tuple[list[RowFailure], pa.Table]:
    """The batch's row failures and the rows to write (under ``fail_fast``: the first failure
    and only the rows before it)."""
    failed = utf8_failures(batch)
    if not failed:
        return [], batch
    todo = list(range(batch.num_rows))
    if fail_fast:
        failed, todo = first_failure_only(failed, todo)
    bad = {f.index for f in failed}
    keep = [i for i in todo if i not in bad]
    return failed, batch.take(pa.array(keep, pa.int64()))


def data_columns(table: pa.Table, message_columns: bool) -> pa.Table:
    """What a table commit writes: the payload columns, and the message columns if asked."""
    names = payload_columns(table)
    if message_columns:
        names += [c for c in MESSAGE_COLUMNS if c in table.schema.names]
    return table.select(names)


def last_per_key(table: pa.Table, keys: list[str]) -> pa.Table:
    """One row per key: the last by position (a merge refuses two source rows for one key)."""
    if not keys or table.num_rows == 0:
        return table
    import pyarrow.compute as pc

    pos = "__conveyor_row"
    numbered = table.append_column(pos, pa.array(range(table.num_rows), pa.int64()))
    last = numbered.group_by(keys, use_threads=False).aggregate([(pos, "max")])
    rows = pc.sort_indices(last.column(f"{pos}_max"))
    return table.take(pc.take(last.column(f"{pos}_max"), rows))


# -- the sink both formats build on --------------------------------------------------------------


@dataclass(frozen=True)
class CommitInfo:
    """The last table commit a sink made, for the sink asset's metadata."""

    snapshot: str  # Iceberg snapshot id / Delta version
    files_added: int
    rows_added: int

    def metadata(self) -> dict[str, Any]:
        return {
            "snapshot": self.snapshot,
            "files_added": self.files_added,
            "rows_added": self.rows_added,
        }


class LakehouseSink(Sink):
    """Buffers batches and commits them to a table, each commit carrying its ``CommitMark``;
    acknowledges at that commit (``core.sink.AcknowledgesAtCommit``).

    A subclass reads the table's marks (``_latest_mark``) and writes one commit
    (``_write``); ``_mapped`` turns its client's exceptions into sink errors.
    """

    config: LakehouseSinkConfig

    def __init__(self, config: LakehouseSinkConfig, *, clock: Callable[[], float] | None = None):
        super().__init__(config)
        self.binding = TargetBinding("", 0)  # unbound: the marks of an unnamed writer
        self.last_commit: CommitInfo | None = None
        self._clock = clock or time.monotonic
        self._pending: list[pa.Table] = []
        self._pending_bytes = 0
        self._pending_since = 0.0
        self._pending_offsets: Offsets = {}  # next offset per partition of what is buffered

    def bind(self, binding: TargetBinding) -> None:
        """The writer id and generation this sink writes for (before ``init_sink``): its
        commits carry them, and a table holding a newer generation's commit fences it."""
        self.binding = binding

    @property
    def connector(self) -> str:
        """The writer id the commits carry."""
        return self.binding.writer

    @property
    def generation(self) -> int:
        return self.binding.generation

    def is_mine(self, mark: CommitMark) -> bool:
        """Whether ``mark`` is this writer's (a migrated connector's under its bare name too,
        until it commits under its writer id)."""
        return mark.connector in (self.binding.writer, self.binding.legacy_writer)

    def target_offsets(self) -> StoredPositions | None:
        """The positions of the table's latest commit of this writer; None when it has none."""
        mark = self._latest_mark()
        return mark.positions() if mark is not None else None

    def retire_target_offsets(self, connector: str) -> str | None:
        """The marks stay in the table's commit history (a commit cannot be taken back); a new
        incarnation's writer id never matches them."""
        return (
            f"{self.describe()}: its commits keep the marks of {connector} in the table's "
            "history; a connector created again under this name has a new writer id and never "
            "reads them"
        )

    def move_target_offsets(
        self,
        connector: str,
        generations: Mapping[str, int],
        offsets: Offsets,
        *,
        forget: Collection[TopicPartition] = (),
        replace: bool = False,
    ) -> None:
        """Refused: the offsets live in the table's commit history (the latest ``CommitMark``),
        and moving them would take a commit of no rows carrying a new mark, which these sinks
        do not write."""
        from conveyor.core.errors import PermanentSinkError

        raise PermanentSinkError(
            f"{self.describe()}: the offsets are in the table's own commits (each commit's "
            "conveyor.offsets); an offsets change would need a table commit without rows, which "
            "this sink does not make. Write a new table, or reset with the connector's "
            "offsets: give the connector another name"
        )

    def send_batch(self, batch: pa.Table) -> SendResult:
        """Buffer the batch's writable rows (a row already buffered, by its offset, is not
        buffered again); commit the buffer when due. A failed commit raises and keeps it."""
        failed, rows = writable_rows(batch, self.fail_fast)
        rows = unseen_rows(rows, self._pending_offsets)
        if rows.num_rows:
            if not self._pending:
                self._pending_since = self._clock()
            self._pending.append(rows)
            self._pending_bytes += rows.nbytes
            self._pending_offsets.update(batch_offsets(rows))
        if self.commit_due():
            self.commit_held()
        return SendResult(rows=batch.num_rows, failed=tuple(failed))

    def uncommitted_rows(self) -> int:
        """Rows buffered and not yet in a table commit."""
        return sum(t.num_rows for t in self._pending)

    def commit_due(self) -> bool:
        """The buffer's interval has passed, or it holds the target file size."""
        if not self._pending:
            return False
        if self.config.commit_interval_s <= 0:
            return True
        full = self._pending_bytes >= self.config.target_file_size_mb << 20
        return full or self._clock() - self._pending_since >= self.config.commit_interval_s

    def commit_held(self) -> None:
        """Commit what is buffered (one table commit); a failed commit keeps the buffer."""
        if not self._pending:
            return
        table = pa.concat_tables(self._pending, promote_options="permissive")
        with self._mapped():
            self._commit(table)
        self._drop_buffer()

    def _drop_buffer(self) -> None:
        self._pending.clear()
        self._pending_bytes = 0
        self._pending_offsets = {}

    def _commit(self, table: pa.Table) -> None:
        mark = self._latest_mark()
        if mark is not None and mark.generation > self.generation:
            raise FencedError(
                f"connector {self.connector!r}: the table holds a commit of generation "
                f"{mark.generation}, this run is generation {self.generation}; not committing"
            )
        known = self.binding.usable(mark.positions()) if mark is not None else {}
        fresh = unseen_rows(table, known)
        if fresh.num_rows == 0:
            return  # every row is in the table already (a replay)
        offsets = {**known, **batch_offsets(fresh)}
        logs = {**(mark.log_ids if mark is not None else {}), **self.binding.scope.log_ids}
        kept = {tp.topic for tp in offsets}
        log_ids = {t: i for t, i in logs.items() if i and t in kept}
        self._write(fresh, CommitMark(self.connector, self.generation, offsets, log_ids))

    def cleanup_sink(self) -> None:
        """Release the table. Never commits: rows still buffered were not acknowledged (the
        runtime commits what it means to with ``commit_held``); they are read again."""
        if self._pending:
            log.info(
                "%s: %d buffered rows dropped on close, not committed (read again on start)",
                self.describe(),
                self.uncommitted_rows(),
            )
        self._drop_buffer()
        self._close()

    @abc.abstractmethod
    def _latest_mark(self) -> CommitMark | None:
        """The newest mark of ``self.connector`` in the table (read now), or None."""

    @abc.abstractmethod
    def _write(self, table: pa.Table, mark: CommitMark) -> None:
        """One table commit of ``table`` (message columns included) carrying ``mark``;
        sets ``last_commit``."""

    @abc.abstractmethod
    def _mapped(self) -> Any:
        """A context manager raising the client's exceptions as sink errors."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the table and its catalog. Idempotent."""


def conform(
    data: pa.Table, schema: pa.Schema, *, auto_evolve: bool, keep_extra: bool = False
) -> pa.Table:
    """``data`` in the table's column order and types (a millisecond timestamp as the table's
    microseconds, a column the batch lacks as nulls). A column the table lacks (kept as it is,
    after the others, with ``keep_extra``: the writer adds it), or a value its column cannot
    hold, raises ``PermanentSinkError`` naming the column (the retry would fail the same way)."""
    from conveyor.core.errors import PermanentSinkError

    extra = [n for n in data.schema.names if schema.get_field_index(n) < 0]
    if extra and not keep_extra:
        hint = "" if auto_evolve else " (auto_evolve: true adds it)"
        raise PermanentSinkError(f"the table has no column {', '.join(extra)}{hint}")
    columns = []
    for f in schema:
        if f.name not in data.schema.names:
            columns.append(pa.nulls(data.num_rows, f.type))
            continue
        column = data.column(f.name)
        try:
            columns.append(column if column.type == f.type else column.cast(f.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise PermanentSinkError(
                f"column {f.name}: the table's {f.type} cannot hold the batch's {column.type}: {e}"
            ) from None
    out = pa.Table.from_arrays(columns, schema=schema)
    for name in extra:
        out = out.append_column(data.schema.field(name), data.column(name))
    return out


def nullable_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every top-level field nullable (a table created from one batch must
    take a later batch's nulls)."""
    return pa.schema([f.with_nullable(True) for f in schema], metadata=schema.metadata)
