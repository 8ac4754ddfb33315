"""A real Dagster instance for end-to-end tests.

``dagster-webserver`` runs in a subprocess over a temporary DAGSTER_HOME with the
default run launcher; tests launch and terminate connector runs through its
GraphQL API (as the UI does) and read results from the real sink.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from conveyor.core.host.ports import free_port, port_open
from conveyor.store.meta import MetaStore

LOCATION = "conveyor"

# Deadlines of the e2e waits, for a loaded machine (CI shares two cores between two test
# workers, each with its own Spark Connect server, Kafka broker and Dagster). Each wait
# returns as soon as its condition holds: a generous deadline costs nothing when things
# go well, and what takes a second on a quiet machine can take tens of seconds there.
SETTLE_S = 120.0
"""A change a run makes (a heartbeat, a commit, a counter, a status) to show."""
STOP_S = 180.0
"""A terminated or stopped run to end: drain, commit, close (STOP_GRACE_S alone is 30 s)."""

DAGSTER_YAML = """\
run_coordinator:
  module: dagster.core.run_coordinator
  class: DefaultRunCoordinator
telemetry:
  enabled: false
"""


@dataclass
class DagsterHarness:
    home: Path
    dagster_home: Path
    connectors: Path
    env: dict[str, str]
    port: int
    process: subprocess.Popen[bytes]
    meta_url: str

    @property
    def client(self) -> Any:
        from dagster_graphql import DagsterGraphQLClient

        return DagsterGraphQLClient("127.0.0.1", port_number=self.port, timeout=60)

    @property
    def store(self) -> MetaStore:
        return MetaStore(self.meta_url)

    def instance(self) -> Any:
        from dagster import DagsterInstance

        return DagsterInstance.from_config(str(self.dagster_home))

    def write_spec(self, spec: dict[str, Any]) -> Path:
        path = self.connectors / f"{spec['name']}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    def reload(self) -> None:
        """Reload the code location, then sync the spec files into the meta store.

        This harness runs no daemon, so no scheduler sensor syncs the files (loading the
        code location never touches the store): the sync is the sensor's own
        ``sync_files``, as its next tick would do it.
        """
        from dagster_graphql import ReloadRepositoryLocationStatus

        from conveyor.config.specs import sync_files
        from conveyor.dagster.sensors.scheduler import SpecSources

        info = self.client.reload_repository_location(LOCATION)
        assert info.status == ReloadRepositoryLocationStatus.SUCCESS, info.message
        # Validated as the sensor would: against this home (spec paths resolve under it).
        with mock.patch.dict(os.environ, {"CONVEYOR_HOME": str(self.home)}):
            sync_files(self.store, SpecSources(self.connectors).scan())

    def launch(self, connector: str, tags: dict[str, str] | None = None) -> str:
        return self.client.submit_job_execution(
            f"connector__{connector}", repository_location_name=LOCATION, tags=tags
        )

    def terminate(self, run_id: str) -> None:
        self.client.terminate_run(run_id)

    def run_status(self, run_id: str) -> str:
        return self.client.get_run_status(run_id).value

    def wait_status(self, run_id: str, statuses: set[str], timeout: float = STOP_S) -> str:
        deadline = time.monotonic() + timeout
        status = ""
        while time.monotonic() < deadline:
            status = self.run_status(run_id)
            if status in statuses:
                return status
            time.sleep(0.5)
        raise AssertionError(
            f"run {run_id} still {status} after {timeout}s; wanted {statuses}\n{self.run_log(run_id)}"
            f"\n{self.run_stacks(run_id)}"
        )

    def run_stacks(self, run_id: str) -> str:
        """py-spy's dump of the run's process (a connector run's pid, from the meta store)."""
        try:
            pids = [r.run_pid for r in self.store.list() if r.run_id == run_id and r.run_pid]
        except Exception as e:  # noqa: BLE001 - a diagnostic only
            return f"no stacks: the meta store could not be read ({e})"
        return "\n".join(process_stacks(pid) for pid in pids) or f"no pid known for run {run_id}"

    def run_log(self, run_id: str, tail: int = 40) -> str:
        inst = self.instance()
        lines = []
        for rec in inst.all_logs(run_id)[-tail:]:
            msg = rec.user_message or ""
            if rec.dagster_event and rec.dagster_event.event_specific_data is not None:
                err = getattr(rec.dagster_event.event_specific_data, "error", None)
                if err is not None:
                    msg += f" | {err.message}"
            lines.append(f"{rec.level} {msg}")
        return "\n".join(lines)

    def failure_message(self, run_id: str) -> str:
        return self.run_log(run_id, tail=200)

    def end_active_runs(self, timeout: float = 120) -> list[str]:
        """Terminate every run still active and wait for each to end; returns their ids.

        Run after each test (``pytest_runtest_teardown`` below), also after a failure, so
        that a run a test left going never works on into the next test (the instance and
        its meta store are shared by a worker's whole session). A run that does not end
        within ``timeout`` has its process killed and is reported canceled.
        """
        from dagster import DagsterRunStatus, RunsFilter

        active = [
            DagsterRunStatus.QUEUED,
            DagsterRunStatus.NOT_STARTED,
            DagsterRunStatus.STARTING,
            DagsterRunStatus.STARTED,
            DagsterRunStatus.CANCELING,
        ]
        with self.instance() as inst:
            ids = [r.run_id for r in inst.get_runs(filters=RunsFilter(statuses=active))]
        for run_id in ids:
            with contextlib.suppress(Exception):  # it may have ended meanwhile
                self.terminate(run_id)
        deadline = time.monotonic() + timeout
        left = set(ids)
        while left and time.monotonic() < deadline:
            left = {r for r in left if self.run_status(r) not in FINISHED}
            if left:
                time.sleep(0.5)
        if left:
            pids = {row.run_id: row.run_pid for row in self.store.list() if row.run_pid}
            with self.instance() as inst:
                for run_id in left:
                    if pids.get(run_id):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pids[run_id], signal.SIGKILL)
                    run = inst.get_run_by_id(run_id)
                    if run is not None and not run.is_finished:
                        inst.report_run_canceled(run, message="test teardown: did not end")
        return ids


FINISHED = {"SUCCESS", "FAILURE", "CANCELED"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """An e2e test's time limit covers its own body, not the session's servers it starts
    first (Spark Connect, the broker, dagster-webserver, each under a deadline of its
    own): whichever test of a worker needs them first would otherwise pay for them, and
    pass or fail by the order the tests ran in."""
    for item in items:
        if not item.nodeid.startswith("tests/e2e/"):
            continue
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.kwargs.get("func_only") is not None:
            continue
        limit = marker.args[0] if marker is not None and marker.args else None
        if limit is None and marker is not None:
            limit = marker.kwargs.get("timeout")
        if limit is None:
            limit = float(config.getini("timeout") or 0)
        item.add_marker(pytest.mark.timeout(limit, func_only=True))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Before a test's fixtures are torn down (its schema dropped, its files removed), end
    the runs it left going on the session's Dagster instance."""
    for harness in getattr(item, "funcargs", {}).values():
        if isinstance(harness, DagsterHarness):
            left = harness.end_active_runs()
            if left:
                print(f"\n{item.nodeid}: ended the runs it left active: {left}")
    return (yield)


def process_stacks(pid: int) -> str:
    """Every thread's stack (Python and native) of a live process, by py-spy: what a run that
    does not end was doing, for a failure message."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        dump = subprocess.run(
            [py_spy, "dump", "--native", "--pid", str(pid)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"process {pid}: no py-spy dump ({e})"
    return f"py-spy dump of process {pid}:\n{dump.stdout}{dump.stderr}"


def processes_of(home: Path) -> list[int]:
    """Pids of the processes started for the test home ``home`` (CONVEYOR_HOME in their environment).

    Connector runs are grandchildren of the code server, in their own process groups, so
    killing the webserver's group does not reach them; a SIGSTOPped run ignores SIGTERM.
    """
    needle = f"CONVEYOR_HOME={home}".encode() + b"\0"
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env + b"\0":
            out.append(int(entry.name))
    return out


def kill_processes_of(home: Path) -> None:
    """SIGKILL whatever is left of a test home's processes (teardown, also after a failure)."""
    for pid in processes_of(home):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@contextlib.contextmanager
def dagster_webserver(home: Path, tansu: str, spark_remote: str) -> Iterator[DagsterHarness]:
    """``dagster-webserver`` over a fresh Conveyor home, its connectors run on ``spark_remote``."""
    dagster_home = home / "dagster"
    connectors = home / "connectors"
    for d in (dagster_home, connectors):
        d.mkdir(parents=True)
    (dagster_home / "dagster.yaml").write_text(DAGSTER_YAML)
    (home / "workspace.yaml").write_text(
        yaml.safe_dump(
            {
                "load_from": [
                    {
                        "python_module": {
                            "module_name": "conveyor.dagster.definitions",
                            "location_name": LOCATION,
                        }
                    }
                ]
            }
        )
    )
    meta_url = f"sqlite:///{home / 'meta.db'}"
    env = {
        **os.environ,
        "CONVEYOR_HOME": str(home),
        "CONVEYOR_META_URL": meta_url,
        "CONVEYOR_CONNECTORS_DIR": str(connectors),
        "CONVEYOR_KAFKA_BOOTSTRAP": tansu,
        "CONVEYOR_SPARK_REMOTE": spark_remote,
        "DAGSTER_HOME": str(dagster_home),
        # RabbitMQ's default user's password, referred to by the RabbitMQ sink's URL (a literal
        # password in a URL is refused).
        "CONVEYOR_E2E_AMQP_PASSWORD": "guest",
        # The SCRAM user's password of the Apache Kafka broker (tests/apache_kafka.py).
        "CONVEYOR_E2E_KAFKA_PASSWORD": "conveyor-secret",
    }
    port = free_port()
    webserver = str(Path(sys.executable).parent / "dagster-webserver")
    log = open(home / "webserver.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [webserver, "-w", str(home / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
        cwd=home,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: port_open("127.0.0.1", port) or proc.poll() is not None,
            300,
            "dagster-webserver",
        )
        if proc.poll() is not None:
            raise RuntimeError(
                f"dagster-webserver exited: {(home / 'webserver.log').read_text()[-3000:]}"
            )
        yield DagsterHarness(home, dagster_home, connectors, env, port, proc, meta_url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_processes_of(home)
        log.close()


class DevStack:
    """A ``dagster dev`` (webserver, daemon: sensors fire) started by :func:`dagster_dev_workspace`."""

    def __init__(self, cwd: Path, proc: subprocess.Popen[bytes], env: dict[str, str]):
        self.cwd, self.proc, self.env = cwd, proc, env
        self.home = cwd / ".conveyor"

    def log(self) -> str:
        return (self.cwd / "dagster-dev.log").read_text(errors="replace")[-4000:]

    def instance(self) -> Any:
        from dagster import DagsterInstance

        return DagsterInstance.from_config(str(self.home / "dagster"))


@contextlib.contextmanager
def dagster_dev_workspace(
    tansu: str,
    spark_remote: str,
    spec: dict[str, Any],
    *,
    extra_locations: list[dict[str, Any]] | None = None,
    extra_env: dict[str, str] | None = None,
    prefix: str = "conveyor-dev-e2e-",
) -> Iterator[DevStack]:
    """``dagster dev`` (webserver and daemon: the scheduler and every sensor) over a workspace of
    Conveyor's code location and ``extra_locations`` (a user's), with a fresh home holding
    ``spec``; the home and its processes removed afterwards, the log printed on a failure."""
    from conveyor.control.devserver import dagster_yaml

    cwd = Path(tempfile.mkdtemp(prefix=prefix))
    home = cwd / ".conveyor"
    for d in ("connectors", "dagster", "logs"):
        (home / d).mkdir(parents=True)
    (home / "dagster" / "dagster.yaml").write_text(dagster_yaml([("local", 8)]))
    (home / "connectors" / f"{spec['name']}.yaml").write_text(yaml.safe_dump(spec))
    locations = [{"python_module": {"module_name": "conveyor.dagster.definitions"}}]
    (cwd / "workspace.yaml").write_text(
        yaml.safe_dump({"load_from": locations + list(extra_locations or [])})
    )
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "DAGSTER_"))},
        "CONVEYOR_HOME": str(home),
        "CONVEYOR_KAFKA_BOOTSTRAP": tansu,
        "CONVEYOR_SPARK_REMOTE": spark_remote,
        "DAGSTER_HOME": str(home / "dagster"),
        "CONVEYOR_DAGSTER_URL": f"http://127.0.0.1:{port}",
        **(extra_env or {}),
    }
    dagster_exe = str(Path(sys.executable).parent / "dagster")
    log = open(cwd / "dagster-dev.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [dagster_exe, "dev", "-w", str(cwd / "workspace.yaml"), "-p", str(port), "-h", "127.0.0.1"],
        cwd=cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    stack = DevStack(cwd, proc, env)
    try:
        wait_for(
            lambda: port_open("127.0.0.1", port) or proc.poll() is not None, 300, "dagster dev"
        )
        assert proc.poll() is None, stack.log()
        yield stack
    except BaseException:
        print((cwd / "dagster-dev.log").read_text(errors="replace")[-6000:])
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        kill_processes_of(home)
        log.close()
        shutil.rmtree(cwd, ignore_errors=True)


@pytest.fixture(scope="session")
def dagster(
    tmp_path_factory: pytest.TempPathFactory, tansu: str, spark_remote: str
) -> Iterator[DagsterHarness]:
    with dagster_webserver(tmp_path_factory.mktemp("conveyor_home"), tansu, spark_remote) as h:
        yield h


def produce(
    bootstrap: str, topic: str, n: int, *, partitions: int = 2, start: int = 0, payload: Any = None
) -> None:
    """Create ``topic`` (if new) and produce ``n`` JSON messages with ids start..start+n-1."""
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    with contextlib.suppress(TopicAlreadyExistsError):
        admin.create_topics([NewTopic(topic, partitions, 1)])
    admin.close()
    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=10)
    sent = []
    for i in range(start, start + n):
        value = (
            payload(i)
            if payload
            else json.dumps({"id": i, "name": f"name {i}", "amount": i * 1.5}).encode()
        )
        sent.append(p.send(topic, key=str(i).encode(), value=value, partition=i % partitions))
    p.flush()
    # flush() does not raise for a record that could not be delivered: every record is
    # checked, so a loaded broker shows as an error here, not as "lost" messages later.
    for future in sent:
        future.get(timeout=SETTLE_S)
    p.close()
