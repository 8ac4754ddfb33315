"""The fork-server run launcher: Dagster runs forked from Conveyor's warm run server
(``runserver.py``) instead of spawned by the code server (issue 47, light runs).

In ``dagster.yaml`` (``conveyor dev`` writes it unless ``CONVEYOR_RUN_LAUNCHER=default``)::

    run_launcher:
      module: conveyor.dagster.launcher
      class: ForkServerRunLauncher
      config:
        socket: /path/to/runserver.sock   # default: $DAGSTER_HOME/runserver.sock

The run server must be running (``python -m conveyor.dagster.runserver --socket PATH``):
a launch without it fails with a message that says so.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dagster import DagsterRun, Field, StringSource
from dagster._core.errors import DagsterLaunchFailedError
from dagster._core.launcher import (
    CheckRunHealthResult,
    LaunchRunContext,
    RunLauncher,
    WorkerStatus,
)
from dagster._serdes import ConfigurableClass, ConfigurableClassData, serialize_value

SOCKET_NAME = "runserver.sock"
RUN_PID_TAG = "conveyor/run_pid"
CONNECT_TIMEOUT_S = 10.0


def default_socket() -> Path:
    """``$DAGSTER_HOME/runserver.sock``."""
    return Path(os.environ.get("DAGSTER_HOME", ".")) / SOCKET_NAME


class RunServerUnreachable(Exception):
    """The run server does not answer on its socket."""


def ask(socket_path: Path, request: dict[str, Any], timeout_s: float = CONNECT_TIMEOUT_S) -> Any:
    """One request to the run server, its JSON reply; RunServerUnreachable when it is gone."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(socket_path))
            s.sendall(json.dumps(request).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
    except OSError as e:
        raise RunServerUnreachable(f"no run server on {socket_path}: {e}") from e
    if not buf:
        raise RunServerUnreachable(f"the run server on {socket_path} closed without a reply")
    return json.loads(buf)


class ForkServerRunLauncher(RunLauncher, ConfigurableClass):
    """Launches each run as a child forked by the run server; terminates it with SIGINT."""

    def __init__(self, socket: str | None = None, inst_data: ConfigurableClassData | None = None):
        self._socket = Path(socket) if socket else None
        self._inst_data = inst_data
        super().__init__()

    @property
    def socket_path(self) -> Path:
        return self._socket or default_socket()

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self._inst_data

    @classmethod
    def config_type(cls) -> dict[str, Any]:
        return {"socket": Field(StringSource, is_required=False)}

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]
    ) -> ForkServerRunLauncher:
        return cls(inst_data=inst_data, **config_value)

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        request = {
            "op": "start",
            "run_id": run.run_id,
            "instance_ref": serialize_value(self._instance.get_ref()),
        }
        try:
            reply = ask(self.socket_path, request)
        except RunServerUnreachable as e:
            raise DagsterLaunchFailedError(
                f"{e}. Start it (python -m conveyor.dagster.runserver --socket "
                f"{self.socket_path}) or use Dagster's DefaultRunLauncher."
            ) from e
        if not reply.get("ok"):
            raise DagsterLaunchFailedError(f"the run server refused the run: {reply.get('error')}")
        self._instance.add_run_tags(run.run_id, {RUN_PID_TAG: str(reply["pid"])})
        self._instance.report_engine_event(
            f"Forked by the run server (pid {reply['pid']}).", run, cls=self.__class__
        )

    def terminate(self, run_id: str) -> bool:
        run = self._instance.get_run_by_id(run_id)
        if not run or run.is_finished:
            return False
        self._instance.report_run_canceling(run)
        try:
            reply = ask(self.socket_path, {"op": "terminate", "run_id": run_id})
            if not reply.get("ok"):
                # Its process had ended already (the run's own end raced the terminate):
                # nothing will end the CANCELING it was just given.
                gone = ask(self.socket_path, {"op": "status", "run_id": run_id})
                if gone.get("state") == "exited":
                    self._instance.report_run_canceled(
                        run, message="The run process had ended when it was terminated."
                    )
        except RunServerUnreachable as e:
            self._instance.report_engine_event(
                f"Could not ask the run server to terminate the run: {e}", run, cls=self.__class__
            )
            return False
        return bool(reply.get("ok"))

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        try:
            reply = ask(self.socket_path, {"op": "status", "run_id": run.run_id})
        except RunServerUnreachable as e:
            # Its children die with it (runserver.die_with_parent).
            return CheckRunHealthResult(WorkerStatus.FAILED, str(e))
        return health(reply)


def health(reply: Mapping[str, Any]) -> CheckRunHealthResult:
    """The run server's status reply as Dagster's run monitoring reads it."""
    state = reply.get("state")
    if state == "running":
        return CheckRunHealthResult(WorkerStatus.RUNNING, run_worker_id=str(reply.get("pid")))
    if state == "exited":
        code = reply.get("code")
        if code == 0:
            return CheckRunHealthResult(WorkerStatus.SUCCESS)
        return CheckRunHealthResult(WorkerStatus.FAILED, f"the run process exited with {code}")
    return CheckRunHealthResult(WorkerStatus.NOT_FOUND, "the run server does not know this run")
