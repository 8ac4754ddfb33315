"""Spark Connect sessions are closed at exit, also when their server is gone.

pyspark's client retries its exit-time cleanup RPC with backoff for minutes when the
endpoint is unreachable; without ``close_spark_sessions`` a connector run whose Spark
server went down would hang on exit (and a test session would too).
"""

from __future__ import annotations

import socket
import subprocess
import sys

from conveyor.brokers.embedded import free_port

SCRIPT = """
import sys
from conveyor.spark.transform import spark_session
s = spark_session(sys.argv[1])
if sys.argv[2] == "use":
    assert s.range(3).count() == 3
print("done")
"""


def run(remote: str, mode: str) -> subprocess.CompletedProcess[str]:
    # 90 s is far below pyspark's retry budget (minutes) and far above a clean exit (seconds).
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, remote, mode], capture_output=True, text=True, timeout=90
    )


def test_a_process_whose_spark_endpoint_is_gone_exits() -> None:
    r = run(f"sc://127.0.0.1:{free_port()}", "idle")
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]


def test_a_process_whose_spark_endpoint_accepts_but_never_answers_exits() -> None:
    # A port that accepts connections and says nothing (a server shutting down, a wrong
    # service): stopping the session cannot complete, the exit must still be bounded.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        r = run(f"sc://127.0.0.1:{mute.getsockname()[1]}", "idle")
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]


def test_a_session_on_a_live_server_is_stopped_at_exit(spark_remote: str) -> None:
    r = run(spark_remote, "use")
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]
