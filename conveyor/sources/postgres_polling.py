"""PostgreSQL polling source: rows of a table in the order of a position column and key."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from conveyor.core.connection import SECRET_FIELD
from conveyor.core.engine.routing import SourceMode, topic_problem
from conveyor.core.errors import (
    ConfigError,
    PermanentSourceError,
    TransientSourceError,
    rule,
)
from conveyor.sources.base import Polled, Source, SourceConfig, SourceMessage, State

log = logging.getLogger("conveyor.sources.postgres")

_XID_SPACE = 1 << 32


class PostgresPollingConfig(SourceConfig):
    """Reads the rows of one table in the order of a position column (incrementing or
    timestamp), then the row's key (the primary key or `unique_key`), so rows of an equal
    position are never skipped. Without `delete_after_read` / `processed_column` the state is
    the last (position, key) read and a poll reads strictly after it, up to a visibility
    horizon from the poll's own snapshot (`pg_current_snapshot()`): a batch ends before the
    first row written by a transaction not older than the oldest one still running (its xid
    not below the snapshot's xmin), since that one may still commit a lower position. An open
    transaction that has written anything in the cluster so holds back the rows written after
    it (a delay, never a loss); xid wraparound and rows frozen by VACUUM FREEZE are handled.
    The horizon cannot see a position taken before its transaction first wrote (`SELECT
    nextval()` and the INSERT later, a sequence with CACHE > 1, a timestamp from now() in a
    transaction that read first) and committed after a higher one was read: that row is
    skipped. `delay_ms` covers those that commit within it (timestamp column); where it
    matters, use the destructive modes or `postgres_cdc`. With `delete_after_read` or
    `processed_column` (and `destructive: true`) a poll reads every row left (not marked),
    with no lower bound, so a row is read whenever it commits, however late; the state holds
    each row read (its key and row version, `xmin`) and commit deletes or marks exactly those
    rows, never a range: a row changed after it was read is kept and read again, and a commit
    re-run after a crash touches nothing else. A commit that fails and is overtaken by the
    next batch leaves its rows to be read again (duplicates, never a loss). Rows with a NULL
    position are read only by the destructive modes. The table must be a table, not a view.
    State version 2: a version-1 state refuses to start (`conveyor connector reset-state`; a
    non-destructive source then reads the table from its start)."""

    type: Literal["postgres_polling"] = "postgres_polling"
    url: str = Field(
        description="libpq URL, e.g. postgresql://user:${file:/run/secrets/pg}@127.0.0.1:5432/db "
        "(secret; a password in it must be a reference).",
        json_schema_extra=SECRET_FIELD,
    )
    table: str = Field(description="Table to read, 'schema.table' or 'table' (schema public).")
    incrementing_column: str | None = Field(
        default=None,
        description="A column that grows with every new row (a serial id). Give this or timestamp_column.",
    )
    timestamp_column: str | None = Field(
        default=None,
        description="A timestamp column set when a row is written; rows are read in (timestamp, key) "
        "order and a poll resumes strictly after the last (timestamp, key) read, so rows of an equal "
        "timestamp are all read. Needs a key (the primary key or unique_key).",
    )
    unique_key: list[str] | None = Field(
        default=None,
        description="Columns that identify a row (NOT NULL, covered by a unique index): the order "
        "after the position column and what destructive commits match. Default: the primary key. "
        "Required (or a primary key) with timestamp_column, delete_after_read and processed_column.",
    )
    delay_ms: int = Field(
        default=0,
        ge=0,
        le=86_400_000,
        description="timestamp_column only: read a row only once its timestamp is this much older "
        "than the poll's transaction (Kafka Connect's timestamp.delay.interval.ms), for transactions "
        "whose timestamp was taken before they first wrote.",
    )
    destination: str | None = Field(
        default=None, description="Topic of every row of this table (per-table routing)."
    )
    destination_column: str | None = Field(
        default=None,
        description="Column whose value is the row's destination topic (column-derived routing).",
    )
    key_column: str | None = Field(
        default=None,
        description="Column whose value is the Kafka key (partition key); NULL means no key.",
    )
    strip_routing_columns: bool = Field(
        default=True, description="Leave destination_column out of the payload."
    )
    destructive: bool = Field(
        default=False,
        description="Confirms that commit may change the table (delete_after_read, processed_column); "
        "without it those options refuse to start.",
    )
    delete_after_read: bool = Field(
        default=False,
        description="DELETE the rows read (by key and row version), in commit (after the batch is "
        "stored), never in poll.",
    )
    processed_column: str | None = Field(
        default=None,
        description="Boolean column set to true on the rows read (by key and row version), in commit "
        "(after the batch is stored); rows where it is true are not read. An index WHERE NOT it "
        "keeps polls cheap on a large table.",
    )
    poll_interval_ms: int = Field(
        default=200,
        ge=10,
        le=60_000,
        description="Pause between queries while the table has no new rows.",
    )

    @field_validator("unique_key")
    @classmethod
    def _key_names(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or any(not c.strip() for c in v) or len(set(v)) != len(v)):
            raise ValueError("unique_key: give one or more distinct, non-empty column names")
        return v

    @model_validator(mode="after")
    def _one_position(self) -> PostgresPollingConfig:
        rule(
            (self.incrementing_column is None) != (self.timestamp_column is None),
            "give exactly one of incrementing_column and timestamp_column",
            field="incrementing_column",
        )
        rule(
            not (self.delay_ms and self.timestamp_column is None),
            "delay_ms applies to timestamp_column only",
            field="delay_ms",
        )
        rule(
            not (self.delay_ms and (self.delete_after_read or self.processed_column)),
            "delay_ms is not needed with delete_after_read or processed_column (every row left "
            "is read, however late it commits)",
            field="delay_ms",
        )
        rule(
            self.destination is None or self.destination_column is None,
            "give destination or destination_column, not both",
            field="destination",
        )
        if self.destination is not None and topic_problem(self.destination):
            raise ValueError(f"destination: {topic_problem(self.destination)}")
        return self

    @property
    def schema_table(self) -> tuple[str, str]:
        schema, _, table = self.table.rpartition(".")
        return (schema or "public", table)

    @property
    def position_column(self) -> str:
        col = self.incrementing_column or self.timestamp_column
        assert col is not None
        return col

    def asset_key_path(self) -> list[str]:
        schema, table = self.schema_table
        return ["postgres", schema, table]

    def kind(self) -> str:
        return "postgres"


def recent_xmin(xmin: Any, lo: Any, hi: Any) -> Any:
    """SQL: whether a visible row's inserting xid ``xmin`` (32-bit) is in ``[lo, hi)``, the xid8
    xmin and xmax of the snapshot that sees it: a transaction older than it may be running.

    Distances are taken back from ``hi`` modulo 2^32: a committed, unfrozen xid is within 2^31
    of it (PostgreSQL's wraparound limit). A frozen row keeps its raw xmin, which may be any
    number of epochs old: it reads as recent only if its low 32 bits fall in ``[lo, hi)``, and
    then only until the transactions running now end. Xids below 3 (frozen, bootstrap) are old.
    """
    from psycopg2 import sql

    return sql.SQL(
        "({x} >= 3 AND mod(mod({hi}, {n}) - {x} + {n}, {n}) BETWEEN 1 AND ({hi}) - ({lo}))"
    ).format(x=xmin, lo=lo, hi=hi, n=sql.Literal(_XID_SPACE))


class PostgresPollingSource(Source):
    """Polls a PostgreSQL table; deletes or marks exactly the rows read in commit when configured."""

    config_class = PostgresPollingConfig
    mode: ClassVar[SourceMode] = SourceMode.POLLING
    # 2: the state is the last row's position and key ({"last": {...}}) and, when destructive,
    # the rows read ({"read": [[key..., xmin], ...]}); version 1 was a bare position.
    state_version: ClassVar[int] = 2
    config: PostgresPollingConfig

    def __init__(self, config: SourceConfig):
        super().__init__(config)
        self._conn: Any = None
        self._key: list[str] = []
        self._held_since: float | None = None
        self._warned_at = 0.0

    @property
    def destructive(self) -> bool:
        return self.config.delete_after_read or self.config.processed_column is not None

    @property
    def column_routing(self) -> bool:
        return self.config.destination is not None or self.config.destination_column is not None

    @property
    def _order(self) -> list[str]:
        pos = self.config.position_column
        return [pos, *(k for k in self._key if k != pos)]

    def validate(self) -> None:
        c = self.config
        if self.destructive and not c.destructive:
            which = "delete_after_read" if c.delete_after_read else "processed_column"
            raise ConfigError(
                f"{which} changes the table in commit, but this source is not declared destructive "
                "(set destructive: true to confirm)",
                field=f"source.{which}",
            )
        if c.delete_after_read and c.processed_column:
            raise ConfigError(
                "give delete_after_read or processed_column, not both",
                field="source.processed_column",
            )

    # -- connection ----------------------------------------------------------------------

    def _connect(self) -> Any:
        import psycopg2

        if self._conn is not None and not self._conn.closed:
            return self._conn
        try:
            self._conn = psycopg2.connect(
                self.config.url, application_name="conveyor-source", connect_timeout=10
            )
        except psycopg2.OperationalError as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "authentication" in msg or "does not exist" in msg or "password" in msg:
                raise PermanentSourceError(f"cannot connect to PostgreSQL: {msg}") from None
            raise TransientSourceError(f"cannot connect to PostgreSQL: {msg}") from None
        self._conn.autocommit = False
        return self._conn

    def _run(self, fn: Any) -> Any:
        import psycopg2

        conn = self._connect()
        try:
            with conn, conn.cursor() as cur:
                return fn(cur)
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
            self._drop()
            raise TransientSourceError(
                f"PostgreSQL: {str(e).strip().splitlines()[0] if str(e).strip() else e}"
            ) from None
        except psycopg2.Error as e:
            raise PermanentSourceError(
                f"PostgreSQL {self.config.table}: {str(e).strip()}"
            ) from None

    def _drop(self) -> None:
        c, self._conn = self._conn, None
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()

    # -- init: the table, its columns and its key ---------------------------------------------

    def init(self, state: State | None) -> None:
        c = self.config
        schema, table = c.schema_table
        wanted = [
            col
            for col in (c.position_column, c.destination_column, c.key_column, c.processed_column)
            if col is not None
        ]

        def check(cur: Any) -> list[str]:
            cur.execute(
                "SELECT c.oid, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relname = %s",
                (schema, table),
            )
            found = cur.fetchone()
            if found is None:
                raise PermanentSourceError(f"table {schema}.{table} does not exist")
            if found[1] not in ("r", "p"):
                raise ConfigError(
                    f"{schema}.{table} is not a table (a view has no row versions to read by)",
                    field="source.table",
                )
            cols = _columns(cur, found[0])
            missing = [col for col in wanted + (c.unique_key or []) if col not in cols]
            if missing:
                raise PermanentSourceError(
                    f"table {schema}.{table} has no column {', '.join(missing)}"
                )
            if c.processed_column and cols[c.processed_column][0] != "boolean":
                raise ConfigError(
                    f"column {c.processed_column} is {cols[c.processed_column][0]}, not boolean",
                    field="source.processed_column",
                )
            return self._resolve_key(cur, found[0], cols)

        self._key = self._run(check)

    def _resolve_key(self, cur: Any, oid: int, cols: dict[str, tuple[str, bool]]) -> list[str]:
        """The configured unique_key (checked: NOT NULL, a unique index within it) or the primary key."""
        c = self.config
        where = f"{c.schema_table[0]}.{c.schema_table[1]}"
        cur.execute(
            "SELECT i.indisprimary, array_agg(a.attname ORDER BY k.n) FROM pg_index i "
            "CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, n) "
            "LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            "WHERE i.indrelid = %s AND i.indisunique AND i.indpred IS NULL AND i.indimmediate "
            "AND k.n <= i.indnkeyatts "  # not the INCLUDE columns"
            "GROUP BY i.indexrelid, i.indisprimary",
            (oid,),
        )
        indexes = [
            (bool(p), [n for n in names if n is not None], None in names) for p, names in cur
        ]
        if c.unique_key is not None:
            nullable = [k for k in c.unique_key if not cols[k][1]]
            if nullable:
                raise ConfigError(
                    f"unique_key column {', '.join(nullable)} of {where} may be NULL",
                    field="source.unique_key",
                )
            if not any(not expr and set(ix) <= set(c.unique_key) for _, ix, expr in indexes):
                raise ConfigError(
                    f"no unique index of {where} lies within ({', '.join(c.unique_key)})",
                    field="source.unique_key",
                )
            return list(c.unique_key)
        primary = next((ix for p, ix, _ in indexes if p), [])
        if not primary and (self.destructive or c.timestamp_column is not None):
            raise ConfigError(
                f"{where} has no primary key: give unique_key (a timestamp column and destructive "
                "commits need a key to order and to match the rows read)",
                field="source.unique_key",
            )
        return primary

    # -- poll ----------------------------------------------------------------------------

    def _query(self, state: State | None, limit: int) -> Any:
        """One statement (one snapshot): the rows after ``state``, each with its position
        object, row version and, when not destructive, whether it is past the horizon."""
        from psycopg2 import sql

        c = self.config
        tbl = sql.Identifier(*c.schema_table)
        payload: sql.Composable = sql.SQL("to_jsonb(t)")
        if c.destination_column and c.strip_routing_columns:
            payload = sql.SQL("(to_jsonb(t) - {})").format(sql.Literal(c.destination_column))
        dest, key = (
            sql.SQL("t.{}::text").format(sql.Identifier(col)) if col else sql.SQL("NULL")
            for col in (c.destination_column, c.key_column)
        )
        position = sql.SQL("jsonb_build_object({})::text").format(
            sql.SQL(", ").join(
                sql.SQL("{}, t.{}").format(sql.Literal(col), sql.Identifier(col))
                for col in self._order
            )
        )
        where, args = self._where(state)
        recent = (
            sql.SQL("false")
            if self.destructive
            else recent_xmin(sql.SQL("t.xmin::text::bigint"), sql.SQL("h.lo"), sql.SQL("h.hi"))
        )
        order = sql.SQL(", ").join(sql.SQL("t.{}").format(sql.Identifier(o)) for o in self._order)
        return sql.SQL(
            "SELECT {payload}::text, {dest}, {key}, {position}, t.xmin::text, {recent}, "
            "(extract(epoch from clock_timestamp()) * 1000)::bigint "
            "FROM {tbl} AS t, (SELECT pg_snapshot_xmin(s)::text::bigint AS lo, "
            "pg_snapshot_xmax(s)::text::bigint AS hi FROM pg_current_snapshot() AS s) AS h "
            "WHERE {where} ORDER BY {order} LIMIT %s"
        ).format(
            payload=payload,
            dest=dest,
            key=key,
            position=position,
            recent=recent,
            tbl=tbl,
            where=where,
            order=order,
        ), [*args, limit]

    def _where(self, state: State | None) -> tuple[Any, list[Any]]:
        """Destructive: every row left but those ``state`` read. Otherwise: strictly after the
        last (position, key) read, not NULL, and older than ``delay_ms``."""
        from psycopg2 import sql

        c = self.config
        pos = sql.Identifier(c.position_column)
        if self.destructive:
            parts: list[sql.Composable] = []
            args: list[Any] = []
            if c.processed_column:
                parts.append(sql.SQL("t.{} IS NOT TRUE").format(sql.Identifier(c.processed_column)))
            read = (state or {}).get("read") or []
            if read:
                rows, rargs = self._read_rows(read)
                parts.append(
                    sql.SQL("NOT EXISTS (SELECT 1 FROM {} WHERE {})").format(rows, self._match())
                )
                args += rargs
            return (sql.SQL(" AND ").join(parts) if parts else sql.SQL("true")), args
        parts = [sql.SQL("t.{} IS NOT NULL").format(pos)]
        args = []
        last = (state or {}).get("last")
        if last:
            cols = [sql.Identifier(o) for o in self._order]
            parts.append(
                sql.SQL(
                    "({}) > (SELECT {} FROM jsonb_populate_record(NULL::{}, %s::jsonb) AS l)"
                ).format(
                    sql.SQL(", ").join(sql.SQL("t.{}").format(col) for col in cols),
                    sql.SQL(", ").join(sql.SQL("l.{}").format(col) for col in cols),
                    sql.Identifier(*c.schema_table),
                )
            )
            args.append(json.dumps(last))
        if c.delay_ms:
            parts.append(sql.SQL("t.{} <= now() - %s * interval '1 millisecond'").format(pos))
            args.append(c.delay_ms)
        return sql.SQL(" AND ").join(parts), args

    def _read_rows(self, read: list[Any]) -> tuple[Any, list[Any]]:
        """SQL: the rows a state read as ``r(e, x)`` (key object, row version) and ``k`` (the key
        typed as the table's columns), with its two parameters."""
        from psycopg2 import sql

        keys = [dict(zip(self._key, row[:-1], strict=True)) for row in read]
        xmins = [str(int(row[-1])) for row in read]
        frm = sql.SQL(
            "ROWS FROM (jsonb_array_elements(%s::jsonb), unnest(%s::text[]::xid[])) AS r(e, x), "
            "LATERAL jsonb_populate_record(NULL::{}, r.e) AS k"
        ).format(sql.Identifier(*self.config.schema_table))
        return frm, [json.dumps(keys), xmins]

    def _match(self) -> Any:
        from psycopg2 import sql

        return sql.SQL(" AND ").join(
            [
                *(sql.SQL("t.{0} = k.{0}").format(sql.Identifier(k)) for k in self._key),
                sql.SQL("t.xmin = r.x"),
            ]
        )

    def poll(self, state: State | None, max_records: int, max_wait_s: float) -> Polled | None:
        deadline = time.monotonic() + max_wait_s
        q, args = self._query(state, max_records)
        while True:
            rows = self._run(lambda cur: (cur.execute(q, args), cur.fetchall())[1])
            held = next((i for i, r in enumerate(rows) if r[5]), None)
            if held is not None:
                # Written by a transaction not older than the snapshot's xmin: one still running
                # may commit a lower position. Read up to it, and it next time.
                rows = rows[:held]
            self._note_held(held == 0)
            if rows:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(left, self.config.poll_interval_ms / 1000))
        return self._polled(rows)

    def _note_held(self, held: bool) -> None:
        """Warn (once a minute) while the horizon holds every new row back: a transaction that
        wrote and stays open (idle in transaction, a prepared transaction) delays the source."""
        now = time.monotonic()
        if not held:
            self._held_since = None
            return
        if self._held_since is None:
            self._held_since = self._warned_at = now
        elif now - self._warned_at >= 60:
            self._warned_at = now
            log.warning(
                "%s: new rows held back for %.0f s by a transaction still open since before they "
                "were written (pg_stat_activity.backend_xid, pg_prepared_xacts); not lost: they "
                "are read once it ends",
                self.describe(),
                now - self._held_since,
            )

    def _polled(self, rows: list[Any]) -> Polled:
        c = self.config
        messages = [
            SourceMessage(
                payload=r[0].encode(),
                destination=c.destination if c.destination is not None else r[1],
                key=r[2].encode() if r[2] is not None else None,
                timestamp_ms=int(r[6]),
            )
            for r in rows
        ]
        state: State = {"last": _exact_json(rows[-1][3])}
        if self.destructive:
            state["read"] = [
                [*(pos[k] for k in self._key), int(r[4])]
                for r, pos in ((r, _exact_json(r[3])) for r in rows)
            ]
        schema, table = c.schema_table
        return Polled(messages, state, origin=f"{schema}.{table}")

    # -- commit --------------------------------------------------------------------------

    def commit(self, state: State) -> None:
        from psycopg2 import sql

        c = self.config
        read = state.get("read") or []
        if not self.destructive or not read:
            return
        rows, args = self._read_rows(read)
        tbl = sql.Identifier(*c.schema_table)
        if c.delete_after_read:
            q = sql.SQL("DELETE FROM {} AS t USING {} WHERE {}").format(tbl, rows, self._match())
        else:
            assert c.processed_column is not None
            q = sql.SQL("UPDATE {tbl} AS t SET {col} = true FROM {rows} WHERE {match}").format(
                tbl=tbl, col=sql.Identifier(c.processed_column), rows=rows, match=self._match()
            )
        self._run(lambda cur: cur.execute(q, args))

    def close(self) -> None:
        self._drop()


def _columns(cur: Any, oid: int) -> dict[str, tuple[str, bool]]:
    """Column name -> (type, NOT NULL) of a table."""
    cur.execute(
        "SELECT attname, format_type(atttypid, atttypmod), attnotnull FROM pg_attribute "
        "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
        (oid,),
    )
    return {name: (typ, bool(notnull)) for name, typ, notnull in cur}


def _exact_json(text: str) -> Any:
    """JSON text with its fractional numbers kept as their digits (no float rounding of a key)."""
    return json.loads(text, parse_float=str)
