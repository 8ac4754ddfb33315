"""Private MariaDB and Redis servers on free ports of 127.0.0.1, each under a temporary
directory, that a test may crash (SIGKILL) and start again on the same port and data: the
machine's shared servers (3306, 6379) are never restarted. PostgreSQL's private cluster is
``tests/integration/pg_cluster.py``.

MariaDB: ``mariadb-install-db`` then ``mariadbd --no-defaults`` with the binary log off and
``innodb_flush_log_at_trx_commit=1``: a transaction committed survives the SIGKILL, one not
committed is rolled back by InnoDB's crash recovery on start. Redis: ``appendonly yes`` with
``appendfsync always`` and no RDB snapshots: what ``EXEC`` acknowledged is in the AOF, which
the next start replays (a ``MULTI`` cut off in the file is dropped).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from conveyor.core.host.ports import free_port

START_S = 60.0


class PrivateServer:
    """A server process on ``port`` with its files under ``base``: ``crash_restart()`` is
    SIGKILL and a start again with the same arguments."""

    name = "server"

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix=f"conveyor-{self.name}-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def command(self) -> list[str]:
        raise NotImplementedError

    def ping(self) -> None:
        """Returns once the server answers; raises while it does not."""
        raise NotImplementedError

    def start(self) -> None:
        self.starts += 1
        log = (self.base / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait(self.ping, self.proc, START_S, f"{self.name} on port {self.port}")

    def crash(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def crash_restart(self) -> None:
        self.crash()
        self.start()

    def log(self) -> str:
        path = self.base / f"{self.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        try:
            self.crash()
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


class PrivateMariaDB(PrivateServer):
    """A fresh MariaDB data directory (root without a password, database ``test``)."""

    name = "mariadb"

    def __init__(self) -> None:
        super().__init__()
        self.data = self.base / "data"
        self.url = f"mysql://root@127.0.0.1:{self.port}/test"

    def install(self) -> None:
        install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
        if install is None:
            raise RuntimeError("no mariadb-install-db / mysql_install_db on PATH")
        subprocess.run(
            [
                install,
                "--no-defaults",
                f"--datadir={self.data}",
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def command(self) -> list[str]:
        server = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
        return [
            server,
            "--no-defaults",
            f"--datadir={self.data}",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            f"--socket={self.base / 'sock'}",
            f"--pid-file={self.base / 'pid'}",
            "--user=root",
            "--skip-log-bin",
            "--innodb-flush-log-at-trx-commit=1",
            "--innodb-buffer-pool-size=64M",
        ]

    def connect(self, database: str | None = "test", **kw: Any) -> Any:
        import pymysql

        return pymysql.connect(
            host="127.0.0.1",
            port=self.port,
            user="root",
            password="",
            database=database,
            **{"autocommit": True, "connect_timeout": 5, **kw},
        )

    def ping(self) -> None:
        self.connect(database=None).close()


class PrivateRedis(PrivateServer):
    """A Redis server whose every acknowledged write is in its fsync'd append-only file."""

    name = "redis"

    def command(self) -> list[str]:
        return [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.base),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ]

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30)

    def ping(self) -> None:
        self.client().ping()


@contextlib.contextmanager
def private_mariadb() -> Iterator[PrivateMariaDB]:
    """A started private MariaDB with a database ``test``; killed and removed after."""
    server = PrivateMariaDB()
    try:
        server.install()
        server.start()
        conn = server.connect(database=None)
        try:
            with conn.cursor() as cur:
                cur.execute("CREATE DATABASE IF NOT EXISTS test")
        finally:
            conn.close()
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def private_redis() -> Iterator[PrivateRedis]:
    """A started private Redis (AOF, fsync always); killed and removed after."""
    server = PrivateRedis()
    try:
        server.start()
        yield server
    finally:
        server.close()


def _wait(
    ping: Callable[[], None], proc: subprocess.Popen[bytes], timeout: float, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            ping()
            return
        except Exception:  # noqa: BLE001 - not accepting connections yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
