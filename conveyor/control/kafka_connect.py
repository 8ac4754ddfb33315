"""Kafka Connect's REST answers that are more than one operation: what the REST API gives
third-party Kafka Connect clients beyond ``conveyor.control.operations``.

- ``validate``: ``PUT /connector-plugins/{type}/config/validate``, Kafka Connect's
  ``ConfigInfos`` shape (``name``, ``error_count``, ``groups``, ``configs[]`` of
  ``definition`` and ``value`` with its ``errors``). Secret values are never echoed.
- ``active_topics`` / ``reset_active_topics``: KIP-558. A sink connector's active topics are
  the topics it has read (committed offsets), a source connector's the topics it has
  written (its destinations); a reset empties the set: a topic is active again once the
  connector moves on it (an offset or a produced count changes). The reset's baseline is a
  file in ``$CONVEYOR_HOME/active-topics``.
- ``restart_plan``: ``POST /connectors/{name}/restart?includeTasks=&onlyFailed=`` (KIP-745):
  whether to restart, given the connector's and its tasks' states.
"""

from __future__ import annotations

import json
import os
import re
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr

from conveyor.config.specs import model_secret_paths, secret_fields
from conveyor.control.metrics import destinations_json
from conveyor.control.operations import Operations, connector_kind
from conveyor.core.errors import ConfigError, ConveyorError
from conveyor.core.host.home import conveyor_home
from conveyor.core.trust.secrets import MASK
from conveyor.store.meta import ConnectorRow

# One problem per "field: message" part of a validation message (they are joined by "; ").
_PART = re.compile(r";\s+(?=[A-Za-z_<][\w.\[\]<>-]*: )")
_FIELD = re.compile(r"^([A-Za-z_<][\w.\[\]<>-]*): (.*)$", re.DOTALL)
_KC_TYPES = {str: "STRING", int: "INT", float: "DOUBLE", bool: "BOOLEAN", SecretStr: "PASSWORD"}


# -- config/validate -------------------------------------------------------------------------


def plugin_kind(plugin: str, config: dict[str, Any]) -> str:
    """``sink`` or ``source``: the config's ``kind``, else what the plugin's name is."""
    from conveyor.sinks import canonical_type as sink_type
    from conveyor.sources import canonical_type as source_type

    if config.get("kind") == "source":
        return "source"
    try:
        sink_type(plugin)
        return "sink"
    except ConfigError:
        try:
            source_type(plugin)
        except ConfigError:
            sink_type(plugin)  # unknown: the sinks' did-you-mean
        return "source"


def validate(ops: Operations, plugin: str, config: Any) -> dict[str, Any]:
    """Kafka Connect's answer to ``config/validate`` for a Conveyor spec of plugin ``plugin``."""
    if not isinstance(config, dict):
        raise ConfigError(f"expected the connector spec as an object, got {type(config).__name__}")
    kind = plugin_kind(plugin, config)
    data = {**config, "name": config.get("name") or "validate"}
    section = dict(data.get(kind) or {}) if isinstance(data.get(kind), dict) else {}
    section.setdefault("type", plugin)
    data[kind] = section
    problems: list[tuple[str, str]] = []
    model: type[BaseModel] | None = None
    try:
        loaded = ops.validate(None, data)
        config = loaded.sink if kind == "sink" else loaded.source_config
        model = type(config) if config is not None else None
    except ConveyorError as e:
        problems = split_problems(str(e))
    if model is None:
        model = _model_of(kind, str(section["type"]))
    secrets = _secret_names(kind, model)
    configs = _definitions(kind, model, section, secrets)
    _attach(configs, problems, data, secrets)
    groups = list(dict.fromkeys(c["definition"]["group"] for c in configs))
    return {
        "name": plugin,
        "error_count": sum(len(c["value"]["errors"]) for c in configs),
        "groups": groups,
        "configs": configs,
    }


def split_problems(message: str) -> list[tuple[str, str]]:
    """``"sink.table: x; batch.max_records: y"`` -> ``[("sink.table", "x"), ...]``."""
    message = message.removeprefix("<request>: ")
    out = []
    for part in _PART.split(message):
        m = _FIELD.match(part.strip())
        out.append((m.group(1), m.group(2)) if m else ("<root>", part.strip()))
    return out


def _model_of(kind: str, type_name: str) -> type[BaseModel] | None:
    from conveyor.sinks import sink_class
    from conveyor.sources import source_class

    try:
        cls = sink_class(type_name) if kind == "sink" else source_class(type_name)
    except ConfigError:
        return None
    model: type[BaseModel] = cls.config_class
    return model


def _secret_names(kind: str, model: type[BaseModel] | None) -> set[str]:
    """The spec's secret paths with the plugin's section's."""
    own = {f"{kind}.{p}" for p in model_secret_paths(model)} if model is not None else set()
    return secret_fields(None, None) | own


def _definitions(
    kind: str, model: type[BaseModel] | None, section: dict[str, Any], secrets: set[str]
) -> list[dict[str, Any]]:
    """One entry per field of the plugin's config model, in its order."""
    if model is None:
        return []
    out = []
    for order, (name, f) in enumerate(model.model_fields.items(), start=1):
        key = f.alias or name
        path = f"{kind}.{key}"
        required = f.is_required()
        default = None if required or f.default is None else _text(f.default)
        out.append(
            {
                "definition": {
                    "name": path,
                    "type": _kc_type(f.annotation),
                    "required": required,
                    "default_value": default,
                    "importance": "HIGH" if required else "MEDIUM",
                    "documentation": f.description or "",
                    "group": kind,
                    "width": "NONE",
                    "display_name": key,
                    "dependents": [],
                    "order": order,
                },
                "value": _value(path, section.get(key, section.get(name)), secrets),
            }
        )
    return out


def _attach(
    configs: list[dict[str, Any]],
    problems: list[tuple[str, str]],
    data: dict[str, Any],
    secrets: set[str],
) -> None:
    """Each problem to its field's entry (an entry of its own for a field outside the model)."""
    by_name = {c["value"]["name"]: c for c in configs}
    for path, message in problems:
        entry = by_name.get(path)
        if entry is None:
            entry = {
                "definition": {
                    "name": path,
                    "type": "STRING",
                    "required": False,
                    "default_value": None,
                    "importance": "MEDIUM",
                    "documentation": "",
                    "group": "Common" if "." not in path else path.split(".", 1)[0],
                    "width": "NONE",
                    "display_name": path,
                    "dependents": [],
                    "order": len(configs) + 1,
                },
                "value": _value(path, _lookup(data, path), secrets),
            }
            configs.append(entry)
            by_name[path] = entry
        entry["value"]["errors"].append(message)


def _value(path: str, value: Any, secrets: set[str]) -> dict[str, Any]:
    shown = None if value is None else (MASK if path in secrets else _text(value))
    return {
        "name": path,
        "value": shown,
        "recommended_values": [],
        "errors": [],
        "visible": True,
    }


def _lookup(data: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if hasattr(value, "value"):  # an enum
        return str(value.value)
    return json.dumps(value, default=str)


def _kc_type(annotation: Any) -> str:
    kinds = typing.get_args(annotation) or (annotation,)
    for k in kinds:
        if k in _KC_TYPES:
            return _KC_TYPES[k]
        if typing.get_origin(k) in (list, tuple):
            return "LIST"
    return "STRING"


# -- active topics (KIP-558) -----------------------------------------------------------------


def _positions(ops: Operations, row: ConnectorRow) -> dict[str, dict[str, Any]]:
    """Per topic, what moves when the connector uses it: offsets read, or counts produced."""
    out: dict[str, dict[str, Any]] = {}
    if connector_kind(row) == "source":
        for topic, info in destinations_json(row.counters).items():
            produced = info.get("produced") if isinstance(info, dict) else info
            out.setdefault(str(topic), {})["produced"] = produced
        return out
    for tp, offset in ops.store.committed_offsets(row.name).items():
        out.setdefault(tp.topic, {})[str(tp.partition)] = offset
    return out


def _baseline_file(name: str) -> Path:
    return conveyor_home() / "active-topics" / f"{name}.json"


def _baseline(row: ConnectorRow) -> dict[str, dict[str, Any]]:
    path = _baseline_file(row.name)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict) or saved.get("created_at") != row.created_at:
        return {}  # a reset of an earlier connector of that name
    topics = saved.get("topics")
    return topics if isinstance(topics, dict) else {}


def active_topics(ops: Operations, name: str) -> dict[str, Any]:
    """``{name: {"topics": [...]}}``: the topics used since creation or the last reset."""
    row = ops.row(name)
    base = _baseline(row)
    topics = sorted(t for t, pos in _positions(ops, row).items() if base.get(t) != pos)
    return {name: {"topics": topics}}


def reset_active_topics(ops: Operations, name: str) -> None:
    """Empty the connector's active topics (its positions now become the baseline)."""
    row = ops.row(name)
    path = _baseline_file(name)
    body = {"created_at": row.created_at, "topics": _positions(ops, row)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)
    except OSError as e:
        raise ConveyorError(f"cannot record the topics reset in {path.parent}: {e.strerror}") from e
    ops.store.record(name, f"active topics reset from {ops.actor}")


# -- restart (KIP-745) ---------------------------------------------------------------------


def restart_plan(status: dict[str, Any], include_tasks: bool, only_failed: bool) -> bool:
    """Whether ``restart?includeTasks&onlyFailed`` restarts anything, given Kafka Connect's
    status of the connector. Conveyor restarts a connector with its tasks (one run), so a
    restart of any instance is a restart of the connector."""
    if not only_failed:
        return True
    if status["connector"]["state"] == "FAILED":
        return True
    return include_tasks and any(t.get("state") == "FAILED" for t in status.get("tasks", []))


def restarting(status: dict[str, Any]) -> dict[str, Any]:
    """The status a restart answers: the connector and its tasks RESTARTING (one run)."""
    tasks = [{**t, "state": "RESTARTING"} for t in status.get("tasks", [])]
    return {**status, "connector": {**status["connector"], "state": "RESTARTING"}, "tasks": tasks}
