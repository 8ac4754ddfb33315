"""Spark Connect sessions are closed at exit, also when their server is gone.

pyspark's client retries its exit-time cleanup RPC with backoff for minutes when the
endpoint is unreachable; without ``close_spark_sessions`` a connector run whose Spark
server went down would hang on exit (and a test session would too).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conveyor.core.host.ports import free_port

SCRIPT = """
import sys
from conveyor.spark.session import spark_session
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


def test_the_pinned_pyspark_still_has_the_internals_conveyor_relies_on(spark_remote: str) -> None:
    """Each shim of conveyor.spark.session against the real client: fails loudly on an upgrade."""
    import pyarrow as pa

    from conveyor.spark.session import (
        _CREATE_DATAFRAME_CONFS,
        ConfCache,
        endpoint_of,
        fetch_arrow,
        spark_session,
    )

    session = spark_session(spark_remote)
    # client._rpc_deadlines: every RPC bounded.
    from conveyor.spark.session import SPARK_RPC_DEADLINE_S

    deadlines = session.client._rpc_deadlines
    assert type(deadlines).__name__ == "RpcDeadlines", "client._rpc_deadlines is gone"
    assert deadlines.analyze_plan == deadlines.config == SPARK_RPC_DEADLINE_S
    # client._builder.url: the endpoint, checked before stopping a session at exit.
    assert endpoint_of(session) is not None
    host, port = endpoint_of(session)  # type: ignore[misc]
    assert f"sc://{host}:{port}" == spark_remote
    # DataFrame._to_table(): one RPC for a result.
    table = fetch_arrow(session.range(3))
    assert table is not None and table.column(0).to_pylist() == [0, 1, 2]
    # client.get_config_dict: createDataFrame reads only the confs cached per session, and
    # after the first call the cache answers.
    cache = session.client.get_config_dict
    assert isinstance(cache, ConfCache), "client.get_config_dict is gone: nothing is cached"
    fetch = cache.fetch
    asked: list[tuple[str, ...]] = []
    rpcs: list[tuple[str, ...]] = []

    def rpc(*keys: str):  # type: ignore[no-untyped-def]
        rpcs.append(keys)
        return fetch(*keys)

    def lookup(*keys: str):  # type: ignore[no-untyped-def]
        asked.append(keys)
        return cache(*keys)

    cache.fetch, cache.cache = rpc, {}
    session.client.get_config_dict = lookup
    try:
        for _ in range(3):
            assert session.createDataFrame(pa.table({"a": [1, 2]})).count() == 2
    finally:
        session.client.get_config_dict, cache.fetch = cache, fetch
    assert asked, "createDataFrame no longer reads its confs through client.get_config_dict"
    unknown = {k for keys in asked for k in keys} - _CREATE_DATAFRAME_CONFS
    assert not unknown, f"createDataFrame reads confs the cache does not cover: {unknown}"
    assert len(rpcs) == len(set(asked)) < len(asked), (rpcs, asked)


def test_a_transforms_queries_are_one_stream_each(spark_remote: str) -> None:
    """The transformer turns pyspark's reattachable execution off on its session (a
    public client switch; fails loudly if it goes): each batch is one ExecutePlan stream,
    without ReleaseExecute RPCs from a thread pool."""
    import pyarrow as pa

    from conveyor.core.model import TransformSpec
    from conveyor.spark.session import one_stream_per_query, spark_session
    from conveyor.spark.transform import SparkTransformer

    session = spark_session(spark_remote)
    session.client.enable_reattachable_execute()
    assert session.client._use_reattachable_execute is True
    t = SparkTransformer(TransformSpec(decode="json", schema="id BIGINT"), lambda: session)
    out = t(pa.table({"__value": [b'{"id": 1}', b"not json"], "__offset": [0, 1]}))
    assert session.client._use_reattachable_execute is False, "pyspark's switch is gone"
    assert out.table.column("id").to_pylist() == [1]
    assert [r.index for r in out.rejected] == [1]
    released = threading.Event()
    real = session.client._stub.ReleaseExecute

    def spy(*a: object, **k: object) -> object:
        released.set()
        return real(*a, **k)

    session.client._stub.ReleaseExecute = spy
    batch = pa.table({"__value": [b'{"id": 2}'], "__offset": [2]})
    try:
        assert t(batch).table.num_rows == 1
        assert not released.is_set()  # one stream per query: nothing to release
        session.client.enable_reattachable_execute()  # pyspark's default, for contrast
        assert t(batch).table.num_rows == 1
        assert released.wait(30), "the spy sees pyspark's release RPCs when reattachable"
    finally:
        session.client.disable_reattachable_execute()
        session.client._stub.ReleaseExecute = real
    assert one_stream_per_query(object()) is False


def test_the_local_server_jvm_runs_with_conveyors_collector(spark_remote: str) -> None:
    """``start_spark_connect`` gives the server's JVM DRIVER_JAVA_OPTIONS (ParallelGC,
    measured in docs/BENCHMARKS.md) next to its derby home."""
    from pathlib import Path

    from conveyor.spark.server import DRIVER_JAVA_OPTIONS

    port = spark_remote.rsplit(":", 1)[1]
    jvms = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile
            continue
        if args[0].endswith("/java") and f"spark.connect.grpc.binding.port={port}" in args:
            jvms.append(args)
    assert len(jvms) == 1, jvms
    assert DRIVER_JAVA_OPTIONS == ("-XX:+UseParallelGC",)
    assert "-XX:+UseParallelGC" in jvms[0]
    assert any(a.startswith("-Dderby.system.home=") for a in jvms[0])


@pytest.mark.slow  # starts a second Spark Connect server (about 27 s): CI's -m slow run
def test_a_process_talking_to_two_endpoints_gets_a_session_on_each(spark_remote, tmp_path):
    """pyspark's getOrCreate returns the process's first session whatever the URL; the
    second endpoint (another broker's server) must get a session of its own, and each URL
    keeps its session afterwards. Each server reports its own binding port."""
    from conveyor.spark.session import spark_session

    port = "spark.connect.grpc.binding.port"
    first = spark_session(spark_remote)
    assert first.conf.get(port) == spark_remote.rsplit(":", 1)[1]
    # pyspark's active session is per thread: a thread that never made one (a REST API
    # worker thread, a Dagster op's) is where a new session would take that role.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(_two_endpoints_from_a_new_thread, spark_remote, tmp_path).result()
    # With the second server gone, the first endpoint's work goes on.
    assert spark_session(spark_remote).range(4).orderBy("id").count() == 4


def _two_endpoints_from_a_new_thread(spark_remote: str, tmp_path: Path) -> None:
    from pyspark.sql.connect.session import SparkSession

    from conveyor.spark.server import start_spark_connect
    from conveyor.spark.session import discard_session, spark_session

    port = "spark.connect.grpc.binding.port"
    assert spark_session(spark_remote).conf.get(port) == spark_remote.rsplit(":", 1)[1]
    second = None
    try:
        with start_spark_connect(work_dir=tmp_path / "second") as other:
            second = spark_session(other.remote)
            assert second.conf.get(port) == str(other.port)
            again = spark_session(spark_remote)
            assert again.conf.get(port) == spark_remote.rsplit(":", 1)[1]
            assert spark_session(other.remote) is second
            assert second.range(3).count() == 3
            # pyspark consults its default/active session on its own (orderBy asks it
            # whether DataFrame debugging is on): the second endpoint's must never be it,
            # or the first endpoint's work waits on the second server once it is gone.
            assert SparkSession.getActiveSession() is not second
            assert SparkSession._get_default_session() is not second
    finally:
        if second is not None:
            discard_session(second)
    assert spark_session(spark_remote).range(4).orderBy("id").count() == 4
