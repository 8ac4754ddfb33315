"""The Kafka sink's size limits: a topic's ``max.message.bytes`` (DescribeConfigs through
the cluster the producer writes to, once per topic) and a record's size against it, checked
before sending under fail_fast."""

from __future__ import annotations

import logging
from typing import Any

from conveyor.brokers.connection import kafka_python_options
from conveyor.sinks.kafka_config import KafkaSinkConfig
from conveyor.sinks.kafka_records import Outgoing

log = logging.getLogger("conveyor.sinks.kafka")


class TopicLimits:
    """Each topic's ``max.message.bytes`` (None: unknown), read by an admin client opened on
    first use and cached until ``clear``."""

    def __init__(self, config: KafkaSinkConfig):
        self.config = config
        self._limits: dict[str, int | None] = {}  # topic -> max.message.bytes (None: unknown)
        self._admin: Any = None

    def limit(self, topic: str, producer: Any) -> int | None:
        """The topic's ``max.message.bytes`` (DescribeConfigs, once per topic), or None when
        the cluster does not say (no permission, an old broker): then only the producer's
        ``max_request_size`` is checked before sending."""
        if topic in self._limits:
            return self._limits[topic]
        from kafka import KafkaProducer

        from conveyor.sinks.kafka_confluent import ConfluentProducer

        limit: int | None = None
        if isinstance(producer, ConfluentProducer):
            limit = self._confluent_limit(topic)
        elif isinstance(producer, KafkaProducer):  # read through the cluster it writes to
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

    def _confluent_limit(self, topic: str) -> int | None:
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

    def clear(self) -> None:
        """Forget the limits and close the admin client (the producer was dropped)."""
        self._limits.clear()
        admin, self._admin = self._admin, None
        if admin is not None and hasattr(admin, "close"):  # librdkafka's has no close()
            try:
                admin.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("error closing admin client", exc_info=True)


def record_too_large(topic: str, msg: dict[str, Any], limit: int | None) -> str | None:
    """Why the broker would refuse this record (``producer.send``'s keyword arguments) for
    its size against the topic's ``limit`` (None: unknown, not checked), or None.

    The broker compares a record batch with the topic's ``max.message.bytes``; one record
    alone in a batch is estimated the way kafka-python sizes it (an upper bound)."""
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


def may_exceed(out: Outgoing, limits: list[int | None]) -> bool:
    """Whether a row of ``out`` may be above one of its topics' ``limits``: False when even
    the batch's largest key, value and headers together fit every known limit, the usual
    case, so no row is sized one by one."""
    known = [limit for limit in limits if limit is not None]
    if not known:
        return False
    return out.largest_record() > min(known)
