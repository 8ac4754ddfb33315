"""Delta Lake sink (deltalake, delta-rs): each commit one Arrow append, or a merge by key,
carrying the connector's offsets in the commit info's custom metadata.

Exactly once through the table's commits, buffering and fencing: ``sinks.lakehouse``. A commit
is tried once (``max_commit_retries=0``): one that loses a race with another writer fails as
an outage, and the retry reads the table's marks again before committing. The table is created
by the first commit; ``auto_evolve`` merges new payload fields into its schema.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field, SecretStr, model_validator

from conveyor.core.asset_keys import key_part
from conveyor.core.errors import (
    ConveyorError,
    PermanentSinkError,
    SinkError,
    TransientSinkError,
    rule,
)
from conveyor.core.trust.references import known_now
from conveyor.sinks.base import mapped_errors, secret
from conveyor.sinks.lakehouse import (
    CommitInfo,
    CommitMark,
    LakehouseSink,
    LakehouseSinkConfig,
    conform,
    data_columns,
    is_local,
    last_per_key,
    local_location,
    location_problem,
    nullable_schema,
)

log = logging.getLogger("conveyor.sinks.delta")

# An object store's words for an outage (delta-rs reports them as a generic DeltaError).
_OUTAGE_WORDS = ("connection", "timed out", "timeout", "temporarily", "unavailable", "503", "429")


class DeltaSinkConfig(LakehouseSinkConfig):
    """Rows appended or merged into a Delta Lake table."""

    type: Literal["delta"] = "delta"
    path: str = Field(
        description="The table: a path or file:// URL under a root ($CONVEYOR_HOME, relative: from there; "
        "section Files a spec names); an object storage URL (s3://, gs://, abfss://, az://) is passed as "
        "written."
    )
    storage_options: dict[str, str] = Field(
        default_factory=dict,
        description="Object store options for delta-rs that are not secret (AWS_REGION, AWS_ENDPOINT_URL, "
        "AWS_ALLOW_HTTP, ...).",
    )
    storage_credentials: SecretStr | None = Field(
        default=None,
        description="Object store credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AZURE_STORAGE_ACCOUNT_KEY, "
        "...) as one secret: KEY=VALUE lines or a JSON object, by reference (${file:/run/secrets/lake}); merged "
        "over storage_options. Unset: delta-rs also reads them from the run's environment.",
    )
    partition_by: list[str] = Field(
        default_factory=list,
        description="Partition columns of the table the first commit creates (a day: a date column "
        "the transform's select computes, e.g. to_date(ts) AS day).",
    )
    mode: Literal["append", "merge"] = Field(
        default="append",
        description="append: every row is added; merge: DeltaTable.merge on upsert_keys, matched rows "
        "updated, the others inserted.",
    )

    def asset_key_path(self) -> list[str]:
        name = PurePosixPath(self.path.rstrip("/")).name or "table"
        return ["delta", key_part(name, "table")]

    @model_validator(mode="after")
    def _rules(self) -> DeltaSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        problem = location_problem(self.path)
        rule(problem is None, problem or "", field="path")
        text = secret(self.storage_credentials)
        if known_now(text):
            try:
                credential_options(text)
            except ValueError as e:
                rule(False, str(e), field="storage_credentials")
        rule(
            (self.mode == "merge") == bool(self.upsert_keys),
            "mode merge needs upsert_keys, and upsert_keys need mode: merge",
            field="upsert_keys",
        )
        rule(
            len(set(self.partition_by)) == len(self.partition_by),
            "a partition column is named twice",
            field="partition_by",
        )
        self.lakehouse_rules()
        return self


def credential_options(text: str | None) -> dict[str, str]:
    """``storage_credentials`` as options: a JSON object of text values, or KEY=VALUE lines
    (blank lines and # comments skipped). ValueError saying what is wrong, never the value."""
    if not text or not text.strip():
        return {}
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            raise ValueError("is not a JSON object (nor KEY=VALUE lines)") from None
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError("must be a JSON object of text values")
        return {str(k): v for k, v in data.items()}
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"line {n} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def classify_delta(e: BaseException) -> SinkError | None:
    """A delta-rs exception as a sink error (None: not one of its exceptions)."""
    if isinstance(e, ConveyorError):
        return None
    from deltalake.exceptions import (
        CommitFailedError,
        DeltaError,
        DeltaProtocolError,
        SchemaMismatchError,
    )

    name = type(e).__name__
    msg = str(e).strip().splitlines()[0] if str(e).strip() else name
    if isinstance(e, (CommitFailedError, OSError, TimeoutError)):
        return TransientSinkError(f"Delta table unavailable or changed under the commit: {msg}")
    if isinstance(e, (SchemaMismatchError, DeltaProtocolError, pa.ArrowException)):
        return PermanentSinkError(f"Delta refused the write: {name}: {msg}")
    if isinstance(e, DeltaError):
        if any(w in msg.lower() for w in _OUTAGE_WORDS):
            return TransientSinkError(f"Delta table's store unavailable: {msg}")
        return PermanentSinkError(f"Delta refused the write: {name}: {msg}")
    return None


class DeltaSink(LakehouseSink):
    """Appends or merges each commit's rows; the mark rides in the commit's custom metadata."""

    config_class = DeltaSinkConfig
    config: DeltaSinkConfig

    def __init__(self, config: DeltaSinkConfig, **kwargs: Any):
        super().__init__(config, **kwargs)
        self._location = local_location(config.path)
        self._table: Any = None
        self._seen: int | None = None  # the version whose marks were read
        self._mark: CommitMark | None = None  # this connector's newest mark up to _seen

    def _options(self) -> dict[str, str] | None:
        opts = {**self.config.storage_options}
        opts.update(credential_options(secret(self.config.storage_credentials)))
        return opts or None

    def init_sink(self) -> None:
        self._location = local_location(self.config.path)  # resolved again as it is opened
        if is_local(self._location):
            try:
                os.makedirs(self._location, exist_ok=True)
            except OSError as e:
                raise PermanentSinkError(f"cannot create {self._location}: {e.strerror}") from None
        with self._mapped():
            self._table = self._load()

    def _load(self) -> Any:
        """The table at its newest version; None while no commit created it."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        if self._table is not None:
            self._table.update_incremental()
            return self._table
        try:
            return DeltaTable(self._location, storage_options=self._options())
        except TableNotFoundError:
            return None

    def _latest_mark(self) -> CommitMark | None:
        with self._mapped():
            self._table = self._load()
            if self._table is None:
                return None
            version = int(self._table.version())
            if version != self._seen:
                newer = version + 1 if self._seen is None else version - self._seen
                found = self._newest_mark(self._table.history(limit=newer))
                self._mark = found or self._mark
                self._seen = version
        return self._mark

    def _newest_mark(self, history: list[dict[str, Any]]) -> CommitMark | None:
        for commit in history:  # newest first
            mark = CommitMark.of(commit)
            if mark is not None and self.is_mine(mark):
                return mark
        return None

    def _write(self, table: pa.Table, mark: CommitMark) -> None:
        from deltalake import CommitProperties, write_deltalake

        data = data_columns(table, self.config.message_columns)
        props = CommitProperties(custom_metadata=mark.properties(), max_commit_retries=0)
        if self._table is None:
            self._create(data, props)
        else:
            schema = pa.schema(self._table.schema().to_arrow())
            evolve = self.config.auto_evolve and not set(data.schema.names) <= set(schema.names)
            data = conform(data, schema, auto_evolve=self.config.auto_evolve, keep_extra=evolve)
            if self.config.mode == "merge":
                self._merge(data, props, evolve)
            else:
                write_deltalake(
                    self._table,
                    data,
                    mode="append",
                    schema_mode="merge" if evolve else None,
                    target_file_size=self.config.target_file_size_mb << 20,
                    commit_properties=props,
                )
        self._table = self._load()
        self._seen, self._mark = int(self._table.version()), mark
        self.last_commit = commit_info(self._table)

    def _create(self, data: pa.Table, props: Any) -> None:
        from deltalake import write_deltalake

        missing = [c for c in self.config.partition_by if c not in data.schema.names]
        if missing:
            raise PermanentSinkError(
                f"partition_by: column {', '.join(missing)} is not in the batch "
                f"(columns: {', '.join(data.schema.names)})"
            )
        if self.config.mode == "merge":
            data = last_per_key(data, self.config.upsert_keys)
        write_deltalake(
            self._location,
            data.cast(nullable_schema(data.schema)),
            mode="append",
            partition_by=self.config.partition_by or None,
            storage_options=self._options(),
            target_file_size=self.config.target_file_size_mb << 20,
            commit_properties=props,
        )
        log.info("created Delta table %s", self.describe())

    def _merge(self, data: pa.Table, props: Any, evolve: bool) -> None:
        keys = self.config.upsert_keys
        predicate = " AND ".join(f"t.`{k}` = s.`{k}`" for k in keys)
        (
            self._table.merge(
                last_per_key(data, keys),
                predicate=predicate,
                source_alias="s",
                target_alias="t",
                merge_schema=evolve,
                commit_properties=props,
            )
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute()
        )

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[None]:
        with mapped_errors(classify_delta):
            yield

    def _close(self) -> None:
        self._table = None
        self._seen = None
        self._mark = None


def commit_info(table: Any) -> CommitInfo:
    """The table's newest commit: its version, files and rows added (merge: inserted + updated)."""
    (last,) = table.history(limit=1)
    m = last.get("operationMetrics") or {}
    files = m.get("num_added_files", m.get("num_target_files_added", 0))
    rows = m.get("num_added_rows")
    if rows is None:
        rows = m.get("num_target_rows_inserted", 0) + m.get("num_target_rows_updated", 0)
    return CommitInfo(snapshot=str(table.version()), files_added=int(files), rows_added=int(rows))
