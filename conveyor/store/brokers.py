"""Brokers in the meta store: the executors the brokers file declares, draining, gone ones kept."""

from __future__ import annotations

import json
from collections.abc import Iterable

import sqlalchemy as sa

from conveyor.core.errors import ConveyorError
from conveyor.core.model import Broker
from conveyor.store import schema as t
from conveyor.store.repository import Repository


class BrokerRepository(Repository):
    """Broker rows, synced from the brokers file; one left out is marked gone, not removed."""

    def upsert_broker(self, broker: Broker, *, keep_draining: bool = True) -> None:
        now = self.db.clock()
        with self.db.tx() as c:
            cur = c.execute(sa.select(t.brokers).where(t.brokers.c.id == broker.id)).first()
            values = {
                "capacity": broker.capacity,
                "spark_remote": broker.spark_remote,
                "run_tags_json": json.dumps(broker.run_tags, sort_keys=True),
                "updated_at": now,
                "gone_at": None,  # back in the brokers file
            }
            if cur is None:
                c.execute(
                    t.brokers.insert().values(id=broker.id, draining=broker.draining, **values)
                )
            else:
                if not keep_draining:
                    values["draining"] = broker.draining
                c.execute(t.brokers.update().where(t.brokers.c.id == broker.id).values(**values))

    def list_brokers(self) -> list[Broker]:
        with self.db.read() as c:
            return [
                Broker(
                    id=r.id,
                    capacity=r.capacity,
                    spark_remote=r.spark_remote,
                    run_tags=json.loads(r.run_tags_json or "{}"),
                    draining=bool(r.draining),
                )
                for r in c.execute(sa.select(t.brokers).order_by(t.brokers.c.id))
            ]

    def get_broker(self, broker_id: str) -> Broker | None:
        return next((b for b in self.list_brokers() if b.id == broker_id), None)

    def gone_brokers(self) -> set[str]:
        """Ids of the brokers marked gone (no longer in the brokers file)."""
        with self.db.read() as c:
            return set(
                c.execute(
                    sa.select(t.brokers.c.id).where(t.brokers.c.gone_at.is_not(None))
                ).scalars()
            )

    def mark_gone(self, broker_ids: Iterable[str]) -> None:
        """Brokers no longer in the brokers file: kept, marked gone (see scheduler.gone_brokers)."""
        ids = list(broker_ids)
        if not ids:
            return
        now = self.db.clock()
        with self.db.tx() as c:
            c.execute(
                t.brokers.update()
                .where(t.brokers.c.id.in_(ids), t.brokers.c.gone_at.is_(None))
                .values(gone_at=now, updated_at=now)
            )

    def set_draining(self, broker_id: str, draining: bool) -> None:
        with self.db.tx() as c:
            res = c.execute(
                t.brokers.update()
                .where(t.brokers.c.id == broker_id)
                .values(draining=draining, updated_at=self.db.clock())
            )
            if res.rowcount == 0:
                raise ConveyorError(f"no broker named {broker_id!r}")
