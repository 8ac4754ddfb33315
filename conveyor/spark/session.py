"""Spark Connect sessions: the process's registry, and every pyspark private-API shim.

Conveyor relies on a few pyspark client internals for speed and for a bounded exit.
They are all here, each with a fallback when pyspark changes shape, and each with a
test in tests/integration/test_spark_session.py that fails loudly when the pinned
pyspark (``pyspark[connect]==4.3.*``) no longer has it:

- ``client.get_config_dict``: wrapped to cache ``createDataFrame``'s per-call conf
  lookup (one RPC per batch saved);
- ``client._builder.url``: the endpoint, to check it answers before stopping a session;
- ``DataFrame._to_table()``: a result fetched without ``toArrow()``'s analysis RPC;
- ``client._rpc_deadlines``: every RPC bounded (``bound_rpcs``): pyspark's defaults
  leave an analysis waiting up to an hour on a server that stopped answering;
- ``session.release_session_on_close``: a session the server lost (it restarted) is
  stopped without the release RPC (``discard_session``);
- ``client.disable_reattachable_execute()``: a batch's query is one ExecutePlan stream
  (``one_stream_per_query``), without the reattach and release RPCs.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pyarrow as pa

log = logging.getLogger("conveyor.spark")

_sessions: weakref.WeakSet[Any] = weakref.WeakSet()
_remote_of: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_own: dict[str, Any] = {}  # sessions of a second endpoint in this process, by URL
_sessions_lock = threading.Lock()
_atexit_registered = False


def spark_session(remote: str) -> Any:
    """A Spark Connect session for ``remote`` (sc://host:port), created through dagster-pyspark.

    pyspark's ``getOrCreate`` hands back the process's existing session whatever URL it is
    asked for; a process that talks to a second endpoint (the REST API reading dead letters
    of connectors on two brokers) gets a session of its own for it, kept by URL.
    Every session is closed when the process exits (see ``close_spark_sessions``).
    """
    global _atexit_registered
    from dagster_pyspark import LazyPySparkResource

    session = LazyPySparkResource(spark_config={"spark.remote": remote}).spark_session
    with _sessions_lock:
        other = _remote_of.get(session)
        if other is not None and other != remote:
            session = _own.get(remote)
            if session is None or getattr(session, "is_stopped", False):
                session = _own[remote] = _unregistered_session(remote)
    _cache_static_confs(session)
    bound_rpcs(session)
    with _sessions_lock:
        _sessions.add(session)
        _remote_of.setdefault(session, remote)
        if not _atexit_registered:
            # Registered after pyspark's own client hook, so it runs first (atexit is LIFO).
            atexit.register(close_spark_sessions)
            _atexit_registered = True
    return session


def no_sql_on_files(session: Any) -> None:
    """Turn off SQL over file paths (``text.`/etc/passwd```) for the session: a transform's
    expressions read only its batch. ``core.spark_sql.sql_guard`` already refuses subqueries; this is
    the second lock. A runtime SQL conf, which a Spark Connect client may set; one RPC, so
    it is set where the session is first used for a transform (``SparkTransformer``), not
    when it is created (creating a session makes no call: the endpoint may be down)."""
    session.conf.set("spark.sql.runSQLOnFiles", "false")


def _unregistered_session(remote: str) -> Any:
    """A session for ``remote`` that does not become pyspark's default or active session.

    ``builder.create()`` makes a new session the process's default (and the thread's
    active) one when none is set, and pyspark reads the active session's conf on its own:
    ``orderBy`` asks it whether DataFrame debugging is on. A second endpoint's session in
    that role makes every later ``orderBy`` on the first endpoint wait on the second, for
    as long as the retries last once that server is gone.
    """
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    return ConnectSession(connection=remote)


# The SQL confs pyspark's ``createDataFrame`` reads on every call (one Config RPC per
# batch). Conveyor never sets them on its sessions, so they are read once per session.
_CREATE_DATAFRAME_CONFS = frozenset(
    {
        "spark.sql.timestampType",
        "spark.sql.session.timeZone",
        "spark.sql.session.localRelationCacheThreshold",
        "spark.sql.session.localRelationSizeLimit",
        "spark.sql.session.localRelationChunkSizeRows",
        "spark.sql.session.localRelationChunkSizeBytes",
        "spark.sql.session.localRelationBatchOfChunksSizeBytes",
        "spark.sql.execution.pandas.convertToArrowArraySafely",
        "spark.sql.execution.pandas.inferPandasDictAsMap",
        "spark.sql.pyspark.inferNestedDictAsStruct.enabled",
        "spark.sql.pyspark.legacy.inferArrayTypeFromFirstElement.enabled",
        "spark.sql.pyspark.legacy.inferMapTypeFromFirstPair.enabled",
        "spark.sql.execution.arrow.useLargeVarTypes",
    }
)


class ConfCache:
    """Stands in for ``client.get_config_dict``: lookups made only of the confs above are
    answered from a per-session cache; any other lookup goes to ``fetch`` (the RPC)."""

    def __init__(self, fetch: Callable[..., Any]):
        self.fetch = fetch
        self.cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, *keys: str) -> Any:
        if not keys or not _CREATE_DATAFRAME_CONFS.issuperset(keys):
            return self.fetch(*keys)
        if keys not in self.cache:
            self.cache[keys] = self.fetch(*keys)
        return dict(self.cache[keys])


def _cache_static_confs(session: Any) -> None:
    """Answer ``createDataFrame``'s per-call conf lookup from a per-session cache.

    Saves one RPC per batch. If pyspark's client changes shape, nothing is patched and
    every call goes through.
    """
    client = getattr(session, "client", None)
    fetch = getattr(client, "get_config_dict", None)
    if fetch is not None and not isinstance(fetch, ConfCache):
        client.get_config_dict = ConfCache(fetch)


# Seconds any one Spark Connect RPC may take (an execution's stream segment is
# re-attached after it; the run's supervisor restarts a stage stuck longer anyway).
SPARK_RPC_DEADLINE_S = 300.0


def bound_rpcs(session: Any, deadline_s: float = SPARK_RPC_DEADLINE_S) -> bool:
    """Give every RPC of the session's client a deadline of at most ``deadline_s``.

    pyspark 4.3 reads ``client._rpc_deadlines`` (an ``RpcDeadlines``) at each call. False
    when the client has no such field (nothing changed).
    """
    import dataclasses

    client = getattr(session, "client", None)
    current = getattr(client, "_rpc_deadlines", None)
    if current is None or not dataclasses.is_dataclass(current):
        return False
    bounded = {
        f.name: min(v, deadline_s) if (v := getattr(current, f.name)) is not None else deadline_s
        for f in dataclasses.fields(current)
    }
    client._rpc_deadlines = dataclasses.replace(current, **bounded)
    return True


def one_stream_per_query(session: Any) -> bool:
    """Run the session's queries as one ExecutePlan stream each, not reattachable.

    pyspark's reattachable execution sends one or two ReleaseExecute RPCs per query from
    a thread pool and keeps each result reattachable: for a connector's per-batch queries
    (a result of one batch, in tens of milliseconds) that is a third of the client's CPU
    per row and a little of the server's (bench/test_bench_transform.py's reattach
    contender; docs/BENCHMARKS.md). A stream broken mid-result is then an outage (the batch
    is transformed again); a server that stops answering is caught by the run's liveness
    (``liveness.restart_after_s``), as with reattachable execution. False when the client
    has no such switch (nothing changed).
    """
    disable = getattr(getattr(session, "client", None), "disable_reattachable_execute", None)
    if disable is None:
        return False
    disable()
    return True


def _endpoint_reachable(session: Any) -> bool:
    from conveyor.core.host.ports import port_open

    endpoint = endpoint_of(session)
    return endpoint is not None and port_open(*endpoint, timeout=1.0)


def close_spark_sessions(timeout_s: float = 5.0) -> None:
    """Close every Spark Connect session this process opened, in bounded time.

    pyspark's client cleans up at interpreter exit with RPCs (ML cache, session
    release) that it retries with backoff for minutes when the server is gone or
    shutting down: a run whose Spark endpoint went down would hang on exit. Here a
    session whose endpoint answers is stopped (its server-side session released)
    within ``timeout_s``; otherwise, or when that takes longer, only its channel is
    closed, which also turns pyspark's own exit hook into a no-op.
    """
    with _sessions_lock:
        sessions = list(_sessions)
        _sessions.clear()
    for session in sessions:
        client = session.client
        if _endpoint_reachable(session):
            stopper = threading.Thread(target=_quietly, args=(session.stop,), daemon=True)
            stopper.start()
            stopper.join(timeout_s)
        if not client.is_closed:
            _quietly(client.close)


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - best effort at shutdown
        log.debug("closing a Spark session: %s", e)


# The server restarted (or is stopping): its sessions are gone, a new one is needed.
_SESSION_LOST = (
    "SESSION_NOT_FOUND",
    "SESSION_CLOSED",
    "NO_ACTIVE_SESSION",
    "Cannot call methods on a stopped SparkContext",
)


def is_connect_outage(e: BaseException) -> bool:
    """True for errors meaning the Spark Connect endpoint is unreachable or restarted."""
    text = f"{type(e).__name__}: {e}"
    return is_session_lost(e) or any(
        s in text
        for s in (
            "UNAVAILABLE",
            "Connection refused",
            "failed to connect",
            "DEADLINE_EXCEEDED",
            "Socket closed",
            "RetriesExceeded",
        )
    )


def is_session_lost(e: BaseException) -> bool:
    """True when the server no longer knows the session (it restarted): retry on a new one."""
    text = f"{type(e).__name__}: {e}"
    return any(s in text for s in _SESSION_LOST)


def discard_session(session: Any) -> None:
    """Forget a session the server lost: close its channel without the release RPC and
    clear pyspark's default session, so that the next ``spark_session()`` is a new one."""
    with _sessions_lock:
        _sessions.discard(session)
        for url, own in list(_own.items()):
            if own is session:
                del _own[url]
    try:
        session.release_session_on_close = False
        session.stop()
    except Exception as e:  # noqa: BLE001 - best effort
        log.debug("discarding a Spark session: %s", e)


def fetch_arrow(df: Any) -> pa.Table | None:
    """``df``'s rows as Arrow in one RPC (``_to_table``), or None when pyspark lacks it."""
    to_table = getattr(df, "_to_table", None)
    if to_table is None:
        return None
    table: pa.Table = to_table()[0]
    return table


def endpoint_of(session: Any) -> tuple[str, int] | None:
    """The (host, port) a Spark Connect session talks to, from pyspark's parsed sc:// URL."""
    try:
        url = session.client._builder.url
        return str(url.hostname), int(url.port or 15002)
    except Exception:  # noqa: BLE001 - a client without a known endpoint
        return None
