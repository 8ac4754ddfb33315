"""Connector specs: YAML files, validated by pydantic; the one source of truth for a connector's config.

A spec is read from one of two kinds of file:

- a plain spec file in the connectors directory (``$CONVEYOR_CONNECTORS_DIR``, default
  ``$CONVEYOR_HOME/connectors``), ``<name>.yaml``;
- a ``defs.yaml`` of a Dagster components project whose document has
  ``type: conveyor.dagster.components.ConnectorComponent`` and the spec under ``attributes``.

Specs are read where definitions are built (the code location), by the scheduler
sensor (to notice new, changed and removed files), by the API and the CLI, and by a
connector run, which reads its own file and resolves its ``${env:...}`` /
``${file:...}`` references (``resolved``). The meta store gets a copy for display
and change detection: the spec with its secrets redacted (``stored_json``) and a
hash of the spec as written (``spec_hash``), never a secret.

A broken plain file never breaks the others: it becomes a ``LoadedSpec`` with an
error that names the file and the field, and the connector shows ``Error``.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from conveyor.core.connection import SECRET_FIELD, SECRET_FIELDS
from conveyor.core.errors import ConfigError
from conveyor.core.host.home import conveyor_home
from conveyor.core.model import ConnectorSpec
from conveyor.core.planning.state import StateChange
from conveyor.core.registry import format_validation_error
from conveyor.core.source_connector import SourceConnectorSpec, is_source_connector
from conveyor.core.trust import paths, scrubbing
from conveyor.core.trust.secrets import (
    check_placement,
    check_syntax,
    keep_stored_secrets,
    redact,
    resolve,
)
from conveyor.sinks import parse_sink_config, sink_class
from conveyor.sinks.base import SinkConfig
from conveyor.sources.base import SourceConfig
from conveyor.store.meta import ConnectorRow, MetaStore, UnknownConnectorError

COMPONENT_TYPES = (
    "conveyor.dagster.components.ConnectorComponent",
    "conveyor.ConnectorComponent",
)

# Sections a running connector takes on at a batch boundary; a change to anything else
# also changes what the code location shows (jobs, assets, metadata) and reloads it.
LIVE_FIELDS = ("batch", "transform", "retry", "heartbeat_timeout_s", "max_restarts", "desired")


@dataclass(frozen=True)
class LoadedSpec:
    """One connector's spec as written (references unresolved): validated, or the error."""

    name: str
    source: str
    spec: ConnectorSpec | None = None
    sink: SinkConfig | None = None
    error: str | None = None
    raw: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    # A source connector (``kind: source``): its spec and its source's config; ``spec`` and
    # ``sink`` stay None, so code written for sink connectors passes it by.
    source_spec: SourceConnectorSpec | None = None
    source_config: SourceConfig | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def is_source(self) -> bool:
        return self.source_spec is not None

    @property
    def any_spec(self) -> ConnectorSpec | SourceConnectorSpec | None:
        """The validated spec, sink or source connector."""
        return self.spec if self.spec is not None else self.source_spec

    @property
    def is_component(self) -> bool:
        return Path(self.source).name in ("defs.yaml", "defs.yml")

    def spec_hash(self) -> str | None:
        """SHA-256 of the spec as written (canonical JSON); changes with any field, secrets included.

        Stored next to the redacted spec so that a run notices a change it cannot see in
        the redacted copy (a rotated literal password); like Helm's ``checksum/`` annotations.
        """
        if self.raw is None or self.error:
            return None
        canonical = json.dumps(self.raw, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def display(self) -> dict[str, Any] | None:
        """The spec as written (aliases applied), secrets redacted, references shown."""
        if self.any_spec is None or self.raw is None:
            return None
        return redact(self._normalized(), self._secret_field)

    def _normalized(self) -> dict[str, Any]:
        """The fields as written, aliases applied (``url_env`` -> ``url``), secrets as text."""
        if self.source_spec is not None:
            assert self.source_config is not None
            full = _plain(self.source_spec.model_dump(by_alias=True, exclude_unset=True))
            full["kind"] = "source"
            full["source"] = _plain(
                self.source_config.model_dump(by_alias=True, exclude_unset=True)
            )
            full["source"]["type"] = self.source_config.type
            return full
        assert self.spec is not None and self.sink is not None
        full = _plain(self.spec.model_dump(by_alias=True, exclude_unset=True))
        full["sink"] = _plain(self.sink.model_dump(by_alias=True, exclude_unset=True))
        full["sink"]["type"] = self.sink.type
        return full

    def stored_json(self) -> str | None:
        """What the meta store keeps (``spec_json``): ``display()`` as JSON."""
        d = self.display()
        return json.dumps(d, sort_keys=False) if d is not None else None

    def _secret_field(self, path: str) -> bool:
        return path in self.secret_paths()

    def secret_paths(self) -> set[str]:
        """The dotted paths of this spec's secret fields (``secret_fields``)."""
        return secret_fields(self.spec, self.sink, self.source_config)

    def location_fingerprint(self) -> str:
        """What the code location builds from this spec: all but the sections taken on live."""
        d = self.display()
        if d is not None:
            for k in LIVE_FIELDS:
                d.pop(k, None)
        view = {"name": self.name, "source": self.source, "error": self.error, "spec": d}
        return json.dumps(view, sort_keys=True, default=str)


def secret_fields(
    spec: ConnectorSpec | None, sink: SinkConfig | None, source: SourceConfig | None = None
) -> set[str]:
    """Dotted paths of the secret fields (typed ``SecretStr`` or marked ``SECRET_FIELD``): in
    the spec's models and the sink's (or a source connector's source's) model. Only these
    may hold references; they are masked when shown."""
    out = set(model_secret_paths(ConnectorSpec)) | set(model_secret_paths(SourceConnectorSpec))
    if source is not None:
        out |= {f"source.{p}" for p in model_secret_paths(type(source))}
    if sink is not None:
        out |= {f"sink.{p}" for p in model_secret_paths(type(sink))}
    elif spec is not None:
        with contextlib.suppress(ConfigError):
            out |= {
                f"sink.{p}" for p in model_secret_paths(sink_class(spec.sink.type).config_class)
            }
    return out


def model_secret_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """The secret fields of one config model, dotted (nested models included)."""
    out = []
    for name, f in model.model_fields.items():
        key = f.alias or name
        path = f"{prefix}{key}"
        ann = f.annotation
        kinds = get_args(ann) or (ann,)
        if SecretStr in kinds or f.json_schema_extra == SECRET_FIELD:
            out.append(path)
        for k in kinds:
            if isinstance(k, type) and issubclass(k, BaseModel) and k is not model:
                out.extend(model_secret_paths(k, f"{path}."))
    return out


def _plain(value: Any) -> Any:
    """JSON-able copy: secrets unwrapped (redaction decides what is shown), enums by value."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def connectors_dir() -> Path:
    return Path(
        os.environ.get("CONVEYOR_CONNECTORS_DIR") or (conveyor_home() / "connectors")
    ).resolve()


def parse_spec(data: Any, *, source: str = "<spec>") -> tuple[ConnectorSpec, SinkConfig]:
    """Validate one spec mapping; raises ConfigError naming the source and the field.

    References are checked for syntax, not resolved: a reference stands for text.
    """
    return _parse(
        data,
        source,
        ConnectorSpec.model_validate,
        lambda spec: parse_sink_config(spec.sink.model_dump()),
    )


def parse_source_spec(
    data: Any, *, source: str = "<spec>"
) -> tuple[SourceConnectorSpec, SourceConfig]:
    """Validate one source connector's spec mapping; ConfigError naming the source and the field."""
    from conveyor.sources import parse_source_config

    return _parse(
        data,
        source,
        lambda d: SourceConnectorSpec.model_validate({**d, "kind": "source"}),
        lambda spec: parse_source_config(spec.source.model_dump()),
    )


_Spec = TypeVar("_Spec")
_Part = TypeVar("_Part")


def _parse(
    data: Any,
    source: str,
    validate: Callable[[dict[str, Any]], _Spec],
    part: Callable[[_Spec], _Part],
) -> tuple[_Spec, _Part]:
    """The one flow of a sink's and a source's spec: a mapping, references' syntax, the
    spec model (``validate``), then the sink's or source's own config model (``part``);
    every ConfigError names ``source``."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping, got {type(data).__name__}", source=source)
    try:
        check_syntax(data)
    except ConfigError as e:
        raise ConfigError(str(e), source=source) from None
    try:
        spec = validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e), source=source) from None
    try:
        config = part(spec)
    except ConfigError as e:
        raise ConfigError(str(e), source=source) from None
    return spec, config


def from_mapping(data: Any, *, source: str, fallback_name: str) -> LoadedSpec:
    """A LoadedSpec from a parsed spec mapping (a file's content, an API request body).

    Besides the models' rules, first: references only in secret fields, no credential
    written literally in a connection string, no mask (``secrets.check_placement``).
    """
    name = data.get("name", fallback_name) if isinstance(data, dict) else fallback_name
    if not isinstance(name, str):
        name = fallback_name
    try:
        if isinstance(data, dict):
            check_placement(data, declared_secret_paths(data))
    except ConfigError as e:
        return LoadedSpec(name, source, error=str(ConfigError(str(e), source=source)))
    if is_source_connector(data):
        try:
            sspec, sconfig = parse_source_spec(data, source=source)
        except ConfigError as e:
            return LoadedSpec(name, source, error=str(e))
        loaded = LoadedSpec(sspec.name, source, raw=data, source_spec=sspec, source_config=sconfig)
    else:
        try:
            spec, sink = parse_spec(data, source=source)
        except ConfigError as e:
            return LoadedSpec(name, source, error=str(e))
        loaded = LoadedSpec(spec.name, source, spec=spec, sink=sink, raw=data)
    try:  # as validated: aliases applied (url_env -> url)
        check_placement(loaded._normalized(), loaded.secret_paths())
    except ConfigError as e:
        return LoadedSpec(loaded.name, source, error=str(ConfigError(str(e), source=source)))
    return loaded


def declared_secret_paths(data: Mapping[str, Any]) -> set[str]:
    """The secret paths of a spec as written, before it is validated: the spec's own and its
    sink's or source's (by its ``type``; none for an unknown type), under aliases and names."""
    kind = "source" if is_source_connector(data) else "sink"
    out = secret_fields(None, None)
    section = data.get(kind)
    if not isinstance(section, Mapping) or not isinstance(section.get("type"), str):
        return out
    try:
        if kind == "sink":
            model: type[BaseModel] = sink_class(section["type"]).config_class
        else:
            from conveyor.sources import source_class

            model = source_class(section["type"]).config_class
    except ConfigError:
        return out
    secret = set(model_secret_paths(model))
    out |= {f"{kind}.{p}" for p in secret}
    for field_name, f in model.model_fields.items():
        if (f.alias or field_name) in secret:
            out |= {f"{kind}.{field_name}", f"{kind}.{f.alias or field_name}"}
    return out


def keep_stored(config: Any, current: LoadedSpec | None) -> Any:
    """A config sent back with secrets shown as the mask, the stored secrets put back
    (``secrets.keep_stored_secrets``); anything else as it is."""
    if not isinstance(config, Mapping):
        return config
    if current is None or not current.ok or current.any_spec is None:
        return config  # nothing stored: a mask is refused by ``from_mapping``
    return keep_stored_secrets(config, current._normalized(), current.secret_paths())


def _resolved_by_the_kafka_client(field: str) -> bool:
    """A Kafka connection's secret field (source, Kafka sink): it stays a reference, which
    the client resolves at each connection (``brokers.connection``)."""
    section, _, name = field.partition(".")
    return section in ("source", "sink", "kafka") and name in SECRET_FIELDS


def resolved(loaded: LoadedSpec) -> LoadedSpec:
    """The spec with its references resolved and validated again: for the data path only.

    Raises ConfigError (naming the field and the reference) when a secret is missing.
    The result holds secrets: never store, log or show it.
    """
    if not loaded.ok or loaded.any_spec is None:
        raise ConfigError(loaded.error or "no spec", source=loaded.source)
    secrets = loaded.secret_paths()

    def keep(field: str) -> bool:  # only secret fields are resolved
        return field not in secrets or _resolved_by_the_kafka_client(field)

    written = loaded._normalized()
    try:
        data = resolve(written, keep=keep)
    except ConfigError as e:
        raise ConfigError(str(e), source=loaded.source) from None
    try:
        if loaded.is_source:
            sspec, sconfig = parse_source_spec(data, source=loaded.source)
            return LoadedSpec(
                sspec.name, loaded.source, raw=data, source_spec=sspec, source_config=sconfig
            )
        spec, sink = parse_spec(data, source=loaded.source)
    except ConfigError as e:  # a validator may quote the value: never a secret
        raise ConfigError(scrubbing.scrub(str(e))) from None
    return LoadedSpec(spec.name, loaded.source, spec=spec, sink=sink, raw=data)


def load_file(path: Path) -> LoadedSpec:
    """A plain spec file (one connector)."""
    fallback = path.stem.replace("-", "_").lower()
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        return LoadedSpec(fallback, str(path), error=_yaml_error(path, e))
    except OSError as e:
        return LoadedSpec(fallback, str(path), error=f"{path}: cannot read: {e.strerror}")
    return from_mapping(data, source=str(path), fallback_name=fallback)


def load_component_file(path: Path) -> list[LoadedSpec]:
    """The connectors declared in a components ``defs.yaml`` (other documents are skipped)."""
    fallback = path.parent.name.replace("-", "_").lower()
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
    except yaml.YAMLError as e:
        return [LoadedSpec(fallback, str(path), error=_yaml_error(path, e))]
    except OSError as e:
        return [LoadedSpec(fallback, str(path), error=f"{path}: cannot read: {e.strerror}")]
    out = []
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("type") not in COMPONENT_TYPES:
            continue
        out.append(from_mapping(doc.get("attributes"), source=str(path), fallback_name=fallback))
    return out


def load_path(path: Path) -> list[LoadedSpec]:
    """Every connector a file declares: a components ``defs.yaml``, else a plain spec file."""
    if path.name in ("defs.yaml", "defs.yml"):
        return load_component_file(path)
    return [load_file(path)]


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{path}: invalid YAML{where}: {problem}"


def spec_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def component_files(defs_root: Path) -> list[Path]:
    """``defs.yaml`` files under a components project's defs folder that declare connectors."""
    if not defs_root.is_dir():
        return []
    out = []
    for p in sorted(defs_root.rglob("defs.y*ml")):
        try:
            text = p.read_text()
        except OSError:
            continue
        if "ConnectorComponent" in text:
            out.append(p)
    return out


def load_dir(directory: Path | None = None) -> list[LoadedSpec]:
    """Every *.yaml / *.yml file in the directory, sorted by name; duplicates are errors."""
    directory = directory or connectors_dir()
    return dedupe(load_file(f) for f in spec_files(directory))


def scan(directory: Path | None, defs_roots: Iterable[Path] = ()) -> list[LoadedSpec]:
    """A connectors directory (None: none) plus the connectors declared in components projects."""
    found: list[LoadedSpec] = [load_file(f) for f in spec_files(directory)] if directory else []
    for root in defs_roots:
        for f in component_files(root):
            found.extend(load_component_file(f))
    return dedupe(found)


def dedupe(
    specs: Iterable[LoadedSpec], created: Mapping[str, float] | None = None
) -> list[LoadedSpec]:
    """The first definition of a name wins; later ones become errors naming both files. So
    does a connector claiming a resource another one owns (a replication slot): see
    ``resource_owners`` for who owns it (``created``: the meta store's connectors, name ->
    created at)."""
    out: list[LoadedSpec] = []
    seen: dict[str, str] = {}
    for loaded in specs:
        if loaded.name in seen and seen[loaded.name] != loaded.source:
            loaded = LoadedSpec(
                loaded.name,
                loaded.source,
                error=f"{loaded.source}: connector name {loaded.name!r} is already defined in {seen[loaded.name]}",
            )
        else:
            seen.setdefault(loaded.name, loaded.source)
        out.append(loaded)
    owners = resource_owners(out, created)
    places = dead_letter_conflicts(out, created)
    return [_owner_checked(loaded, owners, places) for loaded in out]


def claims_of(loaded: LoadedSpec) -> tuple[str, ...]:
    """The resources only this connector may use (a replication slot), none for a broken spec."""
    config = loaded.source_config if loaded.ok else None
    return config.owned_resources(loaded.name) if config is not None else ()


def resource_owners(
    specs: Iterable[LoadedSpec], created: Mapping[str, float] | None = None
) -> dict[str, str]:
    """Owned resource -> the connector it belongs to, among those claiming it: the one it is
    named after (a slot ``conveyor_<name>``), else the one created first in the meta store
    (``created``), else the first in file order. A newcomer never takes a running
    connector's resource."""
    created = created or {}
    ranked: dict[str, tuple[tuple[int, float, int], str]] = {}
    for index, loaded in enumerate(specs):
        config = loaded.source_config if loaded.ok else None
        own = set(config.named_after(loaded.name)) if config is not None else set()
        for claim in claims_of(loaded):
            age = created.get(loaded.name, float("inf"))
            rank = (0 if claim in own else 1, age, index)
            if claim not in ranked or rank < ranked[claim][0]:
                ranked[claim] = (rank, loaded.name)
    return {claim: name for claim, (_rank, name) in ranked.items()}


def _owner_checked(
    loaded: LoadedSpec, owners: Mapping[str, str], places: Mapping[str, str] | None = None
) -> LoadedSpec:
    """An error when another connector owns a resource this one claims (a slot), or a
    dead-letter place this one's overlaps (``dead_letter_conflicts``)."""
    problem = None
    for claim in claims_of(loaded):
        if owners.get(claim, loaded.name) != loaded.name:
            problem = f"{claim} is already used by connector {owners[claim]!r}"
            break
    problem = problem or (places or {}).get(loaded.name)
    if problem is None:
        return loaded
    return LoadedSpec(loaded.name, loaded.source, error=f"{loaded.source}: {problem}")


def dead_letter_place(loaded: LoadedSpec) -> str | None:
    """The real local directory of a valid sink connector's Parquet dead letters, else None."""
    spec = loaded.spec if loaded.ok else None
    if spec is None or spec.failure.dead_letter.store != "parquet":
        return None
    try:
        return spec.dead_letter_place()
    except ConfigError:
        return None  # refused by the spec's own validation, which reports it


def dead_letter_conflicts(
    specs: Iterable[LoadedSpec], created: Mapping[str, float] | None = None
) -> dict[str, str]:
    """Connector -> why its dead letters may not go where it says: another connector's
    place is the same directory, or one holds the other (a store's datasets would mix). The
    place's owner is ranked as ``resource_owners`` ranks a claim: the connector whose
    default place it is (``dead_letters/<name>``), else the one created first, else the
    first in order."""
    created = created or {}
    ranked = []
    for index, loaded in enumerate(specs):
        place = dead_letter_place(loaded)
        if place is not None:
            default = os.path.join(paths.roots().home, paths.DEAD_LETTERS_DIR, loaded.name)
            own = place == default
            rank = (0 if own else 1, created.get(loaded.name, float("inf")), index)
            ranked.append((rank, loaded.name, place))
    ranked.sort()
    out: dict[str, str] = {}
    for i, (_rank, name, place) in enumerate(ranked):
        for _r, owner, theirs in ranked[:i]:
            if owner != name and os.path.commonpath([place, theirs]) in (place, theirs):
                out[name] = (
                    f"failure.dead_letter.path: the dead-letter place {place} overlaps connector "
                    f"{owner!r}'s ({theirs}): each connector's dead letters need their own directory"
                )
                break
    return out


def load_source(name: str, source: str | None) -> LoadedSpec:
    """The connector ``name`` as its file says now (a run's spec, a replay's, the CLI's)."""
    if not source:
        return LoadedSpec(name, "store", error=f"connector {name!r} has no spec file")
    path = Path(source)
    if not path.exists():
        return LoadedSpec(name, source, error=f"{source}: the spec file was removed")
    for loaded in load_path(path):
        if loaded.name == name:
            return loaded
    return LoadedSpec(name, source, error=f"{source} no longer declares connector {name!r}")


REMOVED = "the spec file was removed"


def sync_one(store: MetaStore, loaded: LoadedSpec) -> ConnectorRow:
    """Write one spec (redacted, with its hash) or its error into the meta store.

    A connector whose file had been removed and is back takes its spec's desired state again
    and resumes from its kept offsets.
    """
    desired = (
        loaded.any_spec.desired
        if loaded.any_spec
        else ConnectorSpec.model_fields["desired"].default
    )
    try:
        before = store.get(loaded.name)
    except UnknownConnectorError:
        before = None
    row = store.sync_spec(
        loaded.name,
        spec_json=loaded.stored_json(),
        spec_hash=loaded.spec_hash(),
        source=loaded.source,
        error=loaded.error,
        desired=desired,
    )
    if before is not None and REMOVED in (before.spec_error or "") and loaded.ok:
        row = store.set_desired(loaded.name, desired, reason=f"spec file {loaded.source} is back")
    return row


def sync_files(store: MetaStore, found: Iterable[LoadedSpec]) -> list[str]:
    """Sync the specs found in files; returns what changed besides unchanged specs, for the log.

    A connector whose spec file is gone (its ``spec_source`` names a file that no longer
    declares it) is stopped with its offsets kept, never deleted: deleting is
    ``conveyor connector delete`` or ``DELETE /connectors/<name>``, which remove the
    file first. Connectors created by an older Conveyor through the CLI (spec only in
    the store) get a file in the connectors directory.
    """
    found = list(found)
    names = {loaded.name for loaded in found}
    notes: list[str] = []
    for loaded in found:
        sync_one(store, loaded)
    for row in store.list():
        if row.name in names:
            continue
        if row.spec_source == "cli" and row.spec_json:
            path = connectors_dir() / f"{row.name}.yaml"
            if not path.exists():
                write_spec_file(path, json.loads(row.spec_json))
                notes.append(f"{row.name}: spec moved from the meta store to {path}")
            continue
        if not row.spec_source or not Path(row.spec_source).is_absolute():
            continue  # not from a file (tests, a store written by hand)
        if REMOVED in (row.spec_error or ""):
            continue
        store.sync_spec(
            row.name,
            spec_json=None,
            spec_hash=None,
            source=row.spec_source,
            error=f"{row.spec_source}: {REMOVED}",
        )
        if row.desired.wants_run:
            store.apply(
                row.name,
                None,
                StateChange.stop(),
                f"{row.spec_source} removed: stopped, offsets kept "
                "(delete the connector to forget them)",
            )
        notes.append(f"{row.name}: spec file {row.spec_source} removed, connector stopped")
    return notes


def write_spec_file(path: Path, data: Mapping[str, Any]) -> None:
    """Write a plain spec file atomically (a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(dict(data), sort_keys=False, allow_unicode=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
