"""``conveyor serve`` as a real server for the REST API's tests: a subprocess over a SQLite meta
store and a connectors directory, with its log in a file; stopped when the block ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from conveyor.core.host.ports import free_port, port_open
from conveyor.store.meta import MetaStore
from tests.e2e.conftest import wait_for

TOKEN = "t0ken-for-tests"
READONLY_TOKEN = "read-0nly-for-tests"


@dataclass
class Api:
    url: str
    home: Path
    connectors: Path
    store: MetaStore
    proc: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str]

    def call(self, method: str, path: str, *, token: str | None = TOKEN, **kw) -> requests.Response:
        headers = kw.pop("headers", {})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return requests.request(method, self.url + path, headers=headers, timeout=30, **kw)


def conveyor_exe() -> str:
    return str(Path(sys.executable).parent / "conveyor")


@contextlib.contextmanager
def served(
    home: Path, *args: str, extra_env: dict[str, str] | None = None, readonly: bool = True
) -> Iterator[Api]:
    """``conveyor serve`` with ``$CONVEYOR_HOME`` ``home`` (the admin token in ``home/token``, the
    read-only one in ``home/api-token-readonly``), ``args`` added to its command line."""
    connectors = home / "connectors"
    connectors.mkdir(parents=True, exist_ok=True)
    token_file = home / "token"
    token_file.write_text(TOKEN + "\n")
    if readonly:
        (home / "api-token-readonly").write_text(READONLY_TOKEN + "\n")
    meta_url = f"sqlite:///{home / 'meta.db'}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")},
        "CONVEYOR_HOME": str(home),
        "CONVEYOR_META_URL": meta_url,
        "CONVEYOR_CONNECTORS_DIR": str(connectors),
        **(extra_env or {}),
    }
    port = free_port()
    log = home / "api.log"
    command = [conveyor_exe(), "serve", "--port", str(port), *args]
    if "--no-auth" not in args:
        command += ["--token-file", str(token_file)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for(lambda: port_open("127.0.0.1", port) or proc.poll() is not None, 60, "the API")
        assert proc.poll() is None, log.read_text()
        yield Api(f"http://127.0.0.1:{port}", home, connectors, MetaStore(meta_url), proc, log, env)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
