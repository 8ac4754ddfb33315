"""The sink connector run's fenced writes to the meta store: offsets and heartbeats."""

from __future__ import annotations

from collections.abc import Callable

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.engine.stopping import Directive, directive_for
from conveyor.core.model import ConnectorStatus, Counters, Offsets
from conveyor.core.positions import PositionScope
from conveyor.store.meta import MetaStore


class StoreCommitter:
    """The run's fenced writes: offsets to the meta store (mirrored to Kafka), heartbeats.

    ``spec_hash`` is the hash of the spec this run runs with; a heartbeat answered with
    another hash asks the loop to take the new spec on (``Directive.RECONFIGURE``).
    """

    def __init__(
        self,
        store: MetaStore,
        name: str,
        generation: int,
        source: KafkaSource,
        spec_hash: str | None = None,
        on_status: Callable[[ConnectorStatus, str | None], None] | None = None,
        scope: PositionScope | None = None,
        adopted: Callable[[], bool] | None = None,
    ):
        self.store = store
        self.name = name
        self.generation = generation
        self.source = source
        self.spec_hash = spec_hash
        self.on_status = on_status  # told each status change (the run's log in the UI)
        self._status: ConnectorStatus | None = None
        self.scope = scope  # what the offsets are positions of (core/positions.py)
        # A migrated connector: once its target holds its positions under its writer id, the
        # meta store stops offering the bare name's (``MetaStore.positions_adopted``).
        self._adopted = adopted

    def commit(self, offsets: Offsets) -> None:
        self.store.commit(self.name, self.generation, offsets, self.scope)
        self.source.mirror_commit(offsets)
        if self._adopted is not None and self._adopted():
            self.store.positions_adopted(self.name, self.generation)
            self._adopted = None

    def ensure_current(self) -> None:
        self.store.ensure_current(self.name, self.generation)

    def heartbeat(
        self, counters: Counters, status: ConnectorStatus, reason: str | None
    ) -> Directive:
        reply = self.store.heartbeat(
            self.name, self.generation, counters.as_dict(), status=status, reason=reason
        )
        if status != self._status and self.on_status is not None:
            self.on_status(status, reason)
        self._status = status
        return directive_for(reply, self.spec_hash)
