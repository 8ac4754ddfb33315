"""The scheduler sensor runs a tasks.max > 1 connector as partition tasks (real instance and store)."""

from __future__ import annotations

import json

import pytest
from dagster import DagsterRunStatus
from dagster._core.test_utils import create_run_for_test

from conveyor.core.errors import FencedError
from conveyor.core.model import ConnectorStatus, TopicPartition
from conveyor.core.planning.tasks import TaskSample
from conveyor.dagster.tags import (
    TAG_BROKER,
    TAG_CONNECTOR,
    TAG_GENERATION,
    TAG_TASK,
    TAG_TASK_GENERATION,
)
from conveyor.store.tasks import TaskStore
from tests.integration.test_scheduler_sensor import env, tick  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

P = [TopicPartition("hot_topic", i) for i in range(6)]
TASKS = {"min": 1, "max": 3, "lag_samples": 2, "cooldown_s": 0, "sample_interval_s": 1}


def add_hot(store) -> TaskStore:
    spec = {"name": "hot", "source": {"topics": ["hot_topic"]}, "tasks": TASKS}
    store.sync_spec("hot", spec_json=json.dumps(spec), spec_hash="h", source="test", error=None)
    ts = TaskStore(store)
    ts.set_partitions("hot", P)  # as a task's source would report them
    return ts


def launched(instance, reqs) -> None:
    for r in reqs:
        create_run_for_test(
            instance, job_name=r.job_name, status=DagsterRunStatus.STARTED, tags=r.tags
        )


def test_a_tasks_connector_gets_task_runs_and_splits_on_growing_lag(env):  # noqa: F811
    instance, store, url = env
    ts = add_hot(store)
    reqs = tick(instance, url).run_requests
    hot = [r for r in reqs if r.tags[TAG_CONNECTOR] == "hot"]
    others = [r for r in reqs if r.tags[TAG_CONNECTOR] != "hot"]
    assert len(hot) == 1 and hot[0].run_key == "hot:task0:1"
    assert hot[0].tags[TAG_TASK] == "0" and hot[0].tags[TAG_TASK_GENERATION] == "1"
    assert TAG_GENERATION not in hot[0].tags, "not a whole-connector claim"
    assert hot[0].tags["pool"] == hot[0].tags[TAG_BROKER]
    # the task run takes one slot of the 4: the three plain connectors get the other three
    assert len(others) == 3
    launched(instance, reqs)
    assert tick(instance, url).run_requests == [], "no second run for a task with an active one"

    # the task heartbeats with a growing lag: split into a new task on a broker with room
    import time

    g = ts.grant("hot", 0, 1)
    assert set(g.owned) == set(P)
    t0 = time.time() - 5
    for at, lag in ((t0, 5_000), (t0 + 5, 9_000)):
        sample = TaskSample(at, dict.fromkeys(P, 100.0), dict.fromkeys(P, lag // 6))
        ts.heartbeat("hot", 0, 1, sample, sample_interval_s=1)
    row = store.get("hot")
    assert row.status == ConnectorStatus.IDLE
    reqs = tick(instance, url).run_requests
    assert [r.run_key for r in reqs] == [], "brokers are full (capacity 2 x 2)"

    store.delete("beta")  # frees two slots
    store.delete("gamma")
    reqs = tick(instance, url).run_requests
    hot = [r for r in reqs if r.tags.get(TAG_CONNECTOR) == "hot"]
    assert [r.run_key for r in hot] == ["hot:task1:1"]
    assert any("tasks: split task 0: " in h.reason for h in store.history("hot"))
    # the old owner is told to release the moving partitions at its next batch boundary
    ts.heartbeat("hot", 1, 1)  # once the new task's run is up
    g0 = ts.heartbeat("hot", 0, 1)
    assert len(g0.releasing) == 3
    handed = ts.release("hot", 0, 1, {}, g0.owned)
    assert set(handed) == g0.releasing
    tick(instance, url)
    assert store.get("hot").status == ConnectorStatus.RUNNING
    assert store.get("hot").counters["tasks"] == 2


def test_a_connector_back_to_one_run_loses_its_tasks(env):  # noqa: F811
    instance, store, url = env
    ts = add_hot(store)
    tick(instance, url)
    assert [t.task_id for t in ts.tasks("hot")] == [0]
    spec = {"name": "hot", "source": {"topics": ["hot_topic"]}, "tasks": {"max": 1}}
    store.sync_spec("hot", spec_json=json.dumps(spec), spec_hash="h2", source="test", error=None)
    tick(instance, url)
    assert ts.tasks("hot") == [] and "hot" not in ts.connectors()
    assert store.get("hot").status == ConnectorStatus.IDLE
    reqs = [r for r in tick(instance, url).run_requests if r.tags[TAG_CONNECTOR] == "hot"]
    assert len(reqs) == 1 and TAG_TASK not in reqs[0].tags, "one run again"


def test_a_run_of_a_replaced_task_is_ended_after_the_heartbeat_timeout(env):  # noqa: F811
    instance, store, url = env
    spec = {
        "name": "hot",
        "source": {"topics": ["hot_topic"]},
        "tasks": TASKS,
        "heartbeat_timeout_s": 0.01,
    }
    store.sync_spec("hot", spec_json=json.dumps(spec), spec_hash="h", source="test", error=None)
    TaskStore(store).set_partitions("hot", P)
    reqs = [r for r in tick(instance, url).run_requests if r.tags[TAG_CONNECTOR] == "hot"]
    # a run of task 0 at generation 7: never current (a restarted task's lost run)
    tags = {**reqs[0].tags, TAG_TASK_GENERATION: "7"}
    lost = create_run_for_test(
        instance, job_name=reqs[0].job_name, status=DagsterRunStatus.STARTED, tags=tags
    )
    tick(instance, url)  # seen superseded
    tick(instance, url)  # still active after the timeout: ended
    assert instance.get_run_by_id(lost.run_id).status == DagsterRunStatus.CANCELED
    assert any("of task 0 (generation 7)" in h.reason for h in store.history("hot"))


def test_a_connector_turned_into_tasks_fences_its_single_run_first(env):  # noqa: F811
    instance, store, url = env
    spec = {"name": "hot", "source": {"topics": ["hot_topic"]}}
    store.sync_spec("hot", spec_json=json.dumps(spec), spec_hash="h", source="test", error=None)
    (req,) = [r for r in tick(instance, url).run_requests if r.tags[TAG_CONNECTOR] == "hot"]
    claim = store.claim("hot", run_id="single", expected_generation=1, holder_alive=lambda r: True)
    store.heartbeat("hot", claim.generation, {})
    spec["tasks"] = TASKS
    store.sync_spec("hot", spec_json=json.dumps(spec), spec_hash="h2", source="test", error=None)
    TaskStore(store).set_partitions("hot", P)
    reqs = [r for r in tick(instance, url).run_requests if r.tags[TAG_CONNECTOR] == "hot"]
    assert [r.run_key for r in reqs] == ["hot:task0:1"]
    row = store.get("hot")
    assert row.generation == claim.generation + 1 and row.broker_id is None
    with pytest.raises(FencedError):
        store.commit("hot", claim.generation, {P[0]: 1})
