"""MQTT source (opaque): topic filters subscribed at QoS 1, acknowledged once stored.

paho-mqtt (``pip install 'conveyor[mqtt]'``) with manual acknowledgements and a
persistent session (``clean_session`` false, a fixed client id): a message's PUBACK
is sent in ``commit``, after its batch was produced and the state stored, so the
broker redelivers whatever a crash left unacknowledged. Each message becomes
``{"topic": <MQTT topic>, "payload": <the JSON payload, or its text>}`` so that a Route
can route on the MQTT topic (``path: topic``); or ``destination_from_topic`` makes
the MQTT topic the destination (``/`` becomes ``.``, after ``topic_prefix``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, field_validator

from conveyor.core.errors import PermanentSourceError, TransientSourceError
from conveyor.core.routing import SourceMode
from conveyor.sources.base import Polled, Source, SourceConfig, SourceMessage, State


class MQTTConfig(SourceConfig):
    """Subscribes to MQTT topic filters."""

    type: Literal["mqtt"] = "mqtt"
    host: str = Field(default="127.0.0.1", description="MQTT broker host.")
    port: int = Field(default=1883, ge=1, le=65_535, description="MQTT broker port.")
    topics: list[str] = Field(
        min_length=1, description="Topic filters ('+' and '#' wildcards), subscribed at QoS 1."
    )
    client_id: str = Field(
        description="Client id of the persistent session (unacknowledged messages are redelivered to it)."
    )
    username: str | None = Field(default=None, description="User name.")
    password: SecretStr | None = Field(
        default=None, description="Password: a reference, ${env:NAME} or ${file:/path}."
    )
    destination_from_topic: bool = Field(
        default=False,
        description="The MQTT topic is the destination ('/' becomes '.', after topic_prefix).",
    )
    topic_prefix: str = Field(
        default="", description="Prefix of destinations taken from MQTT topics."
    )
    max_pending: int = Field(
        default=10_000, ge=1, description="Messages held in memory at most (receive maximum)."
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

    def asset_key_path(self) -> list[str]:
        return ["mqtt", f"{self.host}_{self.port}"]


class MQTTSource(Source):
    """QoS 1 subscriber; PUBACKs in commit."""

    config_class = MQTTConfig
    mode: ClassVar[SourceMode] = SourceMode.OPAQUE
    config: MQTTConfig

    def __init__(self, config: SourceConfig):
        super().__init__(config)
        self._client: Any = None
        self._cond = threading.Condition()
        self._messages: deque[tuple[int, SourceMessage, int]] = deque()  # (seq, message, mid)
        self._next_seq = 1
        self._connected = threading.Event()
        self._error: str | None = None

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
        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=c.client_id,
            clean_session=False,
            manual_ack=True,
        )
        client.max_inflight_messages_set(min(c.max_pending, 65_535))
        if c.username:
            client.username_pw_set(
                c.username, c.password.get_secret_value() if c.password else None
            )
        client.on_connect = self._on_connect
        client.on_message = self._on_message
        client.on_disconnect = lambda *_a, **_k: self._connected.clear()
        try:
            client.connect(c.host, c.port, keepalive=30)
        except OSError as e:
            raise TransientSourceError(f"cannot connect to MQTT {c.host}:{c.port}: {e}") from None
        client.loop_start()
        self._client = client
        if not self._connected.wait(15):
            raise TransientSourceError(f"MQTT {c.host}:{c.port}: no CONNACK within 15 s")
        if self._error:
            raise PermanentSourceError(self._error)

    def _on_connect(
        self, client: Any, _userdata: Any, _flags: Any, reason: Any, _props: Any = None
    ) -> None:
        if getattr(reason, "is_failure", False):
            self._error = f"MQTT refused the connection: {reason}"
            self._connected.set()
            return
        client.subscribe([(f, 1) for f in self.config.topics])
        self._connected.set()

    def _on_message(self, _client: Any, _userdata: Any, msg: Any) -> None:
        try:
            payload: Any = json.loads(msg.payload)
        except ValueError:
            payload = msg.payload.decode("utf-8", "replace")
        dest = None
        if self.config.destination_from_topic:
            dest = self.config.topic_prefix + msg.topic.replace("/", ".")
        body = json.dumps({"topic": msg.topic, "payload": payload}, separators=(",", ":")).encode()
        m = SourceMessage(body, destination=dest, timestamp_ms=int(time.time() * 1000))
        with self._cond:
            self._messages.append((self._next_seq, m, msg.mid))
            self._next_seq += 1
            self._cond.notify_all()

    def poll(self, state: State | None, max_records: int, max_wait_s: float) -> Polled | None:
        after = int((state or {}).get("seq", 0))
        deadline = time.monotonic() + max_wait_s
        with self._cond:
            while True:
                batch = [(s, m) for s, m, _ in self._messages if s > after][:max_records]
                if batch:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
        return Polled([m for _, m in batch], {"seq": batch[-1][0]}, origin="mqtt")

    def commit(self, state: State) -> None:
        upto = int(state["seq"])
        with self._cond:
            done = []
            while self._messages and self._messages[0][0] <= upto:
                done.append(self._messages.popleft()[2])
        for mid in done:
            self._client.ack(mid, 1)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            client.loop_stop()
