"""What the transformer does to payloads before the trip to Spark: messages without one held
back (``null_values``), Debezium's encodings made plain (``envelope: debezium``), and the
schema formats (avro, protobuf, json_schema) decoded here, per topic, into typed columns
(``conveyor.formats``): rows that cannot be decoded become failed messages and stay here."""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa

from conveyor.core.engine.loop import Rejected
from conveyor.core.errors import ConfigError
from conveyor.core.model import TOMBSTONE_COL, TRUNCATE_COL, VALUE_COL, NullValues, TransformSpec
from conveyor.formats import PayloadDecoder, payload_decoder, registry_metrics
from conveyor.spark.envelopes import plain_payloads, unwrap_debezium

BAD_COL = "__bad"  # null, or why the row cannot be decoded
ROW_COL = "__row"


class LocalDecoding:
    """decode avro/protobuf/json_schema: a decoder per topic (its subject is the topic's),
    used by one thread at a time (batches ahead are transformed on several)."""

    def __init__(self, spec: TransformSpec):
        self.spec = spec
        self._decoders: dict[str, PayloadDecoder] = {}
        self._decode_lock = threading.Lock()
        self._decoded_schema: pa.Schema | None = None  # the last batch's payload shape

    def decode(
        self, batch: pa.Table, shipped: pa.Table, meta_used: list[str]
    ) -> tuple[pa.Table, list[Rejected], bool]:
        """decode avro/protobuf/json_schema: the shipped payloads become their fields' typed
        columns here (``conveyor.formats``), per topic; rows that cannot be decoded become
        failed messages and do not make the trip. A registry outage raises
        TransientSinkError (retried, Degraded). Also whether the decoded shape is new (a
        new writer or reader schema: the output schema is learnt again)."""
        import pyarrow.compute as pc

        # Under null_values: pass, messages without a payload go on with null payload columns.
        empty = pc.fill_null(pc.equal(pc.binary_length(shipped.column(VALUE_COL)), 0), True)
        payloadless = shipped.filter(empty).drop_columns([VALUE_COL])
        if self.spec.envelope == "debezium":
            # Payload columns replace message columns: these rows must say they are tombstones.
            n = payloadless.num_rows
            payloadless = payloadless.append_column(
                TOMBSTONE_COL, pa.array([True] * n, pa.bool_())
            ).append_column(TRUNCATE_COL, pa.array([False] * n, pa.bool_()))
        shipped = shipped.filter(pc.invert(empty))
        rows = shipped.column(ROW_COL)
        topics = batch.column("__topic").take(rows) if "__topic" in batch.column_names else None
        parts: list[pa.Table] = [payloadless] if payloadless.num_rows else []
        failed: list[Rejected] = []
        for topic in _distinct(topics) if shipped.num_rows else []:
            mask = pc.equal(topics, topic) if topics is not None else None
            part = shipped if mask is None else shipped.filter(mask)
            with self._decode_lock:
                decoded = self._decoder(topic).decode(part.column(VALUE_COL).combine_chunks())
            table, whys = decoded.table, decoded.failed
            if self.spec.envelope == "debezium":
                table, unwrapped = unwrap_debezium(table)
                whys = {**unwrapped, **whys}  # a record that did not decode says so
            part_rows = part.column(ROW_COL).to_pylist()
            failed += [Rejected(part_rows[i], why) for i, why in sorted(whys.items())]
            keep = pa.array([i not in whys for i in range(part.num_rows)], pa.bool_())
            payload = table.filter(keep)
            payload = payload.cast(_all_nullable(payload.schema))
            clash = set(payload.column_names) & {ROW_COL, BAD_COL, *meta_used}
            if clash:
                raise ConfigError(
                    f"payload field {sorted(clash)[0]!r} has the name of a message column; "
                    "rename it in the writer schema",
                    field="transform.decode",
                )
            carried = part.drop_columns([VALUE_COL]).filter(keep)
            parts.append(
                pa.Table.from_arrays(
                    [*carried.columns, *payload.columns],
                    schema=pa.schema([*carried.schema, *payload.schema]),
                )
            )
        if not parts:
            return shipped.drop_columns([VALUE_COL]), failed, False
        out = parts[0]
        if len(parts) > 1:
            out = pa.concat_tables(parts, promote_options="permissive")
            out = out.take(pc.sort_indices(out.column(ROW_COL)))  # source order
        reshaped = self._decoded_schema is None or not out.schema.equals(self._decoded_schema)
        self._decoded_schema = out.schema
        return out, failed, reshaped

    def _decoder(self, topic: str | None) -> PayloadDecoder:
        key = topic or ""
        decoder = self._decoders.get(key)
        if decoder is None:
            spec = self.spec
            subject = spec.subject or (f"{topic}-value" if topic else None)
            decoder = self._decoders[key] = payload_decoder(
                spec.decode.value,
                spec.schema_registry,
                reader_schema=spec.reader_schema,
                subject=subject,
                schema_file=spec.schema_file,
            )
        return decoder

    def registry_metrics(self) -> dict[str, int] | None:
        """The schema registry lookups of the topics' decoders (None: no registry read)."""
        # Not under the decode lock: the heartbeat must not wait for a batch's decoding
        # (list() of a dict's values is one step under the GIL).
        return registry_metrics(list(self._decoders.values()))


def plain_debezium(shipped: pa.Table) -> tuple[pa.Table, list[Rejected]]:
    """envelope: debezium, decode: json: Debezium's encodings as plain values
    (``envelopes.plain_payloads``); an event whose values do not fit its schema is a
    failed message."""

    values, failed = plain_payloads(shipped.column(VALUE_COL).combine_chunks())
    shipped = shipped.set_column(shipped.schema.get_field_index(VALUE_COL), VALUE_COL, values)
    if not failed:
        return shipped, []
    rows = shipped.column(ROW_COL).to_pylist()
    held = [Rejected(rows[i], why) for i, why in sorted(failed.items())]
    keep = pa.array([i not in failed for i in range(shipped.num_rows)], pa.bool_())
    return shipped.filter(keep), held


def hold_payloadless(
    null_values: NullValues, batch: pa.Table, shipped: pa.Table, tombstones: pa.Array
) -> tuple[pa.Table, list[Rejected], int]:
    """Messages without a payload never reach Spark unless null_values is pass: skipped
    (their count returned), or failed messages (returned). The rest of ``shipped``."""
    import pyarrow.compute as pc

    if null_values == NullValues.PASS or not pc.any(tombstones).as_py():
        return shipped, [], 0
    rows = pc.indices_nonzero(tombstones).to_pylist()
    shipped = shipped.filter(pc.invert(tombstones))
    if null_values == NullValues.SKIP:
        return shipped, [], len(rows)
    values = batch.column(VALUE_COL)
    held = [
        Rejected(
            i,
            ("null payload (a tombstone)" if values[i].as_py() is None else "empty payload")
            + "; transform.null_values is 'fail'",
        )
        for i in rows
    ]
    return shipped, held, 0


def _all_nullable(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every field nullable, nested ones too: a decoder's required nested
    field (an Avro record's) may sit under a null parent, which Spark's crossing refuses."""

    def relax(t: pa.DataType) -> pa.DataType:
        if pa.types.is_struct(t):
            return pa.struct(
                [
                    t.field(i).with_type(relax(t.field(i).type)).with_nullable(True)
                    for i in range(t.num_fields)
                ]
            )
        if pa.types.is_map(t):
            return pa.map_(t.key_type, relax(t.item_type))
        if pa.types.is_large_list(t):
            return pa.large_list(relax(t.value_type))
        if pa.types.is_list(t):
            return pa.list_(relax(t.value_type))
        return t

    return pa.schema([f.with_type(relax(f.type)).with_nullable(True) for f in schema])


def _distinct(values: pa.Array | pa.ChunkedArray | None) -> list[Any]:
    """The distinct values in order of first appearance ([None] without a column)."""
    if values is None:
        return [None]
    return list(dict.fromkeys(values.to_pylist()))
