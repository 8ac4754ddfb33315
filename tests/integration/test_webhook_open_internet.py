"""The webhook source facing hostile senders: real HTTP over loopback (httpx and raw sockets).

Each test runs the source as the runtime does (init, then poll and commit from one thread)
and talks to it as a client on the internet would: oversize bodies (declared and streamed
chunked), slow heads and bodies, too many requests at once, tokens and signatures (GitHub,
Stripe) right, wrong and expired, and bodies that are not strict JSON.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from conveyor.core.errors import ConfigError
from conveyor.core.host.ports import free_port
from conveyor.sources import build_source
from conveyor.sources.webhook import WebhookSource
from tests.integration.sources_harness import wait_for

pytestmark = pytest.mark.integration


class _Stored(list):  # type: ignore[type-arg]
    """The messages produced, parsed; ``raw``: their payloads as produced."""

    def __init__(self) -> None:
        super().__init__()
        self.raw: list[bytes] = []


@contextmanager
def serving(**fields: Any) -> Iterator[tuple[WebhookSource, str, _Stored]]:
    """The source listening, with a thread that polls and commits as the runtime does
    (``store: False`` leaves it unpolled, so posts wait for their acknowledgement)."""
    store = fields.pop("store", True)
    port = free_port()
    source = build_source({"type": "webhook", "port": port, **fields})
    assert isinstance(source, WebhookSource)
    source.init(None)
    stored = _Stored()
    stop = threading.Event()

    def run() -> None:
        state = None
        while not stop.is_set():
            polled = source.poll(state, 100, 0.1)
            if polled is not None:
                stored.extend(json.loads(m.payload) for m in polled.messages)
                stored.raw.extend(m.payload for m in polled.messages)
                state = polled.state
                source.commit(state)

    worker = threading.Thread(target=run, daemon=True)
    if store:
        worker.start()
    try:
        yield source, f"http://127.0.0.1:{port}{source.config.path}", stored
    finally:
        stop.set()
        if store:
            worker.join(10)
        source.close()


def _raw(port: int, data: bytes, timeout: float = 10) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(data)
    return s


def _read_response(
    s: socket.socket, deadline_s: float = 20, data: bytes = b""
) -> tuple[int, bytes, bool]:
    """(status, everything read, whether the server closed the connection)."""
    s.settimeout(deadline_s)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return _status(data), data, True
        if not chunk:
            return _status(data), data, True
        data += chunk
    return _status(data), data, False


def _status(data: bytes) -> int:
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data.split(b" ", 2)[1])


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def test_no_auth_configured_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"source\.auth: required"):
        build_source({"type": "webhook"})
    with pytest.raises(ConfigError, match=r"source\.secret: required with auth: github"):
        build_source({"type": "webhook", "auth": "github"})
    with pytest.raises(ConfigError, match=r"source\.token: not used with auth: none"):
        build_source({"type": "webhook", "auth": "none", "token": "t"})
    # Written explicitly, none accepts anyone; a token alone means auth: token.
    assert build_source({"type": "webhook", "auth": "none"}).config.auth == "none"
    assert build_source({"type": "webhook", "token": "${env:HOOK}"}).config.auth == "token"


def test_bearer_token_wrong_or_missing_is_401_and_right_is_stored():
    with serving(token="s3cret-token") as (_src, url, stored):
        assert httpx.post(url, json={"a": 1}).status_code == 401
        r = httpx.post(url, json={"a": 2}, headers={"Authorization": "Bearer s3cret-tokeN"})
        assert r.status_code == 401 and r.json() == {"error": "unauthorized"}
        r = httpx.post(url, json={"a": 3}, headers={"Authorization": "Basic s3cret-token"})
        assert r.status_code == 401
        r = httpx.post(url, json={"a": 4}, headers={"Authorization": "Bearer s3cret-token"})
        assert r.status_code == 200, r.text
        assert stored == [{"a": 4}]


def _github(secret: bytes, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def test_github_signature_valid_invalid_and_missing():
    secret = b"gh-webhook-secret"
    with serving(auth="github", secret=secret.decode()) as (_src, url, stored):
        body = json.dumps({"action": "opened", "number": 7}).encode()
        sig = _github(secret, body)
        ok = httpx.post(url, content=body, headers={"X-Hub-Signature-256": sig})
        assert ok.status_code == 200, ok.text
        tampered = body.replace(b"7", b"8")
        bad = httpx.post(url, content=tampered, headers={"X-Hub-Signature-256": sig})
        assert bad.status_code == 401 and bad.json() == {"error": "signature does not match"}
        other = _github(b"another-secret", body)
        assert httpx.post(url, content=body, headers={"X-Hub-Signature-256": other}).is_error
        no_prefix = {"X-Hub-Signature-256": sig.removeprefix("sha256=")}
        assert httpx.post(url, content=body, headers=no_prefix).status_code == 401
        assert httpx.post(url, content=body).json() == {"error": "missing signature"}
        assert stored == [{"action": "opened", "number": 7}]


def _stripe(secret: bytes, body: bytes, t: int) -> str:
    mac = hmac.new(secret, str(t).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def test_stripe_signature_valid_invalid_and_expired():
    secret = b"whsec_test_123"
    with serving(auth="stripe", secret=secret.decode(), signature_tolerance_s=300) as (
        _src,
        url,
        stored,
    ):
        body = json.dumps({"id": "evt_1", "type": "charge.succeeded"}).encode()
        now = int(time.time())
        h = "Stripe-Signature"
        r = httpx.post(url, content=body, headers={h: _stripe(secret, body, now)})
        assert r.status_code == 200, r.text
        # A second v1 (Stripe sends several while a secret is rolled) may be the one that matches.
        two = f"{_stripe(b'old', body, now)},v1={_stripe(secret, body, now).split('v1=')[1]}"
        assert httpx.post(url, content=body, headers={h: two}).status_code == 200
        wrong = _stripe(b"whsec_other", body, now)
        assert httpx.post(url, content=body, headers={h: wrong}).status_code == 401
        expired = _stripe(secret, body, now - 600)  # correctly signed, replayed 10 minutes on
        r = httpx.post(url, content=body, headers={h: expired})
        assert r.status_code == 401 and r.json() == {"error": "timestamp outside the tolerance"}
        # The timestamp is signed: moving it forward breaks the signature.
        moved = _stripe(secret, body, now - 600).replace(f"t={now - 600}", f"t={now}")
        assert httpx.post(url, content=body, headers={h: moved}).status_code == 401
        garbage = {h: "t=abc,v1=zz"}
        assert httpx.post(url, content=body, headers=garbage).json() == {
            "error": "malformed signature"
        }
        assert [m["id"] for m in stored] == ["evt_1", "evt_1"]


def test_hmac_sha256_in_a_named_header():
    secret = b"k"
    with serving(auth="hmac_sha256", secret="k", signature_header="X-Sig") as (_s, url, stored):
        body = b'{"n":1}'
        mac = hmac.new(secret, body, hashlib.sha256).hexdigest()
        assert httpx.post(url, content=body, headers={"X-Sig": mac}).status_code == 200
        assert httpx.post(url, content=body, headers={"X-Sig": "sha256=" + mac}).status_code == 200
        assert httpx.post(url, content=body, headers={"X-Sig": _flip(mac)}).status_code == 401
        assert stored == [{"n": 1}, {"n": 1}]


def _flip(hex_mac: str) -> str:
    return hex_mac[:-1] + ("1" if hex_mac[-1] == "0" else "0")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"a": NaN}', "NaN is not JSON"),
        (b'{"a": Infinity}', "Infinity is not JSON"),
        (b'{"a": -Infinity}', "-Infinity is not JSON"),
        (b'{"a": 1e400}', "out of a double's range"),
        (b"{nope", "body is not JSON"),
        (b"[1, 2]", "post a JSON object or an array of objects"),
        (b"[]", "post a JSON object or an array of objects"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a": "\xff"}', "body is not"),
        # A lone surrogate escape is no Unicode text: accepted once, the message failed later.
        (b'{"a": "\\ud800"}', "lone surrogate"),
        (b'[{"a": "good"}, {"b": "x\\udc00"}]', "lone surrogate"),
    ],
)
def test_bodies_that_are_not_strict_json_are_400_with_a_short_reason(body: bytes, reason: str):
    with serving(auth="none") as (_src, url, stored):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert reason in r.json()["error"] and len(r.json()["error"]) < 120
        assert stored == []


def test_a_declared_content_length_over_the_limit_is_413_before_any_body_is_sent():
    with serving(auth="none", max_body_bytes=1024) as (_src, url, _stored):
        head = (
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        s = _raw(_port(url), head)  # the body is never sent: the answer must not wait for it
        try:
            status, data, closed = _read_response(s)
        finally:
            s.close()
        assert status == 413 and b"body over 1024 bytes" in data and closed


def test_a_chunked_body_over_the_limit_is_cut_with_413_while_it_streams():
    """The sender streams up to 256 MB; the server answers 413 and closes after about the
    limit, so the sender managed to push only a small part of it (socket buffers)."""
    limit = 64 * 1024
    with serving(auth="none", max_body_bytes=limit) as (_src, url, stored):
        s = _raw(_port(url), b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
        sent, answer = 0, b""
        s.setblocking(False)
        try:
            deadline = time.monotonic() + 60
            while sent < 256 << 20 and time.monotonic() < deadline:
                readable, writable, _ = select.select([s], [s], [], 1)
                if readable:
                    answer = s.recv(65536)
                    break
                if writable:
                    try:
                        sent += s.send(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        break
            s.setblocking(True)
            status, data, closed = _read_response(s, data=answer)
        finally:
            s.close()
        assert status == 413, data[:300]
        assert closed
        assert sent < 32 << 20, f"the server let {sent} bytes in"
        assert stored == []


def test_a_body_sent_slowly_is_408_and_closed():
    with serving(auth="none", body_timeout_s=1.0) as (_src, url, stored):
        s = _raw(_port(url), b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        started = time.monotonic()
        try:
            trickle = threading.Thread(target=_trickle, args=(s, 30), daemon=True)
            trickle.start()
            status, data, closed = _read_response(s)
        finally:
            s.close()
        assert status == 408 and b"body not received in time" in data and closed
        assert time.monotonic() - started < 10
        assert stored == []


def _count(source: WebhookSource) -> int:
    polled = source.poll(None, 10, 0.1)  # a poll changes nothing: it only looks
    return len(polled.messages) if polled else 0


def _trickle(s: socket.socket, n: int) -> None:
    for _ in range(n):
        try:
            s.sendall(b" ")
        except OSError:
            return
        time.sleep(0.2)  # a slow sender's pace, not a synchronisation


def test_a_request_head_sent_slowly_is_408_and_closed():
    with serving(auth="none", header_timeout_s=1.0) as (_src, url, _stored):
        s = _raw(_port(url), b"POST / HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        try:
            status, data, closed = _read_response(s)
        finally:
            s.close()
        assert status == 408 and b"request head not received in time" in data and closed
        assert time.monotonic() - started < 10
        # A timely request on a new connection is served.
        assert httpx.post(url, json={"ok": True}).status_code == 200


def test_requests_beyond_the_concurrency_limit_get_503_at_once():
    with serving(auth="none", max_concurrent_requests=2, ack_timeout_s=30, store=False) as (
        source,
        url,
        _stored,
    ):
        results: dict[int, int] = {}

        def post(i: int) -> None:
            results[i] = httpx.post(url, json={"i": i}, timeout=60).status_code

        waiting = [threading.Thread(target=post, args=(i,)) for i in (1, 2)]
        for t in waiting:
            t.start()
        # Both are held (nobody stores them yet): a poll sees their two messages.
        wait_for(lambda: _count(source) == 2, timeout=30, what="two held posts")
        started = time.monotonic()
        r = httpx.post(url, json={"i": 3}, timeout=30)
        assert r.status_code == 503 and r.json() == {"error": "too many concurrent requests"}
        assert time.monotonic() - started < 5
        # Storing the two answers them 200; a slot is free again.
        polled = source.poll(None, 10, 5)
        assert polled is not None and len(polled.messages) == 2
        source.commit(polled.state)
        for t in waiting:
            t.join(30)
        assert results == {1: 200, 2: 200}
        r3: dict[str, int] = {}

        def post3() -> None:
            r3["s"] = httpx.post(url, json={"i": 4}, timeout=60).status_code

        t3 = threading.Thread(target=post3)
        t3.start()
        polled2 = None
        deadline = time.monotonic() + 30
        while polled2 is None and time.monotonic() < deadline:
            polled2 = source.poll(polled.state, 10, 1)
        assert polled2 is not None and json.loads(polled2.messages[0].payload) == {"i": 4}
        source.commit(polled2.state)
        t3.join(30)
        assert r3 == {"s": 200}


def test_the_token_by_reference_is_resolved_in_the_run_and_never_shown(monkeypatch):
    from conveyor.config.specs import from_mapping, resolved

    monkeypatch.setenv("CONVEYOR_TEST_HOOK_TOKEN", "from-the-environment")
    port = free_port()
    spec = {
        "name": "hook_ref",
        "kind": "source",
        "source": {
            "type": "webhook",
            "port": port,
            "token": "${env:CONVEYOR_TEST_HOOK_TOKEN}",
            "ack_timeout_s": 0.5,
        },
    }
    loaded = from_mapping(spec, source="hook_ref.yaml", fallback_name="hook_ref")
    assert loaded.ok, loaded.error
    assert "from-the-environment" not in json.dumps(loaded.display())
    live = resolved(loaded)  # what the run does
    assert live.source_config is not None
    source = build_source(live.source_config)
    source.init(None)
    try:
        url = f"http://127.0.0.1:{port}/"
        good = {"Authorization": "Bearer from-the-environment"}
        bad = {"Authorization": "Bearer ${env:CONVEYOR_TEST_HOOK_TOKEN}"}
        assert httpx.post(url, json={"a": 1}, headers=bad).status_code == 401
        r = httpx.post(url, json={"a": 1}, headers=good, timeout=10)
        assert r.status_code == 503  # authenticated; nobody stores it here
    finally:
        source.close()


def test_other_paths_and_methods_are_answered_without_reading_the_body_and_closed():
    with serving(auth="none", path="/hook") as (_src, url, stored):
        port = _port(url)
        for head in (
            b"POST /other HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n",
            b"PUT /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n",
        ):
            s = _raw(port, head)  # the announced body never comes: the answer must not wait
            try:
                status, data, closed = _read_response(s)
            finally:
                s.close()
            assert status in (404, 405) and closed, data[:200]
        assert stored == []


def test_numbers_and_text_pass_on_as_posted():
    """A price is not rounded to a double; a surrogate pair (an emoji) is text like any other."""
    body = b'{"price": 12345678901234567.89, "q": 1.10, "n": -0, "big": 123456789012345678901234567890, "e": "\\ud83d\\ude00"}'
    with serving(auth="none") as (_src, url, stored):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert stored.raw == [
            b'{"price":12345678901234567.89,"q":1.10,"n":-0,'
            b'"big":123456789012345678901234567890,"e":"\\ud83d\\ude00"}'
        ]
        assert stored[0]["e"] == "\U0001f600"
