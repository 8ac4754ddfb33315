"""A Spark standalone cluster with a Spark Connect server in front of it.

The topology a broker executor has in production (a Spark Connect endpoint whose
batches run on a cluster's executors), on one machine, from the pyspark wheel alone:
``bin/spark-class org.apache.spark.deploy.master.Master``, N
``...deploy.worker.Worker`` processes, then ``start-connect-server.sh --master
spark://HOST:PORT``. Used by ``conveyor dev --spark-workers N`` and the tests; on a
real cluster only the Connect server's ``--master`` changes (docs/OPERATIONS.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.core.host.ports import free_port, port_open
from conveyor.spark.server import (
    SparkConnectServer,
    SparkServerError,
    spark_home,
    start_spark_connect,
    stop_process_group,
)

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


@dataclass
class SparkCluster:
    """A running master, its workers and the Spark Connect server submitting to them."""

    host: str
    master_port: int
    master_ui_port: int
    master: subprocess.Popen[bytes]
    work_dir: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    connect: SparkConnectServer | None = None

    @property
    def master_url(self) -> str:
        return f"spark://{self.host}:{self.master_port}"

    @property
    def remote(self) -> str:
        if self.connect is None:
            raise SparkServerError("the cluster's Spark Connect server is not running")
        return self.connect.remote

    def status(self, timeout: float = 2.0) -> dict[str, object]:
        """The master's own view (its web UI's JSON): alive workers, cores, running apps."""
        url = f"http://{self.host}:{self.master_ui_port}/json/"
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback
            return dict(json.loads(r.read()))

    def alive_workers(self) -> int:
        try:
            return int(self.status().get("aliveworkers", 0))  # type: ignore[call-overload]
        except (OSError, ValueError):
            return 0

    def stop(self, timeout: float = 15.0) -> None:
        """Connect server first (it is the cluster's application), then workers, then master."""
        if self.connect is not None:
            self.connect.stop(timeout)
        for w in self.workers:
            stop_process_group(w, timeout)
        stop_process_group(self.master, timeout)

    def __enter__(self) -> SparkCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _spark_class(
    cls: str, args: list[str], *, work_dir: Path, log: Path, host: str
) -> subprocess.Popen[bytes]:
    home = spark_home()
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": host,
        "SPARK_LOG_DIR": str(work_dir),
        "SPARK_WORKER_DIR": str(work_dir / "worker"),
    }
    with open(log, "ab") as out:
        return subprocess.Popen(
            [str(home / "bin" / "spark-class"), cls, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work_dir,
            start_new_session=True,
        )


def start_spark_cluster(
    workers: int = 1,
    *,
    work_dir: Path,
    host: str = "127.0.0.1",
    connect_port: int | None = None,
    worker_cores: int = 1,
    worker_memory: str = "1g",
    executor_memory: str = "512m",
    ready_timeout: float = 120.0,
) -> SparkCluster:
    """Start a master, ``workers`` workers and a Connect server on them; wait until usable.

    Ready means: the master lists every worker alive, and the Connect server listens.
    Anything started is stopped again when a later step fails.
    """
    if workers < 1:
        raise SparkServerError("a Spark cluster needs at least one worker")
    work_dir.mkdir(parents=True, exist_ok=True)
    master_port, ui_port = free_port(host), free_port(host)
    master = _spark_class(
        MASTER_CLASS,
        ["--host", host, "--port", str(master_port), "--webui-port", str(ui_port)],
        work_dir=work_dir,
        log=work_dir / "master.log",
        host=host,
    )
    cluster = SparkCluster(host, master_port, ui_port, master, work_dir)
    try:
        deadline = time.monotonic() + ready_timeout
        _wait(lambda: port_open(host, master_port), deadline, master, "Spark master", work_dir)
        for i in range(workers):
            wdir = work_dir / f"worker-{i}"
            wdir.mkdir(exist_ok=True)
            cluster.workers.append(
                _spark_class(
                    WORKER_CLASS,
                    [
                        cluster.master_url,
                        "--host",
                        host,
                        "--cores",
                        str(worker_cores),
                        "--memory",
                        worker_memory,
                        "--webui-port",
                        str(free_port(host)),
                        "--work-dir",
                        str(wdir),
                    ],
                    work_dir=work_dir,
                    log=work_dir / f"worker-{i}.log",
                    host=host,
                )
            )
        _wait(
            lambda: cluster.alive_workers() >= workers,
            deadline,
            master,
            f"{workers} Spark worker(s) registered",
            work_dir,
        )
        cluster.connect = start_spark_connect(
            connect_port,
            host,
            work_dir=work_dir / "connect",
            master=cluster.master_url,
            executor_memory=executor_memory,
            ready_timeout=max(10.0, deadline - time.monotonic()),
        )
        return cluster
    except BaseException:
        with contextlib.suppress(Exception):
            cluster.stop()
        raise


def _wait(
    ready: Callable[[], bool],
    deadline: float,
    proc: subprocess.Popen[bytes],
    what: str,
    logs: Path,
) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SparkServerError(f"{what}: the Spark master exited; logs in {logs}")
        if ready():
            return
        time.sleep(0.3)
    raise SparkServerError(f"{what}: not ready in time; logs in {logs}")
