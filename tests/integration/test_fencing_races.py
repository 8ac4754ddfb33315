"""Fencing on every operator path, raced against zombies, on SQLite and PostgreSQL.

Each race starts the operator's command (stop, offsets reset, state reset, delete, pause)
and a zombie (a run or partition task of the generation being fenced, on its own meta-store
handle and thread) at the same moment, 20 times over. The zombie commits or heartbeats in
a loop until it is refused, and tries once more after the operator's command returned: it
must always be refused, and the operator's result must stand. Then two concurrent
``POST /connectors`` of one name against a served API: exactly one 201, the other 409.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from conveyor.config.specs import load_source, sync_one
from conveyor.control.operations import OFFSETS_RESET, NotFoundError, Operations
from conveyor.core.errors import FencedError
from conveyor.core.host.ports import free_port, port_open
from conveyor.core.model import ConnectorStatus, DesiredState, TopicPartition
from conveyor.core.planning import tasks as tk
from conveyor.core.planning.state import StateChange
from conveyor.store.meta import MetaStore, UnknownConnectorError
from conveyor.store.tasks import TaskStore
from tests.integration.test_store import store  # noqa: F401  (the parametrized fixture)

ROUNDS = 20
TP = TopicPartition("orders", 0)
PARTS = [TopicPartition("orders", i) for i in range(4)]
POLICY = tk.TaskPolicy(min_tasks=1, max_tasks=3)
BROKERS = [tk.BrokerSlot("b1", free=5)]
REFUSED = (FencedError, UnknownConnectorError)


# -- the race --------------------------------------------------------------------------


@dataclass
class Outcome:
    result: Any
    zombie: BaseException | str
    zombie_writes: int


def race(operator: Callable[[], Any], zombie: Callable[[], None]) -> Outcome:
    """``operator()`` once, ``zombie()`` in a loop on another thread, started together.

    The zombie steps until refused (FencedError or UnknownConnectorError), or until it
    stepped once after the operator returned (then it "survived")."""
    barrier = threading.Barrier(2)
    done = threading.Event()
    seen: dict[str, Any] = {"writes": 0}

    def run_zombie() -> None:
        barrier.wait(30)
        try:
            while True:
                after = done.is_set()
                zombie()
                seen["writes"] += 1
                if after:
                    seen["end"] = "survived"
                    return
        except BaseException as e:  # noqa: BLE001 - the outcome is asserted by the test
            seen["end"] = e

    thread = threading.Thread(target=run_zombie, daemon=True)
    thread.start()
    barrier.wait(30)
    try:
        result = operator()
    finally:
        done.set()
    thread.join(120)
    assert not thread.is_alive(), "the zombie did not end"
    return Outcome(result, seen["end"], seen["writes"])


def assert_refused(o: Outcome) -> None:
    assert isinstance(o.zombie, REFUSED), f"the zombie was not refused: {o.zombie!r}"


@pytest.fixture
def handles(
    store: MetaStore,  # noqa: F811
    tmp_path: Path,
) -> Iterator[tuple[MetaStore, MetaStore, Operations]]:
    """The operator's store and Operations, and the zombie's own handle on the same store."""
    store.ensure_schema()
    zombie = MetaStore(store.url)
    try:
        yield store, zombie, Operations(store, directory=tmp_path, actor="the test")
    finally:
        zombie.close()


def add(meta: MetaStore, name: str) -> None:
    meta.sync_spec(name, spec_json=f'{{"name": "{name}"}}', spec_hash="h", source="t", error=None)


def claimed(meta: MetaStore, name: str, *, heartbeat: bool) -> int:
    """A run claims the connector (a launch by hand); with ``heartbeat`` it is Running."""
    add(meta, name)
    claim = meta.claim(name, run_id=f"run-{name}", expected_generation=None, holder_alive=_no)
    meta.commit(name, claim.generation, {TP: 50})
    if heartbeat:
        meta.heartbeat(name, claim.generation, {})
        assert meta.get(name).status == ConnectorStatus.RUNNING
    return claim.generation


def _no(_row: Any) -> bool:
    return False


def tasks_running(meta: MetaStore, name: str) -> tuple[TaskStore, tk.TaskPolicy, Any]:
    """A connector run as partition tasks: task 0 owns every partition and heartbeats."""
    add(meta, name)
    ts = TaskStore(meta)
    group, epoch = ts.load_group(name, POLICY, PARTS)
    plan = tk.plan_tasks([group], BROKERS, meta.clock())
    ts.apply(name, plan.for_connector(name), expected_epoch=epoch)
    grant = ts.heartbeat(name, 0, 1)
    assert set(grant.owned) == set(PARTS)
    ts.commit(name, 0, 1, {p: 50 for p in PARTS}, grant.owned)
    meta.apply(name, None, StateChange(status=ConnectorStatus.RUNNING), "tasks: 1 heartbeating")
    return ts, POLICY, grant


# -- stop, then an offsets reset -----------------------------------------------------------


def test_stop_fences_a_run_that_claimed_but_never_heartbeated(handles) -> None:
    meta, zombie_store, ops = handles
    for i in range(ROUNDS):
        name = f"claimed_{i}"
        gen = claimed(meta, name, heartbeat=False)

        def zombie(name: str = name, gen: int = gen, i: int = i) -> None:
            zombie_store.commit(name, gen, {TP: 1000 + i})  # a batch before its first heartbeat

        o = race(lambda name=name: ops.stop(name), zombie)
        assert_refused(o)
        with pytest.raises(FencedError):  # its first heartbeat comes too late to show Running
            zombie_store.heartbeat(name, gen, {})
        row = meta.get(name)
        assert (row.status, row.desired) == (ConnectorStatus.STOPPED, DesiredState.STOPPED)
        assert row.generation == gen + 1 and o.result.generation == gen + 1
        assert ops.reset_offsets(name) == {"message": OFFSETS_RESET}
        assert meta.committed_offsets(name) == {}
        with pytest.raises(FencedError):
            zombie_store.commit(name, gen, {TP: 1})
        assert meta.committed_offsets(name) == {}, f"round {i}: the reset was undone"


def test_stop_fences_every_partition_task(handles) -> None:
    meta, zombie_store, ops = handles
    zombie_tasks = TaskStore(zombie_store)
    for i in range(ROUNDS):
        name = f"tasks_{i}"
        ts, _, grant = tasks_running(meta, name)

        def zombie(name: str = name, grant: Any = grant, i: int = i) -> None:
            zombie_tasks.commit(name, 0, 1, {p: 2000 + i for p in PARTS}, grant.owned)
            zombie_tasks.heartbeat(name, 0, 1)

        o = race(lambda name=name: ops.stop(name), zombie)
        assert_refused(o)
        row = meta.get(name)
        assert (row.status, row.desired) == (ConnectorStatus.STOPPED, DesiredState.STOPPED)
        (task,) = ts.tasks(name)
        assert task.generation == 2 and task.heartbeat_at is None and task.run_id is None
        assert ops.reset_offsets(name) == {"message": OFFSETS_RESET}
        with pytest.raises(FencedError):
            zombie_tasks.commit(name, 0, 1, {PARTS[0]: 1}, grant.owned)
        assert meta.committed_offsets(name) == {}, f"round {i}: the reset was undone"
        assert ts.tasks(name)[0].generation == 3  # and the reset fenced them again


def test_a_live_run_drains_on_stop_and_its_stuck_thread_cannot_undo_a_reset(handles) -> None:
    """A Running run is left to stop itself (its last commit lands); once it released the
    connector, an offsets reset fences whatever thread of it is still under way."""
    meta, zombie_store, ops = handles
    for i in range(ROUNDS):
        name = f"live_{i}"
        gen = claimed(meta, name, heartbeat=True)
        row = ops.stop(name)
        assert (row.status, row.desired, row.generation) == (
            ConnectorStatus.RUNNING,
            DesiredState.STOPPED,
            gen,
        )
        assert zombie_store.heartbeat(name, gen, {}).desired == DesiredState.STOPPED
        zombie_store.commit(name, gen, {TP: 60})  # the batch in flight, committed on the way out
        assert zombie_store.release(name, gen, ConnectorStatus.STOPPED, "stopped")
        want = {TP: 7 + i}

        def operator(name: str = name, want: dict = want) -> dict[str, str]:
            return ops.alter_offsets(
                name,
                {
                    "offsets": [
                        {
                            "partition": {"kafka_topic": tp.topic, "kafka_partition": tp.partition},
                            "offset": {"kafka_offset": off},
                        }
                        for tp, off in want.items()
                    ]
                },
            )

        def zombie(name: str = name, gen: int = gen, i: int = i) -> None:
            zombie_store.commit(name, gen, {TP: 3000 + i})

        o = race(operator, zombie)
        assert_refused(o)
        assert meta.committed_offsets(name) == want, f"round {i}: the reset was undone"
        assert meta.get(name).status == ConnectorStatus.STOPPED


def test_a_source_state_reset_stands_against_a_zombie_save(handles) -> None:
    meta, zombie_store, ops = handles
    for i in range(ROUNDS):
        name = f"source_{i}"
        gen = claimed(meta, name, heartbeat=True)
        meta.save_source_state(name, gen, {"id": 10}, version=1)
        ops.stop(name)
        assert zombie_store.release(name, gen, ConnectorStatus.STOPPED, "stopped")

        def zombie(name: str = name, gen: int = gen, i: int = i) -> None:
            zombie_store.save_source_state(name, gen, {"id": 4000 + i}, version=1)

        o = race(lambda name=name: ops.reset_source_state(name), zombie)
        assert_refused(o)
        assert o.result == {"name": name, "reset": True}
        assert meta.source_state(name) is None, f"round {i}: the state reset was undone"


# -- delete -------------------------------------------------------------------------------


def test_deleted_stays_deleted_against_zombie_runs_and_tasks(handles) -> None:
    meta, zombie_store, ops = handles
    zombie_tasks = TaskStore(zombie_store)
    for i in range(ROUNDS):
        name = f"gone_{i}"
        gen = claimed(meta, name, heartbeat=False)  # Idle: deletable, its run not fenced
        ts, _, grant = tasks_running(meta, f"{name}_t")
        # Stopped without fencing its task (as a stop did before): only the delete fences it.
        meta.apply(f"{name}_t", None, StateChange.release(ConnectorStatus.STOPPED), "stopped")

        def operator(name: str = name) -> None:
            ops.delete(name)
            ops.delete(f"{name}_t")

        def zombie(name: str = name, gen: int = gen, grant: Any = grant, i: int = i) -> None:
            zombie_store.commit(name, gen, {TP: 5000 + i})
            zombie_store.save_source_state(name, gen, {"id": 1}, version=1)
            zombie_tasks.commit(f"{name}_t", 0, 1, {PARTS[0]: 5000}, grant.owned)
            zombie_tasks.heartbeat(f"{name}_t", 0, 1)

        o = race(operator, zombie)
        assert_refused(o)
        assert not zombie_store.release(name, gen, ConnectorStatus.STOPPED, "late")
        with pytest.raises(FencedError):
            zombie_store.heartbeat(name, gen, {"messages_out": 1})
        for n in (name, f"{name}_t"):
            with pytest.raises(UnknownConnectorError):
                meta.get(n)
            assert meta.committed_offsets(n) == {}
            assert meta.source_state(n) is None
            assert ts.tasks(n) == []
        assert name not in {r.name for r in meta.list()}
        assert name not in ts.connectors() and f"{name}_t" not in ts.connectors()


def test_a_spec_sync_that_read_the_file_before_the_delete_does_not_bring_it_back(
    handles, tmp_path: Path, file_root: Path
) -> None:
    """The scheduler's scan read the file, the delete removed file and row, then the scan
    syncs what it read: the connector stays deleted (raced 20 times, then once in order)."""
    meta, zombie_store, ops = handles
    for i in range(ROUNDS):
        name = f"scanned_{i}"
        ops.put_config(name, local_spec(tmp_path))
        stale = load_source(name, str(tmp_path / f"{name}.yaml"))  # read by the scan
        assert stale.ok, stale.error

        def zombie(stale: Any = stale) -> None:
            sync_one(zombie_store, stale)

        o = race(lambda name=name: ops.delete(name), zombie)
        assert_refused(o)
        with pytest.raises(UnknownConnectorError):
            meta.get(name)
        assert not (tmp_path / f"{name}.yaml").exists()


# -- pause --------------------------------------------------------------------------------


def test_pause_is_checked_not_fenced(handles) -> None:
    """A pause keeps the run's generation (it reads nothing, and goes on heartbeating); a
    zombie of an older generation is refused; a deleted connector cannot be paused back."""
    meta, zombie_store, ops = handles
    for i in range(ROUNDS):
        name = f"paused_{i}"
        old = claimed(meta, name, heartbeat=True)
        gen = meta.claim(
            name, run_id=f"new-{i}", expected_generation=None, holder_alive=_no
        ).generation
        assert gen == old + 1

        def zombie(name: str = name, old: int = old) -> None:
            zombie_store.heartbeat(name, old, {}, status=ConnectorStatus.RUNNING)

        o = race(lambda name=name: ops.pause(name), zombie)
        assert_refused(o)
        assert o.result.desired == DesiredState.PAUSED and o.result.generation == gen
        assert zombie_store.heartbeat(name, gen, {}).desired == DesiredState.PAUSED
    ops.stop("paused_0")
    zombie_store.release("paused_0", meta.get("paused_0").generation, ConnectorStatus.STOPPED, "")
    ops.delete("paused_0")
    with pytest.raises(NotFoundError):
        ops.pause("paused_0")
    with pytest.raises(UnknownConnectorError):
        meta.get("paused_0")


# -- create --------------------------------------------------------------------------------


def local_spec(d: Path, prefix: str = "out") -> dict[str, Any]:
    return {
        "source": {"topics": ["orders"]},
        "sink": {"type": "localfile", "path": str(d / "out"), "prefix": prefix},
    }


@dataclass
class Served:
    url: str
    connectors: Path
    store: MetaStore
    token: str

    def post(self, body: Any) -> requests.Response:
        return requests.post(
            self.url + "/connectors",
            json=body,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=60,
        )


@pytest.fixture
def served(store: MetaStore, tmp_path: Path) -> Iterator[Served]:  # noqa: F811
    """``conveyor serve`` in a subprocess over the parametrized meta store."""
    store.ensure_schema()
    connectors = tmp_path / "connectors"
    connectors.mkdir()
    token = "fencing-t0ken"
    (tmp_path / "token").write_text(token + "\n")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")},
        "CONVEYOR_HOME": str(tmp_path),
        "CONVEYOR_META_URL": store.url,
        "CONVEYOR_CONNECTORS_DIR": str(connectors),
    }
    port = free_port()
    log = tmp_path / "api.log"
    exe = str(Path(sys.executable).parent / "conveyor")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [exe, "serve", "--port", str(port), "--token-file", str(tmp_path / "token")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not port_open("127.0.0.1", port) and proc.poll() is None:
            assert time.monotonic() < deadline, "the API did not start: " + log.read_text()
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()
        yield Served(f"http://127.0.0.1:{port}", connectors, store, token)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)


def post_together(served: Served, bodies: list[Any]) -> list[requests.Response | None]:
    """POST each body on its own thread, released at once."""
    barrier = threading.Barrier(len(bodies))
    answers: list[requests.Response | None] = [None] * len(bodies)

    def post(k: int) -> None:
        barrier.wait(30)
        answers[k] = served.post(bodies[k])

    threads = [threading.Thread(target=post, args=(k,)) for k in range(len(bodies))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    return answers


def test_concurrent_creates_of_one_name_one_201_one_409(served: Served, tmp_path: Path) -> None:
    for i in range(ROUNDS):
        name = f"twin_{i}"
        bodies = [
            {"name": name, "config": local_spec(tmp_path, prefix=f"first{i}")},
            {"name": name, "config": local_spec(tmp_path, prefix=f"second{i}")},
        ]
        answers = post_together(served, bodies)
        assert all(a is not None for a in answers)
        codes = sorted(a.status_code for a in answers if a is not None)
        assert codes == [201, 409], [(a.status_code, a.text) for a in answers if a is not None]
        won = next(k for k, a in enumerate(answers) if a is not None and a.status_code == 201)
        lost = answers[1 - won]
        assert lost is not None and "already exists" in lost.json()["message"]
        on_disk = yaml.safe_load((served.connectors / f"{name}.yaml").read_text())
        assert on_disk["sink"]["prefix"] == bodies[won]["config"]["sink"]["prefix"]
        row = served.store.get(name)
        assert row.spec is not None and row.spec["sink"]["prefix"] == on_disk["sink"]["prefix"]
        assert [h.reason for h in served.store.history(name)].count("created") == 1
    leftovers = [p.name for p in served.connectors.iterdir() if p.suffix != ".yaml"]
    assert leftovers == []  # no file written aside is left behind


def test_a_name_outside_the_allowed_set_is_refused_naming_the_field(
    served: Served, tmp_path: Path
) -> None:
    for bad in ["orders\n", "orders\r\n", "\norders", "Orders", "or ders", "orders\x00", "ö"]:
        r = served.post({"name": bad, "config": local_spec(tmp_path)})
        assert r.status_code == 400, (bad, r.text)
        message = r.json()["message"]
        assert "name" in message and "must match" in message, message
        assert repr(bad) in message  # the value, escaped: a newline shows as \\n
    # In the path of a PUT, too (%0A is a newline).
    r = requests.put(
        served.url + "/connectors/orders%0A/config",
        json=local_spec(tmp_path),
        headers={"Authorization": f"Bearer {served.token}"},
        timeout=60,
    )
    assert r.status_code == 400 and "must match" in r.json()["message"], r.text
    assert list(served.connectors.iterdir()) == []
    assert served.store.list() == []
