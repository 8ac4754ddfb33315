"""RabbitMQ sink without a server: config, connection parameters, properties, confirms, error mapping."""

from __future__ import annotations

from typing import Any

import pika
import pytest
from pika import exceptions as px
from pika.adapters.blocking_connection import ReturnedMessage

from conveyor.core.errors import ConfigError, PermanentSinkError, TransientSinkError
from conveyor.sinks import build_sink, parse_sink_config
from conveyor.sinks.base import Record, iter_records
from conveyor.sinks.kafka import timestamp_ms
from conveyor.sinks.rabbitmq import (
    ConfirmTracker,
    RabbitMQSink,
    RabbitMQSinkConfig,
    classify_amqp_error,
    connection_parameters,
    connection_settings,
    endpoint,
    header_value,
    sink_error,
)
from conveyor.sinks.templates import TemplateError
from tests.sinks.contract import BASE_TS, make_batch

BASE = {"type": "rabbitmq", "url": "amqp://guest:guest@127.0.0.1:5672/%2F", "exchange": "orders"}


def sink(**over: Any) -> RabbitMQSink:
    s = build_sink({**BASE, **over})
    assert isinstance(s, RabbitMQSink)
    return s


def record(**over: Any) -> Record:
    fields = {
        "index": 0,
        "topic": "orders",
        "partition": 1,
        "offset": 42,
        "timestamp": BASE_TS,
        "key": b"k1",
        "headers": [("h", b"1"), ("bin", b"\xff\x00")],
        "destination": None,
        "payload": {"id": 1, "region": "eu"},
    }
    fields.update(over)
    return Record(**fields)


# -- config --------------------------------------------------------------------------------------


def test_alias_and_defaults() -> None:
    cfg = parse_sink_config({**BASE, "type": "amqp"})
    assert isinstance(cfg, RabbitMQSinkConfig)
    assert (
        cfg.routing_key == "${topic}"
        and cfg.delivery_mode == "persistent"
        and cfg.confirm_mode == "pipelined"
    )
    assert (
        cfg.mandatory is False
        and cfg.declare_exchange is False
        and cfg.max_message_bytes == 16 << 20
    )
    assert cfg.asset_key_path() == ["rabbitmq", "orders"]
    assert parse_sink_config({**BASE, "exchange": ""}).asset_key_path() == ["rabbitmq", "default"]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"url": None}, "url"),
        ({"url": "http://h/"}, "url"),
        ({"url": "amqp:///"}, "url"),
        ({"host": "h"}, "url"),
        ({"url": None, "host": " "}, "host"),
        ({"url": None, "host": "h", "port": 0}, "port"),
        ({"exchange": "a b"}, "exchange"),
        ({"exchange": "e" * 256}, "exchange"),
        ({"exchange": "", "declare_exchange": True}, "declare_exchange"),
        ({"exchange": "amq.topic", "declare_exchange": True}, "declare_exchange"),
        ({"routing_key": "${partitions}"}, "routing_key"),
        ({"routing_key": "r" * 256}, "routing_key"),
        ({"exchange_type": "x-consistent-hash"}, "exchange_type"),
        ({"delivery_mode": "durable"}, "delivery_mode"),
        ({"header_values": "json"}, "header_values"),
        ({"confirm_mode": "off"}, "confirm_mode"),
        ({"confirm_timeout_s": -1}, "confirm_timeout_s"),
        ({"max_message_bytes": 0}, "max_message_bytes"),
        ({"connect_timeout_s": 0}, "connect_timeout_s"),
        ({"ssl_cafile": "tls/ca.pem"}, "ssl_cafile"),
        ({"tls": True}, "tls"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_config_names_the_field(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_sink({**BASE, **override})
    assert field in str(err.value)


def test_secrets_are_redacted_and_never_in_messages() -> None:
    s = sink(url="amqp://writer:hunter2@mq.example:5673/prod")
    assert "hunter2" not in repr(s.config) and "hunter2" not in s.describe()
    assert s.config.redacted()["url"] == "**********"
    assert s.describe() == "rabbitmq/orders@mq.example:5673/prod"
    p = sink(url=None, host="h", password="hunter2")
    assert p.config.redacted()["password"] == "**********" and "hunter2" not in p.describe()


def test_endpoint() -> None:
    assert endpoint(parse_sink_config(BASE)) == "127.0.0.1:5672//"
    assert endpoint(parse_sink_config({**BASE, "url": "amqps://u:p@h/v%2Fx"})) == "h:5671/v/x"
    assert (
        endpoint(parse_sink_config({**BASE, "url": None, "host": "h", "tls": True})) == "h:5671//"
    )


def test_connection_settings_and_parameters_from_parts() -> None:
    cfg = parse_sink_config(
        {
            **BASE,
            "url": None,
            "host": "mq",
            "vhost": "v",
            "username": "u",
            "password": "p",
            "heartbeat_s": 30,
        }
    )
    s = connection_settings(cfg)
    assert (
        s["host"] == "mq"
        and s["port"] == 5672
        and s["virtual_host"] == "v"
        and s["username"] == "u"
        and s["password"] == "p"
    )
    params = connection_parameters(cfg)
    assert isinstance(params, pika.ConnectionParameters)
    assert (params.host, params.port, params.virtual_host) == ("mq", 5672, "v")
    assert params.credentials.username == "u" and params.credentials.password == "p"
    assert (
        params.heartbeat == 30 and params.connection_attempts == 1 and params.socket_timeout == 10.0
    )
    assert params.blocked_connection_timeout == 60.0 and params.ssl_options is None
    assert params.client_properties == {"connection_name": "conveyor-sink/orders"}
    guest = connection_settings(parse_sink_config({**BASE, "url": None, "host": "mq"}))
    assert (guest["username"], guest["password"], guest["virtual_host"]) == ("guest", "guest", "/")


def test_connection_parameters_from_url_keep_the_configured_timeouts() -> None:
    cfg = parse_sink_config(
        {
            **BASE,
            "url": "amqp://u:p@mq:5673/%2Fv",
            "connect_timeout_s": 3,
            "blocked_connection_timeout_s": 9,
        }
    )
    params = connection_parameters(cfg)
    assert (params.host, params.port, params.virtual_host) == ("mq", 5673, "/v")
    assert (
        params.socket_timeout == 3
        and params.blocked_connection_timeout == 9
        and params.connection_attempts == 1
    )


def test_tls_parameters() -> None:
    params = connection_parameters(
        parse_sink_config({**BASE, "url": None, "host": "mq", "tls": True})
    )
    assert params.port == 5671 and params.ssl_options is not None
    with pytest.raises(FileNotFoundError):
        connection_parameters(
            parse_sink_config(
                {**BASE, "url": "amqps://u:p@mq/", "ssl_cafile": "nonexistent/ca.pem"}
            )
        )


def test_unreadable_ca_file_is_permanent_at_start() -> None:
    s = sink(url="amqps://u:p@127.0.0.1/", ssl_cafile="nonexistent/ca.pem")
    with pytest.raises(PermanentSinkError, match="connection settings"):
        s.init_sink()
    s.cleanup_sink()


# -- routing and properties ----------------------------------------------------------------------


def test_routing_key() -> None:
    s = sink(routing_key="${topic}.${payload.region}.${partition}")
    assert s.routing_key_for(record()) == "orders.eu.1"
    assert s.routing_key_for(record(destination="dest.key")) == "dest.key"
    assert (
        sink(routing_key="${topic}", use_destination=False).routing_key_for(record(destination="d"))
        == "orders"
    )
    with pytest.raises(TemplateError, match="255"):
        sink(routing_key="${payload.long}").routing_key_for(record(payload={"long": "x" * 256}))
    with pytest.raises(TemplateError, match="region"):
        s.routing_key_for(record(payload={"id": 1}))


def test_properties() -> None:
    p = sink().properties(record())
    ms = timestamp_ms(BASE_TS)
    assert p == {
        "content_type": "application/json",
        "delivery_mode": 2,
        "message_id": "orders-1-42",
        "timestamp": ms // 1000,
        "app_id": "conveyor",
        "headers": {
            "h": "1",
            "bin": b"\xff\x00",
            "x-conveyor-topic": "orders",
            "x-conveyor-partition": 1,
            "x-conveyor-offset": 42,
            "x-conveyor-timestamp": ms,
            "x-conveyor-key": "k1",
        },
    }
    bare = sink(
        keep_headers=False,
        coordinate_headers=False,
        delivery_mode="transient",
        content_type="application/x-ndjson",
    ).properties(record(timestamp=None))
    assert bare["headers"] is None and bare["delivery_mode"] == 1 and bare["timestamp"] is None
    assert bare["content_type"] == "application/x-ndjson"
    assert sink(header_values="bytes").properties(record())["headers"]["h"] == b"1"
    assert sink().properties(record(payload=b"raw"))["content_type"] == "application/octet-stream"
    assert sink().properties(record(payload="text"))["content_type"] == "text/plain"
    # pika can encode every property of a row
    pika.BasicProperties(**p).encode()


def test_header_value() -> None:
    assert header_value(b"abc", "text") == "abc"
    assert header_value(b"\xff", "text") == b"\xff"
    assert header_value(b"abc", "bytes") == b"abc"
    assert header_value(None, "text") is None


def test_prepare_limits_the_body() -> None:
    s = sink(max_message_bytes=10)
    with pytest.raises(TemplateError, match="max_message_bytes"):
        s._prepare(record())
    rk, body, _ = sink(routing_key="r")._prepare(record(payload=None))
    assert (rk, body) == ("r", b"")


def test_properties_of_a_contract_batch() -> None:
    r = list(iter_records(make_batch(3, topic="t", partition=4)))[2]
    p = sink().properties(r)
    assert (
        p["message_id"] == "t-4-2"
        and p["headers"]["x-conveyor-key"] == "k2"
        and p["headers"]["h"] == "2"
    )


# -- publisher confirms --------------------------------------------------------------------------


def test_confirm_tracker_single_and_multiple() -> None:
    t = ConfirmTracker(base=11)
    tags = [
        t.published(row, f"m{row}") for row in (0, 1, 3, 4, 5)
    ]  # row 2 was a data error, never published
    assert tags == [11, 12, 13, 14, 15]
    t.confirm(12, ack=True, multiple=False)
    assert t.settled == 1 and t.low == 0 and not t.done
    t.confirm(13, ack=True, multiple=True)  # settles 11 and 13
    assert t.settled == 3 and t.low == 3
    t.confirm(14, ack=False, multiple=False)
    t.confirm(14, ack=True, multiple=False)  # a second confirm of a settled tag changes nothing
    t.confirm(99, ack=True, multiple=False)  # not this batch's
    t.confirm(3, ack=True, multiple=True)
    assert not t.done
    t.confirm(15, ack=True, multiple=True)
    assert t.done and t.settled == 5 and t.nacked_rows() == [4]


def test_confirm_tracker_maps_returns_to_rows() -> None:
    t = ConfirmTracker(base=1)
    for row in range(4):
        t.published(row, "same" if row in (1, 2) else f"m{row}")
    t.returned_message("m3", "unroutable: (312) NO_ROUTE")
    t.returned_message("same", "unroutable: (312) NO_ROUTE")  # returns come in publish order
    t.returned_message("same", "unroutable: (312) NO_ROUTE")
    t.returned_message("unknown", "x")
    t.returned_message(None, "x")
    assert sorted(t.returned) == [1, 2, 3]
    t.confirm(4, ack=True, multiple=True)
    assert t.done and t.nacked_rows() == []


def test_confirm_tracker_large_batch_multiple_acks_are_linear() -> None:
    t = ConfirmTracker(base=1)
    for row in range(100_000):
        t.published(row, str(row))
    for tag in range(100, 100_001, 100):
        t.confirm(tag, ack=True, multiple=True)
    assert t.done


# -- error mapping -------------------------------------------------------------------------------


def _returned(code: int = 312, text: str = "NO_ROUTE") -> ReturnedMessage:
    method = pika.spec.Basic.Return(
        reply_code=code, reply_text=text, exchange="orders", routing_key="rk"
    )
    return ReturnedMessage(method, pika.BasicProperties(message_id="t-0-1"), b"{}")


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (px.UnroutableError([_returned()]), "data"),
        (px.ShortStringTooLong(b"x" * 256), "data"),
        (px.UnsupportedAMQPFieldException(b"", object()), "data"),
        (TypeError("unsupported header value"), "data"),
        (px.NackError([_returned()]), "transient"),
        (
            px.AMQPConnectionError("AMQPConnectorSocketConnectError: ConnectionRefusedError(111)"),
            "transient",
        ),
        (px.StreamLostError("Stream connection lost: ConnectionResetError(104)"), "transient"),
        (
            px.ConnectionClosedByBroker(
                320, "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'"
            ),
            "transient",
        ),
        (px.ConnectionClosedByBroker(541, "INTERNAL_ERROR"), "transient"),
        (
            px.AMQPHeartbeatTimeout(
                "No activity or too many missed heartbeats in the last 60 seconds"
            ),
            "transient",
        ),
        (px.ConnectionBlockedTimeout("Blocked connection timeout expired."), "transient"),
        (px.ConnectionWrongStateError("Connection is closed."), "transient"),
        (px.ChannelWrongStateError("Channel is closed."), "transient"),
        (px.IncompatibleProtocolError("StreamLostError: EOF"), "transient"),
        (
            px.ChannelClosedByBroker(405, "RESOURCE_LOCKED - cannot obtain exclusive access"),
            "transient",
        ),
        (px.ChannelClosedByBroker(506, "RESOURCE_ERROR"), "transient"),
        (OSError(104, "Connection reset by peer"), "transient"),
        (
            px.ProbableAuthenticationError(
                "ConnectionClosedByBroker: (403) 'ACCESS_REFUSED - Login was refused'"
            ),
            "permanent",
        ),
        (
            px.ProbableAccessDeniedError(
                "ConnectionClosedByBroker: (530) 'NOT_ALLOWED - vhost x not found'"
            ),
            "permanent",
        ),
        (px.AuthenticationError("PLAIN"), "permanent"),
        (px.ConnectionClosedByBroker(403, "ACCESS_REFUSED - Login was refused"), "permanent"),
        (
            px.ConnectionClosedByBroker(
                530, "NOT_ALLOWED - access to vhost 'v' refused for user 'u'"
            ),
            "permanent",
        ),
        (
            px.ChannelClosedByBroker(404, "NOT_FOUND - no exchange 'orders' in vhost '/'"),
            "permanent",
        ),
        (
            px.ChannelClosedByBroker(
                403, "ACCESS_REFUSED - write access to exchange 'orders' refused"
            ),
            "permanent",
        ),
        (
            px.ChannelClosedByBroker(
                406,
                "PRECONDITION_FAILED - message size 200000000 is larger than configured max size",
            ),
            "permanent",
        ),
    ],
)
def test_classify_amqp_error(exc: BaseException, kind: str) -> None:
    assert classify_amqp_error(exc) == kind


def test_sink_error_names_a_missing_exchange() -> None:
    e = sink_error(
        px.ChannelClosedByBroker(404, "NOT_FOUND - no exchange 'orders' in vhost '/'"),
        "publishing",
        exchange="orders",
    )
    assert isinstance(e, PermanentSinkError)
    assert "exchange 'orders' not found" in str(e) and "declare_exchange" in str(e)
    e2 = sink_error(
        px.ConnectionClosedByBroker(320, "CONNECTION_FORCED - shutdown"),
        "publishing",
        exchange="orders",
    )
    assert isinstance(e2, TransientSinkError) and "(320) CONNECTION_FORCED" in str(e2)
    e3 = sink_error(px.ProbableAuthenticationError("ACCESS_REFUSED"), "RabbitMQ at h:5672//")
    assert isinstance(e3, PermanentSinkError) and "ACCESS_REFUSED" in str(e3)
    assert isinstance(sink_error(px.StreamLostError("EOF"), "publishing"), TransientSinkError)


def test_send_batch_of_nothing_needs_no_connection() -> None:
    assert sink().send_batch(make_batch(0)).rows == 0
