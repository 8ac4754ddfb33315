"""Sink registry: sink types by name, imported lazily.

Adding a sink = one module under ``conveyor/sinks/`` defining a ``SinkConfig``
subclass and a ``Sink`` subclass (with ``config_class``), plus one entry in
``_SINKS`` below. Importing a sink module must not import its client library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conveyor.registry import Registry
from conveyor.sinks.base import Sink, SinkConfig

_SINKS: dict[str, str] = {
    "localfile": "conveyor.sinks.localfile:LocalFileSink",
    "postgres": "conveyor.sinks.postgres:PostgresSink",
    "mysql": "conveyor.sinks.mysql:MySQLSink",
    "redis": "conveyor.sinks.redis:RedisSink",
    "kafka": "conveyor.sinks.kafka:KafkaSink",
    "rabbitmq": "conveyor.sinks.rabbitmq:RabbitMQSink",
    "mongodb": "conveyor.sinks.mongodb:MongoDBSink",
    "elasticsearch": "conveyor.sinks.elasticsearch:ElasticsearchSink",
    "pulsar": "conveyor.sinks.pulsar:PulsarSink",
    "greptimedb": "conveyor.sinks.greptimedb:GreptimeDBSink",
}

_ALIASES: dict[str, str] = {
    "file": "localfile",
    "jsonl": "localfile",
    "postgresql": "postgres",
    "pg": "postgres",
    "mariadb": "mysql",
    "amqp": "rabbitmq",
    "mongo": "mongodb",
    "es": "elasticsearch",
    "greptime": "greptimedb",
}


REGISTRY: Registry[Sink] = Registry("sink", _SINKS, _ALIASES)


def sink_types() -> list[str]:
    return REGISTRY.types()


def canonical_type(name: str) -> str:
    """The registered name for ``name`` (aliases resolved), or ConfigError with a did-you-mean."""
    return REGISTRY.canonical_type(name)


def sink_class(name: str) -> type[Sink]:
    return REGISTRY.load(name)


def parse_sink_config(raw: Mapping[str, Any]) -> SinkConfig:
    """Validate a raw sink mapping (with ``type``) into that sink's config model."""
    config: SinkConfig = REGISTRY.parse_config(raw)
    return config


def build_sink(config: SinkConfig | Mapping[str, Any]) -> Sink:
    """A sink instance for a config (validated first when given as a mapping)."""
    if not isinstance(config, SinkConfig):
        config = parse_sink_config(config)
    sink = sink_class(config.type)(config)
    sink.validate()
    return sink
