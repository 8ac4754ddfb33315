"""HTTP webhook source (opaque): JSON posts, answered 2xx only once their batch is stored.

A small Starlette app on uvicorn (h11), in a thread of the run. A request's messages (a
JSON object, or an array of objects: one message each) get sequence numbers and wait in
memory; ``poll`` hands out those after the stored state's sequence number; ``commit``
answers the requests whose messages the state covers with 200. A request whose batch is
not stored within ``ack_timeout_s`` (or whose run stops) gets 503, and the sender
retries: at least once. A full buffer answers 429.

Made for the open internet: authentication is required (``auth``, checked in constant
time; ``conveyor.sources.webhook_auth``), the body is read against ``max_body_bytes``
and a deadline while it streams in (413 / 408, the connection closed, nothing more
buffered), a new connection must send its request head within ``header_timeout_s``,
requests beyond ``max_concurrent_requests`` get 503, and a body that is not strict
JSON (NaN and Infinity included) gets 400 with a short reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, model_validator

from conveyor.core.engine.routing import SourceMode
from conveyor.core.errors import PermanentSourceError, rule
from conveyor.core.trust.references import known_now
from conveyor.sources import strict_json
from conveyor.sources.base import Polled, Source, SourceConfig, SourceMessage, State
from conveyor.sources.webhook_auth import AuthMode, needs_body, verifier

WEBHOOK_NOTES = """
A GitHub webhook and a Stripe endpoint (the secret as a reference):

```yaml
source: {type: webhook, port: 8088, path: /github, auth: github, secret: ${file:/run/secrets/github}}
source: {type: webhook, port: 8089, path: /stripe, auth: stripe, secret: ${file:/run/secrets/whsec}}
```

Guarantees, as tested (tests/integration/test_webhook_open_internet.py,
tests/unit/test_webhook_auth.py): a spec without `auth` (and without `token`) is refused naming
`source.auth`; tokens and signatures are compared with `hmac.compare_digest`; a wrong or missing
token, a wrong, missing or malformed signature, and a Stripe `t` more than
`signature_tolerance_s` from now get 401; a body larger than `max_body_bytes` gets 413 before it
is read when its Content-Length says so, and otherwise as soon as the limit is passed while it
streams (chunked): the server stops reading, so the sender cannot push much more than the limit;
a request head not complete within `header_timeout_s`, or a body within `body_timeout_s`
(slowloris), gets 408 and the connection is closed; requests over `max_concurrent_requests` get
503 at once; `NaN`, `Infinity`, numbers beyond a double, a `\\ud800`-style escape without its
pair (no Unicode text), nesting too deep for the parser and bodies not in UTF-8 get 400 with a
short reason (a 200 means every object of the body is stored). Messages are passed on as the JSON
received, re-serialized compactly with every number exactly as written (`12345678901234567.89`
and `1.10` are not rounded to a double).
"""


class WebhookConfig(SourceConfig):
    """An HTTP endpoint that accepts JSON posts (an object, or an array of objects). Answers:
    200 once the batch holding the post is stored; 400 for a body that is not strict JSON
    (NaN, Infinity included) or not objects; 401 when `auth` fails; 408 when the request head
    or body does not arrive in time; 413 for a body over `max_body_bytes` (refused from its
    Content-Length, or cut while it streams in); 429 when `max_pending` messages wait; 503 over
    `max_concurrent_requests` or when the batch is not stored within `ack_timeout_s` (the
    sender retries: at least once). An answer sent before the body was read to its end closes
    the connection."""

    doc_notes: ClassVar[str] = WEBHOOK_NOTES

    type: Literal["webhook"] = "webhook"
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8088, ge=1, le=65_535, description="Port to listen on.")
    path: str = Field(default="/", pattern=r"^/", description="Path that accepts POST requests.")
    auth: AuthMode | None = Field(
        default=None,
        description=(
            "How a sender proves itself: token (Authorization: Bearer <token>), hmac_sha256 (a hex "
            "HMAC-SHA256 of the raw body in signature_header, 'sha256=' prefix optional), github "
            "(X-Hub-Signature-256: sha256=<hex>), stripe (Stripe-Signature: t=...,v1=..., t within "
            "signature_tolerance_s) or none. Required: none must be written to accept anyone; "
            "left out with a token given, it is token."
        ),
    )
    token: SecretStr | None = Field(
        default=None,
        description="auth token: the bearer token, a reference ${env:NAME} or ${file:/path}.",
    )
    secret: SecretStr | None = Field(
        default=None,
        description=(
            "auth hmac_sha256, github, stripe: the HMAC key (GitHub's webhook secret, Stripe's "
            "endpoint signing secret whsec_...), a reference ${env:NAME} or ${file:/path}."
        ),
    )
    signature_header: str = Field(
        default="X-Signature-256",
        pattern=r"^[A-Za-z0-9-]{1,64}$",
        description="auth hmac_sha256: the header holding the signature.",
    )
    signature_tolerance_s: int = Field(
        default=300,
        ge=1,
        le=86_400,
        description="auth stripe: largest distance between the signature's t and now, seconds.",
    )
    max_pending: int = Field(
        default=10_000, ge=1, le=10_000_000, description="Messages held before new posts get 429."
    )
    ack_timeout_s: float = Field(
        default=30.0, gt=0, le=3_600, description="A post not stored within this gets 503."
    )
    max_body_bytes: int = Field(
        default=8 << 20,
        ge=1024,
        le=1 << 30,
        description="Largest request body; a larger one gets 413 while it streams in.",
    )
    max_concurrent_requests: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Requests handled at once (each waits for its batch); more get 503.",
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        le=100_000,
        description="Open connections at most; a request on a connection beyond gets 503.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="A new connection's request head must arrive within this (else 408, closed).",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3_600,
        description="A request's whole body must arrive within this after its head (else 408, closed).",
    )

    @model_validator(mode="after")
    def _auth_rules(self) -> WebhookConfig:
        """Authentication is chosen explicitly; each mode has its key, and only its key."""
        auth = self.auth
        if auth is None:
            rule(
                self.token is not None,
                "required: token, hmac_sha256, github, stripe, or none to accept anyone",
                field="auth",
            )
            auth = "token"
            object.__setattr__(self, "auth", auth)
        if auth == "token":
            rule(self.token is not None, "required with auth: token", field="token")
        if needs_body(auth):
            rule(self.secret is not None, f"required with auth: {auth}", field="secret")
        for name, value in (("token", self.token), ("secret", self.secret)):
            if value is None:
                continue
            wanted = name == "token" if auth == "token" else name == "secret" and auth != "none"
            rule(wanted, f"not used with auth: {auth}", field=name)
            text = value.get_secret_value()
            rule(not known_now(text) or bool(text.strip()), "must not be empty", field=name)
        return self

    def asset_key_path(self) -> list[str]:
        return ["webhook", f"{self.host}_{self.port}"]

    def owned_resources(self, connector: str) -> tuple[str, ...]:
        return (f"HTTP port {self.host}:{self.port}",)

    def kind(self) -> str:
        return "http"


@dataclass
class _Request:
    last_seq: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[bool]


@dataclass
class _Buffer:
    cond: threading.Condition = field(default_factory=threading.Condition)
    messages: deque[tuple[int, SourceMessage]] = field(default_factory=deque)
    requests: list[_Request] = field(default_factory=list)
    next_seq: int = 1


class WebhookSource(Source):
    """Serves POSTs on a thread; messages are acknowledged to their senders in commit."""

    config_class = WebhookConfig
    mode: ClassVar[SourceMode] = SourceMode.OPAQUE
    config: WebhookConfig

    def __init__(self, config: SourceConfig):
        super().__init__(config)
        self._buf = _Buffer()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._active = 0  # requests being handled, on the server's event loop only

    def init(self, state: State | None) -> None:
        import uvicorn

        if state is not None:
            self._buf.next_seq = int(state.get("seq", 0)) + 1
        c = self.config
        server = uvicorn.Server(
            uvicorn.Config(
                self._app(),
                host=c.host,
                port=c.port,
                http=head_timed_h11(c.header_timeout_s),
                limit_concurrency=c.max_connections,
                timeout_keep_alive=5,
                log_level="warning",
                access_log=False,
                lifespan="off",
            )
        )
        server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]  # older uvicorn; never in a run's op
        self._server = server
        self._thread = threading.Thread(target=server.run, name="webhook", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 15
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise PermanentSourceError(
                    f"webhook cannot listen on {c.host}:{c.port} (port in use?)"
                )
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}{self.config.path}"

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        c = self.config
        assert c.auth is not None  # the config's validator chose it
        key = c.token if c.auth == "token" else c.secret
        check = verifier(
            c.auth,
            key.get_secret_value() if key is not None else None,
            signature_header=c.signature_header,
            tolerance_s=c.signature_tolerance_s,
            clock=time.time,
        )
        signed = needs_body(c.auth)

        async def receive(request: Request) -> Response:
            if self._active >= c.max_concurrent_requests:
                return _answer(503, "too many concurrent requests", close=True)
            self._active += 1  # the server's event loop is single-threaded
            try:
                return await self._handle(request, check, signed)
            finally:
                self._active -= 1

        async def elsewhere(_request: Request, exc: Exception) -> Response:
            # Another path or method: answered without reading the body, the connection closed
            # (else the server would go on reading, and discarding, whatever body follows).
            code = getattr(exc, "status_code", 404)
            return _answer(code, "not found" if code == 404 else "POST only", close=True)

        return Starlette(
            routes=[Route(c.path, receive, methods=["POST"])],
            exception_handlers={404: elsewhere, 405: elsewhere},
        )

    async def _handle(self, request: Any, check: Any, signed: bool) -> Any:
        """Refuse early what can be refused from the head; read the body bounded; enqueue."""
        c = self.config
        refused = _length_refused(request.headers.get("content-length"), c.max_body_bytes)
        if refused is not None:
            return refused
        if not signed and (reason := check(request.headers, b"")) is not None:
            return _answer(401, reason, close=True)
        deadline = asyncio.get_running_loop().time() + c.body_timeout_s
        body = await _read_body(request.receive, c.max_body_bytes, deadline)
        if not isinstance(body, bytes):
            return body
        if signed and (reason := check(request.headers, body)) is not None:
            return _answer(401, reason)
        items = strict_json_objects(body)
        if isinstance(items, str):
            return _answer(400, items)
        return await self._enqueue(items)

    async def _enqueue(self, items: list[dict[str, Any]]) -> Any:
        """Hold the request's messages until a commit covers them (200) or the timeout (503)."""
        from starlette.responses import JSONResponse

        now_ms = int(time.time() * 1000)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        with self._buf.cond:
            if len(self._buf.messages) + len(items) > self.config.max_pending:
                return _answer(429, "too many pending messages")
            for x in items:
                msg = SourceMessage(strict_json.dumps(x).encode(), timestamp_ms=now_ms)
                self._buf.messages.append((self._buf.next_seq, msg))
                self._buf.next_seq += 1
            self._buf.requests.append(_Request(self._buf.next_seq - 1, loop, fut))
            self._buf.cond.notify_all()
        try:
            ok = await asyncio.wait_for(fut, self.config.ack_timeout_s)
        except asyncio.TimeoutError:
            ok = False
        if not ok:
            return _answer(503, "not stored in time; retry")
        return JSONResponse({"accepted": len(items)}, status_code=200)

    def poll(self, state: State | None, max_records: int, max_wait_s: float) -> Polled | None:
        after = int((state or {}).get("seq", 0))
        deadline = time.monotonic() + max_wait_s
        with self._buf.cond:
            while True:
                batch = [(s, m) for s, m in self._buf.messages if s > after][:max_records]
                if batch:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._buf.cond.wait(left)
        return Polled([m for _, m in batch], {"seq": batch[-1][0]}, origin=self.config.path)

    def commit(self, state: State) -> None:
        upto = int(state["seq"])
        with self._buf.cond:
            while self._buf.messages and self._buf.messages[0][0] <= upto:
                self._buf.messages.popleft()
            done = [r for r in self._buf.requests if r.last_seq <= upto]
            self._buf.requests = [r for r in self._buf.requests if r.last_seq > upto]
        for r in done:
            r.loop.call_soon_threadsafe(_resolve, r.future, True)

    def close(self) -> None:
        with self._buf.cond:
            pending, self._buf.requests = self._buf.requests, []
        for r in pending:
            with contextlib.suppress(RuntimeError):  # the server's loop may be gone already
                r.loop.call_soon_threadsafe(_resolve, r.future, False)
        server, self._server = self._server, None
        if server is not None:
            server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None


def _resolve(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


def _answer(status: int, reason: str, *, close: bool = False) -> Any:
    """A short JSON error; ``close`` ends the connection (its body was not read to the end)."""
    from starlette.responses import JSONResponse

    headers = {"connection": "close"} if close else None
    return JSONResponse({"error": reason}, status_code=status, headers=headers)


def _length_refused(value: str | None, limit: int) -> Any:
    """413 for a declared Content-Length over the limit, before a byte of the body is read."""
    if value is None:
        return None
    v = value.strip()
    if not (v.isascii() and v.isdigit()):
        return _answer(400, "malformed Content-Length", close=True)
    if len(v) > 19 or int(v) > limit:
        return _answer(413, f"body over {limit} bytes", close=True)
    return None


async def _read_body(
    receive: Callable[[], Awaitable[dict[str, Any]]], limit: int, deadline: float
) -> bytes | Any:
    """The body as it streams in, or the answer: 413 past ``limit``, 408 past ``deadline``.

    uvicorn pauses reading the socket while a chunk waits unread, so stopping here stops
    the sender: nothing past the limit (and the server's small read-ahead) is buffered.
    """
    loop = asyncio.get_running_loop()
    body = bytearray()
    while True:
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise asyncio.TimeoutError
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return _answer(408, "body not received in time", close=True)
        if message["type"] != "http.request":
            return _answer(400, "the client went away", close=True)
        body += message.get("body", b"")
        if len(body) > limit:
            return _answer(413, f"body over {limit} bytes", close=True)
        if not message.get("more_body", False):
            return bytes(body)


def strict_json_objects(body: bytes) -> list[dict[str, Any]] | str:
    """The JSON object (or array of objects) a body holds, or the reason it is refused.

    Strict JSON (``strict_json``): NaN, Infinity, numbers out of a double's range, lone
    surrogates, too deeply nested documents and bodies not in UTF-8 are refused; numbers are
    kept as written.
    """
    try:
        data = strict_json.loads(body)
    except ValueError as e:
        return f"body is not JSON: {e}"
    items = data if isinstance(data, list) else [data]
    if not items or not all(isinstance(x, dict) for x in items):
        return "post a JSON object or an array of objects"
    return items


def head_timed_h11(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline for a new connection's request head.

    uvicorn times out idle keep-alive connections but not a first request head sent byte
    by byte (slowloris); this closes such a connection with 408 after ``timeout_s``.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimedH11(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.head_timer = self.loop.call_later(timeout_s, self.head_timeout)

        def head_timeout(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.write(_TIMEOUT_408)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

    return HeadTimedH11


_HEAD_TIMEOUT_BODY = b'{"error":"request head not received in time"}'
_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s"
    % (len(_HEAD_TIMEOUT_BODY), _HEAD_TIMEOUT_BODY)
)
