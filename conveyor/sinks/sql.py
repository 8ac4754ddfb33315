"""What the SQL sinks (PostgreSQL, MySQL) share: where each column comes from, and the column
types a table created from an Arrow batch gets, through each database's type map (its dialect).

Both configs subclass ``SqlSinkConfig`` (the fields they share, their rules and their asset
key); ``url``/``url_env`` come from ``sinks.base.UrlSinkConfig``. Bad rows are isolated with
savepoints through the one bisection, ``core.sink.isolate_rows``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import pyarrow as pa
from pydantic import Field

from conveyor.core.asset_keys import key_part
from conveyor.core.errors import ConfigError, FieldRuleError, PermanentSinkError, rule
from conveyor.core.model import (
    HEADERS_COL,
    KEY_COL,
    OFFSET_COL,
    PARTITION_COL,
    TIMESTAMP_COL,
    TOPIC_COL,
)
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


class SqlSinkConfig(UrlSinkConfig):
    """Base of the SQL sinks' configs (PostgreSQL, MySQL): the rules of the fields they share,
    and their asset key ``[kind, namespace, table]``.

    A subclass declares ``table``, ``columns``, ``upsert_keys``, ``create_table``,
    ``delete_enabled`` and ``connect_timeout_s`` (the shared ones through the aliases above),
    and says where its table lives (``key_namespace``)."""

    if TYPE_CHECKING:  # declared by each subclass, in its own field order
        table: str
        columns: dict[str, str] | None
        upsert_keys: list[str]
        create_table: bool
        delete_enabled: bool
        connect_timeout_s: int

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
            arrow = batch.schema.field(META_SOURCES.get(src, src)).type
            types[target] = dialect.type_of(arrow, target in keys)
    return types


def check_columns(table: str, mapping: dict[str, str], existing: Collection[str]) -> None:
    """PermanentSinkError when the table lacks a mapped column."""
    missing = [t for t in mapping if t not in existing]
    if missing:
        raise PermanentSinkError(
            f"table {table} has no column(s) {', '.join(missing)} (it has {', '.join(existing)})"
        )


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
