"""Offsets in the meta store: the positions each connector committed, and the operator's changes.

Every stored offset names what it is a position of (``core/positions.py``: the log and
the destination); a run's commit writes them with its ``PositionScope``, an operator's
offsets name none. The operator's changes (``reset_offsets``, ``fence_writers``) are
refused unless the connector is stopped, checked and fenced in the transaction that writes.
"""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa

from conveyor.core.model import ConnectorStatus, Offsets, TopicPartition
from conveyor.core.positions import PositionScope, StoredPosition, StoredPositions
from conveyor.core.trust.scrubbing import scrub
from conveyor.store import schema as t
from conveyor.store.database import transient_errors
from conveyor.store.repository import Repository, require_editable, task_writers


class OffsetRepository(Repository):
    """A connector's stored positions: read, written by its runs, changed by the operator."""

    def committed_offsets(self, name: str) -> Offsets:
        with self.db.read() as c:
            return self.read(c, name)

    def read(self, c: sa.Connection, name: str) -> Offsets:
        """The connector's offsets, read in the caller's transaction."""
        q = sa.select(t.offsets).where(t.offsets.c.connector == name)
        return {TopicPartition(r.topic, r.partition): int(r.next_offset) for r in c.execute(q)}

    def stored_positions(self, name: str) -> StoredPositions:
        """The connector's offsets with the log and destination each names (core/positions.py)."""
        with self.db.read() as c:
            q = sa.select(t.offsets).where(t.offsets.c.connector == name)
            return {
                TopicPartition(r.topic, r.partition): StoredPosition(
                    int(r.next_offset), r.log_id, r.destination
                )
                for r in c.execute(q)
            }

    def record_positions(self, name: str, generation: int, messages: list[str]) -> None:
        """Positions a run did not take as stored (``core.positions.PositionNote``): each in the
        history, the last as the connector's last error (fenced: a stale run records nothing)."""
        if not messages:
            return
        now = self.db.clock()
        with transient_errors("recording positions"), self.db.tx() as c:
            row = c.execute(
                sa.select(t.connectors.c.status, t.connectors.c.run_id).where(
                    t.connectors.c.name == name, t.connectors.c.generation == generation
                )
            ).first()
            if row is None:
                return
            status = ConnectorStatus(row.status)
            for m in messages:
                self._history(c, name, status, status, f"position: {m}", row.run_id, generation)
            last = (
                messages[-1]
                if len(messages) == 1
                else f"{messages[-1]} (and {len(messages) - 1} more: see history)"
            )
            c.execute(
                t.connectors.update()
                .where(t.connectors.c.name == name, t.connectors.c.generation == generation)
                .values(last_error=scrub(last), updated_at=now)
            )

    def positions_adopted(self, name: str, generation: int) -> None:
        """A migrated connector's run took what its target kept under the bare writer name:
        later runs look only under its writer id (fenced: a stale run changes nothing)."""
        with transient_errors("recording adopted positions"), self.db.tx() as c:
            c.execute(
                t.connectors.update()
                .where(t.connectors.c.name == name, t.connectors.c.generation == generation)
                .values(legacy_positions=False)
            )

    def reset_offsets(
        self,
        name: str,
        offsets: Offsets,
        *,
        replace: bool = False,
        forget: Iterable[TopicPartition] = (),
        reason: str | None = None,
    ) -> None:
        """Set offsets by hand (CLI, API). Refused unless the connector is stopped.

        ``replace``: every stored offset goes first (the connector starts over from
        ``source.start_from`` where ``offsets`` names no partition); ``forget``: those
        partitions' offsets go (KIP-875's ``"offset": null``).
        """
        now = self.db.clock()
        forget = list(forget)
        with self.db.tx() as c:
            row = self._lock_operator(c, name)
            require_editable(row, "offsets")
            # Fenced in the same transaction: a batch in flight of any older run (a stuck
            # thread, a task that missed the stop) is refused, so the reset stands.
            generation = self._fence(c, row)
            if replace:
                c.execute(t.offsets.delete().where(t.offsets.c.connector == name))
            for tp in forget:
                c.execute(
                    t.offsets.delete().where(
                        t.offsets.c.connector == name,
                        t.offsets.c.topic == tp.topic,
                        t.offsets.c.partition == tp.partition,
                    )
                )
            self.upsert(c, name, generation, offsets, now)
            what = _fmt_offsets(offsets) or "-"
            if forget:
                what += "; forgotten: " + ", ".join(str(tp) for tp in sorted(forget))
            if replace:
                what = "all cleared" + (f", then {what}" if offsets else "")
            self._history(
                c,
                name,
                row.status,
                row.status,
                f"{reason or 'offsets reset'}: {what}; generation {row.generation} fenced",
                None,
                generation,
            )

    # -- offsets a sink's target keeps (exactly once; issue 37) ----------------------------

    def fence_writers(self, name: str, *, reason: str) -> dict[str, int]:
        """Before an offsets change moves the offsets a connector's target keeps: the
        connector's generation and every partition task's bumped (``_fence``; stopped only),
        and each writer's new generation, by the name its target commits carry (the
        connector's own, ``<connector>.task<N>``). The target's fence is raised to these; every
        later run of a writer gets a generation at least as high (runs claim above the
        connector's, tasks restart above theirs), and no older run holds one."""
        with self.db.tx() as c:
            row = self._lock_operator(c, name)
            require_editable(row, "offsets")
            generation = self._fence(c, row)
            writers = {name: generation, **task_writers(c, name)}
            self._history(
                c,
                name,
                row.status,
                row.status,
                f"{reason}: generation {row.generation} fenced for the change in the target",
                None,
                generation,
            )
        return writers

    def upsert(
        self,
        c: sa.Connection,
        name: str,
        generation: int,
        offsets: Offsets,
        now: float,
        scope: PositionScope | None = None,
    ) -> None:
        """Offsets set (backwards too), with what they are positions of: a run's commit names
        its logs and destination (``scope``); an operator's offsets name none (NULL: taken for
        the log that is there, after a range check). In the caller's transaction, which
        holds the fence (the connector's generation, or the task's partitions)."""
        if not offsets:
            return
        rows = [
            {
                "connector": name,
                "topic": tp.topic,
                "partition": tp.partition,
                "next_offset": off,
                "generation": generation,
                "committed_at": now,
                "log_id": scope.log_ids.get(tp.topic) if scope else None,
                "destination": scope.destination if scope else None,
            }
            for tp, off in offsets.items()
        ]
        if self.db.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
        stmt = insert(t.offsets).values(rows)
        stmt = stmt.on_conflict_do_update(
            index_elements=["connector", "topic", "partition"],
            set_={
                "next_offset": stmt.excluded.next_offset,
                "generation": stmt.excluded.generation,
                "committed_at": stmt.excluded.committed_at,
                "log_id": stmt.excluded.log_id,
                "destination": stmt.excluded.destination,
            },
        )
        c.execute(stmt)


def offsets_from_pairs(pairs: Iterable[tuple[str, int, int]]) -> Offsets:
    return {TopicPartition(tp, p): o for tp, p, o in pairs}


def _fmt_offsets(offsets: Offsets) -> str:
    return ", ".join(f"{tp}={off}" for tp, off in sorted(offsets.items()))
