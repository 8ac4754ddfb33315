"""Apache Kafka 3.8 for tests (``../shared/kafka``: KRaft, one node, the log on disk, SASL/SCRAM).

``ApacheKafka`` starts the broker on free loopback ports in a directory of the test's, restarts
it with its log kept, and stops it (in the fixture's cleanup, also when the test fails). Where
the broker's files are missing the fixture skips with that reason; CI sets
``CONVEYOR_REQUIRE_APACHE_KAFKA=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conveyor.core.host.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
KAFKA = ROOT.parent / "shared" / "kafka" / "kafka"
USER, PASSWORD = "conveyor", "conveyor-secret"
#: The environment variable the connectors' specs refer to for the SASL password.
PASSWORD_ENV = "CONVEYOR_E2E_KAFKA_PASSWORD"


def require_apache_kafka() -> None:
    """Skip (or fail, under ``CONVEYOR_REQUIRE_APACHE_KAFKA=1``) without the broker's files."""
    if KAFKA.exists():
        return
    reason = f"Apache Kafka is not at {KAFKA} (../shared/kafka beside the checkout)"
    if os.environ.get("CONVEYOR_REQUIRE_APACHE_KAFKA") == "1":
        pytest.fail(reason + "; CI requires it (CONVEYOR_REQUIRE_APACHE_KAFKA=1)")
    pytest.skip(reason)


@dataclass
class ApacheKafka:
    directory: Path
    port: int = field(default_factory=free_port)
    pid: int | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client_config(self) -> dict[str, Any]:
        """librdkafka settings of the SCRAM user."""
        return {
            "bootstrap.servers": self.bootstrap,
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": USER,
            "sasl.password": PASSWORD,
        }

    def source_spec(self, topic: str) -> dict[str, Any]:
        """A connector's ``source`` on this broker (the password by reference)."""
        return {
            "topics": [topic],
            "bootstrap_servers": self.bootstrap,
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": USER,
            "sasl_password": f"${{env:{PASSWORD_ENV}}}",
        }

    def start(self) -> None:
        env = {
            **os.environ,
            "PYTHON": sys.executable,
            "KAFKA_CONTROLLER_PORT": str(free_port()),
        }
        r = subprocess.run(
            [str(KAFKA), "start", str(self.directory), str(self.port), "sasl"],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
        )
        if r.returncode != 0:
            log = self.directory / "server.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"kafka start failed: {r.stdout}{r.stderr}\n{tail}")
        self.pid = int(r.stdout.strip().splitlines()[-1])
        self.wait_ready()

    def stop(self) -> None:
        subprocess.run(
            [str(KAFKA), "stop", str(self.directory)], capture_output=True, text=True, timeout=120
        )
        self.pid = None

    def restart(self) -> None:
        """Stopped (SIGTERM, a clean shutdown) and started again on the same log and port."""
        self.stop()
        self.start()

    def wait_ready(self, timeout: float = 60.0) -> None:
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                AdminClient(self.client_config()).list_topics(timeout=5)
                return
            except Exception as e:  # noqa: BLE001 - not up yet
                last = e
                time.sleep(0.5)
        raise RuntimeError(f"Apache Kafka at {self.bootstrap} not ready: {last}")
