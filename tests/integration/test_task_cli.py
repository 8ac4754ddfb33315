"""`conveyor connector tasks` and `connector list` for a connector run as partition tasks."""

from __future__ import annotations

import json
import time

from conveyor.core.model import TopicPartition
from conveyor.core.planning import tasks as tk
from conveyor.core.planning.state import StateChange
from conveyor.store.meta import MetaStore
from conveyor.store.tasks import TaskStore
from tests.integration.test_cli import cli, connectors_dir, meta_url  # noqa: F401  (fixtures)

P = [TopicPartition("orders", i) for i in range(4)]


def test_connector_tasks_shows_partitions_rate_lag_and_handovers(meta_url):  # noqa: F811
    store = MetaStore(meta_url)
    spec = {"name": "hot", "source": {"topics": ["orders"]}, "tasks": {"max": 2}}
    store.sync_spec("hot", spec_json=json.dumps(spec), spec_hash="h", source="cli", error=None)
    ts = TaskStore(store)
    policy = tk.TaskPolicy(max_tasks=2, min_tasks=2)
    group, epoch = ts.load_group("hot", tk.TaskPolicy(max_tasks=2), P)
    plan = tk.plan_tasks([group], [tk.BrokerSlot("b1", free=4)], time.time())
    ts.apply("hot", plan.for_connector("hot"), expected_epoch=epoch)  # start: one task
    now = time.time()
    ts.heartbeat("hot", 0, 1, tk.TaskSample(now, {P[0]: 12.0, P[1]: 30.0}, {P[0]: 5, P[1]: 7}))
    group, epoch = ts.load_group("hot", policy, P)
    plan = tk.plan_tasks([group], [tk.BrokerSlot("b1", free=4)], now)
    ts.apply("hot", plan.for_connector("hot"), expected_epoch=epoch)  # below min: split
    ts.heartbeat("hot", 1, 1)
    store.apply("hot", None, StateChange(counters={"tasks": 2, "msgs_per_s": 42.0}), "test")

    out = cli(meta_url, "connector", "tasks", "hot")
    assert out.exit_code == 0, out.output
    assert "tasks of hot" in out.output and "orders[0] (12/s, lag 5)" in out.output
    assert "-> task 1" in out.output, "a partition being handed over is shown"
    data = json.loads(cli(meta_url, "connector", "tasks", "hot", "--json").output)
    assert [t["task"] for t in data] == [0, 1]
    assert data[0]["msgs_per_s"] == 42.0 and data[0]["lag"] == 12
    assert sorted(data[0]["partitions"] + data[1]["partitions"]) == [str(p) for p in P]
    assert data[1]["incoming"] == sorted(data[0]["releasing"])

    listing = cli(meta_url, "connector", "list").output
    assert "2 tasks" in listing

    assert cli(meta_url, "connector", "tasks", "nope").exit_code != 0

    # the REST API answers the same, from the same operation
    from starlette.testclient import TestClient

    from conveyor.control.api import create_app
    from conveyor.control.operations import Operations

    client = TestClient(
        create_app(lambda: Operations(store), token=None), base_url="http://localhost"
    )

    def without_age(tasks):  # type: ignore[no-untyped-def]
        return [{k: v for k, v in t.items() if k != "heartbeat_age_s"} for t in tasks]

    assert without_age(client.get("/connectors/hot/partition-tasks").json()) == without_age(data)
    assert client.get("/connectors/nope/partition-tasks").status_code == 404
    status = client.get("/connectors/hot/status").json()
    assert [(t["id"], t["state"], t["worker_id"]) for t in status["tasks"]] == [
        (0, "RUNNING", "b1"),
        (1, "RUNNING", "b1"),
    ]
    assert client.get("/connectors/hot/tasks/1/status").json()["id"] == 1
    assert client.get("/connectors/hot/tasks/5/status").status_code == 404
