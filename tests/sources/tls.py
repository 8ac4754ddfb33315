"""A TLS terminator (Debian's socat) in front of a tansu broker, with a CA the test makes.

tansu advertises the terminator's port, so every client connection (bootstrap and
the brokers from the metadata) goes through TLS. The certificates come from the
``openssl`` command: a CA, a server certificate for 127.0.0.1 (IP SAN only, so a
client that connects to ``localhost`` fails the host name check), and a second,
unrelated CA for the wrong-CA case.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from conveyor.brokers.embedded import tansu_binary
from conveyor.ports import free_port, port_open


@dataclass(frozen=True)
class Certificates:
    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate signed by it (SAN IP:127.0.0.1) and an unrelated CA."""
    d = directory
    for name in ("ca", "other_ca"):
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN=conveyor test {name}",
            "-keyout", f"{name}.key", "-out", f"{name}.pem",
            cwd=d,
        )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr",
        cwd=d,
    )  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.pem",
        cwd=d,
    )  # fmt: skip
    return Certificates(d / "ca.pem", d / "other_ca.pem", d / "server.pem", d / "server.key")


@dataclass(frozen=True)
class TlsBroker:
    bootstrap: str  # 127.0.0.1:<TLS port>
    port: int
    certs: Certificates


def socat_available() -> bool:
    return shutil.which("socat") is not None and shutil.which("openssl") is not None


@contextmanager
def tls_tansu(directory: Path) -> Iterator[TlsBroker]:
    """tansu on a hidden plaintext port, socat terminating TLS on the advertised one."""
    certs = make_certificates(directory)
    plain, tls = free_port(), free_port()
    log = open(directory / "tansu.log", "wb")  # noqa: SIM115 - closed below
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    tansu_binary(), "broker",
                    "--listener-url", f"tcp://127.0.0.1:{plain}",
                    "--advertised-listener-url", f"tcp://127.0.0.1:{tls}",
                    "--storage-engine", "memory://tansu/",
                ],
                stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "RUST_LOG": "warn"}, start_new_session=True,
            )
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [
                    "socat",
                    f"OPENSSL-LISTEN:{tls},bind=127.0.0.1,reuseaddr,fork,"
                    f"cert={certs.server_cert},key={certs.server_key},verify=0",
                    f"TCP:127.0.0.1:{plain}",
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not (port_open("127.0.0.1", plain) and port_open("127.0.0.1", tls)):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(
                    f"tansu or socat did not start: {(directory / 'tansu.log').read_text()[-2000:]}"
                )
            time.sleep(0.05)
        yield TlsBroker(f"127.0.0.1:{tls}", tls, certs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        log.close()
