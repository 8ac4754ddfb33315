"""PostgreSQL sink: the contract suite against the machine's PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest

from tests.conftest import PG_URL
from tests.sinks.contract import SinkContract, closed_port, make_batch, unique

pytestmark = pytest.mark.integration

SCHEMA = "conveyor_contract"


def _exec(sql: str, *args: Any, fetch: bool = False) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(PG_URL)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql, args or None)
            return cur.fetchall() if fetch else []
    finally:
        conn.close()


class TestPostgresContract(SinkContract):
    sink_type = "postgres"
    idempotent = True  # upsert on id
    keeps_keys = keeps_headers = keeps_timestamps = True

    def make_target(self) -> Iterator[str]:
        table = unique("orders")
        _exec(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
        _exec(
            f'CREATE TABLE "{SCHEMA}"."{table}" (id bigint PRIMARY KEY, name text NOT NULL, '
            "amount double precision CHECK (amount >= 0), k bytea, h jsonb, ts timestamptz)"
        )
        yield table
        _exec(f'DROP TABLE IF EXISTS "{SCHEMA}"."{table}"')

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "postgres",
            "url": PG_URL,
            "schema": SCHEMA,
            "table": target,
            "columns": {
                "id": "id",
                "name": "name",
                "amount": "amount",
                "k": "$key",
                "h": "$headers",
                "ts": "$timestamp",
            },
            "upsert_keys": ["id"],
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        rows = _exec(f'SELECT id, name, k, h, ts FROM "{SCHEMA}"."{target}"', fetch=True)
        return [
            {
                "id": i,
                "name": n,
                "key": bytes(k) if k is not None else None,
                "headers": {a: b.encode() for a, b in (h or {}).items()},
                "timestamp": ts,
            }
            for i, n, k, h, ts in rows
        ]

    def poison_batch(self, target: str):
        # Row 250 violates NOT NULL, row 400 the CHECK constraint.
        return make_batch(500, names={250: None}, amounts={400: -1.0}), {250, 400}

    def outage_config(self, target: str) -> dict[str, Any]:
        return {
            **self.config(target),
            "url": f"postgresql://postgres@127.0.0.1:{closed_port()}/test",
            "connect_timeout_s": 2,
        }

    bad_fields = [
        ({"table": ""}, "table"),
        ({"write_method": "insert"}, "write_method"),
        ({"connect_timeout_s": 0}, "connect_timeout_s"),
        ({"columns": {"id": "$nope"}}, "columns"),
        ({"upsert_keys": ["missing_column"]}, "upsert_keys"),
    ]


class TestPostgresAppendContract(TestPostgresContract):
    """COPY without upsert keys: a replay duplicates rows (documented)."""

    idempotent = False

    def make_target(self) -> Iterator[str]:
        table = unique("orders")
        _exec(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
        _exec(
            f'CREATE TABLE "{SCHEMA}"."{table}" (id bigint, name text NOT NULL, amount double precision CHECK (amount >= 0), k bytea, h jsonb, ts timestamptz)'
        )
        yield table
        _exec(f'DROP TABLE IF EXISTS "{SCHEMA}"."{table}"')

    def config(self, target: str) -> dict[str, Any]:
        cfg = super().config(target)
        del cfg["upsert_keys"]
        return cfg
