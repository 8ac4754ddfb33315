"""Sink registry: sink types by name, imported lazily.

Adding a sink = one module under ``conveyor/sinks/`` defining a ``SinkConfig``
subclass and a ``Sink`` subclass (with ``config_class``), plus one entry in
``_SINKS`` below. Importing a sink module must not import its client library.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from conveyor.core.errors import ConfigError
from conveyor.secrets import has_reference
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


def sink_types() -> list[str]:
    return sorted(_SINKS)


def canonical_type(name: str) -> str:
    """The registered name for ``name`` (aliases resolved), or ConfigError with a did-you-mean."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _SINKS:
        return key
    close = difflib.get_close_matches(key, list(_SINKS) + list(_ALIASES), n=1, cutoff=0.5)
    hint = f"; did you mean {_ALIASES.get(close[0], close[0])!r}?" if close else ""
    raise ConfigError(
        f"unknown sink type {name!r}{hint} (known: {', '.join(sink_types())})", field="sink.type"
    )


def sink_class(name: str) -> type[Sink]:
    key = canonical_type(name)
    module_name, _, attr = _SINKS[key].partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except ImportError as e:
        raise ConfigError(
            f"sink type {key!r} cannot be loaded ({e}); install its extra: pip install 'conveyor[{key}]'",
            field="sink.type",
        ) from None


def parse_sink_config(raw: Mapping[str, Any]) -> SinkConfig:
    """Validate a raw sink mapping (with ``type``) into that sink's config model."""
    if "type" not in raw:
        raise ConfigError("missing field 'type'", field="sink.type")
    data = dict(raw)
    data["type"] = canonical_type(str(data["type"]))
    cls = sink_class(data["type"]).config_class
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix="sink")) from None


def build_sink(config: SinkConfig | Mapping[str, Any]) -> Sink:
    """A sink instance for a config (validated first when given as a mapping)."""
    if not isinstance(config, SinkConfig):
        config = parse_sink_config(config)
    sink = sink_class(config.type)(config)
    sink.validate()
    return sink


def format_validation_error(e: ValidationError, *, prefix: str = "") -> str:
    """One line per problem, each naming the field path, never echoing secret input."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        path = ".".join(p for p in (prefix, loc) if p)
        msg = err.get("msg")
        value = err.get("input")
        if isinstance(value, str) and has_reference(value):
            msg = (
                f"{msg}; a ${{env:...}} / ${{file:...}} reference is resolved only inside the run, "
                "so it can stand only in a text field"
            )
        lines.append(f"{path or '<root>'}: {msg}")
    return "; ".join(lines)
