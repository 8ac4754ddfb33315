"""HTTP webhook source (opaque): JSON posts, answered 2xx only once their batch is stored.

A small Starlette app on uvicorn, in a thread of the run. A request's messages (a JSON
object, or an array of objects: one message each) get sequence numbers and wait in
memory; ``poll`` hands out those after the stored state's sequence number;
``commit`` answers the requests whose messages the state covers with 200. A request
whose batch is not stored within ``ack_timeout_s`` (or whose run stops) gets 503, and
the sender retries: at least once. A full buffer answers 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr

from conveyor.core.errors import PermanentSourceError
from conveyor.core.routing import SourceMode
from conveyor.sources.base import Polled, Source, SourceConfig, SourceMessage, State


class WebhookConfig(SourceConfig):
    """An HTTP endpoint that accepts JSON posts."""

    type: Literal["webhook"] = "webhook"
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8088, ge=1, le=65_535, description="Port to listen on.")
    path: str = Field(default="/", pattern=r"^/", description="Path that accepts POST requests.")
    token: SecretStr | None = Field(
        default=None,
        description="Bearer token the sender must present: a reference, ${env:NAME} or ${file:/path}.",
    )
    max_pending: int = Field(
        default=10_000, ge=1, le=10_000_000, description="Messages held before new posts get 429."
    )
    ack_timeout_s: float = Field(
        default=30.0, gt=0, le=3_600, description="A post not stored within this gets 503."
    )
    max_body_bytes: int = Field(default=8 << 20, ge=1024, description="Largest request body.")

    def asset_key_path(self) -> list[str]:
        return ["webhook", f"{self.host}_{self.port}"]

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

    def init(self, state: State | None) -> None:
        import uvicorn

        if state is not None:
            self._buf.next_seq = int(state.get("seq", 0)) + 1
        server = uvicorn.Server(
            uvicorn.Config(
                self._app(),
                host=self.config.host,
                port=self.config.port,
                log_level="warning",
                lifespan="off",
            )
        )
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # never in a run's op
        self._server = server
        self._thread = threading.Thread(target=server.run, name="webhook", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 15
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise PermanentSourceError(
                    f"webhook cannot listen on {self.config.host}:{self.config.port} (port in use?)"
                )
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}{self.config.path}"

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        token = self.config.token.get_secret_value() if self.config.token else None

        async def receive(request: Request) -> JSONResponse:
            if token is not None and request.headers.get("authorization") != f"Bearer {token}":
                return JSONResponse({"error": "unauthorized"}, status_code=401)
            body = await request.body()
            if len(body) > self.config.max_body_bytes:
                return JSONResponse({"error": "body too large"}, status_code=413)
            try:
                data = json.loads(body)
            except ValueError:
                return JSONResponse({"error": "body is not JSON"}, status_code=400)
            items = data if isinstance(data, list) else [data]
            if not items or not all(isinstance(x, dict) for x in items):
                return JSONResponse(
                    {"error": "post a JSON object or an array of objects"}, status_code=400
                )
            now_ms = int(time.time() * 1000)
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[bool] = loop.create_future()
            with self._buf.cond:
                if len(self._buf.messages) + len(items) > self.config.max_pending:
                    return JSONResponse({"error": "too many pending messages"}, status_code=429)
                for x in items:
                    msg = SourceMessage(
                        json.dumps(x, separators=(",", ":")).encode(), timestamp_ms=now_ms
                    )
                    self._buf.messages.append((self._buf.next_seq, msg))
                    self._buf.next_seq += 1
                self._buf.requests.append(_Request(self._buf.next_seq - 1, loop, fut))
                self._buf.cond.notify_all()
            try:
                ok = await asyncio.wait_for(fut, self.config.ack_timeout_s)
            except asyncio.TimeoutError:
                ok = False
            if not ok:
                return JSONResponse({"error": "not stored in time; retry"}, status_code=503)
            return JSONResponse({"accepted": len(items)}, status_code=200)

        return Starlette(routes=[Route(self.config.path, receive, methods=["POST"])])

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
