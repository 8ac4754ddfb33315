"""The REST API is browser-safe even with ``--no-auth`` (issue 34, point 4).

A real ``conveyor serve --no-auth`` on loopback gets the requests a browser sends for a page
of another site: a ``fetch(url, {method: "POST", mode: "no-cors", body})`` (``Origin`` of
the page, ``Content-Type: text/plain``, ``Sec-Fetch-Site: cross-site``), the same from an
older browser (``Origin`` only), a sandboxed page (``Origin: null``), and a DNS-rebinding
page (its own name in ``Host``). None creates a connector; the API's own origin, curl-like
clients and the allowed names work. Bodies and ``?limit=`` are bounded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from conveyor.control.api import create_app
from conveyor.control.api_guard import Access
from conveyor.control.operations import Operations
from conveyor.store.meta import MetaStore
from tests.integration.api_server import Api, served


def spec(name: str) -> dict:
    return {
        "name": name,
        "config": {
            "source": {"topics": ["orders"]},
            "sink": {"type": "localfile", "path": "conveyor-browser-test"},
        },
    }


@pytest.fixture(scope="module")
def open_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with served(tmp_path_factory.mktemp("browser_home"), "--no-auth", readonly=False) as a:
        yield a


def nothing_created(api: Api) -> bool:
    return list(api.connectors.iterdir()) == [] and api.store.list() == []


def test_a_cross_site_no_cors_fetch_cannot_create_a_connector(open_api: Api) -> None:
    body = json.dumps(spec("evil")).encode()
    page = "http://evil.example"
    attempts = [
        {  # fetch(..., {mode: "no-cors"}) from a page of another site, today's browsers
            "Origin": page,
            "Content-Type": "text/plain;charset=UTF-8",
            "Sec-Fetch-Mode": "no-cors",
            "Sec-Fetch-Site": "cross-site",
            "Sec-Fetch-Dest": "empty",
        },
        {"Origin": page, "Content-Type": "text/plain;charset=UTF-8"},  # no Sec-Fetch-*
        {"Origin": page, "Content-Type": "application/json"},  # a CORS request
        {"Origin": "null", "Content-Type": "text/plain"},  # a sandboxed iframe, a file: page
        {"Origin": f"http://localhost:{open_api.url.rsplit(':', 1)[1]}0"},  # another port
        {"Sec-Fetch-Site": "same-site", "Content-Type": "application/json"},  # no Origin
    ]
    for headers in attempts:
        for method, path in (("POST", "/connectors"), ("PUT", "/connectors/evil/config")):
            data = body if path == "/connectors" else json.dumps(spec("evil")["config"]).encode()
            r = open_api.call(method, path, token=None, data=data, headers=dict(headers))
            assert r.status_code == 403, (headers, r.text)
            assert "refused" in r.json()["message"]
    # A form post (the other no-cors way in): refused on its content type too.
    r = open_api.call(
        "POST",
        "/connectors",
        token=None,
        data={"name": "evil"},
        headers={"Origin": page},
    )
    assert r.status_code == 403
    assert nothing_created(open_api)


def test_the_apis_own_origin_and_non_browser_clients_work(open_api: Api) -> None:
    port = open_api.url.rsplit(":", 1)[1]
    r = open_api.call(
        "POST",
        "/connectors",
        token=None,
        json=spec("same_origin"),
        headers={"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"},
    )
    assert r.status_code == 201, r.text
    r = open_api.call("POST", "/connectors", token=None, json=spec("curl_like"))
    assert r.status_code == 201, r.text
    r = open_api.call("GET", "/connectors", token=None, headers={"Host": f"localhost:{port}"})
    assert r.status_code == 200 and sorted(r.json()) == ["curl_like", "same_origin"]
    for name in ("same_origin", "curl_like"):
        assert open_api.call("DELETE", f"/connectors/{name}", token=None).status_code == 204


def test_writes_need_a_json_content_type(open_api: Api) -> None:
    payload = json.dumps(spec("typed")).encode()
    for content_type in (
        None,
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ):
        headers = {"Content-Type": content_type} if content_type else {}
        r = open_api.call("POST", "/connectors", token=None, data=payload, headers=headers)
        assert r.status_code == 415, (content_type, r.text)
        assert "Content-Type: application/json" in r.json()["message"]
    r = open_api.call(
        "POST",
        "/connectors",
        token=None,
        data=payload,
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 201, r.text
    # A write without a body (pause, restart) needs no content type, as curl -X PUT sends it.
    assert open_api.call("PUT", "/connectors/typed/pause", token=None).status_code == 202
    assert open_api.call("PUT", "/connectors/typed/stop", token=None).status_code == 204
    assert open_api.call("DELETE", "/connectors/typed", token=None).status_code == 204


def test_a_dns_rebinding_host_is_refused_and_probes_say_only_ready(open_api: Api) -> None:
    port = open_api.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "[::2]"):
        r = open_api.call("GET", "/connectors", token=None, headers={"Host": host})
        assert r.status_code == 403 and "is not allowed" in r.json()["message"], host
        r = open_api.call("POST", "/connectors", token=None, json=spec("x"), headers={"Host": host})
        assert r.status_code == 403
    r = open_api.call("GET", "/ready", token=None, headers={"Host": "evil.example"})
    assert r.status_code == 200 and r.json() == {"status": "ready"}  # no details, ever here
    assert open_api.call("GET", "/health", token=None).status_code == 200
    assert nothing_created(open_api)


def test_bodies_and_limits_are_bounded(open_api: Api) -> None:
    big = b'{"name": "big", "config": {"x": "' + b"a" * (1 << 20) + b'"}}'
    r = open_api.call(
        "POST", "/connectors", token=None, data=big, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and "larger than 1048576 bytes" in r.json()["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"name": "big", "config": {"x": "'
        for _ in range(80):
            yield b"a" * 16384
        yield b'"}}'

    r = open_api.call(
        "POST",
        "/connectors",
        token=None,
        data=chunks(),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413, r.text
    assert open_api.call("GET", "/connectors/x/history?limit=100000", token=None).status_code == 400
    assert nothing_created(open_api)


def test_the_operator_widens_hosts_and_origins(tmp_path: Path) -> None:
    """``CONVEYOR_API_ALLOWED_HOSTS`` / ``_ORIGINS``: a UI served from another origin, a name."""
    access = Access.from_environ(
        "tok",
        environ={
            "CONVEYOR_API_ALLOWED_HOSTS": "connect.internal",
            "CONVEYOR_API_ALLOWED_ORIGINS": "https://ui.internal",
            "CONVEYOR_API_MAX_BODY_BYTES": "2048",
        },
    )
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    ops = Operations(store=store, directory=tmp_path / "connectors")
    client = TestClient(
        create_app(lambda: ops, "tok", access=access), base_url="http://connect.internal"
    )
    auth = {"Authorization": "Bearer tok"}
    assert client.get("/connectors", headers=auth).status_code == 200
    r = client.get("/connectors", headers={**auth, "Origin": "https://ui.internal"})
    assert r.status_code == 200
    r = client.get("/connectors", headers={**auth, "Origin": "https://other.internal"})
    assert r.status_code == 403
    r = client.get("/connectors", headers={**auth, "Host": "localhost"})  # no longer listed
    assert r.status_code == 403
    r = client.post("/connectors", headers=auth, content=b"{" + b" " * 4096 + b"}")
    assert r.status_code == 413
    default = Access.from_environ("tok", bind_host="10.1.2.3", environ={})
    assert default.allowed_hosts == {"localhost", "127.0.0.1", "::1", "10.1.2.3"}
    assert Access.from_environ("tok", bind_host="0.0.0.0", environ={}).allowed_hosts == {
        "localhost",
        "127.0.0.1",
        "::1",
    }
    store.close()
