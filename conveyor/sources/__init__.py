"""Source registry: source types by name, imported lazily (like ``conveyor.sinks``).

Adding a source = one module under ``conveyor/sources/`` defining a ``SourceConfig``
subclass and a ``Source`` subclass (with ``config_class``), plus one entry in
``_SOURCES`` below. Importing a source module must not import its client library.
"""

from __future__ import annotations

from conveyor.core.registry import Registry
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


REGISTRY: Registry[Source, SourceConfig] = Registry("source", _SOURCES, _ALIASES, SourceConfig)

source_types = REGISTRY.types
canonical_type = REGISTRY.canonical_type  # aliases resolved, or ConfigError with a did-you-mean
source_class = REGISTRY.load
parse_source_config = REGISTRY.parse_config  # a raw mapping (with ``type``) -> that source's config
build_source = REGISTRY.build  # a source for a config (a mapping is validated first)


def release_source(config: SourceConfig, connector: str) -> None:
    """Drop what a connector's source owns in its system (its replication slot and managed
    publication): the connector is being deleted with an explicit confirmation."""
    source = build_source(config.for_connector(connector))
    try:
        source.release()
    finally:
        source.close()
