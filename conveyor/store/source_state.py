"""Source connectors' state in the meta store: the position a source resumes from, fenced.

A source's state (an id, an LSN, a sequence number) is written in the same transaction as
the generation check; ``version`` is the source's state format. The operator may forget
it (stopped only, fenced) or ask the next run to skip its first batch.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from conveyor.core.model import ConnectorStatus
from conveyor.store import schema as t
from conveyor.store.repository import Repository, require_editable


class SourceStateRepository(Repository):
    """A source connector's stored state: saved by its runs, read, reset and abandoned."""

    def save_source_state(
        self,
        name: str,
        generation: int,
        state: dict[str, Any],
        *,
        version: int,
        abandoned: bool = False,
    ) -> None:
        """Store a source connector's state for this generation: one transaction, fenced.

        ``abandoned``: the batch up to ``state`` was skipped on the operator's request
        (clears the request, records ``last_abandon_at``)."""
        now = self.db.clock()
        with self.db.tx() as c:
            self._fenced_touch(c, name, generation, now, "state not stored")
            values: dict[str, Any] = {
                "version": version,
                "state_json": json.dumps(state, sort_keys=True),
                "generation": generation,
                "saved_at": now,
            }
            if abandoned:
                values.update(abandon_requested=False, last_abandon_at=now)
                self._history(
                    c,
                    name,
                    None,
                    ConnectorStatus.RUNNING,
                    f"batch abandoned by the operator's request; now at {values['state_json']}",
                    None,
                    generation,
                )
            updated = c.execute(
                t.source_state.update().where(t.source_state.c.connector == name).values(**values)
            )
            if updated.rowcount == 0:
                c.execute(t.source_state.insert().values(connector=name, **values))

    def source_state(self, name: str) -> tuple[int, dict[str, Any]] | None:
        """(version, state) last stored for a source connector, or None (none stored yet)."""
        info = self.source_state_info(name)
        if info is None or info["state"] is None:
            return None
        return int(info["version"]), info["state"]

    def source_state_info(self, name: str) -> dict[str, Any] | None:
        """The stored state row: version, state, generation, saved_at, abandon bookkeeping."""
        with self.db.read() as c:
            r = c.execute(
                sa.select(t.source_state).where(t.source_state.c.connector == name)
            ).first()
        if r is None:
            return None
        return {
            "version": int(r.version),
            "state": json.loads(r.state_json),
            "generation": r.generation,
            "saved_at": r.saved_at,
            "abandon_requested": bool(r.abandon_requested),
            "last_abandon_at": r.last_abandon_at,
        }

    def request_abandon(self, name: str) -> None:
        """Ask the connector's next run to skip its first batch (a documented data-loss escape)."""
        now = self.db.clock()
        with self.db.tx() as c:
            self._get_for_update(c, name)
            updated = c.execute(
                t.source_state.update()
                .where(t.source_state.c.connector == name)
                .values(abandon_requested=True)
            )
            if updated.rowcount == 0:
                c.execute(
                    t.source_state.insert().values(
                        connector=name,
                        version=0,
                        state_json="null",
                        generation=0,
                        saved_at=now,
                        abandon_requested=True,
                    )
                )
            self._history(
                c, name, None, ConnectorStatus.STOPPED, "abandon-batch requested", None, None
            )

    def reset_source_state(self, name: str, *, reason: str = "source state reset") -> bool:
        """Forget a stopped source connector's state (an operator command); True when there
        was one. Checked, written and fenced in one transaction, as ``reset_offsets``."""
        with self.db.tx() as c:
            row = self._lock_operator(c, name)
            require_editable(row, "its source state")
            res = c.execute(t.source_state.delete().where(t.source_state.c.connector == name))
            generation = self._fence(c, row)
            self._history(
                c,
                name,
                row.status,
                row.status,
                f"{reason}{'' if res.rowcount else ' (none stored)'}; "
                f"generation {row.generation} fenced",
                None,
                generation,
            )
            return bool(res.rowcount)
