"""Issue 47: ``conveyor dev`` stopped while runs are queued leaves nothing of its home behind.

Before, the daemon launched a queued run while the connector runs were being stopped; that
run, its code server and its log tails outlived ``conveyor dev`` for minutes. Here the demo
connector runs, and a user's job tagged ``conveyor/maintenance`` (a tag limit of 1 in the
instance ``conveyor dev`` writes) is requested three times by its sensor: one run holds the
slot, two wait in the queue. Ctrl-C must pause the daemon before it stops any run, cancel the
two queued runs (never launched), stop the connector run and the user's run, and leave no
process whose command line, working directory or environment refers to the home.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from conveyor.core.host.ports import free_port, port_open
from conveyor.core.model import ConnectorStatus
from conveyor.store.meta import MetaStore, UnknownConnectorError
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

DEMO = "demo_orders"
USER_DEFS = """\
import time

import dagster as dg


@dg.op
def hold() -> None:
    while True:  # until terminated
        time.sleep(0.5)


@dg.job(tags={"conveyor/maintenance": "user"}, executor_def=dg.in_process_executor)
def hold_job() -> None:
    hold()


@dg.sensor(job=hold_job, default_status=dg.DefaultSensorStatus.RUNNING, minimum_interval_seconds=1)
def three_holds(context):
    return [dg.RunRequest(run_key=str(i)) for i in range(3)]


defs = dg.Definitions(jobs=[hold_job], sensors=[three_holds])
"""


def refers_to(p: psutil.Process, home: str) -> str | None:
    """What of ``p`` names ``home`` (its command line, working directory or environment)."""
    try:
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        if any(home in a for a in p.cmdline()):
            return f"cmdline {' '.join(p.cmdline())[:200]}"
        if p.cwd().startswith(home):
            return f"cwd {p.cwd()}"
        env = p.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    hits = [f"{k}={v}" for k, v in env.items() if home in v]
    return f"environ {hits}" if hits else None


def left_of(home: Path) -> dict[int, str]:
    me = os.getpid()
    out = {}
    for p in psutil.process_iter():
        if p.pid != me and (why := refers_to(p, str(home))):
            out[p.pid] = why
    return out


def hold_runs(instance: Any) -> dict[str, list[Any]]:
    by_status: dict[str, list[Any]] = {}
    for rec in instance.get_run_records():
        if rec.dagster_run.job_name == "hold_job":
            by_status.setdefault(rec.dagster_run.status.value, []).append(rec)
    return by_status


def test_ctrl_c_with_runs_queued_leaves_no_process_of_its_home() -> None:
    from dagster import DagsterInstance

    cwd = Path(tempfile.mkdtemp(prefix="conveyor-dev-stop-"))
    home = cwd / ".conveyor"
    ports = {"kafka": free_port(), "ui": free_port(), "spark": free_port(), "api": free_port()}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CONVEYOR_", "DAGSTER_HOME")) or k == "CONVEYOR_TEST_PG_URL"
    }
    (cwd / "my_defs.py").write_text(USER_DEFS)
    exe = str(Path(sys.executable).parent / "conveyor")
    log_path = cwd / "conveyor-dev.log"
    log = open(log_path, "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [exe, "dev", "--kafka-port", str(ports["kafka"]), "--port", str(ports["ui"])]
        + ["--spark-port", str(ports["spark"]), "--api-port", str(ports["api"]), "--rate", "20"]
        + ["--defs", "my_defs.py"],
        cwd=cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    instance = None
    try:
        wait_for(
            lambda: port_open("127.0.0.1", ports["ui"]) or proc.poll() is not None,
            300,
            "the Dagster UI",
        )
        assert proc.poll() is None, log_path.read_text()[-4000:]
        store = MetaStore(f"sqlite:///{home / 'meta.db'}")
        instance = DagsterInstance.from_config(str(home / "dagster"))

        def demo_running() -> bool:
            try:
                return store.get(DEMO).status == ConnectorStatus.RUNNING
            except UnknownConnectorError:
                return False

        wait_for(demo_running, 600, "the demo connector Running")
        # One user run holds the maintenance slot, two wait in the queue.
        wait_for(
            lambda: (
                len(hold_runs(instance).get("STARTED", [])) == 1
                and len(hold_runs(instance).get("QUEUED", [])) == 2
            ),
            300,
            "one hold_job run started and two queued",
        )
        queued = [r.dagster_run.run_id for r in hold_runs(instance)["QUEUED"]]
        run_pid = store.get(DEMO).run_pid
        assert run_pid and left_of(home), "conveyor dev's processes should hold its home"

        began = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(300) == 0, log_path.read_text()[-6000:]
        text = log_path.read_text(errors="replace")
        stop_log = [line for line in text.splitlines() if line.startswith("conveyor dev:")]
        print(f"stopped in {time.monotonic() - began:.1f} s:", *stop_log[-30:], sep="\n")
        assert "all processes stopped" in text
        # The daemon was paused before any run was stopped.
        assert text.index("paused: no queued run starts") < text.index(
            f"stopping connector {DEMO}"
        ), text[-6000:]
        assert "2 queued run(s) canceled" in text
        # Nothing is left that holds the home: no run, code server, log tail, server.
        assert left_of(home) == {}
        assert not psutil.pid_exists(run_pid) or (
            psutil.Process(run_pid).status() == psutil.STATUS_ZOMBIE
        )
        for name, port in ports.items():
            assert not port_open("127.0.0.1", port), f"{name} still listening on {port}"
        # The queued runs were canceled without ever being launched.
        for run_id in queued:
            rec = instance.get_run_record_by_id(run_id)
            assert rec.dagster_run.status.value == "CANCELED" and rec.start_time is None
        assert not hold_runs(instance).get("STARTED")
        # The demo connector stays meant to run at the next start.
        row = store.get(DEMO)
        assert row.desired.value == "running" and row.status != ConnectorStatus.RUNNING, row
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in left_of(home):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        if instance is not None:
            instance.dispose()
        log.close()
        shutil.rmtree(cwd, ignore_errors=True)
