"""The fork-server run launcher (conveyor/dagster/launcher.py) with a real run server and a
real Dagster instance: a run completes, terminate stops one run and not another, a run whose
server is killed stops itself, a run's output reaches its compute log with no process of its
own beside it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from dagster import DagsterInstance, DagsterRunStatus, reconstructable
from dagster._core.launcher import WorkerStatus
from dagster._core.test_utils import instance_for_test

from conveyor.core.host.processes import pid_alive
from conveyor.dagster.launcher import RUN_PID_TAG, ForkServerRunLauncher, ask
from tests.e2e.conftest import wait_for
from tests.integration import runserver_jobs

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PRELOAD = "dagster._cli.api,tests.integration.runserver_jobs"


@contextlib.contextmanager
def run_server(sock: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {
        **os.environ,
        "CONVEYOR_RUNSERVER_PRELOAD": PRELOAD,
        "CONVEYOR_RUNSERVER_CODE_LOCATION": "",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [sys.executable, "-m", "conveyor.dagster.runserver", "--socket", str(sock)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _answers(sock) or proc.poll() is not None, 60, "the run server", 0.1)
        assert proc.poll() is None, log.read_text()
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers(sock: Path) -> bool:
    try:
        return bool(ask(sock, {"op": "ping"}, timeout_s=1).get("ok"))
    except Exception:  # noqa: BLE001 - not up yet
        return False


@pytest.fixture
def fork_instance(tmp_path: Path) -> Iterator[tuple[DagsterInstance, subprocess.Popen[bytes]]]:
    sock = tmp_path / "runserver.sock"
    launcher = {
        "module": "conveyor.dagster.launcher",
        "class": "ForkServerRunLauncher",
        "config": {"socket": str(sock)},
    }
    (tmp_path / "dh").mkdir()
    with (
        run_server(sock, tmp_path / "runserver.log") as server,
        instance_for_test(
            overrides={"run_launcher": launcher}, temp_dir=str(tmp_path / "dh")
        ) as inst,
    ):
        yield inst, server


def launch(instance: DagsterInstance, job: object, run_config: dict | None = None) -> str:
    recon = reconstructable(job)  # type: ignore[arg-type]
    run = instance.create_run_for_job(
        job_def=recon.get_definition(),
        run_config=run_config or {},
        job_code_origin=recon.get_python_origin(),
    )
    instance.launch_run(run.run_id, workspace=None)  # type: ignore[arg-type]
    return run.run_id


def status(instance: DagsterInstance, run_id: str) -> DagsterRunStatus:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    return run.status


def waiting(instance: DagsterInstance, tmp_path: Path, name: str) -> tuple[str, Path]:
    marker = tmp_path / f"{name}.started"
    config = {"ops": {"wait_for_interrupt": {"config": {"marker": str(marker)}}}}
    run_id = launch(instance, runserver_jobs.waiting_job, config)
    wait_for(marker.exists, 60, f"run {name} to start its op", 0.1)
    return run_id, marker


def run_pid(instance: DagsterInstance, run_id: str) -> int:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    return int(run.tags[RUN_PID_TAG])


def test_a_launched_run_completes(fork_instance: tuple[DagsterInstance, object]) -> None:
    instance, _ = fork_instance
    assert isinstance(instance.run_launcher, ForkServerRunLauncher)
    run_id = launch(instance, runserver_jobs.quick_job)
    wait_for(lambda: status(instance, run_id) == DagsterRunStatus.SUCCESS, 60, "success", 0.1)
    run = instance.get_run_by_id(run_id)
    assert run is not None
    pid = run_pid(instance, run_id)
    wait_for(lambda: not pid_alive(pid), 30, "the run process to exit", 0.1)
    assert instance.run_launcher.check_run_worker_health(run).status == WorkerStatus.SUCCESS


def test_terminate_stops_one_run_and_not_another(
    fork_instance: tuple[DagsterInstance, object], tmp_path: Path
) -> None:
    instance, _ = fork_instance
    first, _ = waiting(instance, tmp_path, "first")
    second, _ = waiting(instance, tmp_path, "second")
    try:
        assert instance.run_launcher.terminate(first)
        wait_for(lambda: status(instance, first) == DagsterRunStatus.CANCELED, 60, "cancel", 0.1)
        wait_for(lambda: not pid_alive(run_pid(instance, first)), 30, "first to exit", 0.1)
        assert status(instance, second) == DagsterRunStatus.STARTED
        other = instance.get_run_by_id(second)
        assert other is not None
        assert instance.run_launcher.check_run_worker_health(other).status == WorkerStatus.RUNNING
    finally:
        instance.run_launcher.terminate(second)
    wait_for(lambda: status(instance, second) == DagsterRunStatus.CANCELED, 60, "cancel 2", 0.1)


def test_a_runs_output_reaches_its_compute_log_with_no_tail_process(
    fork_instance: tuple[DagsterInstance, object], tmp_path: Path
) -> None:
    """Dagster's capture would mirror each stream through a ``tail -F`` and a Python watcher
    (four processes per run); a forked run writes its compute log files alone."""
    instance, _ = fork_instance
    run_id, _ = waiting(instance, tmp_path, "logged")
    pid = run_pid(instance, run_id)
    try:
        assert psutil.Process(pid).children(recursive=True) == []
        line = f"waiting for an interrupt: {run_id}"
        logs = tmp_path / "dh"
        wait_for(
            lambda: any(line in p.read_text() for p in logs.rglob("*.out")), 30, "the log", 0.1
        )
        assert line not in (tmp_path / "runserver.log").read_text()
    finally:
        instance.run_launcher.terminate(run_id)
    wait_for(lambda: status(instance, run_id) == DagsterRunStatus.CANCELED, 60, "cancel", 0.1)


def test_a_terminate_that_comes_after_the_runs_process_ended_ends_it_canceled(
    fork_instance: tuple[DagsterInstance, object],
) -> None:
    """The race of a connector that stops itself: its run ends, then the scheduler's terminate
    marks it CANCELING. With its process gone nothing else would end it."""
    instance, _ = fork_instance
    run_id = launch(instance, runserver_jobs.quick_job)
    wait_for(lambda: status(instance, run_id) == DagsterRunStatus.SUCCESS, 60, "success", 0.1)
    wait_for(lambda: not pid_alive(run_pid(instance, run_id)), 30, "the process to end", 0.1)
    run = instance.get_run_by_id(run_id)
    assert run is not None
    instance.report_run_canceling(run)  # the racing write: the run read as not finished
    assert status(instance, run_id) == DagsterRunStatus.CANCELING
    assert not instance.run_launcher.terminate(run_id)
    assert status(instance, run_id) == DagsterRunStatus.CANCELED


def test_a_run_whose_process_ends_while_canceling_is_not_left_canceling(
    fork_instance: tuple[DagsterInstance, object], tmp_path: Path
) -> None:
    """Marked CANCELING while its op was returning on its own: the run's process ends it."""
    instance, _ = fork_instance
    marker, end = tmp_path / "ending.started", tmp_path / "ending.end"
    config = {"ops": {"wait_for_end_file": {"config": {"marker": str(marker), "end": str(end)}}}}
    run_id = launch(instance, runserver_jobs.ending_job, config)
    wait_for(marker.exists, 60, "the run to start its op", 0.1)
    run = instance.get_run_by_id(run_id)
    assert run is not None
    instance.report_run_canceling(run)  # no interrupt reaches it: the op ends by itself
    end.write_text("end")
    wait_for(lambda: not pid_alive(run_pid(instance, run_id)), 60, "the process to end", 0.1)
    assert status(instance, run_id) in (DagsterRunStatus.CANCELED, DagsterRunStatus.SUCCESS)


def test_a_run_whose_server_dies_stops_itself(
    fork_instance: tuple[DagsterInstance, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    instance, server = fork_instance
    run_id, _ = waiting(instance, tmp_path, "orphan")
    pid = run_pid(instance, run_id)
    try:
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        wait_for(lambda: not pid_alive(pid), 60, "the orphaned run to stop itself", 0.1)
        # Interrupted without a terminate: Dagster ends the run FAILURE.
        wait_for(lambda: status(instance, run_id) == DagsterRunStatus.FAILURE, 30, "failure", 0.1)
        run = instance.get_run_by_id(run_id)
        assert run is not None
        assert instance.run_launcher.check_run_worker_health(run).status == WorkerStatus.FAILED
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
