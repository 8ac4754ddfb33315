"""RabbitMQ sink (pika): each row is published to an exchange with publisher confirms.

A batch is acknowledged when the broker confirmed (``basic.ack``) every message of
it. Confirms are pipelined by default: the whole batch is published, then the
confirms are collected, which is several times faster than waiting for each one.
With ``mandatory: true`` a message no queue takes comes back (``basic.return``) and
its row is reported as a data error; under ``fail_fast`` such a batch is published one
confirm at a time (a return arrives only after the message went out).

AMQP has no idempotent publish: a replayed batch is published again. Each message
carries ``message_id = "<topic>-<partition>-<offset>"`` so that consumers can drop
duplicates.
"""

from __future__ import annotations

import collections
import logging
import re
import time
import urllib.parse
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field, SecretStr, model_validator

from conveyor.core import sink as sink_contract
from conveyor.core.asset_keys import key_part
from conveyor.core.errors import (
    PermanentSinkError,
    SinkError,
    TransientSinkError,
    rule,
)
from conveyor.core.sink import ErrorKind
from conveyor.core.trust import paths
from conveyor.core.trust.references import known_now
from conveyor.sinks import templates
from conveyor.sinks.base import (
    Record,
    RowFailure,
    SendResult,
    Sink,
    SinkConfig,
    iter_records,
    secret,
)
from conveyor.sinks.kafka import template_problems, timestamp_ms

log = logging.getLogger("conveyor.sinks.rabbitmq")

_EXCHANGE_NAME = re.compile(r"^[A-Za-z0-9_.:-]{0,255}$")
MAX_SHORT_STRING = 255  # AMQP short string: routing keys, exchange names, message ids


class RabbitMQSinkConfig(SinkConfig):
    """Rows as messages published to a RabbitMQ exchange."""

    type: Literal["rabbitmq"] = "rabbitmq"
    url: SecretStr | None = Field(
        default=None,
        description="AMQP URL, e.g. amqp://user:${file:/run/secrets/amqp}@127.0.0.1:5672/%2F (secret; a password in it must be a reference). Instead of host/port/vhost/username/password.",
    )
    host: str | None = Field(default=None, description="Broker host (when no url is given).")
    port: int | None = Field(
        default=None, ge=1, le=65535, description="Broker port; default 5672, or 5671 with tls."
    )
    vhost: str | None = Field(default=None, description="Virtual host; default '/'.")
    username: str | None = Field(default=None, description="User name; default 'guest'.")
    password: SecretStr | None = Field(
        default=None, description="Password (secret); default 'guest'."
    )
    tls: bool = Field(
        default=False, description="Connect with TLS (host/port form; with url use amqps://)."
    )
    ssl_cafile: str | None = Field(
        default=None, description="CA bundle (PEM) to verify the broker, with tls or amqps://."
    )
    exchange: str = Field(
        default="",
        description="Exchange to publish to; '' is the default exchange (routing key = queue name).",
    )
    routing_key: str = Field(
        default="${topic}",
        description="Routing key template: ${topic}, ${key}, ${partition}, ${offset}, ${destination}, ${payload.<field>}.",
    )
    use_destination: bool = Field(
        default=True, description="A row with a __destination value uses it as its routing key."
    )
    declare_exchange: bool = Field(
        default=False,
        description="Declare the exchange at start (else it must exist: a passive declare checks it).",
    )
    exchange_type: Literal["direct", "topic", "fanout", "headers"] = Field(
        default="direct", description="Type of a declared exchange."
    )
    exchange_durable: bool = Field(
        default=True, description="A declared exchange survives a broker restart."
    )
    mandatory: bool = Field(
        default=False,
        description="Publish with the mandatory flag: a message no queue takes is returned and its row is a data error.",
    )
    delivery_mode: Literal["persistent", "transient"] = Field(
        default="persistent",
        description="persistent (delivery mode 2: written to disk in durable queues) or transient (1).",
    )
    content_type: str | None = Field(
        default=None,
        description="content_type property; default by payload: application/json (columns), text/plain (text), application/octet-stream (bytes).",
    )
    keep_headers: bool = Field(
        default=True, description="Copy the source message's headers into the AMQP headers."
    )
    coordinate_headers: bool = Field(
        default=True,
        description="Add headers x-conveyor-topic, x-conveyor-partition, x-conveyor-offset, x-conveyor-timestamp (epoch ms) "
        "and x-conveyor-key (the source key).",
    )
    header_values: Literal["text", "bytes"] = Field(
        default="text",
        description="text: header values that are UTF-8 become AMQP strings (others byte arrays); bytes: always byte arrays.",
    )
    confirm_mode: Literal["pipelined", "per_message"] = Field(
        default="pipelined",
        description="pipelined: publish the batch, then collect the confirms (fast); per_message: wait for each confirm (pika's public API).",
    )
    confirm_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="How long to wait for the batch's confirms; then it is an outage.",
    )
    max_message_bytes: int = Field(
        default=16 << 20,
        ge=1,
        description="Largest body published; a larger row is a data error (a body above the broker's max_message_size would close the channel).",
    )
    connect_timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="Socket connect / handshake timeout."
    )
    heartbeat_s: int = Field(default=60, ge=0, le=3600, description="AMQP heartbeat (0 = off).")
    blocked_connection_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long the broker may block publishing (memory / disk alarm) before the batch counts as an outage.",
    )
    app_id: str = Field(default="conveyor", description="app_id property of every message.")

    def asset_key_path(self) -> list[str]:
        return ["rabbitmq", key_part(self.exchange or "default")]

    def kind(self) -> str:
        return "rabbitmq"

    @model_validator(mode="after")
    def _rules(self) -> RabbitMQSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        by_parts = any(
            v is not None for v in (self.host, self.port, self.vhost, self.username, self.password)
        )
        rule(
            self.url is not None or by_parts,
            "give url, or host (with port, vhost, username, password)",
            field="url",
        )
        rule(
            not (self.url is not None and by_parts),
            "give either url or host/port/vhost/username/password, not both",
            field="url",
        )
        url_known = known_now(secret(self.url))
        if self.url is not None and url_known:
            raw = secret(self.url) or ""
            u = urllib.parse.urlsplit(raw)
            rule(
                u.scheme in ("amqp", "amqps") and bool(u.hostname),
                "must be amqp://[user:pw@]host[:port][/vhost]",
                field="url",
            )
        elif self.url is None:
            rule(bool(self.host and self.host.strip()), "must not be empty", field="host")
        rule(
            not known_now(self.exchange) or bool(_EXCHANGE_NAME.match(self.exchange)),
            "exchange names are up to 255 characters of letters, digits, - _ . :",
            field="exchange",
        )
        rule(
            not (self.declare_exchange and not self.exchange),
            "the default exchange ('') cannot be declared",
            field="declare_exchange",
        )
        rule(
            not self.exchange.startswith("amq.") or not self.declare_exchange,
            "amq.* exchanges cannot be declared",
            field="declare_exchange",
        )
        problems = template_problems(self.routing_key) if known_now(self.routing_key) else []
        if (
            not problems
            and templates.is_static(self.routing_key)
            and len(self.routing_key.encode()) > MAX_SHORT_STRING
        ):
            problems = [f"longer than {MAX_SHORT_STRING} bytes"]
        rule(not problems, "; ".join(problems), field="routing_key")
        rule(
            not (
                self.ssl_cafile
                and not (
                    self.tls or not url_known or (secret(self.url) or "").startswith("amqps://")
                )
            ),
            "only with tls or an amqps:// url",
            field="ssl_cafile",
        )
        rule(
            not (self.tls and self.url is not None),
            "with url, use the amqps:// scheme instead",
            field="tls",
        )
        return self


# -- pure helpers -------------------------------------------------------------------------------


def endpoint(c: RabbitMQSinkConfig) -> str:
    """host:port/vhost of the broker, for messages (never the password)."""
    if c.url is not None:
        u = urllib.parse.urlsplit(secret(c.url) or "")
        port = u.port or (5671 if u.scheme == "amqps" else 5672)
        vhost = urllib.parse.unquote(u.path[1:]) if len(u.path) > 1 else "/"
        return f"{u.hostname}:{port}/{vhost}"
    port = c.port or (5671 if c.tls else 5672)
    return f"{c.host}:{port}/{c.vhost or '/'}"


def connection_settings(c: RabbitMQSinkConfig) -> dict[str, Any]:
    """What the connection is made of (secrets included: never log it)."""
    out: dict[str, Any] = {
        "socket_timeout": c.connect_timeout_s,
        "stack_timeout": c.connect_timeout_s + 5,
        "heartbeat": c.heartbeat_s,
        "blocked_connection_timeout": c.blocked_connection_timeout_s,
        "connection_attempts": 1,
        "client_properties": {"connection_name": f"conveyor-sink/{c.exchange or 'default'}"},
    }
    if c.url is not None:
        out["url"] = secret(c.url)
    else:
        out.update(
            host=c.host,
            port=c.port or (5671 if c.tls else 5672),
            virtual_host=c.vhost or "/",
            username=c.username or "guest",
            password=secret(c.password) or "guest",
        )
    out["tls"] = c.tls or (c.url is not None and (secret(c.url) or "").startswith("amqps://"))
    out["ssl_cafile"] = paths.resolve_file(c.ssl_cafile, field="sink.ssl_cafile")
    return out


def connection_parameters(c: RabbitMQSinkConfig) -> Any:
    """pika connection parameters for a config."""
    import pika

    s = connection_settings(c)
    if "url" in s:
        params = pika.URLParameters(s["url"])
    else:
        params = pika.ConnectionParameters(
            host=s["host"],
            port=s["port"],
            virtual_host=s["virtual_host"],
            credentials=pika.PlainCredentials(s["username"], s["password"]),
        )
    params.socket_timeout = s["socket_timeout"]
    params.stack_timeout = s["stack_timeout"]
    params.heartbeat = s["heartbeat"]
    params.blocked_connection_timeout = s["blocked_connection_timeout"]
    params.connection_attempts = s["connection_attempts"]
    params.client_properties = s["client_properties"]
    if s["tls"]:
        import ssl

        ctx = ssl.create_default_context(cafile=s["ssl_cafile"])
        params.ssl_options = pika.SSLOptions(ctx, server_hostname=params.host)
    return params


def header_value(v: bytes | None, mode: str) -> str | bytes | None:
    """A Kafka header value as an AMQP field value."""
    if v is None or mode == "bytes":
        return v
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return v


def message_id(r: Record) -> str:
    return f"{r.topic}-{r.partition}-{r.offset}"[:MAX_SHORT_STRING]


def content_type_for(payload: Any) -> str:
    if isinstance(payload, bytes):
        return "application/octet-stream"
    if isinstance(payload, str):
        return "text/plain"
    return "application/json"


# -- error mapping ------------------------------------------------------------------------------

# AMQP reply codes: refusals no retry can fix.
_PERMANENT_CODES = {
    402,  # INVALID_PATH (vhost)
    403,  # ACCESS_REFUSED
    404,  # NOT_FOUND (exchange)
    406,  # PRECONDITION_FAILED (exchange type mismatch, message above max_message_size)
    530,  # NOT_ALLOWED (vhost)
    540,  # NOT_IMPLEMENTED
}


def reply_code(exc: BaseException) -> int | None:
    code = getattr(exc, "reply_code", None)
    return code if isinstance(code, int) else None


def classify_amqp_error(exc: BaseException) -> ErrorKind:
    """What an exception from pika means.

    Data: the message cannot be encoded (routing key too long, bad header type) or came
    back unroutable. Permanent: authentication, vhost access, a missing exchange, a
    precondition (406). Transient: connection refused / lost / closed by a shutting-down
    broker (320), heartbeat or blocked-connection timeouts, a nack, anything else.
    """
    from pika import exceptions as px

    if isinstance(exc, px.UnroutableError):
        return ErrorKind.DATA
    if isinstance(
        exc,
        (
            px.ShortStringTooLong,
            px.UnsupportedAMQPFieldException,
            TypeError,
            ValueError,
            UnicodeEncodeError,
        ),
    ):
        return ErrorKind.DATA
    if isinstance(
        exc, (px.ProbableAuthenticationError, px.ProbableAccessDeniedError, px.AuthenticationError)
    ):
        return ErrorKind.PERMANENT
    if isinstance(exc, (px.ConnectionClosedByBroker, px.ChannelClosedByBroker)):
        return ErrorKind.PERMANENT if reply_code(exc) in _PERMANENT_CODES else ErrorKind.TRANSIENT
    return ErrorKind.TRANSIENT


def _describe(exc: BaseException) -> str:
    code = reply_code(exc)
    text = getattr(exc, "reply_text", None)
    if code is not None:
        return f"{type(exc).__name__} ({code}) {text}"
    s = str(exc).strip()
    return (
        f"{type(exc).__name__}: {s}"
        if s and type(exc).__name__ not in s
        else (s or type(exc).__name__)
    )


def sink_error(exc: BaseException, context: str, *, exchange: str = "") -> SinkError:
    """The SinkError a connection / channel failure becomes."""
    detail = _describe(exc)
    if reply_code(exc) == 404 and exchange:
        return PermanentSinkError(
            f"{context}: exchange {exchange!r} not found ({detail}); create it or set declare_exchange: true"
        )
    return sink_contract.sink_error(classify_amqp_error(exc), f"{context}: {detail}")


# -- confirm tracking (pure) --------------------------------------------------------------------


class ConfirmTracker:
    """Publisher confirms of one batch: delivery tags -> rows, acks, nacks and returns.

    Delivery tags count the channel's publishes from 1; the batch's messages have the
    consecutive tags ``base .. base + n - 1``. A multiple ack/nack settles every
    unsettled tag up to its tag.
    """

    ACK, NACK = 1, 2

    def __init__(self, base: int):
        self.base = base
        self.rows: list[int] = []  # row index by (tag - base)
        self.state = bytearray()
        self.low = 0  # every position below is settled
        self.settled = 0
        self._by_id: dict[str, collections.deque[int]] = {}
        self.returned: dict[int, str] = {}

    def published(self, row: int, msg_id: str) -> int:
        """Record a publish; returns its delivery tag."""
        self.rows.append(row)
        self.state.append(0)
        self._by_id.setdefault(msg_id, collections.deque()).append(row)
        return self.base + len(self.rows) - 1

    def confirm(self, tag: int, *, ack: bool, multiple: bool) -> None:
        pos = tag - self.base
        if pos < 0 or pos >= len(self.rows):
            return  # a tag of another batch (cannot happen while batches wait for their confirms)
        value = self.ACK if ack else self.NACK
        if multiple:
            for p in range(self.low, pos + 1):
                if not self.state[p]:
                    self.state[p] = value
                    self.settled += 1
            self.low = max(self.low, pos + 1)
        elif not self.state[pos]:
            self.state[pos] = value
            self.settled += 1
        while self.low < len(self.rows) and self.state[self.low]:
            self.low += 1

    def returned_message(self, msg_id: str | None, reason: str) -> None:
        """A basic.return (it precedes the message's ack): map it to its row by message_id."""
        rows = self._by_id.get(msg_id or "")
        if rows:
            self.returned[rows.popleft()] = reason

    @property
    def done(self) -> bool:
        return self.settled == len(self.rows)

    def nacked_rows(self) -> list[int]:
        return [self.rows[p] for p, s in enumerate(self.state) if s == self.NACK]


# -- the sink -----------------------------------------------------------------------------------


class RabbitMQSink(Sink):
    """Publishes each row and waits for the broker's confirms before acknowledging the batch."""

    config_class = RabbitMQSinkConfig
    config: RabbitMQSinkConfig

    def __init__(self, config: RabbitMQSinkConfig):
        super().__init__(config)
        self._conn: Any = None
        self._channel: Any = None
        self._exact_channel: Any = None  # fail_fast with mandatory: per-message confirms
        self._next_tag = 1
        self._tracker: ConfirmTracker | None = None
        self._channel_closed: BaseException | None = None

    def describe(self) -> str:
        return f"rabbitmq/{self.config.exchange or '(default)'}@{endpoint(self.config)}"

    # -- lifecycle ----------------------------------------------------------------------

    def init_sink(self) -> None:
        self._open()

    def _open(self) -> None:
        import pika

        c = self.config
        try:
            params = connection_parameters(c)
        except (OSError, ValueError) as e:  # unreadable CA file, malformed URL
            raise PermanentSinkError(f"RabbitMQ connection settings: {e}") from None
        try:
            self._conn = pika.BlockingConnection(params)
            ch = self._conn.channel()
            if c.exchange:
                ch.exchange_declare(
                    c.exchange,
                    exchange_type=c.exchange_type,
                    durable=c.exchange_durable,
                    passive=not c.declare_exchange,
                )
            self._channel_closed = None
            if c.confirm_mode == "pipelined":
                # pika's BlockingChannel waits for each confirm; the underlying channel lets the
                # batch's confirms be collected after publishing it (same connection, same thread).
                impl = ch._impl
                ready: list[bool] = []
                impl.confirm_delivery(
                    ack_nack_callback=self._on_confirm, callback=lambda _frame: ready.append(True)
                )
                deadline = time.monotonic() + c.connect_timeout_s
                while not ready:
                    if ch.is_closed or time.monotonic() > deadline:
                        raise TransientSinkError(
                            f"RabbitMQ at {endpoint(c)} did not enable publisher confirms"
                        )
                    self._conn.process_data_events(time_limit=0.002)
                impl.add_on_return_callback(self._on_return)
                impl.add_on_close_callback(self._on_channel_close)
            else:
                ch.confirm_delivery()
            self._channel = ch
            self._next_tag = 1
        except SinkError:
            self._close()
            raise
        except Exception as e:  # noqa: BLE001 - classified
            self._close()
            raise sink_error(e, f"RabbitMQ at {endpoint(c)}", exchange=c.exchange) from None

    def _close(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        self._exact_channel = None
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("error closing RabbitMQ connection", exc_info=True)

    def cleanup_sink(self) -> None:
        self._close()

    def _ensure_open(self) -> None:
        """Reconnect if the connection died between batches (idle past the heartbeat, broker restart)."""
        if (
            self._conn is not None
            and self._conn.is_open
            and self._channel is not None
            and self._channel.is_open
        ):
            try:
                self._conn.process_data_events(
                    time_limit=0
                )  # services heartbeats, notices a dead socket
                if self._conn.is_open and self._channel.is_open:
                    return
            except Exception:  # noqa: BLE001 - reconnect below
                log.info(
                    "RabbitMQ connection to %s lost between batches; reconnecting",
                    endpoint(self.config),
                )
        self._close()
        self._open()

    # -- callbacks of the pipelined mode --------------------------------------------------

    def _on_confirm(self, frame: Any) -> None:
        import pika

        m = frame.method
        if self._tracker is not None:
            self._tracker.confirm(
                m.delivery_tag, ack=isinstance(m, pika.spec.Basic.Ack), multiple=bool(m.multiple)
            )

    def _on_return(self, _channel: Any, method: Any, properties: Any, _body: bytes) -> None:
        if self._tracker is not None:
            reason = f"unroutable: ({method.reply_code}) {method.reply_text}, exchange {method.exchange!r}, routing key {method.routing_key!r}"
            self._tracker.returned_message(properties.message_id, reason)

    def _on_channel_close(self, _channel: Any, reason: BaseException) -> None:
        self._channel_closed = reason

    # -- writing --------------------------------------------------------------------------

    def routing_key_for(self, r: Record) -> str:
        """The routing key of a row; templates.TemplateError when the row cannot give one."""
        if self.config.use_destination and r.destination:
            rk = r.destination
        else:
            rk = templates.render(self.config.routing_key, r)
        if len(rk.encode()) > MAX_SHORT_STRING:
            raise templates.TemplateError(f"routing key is longer than {MAX_SHORT_STRING} bytes")
        return rk

    def properties(self, r: Record) -> dict[str, Any]:
        """The AMQP message properties of a row (as pika.BasicProperties keyword arguments)."""
        c = self.config
        headers: dict[str, Any] = {}
        if c.keep_headers:
            for k, v in r.headers:
                headers[str(k)] = header_value(v, c.header_values)
        ts = timestamp_ms(r.timestamp)
        if c.coordinate_headers:
            headers["x-conveyor-topic"] = r.topic
            headers["x-conveyor-partition"] = int(r.partition)
            headers["x-conveyor-offset"] = int(r.offset)
            if ts is not None:
                headers["x-conveyor-timestamp"] = ts
            if r.key is not None:
                headers["x-conveyor-key"] = header_value(r.key, c.header_values)
        return {
            "content_type": c.content_type or content_type_for(r.payload),
            "delivery_mode": 2 if c.delivery_mode == "persistent" else 1,
            "message_id": message_id(r),
            "timestamp": ts // 1000 if ts is not None else None,
            "app_id": c.app_id,
            "headers": headers or None,
        }

    def _prepare(self, r: Record) -> tuple[str, bytes, dict[str, Any]]:
        rk = self.routing_key_for(r)
        body = b"" if r.payload is None else r.payload_bytes()
        if len(body) > self.config.max_message_bytes:
            raise templates.TemplateError(
                f"message body is {len(body)} bytes, above max_message_bytes {self.config.max_message_bytes}"
            )
        return rk, body, self.properties(r)

    def send_batch(self, batch: pa.Table) -> SendResult:
        if batch.num_rows == 0:
            return SendResult(rows=0)
        self._ensure_open()
        try:
            if self.config.confirm_mode == "per_message":
                failures = self._send_per_message(batch, self._channel)
            elif self.fail_fast and self.config.mandatory:
                # A basic.return arrives only after the message went out (in a transaction,
                # only at tx.commit, for all of them): waiting for each confirm is the one
                # way to publish nothing after an unroutable message.
                failures = self._send_per_message(batch, self._confirming_channel())
            else:
                failures = self._send_pipelined(batch)
        except SinkError:
            self._close()
            raise
        except UnicodeDecodeError:
            raise  # a text column with invalid UTF-8, met before publishing: the runtime bisects it
        except Exception as e:  # noqa: BLE001 - classified
            self._close()
            raise sink_error(
                e,
                f"publishing to RabbitMQ at {endpoint(self.config)}",
                exchange=self.config.exchange,
            ) from None
        failures.sort(key=lambda f: f.index)
        return SendResult(rows=batch.num_rows, failed=tuple(failures))

    def _send_pipelined(self, batch: pa.Table) -> list[RowFailure]:
        import pika

        c = self.config
        impl = self._channel._impl
        tracker = self._tracker = ConfirmTracker(self._next_tag)
        failures: list[RowFailure] = []
        try:
            for n, r in enumerate(iter_records(batch), 1):
                try:
                    rk, body, props = self._prepare(r)
                    mid = props["message_id"]
                    impl.basic_publish(
                        c.exchange, rk, body, pika.BasicProperties(**props), mandatory=c.mandatory
                    )
                except templates.TemplateError as e:
                    failures.append(RowFailure(r.index, str(e)))
                    if self.fail_fast:
                        break  # without mandatory nothing comes back: this is the first failure
                    continue
                except Exception as e:  # noqa: BLE001 - an encoding error sends nothing (pika marshals every frame first)
                    if (
                        classify_amqp_error(e) is not ErrorKind.DATA
                        or self._channel_closed is not None
                    ):
                        raise
                    failures.append(RowFailure(r.index, _describe(e)))
                    if self.fail_fast:
                        break
                    continue
                self._next_tag = tracker.published(r.index, mid) + 1
                if n % 1000 == 0:
                    # Write what is buffered and take confirms in, so memory stays bounded.
                    self._conn.process_data_events(time_limit=0)
                    self._raise_if_closed()
            deadline = time.monotonic() + c.confirm_timeout_s
            while not tracker.done:
                self._raise_if_closed()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransientSinkError(
                        f"RabbitMQ at {endpoint(c)} confirmed {tracker.settled} of {len(tracker.rows)} messages within {c.confirm_timeout_s}s"
                    )
                # process_data_events runs for its whole time limit (confirms reach the
                # underlying channel's callback, which does not end it early): short slices.
                self._conn.process_data_events(time_limit=min(remaining, 0.002))
            self._raise_if_closed()
        finally:
            self._tracker = None
        nacked = tracker.nacked_rows()
        if nacked:
            raise TransientSinkError(
                f"RabbitMQ nacked {len(nacked)} of {len(tracker.rows)} messages (a queue is full with overflow reject-publish, "
                "or the broker had an internal error); the batch is retried"
            )
        failures.extend(RowFailure(i, reason) for i, reason in tracker.returned.items())
        return failures

    def _raise_if_closed(self) -> None:
        if self._channel_closed is not None:
            reason, self._channel_closed = self._channel_closed, None
            raise sink_error(
                reason,
                f"RabbitMQ closed the channel at {endpoint(self.config)}",
                exchange=self.config.exchange,
            )

    def _confirming_channel(self) -> Any:
        """A second channel in pika's blocking confirm mode (the first one's confirms are
        collected by the pipelined callbacks), opened on first use."""
        if self._exact_channel is None or not self._exact_channel.is_open:
            ch = self._conn.channel()
            ch.confirm_delivery()
            self._exact_channel = ch
        return self._exact_channel

    def _send_per_message(self, batch: pa.Table, channel: Any) -> list[RowFailure]:
        import pika
        from pika import exceptions as px

        c = self.config
        failures: list[RowFailure] = []
        for r in iter_records(batch):
            if failures and self.fail_fast:
                break  # each message is confirmed before the next: nothing after a refused one
            try:
                rk, body, props = self._prepare(r)
                channel.basic_publish(
                    c.exchange, rk, body, pika.BasicProperties(**props), mandatory=c.mandatory
                )
            except templates.TemplateError as e:
                failures.append(RowFailure(r.index, str(e)))
            except px.UnroutableError as e:
                m = e.messages[0].method if e.messages else None
                reason = (
                    f"unroutable: ({m.reply_code}) {m.reply_text}, exchange {m.exchange!r}, routing key {m.routing_key!r}"
                    if m
                    else "unroutable"
                )
                failures.append(RowFailure(r.index, reason))
            except px.NackError:
                raise TransientSinkError(
                    f"RabbitMQ nacked the message of row {r.index}; the batch is retried"
                ) from None
            except Exception as e:  # noqa: BLE001 - classified
                if classify_amqp_error(e) is not ErrorKind.DATA or channel.is_closed:
                    raise
                failures.append(RowFailure(r.index, _describe(e)))
        return failures
