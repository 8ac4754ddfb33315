"""Source registry: source types by name, imported lazily (like ``conveyor.sinks``).

Adding a source = one module under ``conveyor/sources/`` defining a ``SourceConfig``
subclass and a ``Source`` subclass (with ``config_class``), plus one entry in
``_SOURCES`` below. Importing a source module must not import its client library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conveyor.registry import Registry
from conveyor.sources.base import Source, SourceConfig

_SOURCES: dict[str, str] = {
    "postgres_polling": "conveyor.sources.postgres_polling:PostgresPollingSource",
    "postgres_cdc": "conveyor.sources.postgres_cdc:PostgresCDCSource",
    "webhook": "conveyor.sources.webhook:WebhookSource",
    "mqtt": "conveyor.sources.mqtt:MQTTSource",
}

_ALIASES: dict[str, str] = {
    "postgres": "postgres_polling",
    "pg_polling": "postgres_polling",
    "jdbc": "postgres_polling",
    "pg_cdc": "postgres_cdc",
    "cdc": "postgres_cdc",
    "http": "webhook",
}


REGISTRY: Registry[Source] = Registry("source", _SOURCES, _ALIASES)


def source_types() -> list[str]:
    return REGISTRY.types()


def canonical_type(name: str) -> str:
    """The registered name for ``name`` (aliases resolved), or ConfigError with a did-you-mean."""
    return REGISTRY.canonical_type(name)


def source_class(name: str) -> type[Source]:
    return REGISTRY.load(name)


def parse_source_config(raw: Mapping[str, Any]) -> SourceConfig:
    """Validate a raw source mapping (with ``type``) into that source's config model."""
    config: SourceConfig = REGISTRY.parse_config(raw)
    return config


def build_source(config: SourceConfig | Mapping[str, Any]) -> Source:
    """A source instance for a config (validated first when given as a mapping)."""
    if not isinstance(config, SourceConfig):
        config = parse_source_config(config)
    source = source_class(config.type)(config)
    source.validate()
    return source
