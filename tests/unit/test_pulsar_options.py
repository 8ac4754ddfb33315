"""Pulsar sink without a broker: the exact producer and client options (with pulsar's own
enum and authentication types), the per-message properties / partition key / event
timestamp, the mapping of ``pulsar.Result`` values and client exceptions, and config
validation. One test talks to a closed loopback port (no server) to check that an
unreachable broker is reported as transient."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path
from typing import Any

import pulsar
import pyarrow as pa
import pytest

from conveyor.core.errors import ConfigError, PermanentSinkError, TransientSinkError
from conveyor.sinks import build_sink
from conveyor.sinks.base import ErrorKind, RowFailure, iter_records
from conveyor.sinks.pulsar import (
    PulsarSink,
    PulsarSinkConfig,
    classify_result,
    client_options,
    map_error,
    message_content,
    message_kwargs,
    producer_options,
    render_topic,
)
from tests.sinks.contract import BASE_TS, closed_port, make_batch

BASE: dict[str, Any] = {
    "type": "pulsar",
    "service_url": "pulsar://127.0.0.1:6650",
    "topic": "persistent://public/default/orders",
}


def cfg(**kw: Any) -> PulsarSinkConfig:
    return PulsarSinkConfig.model_validate({**BASE, **kw})


def test_importing_the_module_does_not_import_pulsar() -> None:
    code = "import sys, conveyor.sinks.pulsar; assert 'pulsar' not in sys.modules and '_pulsar' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- producer and client options ----------------------------------------------------------------


def test_default_producer_options() -> None:
    assert producer_options(cfg()) == {
        "send_timeout_millis": 30_000,
        "compression_type": pulsar.CompressionType.NONE,
        "max_pending_messages": 1000,
        "block_if_queue_full": True,
        "batching_enabled": True,
        "batching_max_messages": 1000,
        "batching_max_allowed_size_in_bytes": 131072,
        "batching_max_publish_delay_ms": 10,
        "batching_type": pulsar.BatchingType.Default,
        "chunking_enabled": False,
    }


def test_configured_producer_options() -> None:
    opts = producer_options(
        cfg(
            producer_name="conveyor-orders",
            compression="ZSTD",
            send_timeout_ms=5000,
            batching_max_messages=500,
            batching_max_publish_delay_ms=50,
            batching_type="key_based",
            max_pending_messages=20_000,
        )
    )
    assert opts == {
        "send_timeout_millis": 5000,
        "compression_type": pulsar.CompressionType.ZSTD,
        "max_pending_messages": 20_000,
        "block_if_queue_full": True,
        "batching_enabled": True,
        "batching_max_messages": 500,
        "batching_max_allowed_size_in_bytes": 131072,
        "batching_max_publish_delay_ms": 50,
        "batching_type": pulsar.BatchingType.KeyBased,
        "chunking_enabled": False,
        "producer_name": "conveyor-orders",
    }


@pytest.mark.parametrize(
    ("name", "member"),
    [
        ("NONE", pulsar.CompressionType.NONE),
        ("LZ4", pulsar.CompressionType.LZ4),
        ("ZLIB", pulsar.CompressionType.ZLib),
        ("ZSTD", pulsar.CompressionType.ZSTD),
        ("SNAPPY", pulsar.CompressionType.SNAPPY),
    ],
)
def test_every_compression_maps_to_pulsars_enum(name: str, member: Any) -> None:
    assert producer_options(cfg(compression=name))["compression_type"] == member


def test_chunking_without_batching() -> None:
    opts = producer_options(cfg(batching_enabled=False, chunking_enabled=True))
    assert opts["batching_enabled"] is False and opts["chunking_enabled"] is True


def test_client_options_with_token_and_tls(file_root: Path) -> None:
    opts = client_options(
        cfg(
            service_url="pulsar+ssl://broker:6651",
            token="eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJjb252ZXlvciJ9.sig",
            tls_trust_certs_file_path=str(file_root / "ca.pem"),
            operation_timeout_s=10,
        )
    )
    auth = opts.pop("authentication")
    assert isinstance(auth, pulsar.AuthenticationToken)
    assert opts == {
        "operation_timeout_seconds": 10,
        "connection_timeout_ms": 10_000,
        "tls_allow_insecure_connection": False,
        "tls_validate_hostname": True,
        "tls_trust_certs_file_path": str(file_root / "ca.pem"),
    }


def test_the_client_accepts_the_options() -> None:
    # Creating a client does not connect; this checks the keyword names and types.
    opts = client_options(cfg(token="t0ken"))
    assert isinstance(opts["authentication"], pulsar.AuthenticationToken)
    client = pulsar.Client("pulsar://127.0.0.1:6650", **opts)
    try:
        assert client._client is not None  # the C++ client was built from these options
    finally:
        client.close()


# -- messages -----------------------------------------------------------------------------------


def test_message_properties_partition_key_and_event_timestamp() -> None:
    rec = next(iter_records(make_batch(1, start=7)))
    assert message_kwargs(rec, cfg()) == {
        "properties": {"h": "7"},
        "partition_key": "k7",
        "event_timestamp": int((BASE_TS + dt.timedelta(milliseconds=7)).timestamp() * 1000),
    }
    assert message_kwargs(rec, cfg())["event_timestamp"] == 1793534400007
    assert message_content(rec) == b'{"id":7,"name":"name 7","amount":10.5}'


def test_metadata_properties_and_no_partition_key() -> None:
    rec = next(iter_records(make_batch(1, start=3)))
    assert message_kwargs(rec, cfg(metadata_properties=True, key_as_partition_key=False)) == {
        "properties": {
            "h": "3",
            "conveyor.topic": "orders",
            "conveyor.partition": "0",
            "conveyor.offset": "3",
        },
        "event_timestamp": 1793534400003,
    }


def test_binary_keys_and_headers_are_base64_text() -> None:
    headers = pa.array(
        [[{"key": "raw", "value": b"\xff\xfe"}]],
        pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())])),
    )
    batch = pa.table(
        {
            "value": pa.array([b"\x00\x01"], pa.binary()),
            "__key": pa.array([b"\xff"], pa.binary()),
            "__headers": headers,
        }
    )
    rec = next(iter_records(batch))
    assert message_kwargs(rec, cfg()) == {
        "properties": {"raw": "base64://4="},
        "partition_key": "base64:/w==",
    }
    assert message_content(rec) == b"\x00\x01"  # raw bytes stay raw


def test_a_null_payload_is_a_null_value_message() -> None:
    rec = next(iter_records(pa.table({"value": pa.array([None], pa.binary())})))
    assert message_content(rec) is None
    assert (
        message_kwargs(rec, cfg()) == {}
    )  # no key, no headers, no timestamp in this hand-made batch


def test_the_producer_accepts_the_message_arguments() -> None:
    # pulsar's own argument checks (the same ones send_async runs) accept what we build.
    from pulsar import Producer

    rec = next(iter_records(make_batch(1)))
    producer = Producer()
    producer._schema = pulsar.schema.BytesSchema()
    bare = producer._build_msg(
        message_content(rec), None, None, None, None, None, False, None, None, None
    )
    assert bare.data() == message_content(rec) and bare.properties() == {}
    kw = message_kwargs(rec, cfg())
    msg = producer._build_msg(
        message_content(rec),
        kw["properties"],
        kw["partition_key"],
        None,
        None,
        None,
        False,
        kw["event_timestamp"],
        None,
        None,
    )
    # The built message carries what we meant it to.
    assert msg.data() == message_content(rec)
    assert msg.properties() == kw["properties"]
    assert msg.partition_key() == kw["partition_key"]
    assert msg.event_timestamp() == kw["event_timestamp"]


def test_topic_templates() -> None:
    rec = next(iter_records(make_batch(1, topic="orders")))
    assert (
        render_topic("persistent://public/default/${topic}-copy", rec)
        == "persistent://public/default/orders-copy"
    )
    with pytest.raises(ValueError, match="destination"):
        render_topic("${destination}", rec)


# -- results and exceptions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "kind"),
    [
        (pulsar.Result.Ok, "ok"),
        (pulsar.Result.MessageTooBig, "data"),
        (pulsar.Result.InvalidMessage, "data"),
        (pulsar.Result.Timeout, "transient"),
        (pulsar.Result.ConnectError, "transient"),
        (pulsar.Result.NotConnected, "transient"),
        (pulsar.Result.ServiceUnitNotReady, "transient"),
        (pulsar.Result.ProducerQueueIsFull, "transient"),
        (pulsar.Result.BrokerPersistenceError, "transient"),
        (pulsar.Result.AlreadyClosed, "transient"),
        (pulsar.Result.AuthenticationError, "permanent"),
        (pulsar.Result.AuthorizationError, "permanent"),
        (pulsar.Result.TopicNotFound, "permanent"),
        (pulsar.Result.TopicTerminated, "permanent"),
        (pulsar.Result.ProducerFenced, "permanent"),
    ],
)
def test_result_codes(result: Any, kind: str) -> None:
    assert classify_result(result) == kind


def test_every_result_code_is_classified() -> None:
    for name, member in pulsar.Result.__members__.items():
        assert classify_result(member) in ("ok", "data", "transient", "permanent"), name


def test_row_failures_from_callback_results() -> None:
    sink = PulsarSink(cfg())
    R = pulsar.Result
    assert sink._row_failures([R.Ok, R.MessageTooBig, None, R.Ok], {}) == [
        RowFailure(1, "MessageTooBig")
    ]
    with pytest.raises(TransientSinkError, match="Timeout"):
        sink._row_failures([None, R.MessageTooBig, R.Timeout], {})
    # Some acknowledged: a partial acknowledgement, only the unacknowledged one is re-sent.
    assert sink._row_failures([R.Ok, R.MessageTooBig, R.Timeout], {}) == [
        RowFailure(1, "MessageTooBig"),
        RowFailure(2, "Timeout", ErrorKind.TRANSIENT),
    ]
    with pytest.raises(PermanentSinkError, match="AuthorizationError"):
        sink._row_failures([R.Timeout, R.AuthorizationError], {})


def test_client_exceptions_map_by_class() -> None:
    assert isinstance(
        map_error(pulsar.exceptions.Timeout("Pulsar error: TimeOut")), TransientSinkError
    )
    assert isinstance(
        map_error(pulsar.exceptions.ConnectError("Pulsar error: ConnectError")), TransientSinkError
    )
    assert isinstance(
        map_error(pulsar.exceptions.AuthenticationError("Pulsar error: AuthenticationError")),
        PermanentSinkError,
    )
    assert isinstance(
        map_error(pulsar.exceptions.TopicNotFound("Pulsar error: TopicNotFound")),
        PermanentSinkError,
    )
    assert map_error(KeyError("x")) is None


def test_an_unreachable_broker_is_transient() -> None:
    # No server: a closed loopback port. The producer lookup times out after operation_timeout_s.
    sink = build_sink(
        {
            **BASE,
            "service_url": f"pulsar://127.0.0.1:{closed_port()}",
            "operation_timeout_s": 2,
            "connection_timeout_ms": 500,
        }
    )
    try:
        with pytest.raises(TransientSinkError):
            sink.init_sink()
    finally:
        sink.cleanup_sink()
        sink.cleanup_sink()


# -- config -------------------------------------------------------------------------------------


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"service_url": "http://127.0.0.1:8080"}, "service_url"),
    ({"topic": "a {b}"}, "topic"),
    ({"topic": "{partition}"}, "topic"),
    ({"compression": "GZIP"}, "compression"),
    ({"send_timeout_ms": 0}, "send_timeout_ms"),
    ({"batching_max_messages": 0}, "batching_max_messages"),
    ({"chunking_enabled": True}, "chunking_enabled"),
    ({"token": ""}, "token"),
    ({"tls_trust_certs_file_path": "/ca.pem"}, "tls_trust_certs_file_path"),
]


@pytest.mark.parametrize(("override", "field_name"), BAD_FIELDS)
def test_validate_rejects_each_bad_field(override: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_sink({**BASE, **override})
    assert field_name in str(err.value)


def test_rejects_unknown_field() -> None:
    with pytest.raises(ConfigError, match="no_such_option"):
        build_sink({**BASE, "no_such_option": 1})


def test_the_token_is_redacted() -> None:
    sink = build_sink({**BASE, "token": "s3cret-jwt"})
    assert "s3cret-jwt" not in str(sink.config.redacted())


def test_event_timestamps_are_exact_integers() -> None:
    from conveyor.sinks.pulsar import epoch_ms

    for ms in range(0, 2000, 7):
        ts = BASE_TS + dt.timedelta(milliseconds=ms, microseconds=999)
        assert epoch_ms(ts) == 1793534400000 + ms
    assert epoch_ms(dt.datetime(1970, 1, 1, 0, 0, 1)) == 1000  # naive = UTC


# -- fail_fast: one message at a time -----------------------------------------------------------


class FakeProducer:
    """Results as the client gives them: ``refuse`` maps a message id to its Result, reported
    in the callback at ``flush`` (as for a client batch that closes), ``raise_on`` makes
    ``send_async`` raise. ``sent`` is every message handed to the client, ``stored`` the
    ones the broker persisted."""

    def __init__(
        self, refuse: dict[int, Any] | None = None, raise_on: frozenset[int] = frozenset()
    ):
        self.refuse = refuse or {}
        self.raise_on = raise_on
        self.sent: list[int] = []
        self.stored: list[int] = []
        self.pending: list[tuple[int, Any]] = []
        self.flushes = 0

    def send_async(self, content: bytes, callback: Any, **kwargs: Any) -> None:
        import json

        row = json.loads(content)["id"]
        if row in self.raise_on:
            raise ValueError("Argument 'properties' has incorrect type")
        self.sent.append(row)
        self.pending.append((row, callback))

    def flush(self) -> None:
        self.flushes += 1
        pending, self.pending = self.pending, []
        for row, callback in pending:
            result = self.refuse.get(row, pulsar.Result.Ok)
            if result == pulsar.Result.Ok:
                self.stored.append(row)
            callback(result, None)

    def close(self) -> None:
        pass


class FakeClient:
    def __init__(self, producer: FakeProducer):
        self.producer = producer

    def create_producer(self, topic: str, **kwargs: Any) -> FakeProducer:
        return self.producer

    def close(self) -> None:
        pass


def fake_sink(producer: FakeProducer) -> PulsarSink:
    sink = PulsarSink(cfg())
    sink._client = FakeClient(producer)
    return sink


def test_fail_fast_sends_nothing_after_a_refused_message() -> None:
    from conveyor.core.sink import send_isolating

    producer = FakeProducer(refuse={7: pulsar.Result.MessageTooBig})
    failed = send_isolating(fake_sink(producer), make_batch(20), fail_fast=True)
    assert failed == [RowFailure(7, "MessageTooBig")]
    assert producer.sent == list(range(8))  # the refused one is the last handed to the client
    assert producer.stored == list(range(7))
    assert producer.flushes == 8  # each message acknowledged before the next


def test_fail_fast_stops_at_a_message_send_async_refuses() -> None:
    producer = FakeProducer(raise_on=frozenset({3}))
    sink = fake_sink(producer)
    sink.fail_fast = True
    result = sink.send_batch(make_batch(10))
    assert [f.index for f in result.failed] == [3]
    assert result.failed[0].message.startswith("InvalidMessage: ")
    assert producer.sent == producer.stored == [0, 1, 2]


def test_fail_fast_outage_after_some_acknowledged_resends_the_rest() -> None:
    producer = FakeProducer(refuse={4: pulsar.Result.Timeout})
    sink = fake_sink(producer)
    sink.fail_fast = True
    result = sink.send_batch(make_batch(6))
    assert result.failed == (
        RowFailure(4, "Timeout", ErrorKind.TRANSIENT),
        RowFailure(5, "not sent", ErrorKind.TRANSIENT),
    )
    assert producer.sent == [0, 1, 2, 3, 4]
    producer = FakeProducer(refuse={0: pulsar.Result.Timeout})
    sink = fake_sink(producer)
    sink.fail_fast = True
    with pytest.raises(TransientSinkError, match="Timeout"):
        sink.send_batch(make_batch(6))
    sink = fake_sink(FakeProducer(refuse={2: pulsar.Result.AuthorizationError}))
    sink.fail_fast = True
    with pytest.raises(PermanentSinkError, match="message 2: AuthorizationError"):
        sink.send_batch(make_batch(6))


def test_without_fail_fast_every_message_is_sent_and_the_refusal_reported() -> None:
    producer = FakeProducer(refuse={7: pulsar.Result.MessageTooBig})
    failed = fake_sink(producer).send_batch(make_batch(20)).failed
    assert failed == (RowFailure(7, "MessageTooBig"),)
    assert producer.sent == list(range(20))  # the client reports it after the batch went out
    assert producer.stored == [i for i in range(20) if i != 7]
    assert producer.flushes == 1
