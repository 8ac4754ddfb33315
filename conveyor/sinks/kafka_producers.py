"""The Kafka sink's connections: a producer of either client (``sink.client``) built from
the config, TLS checked before connecting, errors classified; with exactly once, the
transactional producer started (older producers of its id fenced)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.brokers.connection import (
    classify_kafka_error,
    describe_kafka_error,
    kafka_python_options,
    tls_handshake_options,
    tls_problem,
)
from conveyor.core.errors import ConfigError, PermanentSinkError
from conveyor.core.positions import StoredPositions
from conveyor.core.sink import sink_error
from conveyor.sinks.kafka_config import KafkaSinkConfig

if TYPE_CHECKING:
    from conveyor.sinks.kafka_transactions import Transactions


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


def kafka_sink_error(exc: BaseException, context: str) -> Exception:
    """The sink's error for a client exception; a data error outside a row (e.g. a codec the
    broker refuses) is the config's fault."""
    return sink_error(classify_kafka_error(exc), f"{context}: {describe_kafka_error(exc)}")


def open_producer(
    c: KafkaSinkConfig, txn: Transactions | None = None
) -> tuple[Any, StoredPositions | None]:
    """A connected producer of ``c.client``, and (with ``txn``: exactly once, confluent only)
    the positions the target's group held when its transactions started."""
    if c.client == "confluent":
        return _open_confluent(c, txn)
    from kafka import KafkaProducer

    try:
        kwargs = producer_kwargs(c)
    except ConfigError as e:
        raise PermanentSinkError(str(e)) from None
    problem = tls_problem(kwargs)
    if problem:
        raise PermanentSinkError(f"cannot connect to Kafka at {c.bootstrap_servers}: {problem}")
    try:
        return KafkaProducer(**kwargs), None
    except Exception as e:  # noqa: BLE001 - classified below
        raise kafka_sink_error(e, f"cannot connect to Kafka at {c.bootstrap_servers}") from None


def _open_confluent(
    c: KafkaSinkConfig, txn: Transactions | None
) -> tuple[Any, StoredPositions | None]:
    from conveyor.sinks import kafka_confluent as rd

    try:
        conf = rd.producer_config(c)
        problem = tls_problem(tls_handshake_options(c, "producer", prefix="sink"))
    except ConfigError as e:
        raise PermanentSinkError(str(e)) from None
    if problem:
        raise PermanentSinkError(f"cannot connect to Kafka at {c.bootstrap_servers}: {problem}")
    if txn is not None:
        conf = {**conf, **txn.producer_conf()}
    try:
        producer = rd.ConfluentProducer(c, conf)
        producer.bootstrap(c.connect_timeout_ms / 1000)
    except Exception as e:  # noqa: BLE001 - classified below
        raise kafka_sink_error(e, f"cannot connect to Kafka at {c.bootstrap_servers}") from None
    held = None
    if txn is not None:
        try:
            held = txn.start(producer.client)
        except BaseException:
            producer.close(timeout=0)
            raise
    return producer, held


def producer_config(c: KafkaSinkConfig) -> dict[str, Any]:
    """librdkafka's producer settings for ``c`` (a config error is the sink's permanent one)."""
    from conveyor.sinks import kafka_confluent as rd

    try:
        return rd.producer_config(c)
    except ConfigError as e:
        raise PermanentSinkError(str(e)) from None
