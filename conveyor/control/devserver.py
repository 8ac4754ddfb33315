"""`conveyor dev`: everything on one machine, supervised, stopped together on Ctrl-C.

Starts the embedded tansu broker (in memory), a local Spark Connect server (the
default broker executor), the demo producer and connector specs, then
``dagster dev`` with the SQLite meta store under ``.conveyor/``, over a workspace of
Conveyor's code location, the demo's downstream asset (``conveyor.demo.downstream``) and
the user's own definitions (``--defs``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TypeVar

import click
import yaml

from conveyor.brokers.embedded import EmbeddedBroker, start_embedded_broker
from conveyor.control import devstop
from conveyor.core.errors import ConveyorError
from conveyor.core.host.ports import port_open
from conveyor.dagster.resources.conveyor import load_brokers
from conveyor.dagster.run_queue import run_queue_config
from conveyor.spark.cluster import SparkCluster, start_spark_cluster
from conveyor.spark.server import SparkConnectServer, start_spark_connect

DAGSTER_YAML = """\
# Written by `conveyor dev`. Settings that suit long-running connector runs.
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config:
    dequeue_interval_seconds: 1
{queue}
run_monitoring:
  enabled: true
  poll_interval_seconds: 10
retention:
  schedule:
    purge_after_days: 7
  sensor:
    purge_after_days:
      skipped: 1
      failure: 7
      success: 7
sensors:
  use_threads: true
  num_workers: 4
telemetry:
  enabled: false
"""


def dagster_yaml(brokers: list[tuple[str, int]]) -> str:
    """The instance ``conveyor dev`` writes, its run queue sized for ``brokers`` (id, capacity)
    plus room for one-off jobs (``conveyor.dagster.run_queue``)."""
    queue = yaml.safe_dump(run_queue_config(brokers), sort_keys=False, default_flow_style=None)
    return DAGSTER_YAML.format(queue="\n".join("    " + line for line in queue.splitlines()))


T = TypeVar("T")


def write_instance(dagster_home: Path, run_launcher: str = "") -> None:
    """``dagster.yaml`` in ``dagster_home``, its run queue sized for the brokers file's executors,
    else for ``local`` of ``$CONVEYOR_BROKER_CAPACITY`` (default 8); ``run_launcher``: the
    section ``run_launcher_yaml`` gives (empty: Dagster's DefaultRunLauncher)."""
    brokers = [(b.id, b.capacity) for b in load_brokers()]
    (dagster_home / "dagster.yaml").write_text(dagster_yaml(brokers) + run_launcher)


RUN_LAUNCHER_YAML = """\
# Runs forked from Conveyor's warm run server (CONVEYOR_RUN_LAUNCHER=forkserver).
run_launcher:
  module: conveyor.dagster.launcher
  class: ForkServerRunLauncher
  config:
    socket: {socket}
"""


def run_launcher_yaml(socket: Path | None) -> str:
    """The ``run_launcher`` section: the fork-server launcher on ``socket``; none (Dagster's
    DefaultRunLauncher) when ``socket`` is None."""
    return RUN_LAUNCHER_YAML.format(socket=socket) if socket else ""


def uses_run_server() -> bool:
    """``CONVEYOR_RUN_LAUNCHER``: ``forkserver`` (the default: runs forked from the warm run
    server, docs/DESIGN.md "Runs forked from a warm run server") or ``default`` (Dagster's own
    DefaultRunLauncher: a spawned interpreter per run)."""
    choice = os.environ.get("CONVEYOR_RUN_LAUNCHER", "forkserver")
    if choice not in ("forkserver", "default"):
        raise ConveyorError(f"CONVEYOR_RUN_LAUNCHER={choice!r}: use forkserver or default")
    return choice == "forkserver"


DEFINITIONS_MODULE = "conveyor.dagster.definitions"
DEMO_LOCATION = "conveyor.demo.downstream"


def workspace_yaml(defs: tuple[str, ...], *, demo: bool, cwd: Path) -> str:
    """The ``dagster dev -w`` workspace: Conveyor's code location, the demo's downstream
    location (with the demo), and each of ``defs``: a ``.py`` file, else a module importable
    from ``cwd``. Each location is named after its module or file."""
    entries: list[dict[str, object]] = [{"python_module": {"module_name": DEFINITIONS_MODULE}}]
    if demo:
        entries.append({"python_module": {"module_name": DEMO_LOCATION}})
    for d in defs:
        if d.endswith(".py"):
            path = (cwd / d).resolve()
            if not path.is_file():
                raise ConveyorError(f"--defs {d}: no such file {path}")
            entries.append({"python_file": {"relative_path": str(path)}})
        else:
            entries.append(
                {"python_module": {"module_name": d, "working_directory": str(cwd.resolve())}}
            )
    return "# Written by `conveyor dev` at each start.\n" + yaml.safe_dump(
        {"load_from": entries}, sort_keys=False
    )


def _say(msg: str) -> None:
    click.secho(f"conveyor dev: {msg}", fg="cyan", err=True)


def api_token(home: Path) -> Path:
    """``<home>/api-token``: the REST API's bearer token, made once (0600) and kept."""
    path = home / "api-token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path


def run_dev(
    *,
    home: Path,
    kafka_port: int,
    spark_port: int,
    dagster_port: int,
    producer_rate: float,
    demo: bool,
    api_port: int = 8083,
    spark_workers: int = 0,
    defs: tuple[str, ...] = (),
) -> int:
    """Start every service in order (broker, Spark, demo producer, API, Dagster), wait for
    ``dagster dev`` to end, and stop them all in reverse order on exit or Ctrl-C."""
    connectors, dagster_home = _prepare_home(home)
    workspace = home / "workspace.yaml"
    workspace.write_text(workspace_yaml(defs, demo=demo, cwd=Path.cwd()))
    services = _DevServices(home)
    _install_signal_handlers()
    try:
        services.broker, bootstrap = _start_kafka(home, kafka_port)
        services.spark, remote = _start_spark(home, spark_port, spark_workers)
        dagster_url = f"http://127.0.0.1:{dagster_port}"
        env = _dev_env(home, dagster_home, bootstrap, remote, dagster_url)
        if demo:
            # The demo's minutes begin when it starts (conveyor/demo/downstream.py). Set before
            # the run server starts: its runs see its environment, as the code server's see
            # the code server's (a run of a minute before a start of its own fails).
            env["CONVEYOR_DEMO_START"] = str(int(time.time() // 60 * 60))
        socket = None
        if uses_run_server():
            socket = dagster_home / RUN_SERVER_SOCKET
            services.children.append(start_run_server(home, socket, env))
        write_instance(dagster_home, run_launcher_yaml(socket))
        if demo:
            _install_demo(connectors)
            _say(
                "demo downstream asset orders_per_minute: each minute from now on runs once "
                "demo_orders' watermark has passed it (sensor demo_orders_per_minute)"
            )
            services.children.append(_start_demo_producer(home, bootstrap, producer_rate, env))
        services.children.append(_start_api(home, api_port, dagster_url, env))
        proc = _start_dagster(dagster_port, connectors, workspace, env)
        services.children.append(proc)
        services.dagster = proc
        return proc.wait()
    except KeyboardInterrupt:
        _say("stopping")
        return 0
    finally:
        services.stop()


def _prepare_home(home: Path) -> tuple[Path, Path]:
    """Make ``home`` with its logs, connectors and dagster directories and point
    ``$CONVEYOR_HOME`` at it; returns the connectors and Dagster home directories."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(exist_ok=True)
    connectors = home / "connectors"
    connectors.mkdir(exist_ok=True)
    dagster_home = home / "dagster"
    dagster_home.mkdir(exist_ok=True)
    os.environ["CONVEYOR_HOME"] = str(home)
    return connectors, dagster_home


def _shutdown(*_: object) -> None:
    """SIGTERM handler: stop the way Ctrl-C does."""
    raise KeyboardInterrupt


def _install_signal_handlers() -> None:
    """SIGTERM and SIGINT both end ``run_dev`` through KeyboardInterrupt."""
    signal.signal(signal.SIGTERM, _shutdown)
    # Started in the background, this process inherits SIGINT ignored, and so would every
    # child (an ignored signal survives exec): `dagster dev` would then never stop on the
    # SIGINT _DevServices.stop sends and leave its webserver, daemon and code server behind.
    signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class _DevServices:
    """What ``run_dev`` started, in the order it started them, to stop in reverse."""

    home: Path
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    broker: EmbeddedBroker | None = None
    spark: SparkConnectServer | SparkCluster | None = None
    dagster: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        """Stop the daemon's queue, the runs, then the child processes (SIGINT, SIGKILL after
        20 s), Spark and the broker; last, whatever still holds the home (``control/devstop``)."""
        # Connector runs are grandchildren of `dagster dev` (its code server starts them)
        # and outlive it: stop them first, the way Dagster's terminate does, once the daemon
        # can launch no more.
        daemon = devstop.pause_daemon(self.dagster.pid if self.dagster else None, _say)
        _stop_runs(self.home / "dagster")
        devstop.kill_daemon(daemon)
        for p in reversed(self.children):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        for p in reversed(self.children):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_tree(p)
        if self.spark:
            self.spark.stop()
        if self.broker:
            self.broker.stop()
        left = devstop.sweep(self.home, _say)
        _say("all processes stopped" + (f" ({len(left)} stopped by the sweep)" if left else ""))


def _stop_runs(dagster_home: Path) -> None:
    """The queued runs canceled, the connector runs interrupted, every other active run
    terminated; each step reported and passed over when it fails (the sweep follows)."""
    from conveyor.store.meta import MetaStore

    queue = _opened("the run queue", lambda: devstop.RunQueue(dagster_home, _say))
    store = _opened("the meta store", MetaStore)
    steps: list[tuple[str, Callable[[], object]]] = []
    if queue is not None:
        steps.append(("cancel the queued runs", queue.cancel_queued))
    if store is not None:
        steps.append(
            ("unassign the connectors not started", lambda: devstop.reset_unstarted(store, _say))
        )
        steps.append(("stop the connector runs", lambda: devstop.stop_connector_runs(store, _say)))
    if queue is not None:
        steps.append(("terminate the other runs", queue.terminate_active))
    for what, step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - shutting down: report and go on
            _say(f"could not {what}: {type(e).__name__}: {e}")
    if queue is not None:
        queue.close()


def _opened(what: str, open_: Callable[[], T]) -> T | None:
    try:
        return open_()
    except Exception as e:  # noqa: BLE001 - shutting down: report and go on
        _say(f"could not open {what} to stop the runs: {type(e).__name__}: {e}")
        return None


def _start_kafka(home: Path, kafka_port: int) -> tuple[EmbeddedBroker | None, str]:
    """The Kafka-protocol broker: ``$CONVEYOR_KAFKA_BOOTSTRAP`` if set, else the embedded
    tansu broker started here; returns the broker started (or None) and its bootstrap."""
    bootstrap = os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP")
    if bootstrap:
        _say(f"using Kafka at {bootstrap} (CONVEYOR_KAFKA_BOOTSTRAP)")
        return None, bootstrap
    broker = start_embedded_broker(kafka_port, log_path=home / "logs" / "tansu.log")
    bootstrap = broker.bootstrap
    _say(
        f"embedded broker (tansu) at {bootstrap}: IN MEMORY, its data is lost when conveyor dev stops"
    )
    return broker, bootstrap


def _start_spark(
    home: Path, spark_port: int, spark_workers: int
) -> tuple[SparkConnectServer | SparkCluster | None, str]:
    """The Spark Connect server: ``$CONVEYOR_SPARK_REMOTE`` if set, else one already on
    ``spark_port``, else a standalone cluster (``spark_workers``) or a local server started
    here; returns what was started (or None) and its remote URL."""
    remote = os.environ.get("CONVEYOR_SPARK_REMOTE")
    if remote:
        _say(f"using Spark Connect at {remote} (CONVEYOR_SPARK_REMOTE)")
        return None, remote
    if port_open("127.0.0.1", spark_port):
        remote = f"sc://127.0.0.1:{spark_port}"
        _say(f"a Spark Connect server already listens on {remote}; using it")
        return None, remote
    if spark_workers:
        _say(
            f"starting a Spark standalone cluster (master + {spark_workers} worker(s)) and "
            f"Spark Connect on 127.0.0.1:{spark_port} in front of it (about 20 s; logs in "
            f"{home / 'spark'})"
        )
        cluster = start_spark_cluster(
            spark_workers, work_dir=home / "spark", connect_port=spark_port
        )
        remote = cluster.remote
        _say(f"Spark Connect ready at {remote}, master {cluster.master_url}")
        return cluster, remote
    _say(f"starting Spark Connect on 127.0.0.1:{spark_port} (about 10 s; log in {home / 'logs'})")
    server = start_spark_connect(spark_port, work_dir=home / "spark")
    remote = server.remote
    _say(f"Spark Connect ready at {remote}")
    return server, remote


def _dev_env(
    home: Path, dagster_home: Path, bootstrap: str, remote: str, dagster_url: str
) -> dict[str, str]:
    """The environment of every child: this one, plus where the broker, Spark, the meta
    store's home and Dagster are."""
    return {
        **os.environ,
        "CONVEYOR_HOME": str(home),
        "CONVEYOR_KAFKA_BOOTSTRAP": bootstrap,
        "CONVEYOR_SPARK_REMOTE": remote,
        "DAGSTER_HOME": str(dagster_home),
        # The scheduler sensor reloads the code location through it when a spec changes.
        "CONVEYOR_DAGSTER_URL": dagster_url,
    }


def _start_demo_producer(
    home: Path, bootstrap: str, producer_rate: float, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """The demo producer: ``producer_rate`` orders/s into topic 'orders'."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conveyor.demo.producer",
            "--bootstrap",
            bootstrap,
            "--rate",
            str(producer_rate),
        ],
        env=env,
        stdout=open(home / "logs" / "producer.log", "ab"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    _say(f"demo producer: {producer_rate:g} orders/s into topic 'orders'")
    return proc


def _start_api(
    home: Path, api_port: int, dagster_url: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """The REST API (``conveyor serve``) on ``api_port``, its token in ``home/api-token``."""
    if port_open("127.0.0.1", api_port):
        raise ConveyorError(
            f"port {api_port} is already in use; choose another for the REST API with --api-port"
        )
    token = api_token(home)
    conveyor_exe = shutil.which("conveyor") or str(Path(sys.executable).parent / "conveyor")
    proc = subprocess.Popen(
        [conveyor_exe, "serve", "--host", "127.0.0.1", "--port", str(api_port)]
        + ["--token-file", str(token), "--dagster-url", dagster_url],
        env=env,
        stdout=open(home / "logs" / "api.log", "ab"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    _say(
        f"REST API on http://127.0.0.1:{api_port} (bearer token in {token}; "
        f'curl -H "Authorization: Bearer $(cat {token})" http://127.0.0.1:{api_port}/connectors)'
    )
    return proc


RUN_SERVER_SOCKET = "runserver.sock"


def start_run_server(home: Path, socket: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The warm run server the fork-server launcher forks runs from; returns once it answers
    (its imports take a few seconds)."""
    from conveyor.dagster.launcher import RunServerUnreachable, ask

    log = home / "logs" / "runserver.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor.dagster.runserver", "--socket", str(socket)],
        env=env,
        stdout=open(log, "ab"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        # Like `dagster dev`: a Ctrl-C reaches its runs only through _DevServices.stop.
        start_new_session=True,
    )
    _say(f"starting the run server (connector runs fork from it; log in {log})")
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            ask(socket, {"op": "ping"}, timeout_s=1)
            return proc
        except RunServerUnreachable:
            time.sleep(0.2)
    _kill_tree(proc)
    raise ConveyorError(f"the run server did not start; see {log}")


def _start_dagster(
    dagster_port: int, connectors: Path, workspace: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """``dagster dev`` (webserver, daemon, code servers) on ``dagster_port``, over ``workspace``."""
    dagster = shutil.which("dagster") or str(Path(sys.executable).parent / "dagster")
    cmd = [
        dagster,
        "dev",
        "-w",
        str(workspace),
        "-p",
        str(dagster_port),
        "-h",
        "127.0.0.1",
    ]
    _say(f"starting Dagster UI on http://127.0.0.1:{dagster_port} (connectors in {connectors})")
    # A session of its own: the fallback in _DevServices.stop can kill its whole tree (webserver,
    # daemon, code server), and a Ctrl-C reaches it only through this process, after the
    # connector runs have committed.
    return subprocess.Popen(cmd, env=env, start_new_session=True)


def _kill_tree(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL a child and, when it leads a session of its own, every process in it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, signal.SIGKILL)
            return
    p.kill()


def _install_demo(connectors: Path) -> None:
    files = resources.files("conveyor.demo")
    target = connectors / "demo_orders.yaml"
    if not target.exists():
        target.write_text(files.joinpath("orders_localfile.yaml").read_text())
    pg = connectors / "demo_orders_pg.yaml"
    url = os.environ.get("CONVEYOR_DEMO_PG_URL")
    if url and not pg.exists():
        # A spec may not read Conveyor's own settings: the URL goes to a secret file the
        # demo connector refers to (the secrets directory's default, $CONVEYOR_HOME/secrets).
        secret = (connectors.parent / "secrets" / "demo-pg-url").absolute()
        secret.parent.mkdir(parents=True, exist_ok=True)
        secret.touch(mode=0o600)
        secret.write_text(url)
        text = files.joinpath("orders_postgres.yaml").read_text()
        pg.write_text(text.replace("url_env: CONVEYOR_DEMO_PG_URL", f"url: ${{file:{secret}}}"))
    lake = connectors / "demo_orders_lake.yaml"
    if os.environ.get("CONVEYOR_DEMO_LAKE") == "1" and not lake.exists():
        lake.write_text(files.joinpath("orders_delta.yaml").read_text())
