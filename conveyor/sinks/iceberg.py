"""Apache Iceberg sink (pyiceberg): each commit one Arrow append (or upsert) to a table in a
SQL or REST catalog, carrying the connector's offsets in the snapshot summary.

Exactly once through the table's commits, buffering and fencing: ``sinks.lakehouse``. The
table is created from the first batch's Arrow schema when missing (``create_table``), with
the spec's partition transforms; ``auto_evolve`` adds new payload fields with
``update_schema().union_by_name``. The warehouse lies under ``$CONVEYOR_HOME`` unless it is
an object storage URL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from conveyor.core.errors import (
    ConfigError,
    ConveyorError,
    PermanentSinkError,
    SinkError,
    TransientSinkError,
    rule,
)
from conveyor.core.trust import paths
from conveyor.core.trust.references import known_now
from conveyor.sinks.base import mapped_errors, secret
from conveyor.sinks.lakehouse import (
    CommitInfo,
    CommitMark,
    LakehouseSink,
    LakehouseSinkConfig,
    conform,
    data_columns,
    last_per_key,
    local_location,
    location_problem,
    nullable_schema,
)

log = logging.getLogger("conveyor.sinks.iceberg")

DEFAULT_CATALOG = "iceberg/catalog.db"  # under $CONVEYOR_HOME
# Table properties that move a table's files away from its location.
LOCATION_PROPERTIES = ("write.data.path", "write.metadata.path")

TRANSFORM_PATTERN = (
    r"^(identity|year|month|day|hour|void|bucket\[[1-9][0-9]*\]|truncate\[[1-9][0-9]*\])$"
)


class IcebergCatalogSpec(BaseModel):
    """Where the table's metadata pointer lives."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["sql", "rest"] = Field(
        default="sql",
        description="sql: pyiceberg's SQL catalog (PostgreSQL, SQLite, ...); rest: an Iceberg REST catalog.",
    )
    uri: SecretStr | None = Field(
        default=None,
        description="sql: a SQLAlchemy URL, e.g. postgresql+psycopg2://app:${file:/run/secrets/pg}@db/lake, "
        "or sqlite:///<path> with the file under a root (relative: from $CONVEYOR_HOME; section Files a "
        "spec names) (default: SQLite $CONVEYOR_HOME/iceberg/catalog.db); rest: the catalog's URL "
        "(required). Secret.",
    )
    name: str = Field(
        default="conveyor",
        description="The catalog's name. A SQL catalog keeps the tables of each name apart (its rows "
        "are keyed by it): a reader sees them under the same name (pyiceberg's load_catalog(name, "
        "uri=..., warehouse=...), Spark's spark.sql.catalog.<name>).",
    )
    token: SecretStr | None = Field(
        default=None, description="rest: a bearer token for the catalog (secret)."
    )


class PartitionFieldSpec(BaseModel):
    """One partition field of a table Conveyor creates."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    column: str = Field(description="The source column (a payload column, or a message column).")
    transform: str = Field(
        default="identity",
        pattern=TRANSFORM_PATTERN,
        description="identity, year, month, day, hour (of a date or timestamp), bucket[N] or truncate[W].",
    )

    def field_name(self) -> str:
        """The partition field's name: the column for identity, else column_transform."""
        if self.transform == "identity":
            return self.column
        return f"{self.column}_{re.sub(r'[^A-Za-z0-9]+', '_', self.transform).strip('_')}"


class IcebergSinkConfig(LakehouseSinkConfig):
    """Rows appended (or upserted) to an Apache Iceberg table."""

    type: Literal["iceberg"] = "iceberg"
    catalog: IcebergCatalogSpec = Field(
        default_factory=IcebergCatalogSpec, description="The catalog holding the table."
    )
    warehouse: str = Field(
        default="iceberg/warehouse",
        description="Where new tables' files go: a path or file:// URL under a root ($CONVEYOR_HOME, "
        "relative: from there; section Files a spec names); an object storage URL (s3://, gs://, "
        "abfss://) is passed as written.",
    )
    namespace: str = Field(
        description="The table's namespace (dotted for nested ones; each part becomes a directory "
        "name: no '/', '\\', '.' or '..')."
    )
    table: str = Field(
        description="The table's name (a directory name: no '/', '\\', '.' or '..')."
    )
    create_table: bool = Field(
        default=True,
        description="Create the namespace and the table from the first batch's Arrow schema when missing.",
    )
    partition_by: list[PartitionFieldSpec] = Field(
        default_factory=list,
        description="Partition fields of a table Conveyor creates (an existing table keeps its spec).",
    )

    def asset_key_path(self) -> list[str]:
        from conveyor.core.asset_keys import key_part

        parts = [key_part(p, "_") for p in self.namespace.split(".")]
        return ["iceberg", *parts, key_part(self.table, "_")]

    @model_validator(mode="after")
    def _rules(self) -> IcebergSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        for part in self.namespace.split("."):
            problem = paths.component_problem(part)
            rule(problem is None, problem or "", field="namespace")
        problem = paths.component_problem(self.table)
        rule(problem is None, problem or "", field="table")
        problem = location_problem(self.warehouse)
        rule(problem is None, problem or "", field="warehouse")
        uri = secret(self.catalog.uri)
        if self.catalog.type == "sql" and uri is not None and known_now(uri):
            problem = sqlite_problem(uri)
            rule(problem is None, problem or "", field="catalog.uri")
        rule(
            self.catalog.type == "sql" or self.catalog.uri is not None,
            "a REST catalog needs its uri",
            field="catalog.uri",
        )
        names = [p.field_name() for p in self.partition_by]
        rule(
            len(set(names)) == len(names), "a partition field is named twice", field="partition_by"
        )
        self.lakehouse_rules()
        return self


def catalog_properties(config: IcebergSinkConfig) -> dict[str, str]:
    """pyiceberg's ``load_catalog`` properties for the config (secrets resolved already), its
    places resolved now (``core.trust.paths``): ConfigError naming the field when one is refused."""
    warehouse = local_location(config.warehouse, field="sink.warehouse")
    if os.path.isabs(warehouse):
        os.makedirs(warehouse, exist_ok=True)
        warehouse = "file://" + warehouse
    props = {"type": config.catalog.type, "warehouse": warehouse}
    uri = secret(config.catalog.uri)
    if uri is None:
        path = paths.resolve(DEFAULT_CATALOG, field="sink.catalog.uri")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        uri = f"sqlite:///{path}"
    elif config.catalog.type == "sql":
        uri = sqlite_resolved(uri)
    props["uri"] = uri
    token = secret(config.catalog.token)
    if token is not None:
        props["token"] = token
    return props


def _sqlite_url(uri: str) -> Any:
    """The parsed URL when ``uri`` names a SQLite database; None for another database, a text
    saying why when it is refused. Never quotes ``uri`` (a secret field)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(uri)
    except ArgumentError:
        return "is not a SQLAlchemy URL" if uri.strip().lower().startswith("sqlite") else None
    if url.get_backend_name() != "sqlite":
        return None
    db = url.database or ""
    if str(url.query.get("uri", "")).lower() in ("true", "1") or db.startswith("file:"):
        return "a SQLite URI filename (file:..., ?uri=true) is not allowed: write the file's path"
    return url


def sqlite_problem(uri: str) -> str | None:
    """Why a SQL catalog URL is refused, or None: a SQLite file lies under a root
    (``core.trust.paths``; a relative one from ``$CONVEYOR_HOME``); other databases pass."""
    url = _sqlite_url(uri)
    if url is None or isinstance(url, str):
        return url
    if url.database in (None, "", ":memory:"):
        return None
    return paths.problem(url.database)


def sqlite_resolved(uri: str) -> str:
    """The SQL catalog URL to connect with: a SQLite file's real path (``core.trust.paths``, resolved
    now), other databases as written; ConfigError naming ``sink.catalog.uri`` when refused."""
    url = _sqlite_url(uri)
    if isinstance(url, str):
        raise ConfigError(url, field="sink.catalog.uri")
    if url is None or url.database in (None, "", ":memory:"):
        return uri
    real = paths.resolve(url.database, field="sink.catalog.uri")
    return str(url.set(database=real).render_as_string(hide_password=False))


def confined_table(tbl: Any, ident: tuple[str, ...]) -> Any:
    """``tbl``, once its location and file paths are a root's (``core.trust.paths``): a catalog (a
    REST one, a shared database) may hold a table whose files are anywhere. ConfigError
    naming ``sink.table`` otherwise, before anything is written there."""
    places = [("location", tbl.location()), ("metadata location", tbl.metadata_location)]
    places += [(p, tbl.properties.get(p)) for p in LOCATION_PROPERTIES]
    for what, where in places:
        problem = paths.location_problem(where) if where else None
        if problem:
            raise ConfigError(
                f"Iceberg table {'.'.join(ident)}: its {what} {problem}", field="sink.table"
            )
    return tbl


def classify_iceberg(e: BaseException) -> SinkError | None:
    """A pyiceberg, SQLAlchemy or transport exception as a sink error (None: not theirs)."""
    if isinstance(e, ConveyorError):
        return None
    from pyiceberg import exceptions as ie

    name = type(e).__name__
    msg = str(e).strip().splitlines()[0] if str(e).strip() else name
    transient = (
        ie.CommitFailedException,
        ie.CommitStateUnknownException,
        ie.ServiceUnavailableError,
        ie.ServerError,
        ie.TooManyRequestsError,
        ie.WaitingForLockException,
        OSError,
        TimeoutError,
    )
    if isinstance(e, transient) or name in (
        "OperationalError",
        "InterfaceError",
        "DisconnectionError",
    ):
        return TransientSinkError(f"Iceberg catalog or warehouse unavailable: {name}: {msg}")
    permanent = (
        ie.NoSuchTableError,
        ie.NoSuchNamespaceError,
        ie.UnauthorizedError,
        ie.ForbiddenError,
        ie.BadRequestError,
        ie.ValidationError,
        ValueError,
        TypeError,
        pa.ArrowException,
    )
    if isinstance(e, permanent) or name in ("ProgrammingError", "ArgumentError"):
        return PermanentSinkError(f"Iceberg refused the write: {name}: {msg}")
    return None


class IcebergSink(LakehouseSink):
    """Appends each commit's rows as one Arrow table; the mark rides in the snapshot summary."""

    config_class = IcebergSinkConfig
    config: IcebergSinkConfig

    def __init__(self, config: IcebergSinkConfig, **kwargs: Any):
        super().__init__(config, **kwargs)
        self._catalog: Any = None
        self._table: Any = None

    def _identifier(self) -> tuple[str, ...]:
        return (*self.config.namespace.split("."), self.config.table)

    def init_sink(self) -> None:
        """Load the catalog and the table (once: ``target_offsets`` may have done it)."""
        with self._mapped():
            from pyiceberg.catalog import load_catalog

            if self._catalog is None:
                props = catalog_properties(self.config)
                self._catalog = load_catalog(self.config.catalog.name, **props)
            self._table = self._load()
        if self._table is None and not self.config.create_table:
            raise PermanentSinkError(
                f"Iceberg table {'.'.join(self._identifier())} does not exist (create_table: false)"
            )

    def _load(self) -> Any:
        """The table, its metadata read now; None when it does not exist."""
        from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

        if self._table is not None:
            return self._confined(self._table.refresh())
        try:
            return self._confined(self._catalog.load_table(self._identifier()))
        except (NoSuchTableError, NoSuchNamespaceError):
            return None

    def _confined(self, tbl: Any) -> Any:
        return confined_table(tbl, self._identifier())

    def _namespace_confined(self, namespace: tuple[str, ...]) -> None:
        """A namespace's ``location`` (where the catalog puts its new tables) is a root's."""
        where = self._catalog.load_namespace_properties(namespace).get("location")
        problem = paths.location_problem(where) if where else None
        if problem:
            raise ConfigError(
                f"Iceberg namespace {'.'.join(namespace)}: its location {problem}",
                field="sink.namespace",
            )

    def _latest_mark(self) -> CommitMark | None:
        if self._catalog is None:
            self.init_sink()  # target_offsets before init_sink (the run reads them first)
        with self._mapped():
            self._table = self._load()
        if self._table is None:
            return None
        snapshots = {s.snapshot_id: s for s in self._table.metadata.snapshots}
        snap = self._table.current_snapshot()
        while snap is not None:
            mark = CommitMark.of(snap.summary.additional_properties)
            if mark is not None and self.is_mine(mark):
                return mark
            parent = snap.parent_snapshot_id
            snap = snapshots.get(parent) if parent is not None else None
        return None

    def _write(self, table: pa.Table, mark: CommitMark) -> None:
        data = data_columns(table, self.config.message_columns)
        tbl = self._table if self._table is not None else self._create(data.schema)
        tbl = self._evolved(tbl, data.schema)
        data = conform(data, tbl.schema().as_arrow(), auto_evolve=self.config.auto_evolve)
        props = mark.properties()
        keys = self.config.upsert_keys
        if keys:
            tbl.upsert(last_per_key(data, keys), join_cols=keys, snapshot_properties=props)
        else:
            tbl.append(data, snapshot_properties=props)
        self._table = tbl
        snap = tbl.current_snapshot()
        summary = snap.summary.additional_properties if snap is not None else {}
        self.last_commit = CommitInfo(
            snapshot=str(snap.snapshot_id) if snap is not None else "",
            files_added=int(summary.get("added-data-files", 0)),
            rows_added=int(summary.get("added-records", 0)),
        )

    def _create(self, schema: pa.Schema) -> Any:
        """The table, created from the batch's schema with the spec's partition fields."""
        from pyiceberg.exceptions import TableAlreadyExistsError
        from pyiceberg.transforms import parse_transform

        for p in self.config.partition_by:
            if p.column not in schema.names:
                raise PermanentSinkError(
                    f"partition_by: column {p.column!r} is not in the batch "
                    f"(columns: {', '.join(schema.names)})"
                )
        ident = self._identifier()
        for i, part in enumerate(ident):  # each a directory name of the table's default place
            problem = paths.component_problem(part)
            if problem:
                field = "sink.table" if i == len(ident) - 1 else "sink.namespace"
                raise ConfigError(problem, field=field)
        self._catalog.create_namespace_if_not_exists(ident[:-1])
        self._namespace_confined(ident[:-1])
        props = {"write.target-file-size-bytes": str(self.config.target_file_size_mb << 20)}
        try:
            with self._catalog.create_table_transaction(
                ident, schema=nullable_schema(schema), properties=props
            ) as tx:
                if self.config.partition_by:
                    with tx.update_spec() as spec:
                        for p in self.config.partition_by:
                            spec.add_field(p.column, parse_transform(p.transform), p.field_name())
        except TableAlreadyExistsError:
            pass  # another writer created it first: use theirs
        log.info("created Iceberg table %s", ".".join(ident))
        return self._confined(self._catalog.load_table(ident))

    def _evolved(self, tbl: Any, schema: pa.Schema) -> Any:
        """The table with the batch's new columns added (``auto_evolve``), else as it is."""
        known = set(tbl.schema().as_arrow().names)
        if not self.config.auto_evolve or set(schema.names) <= known:
            return tbl
        with tbl.update_schema() as update:
            update.union_by_name(nullable_schema(schema))
        log.info(
            "Iceberg table %s: added column(s) %s",
            ".".join(self._identifier()),
            ", ".join(n for n in schema.names if n not in known),
        )
        return tbl

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[None]:
        with mapped_errors(classify_iceberg):
            yield

    def _close(self) -> None:
        catalog, self._catalog, self._table = self._catalog, None, None
        engine = getattr(catalog, "engine", None)
        if engine is not None:
            engine.dispose()
