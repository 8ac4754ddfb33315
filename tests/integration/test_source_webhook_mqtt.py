"""Opaque sources end to end into tansu: the HTTP webhook (Route to three topics and a
default, 2xx only after the batch is stored) and MQTT on the machine's Mosquitto (QoS 1,
acknowledged only after the batch is stored, the MQTT topic routable)."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from conveyor.core.host.ports import free_port
from conveyor.sources import build_source
from tests.integration.sources_harness import (
    build_loop,
    claimed_store,
    running,
    topic_values,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_webhook_routes_to_three_topics_and_a_default_answering_after_the_state_is_stored(
    tmp_path, tansu, spark_remote
):
    name = f"hook_{uuid.uuid4().hex[:6]}"
    port = free_port()
    topics = {r: f"{name}.{r}" for r in ("eu", "us", "apac")}
    spec = {
        "name": name,
        "source": {"type": "webhook", "port": port, "path": "/ingest", "token": "s3cret"},
        "routing": {
            "route": {"path": "order.region", "mapping": topics, "default": f"{name}.other"}
        },
        "batch": {"max_records": 10, "max_wait_ms": 100},
    }
    store, gen = claimed_store(tmp_path, name)
    loop = build_loop(spec, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    regions = ["eu", "us", "apac", "mars"]
    seen_after_ack: list[tuple[int, int]] = []
    with running(loop):
        url = f"http://127.0.0.1:{port}/ingest"
        auth = {"Authorization": "Bearer s3cret"}
        wait_for(lambda: _up(url), what="webhook listening")
        assert httpx.post(url, json={"order": {"region": "eu"}}).status_code == 401
        assert httpx.post(url, content=b"{nope", headers=auth).status_code == 400
        with httpx.Client(timeout=60) as client:
            for i in range(20):
                body = {"id": i, "order": {"region": regions[i % 4]}}
                r = client.post(url, json=body, headers=auth)
                assert r.status_code == 200, r.text
                stored = store.source_state(name)
                seen_after_ack.append((i, stored[1]["seq"] if stored else 0))
            # An array posts several messages in one request.
            r = client.post(
                url,
                json=[{"id": 100 + k, "order": {"region": "us"}} for k in range(5)],
                headers=auth,
            )
            assert r.status_code == 200 and r.json() == {"accepted": 5}
        # 2xx only after the batch holding the message was stored: the 401 and 400 posts
        # stored nothing, so post i (1-based i+1) is covered by a stored seq >= i+1.
        assert all(seq >= i + 1 for i, seq in seen_after_ack), seen_after_ack
    ids = {r: sorted(m["id"] for m in topic_values(tansu, t)) for r, t in topics.items()}
    assert ids["eu"] == list(range(0, 20, 4))
    assert ids["us"] == [*range(1, 20, 4), 100, 101, 102, 103, 104]
    assert ids["apac"] == list(range(2, 20, 4))
    assert sorted(m["id"] for m in topic_values(tansu, f"{name}.other")) == list(range(3, 20, 4))
    stats = loop.heartbeat_payload()["routing"]
    assert stats["destinations_active"] == 4 and stats["routed"] == 25


def _up(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
        return True
    except httpx.HTTPError:
        return False


def test_webhook_answers_503_when_the_batch_is_not_stored_in_time():
    port = free_port()
    source = build_source({"type": "webhook", "port": port, "auth": "none", "ack_timeout_s": 0.5})
    source.init(None)
    try:
        wait_for(lambda: _up(f"http://127.0.0.1:{port}/"), what="listening")
        r = httpx.post(f"http://127.0.0.1:{port}/", json={"a": 1}, timeout=10)
        assert r.status_code == 503  # polled by nobody: never stored, the sender must retry
        polled = source.poll(None, 10, 0.1)
        assert polled is not None and json.loads(polled.messages[0].payload) == {"a": 1}
    finally:
        source.close()


def _publish(topic_payloads: list[tuple[str, bytes]]) -> None:
    import paho.mqtt.client as mqtt

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{uuid.uuid4().hex[:6]}")
    c.connect("127.0.0.1", 1883)
    c.loop_start()
    try:
        infos = [c.publish(t, p, qos=1) for t, p in topic_payloads]
        for info in infos:
            info.wait_for_publish(10)
    finally:
        c.disconnect()
        c.loop_stop()


def test_mqtt_routes_by_topic_and_acknowledges_only_after_store(tmp_path, tansu, spark_remote):
    pytest.importorskip("paho.mqtt.client")
    tag = uuid.uuid4().hex[:6]
    base = f"conveyor_{tag}"
    name = f"mqtt_{tag}"
    cfg = {"type": "mqtt", "topics": [f"{base}/#"], "client_id": f"conveyor-{name}"}

    # A first session subscribes (the broker keeps it), receives, and closes without
    # acknowledging: the broker must deliver those messages again.
    first = build_source(cfg)
    first.init(None)
    _publish([(f"{base}/eu/temp", json.dumps({"id": i}).encode()) for i in range(3)])
    # poll(None) peeks at everything received so far: the three arrive one by one.
    deadline = time.monotonic() + 30
    polled = first.poll(None, 10, 5)
    while (polled is None or len(polled.messages) < 3) and time.monotonic() < deadline:
        polled = first.poll(None, 10, 1)
    assert polled is not None and len(polled.messages) == 3
    first.close()  # no commit: no PUBACK

    _publish(
        [
            (f"{base}/{r}/temp", json.dumps({"id": 10 + i}).encode())
            for i, r in enumerate(["eu", "us", "apac"] * 3)
        ]
    )
    spec = {
        "name": name,
        "source": {**cfg, "destination_from_topic": True, "topic_prefix": "m_"},
        "routing": {"admission": {"mode": "allowlist", "patterns": [f"m_{base}.*.temp"]}},
        "batch": {"max_records": 5, "max_wait_ms": 200},
    }
    store, gen = claimed_store(tmp_path, name)
    loop = build_loop(spec, store=store, generation=gen, bootstrap=tansu, spark_remote=spark_remote)
    with running(loop):
        wait_for(lambda: loop.counters.messages_out >= 12, what="12 MQTT messages")
    eu = topic_values(tansu, f"m_{base}.eu.temp")
    assert sorted(m["payload"]["id"] for m in eu) == [0, 1, 2, 10, 13, 16]  # redelivered + new
    assert all(m["topic"] == f"{base}/eu/temp" for m in eu)
    assert sorted(m["payload"]["id"] for m in topic_values(tansu, f"m_{base}.us.temp")) == [
        11,
        14,
        17,
    ]

    # Everything was acknowledged: a new session with the same id gets nothing again.
    again = build_source(cfg)
    again.init(None)
    try:
        assert again.poll(None, 10, 2) is None
    finally:
        again.close()
