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
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from conveyor.brokers.embedded import tansu_binary
from conveyor.core.host.ports import free_port


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


def kafka_answers_over_tls(port: int, ca: Path, timeout: float = 2.0) -> bool:
    """A Kafka ApiVersions request over TLS, verified with our CA, gets its answer: the port
    is our socat (no other listener holds our CA's certificate) and tansu is behind it."""
    ctx = ssl.create_default_context(cafile=str(ca))
    request = struct.pack(">hhih", 18, 0, 4242, -1)  # ApiVersions v0, correlation id, no client id
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw,
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            tls.sendall(struct.pack(">i", len(request)) + request)
            head = b""
            while len(head) < 8:
                chunk = tls.recv(8 - len(head))
                if not chunk:
                    return False
                head += chunk
            return struct.unpack(">ii", head)[1] == 4242
    except (OSError, ssl.SSLError):
        return False


@contextmanager
def tls_tansu(directory: Path, attempts: int = 3) -> Iterator[TlsBroker]:
    """tansu on a hidden plaintext port, socat terminating TLS on the advertised one.

    Ready means a Kafka request over TLS with our CA is answered (not merely that the ports
    accept connections: a port picked free can be taken by another process before socat or
    tansu binds it, which then exits while the other process answers connections). A start
    whose process died is tried again on other ports."""
    certs = make_certificates(directory)
    for attempt in range(1, attempts + 1):
        procs = _start_tls_tansu(directory, certs)
        try:
            deadline, ready = time.monotonic() + 30, False
            while not ready and time.monotonic() < deadline:
                if any(p.poll() is not None for p in procs):
                    break  # a port was taken: try others
                ready = kafka_answers_over_tls(procs.tls_port, certs.ca)
                if not ready:
                    time.sleep(0.1)
            if ready and all(p.poll() is None for p in procs):
                yield TlsBroker(f"127.0.0.1:{procs.tls_port}", procs.tls_port, certs)
                return
            if attempt == attempts:
                raise RuntimeError(
                    f"tansu or socat did not start: {(directory / 'tansu.log').read_text()[-2000:]}"
                )
        finally:
            procs.stop()


class _Procs(list):  # type: ignore[type-arg]
    tls_port: int
    log: IO[bytes]

    def stop(self) -> None:
        for p in self:
            p.terminate()
        for p in self:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.log.close()


def _start_tls_tansu(directory: Path, certs: Certificates) -> _Procs:
    plain, tls = free_port(), free_port()
    procs = _Procs()
    procs.tls_port = tls
    procs.log = open(directory / "tansu.log", "ab")  # noqa: SIM115 - closed by stop()
    procs.append(
        subprocess.Popen(
            [
                tansu_binary(), "broker",
                "--listener-url", f"tcp://127.0.0.1:{plain}",
                "--advertised-listener-url", f"tcp://127.0.0.1:{tls}",
                "--storage-engine", "memory://tansu/",
            ],
            stdout=procs.log, stderr=subprocess.STDOUT,
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
            stdout=procs.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    )  # fmt: skip
    return procs
