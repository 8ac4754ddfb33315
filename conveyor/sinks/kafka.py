"""Kafka sink: each row becomes one record on a target topic.

The target topic is a ``${...}`` template (or the row's ``__destination``). The
message key, headers and source timestamp are kept. A batch is acknowledged when
``flush()`` returned and every record's future succeeded at ``acks=all``.

Two clients, ``sink.client``: ``confluent`` (librdkafka, ``conveyor.sinks.kafka_confluent``:
delivery reports settle the futures) and ``kafka-python`` (``KafkaProducer``). Only
producing, flushing, acknowledging and the topic-limit lookup differ; the records, the
routing and the failure semantics below are the same for both.

Beside this module: the records (``kafka_records``), the connections (``kafka_producers``),
the size limits (``kafka_limits``) and exactly once (``kafka_transactions``).

Kafka is append-only: a replayed batch is written again (at-least-once). The
idempotent producer only removes duplicates of the producer's own internal retries
within one producer session, not replays by the runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from conveyor.brokers.connection import (
    classify_kafka_error,
    close_producer,
    describe_kafka_error,
)
from conveyor.core.errors import PermanentSinkError, TransientSinkError
from conveyor.core.model import Offsets, TopicPartition
from conveyor.core.positions import StoredPositions, TargetBinding
from conveyor.core.sink import ErrorKind
from conveyor.sinks import templates
from conveyor.sinks.base import (
    Record,
    RowFailure,
    SendResult,
    Sink,
    batch_offsets,
    require,
    unseen_mask,
)
from conveyor.sinks.kafka_config import (
    CODEC_MODULES,
    KafkaSinkConfig,
    codec_available,
    topic_name_problem,
)
from conveyor.sinks.kafka_config import (
    template_problems as template_problems,  # the RabbitMQ sink's and the tests' import
)
from conveyor.sinks.kafka_limits import TopicLimits, may_exceed, record_too_large
from conveyor.sinks.kafka_producers import (
    kafka_sink_error,
    open_producer,
    producer_config,
    producer_kwargs,
)
from conveyor.sinks.kafka_records import KafkaRecords, Outgoing, epoch_ms, timestamp_ms

if TYPE_CHECKING:
    from conveyor.sinks.kafka_transactions import Transactions

__all__ = [
    "KafkaSink",
    "KafkaSinkConfig",
    "Outgoing",
    "classify_kafka_error",
    "codec_available",
    "epoch_ms",
    "producer_kwargs",
    "template_problems",
    "timestamp_ms",
    "topic_name_problem",
]

log = logging.getLogger("conveyor.sinks.kafka")


def _describe(exc: BaseException) -> str:
    return describe_kafka_error(exc)


def _index(f: RowFailure) -> int:
    return f.index


class KafkaSink(Sink):
    """Produces each row, flushes, then checks every record's acknowledgement."""

    config_class = KafkaSinkConfig
    config: KafkaSinkConfig

    def __init__(self, config: KafkaSinkConfig):
        super().__init__(config)
        self._producer: Any = None
        self._futures: list[tuple[int, Any]] = []  # kafka-python: each produced row's future
        self._partitions: dict[str, set[int]] = {}
        self._limits = TopicLimits(config)  # read under fail_fast, on first use
        self._records = KafkaRecords(config)
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
        producer, held = open_producer(self.config, self._txn)
        if self._txn is not None:
            self._held = held
        return producer

    # -- exactly once (``conveyor.sinks.kafka_transactions``) -----------------------------

    def bind(self, binding: TargetBinding) -> None:
        """With delivery exactly_once: this run's transactional producer, started now (older
        producers of the id are fenced before the run reads where to start)."""
        if self.config.delivery != "exactly_once":
            return
        from conveyor.sinks.kafka_transactions import Transactions

        conf = producer_config(self.config)
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
        from conveyor.sinks.kafka_transactions import move_offsets

        move_offsets(
            producer_config(self.config),
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
        return kafka_sink_error(exc, context)

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

    # -- size limits (``conveyor.sinks.kafka_limits``) ---------------------------------------

    def topic_limit(self, topic: str) -> int | None:
        """The topic's ``max.message.bytes`` (DescribeConfigs, once per topic), or None when
        the cluster does not say (no permission, an old broker): then only the producer's
        ``max_request_size`` is checked before sending."""
        return self._limits.limit(topic, self._producer)

    def _sizes_checked(self) -> bool:
        """Under fail_fast only (one DescribeConfigs per topic); the other policies learn of
        a refusal from the broker, for that row. With compression the batch may be smaller
        than the estimate: not checked (the broker still refuses it after it went out)."""
        return self.fail_fast and self.config.compression == "none"

    def too_large(self, topic: str, msg: dict[str, Any]) -> str | None:
        """Why the broker would refuse this record for its size, checked before sending
        (``kafka_limits.record_too_large``)."""
        if not self._sizes_checked():
            return None
        return record_too_large(topic, msg, self.topic_limit(topic))

    def _sizes_to_check(self, out: Outgoing) -> bool:
        """Whether a row may be above its topic's ``max.message.bytes`` (``too_large``
        checks each row then)."""
        if not self._sizes_checked():
            return False
        return may_exceed(out, [self.topic_limit(t) for t in set(out.topics) if isinstance(t, str)])

    def _drop_producer(self) -> None:
        p, self._producer = self._producer, None
        self._partitions.clear()
        self._limits.clear()
        if p is not None:
            # Records still buffered after a failure are abandoned: the batch is retried.
            close_producer(p, timeout=0, quiet=True)

    def cleanup_sink(self) -> None:
        if self._txn is not None:
            self._txn.close()
        p, self._producer = self._producer, None
        self._partitions.clear()
        self._limits.clear()
        if p is not None:
            close_producer(p, timeout=5)

    # -- writing (the records: ``conveyor.sinks.kafka_records``) ---------------------------

    def target_topic(self, r: Record) -> str:
        """The topic a row goes to; templates.TemplateError when the row cannot say."""
        return self._records.target_topic(r)

    def message(self, r: Record) -> dict[str, Any]:
        """The keyword arguments of ``producer.send`` for a row (topic excluded)."""
        return self._records.message(r)

    def outgoing(self, batch: pa.Table) -> Outgoing:
        """Every row's target topic (or why it has none) and record (``KafkaRecords``)."""
        return self._records.outgoing(batch)

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
