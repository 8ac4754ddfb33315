"""The meta store: connectors, brokers, offsets, heartbeats and state history, behind one facade.

SQLite file by default (zero set-up), PostgreSQL by URL in production
(``CONVEYOR_META_URL``). Every offset commit and heartbeat is fenced:
``UPDATE ... WHERE name = :n AND generation = :g``; when no row changes the run
has lost its assignment and gets ``FencedError``.

``MetaStore`` is the facade its callers know. Each of its methods is written once, in the
repository of its concern, all over one ``Database`` (``store/database.py``):

- ``connectors`` (``store/connectors.py``): specs synced from the files, reads, desired
  state, delete;
- ``ledger`` (``store/ledger.py``): the run ledger: state transitions, assignment, claim,
  heartbeat, commit, release, the operator's stop;
- ``offsets`` (``store/offsets.py``): stored positions, the operator's offsets changes;
- ``brokers`` (``store/brokers.py``), ``history_log`` (``store/history.py``),
  ``source_states`` (``store/source_state.py``), ``backfill_requests``
  (``store/backfills.py``).

What they share (the connector row, the operator's locks, the fence, the history line) is
``store/repository.py``; the partition tasks' tables are ``store/tasks.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa

from conveyor.store.backfills import (
    BACKFILL_FAILED,
    BACKFILL_LAUNCHED,
    BACKFILL_OPEN,
    BACKFILL_REQUESTED,
    BACKFILL_RUNNING,
    BACKFILL_STATES,
    BACKFILL_SUCCEEDED,
    MAX_POSITION_CHARS,
    BackfillRepository,
    BackfillRequest,
    Position,
    UnknownBackfillError,
    parse_backfill_range,
    parse_position,
    position_ms,
)
from conveyor.store.brokers import BrokerRepository
from conveyor.store.connectors import ConnectorRepository
from conveyor.store.database import (
    Database,
    StoreError,
    default_meta_url,
    is_transient,
    redact_url,
    transient_errors,
)
from conveyor.store.facade import Delegate
from conveyor.store.history import HistoryRepository, HistoryRow
from conveyor.store.ledger import RunLedger
from conveyor.store.offsets import OffsetRepository, offsets_from_pairs
from conveyor.store.repository import (
    LIVE_STATUSES,
    NAME_LOCK_KEY,
    Claim,
    ConnectorRow,
    NotStoppedError,
    UnknownConnectorError,
    drop_tasks,
    fence_tasks,
    offsets_editable,
    task_writers,
)
from conveyor.store.source_state import SourceStateRepository

# The names callers import from here, wherever they are written now.
__all__ = [
    "BACKFILL_FAILED",
    "BACKFILL_LAUNCHED",
    "BACKFILL_OPEN",
    "BACKFILL_REQUESTED",
    "BACKFILL_RUNNING",
    "BACKFILL_STATES",
    "BACKFILL_SUCCEEDED",
    "LIVE_STATUSES",
    "MAX_POSITION_CHARS",
    "NAME_LOCK_KEY",
    "BackfillRequest",
    "Claim",
    "ConnectorRow",
    "HistoryRow",
    "MetaStore",
    "NotStoppedError",
    "Position",
    "StoreError",
    "UnknownBackfillError",
    "UnknownConnectorError",
    "default_meta_url",
    "drop_tasks",
    "fence_tasks",
    "is_transient",
    "offsets_editable",
    "offsets_from_pairs",
    "parse_backfill_range",
    "parse_position",
    "position_ms",
    "redact_url",
    "task_writers",
    "transient_errors",
]


class MetaStore:
    """Connector state in SQLite or PostgreSQL; safe for many processes at once."""

    def __init__(
        self,
        url: str | None = None,
        *,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = 30.0,
    ):
        self.db = Database(url, clock=clock, busy_timeout_s=busy_timeout_s)
        self.connectors = ConnectorRepository(self.db)
        self.offsets = OffsetRepository(self.db)
        self.ledger = RunLedger(self.db, self.offsets)
        self.brokers = BrokerRepository(self.db)
        self.history_log = HistoryRepository(self.db, self.connectors)
        self.source_states = SourceStateRepository(self.db)
        self.backfill_requests = BackfillRepository(self.db)

    def __repr__(self) -> str:
        return f"MetaStore({redact_url(self.url)})"

    @property
    def url(self) -> str:
        return self.db.url

    @property
    def engine(self) -> sa.Engine:
        return self.db.engine

    @property
    def dialect(self) -> str:
        return self.db.dialect

    @property
    def clock(self) -> Callable[[], float]:
        return self.db.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.db.clock = clock  # every repository reads it at each write

    # -- the database (store/database.py) ---------------------------------------------------

    close = Delegate("db", Database.close)
    ensure_schema = Delegate("db", Database.ensure_schema)
    schema_version = Delegate("db", Database.schema_version)

    # -- connectors (store/connectors.py) -----------------------------------------------------

    sync_spec = Delegate("connectors", ConnectorRepository.sync_spec)
    get = Delegate("connectors", ConnectorRepository.get)
    list = Delegate("connectors", ConnectorRepository.list)
    delete = Delegate("connectors", ConnectorRepository.delete)
    set_desired = Delegate("connectors", ConnectorRepository.set_desired)

    # -- the run ledger (store/ledger.py) -----------------------------------------------------

    apply = Delegate("ledger", RunLedger.apply)
    assign = Delegate("ledger", RunLedger.assign)
    stop = Delegate("ledger", RunLedger.stop)
    claim = Delegate("ledger", RunLedger.claim)
    commit = Delegate("ledger", RunLedger.commit)
    heartbeat = Delegate("ledger", RunLedger.heartbeat)
    ensure_current = Delegate("ledger", RunLedger.ensure_current)
    release = Delegate("ledger", RunLedger.release)

    # -- offsets (store/offsets.py) -----------------------------------------------------------

    committed_offsets = Delegate("offsets", OffsetRepository.committed_offsets)
    stored_positions = Delegate("offsets", OffsetRepository.stored_positions)
    record_positions = Delegate("offsets", OffsetRepository.record_positions)
    positions_adopted = Delegate("offsets", OffsetRepository.positions_adopted)
    reset_offsets = Delegate("offsets", OffsetRepository.reset_offsets)
    fence_writers = Delegate("offsets", OffsetRepository.fence_writers)

    # -- brokers (store/brokers.py) -----------------------------------------------------------

    upsert_broker = Delegate("brokers", BrokerRepository.upsert_broker)
    list_brokers = Delegate("brokers", BrokerRepository.list_brokers)
    get_broker = Delegate("brokers", BrokerRepository.get_broker)
    gone_brokers = Delegate("brokers", BrokerRepository.gone_brokers)
    mark_gone = Delegate("brokers", BrokerRepository.mark_gone)
    set_draining = Delegate("brokers", BrokerRepository.set_draining)

    # -- history (store/history.py) -----------------------------------------------------------

    record = Delegate("history_log", HistoryRepository.record)
    history = Delegate("history_log", HistoryRepository.history)

    # -- source connectors' state (store/source_state.py) -------------------------------------

    save_source_state = Delegate("source_states", SourceStateRepository.save_source_state)
    source_state = Delegate("source_states", SourceStateRepository.source_state)
    source_state_info = Delegate("source_states", SourceStateRepository.source_state_info)
    request_abandon = Delegate("source_states", SourceStateRepository.request_abandon)
    reset_source_state = Delegate("source_states", SourceStateRepository.reset_source_state)

    # -- backfill requests (store/backfills.py) -----------------------------------------------

    request_backfill = Delegate("backfill_requests", BackfillRepository.request_backfill)
    backfill = Delegate("backfill_requests", BackfillRepository.backfill)
    backfills = Delegate("backfill_requests", BackfillRepository.backfills)
    update_backfill = Delegate("backfill_requests", BackfillRepository.update_backfill)
