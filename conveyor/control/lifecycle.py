"""A connector's lifecycle: its spec file created, updated or deleted; started, paused, stopped.

A spec arrives as a request body (validated as the file scan validates it) or a file; it
is written to ``<connectors dir>/<name>.yaml`` (created exclusively: of two concurrent
creates of one name exactly one creates it) and synced into the meta store. A delete
removes the file first, then the row. The state commands are the store's fenced writes
(docs/DESIGN.md, "The operator's commands are fenced").
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conveyor.config.specs import (
    LoadedSpec,
    claims_of,
    dead_letter_conflicts,
    from_mapping,
    load_path,
    load_source,
    resolved,
    resource_owners,
    sync_one,
    write_spec_file,
)
from conveyor.control.operation_context import (
    ConflictError,
    InvalidRequestError,
    OperationsPart,
    found,
)
from conveyor.control.reads import ConnectorReads
from conveyor.core.errors import ConfigError
from conveyor.core.model import DesiredState
from conveyor.core.planning.state import StateChange
from conveyor.core.trust.scrubbing import scrub
from conveyor.core.trust.secrets import has_reference
from conveyor.store.meta import LIVE_STATUSES, ConnectorRow, UnknownConnectorError

COMPONENT_FILES = ("defs.yaml", "defs.yml")


class ConnectorLifecycle(OperationsPart):
    """Create, update and delete a connector's spec; start, resume, pause, stop, restart it."""

    def validate(self, name: str | None, config: Any) -> LoadedSpec:
        """A spec from a request body; raises ConfigError / InvalidRequestError naming the field."""
        if not isinstance(config, Mapping):
            raise InvalidRequestError(
                f"the connector config must be a JSON object, got {type(config).__name__}"
            )
        data = dict(config)
        if name is not None:
            given = data.get("name")
            if given is not None and given != name:
                raise InvalidRequestError(
                    f"config.name {given!r} differs from the connector name {name!r} in the path"
                )
            data["name"] = name
        if not isinstance(data.get("name"), str):
            raise InvalidRequestError("missing the connector name (field 'name')")
        loaded = from_mapping(data, source="<request>", fallback_name=str(data["name"]))
        if not loaded.ok:
            raise ConfigError(str(loaded.error).removeprefix("<request>: "))
        if loaded.is_source:
            assert loaded.source_config is not None
            if not has_reference((loaded.display() or {}).get("source")):
                from conveyor.sources import build_source

                build_source(loaded.source_config)  # cross-field rules of the source (no I/O)
            return loaded
        assert loaded.sink is not None
        if not has_reference((loaded.display() or {}).get("sink")):
            # Cross-field rules of the sink (no I/O). With references they wait for the run,
            # where the values are known.
            from conveyor.sinks import build_sink

            build_sink(loaded.sink)
        return loaded

    def put_config(
        self, name: str | None, config: Any, *, create_only: bool = False
    ) -> tuple[dict[str, Any], bool]:
        """Create or update a connector's spec file; returns (info, created).

        The file is ``<connectors dir>/<name>.yaml`` for a new connector, else the plain
        spec file it already has. A connector declared in a components ``defs.yaml`` or
        outside the connectors directory is edited there, not here (ConflictError).
        A new file is created exclusively: of two concurrent creates of one name exactly
        one creates it; with ``create_only`` the other gets ConflictError, else it updates.
        """
        loaded = self.validate(name, config)
        name = loaded.name
        try:
            row: ConnectorRow | None = self.store.get(name)
        except UnknownConnectorError:
            row = None
        if create_only and row is not None:
            raise ConflictError(f"connector {name!r} already exists")
        self._check_owned(loaded, row)
        path = self._writable_file(name, row)
        created = self._write(path, loaded.raw or {}, new=row is None, create_only=create_only)
        written = load_source(name, str(path))
        with found(name):  # deleted between the write and the sync: it stays deleted
            sync_one(self.store, written)
        self.context.notify_specs_changed(f"{'created' if created else 'updated'} connector {name}")
        return ConnectorReads(self.context).info(name), created

    def _check_owned(self, loaded: LoadedSpec, row: ConnectorRow | None) -> None:
        """ConflictError when the spec claims a resource (a replication slot) or a dead-letter
        place that another existing connector holds: the rules the file scan applies
        (``resource_owners``, ``dead_letter_conflicts``)."""
        rows = [r for r in self.store.list() if r.name != loaded.name]
        others = [load_source(r.name, r.spec_source) for r in rows]
        created = {r.name: r.created_at for r in rows}
        if row is not None:  # a newcomer comes after every existing connector
            created[loaded.name] = row.created_at
        owners = resource_owners([*others, loaded], created)
        for claim in claims_of(loaded):
            if owners[claim] != loaded.name:
                raise ConflictError(f"{claim} is used by connector {owners[claim]!r}")
        problem = dead_letter_conflicts([*others, loaded], created).get(loaded.name)
        if problem is not None:
            raise ConflictError(problem)

    def _write(self, path: Path, raw: Mapping[str, Any], *, new: bool, create_only: bool) -> bool:
        """Write the spec file; True when this call created it."""
        try:
            if new and create_spec_file(path, raw):
                return True
            if create_only:
                raise ConflictError(f"connector {path.stem!r} already exists (file {path})")
            write_spec_file(path, raw)
            return False
        except OSError as e:
            raise ConflictError(
                f"cannot write {path}: {e.strerror}; the connectors directory {self.directory} "
                "is read-only here (manage the spec files where they are deployed)"
            ) from None

    def apply_file(self, source: Path) -> tuple[dict[str, Any], bool]:
        """``conveyor connector apply -f``: a spec file copied into the connectors directory."""
        from conveyor.config.specs import load_file

        loaded = load_file(source)
        if not loaded.ok:
            raise ConfigError(str(loaded.error))
        return self.put_config(loaded.name, loaded.raw)

    def _writable_file(self, name: str, row: ConnectorRow | None) -> Path:
        """The plain spec file in the connectors directory that holds (or will hold) the spec."""
        declared = self._declared_in(name, row)
        if declared is None:
            return self.directory / f"{name}.yaml"
        if not self._ours(declared):
            raise ConflictError(f"connector {name!r} is declared in {declared}; change it there")
        return declared

    def _declared_in(self, name: str, row: ConnectorRow | None) -> Path | None:
        """The file that declares the connector now, if any."""
        if row is None or not row.spec_source or not Path(row.spec_source).is_absolute():
            return None
        path = Path(row.spec_source)
        if not path.exists() or all(loaded.name != name for loaded in load_path(path)):
            return None
        return path

    def _ours(self, path: Path) -> bool:
        """A plain spec file in the connectors directory: this process may write and remove it."""
        return (
            path.parent.resolve() == self.directory.resolve() and path.name not in COMPONENT_FILES
        )

    def delete(self, name: str, *, drop_slot: bool = False) -> list[str]:
        """Delete a connector that is not running: its spec file first, then its row and offsets.

        In that order, a scheduler tick in between sees a removed file (and stops the
        connector, keeping its offsets), never a file without a row, which it would
        create again from the beginning of the topic. ``drop_slot``: first drop what its
        source owns (a PostgreSQL replication slot and managed publication). Returns what
        stays in the source's system (without ``drop_slot``: a slot), for a warning.
        """
        row = self.row(name)
        if row.status in LIVE_STATUSES:
            raise ConflictError(
                f"connector {name!r} is {row.status.value}; stop it first (deleting forgets its offsets)"
            )
        loaded = load_source(name, row.spec_source)  # while the spec file says what it owns
        kept: list[str] = []
        if not drop_slot and loaded.source_config is not None:
            kept = list(loaded.source_config.kept_on_delete(name))
        if drop_slot:
            if not loaded.is_source:
                raise ConflictError(f"{name!r} has no source spec: {loaded.error or 'a sink'}")
            from conveyor.sources import release_source

            live = resolved(loaded)
            assert live.source_config is not None
            release_source(live.source_config, name)
        declared = self._declared_in(name, row)
        if declared is not None and not self._ours(declared):
            raise ConflictError(
                f"connector {name!r} is declared in {declared}; remove it there, then delete it here"
            )
        kept += self._retire_target_positions(row, loaded)
        if declared is not None:
            try:
                declared.unlink(missing_ok=True)
            except OSError as e:
                raise ConflictError(f"cannot remove {declared}: {e.strerror}") from None
        self.store.delete(name, kept=kept)
        self.context.notify_specs_changed(f"deleted connector {name}")
        return kept

    def _retire_target_positions(self, row: ConnectorRow, loaded: LoadedSpec) -> list[str]:
        """A deleted connector's positions in its target (exactly once), removed where the
        target can be reached; what stays is listed (it is unusable all the same: a connector
        created again under this name is a new incarnation, ``core/positions.py``)."""
        if not (loaded.ok and loaded.sink is not None and loaded.sink.offsets_in_target()):
            return []
        if row.run_id is None and not self.store.committed_offsets(row.name):
            return []  # never run: its target holds nothing of it
        from conveyor.core.positions import writer_id
        from conveyor.core.sink import OffsetsInTarget
        from conveyor.sinks import build_sink

        try:
            live = resolved(loaded)  # holds secrets: used to connect, never shown
            assert live.sink is not None
            sink = build_sink(live.sink)
            left = None
            if isinstance(sink, OffsetsInTarget):
                left = sink.retire_target_offsets(writer_id(row.name, row.incarnation))
                if left is None and row.legacy_positions:
                    # Migrated and not run since: what it kept under its bare name goes too.
                    left = sink.retire_target_offsets(row.name)
        except Exception as e:  # noqa: BLE001 - reported, the delete goes on
            left = f"{type(e).__name__}: {e}"
        if left is None:
            return []
        return [
            f"positions of incarnation {row.incarnation} in {'/'.join(loaded.sink.asset_key_path())}"
            f" not removed ({scrub(left)}); a connector created again under this name never "
            "uses them"
        ]

    def start(self, name: str) -> ConnectorRow:
        """Desired running; the scheduler launches it (a stopped or failed one starts afresh)."""
        with found(name):
            return self.store.set_desired(
                name, DesiredState.RUNNING, reason=f"started from {self.actor}"
            )

    def resume(self, name: str) -> ConnectorRow:
        """A paused connector reads again (within a second: its run polls while paused)."""
        with found(name):
            return self.store.set_desired(
                name, DesiredState.RUNNING, reason=f"resumed from {self.actor}"
            )

    def pause(self, name: str) -> ConnectorRow:
        """Desired paused: the run keeps its assignment and heartbeats, and reads nothing.

        Nothing is fenced (the run and its tasks keep their generations and learn it from
        their heartbeat's answer); the write checks in its transaction that the connector
        still exists, so a pause never recreates a deleted one."""
        with found(name):
            return self.store.set_desired(
                name, DesiredState.PAUSED, reason=f"paused from {self.actor}"
            )

    def stop(self, name: str) -> ConnectorRow:
        """Desired stopped, fenced in one transaction (``MetaStore.stop``): a live run stops
        itself at its next heartbeat; anything else, partition tasks included, is Stopped
        at once with its generation bumped."""
        with found(name):
            return self.store.stop(name, reason=f"stopped from {self.actor}")

    def restart(self, name: str) -> ConnectorRow:
        """Fence the current run; the scheduler launches a fresh one."""
        self.row(name)
        reason = f"restart from {self.actor}"
        self.store.set_desired(name, DesiredState.RUNNING, reason=reason)
        return self.store.apply(name, None, StateChange.reset(), reason) or self.row(name)


def create_spec_file(path: Path, data: Mapping[str, Any]) -> bool:
    """Create the spec file ``path`` unless one exists (False).

    Written aside, then hard-linked into place, which fails when a file is there: of
    concurrent creators exactly one wins, and no reader sees a partial file. Where hard
    links are not supported, an exclusive open does the same (a reader may then see the
    file while it is written, and reads it again at the next scan)."""
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    write_spec_file(aside, data)
    try:
        os.link(aside, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(aside.read_bytes())
        return True
    finally:
        aside.unlink(missing_ok=True)
