"""What the PostgreSQL CDC source's parts share (pure): LSNs, a table's catalog facts, the
transaction being read, the position of a state, one row change."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.core.errors import PermanentSourceError
from conveyor.sources.base import State
from conveyor.sources.postgres_cdc_config import TABLE_RE


def parse_lsn(lsn: str) -> int:
    hi, _, lo = lsn.partition("/")
    return (int(hi, 16) << 32) + int(lo, 16)


def format_lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


@dataclass
class TableInfo:
    """What a snapshot and the keys need of a table: columns, types, key columns."""

    name: str  # schema.table
    columns: list[tuple[str, int, str, int]]  # (name, type oid, format_type, typmod)
    key: list[str]


@dataclass
class Txn:
    final_lsn: int
    xid: int
    ts_us: int  # commit time
    last_commit: int | None  # the end of the transaction committed before it (Debezium's sequence)
    next_index: int = 0
    origin: tuple[str, int] | None = None  # replication origin: name, LSN there

    @property
    def ts_ms(self) -> int:
        return self.ts_us // 1000


@dataclass
class Position:
    """How far the stream (or snapshot) has been consumed."""

    lsn: int = 0
    index: int = -1
    safe: int | None = None
    snapshot: dict[str, Any] | None = None
    last_commit: int | None = None  # the end of the last transaction read (Debezium's sequence)

    def state(self, done: tuple[str, ...] = ()) -> State:
        """As stored; ``done``: the re-snapshot requests ('table=id') already taken on."""
        out: State = {
            "lsn": format_lsn(self.lsn),
            "index": self.index,
            "safe_lsn": None if self.safe is None else format_lsn(self.safe),
            "snapshot": self.snapshot,
        }
        if self.last_commit is not None:
            out["last_commit_lsn"] = format_lsn(self.last_commit)
        return {**out, "resnapshots": list(done)} if done else out

    @classmethod
    def of(cls, state: State) -> Position:
        try:
            safe = state.get("safe_lsn")
            snap = state.get("snapshot")
            if snap is not None:
                tables, after = snap["tables"], snap.get("after")
                if not all(isinstance(t, str) and TABLE_RE.match(t) for t in tables) or not (
                    after is None or all(isinstance(v, str) for v in after)
                ):
                    raise ValueError("snapshot: tables or after malformed")
            last_commit = state.get("last_commit_lsn")
            return cls(
                parse_lsn(str(state["lsn"])),
                int(state["index"]),
                parse_lsn(str(safe)) if safe else None,
                snap,
                parse_lsn(str(last_commit)) if last_commit else None,
            )
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise PermanentSourceError(f"unreadable stored CDC state {state!r}: {e}") from None


@dataclass
class Change:
    """One row change (or snapshot row) ready to be formatted."""

    op: str  # c u d r t
    table: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    key: dict[str, Any] | None
    lsn: int
    final_lsn: int
    index: int
    xid: int | None
    ts_us: int  # commit time; a snapshot row: its snapshot's
    unchanged: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    # format debezium's source block and headers:
    last_commit: int | None = None  # the end of the transaction committed before
    origin: tuple[str, int] | None = None
    marker: str = "false"  # source.snapshot
    peer_key: dict[str, Any] | None = None  # a key change: the other key (new for d, old for c)
    columns: Any = None  # the stream's Relation (its columns' types); None: the catalog's

    @property
    def ts_ms(self) -> int:
        return self.ts_us // 1000
