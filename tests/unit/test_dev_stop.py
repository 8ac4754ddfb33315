"""``conveyor dev``'s stop: which processes belong to its home (``core.host.processes``), and a run
whose parent is gone stopping itself (``jobs.runs.CancelWatch``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conveyor.core.host import processes
from conveyor.core.host.processes import children_of, holds, parent_of, processes_holding


def sleeper(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.stdin.read()", *args],
        env={**os.environ, **env},
        stdin=subprocess.PIPE,
    )


def test_a_process_holds_a_home_through_its_environment_or_its_arguments(tmp_path: Path) -> None:
    home = tmp_path / "home"
    other = tmp_path / "home2"  # a sibling whose name starts the same is not the home
    by_env = sleeper(tmp_path, {"CONVEYOR_HOME": str(home)})
    by_dagster_home = sleeper(tmp_path, {"DAGSTER_HOME": str(home / "dagster")})
    by_arg = sleeper(tmp_path, {}, f"--log={home / 'logs' / 'x.log'}")
    unrelated = sleeper(tmp_path, {"CONVEYOR_HOME": str(other)}, str(other))
    procs = [by_env, by_dagster_home, by_arg, unrelated]
    try:
        assert [holds(p.pid, home) for p in procs] == [True, True, True, False]
        found = processes_holding(home)
        assert {by_env.pid, by_dagster_home.pid, by_arg.pid} <= set(found)
        assert unrelated.pid not in found and os.getpid() not in found
        assert parent_of(by_env.pid) == os.getpid()
        assert {p.pid for p in procs} <= set(children_of(os.getpid()))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert processes_holding(home) == []


def test_this_process_and_its_ancestors_are_never_swept(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(processes, "holds", lambda pid, home: True)
    assert not set(processes_holding(tmp_path)) & processes.ancestors_of(os.getpid())


class FakeContext:
    def __init__(self, status: str = "STARTED"):
        from dagster import DagsterRunStatus

        self.run_id = "r1"
        self.warnings: list[str] = []
        self.log = SimpleNamespace(
            warning=self.warnings.append, debug=lambda _m: None, info=lambda _m: None
        )
        run = SimpleNamespace(status=DagsterRunStatus(status))
        self.instance = SimpleNamespace(get_run_by_id=lambda _id: run)


def test_a_run_whose_parent_is_gone_stops_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.dagster.jobs import runs

    monkeypatch.setattr(runs, "hold_interrupts", lambda: None)
    ctx = FakeContext()
    watch = runs.cancel_requested(ctx, every_s=0.0)  # type: ignore[arg-type]
    assert not watch() and not watch.orphaned
    monkeypatch.setattr(runs.os, "getppid", lambda: 1)  # reparented: its parent died
    assert watch() and watch.orphaned
    assert "parent process" in ctx.warnings[0]
    assert watch()  # stays stopped


def test_a_canceling_run_stops_as_a_terminate(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.dagster.jobs import runs

    monkeypatch.setattr(runs, "hold_interrupts", lambda: None)
    watch = runs.cancel_requested(FakeContext("CANCELING"), every_s=0.0)  # type: ignore[arg-type]
    assert watch() and not watch.orphaned


def test_an_orphaned_run_is_fenced_and_its_connector_stays_meant_to_run(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    import json

    from dagster import DagsterExecutionInterruptedError

    from conveyor.core.model import ConnectorStatus, DesiredState
    from conveyor.dagster.jobs import runs
    from conveyor.store.meta import MetaStore

    monkeypatch.setattr(runs, "hold_interrupts", lambda: None)
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    store.ensure_schema()
    store.sync_spec("a", spec_json=json.dumps({"name": "a"}), spec_hash="h", source="t", error=None)
    gen = store.assign("a", "b1", expected_generation=0, reason="test")
    assert gen is not None
    store.claim("a", run_id="r1", expected_generation=gen, holder_alive=lambda _r: False)
    store.heartbeat("a", gen, {})

    from conveyor.dagster.jobs.run_template import RunTemplate

    class Orphan(RunTemplate):
        def claim(self) -> bool:
            self.generation = gen
            return True

        def build_loop(self, ls, spec_hash, canceled):  # type: ignore[no-untyped-def]
            monkeypatch.setattr(runs.os, "getppid", lambda: 1)  # the code server died meanwhile
            assert canceled()
            raise DagsterExecutionInterruptedError()

    ls = SimpleNamespace(name="a", spec_hash=lambda: "h")
    with pytest.raises(DagsterExecutionInterruptedError):
        Orphan(FakeContext(), None, ls, store).execute()  # type: ignore[arg-type]
    row = store.get("a")
    assert (row.status, row.desired, row.broker_id) == (
        ConnectorStatus.IDLE,
        DesiredState.RUNNING,
        None,
    )
    assert row.generation == gen + 1  # fenced: nothing of the orphan commits from now on
    assert store.history("a", 1)[0].reason == runs.ORPHANED.format("r1")
