"""The PostgreSQL CDC source's normal connection: queries in the session settings the value
decoder expects, the catalog (a table's columns and key), the value decoder, the database."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from conveyor.core.errors import PermanentSourceError, TransientSourceError
from conveyor.sources.postgres_cdc_changes import TableInfo
from conveyor.sources.postgres_cdc_config import PostgresCDCConfig

# Session settings of every connection: the text forms the value decoder expects.
SESSION_OPTIONS = (
    "-c TimeZone=UTC -c IntervalStyle=iso_8601 -c DateStyle=ISO "
    "-c extra_float_digits=3 -c bytea_output=hex"
)


class CDCCatalog:
    """Connections to the database and what the catalog says; ``on_broken`` runs when the
    connection fails (the source closes everything, the retry starts afresh)."""

    def __init__(self, config: PostgresCDCConfig, on_broken: Callable[[], None]):
        self.config = config
        self._on_broken = on_broken
        self._conn: Any = None  # normal connection: catalog, publication, types
        self._decoder: Any = None
        self._tables: dict[str, TableInfo] = {}
        self._dbname: str | None = None

    def connect(self, **kw: Any) -> Any:
        import psycopg2

        try:
            conn = psycopg2.connect(
                self.config.url,
                application_name="conveyor-cdc",
                connect_timeout=10,
                options=SESSION_OPTIONS,
                **kw,
            )
        except psycopg2.OperationalError as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "authentication" in msg or "does not exist" in msg or "permission" in msg:
                raise PermanentSourceError(f"cannot connect to PostgreSQL: {msg}") from None
            raise TransientSourceError(f"cannot connect to PostgreSQL: {msg}") from None
        if not kw:
            conn.autocommit = True
        return conn

    def run(self, sql: Any, args: tuple[Any, ...] = (), conn: Any = None) -> list[Any]:
        import psycopg2

        if conn is None:
            if self._conn is None or self._conn.closed:
                self._conn = self.connect()
            conn = self._conn
        try:
            with conn.cursor() as cur:
                cur.execute(sql, args)
                return list(cur.fetchall()) if cur.description else []
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
            self._on_broken()
            raise TransientSourceError(f"PostgreSQL: {first_line(e)}") from None
        except psycopg2.Error as e:
            raise PermanentSourceError(
                f"PostgreSQL ({self.config.slot}): {first_line(e)}"
            ) from None

    def decoder(self) -> Any:
        from conveyor.sources.pgoutput import PgType, ValueDecoder

        if self._decoder is None:

            def lookup(oid: int) -> PgType | None:
                rows = self.run(ValueDecoder.TYPE_QUERY, (oid,))
                return PgType.from_row(tuple(rows[0])) if rows else None

            self._decoder = ValueDecoder(lookup, json_text=self.config.json_text)
        return self._decoder

    def table(self, name: str) -> TableInfo:
        """Columns and key of a table (catalog, cached); a table without a key is refused."""
        if name in self._tables:
            return self._tables[name]
        rows = self.run(
            "SELECT a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod), "
            "coalesce(a.attnum = ANY(i.indkey), false), c.relreplident::text, a.atttypmod "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
            "LEFT JOIN pg_index i ON i.indrelid = c.oid AND i.indisprimary "
            "WHERE n.nspname = %s AND c.relname = %s ORDER BY a.attnum",
            tuple(name.split(".", 1)),
        )
        if not rows:
            raise PermanentSourceError(f"table {name} does not exist")
        columns = [(r[0], r[1], r[2], r[5]) for r in rows]
        pk = [r[0] for r in rows if r[3]]
        info = TableInfo(name, columns, self._key_of(name, pk, rows[0][4], [c[0] for c in columns]))
        self._tables[name] = info
        return info

    def _key_of(self, name: str, pk: list[str], identity: str, columns: list[str]) -> list[str]:
        """key_columns, else the primary key, else every column (REPLICA IDENTITY FULL)."""
        configured = self.config.key_columns.get(name)
        if configured:
            missing = sorted(set(configured) - set(columns))
            if missing:
                raise PermanentSourceError(f"key_columns of {name}: no columns {missing}")
            if identity == "n" or (identity == "d" and not set(configured) <= set(pk)):
                raise PermanentSourceError(
                    f"key_columns of {name}: a delete carries only the replica identity; "
                    f"ALTER TABLE {name} REPLICA IDENTITY FULL"
                )
            return list(configured)
        if pk:
            return pk
        if identity == "f":
            return columns
        if identity == "i":
            return []  # the identity index's columns, from the stream's Relation message
        kind = {"d": "default", "n": "nothing"}.get(identity, identity)
        raise PermanentSourceError(
            f"table {name} has no primary key and replica identity {kind}: its changes cannot "
            f"be keyed; add a primary key, ALTER TABLE {name} REPLICA IDENTITY FULL, or set "
            f"key_columns: {{{name}: [...]}}"
        )

    def database(self) -> str:
        if self._dbname is None:
            self._dbname = str(self.run("SELECT current_database()")[0][0])
        return self._dbname

    def close(self) -> None:
        c, self._conn = self._conn, None
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()


def ident(table: str) -> Any:
    from psycopg2 import sql

    schema, _, name = table.partition(".")
    return sql.Identifier(schema, name)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def parts(table: str) -> tuple[str, str]:
    schema, _, name = table.partition(".")
    return schema, name
