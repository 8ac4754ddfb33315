"""One connector spread over partition tasks under a real ``dagster dev``.

A 6-partition topic receives a steady load; the scheduler splits the connector's one
task into three (a task's ceiling is set low in the spec, so the load exceeds it), a
``kill -9`` hits the first task in the middle of the first split, and when the load
stops the tasks are merged back into one. Every message is counted in PostgreSQL
(distinct ids), duplicates stay within one batch per handover, and the committed
offsets end at the partitions' ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
import yaml

from conveyor.control.devserver import dagster_yaml
from conveyor.core.host.ports import free_port, port_open
from conveyor.core.host.processes import pid_alive
from conveyor.core.model import TopicPartition
from conveyor.store.meta import MetaStore
from conveyor.store.tasks import TaskStore
from tests.e2e.conftest import SETTLE_S, kill_processes_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

BROKERS = ["b1", "b2"]
PARTITIONS = 6
BATCH = 50
RATE = 120  # msgs/s produced while the load is on
CEILING = 40  # msgs/s one task is declared to carry: 120/s needs three tasks


@pytest.fixture
def dev(tmp_path: Path, tansu: str, spark_remote: str) -> Iterator[dict]:
    home = tmp_path / "home"
    dagster_home = home / "dagster"
    connectors = home / "connectors"
    for d in (dagster_home, connectors):
        d.mkdir(parents=True)
    (dagster_home / "dagster.yaml").write_text(dagster_yaml([(b, 3) for b in BROKERS]))
    (home / "brokers.yaml").write_text(
        yaml.safe_dump(
            {"brokers": [{"id": b, "capacity": 3, "spark_remote": spark_remote} for b in BROKERS]}
        )
    )
    (home / "workspace.yaml").write_text(
        yaml.safe_dump(
            {
                "load_from": [
                    {
                        "python_module": {
                            "module_name": "conveyor.dagster.definitions",
                            "location_name": "conveyor",
                        }
                    }
                ]
            }
        )
    )
    env = {
        **os.environ,
        "CONVEYOR_HOME": str(home),
        "CONVEYOR_META_URL": f"sqlite:///{home / 'meta.db'}",
        "CONVEYOR_CONNECTORS_DIR": str(connectors),
        "CONVEYOR_BROKERS_FILE": str(home / "brokers.yaml"),
        "CONVEYOR_KAFKA_BOOTSTRAP": tansu,
        "CONVEYOR_SPARK_REMOTE": spark_remote,
        "DAGSTER_HOME": str(dagster_home),
    }
    state: dict = {"home": home, "connectors": connectors, "env": env}

    def start() -> None:
        port = free_port()
        log = open(home / "dagster-dev.log", "wb")  # noqa: SIM115
        exe = str(Path(sys.executable).parent / "dagster")
        proc = subprocess.Popen(
            [exe, "dev", "-w", str(home / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
            cwd=home,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        state["proc"] = proc
        wait_for(
            lambda: port_open("127.0.0.1", port) or proc.poll() is not None, 180, "dagster dev"
        )
        if proc.poll() is not None:
            raise RuntimeError((home / "dagster-dev.log").read_text()[-3000:])

    state["start"] = start
    try:
        yield state
    finally:
        proc = state.get("proc")
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        kill_processes_of(home)


class Producer:
    """Sends JSON messages with increasing ids, round robin over the partitions, at a rate."""

    def __init__(self, bootstrap: str, topic: str):
        from kafka import KafkaProducer

        self.topic = topic
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
        self.sent = 0
        self.ends: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _done(self, md) -> None:  # type: ignore[no-untyped-def]
        with self._lock:
            self.ends[md.partition] = max(self.ends.get(md.partition, 0), md.offset + 1)

    def _run(self, rate: float) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            due = int((time.monotonic() - t0) * rate)
            while self.sent < self.base + due:
                i = self.sent
                value = f'{{"id": {i}, "name": "n{i}", "amount": {i * 1.5}}}'.encode()
                fut = self.producer.send(self.topic, value=value, partition=i % PARTITIONS)
                fut.add_callback(self._done)
                self.sent += 1
            time.sleep(0.02)

    def start(self, rate: float) -> None:
        self.base = self.sent
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(rate,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.producer.flush()


def counts(pg_url: str, schema: str, table: str) -> tuple[int, int]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{schema}"."{table}"',))
        if cur.fetchone()[0] is None:
            return 0, 0
        cur.execute(f'SELECT count(*), count(DISTINCT id) FROM "{schema}"."{table}"')
        return cur.fetchone()


def live_tasks(ts: TaskStore, name: str) -> list:
    now = time.time()
    return [
        t
        for t in ts.tasks(name)
        if t.status != "Ending" and t.heartbeat_at is not None and now - t.heartbeat_at < 5
    ]


def settled(ts: TaskStore, name: str, n: int) -> bool:
    tasks = ts.tasks(name)
    return (
        len(tasks) == n
        and len(live_tasks(ts, name)) == n
        and not any(t.releasing or t.incoming for t in tasks)
    )


def test_one_connector_goes_one_three_one_tasks_and_loses_nothing(dev, tansu, pg_url, pg_schema):
    from kafka.admin import KafkaAdminClient, NewTopic

    name = f"hot_{uuid.uuid4().hex[:6]}"
    topic = f"t_{name}"
    admin = KafkaAdminClient(bootstrap_servers=tansu)
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    admin.close()
    spec = {
        "name": name,
        "source": {"topics": [topic]},
        "batch": {"max_records": BATCH, "max_wait_ms": 200},
        "transform": {"decode": "json", "schema": "id BIGINT, name STRING, amount DOUBLE"},
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": pg_schema,
            "table": name,
            "create_table": True,
        },
        "heartbeat_timeout_s": 10,
        "tasks": {
            "min": 1,
            "max": 3,
            "cooldown_s": 8,
            "lag_samples": 3,
            "sample_interval_s": 1,
            "ceiling_msgs_per_s": CEILING,
        },
    }
    (dev["connectors"] / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    producer = Producer(tansu, topic)
    dev["start"]()
    store = MetaStore(dev["env"]["CONVEYOR_META_URL"])
    ts = TaskStore(store)
    figures: dict[str, float] = {}
    try:
        wait_for(lambda: settled(ts, name, 1), 300, "the first task running")
        producer.start(RATE)

        # The load exceeds the ceiling: task 0 is split. Kill -9 it mid-split, before it
        # hands the moving partitions over.
        wait_for(lambda: len(ts.tasks(name)) > 1, 300, "the first split")
        (first,) = [t for t in ts.tasks(name) if t.task_id == 0]
        assert first.releasing or any(t.incoming for t in ts.tasks(name)), "not handed over yet"
        assert first.run_pid and pid_alive(first.run_pid)
        os.kill(first.run_pid, signal.SIGKILL)

        t_load = time.monotonic()
        wait_for(lambda: settled(ts, name, 3), 480, "three tasks")
        figures["to_three_tasks_s"] = round(time.monotonic() - t_load, 1)
        history = [h.reason for h in store.history(name, limit=500)]
        assert any("tasks: split task" in r and "ceiling" in r for r in history), history
        # the killed task's run does not stay STARTED (it would hold a slot of its broker)
        from dagster import DagsterInstance

        instance = DagsterInstance.from_config(dev["env"]["DAGSTER_HOME"])
        assert first.run_id
        wait_for(
            lambda: instance.get_run_by_id(first.run_id).is_finished, 120, "the killed run ended"
        )
        assert any("task 0 silent" in r or "handover forced" in r for r in history), history

        producer.stop()  # the load goes away: back to one task
        t_calm = time.monotonic()
        wait_for(lambda: settled(ts, name, 1), 480, "one task again")
        figures["back_to_one_task_s"] = round(time.monotonic() - t_calm, 1)
        history = [h.reason for h in store.history(name, limit=500)]
        assert sum("tasks: merge task" in r for r in history) >= 2, history

        total = producer.sent
        wait_for(lambda: counts(pg_url, pg_schema, name)[1] == total, 240, f"{total} distinct ids")
        rows, distinct = counts(pg_url, pg_schema, name)
        handovers = sum(
            ("tasks: split" in r or "tasks: merge" in r or "silent" in r or "forced" in r)
            for r in history
        )
        figures.update(messages=total, rows=rows, duplicates=rows - distinct, handovers=handovers)
        # handover time: a split or merge decided -> the owner released at a batch boundary
        # (a split's includes the new task's run start-up)
        timeline = [(h.at, h.reason) for h in reversed(store.history(name, limit=500))]
        for kind in ("split", "merge"):
            spans = []
            for i, (at, reason) in enumerate(timeline):
                if reason.startswith(f"tasks: {kind} task"):
                    for a, r in timeline[i + 1 :]:
                        if "handed over" in r:
                            spans.append(round(a - at, 1))
                        if "handed over" in r or "silent" in r or r.startswith("tasks: s"):
                            break  # released, or overtaken (the kill) / a next decision
            figures[f"{kind}_to_handover_s"] = spans  # type: ignore[assignment]
        print(json.dumps({"bench": "tasks_e2e", **figures}))
        assert rows - distinct <= (handovers + 1) * BATCH, (rows, distinct, handovers)
        expected = {TopicPartition(topic, p): end for p, end in producer.ends.items()}
        wait_for(
            lambda: store.committed_offsets(name) == expected,
            SETTLE_S,
            "offsets at the partition ends",
        )

        # the sink asset's materializations name the task and its partitions' rate and lag
        (key,) = [k for k in instance.all_asset_keys() if k.path[-1] == name]
        records = instance.fetch_materializations(key, limit=200).records
        tasks_seen = {
            r.asset_materialization.metadata["task"].value
            for r in records
            if r.asset_materialization and "task" in r.asset_materialization.metadata
        }
        assert len(tasks_seen) >= 2, tasks_seen
        some = next(
            r.asset_materialization.metadata["task_partitions"].value
            for r in records
            if r.asset_materialization and "task_partitions" in r.asset_materialization.metadata
        )
        assert all(k.startswith(topic) for k in some), some
    finally:
        producer.stop()
