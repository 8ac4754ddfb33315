"""Connector specs: YAML files in the connectors directory, validated by pydantic.

A broken file never breaks the others: it becomes a ``LoadedSpec`` with an
error that names the file and the field, and the connector shows ``Error``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from conveyor.core.errors import ConfigError
from conveyor.core.model import ConnectorSpec
from conveyor.sinks import format_validation_error, parse_sink_config
from conveyor.sinks.base import SinkConfig
from conveyor.store.meta import MetaStore, conveyor_home


@dataclass(frozen=True)
class LoadedSpec:
    """One spec file: the validated spec and sink config, or the error."""

    name: str
    source: str
    spec: ConnectorSpec | None = None
    sink: SinkConfig | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def spec_json(self) -> str | None:
        return self.spec.model_dump_json(by_alias=True) if self.spec else None

    def spec_hash(self) -> str | None:
        j = self.spec_json()
        return hashlib.sha256(j.encode()).hexdigest() if j else None


def connectors_dir() -> Path:
    return Path(
        os.environ.get("CONVEYOR_CONNECTORS_DIR") or (conveyor_home() / "connectors")
    ).resolve()


def parse_spec(data: Any, *, source: str = "<spec>") -> tuple[ConnectorSpec, SinkConfig]:
    """Validate one spec mapping; raises ConfigError naming the source and the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping, got {type(data).__name__}", source=source)
    try:
        spec = ConnectorSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e), source=source) from None
    try:
        sink = parse_sink_config(spec.sink.model_dump())
    except ConfigError as e:
        raise ConfigError(str(e), source=source) from None
    return spec, sink


def load_file(path: Path) -> LoadedSpec:
    fallback = path.stem.replace("-", "_").lower()
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        return LoadedSpec(fallback, str(path), error=f"{path}: invalid YAML{where}: {problem}")
    except OSError as e:
        return LoadedSpec(fallback, str(path), error=f"{path}: cannot read: {e.strerror}")
    name = data.get("name", fallback) if isinstance(data, dict) else fallback
    if not isinstance(name, str):
        name = fallback
    try:
        spec, sink = parse_spec(data, source=str(path))
    except ConfigError as e:
        return LoadedSpec(name, str(path), error=str(e))
    return LoadedSpec(spec.name, str(path), spec=spec, sink=sink)


def load_dir(directory: Path | None = None) -> list[LoadedSpec]:
    """Every *.yaml / *.yml file in the directory, sorted by name; duplicates are errors."""
    directory = directory or connectors_dir()
    if not directory.is_dir():
        return []
    files = sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    out: list[LoadedSpec] = []
    seen: dict[str, str] = {}
    for f in files:
        ls = load_file(f)
        if ls.name in seen:
            ls = LoadedSpec(
                ls.name,
                ls.source,
                error=f"{f}: connector name {ls.name!r} is already defined in {seen[ls.name]}",
            )
        else:
            seen[ls.name] = ls.source
        out.append(ls)
    return out


def from_store_row(
    name: str, spec_json: str | None, source: str | None, error: str | None
) -> LoadedSpec:
    if error or not spec_json:
        return LoadedSpec(name, source or "store", error=error or "no spec stored")
    try:
        spec, sink = parse_spec(json.loads(spec_json), source=source or "store")
    except ConfigError as e:
        return LoadedSpec(name, source or "store", error=str(e))
    return LoadedSpec(name, source or "store", spec=spec, sink=sink)


def sync(store: MetaStore, specs: Iterable[LoadedSpec]) -> None:
    """Write every spec (or its error) into the meta store; runtime state is kept."""
    for ls in specs:
        store.sync_spec(
            ls.name,
            spec_json=ls.spec_json(),
            spec_hash=ls.spec_hash(),
            source=ls.source,
            error=ls.error,
            desired=ls.spec.desired if ls.spec else ConnectorSpec.model_fields["desired"].default,
        )


def all_specs(store: MetaStore | None, directory: Path | None = None) -> list[LoadedSpec]:
    """Specs from the directory, plus connectors created through the CLI (kept in the store)."""
    files = load_dir(directory)
    names = {s.name for s in files}
    extra: list[LoadedSpec] = []
    if store is not None:
        for row in store.list():
            if row.name not in names and row.spec_source == "cli":
                extra.append(
                    from_store_row(row.name, row.spec_json, row.spec_source, row.spec_error)
                )
    return files + extra
