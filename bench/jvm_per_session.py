"""What a connector's start costs the Spark JVM: its session's first steps, then each batch.

Starts a Spark Connect server, warms it with two clients (each its own process, 30 batches),
then runs three more clients as a connector's run does: a new process and session, the
transform's ``prepare`` (its analyses), then 10 batches of ``rows`` rows of the benchmark's
orders. Prints, per client and step, the JVM's CPU seconds (``/proc``) and the wall time::

    .venv/bin/python -m bench.jvm_per_session [rows]

A batch's JVM CPU after the first is the steady cost; the first batch's excess and
``prepare`` are what a new session adds (docs/BENCHMARKS.md section 11, run H). Not a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

SCHEMA = "id BIGINT, name STRING, amount DOUBLE, ts BIGINT"  # as bench_as_users_run_it


def client(remote: str, jvm: int, label: str, batches: int, rows: int) -> None:
    from bench.harness import synthetic_batch
    from conveyor.core.model import TransformSpec
    from conveyor.spark.session import spark_session
    from conveyor.spark.transform import SparkTransformer

    batch = synthetic_batch(rows, topic="t")
    proc = psutil.Process(jvm)

    def cpu() -> float:
        t = proc.cpu_times()
        return t.user + t.system

    steps: list[tuple[str, float, float]] = []
    last = (cpu(), time.monotonic())

    def mark(name: str) -> None:
        nonlocal last
        now = (cpu(), time.monotonic())
        steps.append((name, round(now[0] - last[0], 3), round(now[1] - last[1], 3)))
        last = now

    transformer = SparkTransformer(
        TransformSpec(decode="json", schema=SCHEMA), spark_session(remote)
    )
    transformer.prepare()
    mark("prepare")
    for i in range(batches):
        transformer(batch)
        mark(f"batch {i}")
    print(label, json.dumps(steps), flush=True)


def main(rows: int = 36_364) -> None:
    from bench.stack import listening_pid
    from conveyor.spark.server import start_spark_connect

    with tempfile.TemporaryDirectory() as work:
        server = start_spark_connect(work_dir=Path(work))
        try:
            jvm = listening_pid(server.port)
            assert jvm is not None, "no process listens on the Spark Connect port"
            for label, batches in [("warm-up 1", 30), ("warm-up 2", 30), ("run 1", 10), ("run 2", 10), ("run 3", 10)]:  # fmt: skip
                subprocess.run(
                    [sys.executable, "-m", "bench.jvm_per_session", "--client", server.remote,
                     str(jvm), label, str(batches), str(rows)],
                    check=True,
                )  # fmt: skip
        finally:
            server.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        remote, jvm, label, batches, rows = sys.argv[2:7]
        client(remote, int(jvm), label, int(batches), int(rows))
    else:
        main(*(int(a) for a in sys.argv[1:2]))
