"""A schema registry STAND-IN for tests: not a schema registry.

No schema registry server installs from the package registries this project reaches, so the
tests produce their data with confluent-kafka's own serializers against this small HTTP server,
which implements only the documented Confluent Schema Registry REST routes those clients call
(https://docs.confluent.io/platform/current/schema-registry/develop/api.html):

- ``POST /subjects/{subject}/versions``: register (``{"id"}``; the same schema gets the same id)
- ``POST /subjects/{subject}``: look a schema up under a subject
- ``GET /schemas/ids/{id}`` (``format=serialized`` for PROTOBUF: the stand-in keeps a Protobuf
  schema as registered, which for confluent-kafka's Python serializer is already the base64
  FileDescriptorProto; it translates nothing to or from ``.proto`` text)
- ``GET /schemas/ids/{id}/versions``: the subject-version pairs of a schema id
- ``GET /schemas/guids/{guid}``
- ``GET /subjects``, ``GET /subjects/{subject}/versions``,
  ``GET /subjects/{subject}/versions/{version|latest}``
- ``GET /config``, ``PUT /config``, ``GET /config/{subject}``, ``PUT /config/{subject}``
- ``POST /compatibility/subjects/{subject}/versions/{version|latest}`` (always compatible: the
  stand-in checks no compatibility)
- ``GET /associations/resources/{namespace}/{name}`` (always none: confluent-kafka 2.16's topic
  name strategy asks it first and falls back to ``<topic>-value``)

Schema types AVRO (the default), PROTOBUF and JSON, with ``references``. Switches for tests:
HTTP Basic and Bearer checking (401 otherwise), ``outage`` (every request answers 503) and
``requests`` (a counter of requests per route, to prove the client caches).

The ``schema_registry`` fixture yields a stand-in, or, with ``CONVEYOR_TEST_SCHEMA_REGISTRY_URL``
set, a real registry at that URL (the contract run): tests that need the switches skip then.
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

REAL_REGISTRY_ENV = "CONVEYOR_TEST_SCHEMA_REGISTRY_URL"
JSON_TYPE = "application/vnd.schemaregistry.v1+json"


@dataclass
class _Stored:
    id: int
    guid: str
    schema_type: str
    schema: str
    references: list[dict[str, Any]]

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": self.schema, "guid": self.guid}
        if self.schema_type != "AVRO":
            out["schemaType"] = self.schema_type
        if self.references:
            out["references"] = self.references
        return out


class _Error(Exception):
    def __init__(self, status: int, code: int, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class _State:
    schemas: dict[int, _Stored] = field(default_factory=dict)
    subjects: dict[str, list[int]] = field(default_factory=dict)  # subject -> ids by version
    config: dict[str, str] = field(default_factory=lambda: {"": "BACKWARD"})
    lock: threading.Lock = field(default_factory=threading.Lock)


def _key(body: dict[str, Any]) -> tuple[str, str, str]:
    refs = json.dumps(body.get("references") or [], sort_keys=True)
    text = body.get("schema")
    if not isinstance(text, str):
        raise _Error(422, 42201, "Invalid schema: 'schema' must be a string")
    return body.get("schemaType") or "AVRO", text, refs


class _Routes:
    """The documented routes over a ``_State`` (one method per route, named in ``ROUTES``)."""

    def __init__(self, state: _State):
        self.s = state

    def _find(self, body: dict[str, Any]) -> _Stored | None:
        key = _key(body)
        for st in self.s.schemas.values():
            if (st.schema_type, st.schema, json.dumps(st.references, sort_keys=True)) == key:
                return st
        return None

    def _versions(self, subject: str) -> list[int]:
        ids = self.s.subjects.get(subject)
        if not ids:
            raise _Error(404, 40401, f"Subject '{subject}' not found.")
        return ids

    def _version(self, subject: str, version: str) -> dict[str, Any]:
        ids = self._versions(subject)
        if version in ("latest", "-1"):
            n = len(ids)
        elif version.isdigit() and 1 <= int(version) <= len(ids):
            n = int(version)
        else:
            raise _Error(404, 40402, f"Version {version} not found.")
        st = self.s.schemas[ids[n - 1]]
        return {"subject": subject, "version": n, "id": st.id, **st.body()}

    def register(self, q: dict[str, str], body: dict[str, Any], subject: str) -> Any:
        st = self._find(body)
        if st is None:
            schema_type, text, _ = _key(body)
            new_id = max(self.s.schemas, default=0) + 1
            st = _Stored(
                new_id,
                str(uuid.uuid5(uuid.NAMESPACE_OID, f"standin-{new_id}")),
                schema_type,
                text,
                list(body.get("references") or []),
            )
            self.s.schemas[new_id] = st
        ids = self.s.subjects.setdefault(subject, [])
        if st.id not in ids:
            ids.append(st.id)
        return {"id": st.id}

    def lookup(self, q: dict[str, str], body: dict[str, Any], subject: str) -> Any:
        ids = self._versions(subject)
        st = self._find(body)
        if st is None or st.id not in ids:
            raise _Error(404, 40403, "Schema not found")
        return {"subject": subject, "version": ids.index(st.id) + 1, "id": st.id, **st.body()}

    def by_id(self, q: dict[str, str], body: Any, schema_id: str) -> Any:
        st = self.s.schemas.get(int(schema_id))
        if st is None:
            raise _Error(404, 40403, f"Schema {schema_id} not found")
        return st.body()

    def id_versions(self, q: dict[str, str], body: Any, schema_id: str) -> Any:
        sid = int(schema_id)
        if sid not in self.s.schemas:
            raise _Error(404, 40403, f"Schema {schema_id} not found")
        return [
            {"subject": subject, "version": ids.index(sid) + 1}
            for subject, ids in sorted(self.s.subjects.items())
            if sid in ids
        ]

    def by_guid(self, q: dict[str, str], body: Any, guid: str) -> Any:
        for st in self.s.schemas.values():
            if st.guid == guid:
                return {"id": st.id, **st.body()}
        raise _Error(404, 40403, f"Schema {guid} not found")

    def subjects(self, q: dict[str, str], body: Any) -> Any:
        return sorted(self.s.subjects)

    def versions(self, q: dict[str, str], body: Any, subject: str) -> Any:
        return list(range(1, len(self._versions(subject)) + 1))

    def version(self, q: dict[str, str], body: Any, subject: str, version: str) -> Any:
        return self._version(subject, version)

    def get_config(self, q: dict[str, str], body: Any, subject: str = "") -> Any:
        level = self.s.config.get(subject) or self.s.config[""]
        return {"compatibilityLevel": level}

    def put_config(self, q: dict[str, str], body: dict[str, Any], subject: str = "") -> Any:
        level = str(body.get("compatibility") or body.get("compatibilityLevel") or "").upper()
        if not level:
            raise _Error(422, 42203, "Invalid compatibility level")
        self.s.config[subject] = level
        return {"compatibility": level}

    def associations(self, q: dict[str, str], body: Any, namespace: str, name: str) -> Any:
        return []  # no topic is associated with a subject: the serializers use their strategy

    def compatibility(
        self, q: dict[str, str], body: dict[str, Any], subject: str, version: str
    ) -> Any:
        self._version(subject, version)
        return {"is_compatible": True}


_SEG = r"([^/]+)"
# (method, route as counted, pattern, _Routes method)
ROUTES: list[tuple[str, str, re.Pattern[str], str]] = [
    ("POST", "POST /subjects/{s}/versions", re.compile(rf"/subjects/{_SEG}/versions"), "register"),
    ("POST", "POST /subjects/{s}", re.compile(rf"/subjects/{_SEG}"), "lookup"),
    ("GET", "GET /schemas/ids/{id}", re.compile(r"/schemas/ids/(\d+)"), "by_id"),
    (
        "GET",
        "GET /schemas/ids/{id}/versions",
        re.compile(r"/schemas/ids/(\d+)/versions"),
        "id_versions",
    ),
    ("GET", "GET /schemas/guids/{guid}", re.compile(rf"/schemas/guids/{_SEG}"), "by_guid"),
    ("GET", "GET /subjects", re.compile(r"/subjects"), "subjects"),
    ("GET", "GET /subjects/{s}/versions", re.compile(rf"/subjects/{_SEG}/versions"), "versions"),
    (
        "GET",
        "GET /subjects/{s}/versions/{v}",
        re.compile(rf"/subjects/{_SEG}/versions/(latest|-?\d+)"),
        "version",
    ),
    ("GET", "GET /config", re.compile(r"/config"), "get_config"),
    ("PUT", "PUT /config", re.compile(r"/config"), "put_config"),
    ("GET", "GET /config/{s}", re.compile(rf"/config/{_SEG}"), "get_config"),
    ("PUT", "PUT /config/{s}", re.compile(rf"/config/{_SEG}"), "put_config"),
    (
        "POST",
        "POST /compatibility/subjects/{s}/versions/{v}",
        re.compile(rf"/compatibility/subjects/{_SEG}/versions/(latest|-?\d+)"),
        "compatibility",
    ),
    (
        "GET",
        "GET /associations/resources/{ns}/{name}",
        re.compile(rf"/associations/resources/{_SEG}/{_SEG}"),
        "associations",
    ),
]


class SchemaRegistryStandIn:
    """The stand-in server on 127.0.0.1 (a free port), in a thread; ``close()`` stops it."""

    real = False

    def __init__(self) -> None:
        self.state = _State()
        self.requests: Counter[str] = Counter()
        self.outage = False
        self.basic_auth: tuple[str, str] | None = None
        self.bearer_token: str | None = None
        self._routes = _Routes(self.state)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _authorized(self, header: str | None) -> bool:
        if self.basic_auth is None and self.bearer_token is None:
            return True
        if header is None:
            return False
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "basic" and self.basic_auth is not None:
            try:
                user, _, pw = base64.b64decode(value).decode().partition(":")
            except ValueError:
                return False
            return (user, pw) == self.basic_auth
        if scheme.lower() == "bearer" and self.bearer_token is not None:
            return value == self.bearer_token
        return False

    def handle(self, method: str, raw_path: str, auth: str | None, body: bytes) -> tuple[int, Any]:
        """(status, JSON body) of one request; counts it under its route."""
        parts = urlsplit(raw_path)
        path = parts.path.rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        for m, name, pattern, fn in ROUTES:
            match = pattern.fullmatch(path)
            if m != method or match is None:
                continue
            self.requests[name] += 1
            if self.outage:
                return 503, {"error_code": 50301, "message": "stand-in outage"}
            if not self._authorized(auth):
                return 401, {"error_code": 401, "message": "Unauthorized"}
            try:
                payload = json.loads(body) if body else {}
                args = [unquote(g) for g in match.groups()]
                with self.state.lock:
                    return 200, getattr(self._routes, fn)(query, payload, *args)
            except _Error as e:
                return e.status, {"error_code": e.code, "message": e.message}
            except (ValueError, KeyError) as e:
                return 422, {"error_code": 42201, "message": f"Invalid request: {e}"}
        self.requests[f"{method} {path} (no route)"] += 1
        return 404, {"error_code": 404, "message": f"HTTP 404 Not Found: {method} {path}"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                status, out = standin.handle(
                    self.command, self.path, self.headers.get("Authorization"), body
                )
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", JSON_TYPE)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


@dataclass
class RealRegistry:
    """A real registry for the contract run (``CONVEYOR_TEST_SCHEMA_REGISTRY_URL``)."""

    url: str
    real: bool = True


def require_standin(registry: Any) -> SchemaRegistryStandIn:
    """The stand-in, or skip: a test that switches outages, auth or counts requests."""
    if getattr(registry, "real", False):
        pytest.skip(
            f"needs the stand-in's switches (outage, auth, request counts); {REAL_REGISTRY_ENV} is set"
        )
    assert isinstance(registry, SchemaRegistryStandIn)
    return registry


@pytest.fixture
def schema_registry() -> Iterator[SchemaRegistryStandIn | RealRegistry]:
    """A fresh stand-in per test, or the real registry at ``$CONVEYOR_TEST_SCHEMA_REGISTRY_URL``."""
    url = os.environ.get(REAL_REGISTRY_ENV)
    if url:
        yield RealRegistry(url.rstrip("/"))
        return
    standin = SchemaRegistryStandIn()
    try:
        yield standin
    finally:
        standin.close()
