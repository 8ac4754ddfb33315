"""The REST API: Kafka Connect's management surface over Conveyor (``conveyor serve``).

Starlette on uvicorn. Every route is a thin translation of one call of
``conveyor.control.operations`` (the same calls the CLI makes) into HTTP:

=======================================  =========================================
``GET /connectors[?expand=status|info]``  names, or name -> {status, info}
``POST /connectors``                      create ``{"name", "config"}`` (201)
``GET /connectors/{name}``                info: name, config, tasks, type
``GET|PUT /connectors/{name}/config``     the spec (secrets redacted) / create or update
``GET /connectors/{name}/status``         state, tasks, worker (broker executor), trace
``PUT /connectors/{name}/pause|resume``   202
``PUT /connectors/{name}/stop``           204
``POST /connectors/{name}/restart``       204; ``?includeTasks=&onlyFailed=``: 202 + status
``GET /connectors/{name}/topics``         KIP-558 active topics; ``PUT .../topics/reset``
``PUT /connector-plugins/{type}/config/validate``  Kafka Connect's ``ConfigInfos``
``DELETE /connectors/{name}``             204 (spec file, state and offsets)
``GET|PATCH|DELETE .../offsets``          KIP-875; changes only when stopped
``GET .../dead-letters``, ``.../destination``, ``.../history``, ``.../tasks``
``POST .../backfills``                    ``{"start", "end"}``: a backfill request (202)
``GET .../backfills[/{id}]``              backfill requests, newest first / one
``GET /health``, ``GET /ready``           no token needed (probes)
``GET /metrics``                          Prometheus text
=======================================  =========================================

Errors are JSON ``{"error_code": <http status>, "message": "..."}``. Every route but
``/health`` and ``/ready`` wants the token, as ``Authorization: Bearer <token>`` or HTTP
Basic with the token as the password; the admin token comes from ``$CONVEYOR_API_TOKEN``
or a file (``$CONVEYOR_API_TOKEN_FILE``), a read-only one (GET only) from
``$CONVEYOR_API_READONLY_TOKEN`` / ``_FILE`` or ``$CONVEYOR_HOME/api-token-readonly``.
``conveyor.control.api_guard`` checks Host, Origin, credentials, content type and size first.
Specs in answers are redacted: ``${env:...}`` references are shown, secrets never; a
config sent back with the mask keeps the stored secret.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from conveyor.config.specs import LoadedSpec, keep_stored, load_source
from conveyor.control.api_guard import Access, BodyTooLargeError, Guard
from conveyor.control.backfills import Backfills, backfill_body
from conveyor.control.kafka_connect import (
    active_topics,
    reset_active_topics,
    restart_plan,
    restarting,
    validate,
)
from conveyor.control.operations import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    Operations,
)
from conveyor.core.errors import ConfigError, ConveyorError, TransientSinkError
from conveyor.core.host.home import conveyor_home
from conveyor.core.trust.secrets import mask_url_passwords
from conveyor.store.meta import StoreError

log = logging.getLogger("conveyor.control.api")

TOKEN_ENV = "CONVEYOR_API_TOKEN"
TOKEN_FILE_ENV = "CONVEYOR_API_TOKEN_FILE"
READONLY_TOKEN_ENV = "CONVEYOR_API_READONLY_TOKEN"
READONLY_TOKEN_FILE_ENV = "CONVEYOR_API_READONLY_TOKEN_FILE"
READONLY_TOKEN_FILE = "api-token-readonly"  # in $CONVEYOR_HOME
DEFAULT_PORT = 8083  # Kafka Connect's
MAX_LIMIT = 1000  # the largest ?limit= a list answers


class TokenError(ConveyorError):
    """No usable API token configured."""


def load_token(token_file: Path | None = None) -> str | None:
    """The admin token: ``token_file``, else ``$CONVEYOR_API_TOKEN_FILE``, else ``$CONVEYOR_API_TOKEN``."""
    return _token(token_file, TOKEN_FILE_ENV, TOKEN_ENV)


def load_readonly_token() -> str | None:
    """The read-only token: ``$CONVEYOR_API_READONLY_TOKEN_FILE``, else
    ``$CONVEYOR_API_READONLY_TOKEN``, else the file ``$CONVEYOR_HOME/api-token-readonly``."""
    token = _token(None, READONLY_TOKEN_FILE_ENV, READONLY_TOKEN_ENV)
    default = conveyor_home() / READONLY_TOKEN_FILE
    if token is None and default.is_file():
        token = _token(default, READONLY_TOKEN_FILE_ENV, READONLY_TOKEN_ENV)
    return token


def _token(token_file: Path | None, file_env: str, env: str) -> str | None:
    path = token_file or (Path(os.environ[file_env]) if os.environ.get(file_env) else None)
    if path is not None:
        try:
            token = path.read_text().strip()
        except OSError as e:
            raise TokenError(f"cannot read the API token file {path}: {e.strerror}") from None
        if not token:
            raise TokenError(f"the API token file {path} is empty")
        return token
    token = os.environ.get(env, "").strip()
    return token or None


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error_code": status, "message": message}, status, headers=headers)


def _conveyor_version() -> str:
    try:
        return version("conveyor")
    except PackageNotFoundError:
        return "unknown"


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequestError("the request has no body; expected JSON")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None


@dataclass(frozen=True)
class ApiContext:
    """What every route shares, kept on ``app.state.api``: where operations come from and
    what ``api_guard`` checks."""

    ops_factory: Callable[[], Operations]
    access: Access

    @staticmethod
    def of(request: Request) -> ApiContext:
        """The context of the app serving ``request``."""
        context: ApiContext = request.app.state.api
        return context

    def ops(self) -> Operations:
        """Fresh operations for one request (cheap, stateless)."""
        return self.ops_factory()


def _ops(request: Request) -> Operations:
    """The operations for ``request``."""
    return ApiContext.of(request).ops()


async def root(request: Request) -> Response:
    return JSONResponse({"version": _conveyor_version(), "commit": None, "kafka_cluster_id": None})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "healthy", "message": "the REST API is up and serving requests"})


def ready(request: Request) -> Response:
    """Ready or not for anyone (a probe); what is wrong only for a token's holder."""
    context = ApiContext.of(request)
    checks: dict[str, str] = {}
    o = context.ops()
    try:
        o.store.schema_version()
        checks["meta_store"] = "ok"
    except Exception as e:  # noqa: BLE001 - reported in the answer
        checks["meta_store"] = mask_url_passwords(f"unavailable: {type(e).__name__}: {e}")
    checks["connectors_dir"] = "ok" if o.directory.is_dir() else f"{o.directory} is not a directory"
    ok = all(v == "ok" for v in checks.values())
    body: dict[str, Any] = {"status": "ready" if ok else "not ready"}
    if request.state.access is not None and context.access.token is not None:
        body["checks"] = checks
    return JSONResponse(body, 200 if ok else 503)


def metrics(request: Request) -> Response:
    from prometheus_client import CollectorRegistry, generate_latest

    from conveyor.control.metrics import StoreCollector

    registry = CollectorRegistry()
    registry.register(StoreCollector(_ops(request).store))  # type: ignore[arg-type]
    return PlainTextResponse(
        generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


def list_connectors(request: Request) -> Response:
    o = _ops(request)
    expand = set(request.query_params.getlist("expand"))
    unknown = expand - {"status", "info"}
    if unknown:
        raise InvalidRequestError(f"expand: unknown value(s) {sorted(unknown)}; use status, info")
    if not expand:
        return JSONResponse(o.names())
    out: dict[str, Any] = {}
    for r in o.rows():
        item: dict[str, Any] = {}
        if "status" in expand:
            from conveyor.control.operations import status_of

            item["status"] = status_of(r)
        if "info" in expand:
            item["info"] = o.info(r.name)
        out[r.name] = item
    return JSONResponse(out)


async def create_connector(request: Request) -> Response:
    context = ApiContext.of(request)
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise InvalidRequestError('expected {"name": ..., "config": {...}}')
    name, config = body.get("name"), body.get("config")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("name: missing; expected the connector's name")
    if config is None:
        raise InvalidRequestError("config: missing; expected the connector spec as an object")
    info, _ = await _threaded(lambda: context.ops().put_config(name, config, create_only=True))
    return JSONResponse(info, 201)


def get_info(request: Request) -> Response:
    return JSONResponse(_ops(request).info(request.path_params["name"]))


def get_config(request: Request) -> Response:
    return JSONResponse(_ops(request).config(request.path_params["name"]))


async def put_config(request: Request) -> Response:
    context = ApiContext.of(request)
    body = await _json_body(request)
    name = request.path_params["name"]

    def put() -> tuple[dict[str, Any], bool]:
        o = context.ops()
        return o.put_config(name, keep_stored(body, _current(o, name)))

    info, created = await _threaded(put)
    return JSONResponse(info, 201 if created else 200)


def get_status(request: Request) -> Response:
    return JSONResponse(_ops(request).status(request.path_params["name"]))


def get_tasks(request: Request) -> Response:
    name = request.path_params["name"]
    o = _ops(request)
    return JSONResponse([{"id": {"connector": name, "task": 0}, "config": o.config(name)}])


def get_task_status(request: Request) -> Response:
    name = request.path_params["name"]
    tasks = _ops(request).status(name)["tasks"]
    if not tasks:
        raise NotFoundError(f"connector {name!r} has no task running")
    for task in tasks:  # one task (0) per run, or the connector's partition tasks
        if task["id"] == request.path_params["task"]:
            return JSONResponse(task)
    raise NotFoundError(f"connector {name!r} has task(s) {', '.join(str(t['id']) for t in tasks)}")


def pause(request: Request) -> Response:
    _ops(request).pause(request.path_params["name"])
    return Response(status_code=202)


def resume(request: Request) -> Response:
    _ops(request).resume(request.path_params["name"])
    return Response(status_code=202)


def stop(request: Request) -> Response:
    _ops(request).stop(request.path_params["name"])
    return Response(status_code=204)


def restart(request: Request) -> Response:
    """Kafka Connect's (KIP-745): without parameters 204; with ``includeTasks`` or
    ``onlyFailed`` 202 and the status, the restarted instances RESTARTING."""
    name = request.path_params["name"]
    include_tasks = _bool_param(request, "includeTasks")
    only_failed = _bool_param(request, "onlyFailed")
    o = _ops(request)
    if not include_tasks and not only_failed:
        o.restart(name)
        return Response(status_code=204)
    status = o.status(name)
    if not restart_plan(status, include_tasks, only_failed):
        return JSONResponse(status, status_code=202)
    o.restart(name)
    return JSONResponse(restarting(status), status_code=202)


def restart_task(request: Request) -> Response:
    _ops(request).restart(request.path_params["name"])
    return Response(status_code=204)


def topics(request: Request) -> Response:
    return JSONResponse(active_topics(_ops(request), request.path_params["name"]))


def reset_topics(request: Request) -> Response:
    reset_active_topics(_ops(request), request.path_params["name"])
    return Response(status_code=202)


async def validate_config(request: Request) -> Response:
    context = ApiContext.of(request)
    body = await _json_body(request)
    plugin = request.path_params["plugin"]
    return JSONResponse(await _threaded(lambda: validate(context.ops(), plugin, body)))


def delete(request: Request) -> Response:
    """204; 200 with what stays in the source's system (a slot) when something does, or
    when ``?drop_slot=true`` dropped it (the CLI's ``--drop-slot``)."""
    name = request.path_params["name"]
    flag = request.query_params.get("drop_slot", "false").lower()
    if flag not in ("true", "false"):
        raise InvalidRequestError(f"drop_slot must be true or false, got {flag!r}")
    kept = _ops(request).delete(name, drop_slot=flag == "true")
    if flag == "false" and not kept:
        return Response(status_code=204)
    return JSONResponse(
        {"name": name, "deleted": True, "slot_dropped": flag == "true", "remains": kept}
    )


def get_offsets(request: Request) -> Response:
    return JSONResponse(_ops(request).offsets(request.path_params["name"]))


async def patch_offsets(request: Request) -> Response:
    context = ApiContext.of(request)
    body = await _json_body(request)
    name = request.path_params["name"]
    return JSONResponse(await _threaded(lambda: context.ops().alter_offsets(name, body)))


def delete_offsets(request: Request) -> Response:
    return JSONResponse(_ops(request).reset_offsets(request.path_params["name"]))


def history(request: Request) -> Response:
    limit = _int_param(request, "limit", 30)
    return JSONResponse(_ops(request).history(request.path_params["name"], limit))


def dead_letters(request: Request) -> Response:
    limit = _int_param(request, "limit", 20)
    return JSONResponse(_ops(request).dead_letters(request.path_params["name"], limit))


def destination(request: Request) -> Response:
    return JSONResponse(_ops(request).destination(request.path_params["name"]))


def destinations(request: Request) -> Response:
    return JSONResponse(_ops(request).destinations(request.path_params["name"]))


def partition_tasks(request: Request) -> Response:
    return JSONResponse(_ops(request).tasks(request.path_params["name"]))


def abandon_batch(request: Request) -> Response:
    return JSONResponse(_ops(request).abandon_batch(request.path_params["name"]), status_code=202)


def reset_source_state(request: Request) -> Response:
    return JSONResponse(_ops(request).reset_source_state(request.path_params["name"]))


async def request_backfill(request: Request) -> Response:
    """202 with the request: the backfills sensor launches its run."""
    context = ApiContext.of(request)
    start, end = backfill_body(await _json_body(request))
    name = request.path_params["name"]
    made = await _threaded(lambda: Backfills.of(context.ops()).request(name, start, end))
    return JSONResponse(made, 202)


def list_backfills(request: Request) -> Response:
    limit = _int_param(request, "limit", 50)
    return JSONResponse(Backfills.of(_ops(request)).list(request.path_params["name"], limit))


def get_backfill(request: Request) -> Response:
    name, backfill_id = request.path_params["name"], request.path_params["backfill_id"]
    return JSONResponse(Backfills.of(_ops(request)).get(name, backfill_id))


def plugins(request: Request) -> Response:
    from conveyor.sinks import sink_types
    from conveyor.sources import source_types

    version = _conveyor_version()
    return JSONResponse(
        [{"class": t, "type": "sink", "version": version} for t in sink_types()]
        + [{"class": t, "type": "source", "version": version} for t in source_types()]
    )


def routes() -> list[Route]:
    """The route table: every path and method the API answers, and its handler."""
    c = "/connectors/{name}"
    return [
        Route("/", root),
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/connector-plugins", plugins),
        Route("/connector-plugins/{plugin}/config/validate", validate_config, methods=["PUT"]),
        Route("/connectors", list_connectors, methods=["GET"]),
        Route("/connectors", create_connector, methods=["POST"]),
        Route(c, get_info, methods=["GET"]),
        Route(c, delete, methods=["DELETE"]),
        Route(f"{c}/config", get_config, methods=["GET"]),
        Route(f"{c}/config", put_config, methods=["PUT"]),
        Route(f"{c}/status", get_status, methods=["GET"]),
        Route(f"{c}/tasks", get_tasks, methods=["GET"]),
        Route(f"{c}/tasks/{{task:int}}/status", get_task_status, methods=["GET"]),
        Route(f"{c}/pause", pause, methods=["PUT"]),
        Route(f"{c}/resume", resume, methods=["PUT"]),
        Route(f"{c}/stop", stop, methods=["PUT"]),
        Route(f"{c}/restart", restart, methods=["POST"]),
        Route(f"{c}/tasks/{{task:int}}/restart", restart_task, methods=["POST"]),
        Route(f"{c}/topics", topics, methods=["GET"]),
        Route(f"{c}/topics/reset", reset_topics, methods=["PUT"]),
        Route(f"{c}/offsets", get_offsets, methods=["GET"]),
        Route(f"{c}/offsets", patch_offsets, methods=["PATCH"]),
        Route(f"{c}/offsets", delete_offsets, methods=["DELETE"]),
        Route(f"{c}/history", history, methods=["GET"]),
        Route(f"{c}/dead-letters", dead_letters, methods=["GET"]),
        Route(f"{c}/destination", destination, methods=["GET"]),
        Route(f"{c}/destinations", destinations, methods=["GET"]),
        Route(f"{c}/partition-tasks", partition_tasks, methods=["GET"]),
        Route(f"{c}/abandon-batch", abandon_batch, methods=["POST"]),
        Route(f"{c}/source-state", reset_source_state, methods=["DELETE"]),
        Route(f"{c}/backfills", request_backfill, methods=["POST"]),
        Route(f"{c}/backfills", list_backfills, methods=["GET"]),
        Route(f"{c}/backfills/{{backfill_id:int}}", get_backfill, methods=["GET"]),
    ]


def exception_handlers() -> dict[Any, Callable[..., Any]]:
    """Each error the routes raise, as its JSON answer and HTTP status."""
    return {
        HTTPException: _http_error,
        NotFoundError: lambda r, e: error(404, str(e)),
        ConflictError: lambda r, e: error(409, str(e)),
        InvalidRequestError: lambda r, e: error(400, str(e)),
        ConfigError: lambda r, e: error(400, f"invalid connector config: {e}"),
        BodyTooLargeError: lambda r, e: error(413, str(e)),
        StoreError: lambda r, e: error(503, str(e)),
        TransientSinkError: lambda r, e: error(
            503, f"the sink's target did not answer ({e}); nothing was moved: try again"
        ),
        ConveyorError: lambda r, e: error(500, f"{type(e).__name__}: {e}"),
        Exception: _unexpected,
    }


def create_app(
    ops_factory: Callable[[], Operations], token: str | None, *, access: Access | None = None
) -> Starlette:
    """The API over the operations ``ops_factory()`` gives (one per request: cheap, stateless).

    ``access`` (default: ``token`` alone, loopback hosts) is what ``api_guard`` checks.
    """
    context = ApiContext(ops_factory, access or Access(token))
    app = Starlette(
        routes=routes(),
        middleware=[Middleware(Guard, access=context.access)],
        exception_handlers=exception_handlers(),
    )
    app.state.api = context
    return app


def _current(o: Operations, name: str) -> LoadedSpec | None:
    """The connector's spec as its file says now, or None for a new connector."""
    try:
        row = o.row(name)
    except NotFoundError:
        return None
    return load_source(name, row.spec_source)


async def _threaded(fn: Callable[[], Any]) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn)


def _int_param(request: Request, name: str, default: int, maximum: int = MAX_LIMIT) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequestError(f"{name}: {raw[:40]!r} is not a number") from None
    if not 1 <= value <= maximum:
        raise InvalidRequestError(f"{name}: must be between 1 and {maximum}")
    return value


def _bool_param(request: Request, name: str) -> bool:
    raw = request.query_params.get(name)
    if raw is None or raw.lower() == "false":
        return False
    if raw.lower() == "true":
        return True
    raise InvalidRequestError(f"{name}: {raw[:40]!r} is not true or false")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no such resource: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error(exc.status_code, message, dict(exc.headers or {}))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("%s %s failed", request.method, request.url.path)
    return error(500, f"internal error: {type(exc).__name__} (see the server log)")


def serve(
    ops_factory: Callable[[], Operations],
    *,
    host: str,
    port: int,
    token: str | None,
    log_level: str = "info",
    access: Access | None = None,
) -> None:
    """Run the API with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(
        create_app(ops_factory, token, access=access),
        host=host,
        port=port,
        log_level=log_level,
        access_log=True,
        server_header=False,
    )
