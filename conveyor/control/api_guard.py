"""What every REST API request passes before its route: a surface safe to share.

Checked in this order, each refusal a JSON error naming what to change:

1. **Host** (403): the ``Host`` header names an allowed host (``$CONVEYOR_API_ALLOWED_HOSTS``;
   default the loopback names and the address served on), so a DNS-rebinding page cannot
   reach a loopback API under its own name. The probes (``/health``, ``/ready``) skip it.
2. **Origin** (403): a browser's cross-origin request (``Origin`` other than the API's own,
   ``Origin: null``, ``Sec-Fetch-Site: cross-site``/``same-site``) is refused unless the origin
   is listed in ``$CONVEYOR_API_ALLOWED_ORIGINS``; a ``fetch`` with ``mode: no-cors`` from
   any web page the operator opens cannot create a connector, even with ``--no-auth``.
3. **Credentials** (401): ``Authorization: Bearer <token>`` or HTTP Basic with the token as
   the password (any user name; Kafka Connect tooling sends Basic). The admin token may do
   anything; the read-only token only ``GET``/``HEAD`` (403 otherwise).
4. **Content type** (415): a write with a body must be ``application/json``.
5. **Size** (413): a body over ``max_body_bytes`` (``Content-Length``, or counted as it
   streams) is refused before it is parsed.

The probes need no credentials; ``request.state.access`` tells a route who is asking
(``"admin"``, ``"read"`` or None) so that ``/ready`` shows its details only to a token.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from conveyor.core.errors import ConveyorError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

ALLOWED_HOSTS_ENV = "CONVEYOR_API_ALLOWED_HOSTS"
ALLOWED_ORIGINS_ENV = "CONVEYOR_API_ALLOWED_ORIGINS"
MAX_BODY_ENV = "CONVEYOR_API_MAX_BODY_BYTES"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_MAX_BODY_BYTES = 1 << 20
PUBLIC_PATHS = frozenset({"/health", "/ready"})
READ_METHODS = frozenset({"GET", "HEAD"})
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
ADMIN, READ = "admin", "read"


class BodyTooLargeError(ConveyorError):
    """A request body grew past the limit while it streamed in (answered 413)."""


@dataclass(frozen=True)
class Access:
    """Who may call the API and from where. ``token`` None: no authentication (``--no-auth``)."""

    token: str | None
    readonly_token: str | None = None
    allowed_hosts: frozenset[str] = LOOPBACK_HOSTS
    allowed_origins: frozenset[str] = field(default_factory=frozenset)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    @classmethod
    def from_environ(
        cls,
        token: str | None,
        readonly_token: str | None = None,
        *,
        bind_host: str | None = None,
        environ: MutableMapping[str, str] | None = None,
    ) -> Access:
        """The operator's settings: allowed hosts and origins, the body limit."""
        env = os.environ if environ is None else environ
        hosts = _csv(env.get(ALLOWED_HOSTS_ENV, ""))
        if not hosts:
            hosts = set(LOOPBACK_HOSTS)
            if bind_host and not _wildcard(bind_host):
                hosts.add(bind_host.strip("[]").lower())
        raw_max = env.get(MAX_BODY_ENV, "").strip()
        try:
            max_body = int(raw_max) if raw_max else DEFAULT_MAX_BODY_BYTES
        except ValueError:
            raise ConveyorError(f"{MAX_BODY_ENV}: {raw_max!r} is not a number of bytes") from None
        if max_body < 1024:
            raise ConveyorError(f"{MAX_BODY_ENV}: must be 1024 or more")
        origins = {o.rstrip("/") for o in _csv(env.get(ALLOWED_ORIGINS_ENV, ""), lower=False)}
        return cls(token, readonly_token, frozenset(hosts), frozenset(origins), max_body)


def _csv(raw: str, *, lower: bool = True) -> set[str]:
    items = (p.strip() for p in raw.split(","))
    return {(p.lower() if lower else p) for p in items if p}


def _wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The host of a ``Host`` header, without its port (``[::1]:8083`` -> ``::1``)."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:].split("]", 1)[0]
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error_code": status, "message": message}, status, headers=headers)


class Guard:
    """The checks above, as ASGI middleware in front of the whole app."""

    def __init__(self, app: App, access: Access):
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        role, refusal = self.check(scope["method"], scope["path"], headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        scope.setdefault("state", {})["access"] = role
        await self.app(scope, self._bounded(receive), send)

    def check(
        self, method: str, path: str, headers: Headers
    ) -> tuple[str | None, JSONResponse | None]:
        """(the caller's access, None) or (None, the refusal)."""
        public = path in PUBLIC_PATHS
        problem = None if public else self._place_problem(headers)
        if problem:
            return None, _error(403, problem)
        role, refusal = self._credentials(headers, public)
        if refusal is not None:
            return None, refusal
        if role == READ and method not in READ_METHODS:
            return None, _error(
                403, f"the read-only token may only read (GET); {method} needs the admin token"
            )
        if method in WRITE_METHODS:
            refusal = self._body_problem(headers)
            if refusal is not None:
                return None, refusal
        return role, None

    def _place_problem(self, headers: Headers) -> str | None:
        """Why the request's Host or Origin is refused, or None."""
        host = host_name(headers.get("host", ""))
        if "*" not in self.access.allowed_hosts and host not in self.access.allowed_hosts:
            return (
                f"host {host!r} is not allowed: call the API by an allowed name "
                f"({', '.join(sorted(self.access.allowed_hosts))}) or add it to "
                f"{ALLOWED_HOSTS_ENV}"
            )
        origin = headers.get("origin")
        if origin is not None:
            if origin.rstrip("/") in self.access.allowed_origins:
                return None
            parts = urlsplit(origin)
            same = (
                parts.scheme in ("http", "https")
                and parts.netloc.lower() == headers.get("host", "").strip().lower()
            )
            if not same:
                return (
                    f"cross-origin request from {origin[:100]!r} refused: browsers may not call "
                    f"this API from another site (allow an origin with {ALLOWED_ORIGINS_ENV})"
                )
            return None
        if headers.get("sec-fetch-site", "").lower() in ("cross-site", "same-site"):
            return "cross-site request refused: browsers may not call this API from another site"
        return None

    def _credentials(
        self, headers: Headers, public: bool
    ) -> tuple[str | None, JSONResponse | None]:
        """(access, None) for good or no credentials where none are needed, else (None, 401)."""
        if self.access.token is None:
            return ADMIN, None
        given = presented_token(headers.get("authorization", ""))
        if given is not None:
            if hmac.compare_digest(given.encode(), self.access.token.encode()):
                return ADMIN, None
            ro = self.access.readonly_token
            if ro is not None and hmac.compare_digest(given.encode(), ro.encode()):
                return READ, None
        if public:
            return None, None
        challenge = {"WWW-Authenticate": 'Bearer realm="conveyor", Basic realm="conveyor"'}
        header = headers.get("authorization", "")
        if not header:
            message = (
                "missing credentials: send the header 'Authorization: Bearer <token>' "
                "(or HTTP Basic with the token as the password)"
            )
        elif given is None:
            message = (
                "unsupported Authorization scheme: send 'Authorization: Bearer <token>' or Basic"
            )
        elif header.strip().lower().startswith("bearer"):
            message = "invalid bearer token"
        else:
            message = "invalid token"
        return None, _error(401, message, challenge)

    def _body_problem(self, headers: Headers) -> JSONResponse | None:
        length = headers.get("content-length")
        has_body = headers.get("transfer-encoding") is not None or (
            length is not None and length.strip() != "0"
        )
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return _error(400, "Content-Length is not a number")
            if size > self.access.max_body_bytes:
                return _error(413, too_large(self.access.max_body_bytes))
        if not has_body:
            return None
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            return _error(
                415,
                f"unsupported Content-Type {media or '(none)'!r}: send the body as "
                "'Content-Type: application/json'",
            )
        return None

    def _bounded(self, receive: Receive) -> Receive:
        limit = self.access.max_body_bytes
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLargeError(too_large(limit))
            return message

        return bounded


def too_large(limit: int) -> str:
    return f"the request body is larger than {limit} bytes ({MAX_BODY_ENV})"


def presented_token(header: str) -> str | None:
    """The token in an ``Authorization`` header: Bearer's, or Basic's password; None if neither."""
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if not value:
        return None
    if scheme.lower() == "bearer":
        return value
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, sep, password = decoded.partition(":")
        return password if sep and password else None
    return None
