"""MQTT source (opaque): topic filters subscribed at QoS 1, acknowledged once stored.

paho-mqtt (``pip install 'conveyor[mqtt]'``), MQTT 5, with manual acknowledgements and a
persistent session (``clean_start`` false, a session that never expires, a fixed client
id): a message's PUBACK is sent in ``commit``, after its batch was produced and the state
stored, so the broker redelivers whatever a crash left unacknowledged. Each message
becomes ``{"topic": <MQTT topic>, "payload": <the JSON payload, or its text>}`` so that a
Route can route on the MQTT topic (``path: topic``); or ``destination_from_topic`` makes
the MQTT topic the destination (``/`` becomes ``.``, after ``topic_prefix``).

Bounded: at most ``max_pending`` messages wait in memory. The broker is told so (MQTT 5
Receive Maximum: it sends no more unacknowledged QoS 1 messages) and the largest packet
it may send (``max_message_bytes``). When the queue is full anyway (QoS 0 messages fill
it too), a QoS 0 message is dropped and counted; a QoS 1 message is neither queued nor
acknowledged, and once the queue has drained the source resumes its session (disconnect,
reconnect) so that the broker delivers it again.

A lost connection is an outage: paho reconnects with backoff, and while the connection
has been down longer than ``disconnect_grace_s`` ``poll`` raises TransientSourceError
(the runtime shows Degraded and retries). Messages held from a lost connection are
forgotten: their packet ids belonged to it, and the broker redelivers them when the
session resumes (at least once; a batch already produced then appears twice).

PUBACKs have no answer, so ``commit`` returns once paho has written them to the socket,
and ``close`` waits (bounded) for the broker's answer to a no-op UNSUBSCRIBE sent after
them: a run that takes the session over at once then finds nothing delivered twice.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from conveyor.core.engine.routing import SourceMode
from conveyor.core.errors import PermanentSourceError, TransientSourceError, rule
from conveyor.core.trust import paths
from conveyor.sources import strict_json
from conveyor.sources.base import Polled, Source, SourceConfig, SourceMessage, State

log = logging.getLogger(__name__)

# CONNACK reasons no retry fixes (MQTT 5: 0x84-0x87, 0x8C).
_REFUSED_FOR_GOOD = (
    "Unsupported protocol version",
    "Client identifier not valid",
    "Bad user name or password",
    "Not authorized",
    "Bad authentication method",
)
_NEVER_EXPIRES = 0xFFFFFFFF


MQTT_NOTES = """
Over TLS with a client certificate (mutual TLS) and a password:

```yaml
source:
  type: mqtt
  host: broker.example.com
  port: 8883
  topics: ["plant/+/temperature"]
  client_id: conveyor-plant
  tls: true
  tls_ca_file: tls/mqtt-ca.pem
  tls_cert_file: tls/mqtt-client.pem
  tls_key_file: tls/mqtt-client.key
  username: conveyor
  password: ${file:/run/secrets/mqtt}
```

Guarantees, as tested (tests/integration/test_mqtt_tls_and_outages.py, test_source_webhook_mqtt.py):
QoS 1 messages are acknowledged only after their batch is stored, so a crash or a closed session
gets them again (at least once); a broker certificate from another CA, or one that does not name
the host (unless `tls_insecure_skip_hostname_check`), and refused credentials stop the connector
(Error); a broker stopped mid-stream makes `poll` fail after `disconnect_grace_s` (the connector
shows Degraded and retries) and, once it is back, every QoS 1 message arrives, duplicated at most
for the batch that was in flight; at most `max_pending` messages wait in memory (the broker sends
no more unacknowledged QoS 1 messages), a QoS 0 message arriving at a full queue is dropped and
counted (logged once a minute), a QoS 1 one is delivered again after the queue drains. Two
connectors with one `client_id` on one broker are refused. A payload that is not strict JSON
(NaN included) is passed on as text.
"""


class MQTTConfig(SourceConfig):
    """Subscribes to MQTT topic filters (MQTT 5, QoS 1, a persistent session). At least once:
    a message is acknowledged (PUBACK) only after its batch is stored; QoS 2 publishes arrive
    at QoS 1; QoS 0 messages are at most once and, when `max_pending` messages wait, dropped
    and counted (QoS 1 ones are then left unacknowledged and delivered again once the queue
    drains). A connection down longer than `disconnect_grace_s` makes the connector Degraded
    until it is back (reconnected with backoff)."""

    doc_notes: ClassVar[str] = MQTT_NOTES

    type: Literal["mqtt"] = "mqtt"
    host: str = Field(default="127.0.0.1", description="MQTT broker host.")
    port: int = Field(default=1883, ge=1, le=65_535, description="MQTT broker port (TLS: 8883).")
    topics: list[str] = Field(
        min_length=1, description="Topic filters ('+' and '#' wildcards), subscribed at QoS 1."
    )
    client_id: str = Field(
        min_length=1,
        max_length=256,
        description="Client id of the persistent session (unacknowledged messages are redelivered to it).",
    )
    username: str | None = Field(default=None, description="User name.")
    password: SecretStr | None = Field(
        default=None,
        description="Password (with username): a reference, ${env:NAME} or ${file:/path}.",
    )
    tls: bool = Field(
        default=False, description="Connect over TLS (the broker's certificate verified)."
    )
    tls_ca_file: str | None = Field(
        default=None,
        description="CA bundle (PEM) the broker's certificate is verified against; default the system's CAs.",
    )
    tls_cert_file: str | None = Field(
        default=None, description="Client certificate (PEM) for mutual TLS (with tls_key_file)."
    )
    tls_key_file: str | None = Field(default=None, description="Client private key (PEM).")
    tls_key_password: SecretStr | None = Field(
        default=None, description="Password of an encrypted tls_key_file: a reference."
    )
    tls_insecure_skip_hostname_check: bool = Field(
        default=False,
        description="Accept a broker certificate that does not name the host (still signed by the CA). Insecure.",
    )
    destination_from_topic: bool = Field(
        default=False,
        description="The MQTT topic is the destination ('/' becomes '.', after topic_prefix).",
    )
    topic_prefix: str = Field(
        default="", description="Prefix of destinations taken from MQTT topics."
    )
    max_pending: int = Field(
        default=10_000,
        ge=1,
        le=65_535,
        description="Messages held in memory at most; the broker's Receive Maximum for QoS 1.",
    )
    max_message_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        le=256 << 20,
        description="Largest packet the broker may send (MQTT 5 Maximum Packet Size); the broker drops larger messages.",
    )
    keepalive_s: int = Field(default=30, ge=5, le=3_600, description="MQTT keep-alive interval.")
    disconnect_grace_s: float = Field(
        default=5.0,
        ge=0,
        le=3_600,
        description="A connection down longer than this is an outage: poll fails (Degraded) until it is back.",
    )

    @field_validator("topics")
    @classmethod
    def _filters_ok(cls, v: list[str]) -> list[str]:
        for f in v:
            parts = f.split("/")
            if (
                not f
                or any(("#" in p and p != "#") or ("+" in p and p != "+") for p in parts)
                or ("#" in parts[:-1])
            ):
                raise ValueError(f"{f!r} is not an MQTT topic filter")
        return v

    @model_validator(mode="after")
    def _rules(self) -> MQTTConfig:
        """Cross-field rules (no I/O): each error names its field."""
        rule(self.password is None or bool(self.username), "needs username", field="password")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_key_password"):
            rule(self.tls or getattr(self, name) is None, "only with tls: true", field=name)
        rule(
            self.tls or not self.tls_insecure_skip_hostname_check,
            "only with tls: true",
            field="tls_insecure_skip_hostname_check",
        )
        rule(
            (self.tls_cert_file is None) == (self.tls_key_file is None),
            "tls_cert_file and tls_key_file go together",
            field="tls_key_file" if self.tls_cert_file else "tls_cert_file",
        )
        rule(
            self.tls_key_password is None or self.tls_key_file is not None,
            "needs tls_key_file",
            field="tls_key_password",
        )
        return self

    def asset_key_path(self) -> list[str]:
        return ["mqtt", f"{self.host}_{self.port}"]

    def owned_resources(self, connector: str) -> tuple[str, ...]:
        # Two clients with one id take the session from each other (and its messages).
        return (f"MQTT session {self.client_id!r} on {self.host}:{self.port}",)


@dataclass(frozen=True)
class _Held:
    """A received message waiting for the commit that covers it."""

    seq: int
    message: SourceMessage
    mid: int
    qos: int


class MQTTSource(Source):
    """QoS 1 subscriber; PUBACKs in commit; a lost connection is a TransientSourceError."""

    config_class = MQTTConfig
    mode: ClassVar[SourceMode] = SourceMode.OPAQUE
    config: MQTTConfig

    def __init__(self, config: SourceConfig):
        super().__init__(config)
        self._client: Any = None
        self._cond = threading.Condition()
        self._held: deque[_Held] = deque()
        self._next_seq = 1
        self._answered = threading.Event()  # the first CONNACK (or refusal) arrived
        self._unsubacks: dict[int, threading.Event] = {}  # close's barrier, by packet id
        self._subscribed = threading.Event()  # the session's subscriptions are in place
        self._subscribe_mid: int | None = None
        self._subscribe_refused: str | None = None
        self._refused: str | None = None
        self._down_since: float | None = None
        self._down_reason = ""
        self._resume = False
        # Set from the moment a session resume is decided until its old connection is gone:
        # a QoS 1 message arriving meanwhile is not held (it comes again with the session).
        self._resuming = False
        self.dropped_qos0 = 0  # QoS 0 messages dropped because the queue was full
        self.withheld = 0  # QoS 1 messages left unacknowledged because the queue was full
        self.reconnects = 0
        self._warned_at = -60.0

    @property
    def column_routing(self) -> bool:
        return self.config.destination_from_topic

    def init(self, state: State | None) -> None:
        try:
            import paho.mqtt.client as mqtt
        except ImportError:
            raise PermanentSourceError(
                "the MQTT source needs paho-mqtt: pip install 'conveyor[mqtt]'"
            ) from None
        if state is not None:
            self._next_seq = int(state.get("seq", 0)) + 1
        c = self.config
        client = self._new_client(mqtt)
        try:
            client.connect(
                c.host, c.port, keepalive=c.keepalive_s, clean_start=False,
                properties=self._connect_properties(),
            )  # fmt: skip
        except OSError as e:
            raise _connect_error(c, e) from None
        client.loop_start()
        self._client = client
        if not self._answered.wait(15):
            raise TransientSourceError(f"MQTT {c.host}:{c.port}: no CONNACK within 15 s")
        refused = self._refused
        if refused is not None:
            error = PermanentSourceError if refused in _REFUSED_FOR_GOOD else TransientSourceError
            raise error(f"MQTT {c.host}:{c.port} refused the connection: {refused}")
        # Ready only once subscribed: a message published before the broker has the
        # subscription of a new session is delivered to nobody.
        if not self._subscribed.wait(15):
            raise TransientSourceError(f"MQTT {c.host}:{c.port}: no SUBACK within 15 s")
        if self._subscribe_refused is not None:
            raise PermanentSourceError(
                f"MQTT {c.host}:{c.port} refused the subscription: {self._subscribe_refused}"
            )

    def _new_client(self, mqtt: Any) -> Any:
        c = self.config
        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=c.client_id,
            protocol=mqtt.MQTTv5,
            manual_ack=True,
        )
        if c.username:
            client.username_pw_set(
                c.username, c.password.get_secret_value() if c.password else None
            )
        if c.tls:
            self._set_tls(client)
        client.reconnect_delay_set(1, 10)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_unsubscribe = self._on_unsubscribe
        client.on_subscribe = self._on_subscribe
        return client

    def _set_tls(self, client: Any) -> None:
        import ssl

        c = self.config
        files = {
            name: paths.resolve_file(getattr(c, name), field=f"source.{name}")
            for name in ("tls_ca_file", "tls_cert_file", "tls_key_file")
        }
        try:
            client.tls_set(
                ca_certs=files["tls_ca_file"],
                certfile=files["tls_cert_file"],
                keyfile=files["tls_key_file"],
                cert_reqs=ssl.CERT_REQUIRED,
                tls_version=ssl.PROTOCOL_TLS_CLIENT,
                keyfile_password=(
                    c.tls_key_password.get_secret_value() if c.tls_key_password else None
                ),
            )
        except (OSError, ssl.SSLError) as e:
            raise PermanentSourceError(f"MQTT TLS files cannot be used: {e}") from None
        client.tls_insecure_set(c.tls_insecure_skip_hostname_check)

    def _connect_properties(self) -> Any:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = _NEVER_EXPIRES
        props.ReceiveMaximum = self.config.max_pending
        props.MaximumPacketSize = self.config.max_message_bytes
        return props

    # -- paho's network thread -------------------------------------------------------

    def _on_connect(self, client: Any, _u: Any, flags: Any, reason: Any, _p: Any = None) -> None:
        if getattr(reason, "is_failure", False):
            with self._cond:
                self._refused = str(reason)
                self._down_reason = f"connection refused: {reason}"
                self._cond.notify_all()
            self._answered.set()
            return
        if getattr(flags, "session_present", False):
            self._subscribed.set()
        else:
            _rc, self._subscribe_mid = client.subscribe([(f, 1) for f in self.config.topics])
        with self._cond:
            if self._down_since is not None:
                self.reconnects += 1
                log.info("MQTT %s:%s connected again", self.config.host, self.config.port)
            self._refused = None
            self._down_since = None
            self._cond.notify_all()
        self._answered.set()

    def _on_disconnect(self, _c: Any, _u: Any, _flags: Any, reason: Any, _p: Any = None) -> None:
        with self._cond:
            if self._down_since is None:
                self._down_since = time.monotonic()
            self._down_reason = f"disconnected: {reason}"
            # Unacknowledged QoS 1 messages come again when the session resumes; the copies
            # held here carry packet ids of the lost connection and must never be acknowledged.
            self._held = deque(h for h in self._held if h.qos == 0)
            self._cond.notify_all()

    def _on_subscribe(self, _c: Any, _u: Any, mid: int, codes: Any, _p: Any = None) -> None:
        if mid != self._subscribe_mid:
            return
        refused = [
            f"{f}: {code}"
            for f, code in zip(self.config.topics, codes, strict=False)
            if getattr(code, "is_failure", False)
        ]
        if refused:
            self._subscribe_refused = "; ".join(refused)
        self._subscribed.set()

    def _on_unsubscribe(self, _c: Any, _u: Any, mid: int, _codes: Any, _p: Any = None) -> None:
        with self._cond:
            event = self._unsubacks.get(mid)
        if event is not None:
            event.set()

    def _on_message(self, _client: Any, _userdata: Any, msg: Any) -> None:
        with self._cond:
            if self._resuming and msg.qos > 0:
                # Not held: read after the reconnect, its packet id would be the closed
                # connection's; unacknowledged, it comes again with the resumed session.
                return
            if len(self._held) >= self.config.max_pending:
                if msg.qos == 0:
                    self.dropped_qos0 += 1
                else:
                    self.withheld += 1  # no PUBACK: delivered again when the session resumes
                    self._resume = True
                self._warn_full()
                return
            m = _message(msg, self.config)
            self._held.append(_Held(self._next_seq, m, msg.mid, msg.qos))
            self._next_seq += 1
            self._cond.notify_all()

    def _warn_full(self) -> None:
        now = time.monotonic()
        if now - self._warned_at >= 60:  # at most once a minute
            self._warned_at = now
            log.warning(
                "MQTT %s: queue full (max_pending %d): %d QoS 0 messages dropped, "
                "%d QoS 1 withheld so far",
                self.config.client_id,
                self.config.max_pending,
                self.dropped_qos0,
                self.withheld,
            )

    # -- the runtime's thread -----------------------------------------------------------

    def poll(self, state: State | None, max_records: int, max_wait_s: float) -> Polled | None:
        after = int((state or {}).get("seq", 0))
        deadline = time.monotonic() + max_wait_s
        with self._cond:
            while True:
                self._raise_if_down()
                batch = [h for h in self._held if h.seq > after][:max_records]
                if batch:
                    messages = [h.message for h in batch]
                    return Polled(messages, {"seq": batch[-1].seq}, origin="mqtt")
                if self._resume and not self._held:
                    self._resuming = True  # decided under the lock: no QoS 1 is held after it
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, self._grace_left()))
        self._resume_session()
        return None

    def _grace_left(self) -> float:
        if self._down_since is None:
            return 1.0
        return max(0.05, self.config.disconnect_grace_s - (time.monotonic() - self._down_since))

    def _raise_if_down(self) -> None:
        down = self._down_since
        if down is not None and time.monotonic() - down > self.config.disconnect_grace_s:
            c = self.config
            raise TransientSourceError(
                f"MQTT {c.host}:{c.port} down for {time.monotonic() - down:.0f}s "
                f"({self._down_reason}); reconnecting"
            )

    def _resume_session(self) -> None:
        """Reconnect so the broker delivers again the QoS 1 messages a full queue withheld."""
        c = self.config
        log.warning(
            "MQTT %s: %d messages withheld while the queue was full; resuming the session",
            c.client_id,
            self.withheld,
        )
        with self._cond:
            self._resume = False
        client = self._client
        try:
            # The PUBACKs of the last commit must be read by the broker before the socket
            # closes: closed with messages unread (the withheld ones keep coming), it is reset,
            # the broker drops what it had not read, and sends the acknowledged batch again
            # (seen in CI under load: four messages delivered twice). As ``close`` does.
            self._barrier(client)
            client.disconnect()
            client.loop_stop()  # its network thread is gone: no callback of the old connection
        finally:
            with self._cond:
                self._resuming = False
        client.connect_async(
            c.host, c.port, keepalive=c.keepalive_s, clean_start=False,
            properties=self._connect_properties(),
        )  # fmt: skip
        client.loop_start()

    def commit(self, state: State) -> None:
        upto = int(state["seq"])
        with self._cond:
            # Acknowledged under the lock: a disconnect cannot drop these copies in between,
            # so no packet id of a lost connection is ever acknowledged on a new one.
            acked = False
            while self._held and self._held[0].seq <= upto:
                h = self._held.popleft()
                if h.qos > 0 and self._client is not None:
                    self._client.ack(h.mid, h.qos)
                    acked = True
        if acked:
            self._flush_acks()

    def _flush_acks(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until paho's network thread has written the PUBACKs just queued.

        ``ack`` only queues them: a broker stopped right after a commit returned never saw
        them, and delivered the batch again (seen under load). Outside the lock: the network
        thread takes it in ``on_message`` before it writes. A lost connection empties the
        queue (those packet ids are void): the wait ends once the loss is seen."""
        client = self._client
        deadline = time.monotonic() + timeout_s
        while (
            client is not None
            and client.want_write()
            and self._down_since is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.002)

    def _barrier(self, client: Any, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until the broker has processed every PUBACK sent before closing.

        Written is not read: a run started at once with the same client id takes the session
        over, and Mosquitto then drops what the old connection had not read yet (seen under
        load: a whole batch delivered again). A broker handles one connection's packets in
        order, so its answer to an UNSUBSCRIBE of a filter never subscribed (no state
        changes) comes after it has applied every PUBACK before it."""
        if self._down_since is not None or not client.is_connected():
            return
        import uuid

        topic = f"conveyor-close-barrier/{uuid.uuid4().hex}"
        event = threading.Event()
        with self._cond:  # the answer waits for the lock: registered before it is looked up
            rc, mid = client.unsubscribe(topic)
            if rc != 0 or mid is None:
                return
            self._unsubacks[mid] = event
        if not event.wait(timeout_s):
            log.info(
                "MQTT %s: no UNSUBACK within %.0f s at close", self.config.client_id, timeout_s
            )
        self._unsubacks.pop(mid, None)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            self._barrier(client)
            client.disconnect()
            client.loop_stop()
        if self.dropped_qos0 or self.withheld:
            log.warning(
                "MQTT %s: %d QoS 0 messages dropped, %d QoS 1 withheld (queue full)",
                self.config.client_id,
                self.dropped_qos0,
                self.withheld,
            )


def _message(msg: Any, c: MQTTConfig) -> SourceMessage:
    try:
        payload: Any = strict_json.loads(msg.payload)
    except ValueError:  # not strict JSON (NaN included): passed on as text
        payload = msg.payload.decode("utf-8", "replace")
    dest = c.topic_prefix + msg.topic.replace("/", ".") if c.destination_from_topic else None
    body = json.dumps({"topic": msg.topic, "payload": payload}, separators=(",", ":")).encode()
    return SourceMessage(body, destination=dest, timestamp_ms=int(time.time() * 1000))


def _connect_error(c: MQTTConfig, e: OSError) -> Exception:
    import ssl

    if isinstance(e, ssl.SSLCertVerificationError):
        return PermanentSourceError(f"MQTT {c.host}:{c.port}: TLS certificate refused: {e}")
    return TransientSourceError(f"cannot connect to MQTT {c.host}:{c.port}: {e}")
