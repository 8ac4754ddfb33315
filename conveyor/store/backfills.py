"""Backfill requests in the meta store, and the one parser of a backfill's range.

Written by the CLI (``conveyor backfill``) and the REST API (``/connectors/{name}/backfills``),
launched by the backfills sensor, their end reported by the backfill job. A range is checked
when it is requested (``parse_backfill_range``): a bad one never becomes a run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from conveyor.core.errors import ConfigError, ConveyorError
from conveyor.core.model import Offsets, SourceSpec, parse_start_timestamp
from conveyor.core.positions import PositionError, parse_positions, topics_read
from conveyor.core.trust.scrubbing import scrub
from conveyor.store import schema as t
from conveyor.store.database import transient_errors
from conveyor.store.repository import Repository

BACKFILL_REQUESTED = "requested"
BACKFILL_LAUNCHED = "launched"
BACKFILL_RUNNING = "running"
BACKFILL_SUCCEEDED = "succeeded"
BACKFILL_FAILED = "failed"
BACKFILL_STATES = (
    BACKFILL_REQUESTED,
    BACKFILL_LAUNCHED,
    BACKFILL_RUNNING,
    BACKFILL_SUCCEEDED,
    BACKFILL_FAILED,
)
BACKFILL_OPEN = (BACKFILL_REQUESTED, BACKFILL_LAUNCHED, BACKFILL_RUNNING)
MAX_POSITION_CHARS = 16_384  # a start or end (a list of partitions' offsets may be long)


class UnknownBackfillError(ConveyorError):
    """No backfill request with that id."""


@dataclass(frozen=True)
class BackfillRequest:
    """A backfill request as the meta store holds it."""

    id: int
    connector: str
    start: str
    end: str
    requested_at: float
    requested_by: str
    state: str
    run_id: str | None
    read: int
    delivered: int
    failed: int
    message: str | None
    updated_at: float

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "connector": self.connector,
            "start": self.start,
            "end": self.end,
            "requested_at": self.requested_at,
            "requested_by": self.requested_by,
            "state": self.state,
            "run_id": self.run_id,
            "read": self.read,
            "delivered": self.delivered,
            "failed": self.failed,
            "message": self.message,
            "updated_at": self.updated_at,
        }


def _backfill(r: sa.Row[Any]) -> BackfillRequest:
    m = r._mapping
    return BackfillRequest(
        id=int(m["id"]),
        connector=m["connector"],
        start=m["range_start"],
        end=m["range_end"],
        requested_at=m["requested_at"],
        requested_by=m["requested_by"],
        state=m["state"],
        run_id=m["run_id"],
        read=int(m["read"]),
        delivered=int(m["delivered"]),
        failed=int(m["failed"]),
        message=m["message"],
        updated_at=m["updated_at"],
    )


class BackfillRepository(Repository):
    """Backfill requests: stored, read, moved through their states."""

    def request_backfill(
        self, connector: str, start: str, end: str, *, requested_by: str
    ) -> BackfillRequest:
        """Store a backfill request (state ``requested``) for the backfills sensor to launch.
        The range is checked here (``parse_backfill_range``, against the topics the connector
        reads): a bad one never becomes a run."""
        now = self.db.clock()
        with self.db.tx() as c:
            row = self._get_for_update(c, connector)
            parse_backfill_range(start, end, topics_read(row.spec))
            new_id = c.execute(
                t.backfills.insert()
                .values(
                    connector=connector,
                    range_start=start.strip(),
                    range_end=end.strip(),
                    requested_at=now,
                    requested_by=requested_by[:255],
                    state=BACKFILL_REQUESTED,
                    updated_at=now,
                )
                .returning(t.backfills.c.id)
            ).scalar_one()
            self._history(
                c,
                connector,
                row.status,
                row.status,
                f"backfill {new_id} requested by {requested_by}: {start.strip()} .. {end.strip()}",
                None,
                None,
            )
        return self.backfill(int(new_id))

    def backfill(self, backfill_id: int) -> BackfillRequest:
        with self.db.read() as c:
            r = c.execute(sa.select(t.backfills).where(t.backfills.c.id == backfill_id)).first()
        if r is None:
            raise UnknownBackfillError(f"no backfill request {backfill_id}")
        return _backfill(r)

    def backfills(
        self,
        connector: str | None = None,
        *,
        states: Iterable[str] | None = None,
        limit: int = 100,
    ) -> list[BackfillRequest]:
        """Backfill requests, newest first."""
        q = sa.select(t.backfills).order_by(t.backfills.c.id.desc()).limit(limit)
        if connector is not None:
            q = q.where(t.backfills.c.connector == connector)
        if states is not None:
            q = q.where(t.backfills.c.state.in_(list(states)))
        with self.db.read() as c:
            return [_backfill(r) for r in c.execute(q)]

    def update_backfill(
        self,
        backfill_id: int,
        state: str,
        *,
        only_from: Iterable[str] | None = None,
        run_id: str | None = None,
        counts: tuple[int, int, int] | None = None,
        message: str | None = None,
    ) -> bool:
        """Move a request to ``state`` (with its run, counts ``(read, delivered, failed)`` and
        message) if it is in one of ``only_from`` (default: not finished; a finished request
        stays finished). True when it moved."""
        if state not in BACKFILL_STATES:
            raise ValueError(f"unknown backfill state {state!r}")
        values: dict[str, Any] = {"state": state, "updated_at": self.db.clock()}
        if run_id is not None:
            values["run_id"] = run_id
        if counts is not None:
            values.update(read=counts[0], delivered=counts[1], failed=counts[2])
        if message is not None:
            values["message"] = scrub(message)[:4000]
        with transient_errors("updating a backfill request"), self.db.tx() as c:
            res = c.execute(
                t.backfills.update()
                .where(
                    t.backfills.c.id == backfill_id,
                    t.backfills.c.state.in_(list(only_from or BACKFILL_OPEN)),
                )
                .values(**values)
            )
            return bool(res.rowcount)


Position = str | Offsets  # earliest, latest, an ISO 8601 time (as text), or offsets


def parse_position(text: str, what: str = "backfill", reads: SourceSpec | None = None) -> Position:
    """A backfill's start or end: ``earliest``, ``latest``, an ISO 8601 time (naive = UTC;
    kept as text) or ``TOPIC:PARTITION:OFFSET[,...]`` (``core.positions.parse_positions``, with
    ``reads`` the topics the connector reads). ConfigError naming ``what`` otherwise. The one
    parser of a range: the store, the CLI, the API and the job read it alike."""
    text = text.strip()
    if not text:
        raise ConfigError(
            "empty; expected earliest, latest, an ISO 8601 time or offsets", field=what
        )
    if len(text) > MAX_POSITION_CHARS:
        raise ConfigError(f"longer than {MAX_POSITION_CHARS} characters", field=what)
    if text in ("earliest", "latest"):
        return text
    try:
        parse_start_timestamp(text)
        return text
    except ValueError:
        pass
    if ":" not in text:
        raise ConfigError(
            f"{text[:80]!r} is not earliest, latest, an ISO 8601 time or TOPIC:PARTITION:OFFSET",
            field=what,
        )
    try:
        return parse_positions(text, reads)
    except PositionError as e:
        raise ConfigError(str(e), field=what) from None


def position_ms(position: Position) -> int | None:
    """An ISO 8601 time position in epoch milliseconds; None for the others."""
    if isinstance(position, dict) or position in ("earliest", "latest"):
        return None
    return int(parse_start_timestamp(position).timestamp() * 1000)


def parse_backfill_range(
    start: str, end: str, reads: SourceSpec | None = None
) -> tuple[Position, Position]:
    """``start`` .. ``end`` (end excluded), each checked by ``parse_position`` (``reads``: the
    topics the connector reads), and a range that can hold something: not from latest, not to
    earliest, not backwards."""
    lo, hi = parse_position(start, "start", reads), parse_position(end, "end", reads)
    if lo == "latest":
        raise ConfigError("latest is the end of the log: the range would be empty", field="start")
    if hi == "earliest":
        raise ConfigError("earliest is the start of the log: the range would be empty", field="end")
    lo_ms, hi_ms = position_ms(lo), position_ms(hi)
    if lo_ms is not None and hi_ms is not None and lo_ms >= hi_ms:
        raise ConfigError(f"{end.strip()} is not after the start {start.strip()}", field="end")
    if isinstance(lo, dict) and isinstance(hi, dict):
        behind = [f"{tp}" for tp in sorted(lo) if tp in hi and hi[tp] < lo[tp]]
        if behind:
            raise ConfigError(f"before the start on {', '.join(behind[:5])}", field="end")
    return lo, hi
