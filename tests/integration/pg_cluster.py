"""A private PostgreSQL cluster with ``wal_level=logical`` on a free port (CDC tests; the
exactly-once chaos test crash-restarts one).

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
from dataclasses import dataclass
from pathlib import Path

from conveyor.core.host.ports import free_port

PG_BIN = Path(os.environ.get("CONVEYOR_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _as_postgres(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


@dataclass
class PrivateCluster:
    """A running private cluster: its URL, and a crash-restart of its server."""

    url: str
    base: Path
    data: Path
    opts: str

    def start(self) -> None:
        subprocess.run(
            _as_postgres(
                [
                    str(PG_BIN / "pg_ctl"),
                    "-D",
                    str(self.data),
                    "-o",
                    self.opts,
                    "-l",
                    str(self.base / "log"),
                    "-w",
                    "start",
                ]
            ),
            check=True,
            capture_output=True,
            timeout=120,
        )
        _wait_ready(self.url)

    def stop(self, mode: str = "immediate") -> None:
        """``pg_ctl stop -m immediate``: the postmaster and its backends quit at once, open
        transactions are lost and the next start runs crash recovery."""
        subprocess.run(
            _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"]),
            capture_output=True,
            timeout=60,
        )

    def crash_restart(self) -> None:
        """A crash (``-m immediate``) and a start on the same port and data directory."""
        self.stop("immediate")
        self.start()


@contextlib.contextmanager
def private_cluster(next_xid: int | None = None) -> Iterator[str]:
    """Yields the URL of a fresh cluster's ``postgres`` database; stops and removes it after.

    ``next_xid``: the cluster starts with this next transaction id (``pg_resetwal -x``, its
    ``pg_xact`` segment created), e.g. just below 2^32 to test xid wraparound.
    """
    with private_server(next_xid) as cluster:
        yield cluster.url


@contextlib.contextmanager
def private_server(next_xid: int | None = None) -> Iterator[PrivateCluster]:
    """``private_cluster``'s cluster as a handle that can also crash-restart it."""
    if not (PG_BIN / "initdb").exists():
        raise RuntimeError(f"no initdb under {PG_BIN} (set CONVEYOR_TEST_PG_BIN)")
    base = Path(tempfile.mkdtemp(prefix="conveyor-pg-"))
    data = base / "data"
    port = free_port()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
    base.chmod(0o700)
    opts = (
        f"-c port={port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={base} "
        "-c wal_level=logical -c max_replication_slots=8 -c max_wal_senders=8 -c fsync=off"
    )
    cluster = PrivateCluster(f"postgresql://postgres@127.0.0.1:{port}/postgres", base, data, opts)
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
        if next_xid is not None:
            _set_next_xid(data, next_xid)
        cluster.start()
        yield cluster
    finally:
        cluster.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)


def _set_next_xid(data: Path, xid: int) -> None:
    """pg_resetwal -x on a stopped cluster, with the zeroed pg_xact segment holding ``xid``
    (1,048,576 xids per 256 KiB segment, as pg_resetwal's documentation says). initdb's own
    rows are frozen first (single-user VACUUM FREEZE): unfrozen, their xids would read as
    the future from there and the ``postgres`` database would not be visible."""
    for db in ("postgres", "template1"):
        subprocess.run(
            _as_postgres([str(PG_BIN / "postgres"), "--single", "-D", str(data), db]),
            input=b"VACUUM FREEZE;\n",
            check=True,
            capture_output=True,
            timeout=120,
        )
    segment = data / "pg_xact" / f"{xid // 1_048_576:04X}"
    if not segment.exists():
        segment.write_bytes(bytes(262_144))
        if os.geteuid() == 0:
            shutil.chown(segment, "postgres", "postgres")
    subprocess.run(
        _as_postgres([str(PG_BIN / "pg_resetwal"), "-x", str(xid), "-D", str(data)]),
        check=True,
        capture_output=True,
        timeout=60,
    )


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
