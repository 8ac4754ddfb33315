"""What the SQL sinks (PostgreSQL, MySQL) share: where each column comes from, and the column
types a table created from an Arrow batch gets, through each database's type map (its dialect).

Both configs subclass ``SqlSinkConfig`` (the fields they share, their rules and their asset
key); ``url``/``url_env`` come from ``sinks.base.UrlSinkConfig``. Bad rows are isolated with
savepoints through the one bisection, ``core.sink.isolate_rows``.

``delivery: exactly_once`` is here too: ``OffsetsLedger``, the offsets table both sinks keep
in the target and raise in each batch's transaction (docs/sinks/postgres.md). The sink itself,
written once over its dialects, is ``sinks.sql_sink.SqlSink``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import pyarrow as pa
from pydantic import Field

from conveyor.core.asset_keys import key_part
from conveyor.core.engine.loop import next_offsets_of
from conveyor.core.errors import ConfigError, FencedError, FieldRuleError, PermanentSinkError, rule
from conveyor.core.model import (
    HEADERS_COL,
    KEY_COL,
    OFFSET_COL,
    PARTITION_COL,
    TIMESTAMP_COL,
    TOPIC_COL,
    Offsets,
    TopicPartition,
)
from conveyor.core.positions import StoredPosition, StoredPositions, TargetBinding
from conveyor.core.sink import RowFailure, is_writer_of
from conveyor.sinks.base import UrlSinkConfig, payload_columns

#: ``columns`` sources besides payload columns: message metadata, and the payload as JSON.
META_SOURCES = {
    "$key": KEY_COL,
    "$topic": TOPIC_COL,
    "$partition": PARTITION_COL,
    "$offset": OFFSET_COL,
    "$timestamp": TIMESTAMP_COL,
    "$headers": HEADERS_COL,
}
SOURCES = sorted([*META_SOURCES, "$payload"])


@dataclass(frozen=True)
class SqlDialect:
    """A database's column types for Arrow types."""

    name: str
    type_of: Callable[[pa.DataType, bool], str]  # (Arrow type, is an upsert key) -> column type
    json_type: str
    json_sources: frozenset[str]  # sources always stored as JSON


def any_column(_name: str) -> str | None:
    """Every name may be a column (``column_problem``'s default)."""
    return None


def mapping_rules(
    columns: dict[str, str] | None,
    upsert_keys: list[str],
    delete_enabled: bool,
    *,
    column_problem: Callable[[str], str | None] = any_column,
) -> None:
    """The rules of a SQL sink's ``columns``, ``upsert_keys`` and ``delete_enabled`` (run by its
    config model's validator; ``column_problem`` says why a name cannot be a column, if ever)."""
    if columns is not None:
        rule(bool(columns), "must map at least one column", field="columns")
        for target, src in columns.items():
            problem = column_problem(target)
            if problem:
                raise FieldRuleError(f"column {target!r}: {problem}", field="columns")
            if src.startswith("$") and src not in SOURCES:
                raise FieldRuleError(
                    f"{target}: unknown source {src!r}; one of {SOURCES}", field="columns"
                )
        for k in upsert_keys:
            rule(k in columns, f"upsert key {k!r} is not a mapped column", field="upsert_keys")
    rule(
        not delete_enabled or bool(upsert_keys),
        "a delete needs the key columns: set upsert_keys",
        field="delete_enabled",
    )


# -- the config both SQL sinks build on ----------------------------------------------------------

#: The fields both SQL sinks have with the same type, default and description. Each config
#: declares them at its own place (``columns: SqlColumns = None``): a model's field order is
#: the order of its docs/CONFIG.md table, of its validation errors and of a dumped config,
#: and fields declared on the base class would come before every field of the subclass.
SqlColumns = Annotated[
    dict[str, str] | None,
    Field(
        description="Target column -> source: a payload column, or $key, $topic, $partition, $offset, $timestamp, $headers, "
        "$payload (the whole payload as JSON). Default: payload columns to same-named columns.",
    ),
]
DeleteEnabled = Annotated[
    bool,
    Field(
        description="A tombstone (transform.null_values: pass) deletes the row with its upsert_keys instead of "
        "being written (Kafka Connect's delete.enabled). The keys come from the row, else from the message key "
        "(see docs/sinks). Needs upsert_keys.",
    ),
]
ConnectTimeoutS = Annotated[int, Field(ge=1, le=300, description="Connect timeout.")]
AutoEvolve = Annotated[
    bool,
    Field(
        description="Evolve the table with the batches (Kafka Connect JDBC's auto.evolve): a mapped column the table "
        "lacks (with columns unset, any new payload field) is added in the running sink as a nullable column of the "
        "type create_table would give it. A batch column the table's column cannot hold (narrowing, e.g. decimal into "
        "integer) and a NOT NULL column without a default that the batch lacks are refused, naming the column; no "
        "column is ever dropped or retyped. Off: the columns are resolved on the first batch and a column the table "
        "lacks is refused.",
    ),
]

DeliveryMode = Literal["auto", "at_least_once", "exactly_once"]
Delivery = Annotated[
    DeliveryMode,
    Field(
        default="auto",
        description="at_least_once: the offsets go to the meta store after the target commits (a crash "
        "between the two writes the batch again; upsert_keys make that harmless). exactly_once: each batch's "
        "rows and its end offsets are committed in one transaction of the target, into offsets_table "
        "(created if missing, so the user needs CREATE on the schema); rows the table's offsets already "
        "cover are dropped, and a run of an older generation is refused (docs/sinks/postgres.md); a user "
        "who may not create or write the offsets table stops the run with an error naming the fixes. auto "
        "(the default): exactly_once where the target allows it (the user may create and write the offsets "
        "table; for MySQL a transactional table), else at_least_once, said in the run's log and in the "
        "sink asset's delivery metadata.",
    ),
]
OffsetsTableName = Annotated[
    str,
    Field(
        min_length=1,
        description="With delivery exactly_once: the table holding each writer's next offset per "
        "topic-partition, next to the target table (same schema or database).",
    ),
]


class SqlSinkConfig(UrlSinkConfig):
    """Base of the SQL sinks' configs (PostgreSQL, MySQL): the rules of the fields they share,
    and their asset key ``[kind, namespace, table]``.

    A subclass declares ``table``, ``columns``, ``upsert_keys``, ``create_table``,
    ``auto_evolve``, ``delete_enabled``, ``connect_timeout_s``, ``delivery`` and ``offsets_table``
    (the shared ones through the aliases above; ``delivery`` after ``create_table``, its default
    depends on it), and says where its table lives (``key_namespace``)."""

    if TYPE_CHECKING:  # declared by each subclass, in its own field order
        table: str
        columns: dict[str, str] | None
        upsert_keys: list[str]
        create_table: bool
        auto_evolve: bool
        delete_enabled: bool
        connect_timeout_s: int
        delivery: DeliveryMode
        offsets_table: str

    @abc.abstractmethod
    def key_namespace(self) -> str:
        """What holds the table, in the asset key (PostgreSQL's schema, MySQL's database)."""

    def asset_key_path(self) -> list[str]:
        return [self.kind(), key_part(self.key_namespace()), key_part(self.table)]

    def check_mapping(self, *, column_problem: Callable[[str], str | None] = any_column) -> None:
        """The rules of ``columns``, ``upsert_keys`` and ``delete_enabled`` (``mapping_rules``),
        for the subclass's validator; ``column_problem`` says why a name cannot be a column."""
        mapping_rules(
            self.columns, self.upsert_keys, self.delete_enabled, column_problem=column_problem
        )


def column_mapping(columns: dict[str, str] | None, batch: pa.Table) -> dict[str, str]:
    """Target column -> source: the configured ``columns``, or every payload column as itself.

    ConfigError when a source is not in the transformed batch.
    """
    mapping = dict(columns) if columns is not None else {c: c for c in payload_columns(batch)}
    names = batch.schema.names
    for target, src in mapping.items():
        if not src.startswith("$") and src not in names:
            raise ConfigError(
                f"{target}: source column {src!r} is not in the transformed batch (columns: {payload_columns(batch)})",
                field="sink.columns",
            )
        if src in META_SOURCES and META_SOURCES[src] not in names:
            raise ConfigError(
                f"{target}: the batch has no {META_SOURCES[src]} column for {src}",
                field="sink.columns",
            )
    return mapping


def column_types(
    mapping: dict[str, str], batch: pa.Table, dialect: SqlDialect, keys: Collection[str] = ()
) -> dict[str, str]:
    """Target column -> the dialect's type, for creating the table from the first batch."""
    types = {}
    for target, src in mapping.items():
        if src in dialect.json_sources:
            types[target] = dialect.json_type
        else:
            types[target] = dialect.type_of(source_type(src, batch), target in keys)
    return types


def source_type(src: str, batch: pa.Table) -> pa.DataType:
    """The Arrow type of a mapped source (a payload column or a message column) in ``batch``."""
    return batch.schema.field(META_SOURCES.get(src, src)).type


def json_values(column: pa.ChunkedArray | pa.Array) -> list[Any]:
    """A nested column's values as JSON-ready Python values: maps as objects (the last of a
    repeated key wins), at any depth (``to_pylist`` gives a map as a list of pairs)."""
    import warnings

    with warnings.catch_warnings():  # "lossy" warns about a repeated key; the last one wins
        warnings.simplefilter("ignore")
        return column.to_pylist(maps_as_pydicts="lossy")


def check_columns(table: str, mapping: dict[str, str], existing: Collection[str]) -> None:
    """PermanentSinkError when the table lacks a mapped column."""
    missing = [t for t in mapping if t not in existing]
    if missing:
        raise PermanentSinkError(
            f"table {table} has no column(s) {', '.join(missing)} (it has {', '.join(existing)})"
        )


# -- tables that evolve (auto_evolve) ------------------------------------------------------------


@dataclass(frozen=True)
class TableColumn:
    """A column of the target table, as the database's information_schema describes it."""

    name: str
    data_type: str  # information_schema's data type, lower case (``integer``, ``bigint``...)
    nullable: bool
    has_default: bool  # a default, identity, auto-increment or generated value
    precision: int | None = None  # a decimal column's precision (None: unconstrained)
    scale: int | None = None  # a decimal column's scale
    fraction_digits: int | None = None  # a timestamp or time column's fractional digits
    unsigned: bool = False  # MySQL's UNSIGNED integers


_INT_BITS = {"tinyint": 8, "smallint": 16, "mediumint": 24, "int": 32, "integer": 32, "bigint": 64}
_FLOAT_BITS = {"real": 32, "float": 32, "double precision": 64, "double": 64}
_DECIMALS = frozenset({"numeric", "decimal"})
_TEXTS = frozenset(
    {"text", "character varying", "character", "varchar", "char", "tinytext", "mediumtext"}
    | {"longtext", "enum", "set", "uuid"}
)
_BINARIES = frozenset(
    {"bytea", "binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"}
)
_JSONS = frozenset({"json", "jsonb"})
_TIMESTAMPS = frozenset(
    {"timestamp with time zone", "timestamp without time zone", "datetime", "timestamp"}
)
_TIMES = frozenset({"time with time zone", "time without time zone", "time"})
#: Decimal digits an integer of so many bits (signed, unsigned) needs.
_INT_DIGITS = {(8, True): 3, (16, True): 5, (32, True): 10, (64, True): 19}
_INT_DIGITS |= {(8, False): 3, (16, False): 5, (32, False): 10, (64, False): 20}
_FRACTION_DIGITS = {"s": 0, "ms": 3, "us": 6, "ns": 6}  # ns: written as microseconds


def _holds_integer(t: pa.DataType, col: TableColumn) -> bool:
    """Whether ``col`` holds every value of the integer type ``t``."""
    signed = pa.types.is_signed_integer(t)
    kind = col.data_type
    if kind in _INT_BITS:
        bits = _INT_BITS[kind]
        if col.unsigned:
            return not signed and bits >= t.bit_width
        return bits >= t.bit_width + (0 if signed else 1)
    if kind in _DECIMALS:
        digits = _INT_DIGITS[(t.bit_width, signed)]
        return col.precision is None or col.precision - (col.scale or 0) >= digits
    # A float's mantissa holds integers of 24 (real) or 53 (double) bits exactly.
    return kind in _FLOAT_BITS and t.bit_width <= (16 if _FLOAT_BITS[kind] == 32 else 32)


def _holds_decimal(t: pa.Decimal128Type, col: TableColumn) -> bool:
    if col.data_type not in _DECIMALS:
        return False
    if col.precision is None:
        return True
    scale = col.scale or 0
    return col.precision - scale >= t.precision - t.scale and scale >= t.scale


def _holds(t: pa.DataType, col: TableColumn) -> bool:
    """Whether ``col`` holds every value of Arrow type ``t`` (``type_problem`` knows ``col``)."""
    kind = col.data_type
    if pa.types.is_dictionary(t):
        return _holds(t.value_type, col)
    if pa.types.is_boolean(t):
        return kind == "boolean" or kind in _INT_BITS
    if pa.types.is_integer(t):
        return _holds_integer(t, col)
    if pa.types.is_floating(t):
        return kind in _FLOAT_BITS and _FLOAT_BITS[kind] >= t.bit_width
    if pa.types.is_decimal(t):
        return _holds_decimal(t, col)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return kind in _TEXTS
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return kind in _BINARIES
    if pa.types.is_timestamp(t) or pa.types.is_time(t):
        kinds = _TIMESTAMPS if pa.types.is_timestamp(t) else _TIMES
        digits = col.fraction_digits
        return kind in kinds and (digits is None or digits >= _FRACTION_DIGITS[t.unit])
    if pa.types.is_date(t):
        return kind == "date" or kind in _TIMESTAMPS
    if pa.types.is_nested(t):
        return kind in _JSONS or kind in _TEXTS
    return True  # a type this table does not judge (null): the server does


_KNOWN_KINDS = (
    (_TEXTS | _BINARIES | _JSONS | _TIMESTAMPS | _TIMES | _DECIMALS | {"boolean", "date"})
    | set(_INT_BITS)
    | set(_FLOAT_BITS)
)


def type_problem(t: pa.DataType, col: TableColumn) -> str | None:
    """Why column ``col`` cannot hold every value of Arrow type ``t`` (a narrowing), or None.

    A column type this does not know (PostgreSQL's arrays, enums, domains...) is left to the
    server, row by row."""
    if col.data_type not in _KNOWN_KINDS or _holds(t, col):
        return None
    size = (
        f"({col.precision},{col.scale or 0})"
        if col.data_type in _DECIMALS and col.precision is not None
        else ""
    )
    sign = " unsigned" if col.unsigned else ""
    return f"the table's {col.data_type}{size}{sign} column cannot hold the batch's {t}"


def evolution(
    table: str,
    mapping: dict[str, str],
    batch: pa.Table,
    dialect: SqlDialect,
    existing: dict[str, TableColumn],
    keys: Collection[str] = (),
) -> dict[str, str]:
    """The columns ``auto_evolve`` adds to ``table`` for ``batch`` (target -> type, from
    ``column_types``: the types create_table gives), after checking the columns it keeps.

    PermanentSinkError naming the column for a narrowing (``type_problem``), for a NOT NULL
    column without a default that the batch does not carry, and for a missing upsert key (an
    added column is nullable, never a key)."""
    for target, src in mapping.items():
        col = existing.get(target)
        if col is None or src in dialect.json_sources:
            continue
        problem = type_problem(source_type(src, batch), col)
        if problem:
            raise PermanentSinkError(
                f"table {table}, column {target}: {problem} (a narrowing: auto_evolve adds "
                "columns, it never changes a column's type)"
            )
    required = [
        c.name
        for c in existing.values()
        if not c.nullable and not c.has_default and c.name not in mapping
    ]
    if required:
        raise PermanentSinkError(
            f"table {table} has NOT NULL column(s) without a default that the batch does not carry: "
            f"{', '.join(required)} (a required column was removed from the data, or is not mapped)"
        )
    added = {
        t: typ
        for t, typ in column_types(mapping, batch, dialect, keys).items()
        if t not in existing
    }
    missing_keys = [k for k in keys if k in added]
    if missing_keys:
        raise PermanentSinkError(
            f"table {table} has no upsert key column(s) {', '.join(missing_keys)}: auto_evolve adds only "
            "nullable columns, never a key"
        )
    return added


# -- statement text built by Arrow (the PostgreSQL COPY text, the MySQL literals) -------------


def text_scalar(s: str) -> pa.Scalar:
    """A large-string scalar, to join with the large-string columns of statement text."""
    return pa.scalar(s, pa.large_string())


def concat_text(*parts: Any) -> Any:
    """Element-wise concatenation of Arrow large-string arrays and scalars."""
    import pyarrow.compute as pc

    return pc.binary_join_element_wise(*parts, text_scalar(""))


def text_offsets(text: pa.LargeStringArray) -> tuple[Any, memoryview]:
    """The byte offsets of ``text``'s values (``len(text) + 1`` of them, as numpy int64)
    and its data buffer: the bytes of values ``[a, b)`` are ``data[off[a]:off[b]]``."""
    import numpy as np

    _, offsets, data = text.buffers()
    off = np.frombuffer(offsets, np.int64)[text.offset : text.offset + len(text) + 1]
    return off, memoryview(data) if data is not None else memoryview(b"")


# -- exactly once: the offsets table in the target (delivery: exactly_once) ----------------------

#: The claim row: one per writer, holding the newest generation that started (its fence).
CLAIM_TOPIC = ""
CLAIM_PARTITION = -1
#: How many failed rows a sink remembers, so that the loop's re-sends of them are written.
FAILED_MEMORY = 100_000


@dataclass(frozen=True)
class OffsetsStatements:
    """The statements of one database on its offsets table (``%s`` parameters). Rows are
    ``(writer, topic, partition, next_offset, generation, log_id, destination)``; the writer is
    a writer id (``<writer>@<incarnation>``, ``core/positions.py``). Those marked "no
    parameters" must be executed without any (not even ``()``): their ``%`` is not doubled."""

    table: str  # the quoted, qualified name
    create: str  # no parameters
    columns: str  # no parameters: no row, the table's columns in the cursor's description
    add_identity: tuple[str, ...]  # no parameters: the columns issue 44 added
    claim: str  # (writer, generation): the claim row, its generation raised to this one
    ensure: str  # (writer, generation): the claim row, if missing
    lock: str  # (writer,): the writer's rows, locked until the transaction ends
    read: str  # (writer,): the writer's rows
    advance: str  # (writer, topic, partition, next_offset, generation, log_id, destination)
    writers: str  # no parameters: every writer the table holds
    put: str  # (writer, topic, partition, next_offset, generation, log_id, destination): set
    drop: str  # (writer, topic, partition): one partition's row
    clear: str  # (writer,): every partition row (the claim row stays)
    retire: str  # (writer,): every row of the writer, its claim row too


def percent_escaped(text: str) -> str:
    """SQL text (quoted identifiers) for a statement the driver %-formats: psycopg2 and pymysql
    read ``%`` as the start of a placeholder in any statement executed with parameters (an
    empty tuple included), so a literal ``%`` is written ``%%`` there, and only there."""
    return text.replace("%", "%%")


def offsets_statements(table: str, flavor: Literal["postgres", "mysql"]) -> OffsetsStatements:
    """The offsets table's statements for PostgreSQL or MySQL/MariaDB; ``table`` is quoted
    (not %-escaped: each statement executed with parameters gets it ``percent_escaped``).

    Rows are read with ``SELECT *`` and taken by column name (``ledger_rows``), so a table of
    the release before positions named their log and destination reads as rows naming none."""
    plain, table = table, percent_escaped(table)  # ``table`` below: in statements with parameters
    q = '"partition"' if flavor == "postgres" else "`partition`"
    cols = f"(writer, topic, {q}, next_offset, generation, log_id, destination)"
    insert = f"INSERT INTO {table} {cols} VALUES (%s, %s, %s, %s, %s, %s, %s)"
    claim_values = (
        f"INSERT INTO {table} {cols} "
        f"VALUES (%s, '{CLAIM_TOPIC}', {CLAIM_PARTITION}, 0, %s, NULL, NULL)"
    )
    select = f"SELECT * FROM {table} WHERE writer = %s"
    if flavor == "postgres":
        text = "text NOT NULL"
        ident = "text"
        on_key = f" ON CONFLICT (writer, topic, {q}) DO "
        claim = (
            on_key + f"UPDATE SET generation = GREATEST({table}.generation, EXCLUDED.generation)"
        )
        ensure = on_key + "NOTHING"
        advance = on_key + (
            f"UPDATE SET next_offset = GREATEST({table}.next_offset, EXCLUDED.next_offset), "
            "generation = EXCLUDED.generation, "
            f"log_id = COALESCE(EXCLUDED.log_id, {table}.log_id), "
            f"destination = COALESCE(EXCLUDED.destination, {table}.destination)"
        )
        put = on_key + (
            "UPDATE SET next_offset = EXCLUDED.next_offset, generation = EXCLUDED.generation, "
            "log_id = EXCLUDED.log_id, destination = EXCLUDED.destination"
        )
        engine = ""
    else:
        text = "VARCHAR(255) NOT NULL"
        ident = "VARCHAR(255)"
        claim = " ON DUPLICATE KEY UPDATE generation = GREATEST(generation, VALUES(generation))"
        ensure = " ON DUPLICATE KEY UPDATE writer = writer"
        advance = (
            " ON DUPLICATE KEY UPDATE next_offset = GREATEST(next_offset, VALUES(next_offset)), "
            "generation = VALUES(generation), log_id = COALESCE(VALUES(log_id), log_id), "
            "destination = COALESCE(VALUES(destination), destination)"
        )
        put = (
            " ON DUPLICATE KEY UPDATE next_offset = VALUES(next_offset), "
            "generation = VALUES(generation), log_id = VALUES(log_id), "
            "destination = VALUES(destination)"
        )
        engine = " ENGINE=InnoDB"
    return OffsetsStatements(
        table=plain,
        create=f"CREATE TABLE IF NOT EXISTS {plain} (writer {text}, topic {text}, {q} integer NOT NULL, "
        f"next_offset bigint NOT NULL, generation bigint NOT NULL, log_id {ident}, "
        f"destination {ident}, PRIMARY KEY (writer, topic, {q})){engine}",
        columns=f"SELECT * FROM {plain} WHERE 1 = 0",
        add_identity=(
            f"ALTER TABLE {plain} ADD COLUMN log_id {ident}",
            f"ALTER TABLE {plain} ADD COLUMN destination {ident}",
        ),
        claim=claim_values + claim,
        ensure=claim_values + ensure,
        lock=select + " FOR UPDATE",
        read=select,
        advance=insert + advance,
        writers=f"SELECT DISTINCT writer FROM {plain}",
        put=insert + put,
        drop=f"DELETE FROM {table} WHERE writer = %s AND topic = %s AND {q} = %s",
        clear=f"DELETE FROM {table} WHERE writer = %s AND {q} <> {CLAIM_PARTITION}",
        retire=f"DELETE FROM {table} WHERE writer = %s",
    )


class LedgerDeniedError(PermanentSinkError):
    """The target user may not create (or write) the offsets table."""


def ledger_denied(table: str, detail: str) -> LedgerDeniedError:
    """The error when the target user may not create (or write) the offsets table: both fixes."""
    return LedgerDeniedError(
        f"delivery exactly_once keeps the offsets in the table {table}, which this user may not "
        f"create or write: {detail}. Grant the user CREATE (and INSERT, UPDATE, SELECT) where the "
        "target table is, or set delivery: at_least_once (delivery: auto, the default, does that "
        "by itself)"
    )


def written_rows(n: int, failures: Sequence[RowFailure], fail_fast: bool) -> list[int]:
    """The rows of an ``n``-row write that its transaction holds: every row not failed, and under
    ``fail_fast`` only those before the first failure (nothing after it was written)."""
    bad = {f.index for f in failures}
    end = min(bad) if fail_fast and bad else n
    return [i for i in range(end) if i not in bad]


class OffsetsLedger:
    """A SQL sink's offsets table in ``exactly_once`` mode, for the writer the run bound it to.

    One row per (writer id, topic, partition): the next offset after the rows the writer
    committed, the generation that committed it, and the log and destination that offset is a
    position in (``core/positions.py``); a claim row per writer id (topic ``''``, partition -1)
    holds the newest generation that started. Every batch's transaction first locks the
    writer's rows (the claim row serialises two runs of one writer), refuses to go on when a
    newer generation is there (``FencedError``), drops the rows the usable offsets cover (a
    position of another log or destination covers nothing, and is replaced), writes the
    others and raises the offsets to the rows it wrote, then the sink commits: rows and
    offsets, or neither.

    A row that failed (dead-lettered, discarded) before the last row written in its partition is
    covered by the offsets; this sink remembers the rows that failed in this run so the loop's
    re-sends of them are written, not dropped.
    """

    def __init__(self, statements: OffsetsStatements):
        self.sql = statements
        self.binding: TargetBinding | None = None  # unbound: at least once (a dead-letter replay)
        self._failed: dict[tuple[str, int, int], None] = {}

    def bind(self, binding: TargetBinding) -> None:
        self.binding = binding

    @property
    def bound(self) -> bool:
        return self.binding is not None

    @property
    def writer(self) -> str:
        assert self.binding is not None
        return self.binding.writer

    @property
    def generation(self) -> int:
        return self.binding.generation if self.binding is not None else 0

    def create(self, cur: Any) -> None:
        """The offsets table, if missing; a table of the release before positions named their
        log and destination gets those columns."""
        cur.execute(self.sql.create)
        cur.execute(self.sql.columns)
        have = {str(d[0]).lower() for d in cur.description or ()}
        for name, ddl in zip(("log_id", "destination"), self.sql.add_identity, strict=True):
            if name not in have:
                cur.execute(ddl)

    def claim(self, cur: Any) -> None:
        """Raise the writer's claim to this generation (a zombie's next batch is refused);
        ``FencedError`` when a newer generation has started. A migrated connector's positions
        kept under its bare name are taken over here, in the same transaction."""
        cur.execute(self.sql.claim, (self.writer, self.generation))
        cur.execute(self.sql.lock, (self.writer,))
        mine = self._fence(ledger_rows(cur))
        legacy = self.binding.legacy_writer if self.binding else None
        if legacy and not mine:
            cur.execute(self.sql.lock, (legacy,))
            taken = _positions_of(ledger_rows(cur))
            if taken:
                cur.executemany(
                    self.sql.put,
                    [
                        (self.writer, tp.topic, tp.partition, p.offset, self.generation, None, None)
                        for tp, p in sorted(taken.items())
                    ],
                )
            cur.execute(self.sql.retire, (legacy,))

    def move(
        self,
        cur: Any,
        connector: str,
        generations: Mapping[str, int],
        offsets: Offsets,
        *,
        forget: Collection[TopicPartition] = (),
        replace: bool = False,
    ) -> None:
        """An operator's offsets change for every writer of ``connector`` (a writer id), in the
        caller's open transaction (``OffsetsInTarget.move_target_offsets``): each writer's claim
        raised to its generation and its rows locked (``FencedError`` when a newer one is
        there), then the partitions dropped and set (naming no log: range-checked on start).
        The caller commits."""
        cur.execute(self.sql.writers)
        held = {str(w) for (w,) in cur.fetchall() if is_writer_of(connector, str(w))}
        top = max(generations.values())
        rows: dict[str, Offsets] = {}
        for writer in sorted(held | set(generations) | {connector}):
            generation = generations.get(writer, top)
            cur.execute(self.sql.claim, (writer, generation))
            cur.execute(self.sql.lock, (writer,))
            found = ledger_rows(cur)
            newest = max((int(r["generation"]) for r in found), default=0)
            if newest > generation:
                raise FencedError(
                    f"writer {writer!r}: the offsets table {self.sql.table} holds generation "
                    f"{newest}, newer than {generation}: a run started meanwhile; nothing moved"
                )
            rows[writer] = {tp: p.offset for tp, p in _positions_of(found).items()}
        for writer, known in rows.items():
            if replace:
                cur.execute(self.sql.clear, (writer,))
            for tp in forget if not replace else ():
                if tp in known:
                    cur.execute(self.sql.drop, (writer, tp.topic, tp.partition))
        puts = [
            (writer, tp.topic, tp.partition, off, generations.get(writer, top), None, None)
            for tp, off in sorted(offsets.items())
            for writer in _holders(rows, tp, connector)
        ]
        if puts:
            cur.executemany(self.sql.put, puts)

    def retire(self, cur: Any, connector: str) -> list[str]:
        """Every row of every writer of ``connector`` (a writer id), claim rows included, in the
        caller's open transaction (a deleted connector); the writer ids removed."""
        cur.execute(self.sql.writers)
        gone = sorted(str(w) for (w,) in cur.fetchall() if is_writer_of(connector, str(w)))
        for writer in gone:
            cur.execute(self.sql.retire, (writer,))
        return gone

    def read(self, cur: Any) -> StoredPositions | None:
        """The writer's positions as stored (a migrated connector's under its bare name while
        it has none of its own); None when there are none."""
        cur.execute(self.sql.read, (self.writer,))
        held = _positions_of(ledger_rows(cur))
        legacy = self.binding.legacy_writer if self.binding else None
        if not held and legacy:
            cur.execute(self.sql.read, (legacy,))
            held = {
                tp: StoredPosition(p.offset) for tp, p in _positions_of(ledger_rows(cur)).items()
            }
        return held or None

    def _fence(self, rows: Sequence[Mapping[str, Any]]) -> StoredPositions:
        newest = max((int(r["generation"]) for r in rows), default=0)
        if newest > self.generation:
            raise FencedError(
                f"writer {self.writer!r}: the offsets table {self.sql.table} holds generation "
                f"{newest}, this run is generation {self.generation}; not committing"
            )
        return _positions_of(rows)

    def send(
        self,
        cur: Any,
        batch: pa.Table,
        write: Callable[[pa.Table], list[RowFailure]],
        *,
        fail_fast: bool,
    ) -> list[RowFailure]:
        """In the sink's open transaction: lock and fence, ``write`` the rows the usable offsets
        do not cover (it returns its failures, indexed in what it was given), raise the offsets.
        Returns the failures indexed in ``batch``. The caller commits, or rolls back on error."""
        missing = {TOPIC_COL, PARTITION_COL, OFFSET_COL} - set(batch.schema.names)
        if missing:
            raise PermanentSinkError(
                f"delivery exactly_once needs the message columns {', '.join(sorted(missing))} in the batch"
            )
        assert self.binding is not None
        cur.execute(self.sql.ensure, (self.writer, self.generation))
        cur.execute(self.sql.lock, (self.writer,))
        stored = self._fence(ledger_rows(cur))
        usable = self.binding.usable(stored)
        keep = self._uncovered(batch, usable)
        if not keep:
            return []  # every row is in the table already (a replay)
        part = batch if len(keep) == batch.num_rows else batch.take(pa.array(keep, pa.int64()))
        failures = write(part)
        done = written_rows(len(keep), failures, fail_fast) if failures else None
        if done != []:
            written = part if done is None else part.take(pa.array(done, pa.int64()))
            self._advance(cur, next_offsets_of(written), stored, usable)
            self._forget(written)
        for f in failures:
            self._failed[_coords(part, f.index)] = None
        while len(self._failed) > FAILED_MEMORY:
            self._failed.pop(next(iter(self._failed)))
        return [RowFailure(keep[f.index], f.message, f.kind) for f in failures]

    def _advance(
        self, cur: Any, offsets: Offsets, stored: StoredPositions, usable: Offsets
    ) -> None:
        """Raise the offsets to the rows written, naming this run's logs and destination; a
        stored position of another log or destination is replaced, not raised."""
        assert self.binding is not None
        scope = self.binding.scope
        rows = {
            tp: (self.writer, tp.topic, tp.partition, o, self.generation)
            + (scope.log_ids.get(tp.topic), scope.destination)
            for tp, o in sorted(offsets.items())
        }
        stale = [rows[tp] for tp in rows if tp in stored and tp not in usable]
        if stale:
            cur.executemany(self.sql.put, stale)
        fresh = [r for tp, r in rows.items() if tp not in stored or tp in usable]
        if fresh:
            cur.executemany(self.sql.advance, fresh)

    def _uncovered(self, batch: pa.Table, known: Offsets) -> list[int]:
        """The indexes of the rows the offsets do not cover, and of those that failed in this
        run (computed by Arrow, one pass per partition the table knows)."""
        import pyarrow.compute as pc

        covered = pa.array([False] * batch.num_rows, pa.bool_())
        topics, partitions = batch.column(TOPIC_COL), batch.column(PARTITION_COL)
        offsets = batch.column(OFFSET_COL)
        for tp, floor in known.items():
            here = pc.and_(pc.equal(topics, tp.topic), pc.equal(partitions, tp.partition))
            covered = pc.or_(covered, pc.and_(here, pc.less(offsets, floor)))
        keep = pc.indices_nonzero(pc.invert(covered)).to_pylist()
        if len(keep) < batch.num_rows:
            again = [i for i in self._failed_rows(batch) if covered[i].as_py()]
            keep = sorted(keep + again)
        return keep

    def _failed_rows(self, table: pa.Table) -> list[int]:
        """The indexes of ``table``'s rows that failed in this run (the offsets picked by
        Arrow, the few rows with such an offset checked one by one)."""
        if not self._failed:
            return []
        import pyarrow.compute as pc

        offsets = pa.array({o for _, _, o in self._failed}, pa.int64())
        maybe = pc.is_in(table.column(OFFSET_COL).cast(pa.int64()), value_set=offsets)
        return [
            i for i in pc.indices_nonzero(maybe).to_pylist() if _coords(table, i) in self._failed
        ]

    def _forget(self, written: pa.Table) -> None:
        """Rows written are no longer failed rows of this run."""
        for i in self._failed_rows(written):
            self._failed.pop(_coords(written, i), None)


def _coords(table: pa.Table, i: int) -> tuple[str, int, int]:
    """(topic, partition, offset) of row ``i``."""
    return (
        table.column(TOPIC_COL)[i].as_py(),
        table.column(PARTITION_COL)[i].as_py(),
        table.column(OFFSET_COL)[i].as_py(),
    )


def _holders(rows: Mapping[str, Offsets], tp: TopicPartition, connector: str) -> list[str]:
    """The writers holding ``tp``; the connector's own when none does."""
    return sorted(w for w, known in rows.items() if tp in known) or [connector]


def ledger_rows(cur: Any) -> list[dict[str, Any]]:
    """The rows of the query just run, by lower-case column name (``SELECT *``: a table of the
    release before issue 44 has no ``log_id``/``destination``)."""
    names = [str(d[0]).lower() for d in cur.description or ()]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def _positions_of(rows: Sequence[Mapping[str, Any]]) -> StoredPositions:
    """The positions in offsets-table rows, the claim row left out."""
    return {
        TopicPartition(str(r["topic"]), int(r["partition"])): StoredPosition(
            int(r["next_offset"]), r.get("log_id"), r.get("destination")
        )
        for r in rows
        if not (r["topic"] == CLAIM_TOPIC and int(r["partition"]) == CLAIM_PARTITION)
    }
