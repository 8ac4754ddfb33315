"""PostgreSQL CDC source: logical decoding with ``test_decoding``, slot advanced in commit.

``poll`` peeks changes (``pg_logical_slot_peek_changes``: nothing is consumed) and
drops those the stored state already covers; ``commit`` advances the slot with
``pg_replication_slot_advance`` to the last transaction the stored state covers
completely. A change's position is ``(commit LSN of its transaction, index in the
transaction)``: transactions come out in commit order, so this orders every change,
also of interleaved transactions, and a batch may end inside a transaction.
Needs ``wal_level = logical`` and a role with REPLICATION (or superuser).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from conveyor.core.errors import PermanentSourceError, TransientSourceError
from conveyor.core.routing import SourceMode, topic_problem
from conveyor.sources.base import Polled, Source, SourceConfig, SourceMessage, State

_SLOT_RE = re.compile(r"^[a-z0-9_]{1,63}$")
_CHANGE_RE = re.compile(r"^table (?P<table>.+?): (?P<op>INSERT|UPDATE|DELETE): (?P<rest>.*)$", re.S)
# name[type]:value, value quoted ('' escapes a quote), null, or a bare token.
_COL_RE = re.compile(
    r"(?P<name>\"(?:[^\"]|\"\")+\"|[^\s\[]+)\[(?P<type>[^\]]+)\]:(?P<value>'(?:[^']|'')*'|\S+)"
)
_INT_TYPES = {"smallint", "integer", "bigint"}
_FLOAT_TYPES = {"real", "double precision"}


def parse_lsn(lsn: str) -> int:
    hi, _, lo = lsn.partition("/")
    return (int(hi, 16) << 32) + int(lo, 16)


def format_lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


def _value(typ: str, raw: str) -> Any:
    if raw == "null":
        return None
    if raw.startswith("'"):
        text = raw[1:-1].replace("''", "'")
        if typ in ("json", "jsonb"):
            with contextlib.suppress(ValueError):
                return json.loads(text)
        return text
    if typ in _INT_TYPES:
        return int(raw)
    if typ in _FLOAT_TYPES or typ.startswith("numeric"):
        try:
            return float(raw) if typ in _FLOAT_TYPES else json.loads(raw)
        except ValueError:
            return raw
    if typ == "boolean":
        return raw == "true"
    return raw


def parse_change(data: str) -> dict[str, Any] | None:
    """A test_decoding change line as {table, op, data[, old]}; None for BEGIN/COMMIT/other."""
    m = _CHANGE_RE.match(data)
    if m is None:
        return None
    table, op, rest = m.group("table"), m.group("op").lower(), m.group("rest")
    out: dict[str, Any] = {"table": table.replace('"', ""), "op": op}
    if rest.startswith("old-key: "):
        old_part, _, new_part = rest[len("old-key: ") :].partition(" new-tuple: ")
        out["old"] = _columns(old_part)
        rest = new_part
    if rest.startswith("(no-tuple-data)"):
        out["data"] = {}
    else:
        out["data"] = _columns(rest)
    return out


def _columns(text: str) -> dict[str, Any]:
    return {
        m.group("name").strip('"').replace('""', '"'): _value(m.group("type"), m.group("value"))
        for m in _COL_RE.finditer(text)
    }


@dataclass(frozen=True)
class _Change:
    commit: int  # commit LSN of the transaction
    index: int  # position in the transaction
    size: int  # changes in the transaction
    change: dict[str, Any]
    lsn: str  # the change's own LSN

    @property
    def position(self) -> tuple[int, int]:
        return (self.commit, self.index)


class PostgresCDCConfig(SourceConfig):
    """Row changes of PostgreSQL tables through a logical replication slot (test_decoding)."""

    type: Literal["postgres_cdc"] = "postgres_cdc"
    url: str = Field(
        description="libpq URL of a role with REPLICATION; a password as a ${env:...} reference."
    )
    slot: str = Field(
        default="conveyor",
        description="Logical replication slot (created with test_decoding at start when missing).",
    )
    tables: list[str] = Field(
        default_factory=list,
        description="Only changes of these tables ('schema.table'); empty: every table.",
    )
    destinations: dict[str, str] = Field(
        default_factory=dict, description="'schema.table' -> topic: the destination per table."
    )
    poll_interval_ms: int = Field(
        default=200, ge=10, le=60_000, description="Pause between peeks while idle."
    )

    @field_validator("slot")
    @classmethod
    def _slot_ok(cls, v: str) -> str:
        if not _SLOT_RE.match(v):
            raise ValueError("a slot name is 1-63 lower case letters, digits and underscores")
        return v

    @field_validator("destinations")
    @classmethod
    def _topics_ok(cls, v: dict[str, str]) -> dict[str, str]:
        for table, topic in v.items():
            if topic_problem(topic):
                raise ValueError(f"{table}: {topic_problem(topic)}")
        return v

    def asset_key_path(self) -> list[str]:
        if len(self.tables) == 1:
            schema, _, table = self.tables[0].rpartition(".")
            return ["postgres", schema or "public", table]
        return ["postgres", "cdc", self.slot]

    def kind(self) -> str:
        return "postgres"


class PostgresCDCSource(Source):
    """Peeks a logical slot; advances it in commit, never in poll."""

    config_class = PostgresCDCConfig
    mode: ClassVar[SourceMode] = SourceMode.CDC
    config: PostgresCDCConfig

    def __init__(self, config: SourceConfig):
        super().__init__(config)
        self._conn: Any = None

    @property
    def column_routing(self) -> bool:
        return bool(self.config.destinations)

    def _connect(self) -> Any:
        import psycopg2

        if self._conn is not None and not self._conn.closed:
            return self._conn
        try:
            self._conn = psycopg2.connect(
                self.config.url, application_name="conveyor-cdc", connect_timeout=10
            )
        except psycopg2.OperationalError as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "authentication" in msg or "does not exist" in msg:
                raise PermanentSourceError(f"cannot connect to PostgreSQL: {msg}") from None
            raise TransientSourceError(f"cannot connect to PostgreSQL: {msg}") from None
        self._conn.autocommit = True
        return self._conn

    def _run(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        import psycopg2

        conn = self._connect()
        try:
            with conn.cursor() as cur:
                cur.execute(sql, args)
                return list(cur.fetchall()) if cur.description else []
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
            self.close()
            raise TransientSourceError(
                f"PostgreSQL: {str(e).strip() or type(e).__name__}"
            ) from None
        except psycopg2.Error as e:
            raise PermanentSourceError(
                f"PostgreSQL slot {self.config.slot}: {str(e).strip()}"
            ) from None

    def init(self, state: State | None) -> None:
        level = self._run("SHOW wal_level")[0][0]
        if level != "logical":
            raise PermanentSourceError(
                f"PostgreSQL has wal_level={level}; CDC needs wal_level=logical"
            )
        found = self._run(
            "SELECT plugin FROM pg_replication_slots WHERE slot_name = %s", (self.config.slot,)
        )
        if not found:
            self._run(
                "SELECT pg_create_logical_replication_slot(%s, 'test_decoding')",
                (self.config.slot,),
            )
        elif found[0][0] != "test_decoding":
            raise PermanentSourceError(
                f"slot {self.config.slot} uses the plugin {found[0][0]}, not test_decoding"
            )

    def _peek(self, limit: int) -> list[tuple[str, int, str]]:
        return [
            (r[0], int(r[1]) if r[1] is not None else 0, r[2])
            for r in self._run(
                "SELECT lsn::text, xid::text::bigint, data FROM pg_logical_slot_peek_changes(%s, NULL, %s)",
                (self.config.slot, limit),
            )
        ]

    def _changes(self, rows: list[tuple[str, int, str]]) -> list[_Change]:
        """The changes of complete transactions, in commit order."""
        out: list[_Change] = []
        pending: list[tuple[dict[str, Any], str]] = []
        for lsn, _xid, data in rows:
            if data.startswith("BEGIN"):
                pending = []
            elif data.startswith("COMMIT"):
                commit = parse_lsn(lsn)
                out.extend(
                    _Change(commit, i, len(pending), c, change_lsn)
                    for i, (c, change_lsn) in enumerate(pending)
                )
                pending = []
            else:
                change = parse_change(data)
                if change is not None:
                    pending.append((change, lsn))
        return out

    def _state(self, last: _Change, safe: int | None) -> State:
        """Position of ``last``; ``safe``: commit LSN of the last transaction covered completely."""
        done = last.index + 1 >= last.size
        safe = last.commit if done else safe
        return {
            "commit_lsn": format_lsn(last.commit),
            "index": last.index,
            "safe_lsn": None if safe is None else format_lsn(safe),
        }

    def poll(self, state: State | None, max_records: int, max_wait_s: float) -> Polled | None:
        covered = (parse_lsn(state["commit_lsn"]), int(state["index"])) if state else (-1, -1)
        safe = parse_lsn(state["safe_lsn"]) if state and state.get("safe_lsn") else None
        deadline = time.monotonic() + max_wait_s
        limit = max(max_records, 16)
        while True:
            rows = self._peek(limit)
            fresh = [c for c in self._changes(rows) if c.position > covered]
            if fresh:
                break
            if len(rows) >= limit:
                limit *= 4  # the slot lags behind the stored state (a commit is owed): peek further
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(left, self.config.poll_interval_ms / 1000))
        taken: list[_Change] = []
        messages: list[SourceMessage] = []
        for c in fresh:
            if len(messages) >= max_records:
                break
            taken.append(c)
            if c.index + 1 >= c.size:
                safe = c.commit
            if self.config.tables and c.change["table"] not in self.config.tables:
                continue  # the position moves past other tables' changes
            payload = {
                **c.change,
                "lsn": c.lsn,
                "commit_lsn": format_lsn(c.commit),
                "index": c.index,
            }
            messages.append(
                SourceMessage(
                    payload=json.dumps(payload, separators=(",", ":"), default=str).encode(),
                    destination=self.config.destinations.get(c.change["table"]),
                )
            )
        return Polled(messages, self._state(taken[-1], safe), origin=self.config.slot)

    def commit(self, state: State) -> None:
        """Advance the slot to the last transaction the state covers completely (idempotent)."""
        if not state.get("safe_lsn"):
            return
        target = parse_lsn(state["safe_lsn"])
        current = self._run(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (self.config.slot,),
        )
        if not current:
            raise PermanentSourceError(f"replication slot {self.config.slot} is gone")
        if current[0][0] and parse_lsn(current[0][0]) >= target:
            return
        self._run(
            "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
            (self.config.slot, format_lsn(target)),
        )

    def close(self) -> None:
        c, self._conn = self._conn, None
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()
