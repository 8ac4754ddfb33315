"""Connector operations, shared by the CLI and the REST API: one place for each.

Every operation works on the meta store and the connector spec files; none talks to
Dagster except through the reload hook (a new or changed file must reach the code
location). Errors are typed so that each front end maps them once:

- ``NotFoundError``: no such connector (HTTP 404);
- ``ConflictError``: the connector's state forbids it (running, not stopped, declared
  in a file this process must not write) (HTTP 409);
- ``InvalidRequestError`` and ``ConfigError``: the input is wrong, the message names the
  field (HTTP 400).

Everything returned is safe to show: specs are redacted (``LoadedSpec.display``),
secrets never leave the file they are written in.
"""

from __future__ import annotations

import datetime as dt
import errno
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.config.specs import (
    LoadedSpec,
    claims_of,
    connectors_dir,
    dead_letter_conflicts,
    from_mapping,
    load_path,
    load_source,
    resolved,
    resource_owners,
    sync_one,
    write_spec_file,
)
from conveyor.control.metrics import destinations_json, row_head
from conveyor.core.errors import ConfigError, ConveyorError
from conveyor.core.model import ConnectorStatus, DesiredState, TopicPartition
from conveyor.core.secrets import has_reference
from conveyor.core.state import StateChange
from conveyor.store.meta import (
    LIVE_STATUSES,
    ConnectorRow,
    MetaStore,
    NotStoppedError,
    UnknownConnectorError,
    offsets_editable,
)


class NotFoundError(ConveyorError):
    """No connector of that name."""


class ConflictError(ConveyorError):
    """The connector's state (or where its spec lives) forbids the operation."""


class InvalidRequestError(ConveyorError):
    """The request itself is malformed; the message says where."""


# Kafka Connect's connector and task states, from Conveyor's statuses.
KAFKA_CONNECT_STATE = {
    ConnectorStatus.IDLE: "UNASSIGNED",
    ConnectorStatus.RUNNING: "RUNNING",
    ConnectorStatus.DEGRADED: "RUNNING",
    ConnectorStatus.PAUSED: "PAUSED",
    ConnectorStatus.STOPPED: "STOPPED",
    ConnectorStatus.ERROR: "FAILED",
}
COMPONENT_FILES = ("defs.yaml", "defs.yml")
OFFSETS_ALTERED = "The offsets for this connector have been altered successfully"
OFFSETS_RESET = "The offsets for this connector have been reset successfully"


@dataclass
class Operations:
    """The operations on one meta store and connectors directory.

    ``specs_changed(reason)`` is called after a spec file was written or removed (the API
    reloads the Dagster code location there; the CLI leaves it to the scheduler).
    ``actor`` ends up in the connector's history ("stopped from the CLI").
    """

    store: MetaStore
    directory: Path = field(default_factory=connectors_dir)
    specs_changed: Callable[[str], None] | None = None
    actor: str = "the CLI"

    # -- reading ------------------------------------------------------------------------

    def row(self, name: str) -> ConnectorRow:
        try:
            return self.store.get(name)
        except UnknownConnectorError:
            raise NotFoundError(f"connector {name!r} not found") from None

    def names(self) -> list[str]:
        return [r.name for r in self.store.list()]

    def rows(self) -> list[ConnectorRow]:
        return self.store.list()

    def config(self, name: str) -> dict[str, Any]:
        """The spec as written, secrets redacted (the current file; the stored copy if it is gone)."""
        row = self.row(name)
        loaded = load_source(name, row.spec_source)
        if loaded.ok and loaded.display() is not None:
            return loaded.display() or {}
        return row.spec or {}

    def info(self, name: str) -> dict[str, Any]:
        """Kafka Connect's connector info: name, config, tasks, type."""
        row = self.row(name)
        return {
            "name": name,
            "config": self.config(name),
            "tasks": [{"connector": name, "task": 0}],
            "type": connector_kind(row),
            "spec_source": row.spec_source,
        }

    def status(self, name: str) -> dict[str, Any]:
        """Kafka Connect's status (connector, one task per run, trace of the last error) plus
        Conveyor's own view under ``conveyor``. A connector run as partition tasks lists
        its tasks (RUNNING while heartbeating)."""
        status = status_of(self.row(name))
        tasks = self.tasks(name)
        if tasks:
            timeout = float((self.row(name).spec or {}).get("heartbeat_timeout_s", 30.0))
            status["tasks"] = [
                {
                    "id": t["task"],
                    "state": "RUNNING"
                    if t["heartbeat_age_s"] is not None and t["heartbeat_age_s"] < timeout
                    else "UNASSIGNED",
                    "worker_id": t["broker"] or "-",
                }
                for t in tasks
            ]
        return status

    def summary(self, name: str) -> dict[str, Any]:
        return row_summary(self.row(name))

    def history(self, name: str, limit: int = 30) -> list[dict[str, Any]]:
        self.row(name)
        return [
            {
                "at": h.at,
                "at_iso": _iso(h.at),
                "from": h.from_status,
                "to": h.to_status,
                "generation": h.generation,
                "run_id": h.run_id,
                "reason": h.reason,
            }
            for h in self.store.history(name, limit)
        ]

    def tasks(self, name: str) -> list[dict[str, Any]]:
        """A connector's partition tasks (``tasks.max > 1``): partitions, rate and lag of each."""
        import time

        from conveyor.store.tasks import TaskStore

        self.row(name)
        now = time.time()
        out = []
        for t in TaskStore(self.store).tasks(name):
            latest = t.latest()
            out.append(
                {
                    "task": t.task_id,
                    "status": t.status,
                    "broker": t.broker_id,
                    "generation": t.generation,
                    "run_id": t.run_id,
                    "heartbeat_age_s": None
                    if t.heartbeat_at is None
                    else round(now - t.heartbeat_at, 1),
                    "partitions": [str(tp) for tp in sorted(t.partitions)],
                    "releasing": {str(tp): to for tp, to in sorted(t.releasing.items())},
                    "incoming": [str(tp) for tp in sorted(t.incoming)],
                    "msgs_per_s": round(latest.rate, 1) if latest else None,
                    "lag": latest.lag if latest else None,
                    "by_partition": {
                        str(tp): {
                            "msgs_per_s": round(latest.rates.get(tp, 0.0), 1),
                            "lag": latest.lags.get(tp),
                        }
                        for tp in sorted(set(t.owned) | t.partitions)  # with those moving out
                    }
                    if latest
                    else {},
                }
            )
        return out

    def offsets(self, name: str) -> dict[str, Any]:
        """KIP-875: ``{"offsets": [{"partition": {...}, "offset": {"kafka_offset": n}}]}``,
        the next offset to read per partition."""
        self.row(name)
        return {
            "offsets": [
                {
                    "partition": {"kafka_topic": tp.topic, "kafka_partition": tp.partition},
                    "offset": {"kafka_offset": off},
                }
                for tp, off in sorted(self.store.committed_offsets(name).items())
            ]
        }

    def destination(self, name: str) -> dict[str, Any]:
        """Where the connector writes: the sink, its Dagster asset, and delivery counters."""
        row = self.row(name)
        loaded = load_source(name, row.spec_source)
        sink = (self.config(name) or {}).get("sink") or {}
        counters = row.counters
        return {
            "name": name,
            "type": sink.get("type"),
            "asset_key": "/".join(loaded.sink.asset_key_path()) if loaded.sink else None,
            "config": sink,
            "delivered": counters.get("messages_out", 0),
            "failed": counters.get("failed", 0),
            "dead_lettered": counters.get("dead_lettered", 0),
            "msgs_per_s": counters.get("msgs_per_s", 0.0),
            "lag": counters.get("lag"),
            "routed": bool(
                any("__destination" in s for s in (loaded.spec.transform.select or []))
                if loaded.spec
                else False
            ),
        }

    def reset_source_state(self, name: str) -> dict[str, Any]:
        """Forget a STOPPED source connector's state: it reads from the beginning again."""
        row = self.row(name)
        self._require_stopped(row)
        with _found(name):
            existed = self.store.reset_source_state(
                name, reason=f"source state reset from {self.actor}"
            )
        return {"name": name, "reset": existed}

    def abandon_batch(self, name: str) -> dict[str, Any]:
        """Ask a STOPPED source connector's next run to skip its first batch (data loss, on purpose)."""
        row = self.row(name)
        if connector_kind(row) != "source":
            raise ConflictError(
                f"{name} is a sink connector; abandon-batch is for source connectors"
            )
        self._require_stopped(row)
        self.store.request_abandon(name)
        return {"name": name, "abandon_requested": True}

    def destinations(self, name: str) -> dict[str, Any]:
        """A source connector's destinations: produced count, breaker, failures, last error;
        and its routing totals (rejected by reason, unmatched by action)."""
        row = self.row(name)
        routing = row.counters.get("routing") or {}
        info = self.store.source_state_info(name)
        return {
            "name": name,
            "kind": connector_kind(row),
            "destinations": destinations_json(row.counters),
            "routed": routing.get("routed", 0),
            "destinations_active": routing.get("destinations_active", 0),
            "rejected": routing.get("rejected", {}),
            "unmatched": routing.get("unmatched", {}),
            "open_breakers": routing.get("open_breakers", 0),
            "commit_failures_in_row": row.counters.get("commit_failures_in_row", 0),
            "state": (info or {}).get("state"),
            "abandon_requested": bool((info or {}).get("abandon_requested")),
            "last_abandon_at": (info or {}).get("last_abandon_at"),
        }

    # -- specs ----------------------------------------------------------------------------

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
        with _found(name):  # deleted between the write and the sync: it stays deleted
            sync_one(self.store, written)
        self._changed(f"{'created' if created else 'updated'} connector {name}")
        return self.info(name), created

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
        if declared is not None:
            if not self._ours(declared):
                raise ConflictError(
                    f"connector {name!r} is declared in {declared}; remove it there, then delete it here"
                )
            try:
                declared.unlink(missing_ok=True)
            except OSError as e:
                raise ConflictError(f"cannot remove {declared}: {e.strerror}") from None
        self.store.delete(name)
        self._changed(f"deleted connector {name}")
        return kept

    def _changed(self, reason: str) -> None:
        if self.specs_changed is not None:
            self.specs_changed(reason)

    # -- state ------------------------------------------------------------------------------

    def start(self, name: str) -> ConnectorRow:
        """Desired running; the scheduler launches it (a stopped or failed one starts afresh)."""
        with _found(name):
            return self.store.set_desired(
                name, DesiredState.RUNNING, reason=f"started from {self.actor}"
            )

    def resume(self, name: str) -> ConnectorRow:
        """A paused connector reads again (within a second: its run polls while paused)."""
        with _found(name):
            return self.store.set_desired(
                name, DesiredState.RUNNING, reason=f"resumed from {self.actor}"
            )

    def pause(self, name: str) -> ConnectorRow:
        """Desired paused: the run keeps its assignment and heartbeats, and reads nothing.

        Nothing is fenced (the run and its tasks keep their generations and learn it from
        their heartbeat's answer); the write checks in its transaction that the connector
        still exists, so a pause never recreates a deleted one."""
        with _found(name):
            return self.store.set_desired(
                name, DesiredState.PAUSED, reason=f"paused from {self.actor}"
            )

    def stop(self, name: str) -> ConnectorRow:
        """Desired stopped, fenced in one transaction (``MetaStore.stop``): a live run stops
        itself at its next heartbeat; anything else, partition tasks included, is Stopped
        at once with its generation bumped."""
        with _found(name):
            return self.store.stop(name, reason=f"stopped from {self.actor}")

    def restart(self, name: str) -> ConnectorRow:
        """Fence the current run; the scheduler launches a fresh one."""
        self.row(name)
        reason = f"restart from {self.actor}"
        self.store.set_desired(name, DesiredState.RUNNING, reason=reason)
        return self.store.apply(name, None, StateChange.reset(), reason) or self.row(name)

    # -- offsets (KIP-875) --------------------------------------------------------------------

    def alter_offsets(self, name: str, body: Any) -> dict[str, str]:
        """PATCH: set (or with ``"offset": null`` forget) the given partitions; stopped only."""
        row = self.row(name)
        offsets, forget = parse_kip875(body, topics=_topics(row))
        self._require_stopped(row)
        reason = f"offsets altered from {self.actor}"
        with _found(name):
            self._move_target_offsets(row, offsets, forget=forget, reason=reason)
            self.store.reset_offsets(name, offsets, forget=forget, reason=reason)
        return {"message": OFFSETS_ALTERED}

    def reset_offsets(self, name: str) -> dict[str, str]:
        """DELETE: forget every offset; the connector starts over from ``source.start_from``."""
        row = self.row(name)
        self._require_stopped(row)
        reason = f"offsets reset from {self.actor}"
        with _found(name):
            self._move_target_offsets(row, {}, replace=True, reason=reason)
            self.store.reset_offsets(name, {}, replace=True, reason=reason)
        return {"message": OFFSETS_RESET}

    def reset_offsets_to(
        self,
        name: str,
        to: str | None = None,
        *,
        to_datetime: str | None = None,
        from_group: str | None = None,
    ) -> dict[TopicPartition, int]:
        """The CLI's ``--to earliest|latest|TOPIC:PARTITION:OFFSET[,...]``, ``--to-datetime TIME``
        or ``--from-group GROUP`` (all but explicit offsets ask Kafka, through the connector's
        own source connection: TLS, SASL)."""
        row = self.row(name)
        self._require_stopped(row)
        given = [v for v in (to, to_datetime, from_group) if v]
        if len(given) != 1:
            raise InvalidRequestError("give exactly one of --to, --to-datetime and --from-group")
        if to is not None and to not in ("earliest", "latest"):
            new = {}
            for item in to.split(","):
                try:
                    topic, part, off = item.rsplit(":", 2)
                    new[TopicPartition(topic, int(part))] = int(off)
                except ValueError:
                    raise InvalidRequestError(f"{item!r} is not TOPIC:PARTITION:OFFSET") from None
        else:
            new = self._offsets_from_kafka(row, to or to_datetime, from_group)
        reason = f"offsets reset from {self.actor}"
        with _found(name):
            self._move_target_offsets(row, new, reason=reason)
            self.store.reset_offsets(name, new, reason=reason)
        return new

    def _offsets_from_kafka(
        self, row: ConnectorRow, at: str | None, from_group: str | None
    ) -> dict[TopicPartition, int]:
        """Each partition's offset at ``at`` (earliest, latest, a time), or group ``from_group``'s."""
        from conveyor.brokers.kafka import KafkaSource, source_time

        if at not in (None, "earliest", "latest"):
            source_time(at)  # a bad time is a config error before anything connects
        loaded = load_source(row.name, row.spec_source)
        if not loaded.ok:
            raise ConfigError(str(loaded.error))
        live = resolved(loaded)  # the source may need a secret (SASL) to connect
        assert live.spec is not None
        source = KafkaSource(live.spec.source, group_id=row.name)
        try:
            source.open(self.store.committed_offsets(row.name), wait_for_topics_s=5)
            if from_group is None:
                return source.offsets_at(at or "earliest")
            new = source.group_offsets(from_group)
            if not new:
                raise InvalidRequestError(
                    f"consumer group {from_group!r} has no committed offsets for {row.name}'s topics"
                )
            return new
        finally:
            source.close()

    def _require_stopped(self, row: ConnectorRow) -> None:
        if not offsets_editable(row):
            raise ConflictError(
                f"connector {row.name!r} is {row.status.value} (desired {row.desired.value}); "
                "offsets can be changed only when it is stopped: stop it first"
            )

    def _move_target_offsets(
        self,
        row: ConnectorRow,
        offsets: dict[TopicPartition, int],
        *,
        forget: list[TopicPartition] | None = None,
        replace: bool = False,
        reason: str,
    ) -> None:
        """A connector whose target keeps its offsets (exactly once; they win over the meta
        store's on start): the change made in the target first, fenced (``fence_writers``
        raises every writer's generation; the target refuses an older run from then on),
        then by the caller in the meta store, its mirror. A crash between the two leaves the
        target's value, which wins on start. ConflictError when the sink cannot move them or
        a run started meanwhile; nothing is changed in the meta store then."""
        loaded = load_source(row.name, row.spec_source)
        if not (loaded.ok and loaded.sink is not None and loaded.sink.offsets_in_target()):
            return
        from conveyor.core.errors import FencedError, PermanentSinkError
        from conveyor.core.sink import OffsetsInTarget
        from conveyor.sinks import build_sink

        live = resolved(loaded)  # holds secrets: used to connect, never shown
        assert live.sink is not None
        sink = build_sink(live.sink)
        if not isinstance(sink, OffsetsInTarget):
            raise ConflictError(f"connector {row.name!r}: sink {sink.describe()} keeps no offsets")
        generations = self.store.fence_writers(row.name, reason=reason)
        try:
            sink.move_target_offsets(
                row.name, generations, offsets, forget=forget or [], replace=replace
            )
        except FencedError as e:
            raise ConflictError(f"connector {row.name!r}: {e}") from None
        except PermanentSinkError as e:
            raise ConflictError(
                f"connector {row.name!r} keeps its offsets in its target (sink "
                f"{loaded.sink.type}, delivery {getattr(loaded.sink, 'delivery', 'exactly_once')}), "
                f"which win over the meta store's on start, and they could not be moved there: "
                f"{e} (docs/OPERATIONS.md, 'Exactly once and offsets')"
            ) from None

    # -- dead letters ---------------------------------------------------------------------------

    def dead_letter_store(self, name: str) -> tuple[LoadedSpec, Any]:
        """The connector's spec and its Parquet dead-letter store (ConflictError for Kafka)."""
        from conveyor.dagster.resources.conveyor import default_spark_remote
        from conveyor.spark.deadletters import SparkParquetDeadLetters, dead_letter_location
        from conveyor.spark.session import spark_session

        row = self.row(name)
        loaded = load_source(name, row.spec_source)
        if not loaded.ok or loaded.spec is None:
            raise ConflictError(f"{name} has an invalid spec: {loaded.error}")
        if loaded.spec.failure.dead_letter.store != "parquet":
            raise ConflictError(
                f"{name} dead-letters to the Kafka topic {name}.dlq; read it with any Kafka consumer"
            )
        broker = self.store.get_broker(row.broker_id) if row.broker_id else None
        remote = broker.spark_remote if broker else default_spark_remote()
        session: dict[str, Any] = {}

        def spark() -> Any:
            if "s" not in session:
                session["s"] = spark_session(remote)
            return session["s"]

        return loaded, SparkParquetDeadLetters(
            dead_letter_location(loaded.spec), spark, connector=name
        )

    def dead_letters(self, name: str, limit: int = 20) -> dict[str, Any]:
        """Pending dead letters: count and the oldest ``limit`` with their errors."""
        from conveyor.spark.deadletters import dlq_topic, sample_rows

        row = self.row(name)
        failure = (row.spec or {}).get("failure") or {}
        store_kind = (failure.get("dead_letter") or {}).get("store", "parquet")
        dead_by_run = row.counters.get("dead_lettered", 0)
        if failure.get("policy") != "dead_letter":
            return {"name": name, "policy": failure.get("policy", "fail"), "store": None}
        if store_kind == "kafka":
            return {
                "name": name,
                "policy": "dead_letter",
                "store": "kafka",
                "topic": dlq_topic(name),
                "dead_lettered_by_current_run": dead_by_run,
            }
        _, dl = self.dead_letter_store(name)
        rows = sample_rows(dl.pending(limit=limit), n=limit)
        return {
            "name": name,
            "policy": "dead_letter",
            "store": "parquet",
            "pending": dl.count(),
            "dead_lettered_by_current_run": dead_by_run,
            "letters": rows,
        }


def parse_kip875(
    body: Any, *, topics: set[str] | None = None
) -> tuple[dict[TopicPartition, int], list[TopicPartition]]:
    """KIP-875's request body for a sink connector -> (offsets to set, partitions to forget)."""
    if not isinstance(body, Mapping) or not isinstance(body.get("offsets"), list):
        raise InvalidRequestError(
            'expected {"offsets": [{"partition": {"kafka_topic": ..., "kafka_partition": ...}, '
            '"offset": {"kafka_offset": ...}}, ...]}'
        )
    if not body["offsets"]:
        raise InvalidRequestError("offsets: the list is empty")
    offsets: dict[TopicPartition, int] = {}
    forget: list[TopicPartition] = []
    for i, item in enumerate(body["offsets"]):
        where = f"offsets[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"{where}: expected an object")
        part = item.get("partition")
        if not isinstance(part, Mapping):
            raise InvalidRequestError(f"{where}.partition: expected an object")
        topic, p = part.get("kafka_topic"), part.get("kafka_partition")
        if not isinstance(topic, str) or not topic:
            raise InvalidRequestError(f"{where}.partition.kafka_topic: expected a topic name")
        if topics is not None and topic not in topics:
            raise InvalidRequestError(
                f"{where}.partition.kafka_topic: the connector does not read topic {topic!r} "
                f"(it reads {', '.join(sorted(topics))})"
            )
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise InvalidRequestError(
                f"{where}.partition.kafka_partition: expected a partition number >= 0"
            )
        tp = TopicPartition(topic, p)
        if tp in offsets or tp in forget:
            raise InvalidRequestError(f"{where}: partition {tp} is given twice")
        if "offset" not in item:
            raise InvalidRequestError(f"{where}.offset: missing (an object, or null to reset)")
        off = item["offset"]
        if off is None:
            forget.append(tp)
            continue
        if not isinstance(off, Mapping):
            raise InvalidRequestError(f"{where}.offset: expected an object or null")
        value = off.get("kafka_offset")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequestError(
                f"{where}.offset.kafka_offset: expected the next offset to read, an integer >= 0"
            )
        offsets[tp] = value
    return offsets, forget


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


@contextmanager
def _found(name: str) -> Iterator[None]:
    """The store's refusals as the front ends' errors: a connector deleted meanwhile is
    not found (404), one that is not stopped is a conflict (409)."""
    try:
        yield
    except UnknownConnectorError:
        raise NotFoundError(f"connector {name!r} not found") from None
    except NotStoppedError as e:
        raise ConflictError(str(e)) from None


def _topics(row: ConnectorRow) -> set[str] | None:
    topics = ((row.spec or {}).get("source") or {}).get("topics")
    return set(topics) if isinstance(topics, list) and topics else None


def _iso(ts: float | None) -> str | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat()


def row_summary(r: ConnectorRow) -> dict[str, Any]:
    """One connector's state as the CLI's ``--json`` and the API's ``conveyor`` section show it."""
    return {
        **row_head(r),
        "run_id": r.run_id,
        "heartbeat_at": r.heartbeat_at,
        "counters": r.counters,
        "last_error": r.last_error,
        "spec_source": r.spec_source,
        "spec_error": r.spec_error,
        "kind": connector_kind(r),
    }


def connector_kind(r: ConnectorRow) -> str:
    """``source`` for a source connector (its stored spec says ``kind: source``), else ``sink``."""
    return "source" if (r.spec or {}).get("kind") == "source" else "sink"


def status_of(r: ConnectorRow, now: float | None = None) -> dict[str, Any]:
    import time

    now = time.time() if now is None else now
    state = KAFKA_CONNECT_STATE[r.status]
    worker = r.broker_id or "-"
    trace = r.last_error or r.spec_error
    task: dict[str, Any] = {"id": 0, "state": state, "worker_id": worker}
    connector: dict[str, Any] = {"state": state, "worker_id": worker}
    if trace:
        task["trace"] = trace
        if r.status == ConnectorStatus.ERROR:
            connector["trace"] = trace
    counters = r.counters
    return {
        "name": r.name,
        "connector": connector,
        "tasks": [task] if r.run_id or r.status != ConnectorStatus.STOPPED else [],
        "type": connector_kind(r),
        "conveyor": {
            **row_summary(r),
            "status_since": _iso(r.status_since),
            "heartbeat_age_s": None if r.heartbeat_at is None else round(now - r.heartbeat_at, 3),
            "lag": counters.get("lag"),
            "msgs_per_s": counters.get("msgs_per_s", 0.0),
            "delivered": counters.get("messages_out", 0),
            "restarts": r.restarts,
        },
    }


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
