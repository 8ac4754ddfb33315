"""Kafka sink without a server: config, producer arguments, templates, records, error mapping."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka import errors as ke

from conveyor.core.errors import ConfigError, PermanentSinkError, TransientSinkError
from conveyor.sinks import build_sink, parse_sink_config
from conveyor.sinks.base import Record, iter_records
from conveyor.sinks.kafka import (
    KafkaSink,
    KafkaSinkConfig,
    classify_kafka_error,
    codec_available,
    producer_kwargs,
    template_problems,
    timestamp_ms,
    topic_name_problem,
)
from conveyor.sinks.templates import TemplateError
from conveyor.sinks.templates import render as render_template
from tests.sinks.contract import BASE_TS, make_batch

BASE = {"type": "kafka", "bootstrap_servers": "127.0.0.1:9092", "topic": "orders-out"}


@pytest.fixture(autouse=True)
def _secrets_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the clients' options, not the secrets policy (tests/unit/
    test_secrets.py): the operator lets references read any variable."""
    monkeypatch.setenv("CONVEYOR_SECRET_ENV", "*")


def sink(**over: Any) -> KafkaSink:
    s = build_sink({**BASE, **over})
    assert isinstance(s, KafkaSink)
    return s


def record(**over: Any) -> Record:
    fields = {
        "index": 0,
        "topic": "orders",
        "partition": 3,
        "offset": 42,
        "timestamp": BASE_TS,
        "key": b"k1",
        "headers": [("h", b"1")],
        "destination": None,
        "payload": {
            "id": 1,
            "name": "a b",
            "customer": {"region": "eu"},
            "flag": True,
            "none": None,
        },
    }
    fields.update(over)
    return Record(**fields)


# -- config --------------------------------------------------------------------------------------


def test_defaults_and_producer_kwargs() -> None:
    cfg = parse_sink_config({**BASE, "bootstrap_servers": "a:9092, b:9093"})
    assert isinstance(cfg, KafkaSinkConfig)
    kw = producer_kwargs(cfg)
    assert kw == {
        "bootstrap_servers": ["a:9092", "b:9093"],
        "client_id": "conveyor-sink",
        "acks": "all",
        "enable_idempotence": True,
        "compression_type": None,
        "linger_ms": 5,
        "batch_size": 262144,
        "max_request_size": 1048576,
        "request_timeout_ms": 30000,
        "delivery_timeout_ms": 120000,
        "max_block_ms": 60000,
        "bootstrap_timeout_ms": 30000,
        "security_protocol": "PLAINTEXT",
    }


def test_producer_kwargs_are_all_known_to_kafka_python(
    tmp_path: Path, file_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kafka import KafkaProducer

    for name in ("ca.pem", "c.pem", "k.pem"):
        (tmp_path / name).write_text("PEM")
    monkeypatch.setenv("SINK_KAFKA_PW", "s3cret")
    cfg = parse_sink_config(
        {
            **BASE,
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "svc",
            "sasl_password": "${env:SINK_KAFKA_PW}",
            "ssl_cafile": str(tmp_path / "ca.pem"),
            "ssl_certfile": str(tmp_path / "c.pem"),
            "ssl_keyfile": str(tmp_path / "k.pem"),
            "compression": "gzip",
            "acks": "all",
        }
    )
    kw = producer_kwargs(cfg)
    assert set(kw) <= set(KafkaProducer.DEFAULT_CONFIG)
    assert (
        kw["sasl_mechanism"] == "SCRAM-SHA-512"
        and kw["sasl_plain_username"] == "svc"
        and kw["sasl_plain_password"] == "s3cret"
    )
    assert kw["ssl_cafile"] == str(tmp_path / "ca.pem") and kw["compression_type"] == "gzip"
    non_idem = producer_kwargs(parse_sink_config({**BASE, "idempotent": False, "acks": "1"}))
    assert non_idem["acks"] == 1 and non_idem["enable_idempotence"] is False


def test_passwords_are_references_never_values(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"sink.sasl_password: .*reference"):
        sink(
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="PLAIN",
            sasl_username="u",
            sasl_password="hunter2",
        )
    s = sink(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_username="u",
        sasl_password="${env:SINK_KAFKA_PW2}",
    )
    # The reference is what the spec (and so the meta store) holds; the value stays in the run.
    assert s.config.redacted()["sasl_password"] == "${env:SINK_KAFKA_PW2}"
    monkeypatch.setenv("SINK_KAFKA_PW2", "hunter2")
    assert producer_kwargs(s.config)["sasl_plain_password"] == "hunter2"
    assert "hunter2" not in repr(s.config) and "hunter2" not in s.describe()
    monkeypatch.delenv("SINK_KAFKA_PW2")
    with pytest.raises(
        ConfigError,
        match=r"sink.sasl_password: \$\{env:SINK_KAFKA_PW2\}: environment variable SINK_KAFKA_PW2 is not set",
    ):
        producer_kwargs(s.config)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"bootstrap_servers": "nohost"}, "bootstrap_servers"),
        ({"bootstrap_servers": "a:9092,b"}, "bootstrap_servers"),
        ({"topic": "has space"}, "topic"),
        ({"topic": "x" * 250}, "topic"),
        ({"topic": ".."}, "topic"),
        ({"topic": "t-${unknown}"}, "topic"),
        ({"topic": "t-${payload.}"}, "topic"),
        ({"topic": "t-${topic"}, "topic"),
        ({"key": "${what}"}, "key"),
        ({"compression": "lzma"}, "compression"),
        ({"acks": "1"}, "acks"),
        ({"acks": 0, "idempotent": False}, "acks"),
        ({"batch_size": 10}, "batch_size"),
        ({"max_request_size": 100}, "max_request_size"),
        ({"request_timeout_ms": 10}, "request_timeout_ms"),
        ({"delivery_timeout_ms": 20_000}, "delivery_timeout_ms"),
        ({"timestamp": "log_append"}, "timestamp"),
        ({"partitioning": "round_robin"}, "partitioning"),
        ({"security_protocol": "SASL_PLAINTEXT"}, "sasl_mechanism"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"}, "sasl_username"),
        (
            {
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "u",
            },
            "sasl_password",
        ),
        ({"sasl_mechanism": "GSSAPI"}, "sasl_mechanism"),
        ({"sasl_password": "x"}, "sasl_password"),
        ({"ssl_certfile": "/c.pem"}, "ssl_certfile"),
        ({"security_protocol": "SSL", "ssl_certfile": "c.pem"}, "ssl_keyfile"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_config_names_the_field(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_sink({**BASE, **override})
    assert field in str(err.value)


def test_compression_codecs_follow_installed_libraries() -> None:
    assert codec_available("none") and codec_available("gzip")
    for codec in ("snappy", "lz4", "zstd"):
        if codec_available(codec):
            sink(compression=codec)
        else:
            with pytest.raises(ConfigError, match="compression.*not installed"):
                sink(compression=codec)


def test_asset_key_and_describe() -> None:
    assert sink().config.asset_key_path() == ["kafka", "orders_out"]
    assert sink(topic="out-${topic}-${payload.region}").config.asset_key_path() == [
        "kafka",
        "out_topic_region",
    ]
    assert sink().describe() == "kafka/orders-out@127.0.0.1:9092"


def test_importing_the_sink_modules_does_not_import_their_clients() -> None:
    code = "import sys, conveyor.sinks.kafka, conveyor.sinks.kafka_confluent, conveyor.sinks.rabbitmq; sys.exit(1 if {'kafka', 'confluent_kafka', 'pika'} & set(sys.modules) else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- templates -----------------------------------------------------------------------------------


def test_template_rendering() -> None:
    r = record()
    assert render_template("${topic}.${partition}.${offset}", r) == "orders.3.42"
    assert render_template("k=${key}", r) == "k=k1"
    assert (
        render_template("${payload.customer.region}-${payload.id}-${payload.flag}", r)
        == "eu-1-true"
    )
    assert render_template("${ payload.name }", r) == "a b"
    assert render_template("${payload.customer}", r) == '{"region":"eu"}'
    assert render_template("static", r) == "static"
    assert render_template("${destination}", record(destination="d1")) == "d1"


@pytest.mark.parametrize(
    ("template", "rec", "match"),
    [
        ("${payload.missing}", record(), "no field 'missing'"),
        ("${payload.customer.city}", record(), "customer.city"),
        ("${payload.none}", record(), "null"),
        ("${key}", record(key=None), "no key"),
        ("${destination}", record(), "no destination"),
        ("${payload.id}", record(payload=b"not json"), "no field"),
    ],
)
def test_template_errors_are_row_errors(template: str, rec: Record, match: str) -> None:
    with pytest.raises(TemplateError, match=match):
        render_template(template, rec)


def test_template_on_a_json_text_payload() -> None:
    assert render_template("${payload.id}", record(payload=b'{"id": 9}')) == "9"


def test_template_problems() -> None:
    assert template_problems("a-${topic}-${payload.x.y}") == []
    assert template_problems("") == ["must not be empty"]
    assert "unknown placeholder" in template_problems("${nope}")[0]
    assert template_problems("${topic") == ["unclosed '${'"]
    assert topic_name_problem("ok.topic_1-x") is None
    assert topic_name_problem("no/slash")


# -- records -------------------------------------------------------------------------------------


def test_target_topic_destination_and_illegal_names() -> None:
    s = sink(topic="out-${topic}")
    assert s.target_topic(record()) == "out-orders"
    assert s.target_topic(record(destination="special")) == "special"
    assert (
        sink(topic="out-${topic}", use_destination=False).target_topic(
            record(destination="special")
        )
        == "out-orders"
    )
    with pytest.raises(TemplateError, match="legal topic name"):
        sink(topic="out-${payload.name}").target_topic(record())


def test_message_keeps_key_headers_timestamp() -> None:
    m = sink().message(record())
    assert m == {
        "value": b'{"id":1,"name":"a b","customer":{"region":"eu"},"flag":true,"none":null}',
        "key": b"k1",
        "headers": [("h", b"1")],
        "timestamp_ms": timestamp_ms(BASE_TS),
        "partition": None,
    }
    m2 = sink(
        key="${payload.id}",
        keep_headers=False,
        coordinate_headers=True,
        timestamp="now",
        partitioning="source",
    ).message(record())
    assert m2["key"] == b"1" and m2["timestamp_ms"] is None and m2["partition"] == 3
    assert m2["headers"] == [
        ("x-conveyor-topic", b"orders"),
        ("x-conveyor-partition", b"3"),
        ("x-conveyor-offset", b"42"),
    ]
    assert sink().message(record(payload=None))["value"] is None  # tombstone
    assert sink().message(record(headers=[("n", None)]))["headers"] == [("n", b"")]


def test_message_from_a_contract_batch() -> None:
    r = list(iter_records(make_batch(3)))[2]
    m = sink().message(r)
    assert (
        m["key"] == b"k2"
        and m["headers"] == [("h", b"2")]
        and m["timestamp_ms"] == timestamp_ms(BASE_TS) + 2
    )


def _row_by_row(s: KafkaSink, batch: pa.Table) -> list[tuple[int, str, dict[str, Any]]]:
    out = []
    for r in iter_records(batch):
        try:
            out.append((r.index, s.target_topic(r), s.message(r)))
        except TemplateError as e:
            out.append((r.index, f"error: {e}", {}))
    return out


def _columnar(s: KafkaSink, batch: pa.Table) -> list[tuple[int, str, dict[str, Any]]]:
    out = s.outgoing(batch)
    return [
        (i, f"error: {t}", {}) if isinstance(t, TemplateError) else (i, t, out.message(i))
        for i, t in enumerate(out.topics)
    ]


def _odd_batch() -> pa.Table:
    """Single ``value`` column: bytes, text, a null (tombstone), a number; missing keys,
    null and empty headers, destinations (one illegal), microsecond timestamps before
    and after the epoch, a null timestamp."""
    us = pa.timestamp("us", tz="UTC")
    return pa.table(
        {
            "value": pa.array(['{"a": 1}', "plain text", None, "x"], pa.string()),
            "__topic": pa.array(["orders", "orders", None, "orders"], pa.string()),
            "__partition": pa.array([0, 1, None, 2], pa.int32()),
            "__offset": pa.array([5, 6, 7, 8], pa.int64()),
            "__timestamp": pa.array(
                [
                    dt.datetime(1969, 12, 31, 23, 59, 59, 999_500, tzinfo=dt.timezone.utc),
                    BASE_TS + dt.timedelta(microseconds=1_999),
                    None,
                    BASE_TS,
                ],
                us,
            ),
            "__key": pa.array([b"k", None, b"", b"k3"], pa.binary()),
            "__headers": pa.array(
                [[{"key": "h", "value": None}], None, [], [{"key": "a", "value": b"1"}]],
                make_batch(1).schema.field("__headers").type,
            ),
            "__destination": pa.array([None, "routed", "bad topic!", None], pa.string()),
        }
    )


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"keep_headers": False, "coordinate_headers": True},
        {"timestamp": "now", "partitioning": "source"},
        {"use_destination": False},
        {"key": "${payload.id}"},  # a key template: row by row
        {"topic": "out-${topic}"},  # a topic template: row by row
    ],
)
@pytest.mark.parametrize("batch", [make_batch(50), _odd_batch()], ids=["columns", "value"])
def test_columnar_messages_equal_the_row_by_row_ones(over: dict[str, Any], batch: pa.Table) -> None:
    s = sink(**over)
    assert _columnar(s, batch) == _row_by_row(s, batch)


def test_columnar_messages_of_odd_rows() -> None:
    got = _columnar(sink(), _odd_batch())
    assert [t for _, t, _ in got] == ["orders-out", "routed", got[2][1], "orders-out"]
    assert got[2][1].startswith("error: ")  # an illegal destination is that row's error
    assert [m.get("value") for _, _, m in got] == [b'{"a": 1}', b"plain text", None, b"x"]
    assert got[0][2]["timestamp_ms"] == -1  # floored, like timestamp_ms
    assert got[1][2]["timestamp_ms"] == timestamp_ms(BASE_TS) + 1
    assert got[0][2]["headers"] == [("h", b"")]
    after = _columnar(sink(), _odd_batch().slice(1))  # none before the epoch: Arrow divides
    assert [m.get("timestamp_ms") for _, _, m in after] == [
        timestamp_ms(BASE_TS) + 1,
        None,
        timestamp_ms(BASE_TS),
    ]


def test_timestamp_ms_is_exact() -> None:
    assert timestamp_ms(None) is None
    assert timestamp_ms(dt.datetime(1970, 1, 1, 0, 0, 0, 1000, tzinfo=dt.timezone.utc)) == 1
    assert (
        timestamp_ms(dt.datetime(2026, 11, 1, 12, 0, 0, 7000)) == timestamp_ms(BASE_TS) + 7
    )  # naive = UTC
    t = pa.array(
        [BASE_TS + dt.timedelta(milliseconds=999)], pa.timestamp("ms", tz="UTC")
    ).to_pylist()[0]
    assert timestamp_ms(t) == timestamp_ms(BASE_TS) + 999


# -- error mapping -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ke.MessageSizeTooLargeError("The message is 20480 bytes"), "data"),
        (ke.RecordListTooLargeError(), "data"),
        (ke.InvalidTopicError(), "data"),
        (ke.CorruptRecordError(), "data"),
        (ke.InvalidRecordError(), "data"),
        (ke.InvalidTimestampError(), "data"),
        (ValueError('Topic name "a b" is illegal'), "data"),
        (ValueError("Unrecognized partition 7 for topic t"), "data"),
        (TypeError("All headers items must be (str, bytes) tuples"), "data"),
        (ke.KafkaTimeoutError("Unable to bootstrap from 127.0.0.1:1"), "transient"),
        (ke.KafkaTimeoutError("Expiring 5 record(s) for t-0: 3001 ms has passed"), "transient"),
        (ke.KafkaConnectionError("connection reset"), "transient"),
        (ke.NotLeaderForPartitionError(), "transient"),
        (ke.LeaderNotAvailableError(), "transient"),
        (ke.RequestTimedOutError(), "transient"),
        (ke.NotEnoughReplicasError(), "transient"),
        (ke.NotEnoughReplicasAfterAppendError(), "transient"),
        (ke.UnknownTopicOrPartitionError(), "transient"),
        (ke.NodeNotReadyError(), "transient"),
        (ke.KafkaStorageError(), "transient"),
        (ke.ThrottlingQuotaExceededError(), "transient"),
        (ke.OutOfOrderSequenceNumberError(), "transient"),
        (ke.UnknownError(), "transient"),
        (ke.IllegalStateError("KafkaProducer already closed!"), "transient"),
        (OSError(111, "Connection refused"), "transient"),
        (ke.TopicAuthorizationFailedError({"t"}), "permanent"),
        (ke.ClusterAuthorizationFailedError(), "permanent"),
        (ke.TransactionalIdAuthorizationFailedError(), "permanent"),
        (ke.SaslAuthenticationFailedError("bad credentials"), "permanent"),
        (ke.UnsupportedSaslMechanismError(), "permanent"),
        (ke.IllegalSaslStateError(), "permanent"),
        (ke.UnsupportedVersionError(), "permanent"),
        (ke.UnsupportedCompressionTypeError(), "permanent"),
        (
            ke.KafkaConfigurationError("enable_idempotence=True is incompatible with acks=1"),
            "permanent",
        ),
        (ke.PolicyViolationError(), "permanent"),
    ],
)
def test_classify_kafka_error(exc: BaseException, kind: str) -> None:
    assert classify_kafka_error(exc) == kind


def test_ssl_verification_failure_is_permanent() -> None:
    import ssl

    assert (
        classify_kafka_error(ssl.SSLCertVerificationError(1, "certificate verify failed"))
        == "permanent"
    )


def test_batch_level_errors_become_sink_errors() -> None:
    s = sink()
    assert isinstance(s._error(ke.KafkaTimeoutError("x"), "ctx"), TransientSinkError)
    assert isinstance(s._error(ke.SaslAuthenticationFailedError("x"), "ctx"), PermanentSinkError)
    # a content error outside a row (e.g. the cluster refuses the codec) is the config's fault
    assert isinstance(s._error(ke.UnsupportedCompressionTypeError(), "ctx"), PermanentSinkError)
    e = s._error(ke.MessageSizeTooLargeError("too big"), "producing")
    assert (
        isinstance(e, PermanentSinkError)
        and "MessageSizeTooLargeError" in str(e)
        and str(e).startswith("producing: ")
    )


def test_send_batch_of_nothing_needs_no_connection() -> None:
    assert sink().send_batch(make_batch(0)).rows == 0


class _Future:
    def __init__(self, exc: BaseException | None):
        self.exception, self.is_done = exc, True

    def succeeded(self) -> bool:
        return self.exception is None


class _Producer:
    """Acknowledges every record but those whose index is in ``lost`` (a broker gone)."""

    def __init__(self, lost: set[int]):
        self.lost, self.sent = lost, []

    def send(self, topic: str, **msg: Any) -> _Future:
        self.sent.append(msg["value"])
        n = len(self.sent) - 1
        return _Future(ke.KafkaTimeoutError("expired") if n in self.lost else None)

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        pass


def test_a_batch_partly_acknowledged_reports_the_rest_as_transient_row_failures() -> None:
    from conveyor.sinks.base import ErrorKind

    s = sink()
    s._producer = _Producer(lost={3, 4})
    result = s.send_batch(make_batch(6))
    assert [(f.index, f.kind) for f in result.failed] == [
        (3, ErrorKind.TRANSIENT),
        (4, ErrorKind.TRANSIENT),
    ]
    s._producer = _Producer(lost={0, 1})  # nothing acknowledged: an outage of the whole batch
    with pytest.raises(TransientSinkError):
        s.send_batch(make_batch(2))


def test_fail_fast_produces_nothing_after_a_record_the_producer_refuses() -> None:
    s = sink(max_request_size=2048)
    s.fail_fast = True
    producer = _Producer(lost=set())

    def send(topic: str, **msg: Any) -> _Future:
        if len(msg["value"]) > 2048:
            raise ke.MessageSizeTooLargeError("too large")
        return _Producer.send(producer, topic, **msg)

    producer.send = send  # type: ignore[method-assign]
    s._producer = producer
    result = s.send_batch(make_batch(10, names={4: "x" * 5000}))
    assert [f.index for f in result.failed] == [4]
    assert len(producer.sent) == 4  # rows 0-3, nothing after the refused one


# -- the librdkafka client (sink.client: confluent) ----------------------------------------------


def test_librdkafka_producer_config(
    tmp_path: Path, file_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from confluent_kafka import Producer

    from conveyor.sinks.kafka_confluent import producer_config

    for name in ("ca.pem", "c.pem", "k.pem"):
        (tmp_path / name).write_text("PEM")
    monkeypatch.setenv("SINK_KAFKA_PW", "s3cret")
    cfg = parse_sink_config(
        {
            **BASE,
            "client": "confluent",
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "svc",
            "sasl_password": "${env:SINK_KAFKA_PW}",
            "ssl_cafile": str(tmp_path / "ca.pem"),
            "compression": "zstd",
            "max_request_size": 1 << 30,
            "client_options": {"socket.keepalive.enable": True},
        }
    )
    assert isinstance(cfg, KafkaSinkConfig)
    conf = producer_config(cfg)
    assert {k: conf[k] for k in ("acks", "enable.idempotence", "compression.type")} == {
        "acks": "all",
        "enable.idempotence": True,
        "compression.type": "zstd",
    }
    assert conf["message.max.bytes"] == 1_000_000_000  # librdkafka's bound
    assert conf["message.timeout.ms"] == 120_000 and conf["partitioner"] == "murmur2_random"
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512" and conf["sasl.password"] == "s3cret"
    assert conf["ssl.ca.location"] == str(tmp_path / "ca.pem")
    assert conf["socket.keepalive.enable"] is True  # client_options under librdkafka's names
    plain = producer_config(
        parse_sink_config({**BASE, "client": "confluent", "idempotent": False, "acks": "1"})  # type: ignore[arg-type]
    )
    assert plain["acks"] == 1 and plain["enable.idempotence"] is False
    Producer(plain)  # librdkafka accepts every property (it refuses unknown ones)


def test_librdkafka_client_options_are_librdkafka_names() -> None:
    s = sink(client="confluent", client_options={"linger_ms": 3})
    with pytest.raises(PermanentSinkError, match="librdkafka property"):
        s.init_sink()
    s.cleanup_sink()
    # kafka-python's codec libraries do not matter to librdkafka
    sink(client="confluent", compression="snappy").validate()


def _delivered(fail: dict[int, int], *, only_errors: bool = False) -> Any:
    """A ConfluentProducer whose librdkafka producer reports each record delivered, except
    the records in ``fail`` (index -> librdkafka error code), at flush (a report for every
    record, as without ``delivery.report.only.error``, whose successes are ignored; with
    ``only_errors``, for the failed records only, as librdkafka with it)."""
    from confluent_kafka import KafkaError

    from conveyor.sinks.kafka_confluent import ConfluentProducer

    class _Rd:
        def __init__(self) -> None:
            self.queued: list[Any] = []
            self.sent: list[bytes] = []
            self.fail = fail

        def produce(self, topic: str, value: bytes | None, *args: Any) -> None:
            # librdkafka's positional order: key, partition, on_delivery, ...
            self.queued.append(args[2])
            self.sent.append(value)

        def flush(self, timeout: float) -> int:
            for n, cb in enumerate(self.queued):
                if n in self.fail or not only_errors:
                    cb(KafkaError(self.fail[n]) if n in self.fail else None, None)
            self.queued = []
            return 0

        def purge(self, **kw: Any) -> None:
            pass

    return ConfluentProducer(sink(client="confluent").config, {}, client=_Rd())


def test_librdkafka_delivery_reports_are_per_row() -> None:
    from confluent_kafka import KafkaError

    from conveyor.sinks.base import ErrorKind

    s = sink(client="confluent")
    s._producer = _delivered({2: KafkaError.MSG_SIZE_TOO_LARGE, 4: KafkaError._MSG_TIMED_OUT})
    result = s.send_batch(make_batch(6))
    assert [(f.index, f.kind) for f in result.failed] == [
        (2, ErrorKind.DATA),  # the broker refused the record: that row only
        (4, ErrorKind.TRANSIENT),  # not acknowledged: only it is sent again
    ]
    assert "MSG_SIZE_TOO_LARGE" in result.failed[0].message
    s._producer = _delivered({1: KafkaError.INVALID_RECORD})
    assert [(f.index, f.kind) for f in s.send_batch(make_batch(3)).failed] == [(1, ErrorKind.DATA)]
    s._producer = _delivered({0: KafkaError._MSG_TIMED_OUT, 1: KafkaError._MSG_TIMED_OUT})
    with pytest.raises(TransientSinkError):  # nothing acknowledged: an outage of the batch
        s.send_batch(make_batch(2))
    assert s._producer is None  # dropped; the next batch reconnects
    s._producer = _delivered({0: KafkaError.TOPIC_AUTHORIZATION_FAILED})
    with pytest.raises(PermanentSinkError, match="TOPIC_AUTHORIZATION_FAILED"):
        s.send_batch(make_batch(2))


def test_librdkafka_failure_reports_name_their_rows_batch_after_batch() -> None:
    """With failures reported alone (``delivery.report.only.error``, the producer's config),
    each names its row through the row's reporter, reused by every batch; a batch's
    failures do not carry over to the next."""
    from confluent_kafka import KafkaError

    from conveyor.sinks.base import ErrorKind
    from conveyor.sinks.kafka_confluent import producer_config

    assert producer_config(sink(client="confluent").config)["delivery.report.only.error"] is True
    s = sink(client="confluent")
    producer = _delivered(
        {3: KafkaError.MSG_SIZE_TOO_LARGE, 7: KafkaError.INVALID_RECORD}, only_errors=True
    )
    s._producer = producer
    assert [(f.index, f.kind) for f in s.send_batch(make_batch(10)).failed] == [
        (3, ErrorKind.DATA),
        (7, ErrorKind.DATA),
    ]
    reports = producer._reports
    producer._p.fail = {}
    assert s.send_batch(make_batch(5)).failed == ()  # nothing from the batch before
    producer._p.fail = {12: KafkaError._MSG_TIMED_OUT}
    result = s.send_batch(make_batch(40))
    assert [(f.index, f.kind) for f in result.failed] == [(12, ErrorKind.TRANSIENT)]
    assert producer._reports is reports and len(reports) == 40  # made once per index


def test_librdkafka_fail_fast_produces_nothing_after_a_refused_record() -> None:
    from confluent_kafka import KafkaError, KafkaException

    s = sink(client="confluent", max_request_size=2048)
    s.fail_fast = True
    producer = _delivered({})
    rd = producer._p
    produce = rd.produce

    def refuse_large(topic: str, value: bytes, *args: Any) -> None:
        if len(value) > 2048:  # as librdkafka's produce() above message.max.bytes
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        produce(topic, value, *args)

    rd.produce = refuse_large
    s._producer = producer
    result = s.send_batch(make_batch(10, names={4: "x" * 5000}))
    assert [f.index for f in result.failed] == [4]
    assert len(rd.sent) == 4  # rows 0-3, nothing after the refused one
    # a record with neither key nor value is refused before librdkafka sees it
    nokey = pa.table({"value": pa.array([None, b"ok"], pa.binary())})
    s.fail_fast = False
    assert [f.index for f in s.send_batch(nokey).failed] == [0]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.one_of(st.none(), st.binary(max_size=300)),
            st.one_of(st.none(), st.binary(max_size=20_000)),
            st.lists(
                st.tuples(st.text(max_size=40), st.one_of(st.none(), st.binary(max_size=200))),
                max_size=4,
            ),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_the_largest_record_bounds_every_row_s_size_estimate(rows: list[Any]) -> None:
    """``Outgoing.largest_record`` is at least kafka-python's estimate of every row (what
    ``too_large`` compares with the topic's limit), so a batch under it needs no row sized."""
    from kafka.record.default_records import DefaultRecordBatchBuilder

    from conveyor.sinks.kafka import Outgoing

    n = len(rows)
    out = Outgoing(
        topics=["t"] * n,
        values=[v for _, v, _ in rows],
        keys=[k for k, _, _ in rows],
        headers=[list(h) or None for _, _, h in rows],
        stamps=[None] * n,
        partitions=[None] * n,
    )
    bound = out.largest_record()
    for k, v, h in rows:
        assert DefaultRecordBatchBuilder.estimate_size_in_bytes(k, v, h) <= bound


def test_rows_are_sized_one_by_one_only_when_the_largest_may_pass_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = sink(client="confluent")
    s.fail_fast = True
    s._producer = _delivered({})
    monkeypatch.setattr(s, "topic_limit", lambda topic: 5_000)
    sized: list[int] = []
    too_large = s.too_large
    monkeypatch.setattr(s, "too_large", lambda t, m: sized.append(1) or too_large(t, m))
    assert s.send_batch(make_batch(50)).failed == ()
    assert sized == []  # every row fits: none sized
    result = s.send_batch(make_batch(50, names={7: "x" * 6_000}))
    assert [f.index for f in result.failed] == [7]
    assert "max.message.bytes 5000" in result.failed[0].message
    assert len(sized) == 50  # one may not fit: each row sized, as before
    assert len(s._producer._p.sent) == 50 + 7  # nothing after the refused row


def test_source_partitions_are_checked_before_anything_is_produced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = sink(client="confluent", partitioning="source")
    s._producer = _delivered({})
    monkeypatch.setattr(s, "_topic_partitions", lambda topic: {0, 1})
    batch = make_batch(6)
    batch = batch.set_column(
        batch.schema.get_field_index("__partition"),
        "__partition",
        pa.array([0, 1, 0, 2, 1, 0], pa.int32()),
    )
    with pytest.raises(PermanentSinkError, match="has 2 partition.*needs partition 2"):
        s.send_batch(batch)
    assert s._producer._p.sent == []


def test_a_spec_with_kafka_python_options_and_no_client_keeps_kafka_python():
    import warnings

    from conveyor.sinks.kafka import KafkaSinkConfig

    base = {"type": "kafka", "bootstrap_servers": "127.0.0.1:9092", "topic": "t"}
    with pytest.warns(FutureWarning, match="linger_ms"):
        old = KafkaSinkConfig.model_validate({**base, "client_options": {"linger_ms": 5}})
    assert old.client == "kafka-python"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert KafkaSinkConfig.model_validate(base).client == "confluent"
        dotted = {**base, "client_options": {"socket.keepalive.enable": True}}
        assert KafkaSinkConfig.model_validate(dotted).client == "confluent"
        explicit = {**base, "client": "kafka-python", "client_options": {"linger_ms": 5}}
        assert KafkaSinkConfig.model_validate(explicit).client == "kafka-python"
