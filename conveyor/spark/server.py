"""A local Spark Connect server, started with pyspark's bundled sbin script.

One server per broker executor on a single machine (`conveyor dev`, tests). In
production each broker's endpoint is a Spark Connect server in front of a cluster.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from conveyor.core.errors import ConveyorError
from conveyor.core.host.ports import free_port, port_open

#: The server JVM's collector. ParallelGC against the JVM's default (G1) on the connector's
#: transform, each from its own client, alternating rounds: 1.20x the rate at 0.80x the
#: JVM's CPU per row (docs/BENCHMARKS.md, "The Spark JVM's collector"); SerialGC was worse.
DRIVER_JAVA_OPTIONS = ("-XX:+UseParallelGC",)


class SparkServerError(ConveyorError):
    """The Spark Connect server could not be started."""


def spark_home() -> Path:
    env = os.environ.get("SPARK_HOME")
    if env and (Path(env) / "sbin" / "start-connect-server.sh").exists():
        return Path(env)
    import pyspark

    return Path(pyspark.__file__).parent


@dataclass
class SparkConnectServer:
    host: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def remote(self) -> str:
        return f"sc://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        stop_process_group(self.process, timeout)

    def __enter__(self) -> SparkConnectServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_process_group(process: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM a launcher script's process group, wait for all of it, SIGKILL what is left.

    Spark's scripts run the JVM in the script's process group, and the script may exit
    before the JVM has finished its shutdown: wait for the group, not only the script.
    """
    if process.poll() is not None and not _group_alive(process.pid):
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _group_alive(process.pid) and time.monotonic() < deadline:
        process.poll()  # reap the script so that it does not count as alive
        time.sleep(0.1)
    if _group_alive(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_spark_connect(
    port: int | None = None,
    host: str = "127.0.0.1",
    *,
    work_dir: Path,
    master: str = "local[*]",
    driver_memory: str = "1g",
    executor_memory: str | None = None,
    ready_timeout: float = 90.0,
) -> SparkConnectServer:
    """Run ``sbin/start-connect-server.sh`` in the foreground and wait for its port."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise SparkServerError(
            "Java is not installed: Spark Connect needs Java 17 (set JAVA_HOME or put java on PATH)"
        )
    port = port or free_port(host)
    if port_open(host, port):
        raise SparkServerError(f"port {host}:{port} is already in use")
    home = spark_home()
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / f"spark-connect-{port}.log"
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_NO_DAEMONIZE": "1",  # stay in the foreground: we own the process
        "SPARK_IDENT_STRING": f"conveyor-{port}",
        "SPARK_LOG_DIR": str(work_dir),
        "SPARK_PID_DIR": str(work_dir),
        "SPARK_LOCAL_IP": host,
    }
    cmd = [
        "bash",
        str(home / "sbin" / "start-connect-server.sh"),
        "--master",
        master,
        "--driver-memory",
        driver_memory,
        "--conf",
        f"spark.connect.grpc.binding.address={host}",
        "--conf",
        f"spark.connect.grpc.binding.port={port}",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.sql.shuffle.partitions=2",
        "--conf",
        f"spark.sql.warehouse.dir={work_dir / 'warehouse'}",
        "--conf",
        "spark.driver.extraJavaOptions="
        + " ".join((f"-Dderby.system.home={work_dir}", *DRIVER_JAVA_OPTIONS)),
    ]
    if executor_memory:  # on a cluster: what each executor asks its worker for
        cmd += ["--conf", f"spark.executor.memory={executor_memory}"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work_dir, start_new_session=True
        )
    server = SparkConnectServer(host, port, proc, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise SparkServerError(
                f"Spark Connect server exited with code {proc.returncode}; log {log_path}:\n{tail}"
            )
        if port_open(host, port, timeout=0.2):
            return server
        time.sleep(0.2)
    server.stop()
    raise SparkServerError(
        f"Spark Connect server did not listen on {host}:{port} within {ready_timeout}s; log {log_path}"
    )
