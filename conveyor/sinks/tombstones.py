"""Tombstones for keyed sinks: which rows are deletes, and the key a delete removes.

A tombstone is a message without a payload (``__tombstone`` true: see
``transform.null_values: pass``). A sink with ``delete_enabled`` deletes the row or
document it names instead of writing it (Kafka Connect's ``delete.enabled``). The
key columns of a delete come, in this order:

1. from the row itself, when the transform's select computed every key column
   (e.g. ``CAST(__key AS STRING) AS id``);
2. from the message key when it is a JSON object holding the missing key columns
   (Debezium and Kafka Connect's JSON keys, also inside a ``{"schema":..,
   "payload": {..}}`` envelope, whose Debezium encodings are read by the schema:
   ``conveyor.formats.debezium.plain_value``);
3. with one key column, from the message key itself: a JSON scalar (``42``,
   ``"abc"``) or, failing that, its UTF-8 text.

Otherwise the tombstone is a data error for that row, naming the missing column.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from conveyor.core.model import KEY_COL, TOMBSTONE_COL
from conveyor.formats.debezium import plain_value


class DeleteKeyError(ValueError):
    """A tombstone whose key columns cannot be found (a data error for its row)."""


def tombstone_flags(batch: pa.Table) -> list[bool]:
    """Per row: is it a tombstone (all False when the batch has no __tombstone column)."""
    if TOMBSTONE_COL not in batch.schema.names:
        return [False] * batch.num_rows
    return [bool(v) for v in batch.column(TOMBSTONE_COL).to_pylist()]


def has_tombstones(batch: pa.Table) -> bool:
    return any(tombstone_flags(batch))


def message_keys(batch: pa.Table) -> list[bytes | None]:
    if KEY_COL not in batch.schema.names:
        return [None] * batch.num_rows
    return list(batch.column(KEY_COL).to_pylist())


def _key_object(key: bytes | None) -> Any:
    if key is None:
        return None
    try:
        doc = json.loads(key)
    except ValueError:
        return None
    if isinstance(doc, dict) and isinstance(doc.get("payload"), dict) and "schema" in doc:
        # Kafka Connect's JsonConverter envelope; Debezium's encodings as plain values
        try:
            return plain_value(doc["schema"], doc["payload"], "key")
        except (ValueError, RecursionError):
            return doc["payload"]
    return doc


def delete_key(names: Sequence[str], row: dict[str, Any], key: bytes | None) -> tuple[Any, ...]:
    """The values of key columns ``names`` for a tombstone (see the module docstring)."""
    missing = [n for n in names if row.get(n) is None]
    if not missing:
        return tuple(row[n] for n in names)
    doc = _key_object(key)
    values = dict(row)
    if isinstance(doc, dict):
        for n in missing:
            if doc.get(n) is not None:
                values[n] = doc[n]
    elif len(names) == 1 and key is not None:
        if doc is not None and not isinstance(doc, (list, bool)):
            values[names[0]] = doc
        else:
            values[names[0]] = key.decode(errors="replace")
    still = [n for n in names if values.get(n) is None]
    if still:
        shown = "null" if key is None else repr(key[:60].decode(errors="replace"))
        raise DeleteKeyError(
            f"tombstone without a value for key column(s) {', '.join(still)} "
            f"(neither the row nor the message key {shown} gives one)"
        )
    return tuple(values[n] for n in names)
