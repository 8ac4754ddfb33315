"""Source registry: source types by name, imported lazily (like ``conveyor.sinks``).

Adding a source = one module under ``conveyor/sources/`` defining a ``SourceConfig``
subclass and a ``Source`` subclass (with ``config_class``), plus one entry in
``_SOURCES`` below. Importing a source module must not import its client library.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from conveyor.core.errors import ConfigError
from conveyor.sinks import format_validation_error
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


def source_types() -> list[str]:
    return sorted(_SOURCES)


def canonical_type(name: str) -> str:
    """The registered name for ``name`` (aliases resolved), or ConfigError with a did-you-mean."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _SOURCES:
        return key
    close = difflib.get_close_matches(key, list(_SOURCES) + list(_ALIASES), n=1, cutoff=0.5)
    hint = f"; did you mean {_ALIASES.get(close[0], close[0])!r}?" if close else ""
    raise ConfigError(
        f"unknown source type {name!r}{hint} (known: {', '.join(source_types())})",
        field="source.type",
    )


def source_class(name: str) -> type[Source]:
    key = canonical_type(name)
    module_name, _, attr = _SOURCES[key].partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]
    except ImportError as e:
        raise ConfigError(
            f"source type {key!r} cannot be loaded ({e}); install its extra: pip install 'conveyor[{key}]'",
            field="source.type",
        ) from None


def parse_source_config(raw: Mapping[str, Any]) -> SourceConfig:
    """Validate a raw source mapping (with ``type``) into that source's config model."""
    if "type" not in raw:
        raise ConfigError("missing field 'type'", field="source.type")
    data = dict(raw)
    data["type"] = canonical_type(str(data["type"]))
    cls = source_class(data["type"]).config_class
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix="source")) from None


def build_source(config: SourceConfig | Mapping[str, Any]) -> Source:
    """A source instance for a config (validated first when given as a mapping)."""
    if not isinstance(config, SourceConfig):
        config = parse_source_config(config)
    source = source_class(config.type)(config)
    source.validate()
    return source
