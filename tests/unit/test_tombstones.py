"""Tombstones without servers: where a delete's key comes from, and the exact requests the
MongoDB and Elasticsearch sinks build for them (those two have no server here; PostgreSQL,
MySQL and Redis deletes run against the real servers in tests/integration/test_tombstones.py)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from pymongo import DeleteOne, ReplaceOne

from conveyor.core.errors import ConfigError
from conveyor.sinks import build_sink
from conveyor.sinks.base import iter_records
from conveyor.sinks.elasticsearch import ElasticsearchSinkConfig, build_bulk, map_bulk_response
from conveyor.sinks.mongodb import MongoDBSinkConfig, build_operations
from conveyor.sinks.tombstones import DeleteKeyError, delete_key, tombstone_flags
from tests.sinks.contract import make_batch


def with_tombstones(batch: pa.Table, rows: set[int], keys: dict[int, bytes | None]) -> pa.Table:
    """The batch with ``__tombstone`` set on ``rows`` (their payload nulled, keys replaced)."""
    n = batch.num_rows
    flags = pa.array([i in rows for i in range(n)], pa.bool_())
    out = batch.append_column("__tombstone", flags)
    key_col = [keys.get(i, v) for i, v in enumerate(batch.column("__key").to_pylist())]
    out = out.set_column(
        out.schema.get_field_index("__key"), "__key", pa.array(key_col, pa.binary())
    )
    for name in ("id", "name", "amount"):
        col = out.column(name).to_pylist()
        typ = out.schema.field(name).type
        vals = [None if i in rows else v for i, v in enumerate(col)]
        out = out.set_column(out.schema.get_field_index(name), name, pa.array(vals, typ))
    return out


# -- the key of a delete -------------------------------------------------------------------


def test_delete_key_from_the_row_then_the_json_key_then_the_key_itself() -> None:
    assert delete_key(["id"], {"id": 5}, b"ignored") == (5,)
    assert delete_key(["id", "region"], {"id": None}, b'{"id": 7, "region": "eu"}') == (7, "eu")
    envelope = b'{"schema": {"type": "struct"}, "payload": {"id": 8}}'
    assert delete_key(["id"], {}, envelope) == (8,)  # Kafka Connect's JsonConverter
    assert delete_key(["id"], {}, b"42") == (42,)
    assert delete_key(["id"], {}, b'"abc"') == ("abc",)
    assert delete_key(["id"], {}, b"plain-key") == ("plain-key",)
    with pytest.raises(DeleteKeyError, match="key column\\(s\\) region"):
        delete_key(["id", "region"], {}, b'{"id": 1}')
    with pytest.raises(DeleteKeyError, match="message key null"):
        delete_key(["id"], {}, None)


def test_tombstone_flags_default_to_none() -> None:
    batch = make_batch(3)
    assert tombstone_flags(batch) == [False] * 3
    assert tombstone_flags(with_tombstones(batch, {1}, {})) == [False, True, False]


# -- MongoDB ---------------------------------------------------------------------------------


def mongo_raw(**kw: Any) -> dict[str, Any]:
    return {
        "type": "mongodb",
        "url": "mongodb://127.0.0.1:27017",
        "database": "db",
        "collection": "c",
        "write_mode": "upsert",
        "delete_enabled": True,
        **kw,
    }


def mongo(**kw: Any) -> MongoDBSinkConfig:
    return MongoDBSinkConfig.model_validate(mongo_raw(**kw))


def test_mongodb_tombstones_delete_by_key_and_the_latest_operation_wins() -> None:
    batch = with_tombstones(make_batch(4), {1, 3}, {1: b"k0", 3: b"k2"})
    # row 0 writes k0, row 1 deletes k0, row 2 writes k2, row 3 deletes k2 (later: wins)
    plan = build_operations(iter_records(batch), mongo(id_strategy="key"), frozenset({1, 3}))
    assert plan.ops == [DeleteOne({"_id": "k0"}), DeleteOne({"_id": "k2"})]
    assert plan.rows == [1, 3] and sorted(plan.superseded) == [0, 2]
    rewrite = with_tombstones(make_batch(2), {0}, {0: b"k1"})  # a delete, then a write of k1
    plan = build_operations(iter_records(rewrite), mongo(id_strategy="key"), frozenset({0}))
    assert [type(op) for op in plan.ops] == [ReplaceOne] and plan.rows == [1]


def test_mongodb_field_ids_of_a_tombstone_come_from_its_json_key() -> None:
    batch = with_tombstones(make_batch(2), {1}, {1: b'{"id": 1}'})
    plan = build_operations(iter_records(batch), mongo(id_strategy="field:id"), frozenset({1}))
    assert plan.ops[-1] == DeleteOne({"_id": 1})
    bad = with_tombstones(make_batch(1), {0}, {0: None})
    plan = build_operations(iter_records(bad), mongo(id_strategy="field:id"), frozenset({0}))
    assert not plan.ops
    assert plan.failures[0].index == 0 and "tombstone without a value" in plan.failures[0].message


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"write_mode": "insert", "id_strategy": "key"}, "write_mode: upsert"),
        ({"id_strategy": "coordinates"}, "id_strategy key or field"),
    ],
)
def test_mongodb_delete_mode_needs_upserts_by_key(kw: dict[str, Any], message: str) -> None:
    cfg = mongo_raw(**kw)
    with pytest.raises(ConfigError, match=f"sink.delete_enabled: .*{message}"):
        build_sink(cfg)


# -- Elasticsearch ----------------------------------------------------------------------------


def es_raw(**kw: Any) -> dict[str, Any]:
    return {
        "type": "elasticsearch",
        "hosts": ["http://127.0.0.1:9200"],
        "index": "orders",
        "delete_enabled": True,
        "id_strategy": "key",
        **kw,
    }


def es(**kw: Any) -> ElasticsearchSinkConfig:
    return ElasticsearchSinkConfig.model_validate(es_raw(**kw))


def test_elasticsearch_tombstones_are_delete_actions_in_order() -> None:
    batch = with_tombstones(make_batch(3), {1}, {1: b"k0"})
    plan = build_bulk(iter_records(batch), es(), frozenset({1}))
    assert plan.operations[2] == {"delete": {"_index": "orders", "_id": "k0"}}
    assert plan.operations[0] == {"index": {"_index": "orders", "_id": "k0"}}
    assert len(plan.operations) == 5 and plan.rows == [0, 1, 2]  # no source line for a delete
    # Deleting a document that is not there is done, not a failure (a replayed delete).
    response = {
        "errors": True,
        "items": [
            {"index": {"status": 200}},
            {"delete": {"status": 404, "result": "not_found"}},
            {"index": {"status": 201}},
        ],
    }
    assert map_bulk_response(response, plan, es()) == []


def test_elasticsearch_delete_mode_needs_an_id_from_the_key() -> None:
    with pytest.raises(ConfigError, match="sink.delete_enabled: .*id_strategy key or field"):
        build_sink(es_raw(id_strategy="coordinates"))
