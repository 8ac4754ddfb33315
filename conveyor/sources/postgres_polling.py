"""PostgreSQL polling source: rows of a table past an incrementing or timestamp column."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from conveyor.core.errors import ConfigError, PermanentSourceError, TransientSourceError
from conveyor.core.routing import SourceMode, topic_problem
from conveyor.sources.base import Polled, Source, SourceConfig, SourceMessage, State

log = logging.getLogger("conveyor.sources.postgres")


class PostgresPollingConfig(SourceConfig):
    """Reads new rows of one table in the order of a column that only grows."""

    type: Literal["postgres_polling"] = "postgres_polling"
    url: str = Field(
        description="libpq URL, e.g. postgresql://user@host:5432/db; a password as a ${env:...} reference."
    )
    table: str = Field(description="Table to read, 'schema.table' or 'table' (schema public).")
    incrementing_column: str | None = Field(
        default=None,
        description="A column that grows with every new row (a serial id). Give this or timestamp_column.",
    )
    timestamp_column: str | None = Field(
        default=None,
        description="A timestamp column set when a row is written; rows are read in its order (strictly after "
        "the last one read: rows written later with an equal timestamp are not read).",
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
        description="DELETE the rows read, in commit (after the batch is stored), never in poll.",
    )
    processed_column: str | None = Field(
        default=None,
        description="Boolean column set to true on the rows read, in commit (after the batch is stored).",
    )
    poll_interval_ms: int = Field(
        default=200,
        ge=10,
        le=60_000,
        description="Pause between queries while the table has no new rows.",
    )

    @model_validator(mode="after")
    def _one_position(self) -> PostgresPollingConfig:
        if (self.incrementing_column is None) == (self.timestamp_column is None):
            raise ValueError("give exactly one of incrementing_column and timestamp_column")
        if self.destination is not None and self.destination_column is not None:
            raise ValueError("give destination or destination_column, not both")
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


class PostgresPollingSource(Source):
    """Polls a PostgreSQL table; deletes or marks the rows read in commit when configured."""

    config_class = PostgresPollingConfig
    mode: ClassVar[SourceMode] = SourceMode.POLLING
    config: PostgresPollingConfig

    def __init__(self, config: SourceConfig):
        super().__init__(config)
        self._conn: Any = None

    @property
    def destructive(self) -> bool:
        return self.config.delete_after_read or self.config.processed_column is not None

    @property
    def column_routing(self) -> bool:
        return self.config.destination is not None or self.config.destination_column is not None

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

    def init(self, state: State | None) -> None:
        c = self.config
        schema, table = c.schema_table
        wanted = [
            col
            for col in (c.position_column, c.destination_column, c.key_column, c.processed_column)
            if col is not None
        ]

        def check(cur: Any) -> None:
            cur.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = %s",
                (schema, table),
            )
            have = {r[0] for r in cur.fetchall()}
            if not have:
                raise PermanentSourceError(
                    f"table {schema}.{table} does not exist (or has no columns)"
                )
            missing = [col for col in wanted if col not in have]
            if missing:
                raise PermanentSourceError(
                    f"table {schema}.{table} has no column {', '.join(missing)}"
                )

        self._run(check)

    # -- poll / commit -----------------------------------------------------------------------

    def _query(self, state: State | None, limit: int) -> tuple[Any, list[Any]]:
        from psycopg2 import sql

        c = self.config
        schema, table = c.schema_table
        pos = sql.Identifier(c.position_column)
        payload: sql.Composable = sql.SQL("to_jsonb(t)")
        if c.destination_column and c.strip_routing_columns:
            payload = sql.SQL("(to_jsonb(t) - {})").format(sql.Literal(c.destination_column))
        dest = (
            sql.SQL("t.{}::text").format(sql.Identifier(c.destination_column))
            if c.destination_column
            else sql.SQL("NULL")
        )
        key = (
            sql.SQL("t.{}::text").format(sql.Identifier(c.key_column))
            if c.key_column
            else sql.SQL("NULL")
        )
        where = sql.SQL("")
        args: list[Any] = []
        if state is not None and state.get("last") is not None:
            where = sql.SQL("WHERE t.{} > %s").format(pos)
            args.append(state["last"])
        q = sql.SQL(
            "SELECT {payload}::text, {dest}, {key}, t.{pos}, "
            "(extract(epoch from clock_timestamp()) * 1000)::bigint FROM {tbl} AS t {where} ORDER BY t.{pos} LIMIT %s"
        ).format(
            payload=payload,
            dest=dest,
            key=key,
            pos=pos,
            tbl=sql.Identifier(schema, table),
            where=where,
        )
        args.append(limit)

        def fetch(cur: Any) -> list[Any]:
            cur.execute(q, args)
            return list(cur.fetchall())

        return q, self._run(fetch)

    def poll(self, state: State | None, max_records: int, max_wait_s: float) -> Polled | None:
        deadline = time.monotonic() + max_wait_s
        while True:
            _, rows = self._query(state, max_records)
            if rows:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(left, self.config.poll_interval_ms / 1000))
        c = self.config
        last = rows[-1][3]
        if self.config.timestamp_column is not None:
            last = last.isoformat() if hasattr(last, "isoformat") else str(last)
        messages = [
            SourceMessage(
                payload=r[0].encode(),
                destination=c.destination if c.destination is not None else r[1],
                key=r[2].encode() if r[2] is not None else None,
                timestamp_ms=int(r[4]),
            )
            for r in rows
        ]
        schema, table = c.schema_table
        return Polled(messages, {"last": _jsonable(last)}, origin=f"{schema}.{table}")

    def commit(self, state: State) -> None:
        from psycopg2 import sql

        c = self.config
        if not self.destructive or state.get("last") is None:
            return
        schema, table = c.schema_table
        pos = sql.Identifier(c.position_column)
        if c.delete_after_read:
            q = sql.SQL("DELETE FROM {} WHERE {} <= %s").format(sql.Identifier(schema, table), pos)
        else:
            assert c.processed_column is not None
            col = sql.Identifier(c.processed_column)
            q = sql.SQL("UPDATE {} SET {} = true WHERE {} <= %s AND {} IS NOT TRUE").format(
                sql.Identifier(schema, table), col, pos, col
            )
        self._run(lambda cur: cur.execute(q, (state["last"],)))

    def close(self) -> None:
        self._drop()


def _jsonable(v: Any) -> Any:
    if isinstance(v, (int, float, str)) or v is None:
        return v
    try:
        json.dumps(v)
        return v
    except TypeError:
        return str(v)
