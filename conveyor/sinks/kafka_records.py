"""The Kafka sink's records: each row's target topic (a ``${...}`` template, or the row's
``__destination``), key, headers, timestamp and partition, column by column when it can be,
and its value as JSON or written by a schema registry's serializer (``value_format``)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from conveyor.core.model import (
    DESTINATION_COL,
    HEADERS_COL,
    KEY_COL,
    OFFSET_COL,
    PARTITION_COL,
    TIMESTAMP_COL,
    TOPIC_COL,
)
from conveyor.sinks import templates
from conveyor.sinks.base import Record, iter_records, payload_columns, payload_values
from conveyor.sinks.kafka_config import KafkaSinkConfig, topic_name_problem
from conveyor.sinks.tombstones import tombstone_flags

if TYPE_CHECKING:
    from conveyor.formats.encoding import Encoder


def timestamp_ms(ts: dt.datetime | None) -> int | None:
    """Epoch milliseconds of a (naive = UTC) datetime, exact to the millisecond."""
    if ts is None:
        return None
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=dt.timezone.utc)
    return (ts - _EPOCH) // dt.timedelta(milliseconds=1)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)

_PER_MS = {"s": None, "ms": 1, "us": 1_000, "ns": 1_000_000}


def epoch_ms(column: pa.ChunkedArray | pa.Array) -> list[int | None]:
    """A timestamp column as epoch milliseconds (floored, as ``timestamp_ms``)."""
    per_ms = _PER_MS[column.type.unit]
    raw = column.cast(pa.int64())
    if per_ms is None:
        return [None if v is None else v * 1000 for v in raw.to_pylist()]
    if per_ms == 1:
        return raw.to_pylist()
    if (pc.min(raw).as_py() or 0) >= 0:  # Arrow's integer division truncates: floors here
        return pc.divide(raw, per_ms).to_pylist()
    return [None if v is None else v // per_ms for v in raw.to_pylist()]


def _any_header(batch: pa.Table) -> bool:
    """Whether a row of the batch has a header (most batches have none: not read per row)."""
    if HEADERS_COL not in batch.schema.names:
        return False
    lengths = pc.list_value_length(batch.column(HEADERS_COL))
    return bool(pc.max(lengths).as_py())


def _header_bytes(v: Any) -> bytes:
    return v if isinstance(v, bytes) else (b"" if v is None else str(v).encode())


@dataclass
class Outgoing:
    """One batch's records, column by column: row ``i`` goes to ``topics[i]`` (or has that
    TemplateError) as ``producer.send(topics[i], **message(i))``."""

    topics: list[str | templates.TemplateError]
    values: list[bytes | None]  # None: a tombstone
    keys: list[bytes | None]
    headers: list[list[tuple[str, bytes]] | None]  # None: no headers
    stamps: list[int | None]  # epoch ms; None: the producer's clock
    partitions: list[int | None]  # None: the partitioner chooses

    def message(self, i: int) -> dict[str, Any]:
        """Row ``i``'s ``producer.send`` keyword arguments (topic excluded)."""
        return {
            "value": self.values[i],
            "key": self.keys[i],
            "headers": list(self.headers[i] or ()),
            "timestamp_ms": self.stamps[i],
            "partition": self.partitions[i],
        }

    def largest_record(self) -> int:
        """An upper bound of every row's size as ``too_large`` estimates it (kafka-python's
        ``estimate_size_in_bytes``: the batch header 61, record overhead 21, each length's
        varint at most 5 bytes): the largest key, value and headers added together."""

        def longest(items: list[bytes | None]) -> int:
            return max(map(len, filter(None, items)), default=0)

        headers = max(
            (
                5 + sum(10 + len(k.encode()) + len(v or b"") for k, v in hs)
                for hs in self.headers
                if hs
            ),
            default=5,
        )
        return 61 + 21 + 5 + longest(self.keys) + 5 + longest(self.values) + headers


class KafkaRecords:
    """A batch's records as the config says (``outgoing``); the value encoder is built on
    first use."""

    def __init__(self, config: KafkaSinkConfig):
        self.config = config
        self._encoder: Encoder | None = None  # value_format avro / json_schema

    def target_topic(self, r: Record) -> str:
        """The topic a row goes to; templates.TemplateError when the row cannot say."""
        if self.config.use_destination and r.destination:
            topic = r.destination
        elif templates.is_static(self.config.topic):
            return self.config.topic  # checked by validate()
        else:
            topic = templates.render(self.config.topic, r)
        problem = topic_name_problem(topic)
        if problem:
            raise templates.TemplateError(problem)
        return topic

    def message(self, r: Record) -> dict[str, Any]:
        """The keyword arguments of ``producer.send`` for a row (topic excluded)."""
        c = self.config
        key = r.key if c.key is None else templates.render(c.key, r).encode()
        headers: list[tuple[str, bytes]] = []
        if c.keep_headers:
            headers.extend(
                (str(k), v if isinstance(v, bytes) else (b"" if v is None else str(v).encode()))
                for k, v in r.headers
            )
        if c.coordinate_headers:
            headers += [
                ("x-conveyor-topic", r.topic.encode()),
                ("x-conveyor-partition", str(r.partition).encode()),
                ("x-conveyor-offset", str(r.offset).encode()),
            ]
        value = None if r.payload is None else r.payload_bytes()  # a null value is a tombstone
        return {
            "value": value,
            "key": key,
            "headers": headers,
            "timestamp_ms": timestamp_ms(r.timestamp) if c.timestamp == "source" else None,
            "partition": r.partition if c.partitioning == "source" else None,
        }

    def outgoing(self, batch: pa.Table) -> Outgoing:
        """Every row's target topic (or why it has none) and record, column by column.

        Built from the batch's columns when the topic is fixed (or the row's
        ``__destination``) and the key is the source key, the common case; row by row
        through ``target_topic`` and ``message`` otherwise. Both give the same records
        (tests/unit/test_kafka_sink_config.py).
        """
        out = self._outgoing_of(batch)
        if self.config.value_format != "json":
            self._encode_values(batch, out)
        return out

    def _outgoing_of(self, batch: pa.Table) -> Outgoing:
        c = self.config
        if c.key is not None or not templates.is_static(c.topic):
            return self._outgoing_by_row(batch)
        n = batch.num_rows
        names = batch.schema.names

        def col(name: str) -> list[Any]:
            return batch.column(name).to_pylist() if name in names else [None] * n

        partitions = col(PARTITION_COL)
        topics: list[str | templates.TemplateError] = [c.topic] * n
        if c.use_destination and DESTINATION_COL in names:
            dests = batch.column(DESTINATION_COL)
            if dests.null_count < n:
                for i, d in enumerate(dests.to_pylist()):
                    if d:
                        problem = topic_name_problem(d)
                        topics[i] = templates.TemplateError(problem) if problem else d
        headers: list[list[tuple[str, bytes]] | None] = [None] * n
        if c.keep_headers and _any_header(batch):
            headers = [
                [(str(h["key"]), _header_bytes(h["value"])) for h in hs] if hs else None
                for hs in batch.column(HEADERS_COL).to_pylist()
            ]
        if c.coordinate_headers:
            sources, offsets = col(TOPIC_COL), col(OFFSET_COL)
            headers = [
                [
                    *(hs or ()),
                    ("x-conveyor-topic", (sources[i] or "").encode()),
                    ("x-conveyor-partition", str(partitions[i] or 0).encode()),
                    (
                        "x-conveyor-offset",
                        str(offsets[i] if offsets[i] is not None else i).encode(),
                    ),
                ]
                for i, hs in enumerate(headers)
            ]
        return Outgoing(
            topics=topics,
            values=payload_values(batch),
            keys=col(KEY_COL),
            headers=headers,
            stamps=(
                epoch_ms(batch.column(TIMESTAMP_COL))
                if c.timestamp == "source" and TIMESTAMP_COL in names
                else [None] * n
            ),
            partitions=([p or 0 for p in partitions] if c.partitioning == "source" else [None] * n),
        )

    def _encode_values(self, batch: pa.Table, out: Outgoing) -> None:
        """value_format avro / json_schema: each row's payload columns written by confluent-kafka's
        serializer for its target topic, replacing the JSON. A row its schema does not allow
        becomes a failed message (its topic an error); tombstones stay null."""
        if self._encoder is None:
            from conveyor.formats.encoding import payload_encoder

            c = self.config
            fmt = c.value_format
            assert c.schema_registry is not None and fmt != "json"
            self._encoder = payload_encoder(
                fmt,
                c.schema_registry,
                c.subject_name_strategy,
                c.auto_register,
                c.use_latest_version,
                c.value_schema,
                message=c.value_message,
            )
        payload = batch.select(payload_columns(batch))
        tombstones = tombstone_flags(batch)
        by_topic: dict[str, list[int]] = {}
        for i, t in enumerate(out.topics):
            if tombstones[i]:
                out.values[i] = None  # a message without a payload stays one
            elif isinstance(t, str) and out.values[i] is not None:
                by_topic.setdefault(t, []).append(i)
        for topic, rows in by_topic.items():
            for i, value in self._encoded(payload, topic, rows).items():
                if isinstance(value, templates.TemplateError):
                    out.topics[i] = value
                else:
                    out.values[i] = value

    def _encoded(
        self, payload: pa.Table, topic: str, rows: list[int]
    ) -> dict[int, bytes | templates.TemplateError]:
        """Rows ``rows`` of ``payload`` encoded for ``topic``; a row the schema refuses is set
        apart with why and the rest encoded again (as many passes as refused rows)."""
        from conveyor.formats.encoding import EncodeError

        assert self._encoder is not None
        done: dict[int, bytes | templates.TemplateError] = {}
        left = list(rows)
        while left:
            try:
                values = self._encoder.encode(payload.take(pa.array(left, pa.int64())), topic)
            except EncodeError as e:
                bad = left.pop(e.row)
                done[bad] = templates.TemplateError(
                    f"not encodable as {self.config.value_format}: {e}"
                )
                continue
            done.update(zip(left, values, strict=True))
            left = []
        return done

    def _outgoing_by_row(self, batch: pa.Table) -> Outgoing:
        out = Outgoing([], [], [], [], [], [])
        for r in iter_records(batch):
            topic: str | templates.TemplateError
            try:
                topic, m = self.target_topic(r), self.message(r)
            except templates.TemplateError as e:
                topic, m = e, {"value": None, "key": None, "headers": None}
            out.topics.append(topic)
            out.values.append(m["value"])
            out.keys.append(m["key"])
            out.headers.append(m["headers"] or None)
            out.stamps.append(m.get("timestamp_ms"))
            out.partitions.append(m.get("partition"))
        return out
