"""Connectors in the meta store: their specs as synced from the files, reads, start and delete.

A connector's row is inserted only while its spec file exists, checked under the name's
lock that ``delete`` takes too; a delete removes the row, offsets, source state and
partition tasks in one transaction, so no generation is left for a zombie to match.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from conveyor.core.model import ConnectorStatus, DesiredState
from conveyor.core.trust.scrubbing import scrub
from conveyor.store import schema as t
from conveyor.store.repository import (
    LIVE_STATUSES,
    ConnectorRow,
    Repository,
    UnknownConnectorError,
    connector_row,
    drop_tasks,
)


class ConnectorRepository(Repository):
    """Connector rows: spec sync, reads, the desired state, delete."""

    def sync_spec(
        self,
        name: str,
        *,
        spec_json: str | None,
        spec_hash: str | None,
        source: str,
        error: str | None,
        desired: DesiredState = DesiredState.RUNNING,
    ) -> ConnectorRow:
        """Insert or update a connector's spec; runtime state is kept.

        A spec error puts the connector in Error with the message; fixing the spec
        returns it to Idle so it can be scheduled again. A new row is inserted only while
        its spec file exists, checked under the name's lock that ``delete`` takes too: a
        sync that read the file before a delete cannot bring the connector back
        (``UnknownConnectorError``).
        """
        error = scrub(error) if error is not None else None  # never a resolved secret
        # Unchanged (every tick of the scheduler, for every spec): answered by a read, so the
        # sync takes no write lock when there is nothing to write.
        with self.db.read() as c:
            cur = c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).first()
        if cur is not None and _spec_unchanged(connector_row(cur), spec_hash, source, error):
            return connector_row(cur)
        now = self.db.clock()
        with self.db.tx() as c:
            self._lock_name(c, name)
            cur = c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).first()
            if cur is None:
                self._insert_spec(c, name, spec_json, spec_hash, source, error, desired, now)
            else:
                row = connector_row(cur)
                if _spec_unchanged(row, spec_hash, source, error):
                    return row
                self._update_spec(c, name, row, spec_json, spec_hash, source, error, now)
            return connector_row(
                c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).one()
            )

    def _insert_spec(
        self,
        c: sa.Connection,
        name: str,
        spec_json: str | None,
        spec_hash: str | None,
        source: str,
        error: str | None,
        desired: DesiredState,
        now: float,
    ) -> None:
        """Creates the connector's row (Idle, or Error with the spec's error) while its spec
        file still exists, with a ``created`` history entry."""
        if _file_gone(source):
            # Read before a delete that removed the file (and the row) since: the
            # delete stands.
            raise UnknownConnectorError(
                f"connector {name!r} is not created again: its spec file {source} "
                "is gone (deleted meanwhile)"
            )
        status = ConnectorStatus.ERROR if error else ConnectorStatus.IDLE
        # A new incarnation: its generations start above any an earlier connector of this name
        # reached here, so a zombie run of a deleted one matches none of them.
        before = c.execute(
            sa.select(sa.func.max(t.state_history.c.generation)).where(
                t.state_history.c.connector == name
            )
        ).scalar()
        c.execute(
            t.connectors.insert().values(
                name=name,
                incarnation=t.new_incarnation(),
                legacy_positions=False,
                spec_json=spec_json,
                spec_hash=spec_hash,
                spec_source=source,
                spec_error=error,
                desired=desired.value,
                status=status.value,
                status_since=now,
                generation=int(before or 0),
                last_error=error,
                restarts=0,
                created_at=now,
                updated_at=now,
            )
        )
        self._history(c, name, None, status, "created" + (f": {error}" if error else ""), None, 0)

    def _update_spec(
        self,
        c: sa.Connection,
        name: str,
        row: ConnectorRow,
        spec_json: str | None,
        spec_hash: str | None,
        source: str,
        error: str | None,
        now: float,
    ) -> None:
        """Stores a changed spec (a valid one replaces the last valid one; an invalid one only
        its error) and the status change it brings."""
        values: dict[str, Any] = {"spec_source": source, "spec_error": error}
        if error is None:
            values.update(spec_json=spec_json, spec_hash=spec_hash)
        values["updated_at"] = now
        values.update(self._spec_status_change(c, name, row, error, now))
        c.execute(t.connectors.update().where(t.connectors.c.name == name).values(**values))

    def _spec_status_change(
        self, c: sa.Connection, name: str, row: ConnectorRow, error: str | None, now: float
    ) -> dict[str, Any]:
        """The status values a spec change brings, with its history entry: a live run goes on
        with the last valid spec; an idle connector with an invalid spec goes to Error; a
        fixed spec returns a connector in Error to Idle."""
        if error and row.status in LIVE_STATUSES:
            # The run goes on with the last valid spec; the error is shown next to it.
            if row.spec_error != error:
                self._history(
                    c,
                    name,
                    row.status,
                    row.status,
                    f"invalid spec (the run goes on with the last valid one): {error}",
                    row.run_id,
                    row.generation,
                )
            return {}
        if error and row.status != ConnectorStatus.ERROR:
            self._history(
                c,
                name,
                row.status,
                ConnectorStatus.ERROR,
                f"invalid spec: {error}",
                row.run_id,
                row.generation,
            )
            return {"status": ConnectorStatus.ERROR.value, "status_since": now, "last_error": error}
        if not error and row.spec_error and row.status == ConnectorStatus.ERROR:
            self._history(
                c,
                name,
                row.status,
                ConnectorStatus.IDLE,
                "spec fixed",
                row.run_id,
                row.generation,
            )
            return {
                "status": ConnectorStatus.IDLE.value,
                "status_since": now,
                "last_error": None,
                "restarts": 0,
            }
        return {}

    def get(self, name: str) -> ConnectorRow:
        with self.db.read() as c:
            r = c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).first()
        if r is None:
            raise UnknownConnectorError(f"no connector named {name!r}")
        return connector_row(r)

    def list(self) -> list[ConnectorRow]:
        with self.db.read() as c:
            return [
                connector_row(r)
                for r in c.execute(sa.select(t.connectors).order_by(t.connectors.c.name))
            ]

    def delete(self, name: str, *, kept: Iterable[str] = ()) -> None:
        """Forget a connector in one transaction: its row, offsets, source state and partition
        tasks. Its runs and tasks are fenced for good (no generation left to match; a connector
        created again under the name starts above every generation it had), so a zombie's
        commit or heartbeat is refused and cannot bring it back; nor can a spec sync that read
        its file before the delete (``sync_spec``). ``kept``: what the delete left elsewhere
        (positions in an unreachable target), for the history. Idempotent."""
        with self.db.tx() as c:
            row = self._lock_if_any(c, name)
            drop_tasks(c, name)
            c.execute(t.offsets.delete().where(t.offsets.c.connector == name))
            c.execute(t.source_state.delete().where(t.source_state.c.connector == name))
            c.execute(t.connectors.delete().where(t.connectors.c.name == name))
            self._history(
                c,
                name,
                row.status if row else None,
                ConnectorStatus.STOPPED,
                "deleted" + "".join(f"; left: {k}" for k in kept),
                None,
                row.generation if row else None,
            )

    def set_desired(self, name: str, desired: DesiredState, *, reason: str = "") -> ConnectorRow:
        now = self.db.clock()
        with self.db.tx() as c:
            row = self._get_for_update(c, name)
            values: dict[str, Any] = {"desired": desired.value, "updated_at": now}
            if desired.wants_run and row.status in (
                ConnectorStatus.STOPPED,
                ConnectorStatus.ERROR,
            ):
                # A user start clears the error and the restart budget.
                values.update(
                    status=ConnectorStatus.IDLE.value,
                    status_since=now,
                    restarts=0,
                    next_restart_at=None,
                    broker_id=None,
                )
                self._history(
                    c,
                    name,
                    row.status,
                    ConnectorStatus.IDLE,
                    reason or "started by user",
                    row.run_id,
                    row.generation,
                )
                # Its partition tasks get a launch window from now, not from their last run.
                c.execute(
                    t.tasks.update().where(t.tasks.c.connector == name).values(changed_at=now)
                )
            c.execute(t.connectors.update().where(t.connectors.c.name == name).values(**values))
            return connector_row(
                c.execute(sa.select(t.connectors).where(t.connectors.c.name == name)).one()
            )


def _file_gone(source: str) -> bool:
    """``source`` names a spec file (an absolute path) that no longer exists."""
    return os.path.isabs(source) and not os.path.exists(source)


def _spec_unchanged(
    row: ConnectorRow, spec_hash: str | None, source: str, error: str | None
) -> bool:
    """``sync_spec`` would write nothing: same source, same error, same spec when valid."""
    return (
        row.spec_error == error
        and (error is not None or row.spec_hash == spec_hash)
        and row.spec_source == source
    )
