"""GreptimeDB sink: the contract suite against a real server given by CONVEYOR_TEST_GREPTIME_URL.

There is no GreptimeDB on the CI machine, so these tests are skipped unless the variable
is set (see docs/FULL_SUITE.md: ``docker compose up -d greptimedb`` and
``export CONVEYOR_TEST_GREPTIME_URL=http://127.0.0.1:4000``). Read-back goes through
GreptimeDB's SQL HTTP API. Config validation and line protocol are also covered without
a server in tests/unit/test_line_protocol.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sinks.contract import SinkContract, closed_port, make_batch, unique

GREPTIME_URL = os.environ.get("CONVEYOR_TEST_GREPTIME_URL", "")
DATABASE = "public"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not GREPTIME_URL,
        reason="CONVEYOR_TEST_GREPTIME_URL not set: no GreptimeDB server on this machine (see docs/FULL_SUITE.md)",
    ),
]


def _sql(statement: str) -> list[list[Any]]:
    import requests

    resp = requests.post(
        f"{GREPTIME_URL.rstrip('/')}/v1/sql",
        params={"db": DATABASE},
        data={"sql": statement},
        timeout=30,
    )
    resp.raise_for_status()
    output = resp.json().get("output") or []
    if output and "records" in output[0]:
        return output[0]["records"]["rows"]
    return []


class TestGreptimeDBContract(SinkContract):
    """Line protocol; a replay rewrites the same (tags, timestamp) rows, so there are no duplicates."""

    sink_type = "greptimedb"
    idempotent = True
    keeps_keys = True  # as the tag msg_key
    # Timestamps are the time index; how the SQL API renders them differs between versions,
    # so the suite does not compare them (precision is unit-tested).
    keeps_timestamps = False

    def make_target(self) -> Iterator[str]:
        table = unique("orders")  # created by the first write
        yield table
        _sql(f"DROP TABLE IF EXISTS {table}")

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "greptimedb",
            "url": GREPTIME_URL or "http://127.0.0.1:4000",
            "database": DATABASE,
            "measurement": target,
            "tags": {"topic": "$topic", "msg_key": "$key"},
            "precision": "ms",
            "timeout_s": 10,
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        try:
            rows = _sql(f"SELECT id, name, msg_key FROM {target}")
        except Exception:  # noqa: BLE001 - the table does not exist until a row was written
            return []
        return [
            {"id": int(i), "name": n, "key": k.encode() if k is not None else None}
            for i, n, k in rows
        ]

    def poison_batch(self, target: str):
        # Rows the line protocol cannot carry, reported by the sink before sending:
        # 250 has a raw newline in a string (newlines: reject), 400 a NaN.
        return make_batch(500, names={250: "bad\nname"}, amounts={400: float("nan")}), {250, 400}

    def outage_config(self, target: str) -> dict[str, Any]:
        return {**self.config(target), "url": f"http://127.0.0.1:{closed_port()}", "timeout_s": 2}

    bad_fields = [
        ({"url": "127.0.0.1:4000"}, "url"),
        ({"measurement": "m_{partition}"}, "measurement"),
        ({"precision": "m"}, "precision"),
        ({"tags": {"t": "$headers"}}, "tags"),
        ({"newlines": "escape"}, "newlines"),
        ({"username": "u"}, "password"),
    ]
