"""A connector's state history in the meta store: every transition and decision, with its reason.

Every repository writes its lines in the transaction of the change they record
(``Repository._history``); this one reads them and records a line without a change.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from conveyor.store import schema as t
from conveyor.store.connectors import ConnectorRepository
from conveyor.store.database import Database
from conveyor.store.repository import Repository


@dataclass(frozen=True)
class HistoryRow:
    connector: str
    at: float
    from_status: str | None
    to_status: str
    reason: str
    run_id: str | None
    generation: int | None


class HistoryRepository(Repository):
    """History lines: read, newest first; recorded without a status change."""

    def __init__(self, db: Database, connectors: ConnectorRepository):
        super().__init__(db)
        self.connectors = connectors

    def record(self, name: str, reason: str, *, run_id: str | None = None) -> None:
        """A history entry without a status change (a scheduler decision, a replay)."""
        row = self.connectors.get(name)
        with self.db.tx() as c:
            self._history(c, name, row.status, row.status, reason, run_id, row.generation)

    def history(self, name: str | None = None, limit: int = 50) -> list[HistoryRow]:
        q = sa.select(t.state_history).order_by(t.state_history.c.id.desc()).limit(limit)
        if name:
            q = q.where(t.state_history.c.connector == name)
        with self.db.read() as c:
            return [
                HistoryRow(
                    r.connector, r.at, r.from_status, r.to_status, r.reason, r.run_id, r.generation
                )
                for r in c.execute(q)
            ]
