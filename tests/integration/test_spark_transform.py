"""The transform on a real Spark Connect server: decoding, filters, selects, renames.

Each batch is built in the source layout (``records_to_table``'s schema) and goes
through ``SparkTransformer`` exactly as in the loop. What comes back is checked row
by row: payload columns, the message's own columns (topic, partition, offset,
timestamp, key, headers), undecodable rows reported by index, filtered rows counted.
Every test runs both ways a batch crosses to Spark: as its rows, and as one row
unnested on the server (``as_one_row``, the way of large batches).
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pydantic
import pytest

from conveyor.brokers.kafka import SOURCE_SCHEMA
from conveyor.core.errors import ConfigError
from conveyor.core.model import TransformSpec
from conveyor.core.registry import format_validation_error
from conveyor.spark import transform as transform_module
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer

pytestmark = pytest.mark.integration

SCHEMA = "id BIGINT, name STRING, amount DOUBLE"
DEFAULT_ONE_ROW_FROM = transform_module.ONE_ROW_FROM  # before any test changes it


@pytest.fixture(scope="module")
def spark(spark_remote: str) -> Any:
    return spark_session(spark_remote)


@pytest.fixture(autouse=True, params=["rows", "one_row"])
def crossing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How batches cross to Spark: as their rows, or (from one row on) as one row."""
    if request.param == "one_row":
        monkeypatch.setattr(transform_module, "ONE_ROW_FROM", 1)
    else:
        monkeypatch.setattr(transform_module, "ONE_ROW_FROM", 1 << 62)
    return str(request.param)


def source(values: list[bytes | None], *, partition_of=lambda i: i % 2) -> pa.Table:
    n = len(values)
    return pa.Table.from_pylist(
        [
            {
                "__topic": "orders",
                "__partition": partition_of(i),
                "__offset": 100 + i,
                "__timestamp": datetime(2026, 11, 23, 12, 0, i % 60, tzinfo=timezone.utc),
                "__key": f"k{i}".encode(),
                "__headers": [{"key": "h", "value": f"v{i}".encode()}],
                "__destination": None,
                "__value": v,
            }
            for i, v in enumerate(values)
        ],
        schema=SOURCE_SCHEMA,
    ).slice(0, n)


def order(i: int) -> bytes:
    return json.dumps({"id": i, "name": f"name {i}", "amount": i * 0.5}).encode()


def transform(spark: Any, **spec: Any) -> SparkTransformer:
    t = SparkTransformer(TransformSpec.model_validate(spec), spark)
    t.prepare()
    return t


def test_json_with_schema_keeps_each_message_with_its_own_metadata(spark):
    values: list[bytes | None] = [order(i) for i in range(1_000)]
    values[10] = b"not json"
    values[20] = None
    values[30] = b'{"id": 30, "name": "unterminated'
    out = transform(spark, decode="json", schema=SCHEMA)(source(values))

    assert [(r.index, r.message) for r in out.rejected] == [
        (10, "undecodable payload: not valid JSON"),
        (30, "undecodable payload: not valid JSON"),
    ]
    assert out.filtered == 1  # the tombstone at 20: null_values skip (the default)
    t = out.table
    assert t.num_rows == 997
    assert t.column_names == [
        "__topic",
        "__partition",
        "__offset",
        "__timestamp",
        "__timestamp_type",
        "__key",
        "__headers",
        "__destination",
        "id",
        "name",
        "amount",
    ]
    rows = t.to_pylist()
    kept = [i for i in range(1_000) if i not in (10, 20, 30)]
    assert [r["id"] for r in rows] == kept
    for r, i in zip(rows, kept, strict=True):  # every payload stays with its own message
        assert r["name"] == f"name {i}" and r["amount"] == i * 0.5
        assert r["__offset"] == 100 + i and r["__partition"] == i % 2
        assert r["__key"] == f"k{i}".encode()
        assert r["__headers"] == [{"key": "h", "value": f"v{i}".encode()}]
        assert r["__timestamp"] == datetime(2026, 11, 23, 12, 0, i % 60, tzinfo=timezone.utc)
        assert r["__topic"] == "orders" and r["__destination"] is None
    assert t.schema.field("id").type == pa.int64()
    ts = t.schema.field("__timestamp").type
    assert pa.types.is_timestamp(ts) and ts.tz == "UTC"


def test_json_without_schema_keeps_the_document_as_one_validated_string(spark):
    out = transform(spark, decode="json")(source([b'{"a": [1, 2]}', b"{oops", b"[1]"]))
    assert [r.index for r in out.rejected] == [1]
    assert out.table.column("value").to_pylist() == ['{"a": [1, 2]}', "[1]"]


def test_text_and_raw_decoding(spark):
    batch = source([b"caf\xc3\xa9", None, b"\x00\x01"])
    text = transform(spark, decode="text")(batch)
    assert text.rejected == () and text.filtered == 1  # the null payload is skipped
    assert text.table.column("value").to_pylist() == ["café", "\x00\x01"]
    raw = transform(spark, decode="raw", null_values="pass")(batch)
    assert raw.rejected == () and raw.filtered == 0
    assert raw.table.column("value").to_pylist() == [b"caf\xc3\xa9", None, b"\x00\x01"]
    assert raw.table.column("__tombstone").to_pylist() == [False, True, False]


def test_filter_on_a_payload_field_counts_what_it_skips(spark):
    values: list[bytes | None] = [order(i) for i in range(100)]
    values[3] = b"garbage"  # undecodable rows are reported even when the filter would drop them
    out = transform(spark, decode="json", schema=SCHEMA, filter="amount >= 25")(source(values))
    assert [r.index for r in out.rejected] == [3]
    assert out.table.column("id").to_pylist() == list(range(50, 100))
    assert out.table.column("__offset").to_pylist() == [100 + i for i in range(50, 100)]
    assert out.filtered == 49  # 100 in, 50 out, 1 rejected: a rejected row is not also "filtered"


def test_filter_and_select_on_message_columns(spark):
    values = [order(i) for i in range(40)]
    out = transform(
        spark,
        decode="json",
        schema=SCHEMA,
        filter="__partition = 1 AND id < 30",
        select=[
            "id",
            "upper(name) AS name",
            "CAST(__key AS STRING) AS k",
            "__offset AS src_offset",
        ],
        rename={"k": "message_key"},
    )(source(values))
    rows = out.table.to_pylist()
    odd = [i for i in range(30) if i % 2 == 1]
    assert [r["id"] for r in rows] == odd
    assert [r["name"] for r in rows] == [f"NAME {i}" for i in odd]
    assert [r["message_key"] for r in rows] == [f"k{i}" for i in odd]
    assert [r["src_offset"] for r in rows] == [100 + i for i in odd]
    assert [r["__offset"] for r in rows] == [100 + i for i in odd]
    assert [r["__key"] for r in rows] == [f"k{i}".encode() for i in odd]
    assert out.table.column_names[-4:] == ["id", "name", "message_key", "src_offset"]
    assert out.filtered == 40 - len(odd)


def test_a_select_can_route_each_row_with_destination(spark):
    values = [json.dumps({"id": i, "region": "eu" if i % 2 else "us"}).encode() for i in range(6)]
    out = transform(
        spark,
        decode="json",
        schema="id BIGINT, region STRING",
        select=["id", "concat('orders.', region) AS __destination"],
    )(source(values))
    t = out.table
    assert t.column_names.count("__destination") == 1
    assert t.column("__destination").to_pylist() == [
        f"orders.{'eu' if i % 2 else 'us'}" for i in range(6)
    ]
    assert t.column("id").to_pylist() == list(range(6))
    assert t.column("__key").to_pylist() == [f"k{i}".encode() for i in range(6)]


def test_a_select_can_mark_truncate_rows(spark):
    """``__truncate`` is set by a select (no message carries it) and is no payload column."""
    values = [json.dumps({"id": i, "op": "t" if i == 2 else "c"}).encode() for i in range(4)]
    tr = transform(
        spark,
        decode="json",
        schema="id BIGINT, op STRING",
        select=["id", "coalesce(op = 't', false) AS __truncate"],
    )
    assert tr.check(SOURCE_SCHEMA) == ["id"]
    t = tr(source(values)).table
    assert t.column("__truncate").to_pylist() == [False, False, True, False]
    assert t.column("id").to_pylist() == list(range(4))


def test_every_row_undecodable(spark):
    out = transform(spark, decode="json", schema=SCHEMA)(source([b"x", b"y", None]))
    assert [r.index for r in out.rejected] == [0, 1] and out.filtered == 1
    assert out.table.num_rows == 0
    assert "id" in out.table.column_names


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"schema": "id BIGINT", "filter": "no_such_column > 1"}, "no_such_column"),
        ({"schema": "id BIGINT", "select": ["upper(id, id)"]}, "Spark rejected the transform"),
    ],
)
def test_a_bad_expression_is_a_config_error_naming_the_transform(spark, spec, words):
    t = SparkTransformer(TransformSpec.model_validate({"decode": "json", **spec}), spark)
    with pytest.raises(ConfigError) as e:
        t.prepare()
    assert e.value.field == "transform"
    assert words in str(e.value)


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"schema": "id BIGINT", "select": ["id +"]}, "select[0]: the expression ends too early"),
        ({"schema": "id NOT_A_TYPE"}, "schema: 'NOT_A_TYPE' is not a Spark data type"),
    ],
)
def test_an_expression_that_does_not_parse_is_refused_by_the_spec(spec, words):
    with pytest.raises(pydantic.ValidationError) as e:
        TransformSpec.model_validate({"decode": "json", **spec})
    assert words in format_validation_error(e.value)


@pytest.mark.parametrize("decode", ["json", "text", "raw"])
def test_null_values_modes_for_tombstones_and_empty_payloads(spark, decode):
    values = [order(0), None, b"", order(3)]
    schema = {"schema": SCHEMA} if decode == "json" else {}
    skip = transform(spark, decode=decode, **schema)(source(values))
    assert skip.table.num_rows == 2 and skip.filtered == 2 and skip.rejected == ()
    assert "__tombstone" not in skip.table.column_names
    fail = transform(spark, decode=decode, null_values="fail", **schema)(source(values))
    assert [(r.index, r.message) for r in fail.rejected] == [
        (1, "null payload (a tombstone); transform.null_values is 'fail'"),
        (2, "empty payload; transform.null_values is 'fail'"),
    ]
    assert fail.filtered == 0 and fail.table.num_rows == 2
    passed = transform(spark, decode=decode, null_values="pass", **schema)(source(values))
    t = passed.table
    assert passed.rejected == () and passed.filtered == 0 and t.num_rows == 4
    assert t.column("__tombstone").to_pylist() == [False, True, True, False]
    assert t.column("__key").to_pylist() == [b"k0", b"k1", b"k2", b"k3"]  # deletes find their key
    if decode == "json":
        assert t.column("id").to_pylist() == [0, None, None, 3]


def test_a_filter_and_select_can_use_tombstone(spark):
    values = [order(0), None, order(2)]
    out = transform(
        spark,
        decode="json",
        schema=SCHEMA,
        null_values="pass",
        filter="__tombstone OR id > 0",
        select=[
            "coalesce(CAST(id AS STRING), CAST(__key AS STRING)) AS ref",
            "__tombstone AS gone",
        ],
    )(source(values))
    assert out.table.column("ref").to_pylist() == ["k1", "2"]
    assert out.table.column("gone").to_pylist() == [True, False]


def test_a_json_payload_that_does_not_fit_the_schema_is_a_failed_message_not_nulls(spark):
    deep = ("[" * 5000 + "]" * 5000).encode()
    values = [
        order(0),
        b'{"id": "not a number", "name": "x", "amount": 1.0}',  # wrong type
        b"[1, 2, 3]",  # not an object
        b"42",  # not an object
        order(4),
        b'{"id": 5, "name": "nul \\u0000 inside", "amount": 1.0}',  # valid JSON, decoded
        b"\xff\xfe not utf-8",
        deep,
        b'{"id": 8}',  # missing fields are nulls, not an error
    ]
    out = transform(spark, decode="json", schema=SCHEMA)(source(values))
    rejected = {r.index: r.message for r in out.rejected}
    assert set(rejected) == {1, 2, 3, 6, 7}
    assert "does not match the schema" in rejected[1]
    assert all(m.startswith("undecodable payload: ") for m in rejected.values())
    assert out.table.column("id").to_pylist() == [0, 4, 5, 8]
    assert "__corrupt" not in out.table.column_names
    assert out.table.column("name").to_pylist()[2] == "nul \x00 inside"
    # on_type_mismatch: null keeps Spark's permissive decoding.
    lax = transform(spark, decode="json", schema=SCHEMA, on_type_mismatch="null")(source(values))
    assert 1 not in {r.index for r in lax.rejected}


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "unprepared"])
def test_json_fields_with_names_that_need_quoting_nesting_and_case_twins(spark, prepared):
    """After ``prepare`` each batch projects the schema's fields by name; names with a
    backtick, a space or a dot, nested structs and arrays come out exactly as without it
    (``__d.*``), and two names that differ only in case keep the star."""
    schema = "`a.b` BIGINT, `we``ird` STRING, `sp ace` DOUBLE, n STRUCT<x: INT, y: ARRAY<STRING>>"
    doc = {"a.b": 1, "we`ird": "w", "sp ace": 2.5, "n": {"x": 3, "y": ["p", "q"]}}
    values = [json.dumps(doc).encode(), b"{oops", b'{"a.b": "x"}']
    t = SparkTransformer(TransformSpec.model_validate({"decode": "json", "schema": schema}), spark)
    if prepared:
        t.prepare()
        assert t._json_fields == ["a.b", "we`ird", "sp ace", "n"]
    out = t(source(values))
    assert [(r.index, r.message.split(":")[0]) for r in out.rejected] == [
        (1, "undecodable payload"),
        (2, "undecodable payload"),
    ]
    assert out.table.column_names[-4:] == ["a.b", "we`ird", "sp ace", "n"]
    assert out.table.select(["a.b", "we`ird", "sp ace", "n"]).to_pylist() == [doc]

    twins = transform(spark, decode="json", schema="a INT, A STRING")
    assert twins._json_fields is None
    out = twins(source([b'{"a": 1, "A": "one"}']))
    assert out.table.select(["a", "A"]).to_pylist() == [{"a": 1, "A": "one"}]


def test_json_that_only_a_lenient_parser_takes_is_not_valid_json(spark):
    """One parse (from_json) flags what the strict parser (try_parse_json) refused: NaN
    and Infinity tokens, single quotes, comments, trailing commas, blank payloads."""
    values = [
        order(0),
        b'{"id": 1, "amount": NaN}',
        b'{"id": 2, "amount": -Infinity}',
        b"{'id': 3}",
        b'{"id": 4, /* c */ "name": "x"}',
        b'{"id": 5,}',
        b"   ",
        order(7),
    ]
    for mismatch in ("fail", "null"):
        out = transform(spark, decode="json", schema=SCHEMA, on_type_mismatch=mismatch)(
            source(values)
        )
        assert [(r.index, r.message) for r in out.rejected] == [
            (i, "undecodable payload: not valid JSON") for i in range(1, 7)
        ]
        assert out.table.column("id").to_pylist() == [0, 7]


@pytest.mark.slow  # restarts a Spark Connect server (about 50 s): CI's -m slow run
@pytest.mark.parametrize("crossing", ["rows"], indirect=True)  # not about the crossing
def test_a_restarted_spark_server_is_an_outage_then_the_transform_uses_a_new_session(tmp_path):
    """The server restarts between two batches: its sessions are gone. The next attempt
    is an outage (retried by the loop), and the one after runs on a new session."""
    from pyspark.sql.connect.session import SparkSession

    from conveyor.core.errors import TransientSinkError
    from conveyor.spark.server import start_spark_connect

    server = start_spark_connect(work_dir=tmp_path / "spark")
    port = server.port
    made: list[Any] = []

    def factory() -> Any:
        s = SparkSession.builder.remote(f"sc://127.0.0.1:{port}").create()
        made.append(s)
        return s

    try:
        t = transform(factory, decode="json", schema=SCHEMA)
        batch = source([order(i) for i in range(3)])
        assert t(batch).table.num_rows == 3
        server.stop()
        server = start_spark_connect(port=port, work_dir=tmp_path / "spark")
        outages = []
        out = None
        for _ in range(3):
            try:
                out = t(batch)
                break
            except TransientSinkError as e:
                outages.append(str(e))
        assert out is not None and out.table.num_rows == 3, outages
        assert len(made) == 2, outages  # a new session after the restart
    finally:
        for s in made:
            with contextlib.suppress(Exception):
                s.client.close()
        server.stop()


@pytest.mark.parametrize("crossing", ["rows"], indirect=True)  # sets its own thresholds
def test_a_large_batch_crosses_as_one_row_and_comes_back_the_same(spark, monkeypatch):
    """At the default threshold a batch of ONE_ROW_FROM rows crosses as one row, a smaller
    one as its rows; both give what the rows give: every payload and message column,
    the same failed messages (not JSON, a mismatch), tombstones, filter and select on
    message columns."""
    n = DEFAULT_ONE_ROW_FROM
    monkeypatch.setattr(transform_module, "ONE_ROW_FROM", n)
    hostile = [b"{not json", b'{"id": "x"}', b"[1, 2]", None, b"", b'"just a string"']
    values = [hostile[i // 997 % len(hostile)] if i % 997 == 0 else order(i) for i in range(n)]
    batch = source(values, partition_of=lambda i: i % 3)
    spec = {
        "decode": "json",
        "schema": SCHEMA,
        "null_values": "pass",
        "filter": "__offset % 5 <> 1 OR id IS NULL",
        "select": ["id", "name", "amount * 2 AS doubled", "__key AS k", "__offset AS o"],
    }
    sizes: list[int] = []
    real = spark.createDataFrame

    def spy(data: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(data.num_rows)
        return real(data, *args, **kwargs)

    monkeypatch.setattr(spark, "createDataFrame", spy)
    one_row = transform(spark, **spec)
    sizes.clear()
    got = one_row(batch)
    assert sizes == [1]  # the batch crossed as one row
    smaller = one_row(batch.slice(0, n - 1))
    assert sizes == [1, n - 1]  # one row fewer: as its rows
    monkeypatch.setattr(transform_module, "ONE_ROW_FROM", 1 << 62)
    want = transform(spark, **spec)(batch)
    assert got.table.equals(want.table)
    assert got.rejected == want.rejected and got.filtered == want.filtered
    assert {r.message for r in got.rejected} == {
        "undecodable payload: not valid JSON",
        "undecodable payload: a field does not match the schema (transform.on_type_mismatch: fail)",
    }
    assert got.table.num_rows > 0.7 * n
    assert smaller.table.equals(got.table.slice(0, got.table.num_rows - 1))  # last one passes
