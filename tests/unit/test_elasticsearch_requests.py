"""Elasticsearch sink without a server: the exact ``_bulk`` body and ``_id``s built for a
batch, the mapping of bulk response bodies (as the client returns them) and of the
installed client's own exception types, client options, config validation, and an
unreachable server (a closed loopback port, no server)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from elastic_transport import (
    ApiResponseMeta,
    BaseNode,
    HttpHeaders,
    NdjsonSerializer,
    NodeConfig,
)
from elasticsearch import ApiError, ConnectionError, ConnectionTimeout, SerializationError, SSLError
from elasticsearch.exceptions import HTTP_EXCEPTIONS, UnsupportedProductError

from conveyor.core.errors import BatchRejected, ConfigError, PermanentSinkError, TransientSinkError
from conveyor.sinks import build_sink
from conveyor.sinks.base import ErrorKind, RowFailure, iter_records
from conveyor.sinks.elasticsearch import (
    ElasticsearchSinkConfig,
    build_bulk,
    map_bulk_response,
    map_error,
    render_index,
)
from tests.sinks.contract import make_batch

BASE: dict[str, Any] = {
    "type": "elasticsearch",
    "hosts": ["http://127.0.0.1:9200"],
    "index": "orders",
}


def cfg(**kw: Any) -> ElasticsearchSinkConfig:
    return ElasticsearchSinkConfig.model_validate({**BASE, **kw})


def api_error(status: int, body: Any = None, message: str = "error") -> ApiError:
    """An ApiError exactly as elasticsearch-py 8/9 raises it (class chosen by status)."""
    meta = ApiResponseMeta(
        status=status,
        http_version="1.1",
        headers=HttpHeaders({"x-elastic-product": "Elasticsearch"}),
        duration=0.01,
        node=NodeConfig("http", "127.0.0.1", 9200),
    )
    return HTTP_EXCEPTIONS.get(status, ApiError)(message=message, meta=meta, body=body)


def test_importing_the_module_does_not_import_the_client() -> None:
    code = (
        "import sys, conveyor.sinks.elasticsearch; "
        "assert 'elasticsearch' not in sys.modules and 'elastic_transport' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the bulk body ------------------------------------------------------------------------------


def test_exact_bulk_body_with_coordinate_ids() -> None:
    plan = build_bulk(iter_records(make_batch(2, start=5)), cfg())
    assert plan.operations == [
        {"index": {"_index": "orders", "_id": "orders-0-5"}},
        {"id": 5, "name": "name 5", "amount": 7.5},
        {"index": {"_index": "orders", "_id": "orders-0-6"}},
        {"id": 6, "name": "name 6", "amount": 9.0},
    ]
    assert plan.rows == [0, 1] and plan.failures == []
    # What goes on the wire, through the client's own NDJSON serializer.
    assert NdjsonSerializer().dumps(plan.operations) == (
        b'{"index":{"_index":"orders","_id":"orders-0-5"}}\n'
        b'{"id":5,"name":"name 5","amount":7.5}\n'
        b'{"index":{"_index":"orders","_id":"orders-0-6"}}\n'
        b'{"id":6,"name":"name 6","amount":9.0}\n'
    )


def test_dated_index_create_op_key_ids_timestamp_and_metadata() -> None:
    config = cfg(
        index="logs-{topic}-{%Y.%m.%d}",
        op_type="create",
        id_strategy="key",
        timestamp_field="@timestamp",
        metadata_field="kafka",
    )
    plan = build_bulk(iter_records(make_batch(1, start=7, topic="Orders")), config)
    assert plan.operations == [
        {"create": {"_index": "logs-orders-2026.11.01", "_id": "k7"}},
        {
            "id": 7,
            "name": "name 7",
            "amount": 10.5,
            "@timestamp": "2026-11-01T12:00:00.007Z",
            "kafka": {
                "topic": "Orders",
                "partition": 0,
                "offset": 7,
                "timestamp": "2026-11-01T12:00:00.007Z",
                "key": "k7",
                "headers": [{"key": "h", "value": "7"}],
            },
        },
    ]


def test_field_ids_and_generated_ids() -> None:
    plan = build_bulk(iter_records(make_batch(1, start=3)), cfg(id_strategy="field:id"))
    assert plan.operations[0] == {"index": {"_index": "orders", "_id": "3"}}
    plan = build_bulk(iter_records(make_batch(1, start=3)), cfg(id_strategy="none"))
    assert plan.operations[0] == {"index": {"_index": "orders"}}


def test_rows_that_cannot_be_sent_are_data_errors_before_sending() -> None:
    # Row 1: NaN (JSON has none); row 2: no key for id_strategy key.
    batch = make_batch(3, amounts={1: float("nan")}).set_column(
        7, "__key", pa.array([b"a", b"b", None], pa.binary())
    )
    plan = build_bulk(iter_records(batch), cfg(id_strategy="key"))
    assert plan.rows == [0]
    assert [f.index for f in plan.failures] == [1, 2]
    assert "NaN" in plan.failures[0].message or "nan" in plan.failures[0].message
    assert "no key" in plan.failures[1].message


def test_non_json_values_become_json() -> None:
    import decimal

    batch = pa.table(
        {
            "b": pa.array([b"\xff\x01"], pa.binary()),
            "d": pa.array([dt.date(2026, 1, 2)], pa.date32()),
            "n": pa.array([decimal.Decimal("1.25")], pa.decimal128(5, 2)),
            "__offset": pa.array([0], pa.int64()),
        }
    )
    plan = build_bulk(iter_records(batch), cfg())
    assert plan.operations[1] == {"b": "base64:/wE=", "d": "2026-01-02", "n": 1.25}


def test_a_json_text_payload_is_the_document() -> None:
    batch = pa.table(
        {"value": pa.array(['{"a": {"b": 1}}', "42"]), "__offset": pa.array([0, 1], pa.int64())}
    )
    plan = build_bulk(iter_records(batch), cfg())
    assert plan.operations[1] == {"a": {"b": 1}} and plan.operations[3] == {"value": 42}


def test_index_rendering() -> None:
    rec = next(iter_records(make_batch(1, topic="Web.Logs")))
    assert render_index("${topic}-${timestamp:%Y}", rec) == "web.logs-2026"
    with pytest.raises(ValueError, match="destination"):
        render_index("x-${destination}", rec)
    bad = next(iter_records(make_batch(1, topic="a b")))
    with pytest.raises(ValueError, match="not a valid index name"):
        render_index("${topic}", bad)


# -- bulk responses ---------------------------------------------------------------------------


def response(*items: tuple[str, int, dict[str, Any] | None]) -> dict[str, Any]:
    out = []
    for op, status, error in items:
        result: dict[str, Any] = {"_index": "orders", "_id": "x", "status": status}
        if error:
            result["error"] = error
        out.append({op: result})
    return {"took": 3, "errors": any(s >= 300 for _, s, _ in items), "items": out}


MAPPING_ERROR = {
    "type": "document_parsing_exception",
    "reason": "[1:30] failed to parse field [amount] of type [integer]",
    "caused_by": {
        "type": "illegal_argument_exception",
        "reason": "Value [1.0E12] is out of range for an integer",
    },
}


def test_item_errors_map_back_to_batch_rows() -> None:
    # Row 1 never reaches the bulk (NaN), so bulk item 1 is batch row 2.
    config = cfg()
    plan = build_bulk(iter_records(make_batch(3, amounts={1: float("nan")})), config)
    assert plan.rows == [0, 2]
    resp = response(("index", 201, None), ("index", 400, MAPPING_ERROR))
    failures = map_bulk_response(resp, plan, config)
    assert failures == [
        RowFailure(
            2,
            "400 document_parsing_exception: [1:30] failed to parse field [amount] of type [integer] "
            "(caused by illegal_argument_exception: Value [1.0E12] is out of range for an integer)",
        )
    ]
    assert failures[0].kind is ErrorKind.DATA


def test_a_clean_response_has_no_failures() -> None:
    config = cfg()
    plan = build_bulk(iter_records(make_batch(2)), config)
    assert (
        map_bulk_response(response(("index", 201, None), ("index", 200, None)), plan, config) == []
    )


def test_conflict_on_create_with_deterministic_ids_is_a_replay() -> None:
    config = cfg(op_type="create")
    plan = build_bulk(iter_records(make_batch(2)), config)
    conflict = {
        "type": "version_conflict_engine_exception",
        "reason": "[orders-0-1]: version conflict, document already exists",
    }
    assert (
        map_bulk_response(response(("create", 201, None), ("create", 409, conflict)), plan, config)
        == []
    )
    generated = cfg(op_type="create", id_strategy="none")
    assert [
        f.index
        for f in map_bulk_response(
            response(("create", 201, None), ("create", 409, conflict)), plan, generated
        )
    ] == [1]


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_overload_and_server_errors_in_items_are_transient(status: int) -> None:
    config = cfg()
    plan = build_bulk(iter_records(make_batch(2)), config)
    rejected = {
        "type": "es_rejected_execution_exception",
        "reason": "rejected execution of coordinating operation",
    }
    with pytest.raises(TransientSinkError, match=str(status)):
        map_bulk_response(
            response(("index", 400, MAPPING_ERROR), ("index", status, rejected)), plan, config
        )


@pytest.mark.parametrize("status", [401, 403])
def test_security_errors_in_items_are_permanent(status: int) -> None:
    config = cfg()
    plan = build_bulk(iter_records(make_batch(1)), config)
    err = {
        "type": "security_exception",
        "reason": "action [indices:data/write/bulk[s]] is unauthorized",
    }
    with pytest.raises(PermanentSinkError):
        map_bulk_response(response(("index", status, err)), plan, config)


def test_missing_index_without_auto_create_is_permanent() -> None:
    config = cfg()
    plan = build_bulk(iter_records(make_batch(1)), config)
    err = {"type": "index_not_found_exception", "reason": "no such index [orders]"}
    with pytest.raises(PermanentSinkError, match="index_not_found"):
        map_bulk_response(response(("index", 404, err)), plan, config)


# -- transport errors: the installed client's own exception types --------------------------------


@pytest.mark.parametrize("status", [429, 502, 503, 504, 500])
def test_api_errors_429_and_5xx_are_transient(status: int) -> None:
    body = {
        "error": {"type": "es_rejected_execution_exception", "reason": "queue full"},
        "status": status,
    }
    assert isinstance(map_error(api_error(status, body)), TransientSinkError)


@pytest.mark.parametrize("status", [401, 403])
def test_api_errors_401_403_are_permanent(status: int) -> None:
    e = api_error(
        status,
        {
            "error": {
                "type": "security_exception",
                "reason": "unable to authenticate user [elastic]",
            }
        },
    )
    assert type(e).__name__ in ("AuthenticationException", "AuthorizationException")
    mapped = map_error(e)
    assert isinstance(mapped, PermanentSinkError) and "security_exception" in str(mapped)


def test_whole_request_rejections_are_bisected() -> None:
    assert isinstance(map_error(api_error(413, None, "Request Entity Too Large")), BatchRejected)
    assert isinstance(
        map_error(
            api_error(
                400, {"error": {"type": "illegal_argument_exception", "reason": "Malformed action"}}
            )
        ),
        BatchRejected,
    )
    assert isinstance(map_error(SerializationError("Unable to serialize")), BatchRejected)


def test_connection_errors_and_timeouts_are_transient() -> None:
    assert isinstance(
        map_error(ConnectionError("Connection refused", errors=(OSError(111, "refused"),))),
        TransientSinkError,
    )
    assert isinstance(
        map_error(ConnectionTimeout("timed out", errors=(TimeoutError(),))), TransientSinkError
    )
    assert isinstance(
        map_error(SSLError("handshake reset", errors=(OSError("reset"),))), TransientSinkError
    )
    untrusted = SSLError(
        "TLS error", errors=(OSError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"),)
    )
    assert isinstance(map_error(untrusted), PermanentSinkError)


def test_not_elasticsearch_is_permanent_and_foreign_errors_are_not_mapped() -> None:
    meta = api_error(200).meta
    assert isinstance(
        map_error(UnsupportedProductError(message="not Elasticsearch", meta=meta, body={})),
        PermanentSinkError,
    )
    assert map_error(KeyError("x")) is None


# -- client options, params, config ---------------------------------------------------------------


def test_client_options_with_basic_auth_and_tls(file_root: Path) -> None:
    ca = str(file_root / "es-ca.pem")
    sink = build_sink(
        {
            **BASE,
            "hosts": ["https://es-1:9200", "https://es-2:9200"],
            "username": "writer",
            "password": "s3cret",
            "ca_certs": ca,
            "request_timeout_s": 5,
        }
    )
    assert sink.client_options() == {  # type: ignore[attr-defined]
        "hosts": ["https://es-1:9200", "https://es-2:9200"],
        "request_timeout": 5.0,
        "max_retries": 2,
        "retry_on_timeout": False,
        "basic_auth": ("writer", "s3cret"),
        "ca_certs": ca,
    }
    assert "s3cret" not in json.dumps(sink.config.redacted())


def test_client_options_with_api_key_and_bulk_params() -> None:
    sink = build_sink(
        {
            **BASE,
            "api_key": "VnVhQ2ZHY0JDZGJrUW0tZTVhT3g6dWkybHAyYXhUTm1zeWFrdzl0dk5udw==",
            "refresh": "wait_for",
            "pipeline": "p1",
        }
    )
    opts = sink.client_options()  # type: ignore[attr-defined]
    assert (
        opts["api_key"] == "VnVhQ2ZHY0JDZGJrUW0tZTVhT3g6dWkybHAyYXhUTm1zeWFrdzl0dk5udw=="
        and "basic_auth" not in opts
    )
    assert sink.bulk_params() == {"refresh": "wait_for", "pipeline": "p1"}  # type: ignore[attr-defined]
    assert build_sink(BASE).bulk_params() == {}  # type: ignore[attr-defined]


def test_the_client_accepts_the_options() -> None:
    from elasticsearch import Elasticsearch

    sink = build_sink(
        {
            **BASE,
            "hosts": ["https://127.0.0.1:9200"],
            "username": "u",
            "password": "p",
            "verify_certs": False,
        }
    )
    client = Elasticsearch(**sink.client_options())  # type: ignore[attr-defined]
    try:
        # The client took each option as meant: the node, TLS without verification, basic auth.
        (node,) = client.transport.node_pool.all()
        assert (node.config.scheme, node.config.host, node.config.port) == (
            "https",
            "127.0.0.1",
            9200,
        )
        assert node.config.verify_certs is False
        assert client._headers["authorization"] == "Basic dTpw"  # base64("u:p")
    finally:
        client.close()


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"index": "Orders"}, "index"),
    ({"index": "logs-{year}"}, "index"),
    ({"index": "_hidden"}, "index"),
    ({"hosts": []}, "hosts"),
    ({"hosts": ["127.0.0.1:9200"]}, "hosts"),
    ({"hosts": ["https://elastic:pw@es:9200"]}, "hosts"),
    ({"op_type": "update"}, "op_type"),
    ({"id_strategy": "uuid"}, "id_strategy"),
    ({"username": "elastic"}, "password"),
    ({"username": "elastic", "password": "x", "api_key": "k"}, "api_key"),
    ({"ca_certs": "/ca.pem"}, "ca_certs"),
    ({"metadata_field": "_meta"}, "metadata_field"),
    ({"request_timeout_s": 0}, "request_timeout_s"),
    ({"refresh": "always"}, "refresh"),
]


@pytest.mark.parametrize(("override", "field_name"), BAD_FIELDS)
def test_validate_rejects_each_bad_field(override: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_sink({**BASE, **override})
    assert field_name in str(err.value)


def test_rejects_unknown_field() -> None:
    with pytest.raises(ConfigError, match="no_such_option"):
        build_sink({**BASE, "no_such_option": 1})


def test_an_unreachable_server_is_transient() -> None:
    # No server: a closed loopback port.
    from tests.sinks.contract import closed_port

    sink = build_sink(
        {
            **BASE,
            "hosts": [f"http://127.0.0.1:{closed_port()}"],
            "max_retries": 0,
            "request_timeout_s": 2,
        }
    )
    try:
        with pytest.raises(TransientSinkError, match="unreachable"):
            sink.init_sink()
    finally:
        sink.cleanup_sink()
        sink.cleanup_sink()


# -- fail_fast: _bulk requests in order -------------------------------------------------------


class FakeNode(BaseNode):
    """A fake transport node behind the real client: applies each ``_bulk`` item
    independently as Elasticsearch does, refusing the documents whose ``id`` is in
    ``REFUSE`` (400 mapping error), or the whole request (400 malformed) when it holds one
    in ``REJECT_REQUEST``, or answering 503 from request ``UNAVAILABLE_FROM`` on."""

    REFUSE: frozenset[int] = frozenset()
    REJECT_REQUEST: frozenset[int] = frozenset()
    UNAVAILABLE_FROM: int | None = None
    stored: list[int] = []
    requests: list[list[int]] = []

    def perform_request(self, method: str, target: str, body: bytes | None = None, **kw: Any):
        from elastic_transport._node._base import NodeApiResponse

        lines = [json.loads(line) for line in (body or b"").splitlines() if line.strip()]
        docs = [line for line in lines if "id" in line]
        ids = [d["id"] for d in docs]
        status, out = 200, {"took": 1, "errors": False, "items": []}
        if target.split("?")[0] == "/_bulk":
            type(self).requests.append(ids)
            if (
                self.UNAVAILABLE_FROM is not None
                and len(type(self).requests) > self.UNAVAILABLE_FROM
            ):
                status, out = 503, {"error": {"type": "unavailable", "reason": "shutting down"}}
            elif self.REJECT_REQUEST & set(ids):
                status = 400
                out = {"error": {"type": "illegal_argument_exception", "reason": "Malformed"}}
            else:
                for i in ids:
                    if i in self.REFUSE:
                        out["errors"] = True
                        out["items"].append({"index": {"status": 400, "error": MAPPING_ERROR}})
                    else:
                        type(self).stored.append(i)
                        out["items"].append({"index": {"status": 201, "_id": str(i)}})
        meta = ApiResponseMeta(
            status=status,
            http_version="1.1",
            headers=HttpHeaders(
                {"x-elastic-product": "Elasticsearch", "content-type": "application/json"}
            ),
            duration=0.0,
            node=self.config,
        )
        return NodeApiResponse(meta, json.dumps(out).encode())


def fake_es_sink(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Any:
    from elasticsearch import Elasticsearch

    monkeypatch.setattr(FakeNode, "stored", [])
    monkeypatch.setattr(FakeNode, "requests", [])
    sink = build_sink({**BASE, **kw})
    sink._client = Elasticsearch(  # type: ignore[attr-defined]
        **{**sink.client_options(), "max_retries": 0},  # type: ignore[attr-defined]
        node_class=FakeNode,
    )
    return sink


def test_fail_fast_stops_after_the_request_holding_the_refused_document(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from conveyor.core.sink import send_isolating

    monkeypatch.setattr(FakeNode, "REFUSE", frozenset({250, 260}))
    sink = fake_es_sink(monkeypatch, fail_fast_chunk_size=100)
    failed = send_isolating(sink, make_batch(500), fail_fast=True)
    assert [f.index for f in failed] == [250]
    assert "document_parsing_exception" in failed[0].message
    # Requests of 100 in order; the third holds row 250: rows 251-299 (the bound, 99) are
    # written, nothing from row 300 on.
    assert [r[0] for r in FakeNode.requests] == [0, 100, 200]
    assert FakeNode.stored == [i for i in range(300) if i not in (250, 260)]


def test_fail_fast_with_chunks_of_one_writes_nothing_after_the_refused_document(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from conveyor.core.sink import send_isolating

    monkeypatch.setattr(FakeNode, "REFUSE", frozenset({7}))
    sink = fake_es_sink(monkeypatch, fail_fast_chunk_size=1)
    failed = send_isolating(sink, make_batch(20), fail_fast=True)
    assert [f.index for f in failed] == [7]
    assert FakeNode.stored == list(range(7))
    assert FakeNode.requests == [[i] for i in range(8)]
    # id_strategy none (a replay would duplicate): one document per request by default.
    assert cfg(id_strategy="none").fail_fast_chunk() == 1
    assert cfg().fail_fast_chunk() == 100


def test_fail_fast_a_row_refused_before_sending_cuts_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Row 5 is NaN (refused by the sink): nothing from row 5 on is sent; a server refusal
    # before it wins.
    sink = fake_es_sink(monkeypatch)
    sink.fail_fast = True
    result = sink.send_batch(make_batch(10, amounts={5: float("nan")}))
    assert [f.index for f in result.failed] == [5]
    assert FakeNode.stored == [0, 1, 2, 3, 4]
    monkeypatch.setattr(FakeNode, "REFUSE", frozenset({3}))
    sink = fake_es_sink(monkeypatch)
    sink.fail_fast = True
    result = sink.send_batch(make_batch(10, amounts={5: float("nan")}))
    assert [f.index for f in result.failed] == [3]
    assert FakeNode.stored == [0, 1, 2, 4]


def test_fail_fast_a_request_rejected_whole_is_bisected_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from conveyor.core.sink import send_isolating

    monkeypatch.setattr(FakeNode, "REJECT_REQUEST", frozenset({130}))
    sink = fake_es_sink(monkeypatch, fail_fast_chunk_size=100)
    failed = send_isolating(sink, make_batch(300), fail_fast=True)
    assert [f.index for f in failed] == [130]
    assert "Malformed" in failed[0].message
    assert FakeNode.stored == list(range(130))  # the first request is not sent again


def test_fail_fast_outage_after_some_requests_resends_only_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(FakeNode, "UNAVAILABLE_FROM", 2)
    sink = fake_es_sink(monkeypatch, fail_fast_chunk_size=100)
    sink.fail_fast = True
    result = sink.send_batch(make_batch(250))
    assert FakeNode.stored == list(range(200))
    assert [f.index for f in result.failed] == list(range(200, 250))
    assert {f.kind for f in result.failed} == {ErrorKind.TRANSIENT}
    monkeypatch.setattr(FakeNode, "UNAVAILABLE_FROM", 0)
    sink = fake_es_sink(monkeypatch)
    sink.fail_fast = True
    with pytest.raises(TransientSinkError):
        sink.send_batch(make_batch(250))


def test_without_fail_fast_one_bulk_and_the_refusal_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(FakeNode, "REFUSE", frozenset({7}))
    sink = fake_es_sink(monkeypatch)
    result = sink.send_batch(make_batch(500))
    assert [f.index for f in result.failed] == [7]
    assert len(FakeNode.requests) == 1
    assert FakeNode.stored == [i for i in range(500) if i != 7]
