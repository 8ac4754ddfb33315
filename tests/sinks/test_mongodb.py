"""MongoDB sink: the contract suite against a real MongoDB given by CONVEYOR_TEST_MONGO_URL.

There is no MongoDB server on the CI machine, so these tests are skipped unless the
variable is set (see docs/FULL_SUITE.md: ``docker compose up -d mongodb`` and
``export CONVEYOR_TEST_MONGO_URL=mongodb://127.0.0.1:27017``). Config validation is
also covered without a server in tests/unit/test_mongodb_requests.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sinks.contract import SinkContract, closed_port, make_batch, unique

MONGO_URL = os.environ.get("CONVEYOR_TEST_MONGO_URL", "")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not MONGO_URL,
        reason="CONVEYOR_TEST_MONGO_URL not set: no MongoDB server on this machine (see docs/FULL_SUITE.md)",
    ),
]

DATABASE = "conveyor_contract"

# Rows the server must reject one by one: name must be a string, amount >= 0.
VALIDATOR = {
    "$jsonSchema": {
        "bsonType": "object",
        "required": ["name"],
        "properties": {
            "name": {"bsonType": "string"},
            "amount": {"bsonType": "double", "minimum": 0},
        },
    }
}


def _client() -> Any:
    import pymongo

    return pymongo.MongoClient(MONGO_URL, tz_aware=True, serverSelectionTimeoutMS=10_000)


class TestMongoDBContract(SinkContract):
    """Inserts with ``_id`` = topic-partition-offset: a replay hits duplicate ``_id``s, counted as stored."""

    sink_type = "mongodb"
    idempotent = True
    keeps_keys = keeps_headers = keeps_timestamps = True

    def make_target(self) -> Iterator[str]:
        name = unique("orders")
        client = _client()
        try:
            client[DATABASE].create_collection(name, validator=VALIDATOR)
            yield name
            client[DATABASE].drop_collection(name)
        finally:
            client.close()

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "mongodb",
            "url": MONGO_URL or "mongodb://127.0.0.1:27017",
            "database": DATABASE,
            "collection": target,
            "metadata_field": "_meta",
            "w": "majority",
            "server_selection_timeout_ms": 5000,
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        client = _client()
        try:
            docs = list(client[DATABASE][target].find())
        finally:
            client.close()
        out = []
        for d in docs:
            meta = d["_meta"]
            key = meta.get("key")
            out.append(
                {
                    "id": d["id"],
                    "name": d["name"],
                    "key": key.encode() if isinstance(key, str) else key,
                    "headers": {h["key"]: bytes(h["value"]) for h in meta.get("headers", [])},
                    "timestamp": meta["timestamp"],
                }
            )
        return out

    def poison_batch(self, target: str):
        # Row 250 has a null name, row 400 a negative amount: both fail the validator (code 121).
        return make_batch(500, names={250: None}, amounts={400: -1.0}), {250, 400}

    def outage_config(self, target: str) -> dict[str, Any]:
        return {
            **self.config(target),
            "url": f"mongodb://127.0.0.1:{closed_port()}/?directConnection=true",
            "server_selection_timeout_ms": 1000,
            "connect_timeout_ms": 1000,
        }

    bad_fields = [
        ({"database": "bad.name"}, "database"),
        ({"collection": "system.users"}, "collection"),
        ({"w": 0}, "w"),
        ({"id_strategy": "random"}, "id_strategy"),
        ({"write_mode": "upsert", "id_strategy": "none"}, "id_strategy"),
        ({"server_selection_timeout_ms": 1}, "server_selection_timeout_ms"),
    ]


class TestMongoDBUpsertContract(TestMongoDBContract):
    """ReplaceOne(upsert=True) keyed by the payload's ``id``: a replay overwrites in place."""

    def config(self, target: str) -> dict[str, Any]:
        return {**super().config(target), "write_mode": "upsert", "id_strategy": "field:id"}
