"""Kafka sink: each row becomes one record on a target topic.

The target topic is a ``${...}`` template (or the row's ``__destination``). The
message key, headers and source timestamp are kept. A batch is acknowledged when
``flush()`` returned and every record's future succeeded at ``acks=all``.

Two clients, ``sink.client``: ``confluent`` (librdkafka, ``conveyor.sinks.kafka_confluent``:
delivery reports settle the futures) and ``kafka-python`` (``KafkaProducer``). Only
producing, flushing, acknowledging and the topic-limit lookup differ; the records, the
routing and the failure semantics below are the same for both.

Kafka is append-only: a replayed batch is written again (at-least-once). The
idempotent producer only removes duplicates of the producer's own internal retries
within one producer session, not replays by the runtime.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from conveyor.brokers.connection import (
    classify_kafka_error,
    close_producer,
    describe_kafka_error,
    kafka_python_options,
    tls_handshake_options,
    tls_problem,
)
from conveyor.core.errors import (
    ConfigError,
    PermanentSinkError,
    TransientSinkError,
)
from conveyor.core.model import (
    DESTINATION_COL,
    HEADERS_COL,
    KEY_COL,
    OFFSET_COL,
    PARTITION_COL,
    TIMESTAMP_COL,
    TOPIC_COL,
    Offsets,
    TopicPartition,
)
from conveyor.core.positions import StoredPositions, TargetBinding
from conveyor.core.sink import ErrorKind, sink_error
from conveyor.sinks import templates
from conveyor.sinks.base import (
    Record,
    RowFailure,
    SendResult,
    Sink,
    batch_offsets,
    iter_records,
    payload_columns,
    payload_values,
    require,
    unseen_mask,
)
from conveyor.sinks.tombstones import tombstone_flags

if TYPE_CHECKING:
    from conveyor.formats.encoding import Encoder
    from conveyor.sinks.kafka_transactions import Transactions

from conveyor.sinks.kafka_config import (
    CODEC_MODULES,
    KafkaSinkConfig,
    codec_available,
    topic_name_problem,
)
from conveyor.sinks.kafka_config import (
    template_problems as template_problems,  # the RabbitMQ sink's and the tests' import
)

log = logging.getLogger("conveyor.sinks.kafka")


def producer_kwargs(c: KafkaSinkConfig) -> dict[str, Any]:
    """The KafkaProducer keyword arguments for a config (secrets resolved: never log them).

    Raises ConfigError naming the field for a missing secret or an unreadable file."""
    kw: dict[str, Any] = {
        "acks": "all" if c.acks == "all" else 1,
        "enable_idempotence": c.idempotent,
        "compression_type": None if c.compression == "none" else c.compression,
        "linger_ms": c.linger_ms,
        "batch_size": c.batch_size,
        "max_request_size": c.max_request_size,
        "request_timeout_ms": c.request_timeout_ms,
        "delivery_timeout_ms": c.delivery_timeout_ms,
        "max_block_ms": c.max_block_ms,
        "bootstrap_timeout_ms": c.connect_timeout_ms,
    }
    return {**kw, **kafka_python_options(c, "producer", prefix="sink")}


# -- error mapping --------------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    return describe_kafka_error(exc)


def _index(f: RowFailure) -> int:
    return f.index


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


# -- the sink -------------------------------------------------------------------------------


class KafkaSink(Sink):
    """Produces each row, flushes, then checks every record's acknowledgement."""

    config_class = KafkaSinkConfig
    config: KafkaSinkConfig

    def __init__(self, config: KafkaSinkConfig):
        super().__init__(config)
        self._producer: Any = None
        self._futures: list[tuple[int, Any]] = []  # kafka-python: each produced row's future
        self._partitions: dict[str, set[int]] = {}
        self._limits: dict[str, int | None] = {}  # topic -> max.message.bytes (None: unknown)
        self._admin: Any = None  # reads the limits (fail_fast), opened on first use
        self._encoder: Encoder | None = None  # value_format avro / json_schema, built on first use
        self._txn: Transactions | None = None  # delivery: exactly_once, once bound to a run
        self._held: StoredPositions | None = None  # what the target's group held at the start

    def validate(self) -> None:
        """The compression codec's package is installed here (kafka-python; librdkafka has
        every codec built in)."""
        c = self.config
        require(
            c.client == "confluent" or codec_available(c.compression),
            f"{c.compression} needs the Python package {CODEC_MODULES.get(c.compression)!r}, which is not installed",
            field="sink.compression",
        )

    def describe(self) -> str:
        return f"kafka/{self.config.topic}@{self.config.bootstrap_servers}"

    # -- lifecycle ----------------------------------------------------------------------

    def _connect(self) -> Any:
        if self.config.client == "confluent":
            return self._connect_confluent()
        from kafka import KafkaProducer

        c = self.config
        try:
            kwargs = producer_kwargs(c)
        except ConfigError as e:
            raise PermanentSinkError(str(e)) from None
        problem = tls_problem(kwargs)
        if problem:
            raise PermanentSinkError(f"cannot connect to Kafka at {c.bootstrap_servers}: {problem}")
        try:
            return KafkaProducer(**kwargs)
        except Exception as e:  # noqa: BLE001 - classified below
            raise self._error(e, f"cannot connect to Kafka at {c.bootstrap_servers}") from None

    def _connect_confluent(self) -> Any:
        from conveyor.sinks import kafka_confluent as rd

        c = self.config
        try:
            conf = rd.producer_config(c)
            problem = tls_problem(tls_handshake_options(c, "producer", prefix="sink"))
        except ConfigError as e:
            raise PermanentSinkError(str(e)) from None
        if problem:
            raise PermanentSinkError(f"cannot connect to Kafka at {c.bootstrap_servers}: {problem}")
        if self._txn is not None:
            conf = {**conf, **self._txn.producer_conf()}
        try:
            producer = rd.ConfluentProducer(c, conf)
            producer.bootstrap(c.connect_timeout_ms / 1000)
        except Exception as e:  # noqa: BLE001 - classified below
            raise self._error(e, f"cannot connect to Kafka at {c.bootstrap_servers}") from None
        if self._txn is not None:
            try:
                self._held = self._txn.start(producer.client)
            except BaseException:
                producer.close(timeout=0)
                raise
        return producer

    # -- exactly once (``conveyor.sinks.kafka_transactions``) -----------------------------

    def bind(self, binding: TargetBinding) -> None:
        """With delivery exactly_once: this run's transactional producer, started now (older
        producers of the id are fenced before the run reads where to start)."""
        if self.config.delivery != "exactly_once":
            return
        from conveyor.sinks import kafka_confluent as rd
        from conveyor.sinks.kafka_transactions import Transactions

        try:
            conf = rd.producer_config(self.config)
        except ConfigError as e:
            raise PermanentSinkError(str(e)) from None
        timeout = self.config.request_timeout_ms / 1000
        self._txn = Transactions(conf, binding, timeout)
        self._producer = self._connect()

    def move_target_offsets(
        self,
        connector: str,
        generations: Mapping[str, int],
        offsets: Offsets,
        *,
        forget: Collection[TopicPartition] = (),
        replace: bool = False,
    ) -> None:
        """An operator's offsets change in the writers' groups, through their transactional
        ids (``kafka_transactions.move_offsets``)."""
        from conveyor.sinks import kafka_confluent as rd
        from conveyor.sinks.kafka_transactions import move_offsets

        try:
            conf = rd.producer_config(self.config)
        except ConfigError as e:
            raise PermanentSinkError(str(e)) from None
        move_offsets(
            conf,
            generations,
            connector,
            offsets,
            forget=forget,
            replace=replace,
            timeout_s=self.config.request_timeout_ms / 1000,
        )

    def target_offsets(self) -> StoredPositions | None:
        """The source positions the target's group held when this run's producer started."""
        return self._held if self._txn is not None else None

    def retire_target_offsets(self, connector: str) -> str | None:
        """Delete the groups of a deleted connector's writers; what failed, or None."""
        from conveyor.sinks import kafka_confluent as rd
        from conveyor.sinks.kafka_transactions import retire

        if self.config.delivery != "exactly_once":
            return None
        try:
            retire(
                rd.producer_config(self.config), connector, self.config.request_timeout_ms / 1000
            )
            return None
        except Exception as e:  # noqa: BLE001 - reported to the operator
            return f"deleting the groups of {connector} failed: {e}"

    def _send_in_transaction(self, batch: pa.Table) -> SendResult:
        """The batch's rows the target's offsets do not cover yet, and the offsets they end at,
        in one transaction. Rows already covered (a batch sent again after another producer of
        the id committed it) are not written twice."""
        assert self._txn is not None
        if self._producer is None:
            self._producer = self._connect()
        mask = unseen_mask(batch, self._txn.binding.usable(self._held or {}))
        todo = list(range(batch.num_rows)) if mask is None else pc.indices_nonzero(mask).to_pylist()
        if not todo:
            return SendResult(rows=batch.num_rows)
        part = batch if mask is None else batch.filter(mask)
        client = self._producer.client
        self._txn.begin(client)
        try:
            result = self._send(part, in_transaction=True)
            failed = {f.index for f in result.failed}
            done = [i for i in range(part.num_rows) if i not in failed]
            offsets = batch_offsets(part.take(pa.array(done, pa.int64())))
            self._txn.commit(client, offsets)
        except Exception as e:
            fenced = self._txn.abort(client)
            self._drop_producer()
            if fenced is not None:
                raise fenced from e
            raise
        scope = self._txn.binding.scope
        self._held = {
            **(self._held or {}),
            **{tp: scope.position(tp, o) for tp, o in offsets.items()},
        }
        failures = tuple(replace(f, index=todo[f.index]) for f in result.failed)
        return SendResult(rows=batch.num_rows, failed=failures)

    def _error(self, exc: BaseException, context: str) -> Exception:
        # A data error outside a row (e.g. a codec the broker refuses) is the config's fault.
        return sink_error(classify_kafka_error(exc), f"{context}: {_describe(exc)}")

    def init_sink(self) -> None:
        self._producer = self._connect()
        if templates.is_static(self.config.topic):
            self._topic_partitions(self.config.topic, at_start=True)

    def _topic_partitions(self, topic: str, *, at_start: bool = False) -> set[int]:
        if topic in self._partitions:
            return self._partitions[topic]
        from kafka.errors import KafkaTimeoutError

        try:
            parts = set(self._producer.partitions_for(topic) or ())
        except KafkaTimeoutError:
            # The bootstrap server answered, so the cluster is reachable: no metadata for the
            # topic means it does not exist and the cluster does not auto-create topics.
            raise PermanentSinkError(
                f"topic {topic!r} not found on {self.config.bootstrap_servers} within {self.config.max_block_ms} ms "
                "(create it, or enable auto-creation on the cluster)"
            ) from None
        except Exception as e:  # noqa: BLE001 - classified
            self._drop_producer()
            raise self._error(e, f"metadata of topic {topic!r}") from None
        if not parts and at_start:
            raise PermanentSinkError(
                f"topic {topic!r} has no partitions on {self.config.bootstrap_servers}"
            )
        self._partitions[topic] = parts
        return parts

    def topic_limit(self, topic: str) -> int | None:
        """The topic's ``max.message.bytes`` (DescribeConfigs, once per topic), or None when
        the cluster does not say (no permission, an old broker): then only the producer's
        ``max_request_size`` is checked before sending."""
        if topic in self._limits:
            return self._limits[topic]
        from kafka import KafkaProducer

        from conveyor.sinks.kafka_confluent import ConfluentProducer

        limit: int | None = None
        if isinstance(self._producer, ConfluentProducer):
            limit = self._confluent_topic_limit(topic)
        elif isinstance(self._producer, KafkaProducer):  # read through the cluster it writes to
            try:
                from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

                if self._admin is None:
                    c = self.config
                    self._admin = KafkaAdminClient(
                        **kafka_python_options(c, "admin", prefix="sink"),
                        request_timeout_ms=min(c.request_timeout_ms, 10_000),
                        bootstrap_timeout_ms=min(c.connect_timeout_ms, 10_000),
                    )
                reply = self._admin.describe_configs(
                    [ConfigResource(ConfigResourceType.TOPIC, topic)], config_filter="all"
                )
                entry = reply.get("topic", {}).get(topic, {}).get("max.message.bytes")
                value = entry.get("value") if isinstance(entry, dict) else entry
                limit = int(value) if value not in (None, "") else None
            except Exception as e:  # noqa: BLE001 - the check is a refinement, never a failure
                log.info("max.message.bytes of topic %r unknown (%s): not checked", topic, e)
        self._limits[topic] = limit
        return limit

    def _confluent_topic_limit(self, topic: str) -> int | None:
        from conveyor.sinks import kafka_confluent as rd

        c = self.config
        try:
            if self._admin is None:
                from confluent_kafka.admin import AdminClient

                self._admin = AdminClient(rd.admin_config(c))
            return rd.topic_limit(self._admin, topic, min(c.request_timeout_ms, 10_000) / 1000)
        except Exception as e:  # noqa: BLE001 - the check is a refinement, never a failure
            log.info("max.message.bytes of topic %r unknown (%s): not checked", topic, e)
            return None

    def _close_admin(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None and hasattr(admin, "close"):  # librdkafka's has no close()
            try:
                admin.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("error closing admin client", exc_info=True)

    def too_large(self, topic: str, msg: dict[str, Any]) -> str | None:
        """Why the broker would refuse this record for its size, checked before sending.

        The broker compares a record batch with the topic's ``max.message.bytes``; one
        record alone in a batch is estimated the way kafka-python sizes it (an upper bound).
        With compression the batch may be smaller than that: not checked (the broker still
        refuses it after the batch went out). Under fail_fast only (one DescribeConfigs per
        topic); the other policies learn of the refusal from the broker, for that row."""
        if not self.fail_fast or self.config.compression != "none":
            return None
        limit = self.topic_limit(topic)
        if limit is None:
            return None
        from kafka.record.default_records import DefaultRecordBatchBuilder

        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(
            msg["key"], msg["value"], msg["headers"]
        )
        if size <= limit:
            return None
        return (
            f"record too large: {size} bytes as a record batch, above max.message.bytes {limit} "
            f"of topic {topic!r} (the broker would refuse it)"
        )

    def _drop_producer(self) -> None:
        p, self._producer = self._producer, None
        self._partitions.clear()
        self._limits.clear()
        self._close_admin()
        if p is not None:
            # Records still buffered after a failure are abandoned: the batch is retried.
            close_producer(p, timeout=0, quiet=True)

    def cleanup_sink(self) -> None:
        if self._txn is not None:
            self._txn.close()
        p, self._producer = self._producer, None
        self._partitions.clear()
        self._limits.clear()
        self._close_admin()
        if p is not None:
            close_producer(p, timeout=5)

    # -- writing ------------------------------------------------------------------------

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

    def _sizes_to_check(self, out: Outgoing) -> bool:
        """Whether a row may be above its topic's ``max.message.bytes`` (``too_large``
        checks each row then): False when even the batch's largest key, value and headers
        together fit every topic's limit, the usual case, so no row is sized one by one."""
        if not self.fail_fast or self.config.compression != "none":
            return False
        limits = [self.topic_limit(t) for t in set(out.topics) if isinstance(t, str)]
        known = [limit for limit in limits if limit is not None]
        if not known:
            return False
        return out.largest_record() > min(known)

    def send_batch(self, batch: pa.Table) -> SendResult:
        if batch.num_rows == 0:
            return SendResult(rows=0)
        if self.config.delivery == "exactly_once" and self._txn is not None:
            return self._send_in_transaction(batch)
        return self._send(batch)

    def _send(self, batch: pa.Table, *, in_transaction: bool = False) -> SendResult:
        """Produce the batch's rows; the rows refused or not delivered are its failures. In a
        transaction the commit flushes, and a record not delivered aborts the whole batch."""
        if self._producer is None:
            self._producer = self._connect()
        out = self.outgoing(batch)
        refused = self._refused(out)  # rows that are not produced, in order
        n = batch.num_rows
        if self.fail_fast and refused:
            n = min(refused)  # nothing after the first refused row is produced
            refused = {n: refused[n]}
        rows = [i for i in range(n) if i not in refused] if refused else range(n)
        self._check_partitions(out, rows)
        failures: list[RowFailure] = []
        self._futures = []
        produced = 0
        while rows:
            sent, error = self._produce(out, rows)
            produced += sent
            if error is None:
                break
            index, e = error
            topic = out.topics[index]
            if classify_kafka_error(e) is not ErrorKind.DATA:
                self._drop_producer()
                raise self._error(e, f"producing to {topic!r} failed") from None
            failures.append(RowFailure(index, _describe(e)))
            if self.fail_fast:
                refused = {}  # the rows after this one are not produced either
                break
            rows = rows[sent + 1 :]
        failures.extend(refused.values())
        if in_transaction:
            return SendResult(rows=batch.num_rows, failed=tuple(sorted(failures, key=_index)))
        self._flush()
        unacked: list[tuple[int, BaseException | None]] = []
        for index, exc in self._not_acknowledged():
            if exc is not None and classify_kafka_error(exc) is ErrorKind.DATA:
                failures.append(RowFailure(index, _describe(exc)))
                continue
            unacked.append((index, exc))
        if unacked:
            self._drop_producer()
            first = next((e for _, e in unacked if e is not None), None)
            permanent = first is not None and classify_kafka_error(first) is ErrorKind.PERMANENT
            if len(unacked) == produced or permanent:
                if first is None:
                    raise TransientSinkError("Kafka did not acknowledge every record of the batch")
                raise self._error(first, "Kafka did not acknowledge the batch")
            # A partial acknowledgement: only the records not acknowledged are sent again.
            failures.extend(
                RowFailure(
                    i, _describe(e) if e is not None else "not acknowledged", ErrorKind.TRANSIENT
                )
                for i, e in unacked
            )
        failures.sort(key=lambda f: f.index)
        return SendResult(rows=batch.num_rows, failed=tuple(failures))

    def _refused(self, out: Outgoing) -> dict[int, RowFailure]:
        """The rows refused before producing: no legal topic, or (``fail_fast``) above
        their topic's size limit."""
        refused = {
            i: RowFailure(i, str(t))
            for i, t in enumerate(out.topics)
            if isinstance(t, templates.TemplateError)
        }
        if self._sizes_to_check(out):
            for i, topic in enumerate(out.topics):
                if isinstance(topic, str):
                    reason = self.too_large(topic, out.message(i))
                    if reason is not None:
                        refused[i] = RowFailure(i, reason)
        return dict(sorted(refused.items()))

    def _check_partitions(self, out: Outgoing, rows: Sequence[int]) -> None:
        """With ``partitioning: source``, the target topics have the partitions of the
        rows to produce (checked before any is produced)."""
        if self.config.partitioning != "source":
            return
        wanted: dict[str, set[int]] = {}
        for i in rows:
            topic, partition = out.topics[i], out.partitions[i]
            if isinstance(topic, str) and partition is not None:
                wanted.setdefault(topic, set()).add(partition)
        for topic, needed in wanted.items():
            parts = self._topic_partitions(topic)
            missing = sorted(needed - parts)
            if missing:
                raise PermanentSinkError(
                    f"topic {topic!r} has {len(parts)} partition(s); partitioning: source "
                    f"needs partition {missing[0]}"
                )

    def _produce(
        self, out: Outgoing, rows: Sequence[int]
    ) -> tuple[int, tuple[int, Exception] | None]:
        """Produce ``rows`` in order: how many were produced, and the row whose produce
        call raised (nothing after it is produced), if one did."""
        from conveyor.sinks.kafka_confluent import ConfluentProducer

        if isinstance(self._producer, ConfluentProducer):
            return self._producer.send_rows(out, rows)
        sent = 0
        for i in rows:
            try:
                self._futures.append((i, self._producer.send(out.topics[i], **out.message(i))))
            except Exception as e:  # noqa: BLE001 - the caller classifies it
                return sent, (i, e)
            sent += 1
        return sent, None

    def _not_acknowledged(self) -> list[tuple[int, BaseException | None]]:
        """After the flush: the rows produced in this batch that were not acknowledged, with
        their error (None: no report, kafka-python's future not done)."""
        from conveyor.sinks.kafka_confluent import ConfluentProducer

        if isinstance(self._producer, ConfluentProducer):
            return sorted(self._producer.take_failures(), key=lambda f: f[0])
        futures, self._futures = self._futures, []
        return [
            (i, fut.exception if fut.is_done else None) for i, fut in futures if not fut.succeeded()
        ]

    def _flush(self) -> None:
        # delivery_timeout_ms already bounds every record; the margin only covers the flush call.
        timeout = self.config.delivery_timeout_ms / 1000 + 5
        try:
            self._producer.flush(timeout=timeout)
        except Exception as e:  # noqa: BLE001 - classified
            self._drop_producer()
            raise self._error(e, f"flushing to {self.config.bootstrap_servers} failed") from None
