"""MongoDB sink without a server: the exact operations built for a batch, the mapping of
real pymongo errors (``BulkWriteError`` with its ``details``, connection and auth errors)
config validation, and an unreachable server (a closed loopback port, no server)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pymongo import InsertOne, ReplaceOne
from pymongo.errors import (
    AutoReconnect,
    BulkWriteError,
    ConfigurationError,
    NetworkTimeout,
    NotPrimaryError,
    OperationFailure,
    ServerSelectionTimeoutError,
)

from conveyor.core.errors import ConfigError, PermanentSinkError, TransientSinkError
from conveyor.sinks import build_sink
from conveyor.sinks.base import ErrorKind, RowFailure, iter_records
from conveyor.sinks.mongodb import (
    MongoDBSinkConfig,
    MongoPlan,
    build_operations,
    map_bulk_write_error,
    map_error,
    redact_url,
    unencodable,
)
from tests.sinks.contract import BASE_TS, make_batch

URL = "mongodb://127.0.0.1:27017"


def cfg(**kw: Any) -> MongoDBSinkConfig:
    return MongoDBSinkConfig.model_validate(
        {"type": "mongodb", "url": URL, "database": "db", "collection": "orders", **kw}
    )


def plan_for(batch: pa.Table, **kw: Any) -> MongoPlan:
    return build_operations(iter_records(batch), cfg(**kw))


def test_importing_the_module_does_not_import_pymongo() -> None:
    code = "import sys, conveyor.sinks.mongodb; assert 'pymongo' not in sys.modules and 'bson' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- request building ------------------------------------------------------------------------


def test_insert_with_coordinate_ids_is_the_exact_request_list() -> None:
    plan = plan_for(make_batch(3, start=10))
    assert plan.ops == [
        InsertOne({"id": 10, "name": "name 10", "amount": 15.0, "_id": "orders-0-10"}),
        InsertOne({"id": 11, "name": "name 11", "amount": 16.5, "_id": "orders-0-11"}),
        InsertOne({"id": 12, "name": "name 12", "amount": 18.0, "_id": "orders-0-12"}),
    ]
    assert plan.rows == [0, 1, 2] and plan.failures == [] and plan.superseded == []


def test_upsert_by_payload_field_is_replace_one_with_upsert() -> None:
    plan = plan_for(make_batch(2), write_mode="upsert", id_strategy="field:id")
    assert plan.ops == [
        ReplaceOne({"_id": 0}, {"id": 0, "name": "name 0", "amount": 0.0, "_id": 0}, upsert=True),
        ReplaceOne({"_id": 1}, {"id": 1, "name": "name 1", "amount": 1.5, "_id": 1}, upsert=True),
    ]


def test_key_ids_and_metadata_field() -> None:
    plan = plan_for(make_batch(1, start=7), id_strategy="key", metadata_field="_meta")
    (op,) = plan.ops
    assert op == InsertOne(
        {
            "id": 7,
            "name": "name 7",
            "amount": 10.5,
            "_id": "k7",
            "_meta": {
                "topic": "orders",
                "partition": 0,
                "offset": 7,
                "timestamp": BASE_TS + dt.timedelta(milliseconds=7),
                "key": "k7",
                "headers": [{"key": "h", "value": b"7"}],
            },
        }
    )


def test_a_binary_key_stays_binary() -> None:
    batch = make_batch(1).set_column(7, "__key", pa.array([b"\xff\x00"], pa.binary()))
    (op,) = plan_for(batch, id_strategy="key").ops
    assert op._doc["_id"] == b"\xff\x00"


def test_rows_without_an_id_are_data_errors_before_sending() -> None:
    batch = make_batch(3).set_column(7, "__key", pa.array([b"a", None, b"c"], pa.binary()))
    plan = plan_for(batch, id_strategy="key")
    assert plan.rows == [0, 2]
    assert [f.index for f in plan.failures] == [1] and "no key" in plan.failures[0].message


def test_upsert_sends_only_the_last_row_per_id() -> None:
    batch = pa.table({"id": pa.array([1, 2, 1], pa.int64()), "v": pa.array(["a", "b", "c"])})
    plan = plan_for(batch, write_mode="upsert", id_strategy="field:id")
    assert plan.ops == [
        ReplaceOne({"_id": 2}, {"id": 2, "v": "b", "_id": 2}, upsert=True),
        ReplaceOne({"_id": 1}, {"id": 1, "v": "c", "_id": 1}, upsert=True),
    ]
    assert plan.rows == [1, 2] and plan.superseded == [0]


def test_insert_keeps_the_first_row_per_id_and_1_equals_1_0() -> None:
    batch = pa.table({"id": pa.array([1.0, 2.0, 1.0]), "v": pa.array(["a", "b", "c"])})
    plan = plan_for(batch, id_strategy="field:id")
    assert plan.rows == [0, 1] and plan.superseded == [2]


def test_id_strategy_none_keeps_the_payload_id_or_leaves_it_to_the_driver() -> None:
    batch = pa.table({"_id": pa.array(["x", None]), "v": pa.array([1, 2])})
    plan = plan_for(batch, id_strategy="none")
    # A null _id is dropped so that pymongo assigns an ObjectId when it sends.
    assert plan.ops == [InsertOne({"_id": "x", "v": 1}), InsertOne({"v": 2})]


def test_a_json_string_payload_becomes_a_document() -> None:
    batch = pa.table(
        {"value": pa.array(['{"a": 1}', "plain text"]), "__offset": pa.array([5, 6], pa.int64())}
    )
    plan = plan_for(batch)
    assert [op._doc for op in plan.ops] == [
        {"a": 1, "_id": "-0-5"},
        {"value": "plain text", "_id": "-0-6"},
    ]


def test_unencodable_documents_are_found_by_encoding_each() -> None:
    batch = pa.table({"n": pa.array([1, 2**64 - 1, 3], pa.uint64())})
    plan = plan_for(batch)
    bad = unencodable(plan)
    assert [pos for pos, _ in bad] == [1] and "8-byte ints" in bad[0][1]
    rest = plan.without({1})
    assert rest.rows == [0, 2]


# -- response mapping: a real BulkWriteError -----------------------------------------------


def bulk_error(
    write_errors: list[dict[str, Any]], wce: list[dict[str, Any]] | None = None
) -> BulkWriteError:
    return BulkWriteError(
        {
            "writeErrors": write_errors,
            "writeConcernErrors": wce or [],
            "nInserted": 0,
            "nUpserted": 0,
            "nMatched": 0,
            "nModified": 0,
            "nRemoved": 0,
            "upserted": [],
        }
    )


def test_write_errors_map_bulk_indexes_back_to_batch_rows() -> None:
    # Row 1 has no key and never reaches the bulk, so bulk op 1 is batch row 2.
    batch = make_batch(4).set_column(7, "__key", pa.array([b"a", None, b"c", b"d"], pa.binary()))
    config = cfg(id_strategy="key")
    plan = build_operations(iter_records(batch), config)
    assert plan.rows == [0, 2, 3]
    e = bulk_error(
        [
            {"index": 1, "code": 121, "errmsg": "Document failed validation", "op": {}},
            {
                "index": 2,
                "code": 11000,
                "errmsg": 'E11000 duplicate key error collection: db.orders index: _id_ dup key: { _id: "d" }',
                "keyPattern": {"_id": 1},
                "keyValue": {"_id": "d"},
            },
        ]
    )
    assert isinstance(e, OperationFailure) and e.code == 65
    failures = map_bulk_write_error(e.details, plan, config)
    # The duplicate _id of row 3 is a replay (acknowledged); row 2 failed validation.
    assert failures == [RowFailure(2, "E121: Document failed validation")]
    assert failures[0].kind is ErrorKind.DATA


def test_duplicate_on_another_unique_index_is_a_data_error() -> None:
    config = cfg()
    plan = build_operations(iter_records(make_batch(2)), config)
    e = bulk_error(
        [
            {
                "index": 0,
                "code": 11000,
                "errmsg": "E11000 duplicate key error index: email_1",
                "keyPattern": {"email": 1},
            }
        ]
    )
    assert map_bulk_write_error(e.details, plan, config) == [
        RowFailure(0, "E11000: E11000 duplicate key error index: email_1")
    ]


def test_duplicate_id_with_id_strategy_none_is_a_data_error_unless_resending() -> None:
    config = cfg(id_strategy="none")
    plan = build_operations(iter_records(make_batch(1)), config)
    e = bulk_error(
        [
            {
                "index": 0,
                "code": 11000,
                "errmsg": "E11000 duplicate key error index: _id_ dup key",
                "keyPattern": {"_id": 1},
            }
        ]
    )
    assert [f.index for f in map_bulk_write_error(e.details, plan, config)] == [0]
    assert map_bulk_write_error(e.details, plan, config, resend=True) == []


def test_duplicate_id_on_upsert_is_a_race_retried_as_transient() -> None:
    config = cfg(write_mode="upsert")
    plan = build_operations(iter_records(make_batch(1)), config)
    e = bulk_error([{"index": 0, "code": 11000, "errmsg": "E11000 dup", "keyPattern": {"_id": 1}}])
    with pytest.raises(TransientSinkError):
        map_bulk_write_error(e.details, plan, config)


def test_write_concern_errors_and_retryable_codes_are_transient() -> None:
    config = cfg()
    plan = build_operations(iter_records(make_batch(2)), config)
    wce = bulk_error(
        [],
        wce=[
            {
                "code": 64,
                "errmsg": "waiting for replication timed out",
                "errInfo": {"wtimeout": True},
            }
        ],
    )
    with pytest.raises(TransientSinkError, match="write concern"):
        map_bulk_write_error(wce.details, plan, config)
    stepped_down = bulk_error([{"index": 1, "code": 189, "errmsg": "primary stepped down"}])
    with pytest.raises(TransientSinkError, match="189"):
        map_bulk_write_error(stepped_down.details, plan, config)


def test_unauthorized_write_error_is_permanent() -> None:
    config = cfg()
    plan = build_operations(iter_records(make_batch(1)), config)
    e = bulk_error([{"index": 0, "code": 13, "errmsg": "not authorized on db to execute command"}])
    with pytest.raises(PermanentSinkError):
        map_bulk_write_error(e.details, plan, config)


# -- command errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        AutoReconnect("connection reset"),
        ServerSelectionTimeoutError("127.0.0.1:27017: [Errno 111] Connection refused"),
        NetworkTimeout("timed out"),
        NotPrimaryError("not primary", {"code": 10107, "errmsg": "not primary"}),
        OperationFailure("shutting down", code=91),
        OperationFailure(
            "overloaded",
            code=462,
            details={"errmsg": "overloaded", "errorLabels": ["SystemOverloadedError"]},
        ),
    ],
)
def test_connection_errors_are_transient(error: Exception) -> None:
    assert isinstance(map_error(error), TransientSinkError)


@pytest.mark.parametrize("code", [18, 13])
def test_auth_failures_are_permanent(code: int) -> None:
    mapped = map_error(
        OperationFailure(
            "Authentication failed.",
            code=code,
            details={"errmsg": "Authentication failed.", "code": code},
        )
    )
    assert isinstance(mapped, PermanentSinkError) and f"code {code}" in str(mapped)


def test_non_pymongo_errors_are_not_mapped() -> None:
    assert map_error(KeyError("x")) is None
    assert isinstance(map_error(ConfigurationError("bad option")), PermanentSinkError)


def test_credentials_are_redacted_from_messages() -> None:
    assert (
        redact_url("cannot reach mongodb://alice:s3cret@db:27017/x")
        == "cannot reach mongodb://***@db:27017/x"
    )


# -- config ------------------------------------------------------------------------------------


def test_write_concern_is_built_from_config() -> None:
    sink = build_sink(
        {
            "type": "mongodb",
            "url": URL,
            "database": "db",
            "collection": "c",
            "w": "majority",
            "j": True,
            "wtimeout_ms": 5000,
        }
    )
    wc = sink.write_concern()  # type: ignore[attr-defined]
    assert wc.document == {"w": "majority", "j": True, "wtimeout": 5000}
    numeric = build_sink(
        {"type": "mongodb", "url": URL, "database": "db", "collection": "c", "w": "2"}
    )
    assert numeric.write_concern().document == {"w": 2}  # type: ignore[attr-defined]


def test_client_options_bound_every_wait(file_root: Path) -> None:
    sink = build_sink(
        {
            "type": "mongodb",
            "url": URL,
            "database": "db",
            "collection": "c",
            "tls_ca_file": str(file_root / "ca.pem"),
        }
    )
    assert sink.client_options() == {  # type: ignore[attr-defined]
        "appname": "conveyor",
        "serverSelectionTimeoutMS": 10_000,
        "connectTimeoutMS": 10_000,
        "socketTimeoutMS": 60_000,
        "tlsCAFile": str(file_root / "ca.pem"),
    }


BASE = {"type": "mongodb", "url": URL, "database": "db", "collection": "orders"}

BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"database": "bad.name"}, "database"),
    ({"collection": "system.users"}, "collection"),
    ({"collection": ""}, "collection"),
    ({"url": "http://127.0.0.1:27017"}, "url"),
    ({"w": 0}, "w"),
    ({"id_strategy": "random"}, "id_strategy"),
    ({"write_mode": "upsert", "id_strategy": "none"}, "id_strategy"),
    ({"write_mode": "merge"}, "write_mode"),
    ({"metadata_field": "_id"}, "metadata_field"),
    ({"server_selection_timeout_ms": 1}, "server_selection_timeout_ms"),
    ({"url_env": "X"}, "url_env"),  # both url and url_env
]


def test_an_unset_url_env_is_reported_in_the_run_naming_the_field() -> None:
    from conveyor.config.specs import from_mapping, resolved

    raw = {**BASE, "url": None, "url_env": "CONVEYOR_SURELY_UNSET_VARIABLE"}
    ls = from_mapping(
        {"name": "c", "source": {"topics": ["t"]}, "sink": raw}, source="t.yaml", fallback_name="c"
    )
    assert ls.ok, ls.error
    with pytest.raises(ConfigError) as err:
        resolved(ls)
    assert "sink.url: ${env:CONVEYOR_SURELY_UNSET_VARIABLE}: environment variable" in str(err.value)


@pytest.mark.parametrize(("override", "field_name"), BAD_FIELDS)
def test_validate_rejects_each_bad_field(override: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_sink({**BASE, **override})
    assert field_name in str(err.value)


def test_rejects_unknown_field() -> None:
    with pytest.raises(ConfigError, match="no_such_option"):
        build_sink({**BASE, "no_such_option": 1})


def test_secrets_are_redacted_in_the_config_dump() -> None:
    sink = build_sink({**BASE, "url": "mongodb://alice:s3cret@db:27017"})
    assert "s3cret" not in str(sink.config.redacted()) and "s3cret" not in sink.describe()
    assert sink.config.asset_key_path() == ["mongodb", "db", "orders"]


def test_an_unreachable_server_is_transient() -> None:
    # No server: a closed loopback port. Server selection gives up after 500 ms.
    from tests.sinks.contract import closed_port

    sink = build_sink(
        {
            **BASE,
            "url": f"mongodb://127.0.0.1:{closed_port()}/?directConnection=true",
            "server_selection_timeout_ms": 500,
            "connect_timeout_ms": 500,
        }
    )
    try:
        with pytest.raises(TransientSinkError, match="ServerSelectionTimeoutError"):
            sink.init_sink()
    finally:
        sink.cleanup_sink()
        sink.cleanup_sink()


# -- fail_fast: one ordered bulk ------------------------------------------------------------


class OrderedCollection:
    """A collection that applies a bulk like the server: a unique ``_id``, a validator
    (``refuse``), and an ordered bulk stops at its first write error."""

    def __init__(self, refuse: Any = lambda doc: False) -> None:
        self.docs: dict[Any, dict[str, Any]] = {}
        self.refuse = refuse
        self.calls: list[tuple[int, bool]] = []  # (operations, ordered) per bulk_write
        self.finds = 0

    def bulk_write(self, ops: list[Any], ordered: bool, **kw: Any) -> None:
        self.calls.append((len(ops), ordered))
        errors: list[dict[str, Any]] = []
        for index, op in enumerate(ops):
            doc = op._doc
            if isinstance(op, InsertOne) and doc["_id"] in self.docs:
                errors.append(
                    {
                        "index": index,
                        "code": 11000,
                        "errmsg": "E11000 duplicate key error index: _id_ dup key",
                        "keyPattern": {"_id": 1},
                    }
                )
            elif self.refuse(doc):
                errors.append({"index": index, "code": 121, "errmsg": "Document failed validation"})
            else:
                self.docs[doc["_id"]] = doc
                continue
            if ordered:
                break
        if errors:
            raise bulk_error(errors)

    def find(self, query: dict[str, Any], projection: dict[str, Any]) -> list[dict[str, Any]]:
        self.finds += 1
        return [{"_id": i} for i in query["_id"]["$in"] if i in self.docs]


def sink_on(collection: OrderedCollection, *, fail_fast: bool, **kw: Any) -> Any:
    s = build_sink({"type": "mongodb", "url": URL, "database": "db", "collection": "c", **kw})
    s._collection = collection
    s.fail_fast = fail_fast
    return s


def stored_offsets(collection: OrderedCollection) -> list[int]:
    return sorted(d.get("id") for d in collection.docs.values())


def test_fail_fast_is_one_ordered_bulk_that_stops_at_the_first_refused_row() -> None:
    def bad(doc: dict[str, Any]) -> bool:
        return doc.get("name") == "bad"

    batch = make_batch(10, names={4: "bad", 7: "bad"})
    ordered = OrderedCollection(bad)
    result = sink_on(ordered, fail_fast=True).send_batch(batch)
    assert [(f.index, f.message) for f in result.failed] == [
        (4, "E121: Document failed validation")
    ]
    assert stored_offsets(ordered) == [0, 1, 2, 3]  # nothing after row 4
    assert ordered.calls == [(10, True)]
    # the other policies keep one unordered bulk that writes every other row
    unordered = OrderedCollection(bad)
    result = sink_on(unordered, fail_fast=False).send_batch(batch)
    assert [f.index for f in result.failed] == [4, 7]
    assert stored_offsets(unordered) == [0, 1, 2, 3, 5, 6, 8, 9]
    assert unordered.calls == [(10, False)]


def test_fail_fast_replay_goes_on_after_stored_ids_with_one_lookup() -> None:
    """A replayed batch: its first rows are stored already (duplicate _id = acknowledged)."""
    collection = OrderedCollection(lambda doc: doc.get("name") == "bad")
    sink_on(collection, fail_fast=True).send_batch(make_batch(6))
    result = sink_on(collection, fail_fast=True).send_batch(make_batch(10, names={8: "bad"}))
    assert [f.index for f in result.failed] == [8]
    assert stored_offsets(collection) == list(range(8))
    # first bulk stops on the stored _id of row 0; one find drops rows 1-5; rows 6-9 sent
    assert collection.calls == [(6, True), (10, True), (4, True)]
    assert collection.finds == 1


def test_fail_fast_row_refused_before_sending_cuts_the_bulk_there() -> None:
    batch = make_batch(6).set_column(
        7, "__key", pa.array([b"a", b"b", None, b"d", b"e", b"f"], pa.binary())
    )
    collection = OrderedCollection()
    result = sink_on(collection, fail_fast=True, id_strategy="key").send_batch(batch)
    assert [f.index for f in result.failed] == [2]
    assert sorted(collection.docs) == ["a", "b"]
    assert collection.calls == [(2, True)]


def test_fail_fast_upserts_send_every_row_in_order() -> None:
    batch = make_batch(4).set_column(7, "__key", pa.array([b"a", b"b", b"a", b"c"], pa.binary()))
    config = cfg(write_mode="upsert", id_strategy="key")
    assert build_operations(iter_records(batch), config).rows == [1, 2, 3]
    ordered = build_operations(iter_records(batch), config, ordered=True)
    assert ordered.rows == [0, 1, 2, 3] and ordered.superseded == []
    assert all(isinstance(op, ReplaceOne) for op in ordered.ops)


def test_invalid_utf8_payloads_are_row_failures_with_the_byte_offset() -> None:
    """The hostile bytes corpus: each invalid payload fails before sending, naming the
    offset (it used to be stored with replacement characters)."""
    from tests.hostile import HOSTILE_BYTES, hostile_bytes_batch

    batch, what = hostile_bytes_batch()
    plan = build_operations(iter_records(batch), cfg())
    assert [what[f.index] for f in plan.failures] == [label for label, _, _ in HOSTILE_BYTES]
    for f, (_label, _payload, offset) in zip(plan.failures, HOSTILE_BYTES, strict=True):
        assert f.message.startswith("payload is not valid UTF-8: ")
        assert f.message.endswith(f"at byte offset {offset}")
    assert [what[r] for r in plan.rows] == ["good"] * 10
