"""The source interface: an external system read into Kafka-protocol topics.

A source connector reads a system (a PostgreSQL table, a replication slot, HTTP
posts, MQTT topics) and produces each message into the topic its routing chooses.
The runtime (``conveyor.core.engine.source_loop``) calls a source from one thread, in
this order::

    validate()                 # once; config only, no I/O; a contradiction is ConfigError
    init(state)                # once; connect; ``state`` is the last persisted one (None: first run)
    poll(state, max_records, max_wait_s)*   # many times
    commit(state)*             # after the batch up to ``state`` is produced and ``state`` stored
    close()                    # always, also after an error or an interrupt; may be called twice
    release()                  # only when the connector is deleted on purpose: drops its slot

Contract:

- ``poll(state, ...)`` returns the messages *after* ``state`` (the source's own JSON-able
  position: an id, an LSN, a sequence number) and the state that covers them, or None
  when nothing arrived within ``max_wait_s`` (a long poll, no busy loop). It must not
  change the system: nothing is deleted, marked, acknowledged or advanced in ``poll``.
  Given the same ``state`` it returns the same messages again (a failed batch is polled
  again from the stored state), so any position a source holds in memory is a cache.
- ``commit(state)`` runs the side effects that must wait until the batch is safely
  stored: advance a replication slot, DELETE or UPDATE the rows read, acknowledge HTTP
  requests or MQTT messages. It covers everything up to ``state`` and must be
  idempotent: after a crash, or when it failed, the runtime calls it again with the
  stored state after the next poll (which, starting from that state, returned none of
  the rows it covers).
- Outages raise ``TransientSourceError`` (the runtime retries with backoff, nothing is
  stored); anything no retry fixes raises ``PermanentSourceError`` or ``ConfigError``.
- ``mode`` declares what a read is: ``cdc`` (a change stream), ``polling`` (a query;
  ``destructive`` when commit deletes or updates rows) or ``opaque`` (messages pushed to
  us). It sets the defaults of ``routing.on_admission_failure`` and the commit-failure
  policy (DESIGN.md, Source connectors). A non-destructive source configured with a
  destructive option fails in ``validate``.
- A message may carry its destination (a topic; None: decided by routing), a partition
  key (bytes; None means no key) and an explicit partition id. ``column_routing`` is
  True when the source's config derives destinations from the data (a destination
  column, per-table destinations): such a source refuses a Route transform.

Sources import their client library lazily (inside ``init``), so loading the Dagster
code location never imports paho-mqtt or psycopg2.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from conveyor.core.engine.routing import SourceMode
from conveyor.core.errors import (
    ConfigError,  # noqa: F401 - re-exported for sources
    FieldRuleError,
)
from conveyor.core.trust import paths

State = dict[str, Any]


@dataclass(frozen=True)
class SourceMessage:
    """One message read from the system: a JSON payload and where it should go."""

    payload: bytes | None
    destination: str | None = None
    key: bytes | None = None
    partition: int | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int | None = None


@dataclass(frozen=True)
class Polled:
    """A batch: the messages after the polled state, and the state that covers them."""

    messages: list[SourceMessage]
    state: State
    origin: str = ""  # shown as the rows' __topic (e.g. 'public.orders')


class SourceConfig(BaseModel):
    """Base of every source's config model (tagged by ``type``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = Field(description="Source type.")

    def asset_key_path(self) -> list[str]:
        """The Dagster asset key of the system this source reads (lineage upstream of topics)."""
        return [self.type, "source"]

    @model_validator(mode="after")
    def _certificates_confined(self) -> SourceConfig:
        """Certificate and key files lie under a root, outside the secrets (``core.trust.paths``)."""
        found = paths.certificate_problem(self)
        if found is not None:
            raise FieldRuleError(found[1], field=found[0])
        return self

    def kind(self) -> str:
        return self.type

    def for_connector(self, name: str) -> SourceConfig:
        """This config with the defaults derived from the connector's name filled in (a
        replication slot named after it); the run builds its source from it."""
        return self

    def owned_resources(self, connector: str) -> tuple[str, ...]:
        """Names of external resources only one connector may use (a replication slot):
        two specs claiming one are refused where specs are validated together."""
        return ()

    def builds_tombstones(self) -> bool:
        """Whether the source builds null-value messages on purpose (tombstones): they then pass
        the transform unless the spec sets ``transform.null_values``."""
        return False

    def kept_on_delete(self, connector: str) -> tuple[str, ...]:
        """What stays in the source's system when the connector is deleted without releasing
        it (``--drop-slot``), each said with its cost and how to drop it by hand."""
        return ()

    def named_after(self, connector: str) -> tuple[str, ...]:
        """The owned resources named after the connector by default (its slot
        ``conveyor_<name>``): they are its own whoever else claims them."""
        return ()


class Source(abc.ABC):
    """Base class of sources; see the module docstring for the contract."""

    config_class: ClassVar[type[SourceConfig]] = SourceConfig
    mode: ClassVar[SourceMode] = SourceMode.POLLING
    # Bump when the meaning of a stored state changes; a state of another version refuses
    # to start (``SourceStateVersionError``) instead of being reset silently.
    state_version: ClassVar[int] = 1

    def __init__(self, config: SourceConfig):
        self.config = config

    @property
    def destructive(self) -> bool:
        """Whether commit deletes or changes what was read (polling sources)."""
        return False

    @property
    def column_routing(self) -> bool:
        """Whether destinations come from the data by the source's own config."""
        return False

    def validate(self) -> None:  # noqa: B027 - optional hook
        """Check the config without I/O; raise ConfigError naming the field."""

    @abc.abstractmethod
    def init(self, state: State | None) -> None: ...

    @abc.abstractmethod
    def poll(self, state: State | None, max_records: int, max_wait_s: float) -> Polled | None: ...

    @abc.abstractmethod
    def commit(self, state: State) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def metrics(self) -> dict[str, float]:
        """Gauges of the system read (a replication slot's lag and retained WAL, in bytes),
        sent with each heartbeat. May be called from another thread: cached values, no I/O."""
        return {}

    def release(self) -> None:  # noqa: B027 - optional hook
        """Drop what the source owns in the system (a replication slot, a publication): the
        connector is deleted with an explicit confirmation. Runs without ``init`` (it
        connects by itself). Default: nothing to drop."""

    def describe(self) -> str:
        return "/".join(self.config.asset_key_path())
