"""A private PostgreSQL cluster with ``wal_level=logical`` on a free port (CDC tests).

The machine's PostgreSQL runs with ``wal_level=replica``; logical decoding needs its
own cluster: Debian's ``initdb`` and ``pg_ctl`` (as the ``postgres`` user when the
tests run as root, which initdb refuses), trust authentication on loopback only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from conveyor.ports import free_port

PG_BIN = Path(os.environ.get("CONVEYOR_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _as_postgres(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


@contextlib.contextmanager
def private_cluster() -> Iterator[str]:
    """Yields the URL of a fresh cluster's ``postgres`` database; stops and removes it after."""
    if not (PG_BIN / "initdb").exists():
        raise RuntimeError(f"no initdb under {PG_BIN} (set CONVEYOR_TEST_PG_BIN)")
    base = Path(tempfile.mkdtemp(prefix="conveyor-pg-"))
    data = base / "data"
    port = free_port()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
    base.chmod(0o700)
    try:
        subprocess.run(
            _as_postgres(
                [
                    str(PG_BIN / "initdb"),
                    "-D",
                    str(data),
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "--no-sync",
                ]
            ),
            check=True,
            capture_output=True,
            timeout=120,
        )
        opts = (
            f"-c port={port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={base} "
            "-c wal_level=logical -c max_replication_slots=8 -c max_wal_senders=8 -c fsync=off"
        )
        subprocess.run(
            _as_postgres(
                [
                    str(PG_BIN / "pg_ctl"),
                    "-D",
                    str(data),
                    "-o",
                    opts,
                    "-l",
                    str(base / "log"),
                    "-w",
                    "start",
                ]
            ),
            check=True,
            capture_output=True,
            timeout=120,
        )
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        _wait_ready(url)
        yield url
    finally:
        subprocess.run(
            _as_postgres(
                [str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]
            ),
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(base, ignore_errors=True)


def _wait_ready(url: str, timeout: float = 30.0) -> None:
    import psycopg2

    deadline = time.monotonic() + timeout
    while True:
        try:
            psycopg2.connect(url, connect_timeout=2).close()
            return
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
