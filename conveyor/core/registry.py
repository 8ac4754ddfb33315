"""Registries of plugins by name (sinks, sources): aliases, "did you mean", lazy imports, config validation.

A registry maps a type name to ``"module:Class"``; the module is imported only when a spec names
its type, so loading the code location never imports a client library it does not use. The class
carries its config model as ``config_class``; a config mapping is validated against it and its
errors name the field under the registry's section (``sink.url``, ``source.table``).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from conveyor.core.errors import ConfigError, FieldRuleError
from conveyor.core.trust.secrets import has_reference

P = TypeVar("P")  # the plugin class: Sink, Source
C = TypeVar("C", bound=BaseModel)  # its config model's base: SinkConfig, SourceConfig


class Registry(Generic[P, C]):
    """Types of one ``kind`` (``sink``, ``source``) by name, imported lazily.

    A registered class has ``config_class`` (its config model, a subclass of ``config_base``)
    and ``validate()`` (the checks that need the environment).
    """

    def __init__(
        self,
        kind: str,
        entries: Mapping[str, str],
        aliases: Mapping[str, str],
        config_base: type[C],
    ):
        self.kind = kind
        self.entries = dict(entries)
        self.aliases = dict(aliases)
        self.config_base = config_base

    def types(self) -> list[str]:
        return sorted(self.entries)

    def canonical_type(self, name: str) -> str:
        """The registered name for ``name`` (aliases resolved), or ConfigError with a did-you-mean."""
        key = name.strip().lower()
        key = self.aliases.get(key, key)
        if key in self.entries:
            return key
        close = difflib.get_close_matches(
            key, list(self.entries) + list(self.aliases), n=1, cutoff=0.5
        )
        hint = f"; did you mean {self.aliases.get(close[0], close[0])!r}?" if close else ""
        raise ConfigError(
            f"unknown {self.kind} type {name!r}{hint} (known: {', '.join(self.types())})",
            field=f"{self.kind}.type",
        )

    def load(self, name: str) -> type[P]:
        """The class registered for ``name``, its module imported now; ConfigError when its
        client library is missing."""
        key = self.canonical_type(name)
        module_name, _, attr = self.entries[key].partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except ImportError as e:
            raise ConfigError(
                f"{self.kind} type {key!r} cannot be loaded ({e}); install its extra: "
                f"pip install 'conveyor[{key}]'",
                field=f"{self.kind}.type",
            ) from None

    def parse_config(self, raw: Mapping[str, Any]) -> C:
        """Validate a raw mapping (with ``type``) into that type's config model."""
        if "type" not in raw:
            raise ConfigError("missing field 'type'", field=f"{self.kind}.type")
        data = dict(raw)
        data["type"] = self.canonical_type(str(data["type"]))
        cls = self.load(data["type"]).config_class  # type: ignore[attr-defined]
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, prefix=self.kind)) from None

    def build(self, config: C | Mapping[str, Any]) -> P:
        """An instance for a config (validated first when given as a mapping), its
        environment checked (``validate()``)."""
        if not isinstance(config, self.config_base):
            config = self.parse_config(config)  # type: ignore[arg-type]
        instance = self.load(config.type)(config)  # type: ignore[attr-defined, call-arg]
        instance.validate()  # type: ignore[attr-defined]
        return instance


def format_validation_error(e: ValidationError, *, prefix: str = "") -> str:
    """One line per problem, each naming the field path, never echoing secret input."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg")
        broken = (err.get("ctx") or {}).get("error")
        if isinstance(broken, FieldRuleError):  # a cross-field rule names its own field
            loc = ".".join(p for p in (loc, broken.field) if p)
            msg = str(broken)
        path = ".".join(p for p in (prefix, loc) if p)
        value = err.get("input")
        if isinstance(value, str) and has_reference(value):
            msg = (
                f"{msg}; a ${{env:...}} / ${{file:...}} reference is resolved only inside the run, "
                "so it can stand only in a text field"
            )
        lines.append(f"{path or '<root>'}: {msg}")
    return "; ".join(lines)
