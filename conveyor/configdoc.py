"""Generates docs/CONFIG.md from the pydantic models: every field, type, default, description.

``python -m conveyor.configdoc > docs/CONFIG.md``; a test keeps the file in sync.
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel

from conveyor.core.model import (
    BatchPolicy,
    ConnectorSpec,
    DeadLetterSpec,
    FailureSpec,
    RetrySpec,
    SourceSpec,
    TransformSpec,
)
from conveyor.core.model import BATCH_PRESETS

SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("connector", ConnectorSpec),
    ("source", SourceSpec),
    ("batch", BatchPolicy),
    ("transform", TransformSpec),
    ("retry", RetrySpec),
    ("failure", FailureSpec),
    ("failure.dead_letter", DeadLetterSpec),
]


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("conveyor.core.model.", "")


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(built)"
        if isinstance(value, BaseModel):
            return "(section defaults)"
        return f"`{value!r}`"
    d = field.default
    if hasattr(d, "value"):
        d = d.value
    return f"`{d!r}`"


def model_table(model: type[BaseModel]) -> str:
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = field.alias or name
        desc = (field.description or "").replace("|", "\\|")
        typ = _type(field.annotation).replace("|", "or")
        lines.append(f"| `{key}` | {typ} | {_default(field)} | {desc} |")
    return "\n".join(lines)


def sink_tables() -> list[str]:
    from conveyor.sinks import _SINKS, sink_class
    from conveyor.core.errors import ConfigError

    out = []
    for name in sorted(_SINKS):
        try:
            cls = sink_class(name).config_class
        except ConfigError as e:
            out.append(f"### sink `{name}`\n\nnot available: {e}\n")
            continue
        out.append(f"### sink `{name}`\n\n{(cls.__doc__ or '').strip()}\n\n{model_table(cls)}\n")
    return out


def render() -> str:
    parts = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models by `python -m conveyor.configdoc`; do not edit by hand.",
        "",
        "A connector is one YAML file in `$CONVEYOR_CONNECTORS_DIR` (default `.conveyor/connectors`).",
        "Unknown fields are rejected, and every error names the file and the field.",
        "",
        "## Environment",
        "",
        "| variable | meaning | default |",
        "|---|---|---|",
        "| `CONVEYOR_HOME` | state directory (meta store, dead letters, connectors) | `.conveyor` |",
        "| `CONVEYOR_META_URL` | meta store URL (`postgresql://...` in production) | SQLite `$CONVEYOR_HOME/meta.db` |",
        "| `CONVEYOR_CONNECTORS_DIR` | connector spec directory | `$CONVEYOR_HOME/connectors` |",
        "| `CONVEYOR_BROKERS_FILE` | broker executors YAML | `$CONVEYOR_HOME/brokers.yaml` (else one broker `local`) |",
        "| `CONVEYOR_KAFKA_BOOTSTRAP` | default bootstrap servers | `127.0.0.1:9092` |",
        "| `CONVEYOR_SPARK_REMOTE` | Spark Connect endpoint of the default broker | `sc://127.0.0.1:15002` |",
        "",
    ]
    for title, model in SECTIONS:
        parts += [f"## `{title}`", "", (model.__doc__ or "").strip(), "", model_table(model), ""]
    parts += ["Batch presets (`batch: {preset: NAME}` or `batch: NAME`):", ""]
    parts += [f"- `{k}`: {v}" for k, v in BATCH_PRESETS.items()]
    parts += ["", "## Sinks", ""] + sink_tables()
    return "\n".join(parts).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
