"""The GreptimeDB sink's line protocol against a real InfluxDB 1.6 server (Debian's
``influxdb`` package): escaping, precision and types as a real parser of the protocol sees
them, with the contract suite and the hostile corpus.

InfluxDB 1.6 serves ``/write`` and ``/ping``; GreptimeDB serves the same protocol at
``/v1/influxdb/api/v2/write`` and ``/health``. A small path-mapping proxy in the fixture
is the only difference. Skipped (with the reason) when ``influxd`` is not installed
(.ci/run installs it).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from conveyor.core.host.ports import free_port
from tests.sinks.contract import SinkContract, closed_port, make_batch, unique

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("influxd") is None,
        reason="influxd not installed (apt-get install -y influxdb; .ci/run does it)",
    ),
]

DATABASE = "conveyor"

CONFIG = """\
reporting-disabled = true
bind-address = "127.0.0.1:{rpc}"
[meta]
  dir = "{d}/meta"
[data]
  dir = "{d}/data"
  wal-dir = "{d}/wal"
[http]
  bind-address = "127.0.0.1:{http}"
  log-enabled = false
[monitor]
  store-enabled = false
"""


def _proxy(influx: str) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def _forward(self, method: str) -> None:
            parts = urlsplit(self.path)
            path = {"/v1/influxdb/api/v2/write": "/write", "/health": "/ping"}.get(
                parts.path, parts.path
            )
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            query = parts.query
            if path == "/v1/sql":  # the sink's check that the database exists
                method, path, query, body = (
                    "GET",
                    "/query",
                    f"db={DATABASE}&q=SHOW+MEASUREMENTS",
                    b"",
                )
            r = requests.request(method, f"{influx}{path}?{query}", data=body or None, timeout=30)
            self.send_response(200 if path == "/ping" else r.status_code)
            self.send_header("Content-Type", r.headers.get("Content-Type", "text/plain"))
            self.send_header("Content-Length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._forward("GET")

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self._forward("POST")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def influx_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="conveyor-influx-") as d:
        http, rpc = free_port(), free_port()
        conf = Path(d) / "influxdb.conf"
        conf.write_text(CONFIG.format(d=d, http=http, rpc=rpc))
        proc = subprocess.Popen(
            ["influxd", "-config", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        influx = f"http://127.0.0.1:{http}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if requests.get(f"{influx}/ping", timeout=1).status_code == 204:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("influxd did not start within 30 s")
                time.sleep(0.2)
            requests.post(f"{influx}/query", data={"q": f"CREATE DATABASE {DATABASE}"}, timeout=10)
            server, url = _proxy(influx)
            try:
                yield url
            finally:
                server.shutdown()
        finally:
            proc.terminate()
            proc.wait(timeout=30)


class TestGreptimeDBOnInfluxDBContract(SinkContract):
    """Line protocol; a replay rewrites the same (tags, timestamp) points: no duplicates."""

    sink_type = "greptimedb"
    idempotent = True
    keeps_keys = True  # as the tag msg_key
    poison_skip_reason = ""

    @pytest.fixture(autouse=True)
    def _url(self, influx_url: str) -> None:
        self.url = influx_url

    def make_target(self) -> Iterator[str]:
        yield unique("orders")

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "greptimedb",
            "url": self.url,
            "database": DATABASE,
            "measurement": target,
            "tags": {"topic": "$topic", "msg_key": "$key"},
            "precision": "ms",
            "timeout_s": 10,
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        r = requests.get(
            f"{self.url}/query",
            params={"db": DATABASE, "q": f'SELECT "id", "name", "msg_key" FROM "{target}"'},
            timeout=30,
        )
        r.raise_for_status()
        series = r.json()["results"][0].get("series") or []
        rows = series[0]["values"] if series else []
        return [
            {"id": int(i), "name": n, "key": k.encode() if k is not None else None}
            for _, i, n, k in rows
        ]

    bad_fields = [({"precision": "minutes"}, "precision")]

    def outage_config(self, target: str) -> dict[str, Any]:
        return {**self.config(target), "url": f"http://127.0.0.1:{closed_port()}", "timeout_s": 2}

    def poison_batch(self, target: str):
        # A line break in a string field cannot be written (newlines: reject): rows 250, 400.
        return make_batch(500, names={250: "a\nb", 400: "c\nd"}), {250, 400}
