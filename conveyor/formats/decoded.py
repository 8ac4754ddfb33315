"""What every payload decoder returns: the records as Arrow columns, and the rows that failed.

The contract (``PayloadDecoder``): ``decode`` takes a batch's payloads (binary, no nulls) and
returns one row per payload, the payload's fields as columns; a payload that cannot be decoded
(an unknown schema id, a corrupt frame, content its schema does not allow, a record the
reader schema cannot read) is an all-null row and an entry of ``failed`` saying why, for the
connector's failure policy; so is a record nested deeper than ``limits.MAX_RECORD_NESTING``.
``decode`` raises only for what is not a record's fault: a registry outage
(``TransientSinkError``: the batch is retried), refused credentials or a schema beyond the
limits of ``conveyor.formats.limits`` (``ConfigError``, naming the schema's subject and
version). Nothing a record or a schema holds makes it raise anything else (no
``RecursionError``). Decoders keep state between batches (schemas by id, the reader shape), so
one decoder serves one topic's stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa


@dataclass(frozen=True)
class Decoded:
    """A decoded batch: ``table`` has one row per input payload (failed rows all null), the
    payload's top-level fields as columns; ``failed`` maps an input row index to why."""

    table: pa.Table
    failed: dict[int, str]


class PayloadDecoder(Protocol):
    """Decodes a batch of payloads (binary, no nulls) into ``Decoded`` (see the module)."""

    def decode(self, values: pa.Array) -> Decoded: ...


# A struct's fields are nullable in every decoded table, whatever the schema says (a record
# field without null in its union, a required JSON property, a proto3 scalar): a null struct
# (a null nested record, a failed row) holds nulls in its children, and Spark Connect's
# client refuses such a result (``toArrow``: "nulls in input cannot be viewed as
# non-nullable"). Nullability of list items and map values is kept.
STRUCT_FIELDS_NULLABLE = True

# Converts a decoded value (a library's Python object) into what ``pa.array`` takes for the
# value's Arrow type; None where the value is taken as it is.
Convert = Callable[[Any], Any] | None


def converted(convert: Convert, value: Any) -> Any:
    """``value`` through ``convert`` (None passes through; no converter: as it is)."""
    if value is None or convert is None:
        return value
    return convert(value)


def table_of_records(
    records: list[dict[str, Any] | None], row_type: pa.StructType, failed: dict[int, str]
) -> pa.Table:
    """A table with ``row_type``'s fields as columns, one row per record (None: an all-null
    row). Every column is nullable: a failed row is null in each. A record Arrow refuses
    (a value outside its column's type) becomes a failed row in ``failed``."""
    try:
        array = pa.array(records, type=row_type)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        for i, record in enumerate(records):
            if record is None:
                continue
            try:
                pa.array([record], type=row_type)
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
                records[i] = None
                failed[i] = f"a value does not fit its column's type: {e}"
        array = pa.array(records, type=row_type)
    assert isinstance(array, pa.StructArray)
    columns = array.flatten()
    fields = [row_type.field(i).with_nullable(True) for i in range(row_type.num_fields)]
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def payloads(values: pa.Array | pa.ChunkedArray) -> list[bytes]:
    """A batch's payloads as Python bytes (binary or large binary, no nulls)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)):
        raise TypeError(f"payloads must be binary, not {values.type}")
    out: list[bytes] = values.to_pylist()
    return out


def decode_each(
    values: pa.Array | pa.ChunkedArray, read: Callable[[bytes], str | tuple[dict[str, Any], Any]]
) -> Decoded:
    """Each payload through ``read``: (the record, its row type: Arrow fields), or why it
    failed. The batch's columns are the union of its records' fields, first seen first (the
    decoders whose records each carry their writer's shape: Protobuf, JSON Schema)."""
    failed: dict[int, str] = {}
    records: list[dict[str, Any] | None] = []
    fields: dict[str, pa.Field] = {}
    for i, value in enumerate(payloads(values)):
        outcome = read(value)
        if isinstance(outcome, str):
            failed[i] = outcome
            records.append(None)
            continue
        record, row_type = outcome
        for f in row_type:
            fields.setdefault(f.name, f)
        records.append(record)
    return Decoded(table_of_records(records, pa.struct(list(fields.values())), failed), failed)


class RowFailure(Exception):
    """One record cannot be decoded; the message says why (it becomes ``failed[i]``)."""
