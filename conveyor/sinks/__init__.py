"""Sink registry: sink types by name, imported lazily.

Adding a sink = one module under ``conveyor/sinks/`` defining a ``SinkConfig``
subclass and a ``Sink`` subclass (with ``config_class``), plus one entry in
``_SINKS`` below. Importing a sink module must not import its client library.
"""

from __future__ import annotations

from conveyor.core.registry import Registry
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
    "iceberg": "conveyor.sinks.iceberg:IcebergSink",
    "delta": "conveyor.sinks.delta:DeltaSink",
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
    "pyiceberg": "iceberg",
    "deltalake": "delta",
    "delta_lake": "delta",
}


REGISTRY: Registry[Sink, SinkConfig] = Registry("sink", _SINKS, _ALIASES, SinkConfig)

sink_types = REGISTRY.types
canonical_type = REGISTRY.canonical_type  # aliases resolved, or ConfigError with a did-you-mean
sink_class = REGISTRY.load
parse_sink_config = REGISTRY.parse_config  # a raw mapping (with ``type``) -> that sink's config
build_sink = REGISTRY.build  # a sink for a config (a mapping is validated first)
