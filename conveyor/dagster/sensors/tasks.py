"""The scheduler's partition tasks: Dagster glue over the pure ``core.planning.tasks`` planner.

Called from the ``conveyor_scheduler`` tick for connectors whose spec has
``tasks.max > 1`` (those are left out of the one-run-per-connector planning). Per
connector it forces handovers an owner did not make within the heartbeat timeout,
reads the tasks (``TaskStore.load_group``), lets ``plan_tasks`` decide, applies the
decisions fenced on the epoch they were planned on, and requests a run for every task
without an active one (``run_key`` = connector, task id, task generation). The
connector's own row shows the sum: Running while a task heartbeats, the tasks' rate and
lag as its counters.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

from dagster import RunRequest, RunsFilter

from conveyor.core.model import Broker, ConnectorStatus, DesiredState, TasksSpec, TopicPartition
from conveyor.core.planning.state import StateChange
from conveyor.core.planning.tasks import BrokerSlot, TaskGroup, TaskPlan, TaskPolicy, plan_tasks
from conveyor.dagster.tags import (
    ACTIVE,
    TAG_BROKER,
    TAG_CONNECTOR,
    TAG_TASK,
    TAG_TASK_GENERATION,
    job_name,
)
from conveyor.store.meta import ConnectorRow, MetaStore
from conveyor.store.tasks import TaskRow, TaskStore


def tasks_spec(row: ConnectorRow) -> TasksSpec | None:
    """The connector's ``tasks`` section when it runs as tasks (``max > 1``), else None."""
    spec = row.spec or {}
    raw = spec.get("tasks")
    if not raw:
        return None
    try:
        tasks = TasksSpec.model_validate(raw)
    except ValueError:
        return None
    return tasks if tasks.max > 1 else None


def discover_partitions(row: ConnectorRow) -> list[TopicPartition]:
    """Every partition of the connector's topics, read from the cluster's metadata."""
    from conveyor.brokers.kafka import KafkaSource
    from conveyor.config.specs import load_source, resolved

    ls = load_source(row.name, row.spec_source)
    if not ls.ok:
        return []
    live = resolved(ls)
    assert live.spec is not None
    source = KafkaSource(live.spec.source, group_id=row.name, only=())
    try:
        return source.open({}, wait_for_topics_s=2)
    finally:
        source.close()


def _active_task_runs(instance: Any, name: str) -> dict[tuple[int, int], Any]:
    """(task id, task generation) -> its active Dagster run."""

    out = {}
    for run in instance.get_runs(filters=RunsFilter(statuses=ACTIVE, tags={TAG_CONNECTOR: name})):
        if TAG_TASK in run.tags and TAG_TASK_GENERATION in run.tags:
            out[(int(run.tags[TAG_TASK]), int(run.tags[TAG_TASK_GENERATION]))] = run
    return out


# Runs of tasks that were removed or restarted, and since when: a run whose task is gone
# ends by itself at its next heartbeat (fenced); one still active after the heartbeat
# timeout lost its process (kill -9, a lost host) and would hold its broker's slot in
# the run queue, so it is terminated, or reported canceled when it cannot be reached.
_superseded: dict[str, float] = {}


def _reap_superseded(
    context: Any,
    store: MetaStore,
    name: str,
    runs: dict[tuple[int, int], Any],
    current: set[tuple[int, int]],
    now: float,
    grace_s: float,
) -> None:
    for key, run in runs.items():
        if key in current:
            _superseded.pop(run.run_id, None)
            continue
        since = _superseded.setdefault(run.run_id, now)
        if now - since < grace_s:
            continue
        instance = context.instance
        stopped = False
        with contextlib.suppress(Exception):
            stopped = bool(instance.run_launcher.terminate(run.run_id))
        if not stopped:
            instance.report_run_canceled(run, message="its task was replaced or removed")
        _superseded.pop(run.run_id, None)
        store.record(
            name,
            f"tasks: run {run.run_id[:8]} of task {key[0]} (generation {key[1]}) "
            + ("terminated" if stopped else "reported canceled: its process is gone"),
            run_id=run.run_id,
        )


def broker_slots(
    store: MetaStore, rows: Sequence[ConnectorRow], groups: Sequence[TaskGroup]
) -> list[BrokerSlot]:
    """Each broker's room: its capacity less its connectors' runs and its task runs."""
    used: Counter[str] = Counter(r.broker_id for r in rows if r.broker_id)
    for g in groups:
        used.update(t.broker_id for t in g.tasks if t.broker_id)
    return [
        BrokerSlot(
            id=b.id, free=b.capacity - used[b.id], load=float(used[b.id]), healthy=not b.draining
        )
        for b in store.list_brokers()
    ]


def tasks_tick(
    context: Any,
    store: MetaStore,
    rows: Sequence[ConnectorRow],
    now: float,
    *,
    launchable: set[str] | None = None,
    launch_timeout_s: float = 60.0,
) -> list[RunRequest]:
    """One tick for the connectors that run as tasks; returns the runs to launch.

    ``rows``: every connector (the others' runs count against the brokers' room);
    ``launchable``: job names in the code location (None: all)."""
    ts = TaskStore(store)
    task_rows = {r.name: r for r in rows if tasks_spec(r) is not None}
    _drop_untasked(store, ts, rows, task_rows)
    groups, epochs = _load_groups(context, store, ts, task_rows, now, launchable, launch_timeout_s)
    plan = plan_tasks(
        groups, broker_slots(store, [r for r in rows if r.name not in task_rows], groups), now
    )
    requests: list[RunRequest] = []
    brokers = {b.id: b for b in store.list_brokers()}
    for name in sorted(epochs):
        row = task_rows[name]
        try:
            _apply_plan(context, ts, name, plan, groups, epochs[name])
            active = _active_task_runs(context.instance, name)
            current = {(t.task_id, t.generation) for t in ts.tasks(name)}
            hb_timeout = float((row.spec or {}).get("heartbeat_timeout_s", 30.0))
            _reap_superseded(context, store, name, active, current, now, hb_timeout)
            tasks = ts.tasks(name)
            # Appended to ``requests`` directly: a failure further on keeps the runs requested.
            _request_runs(requests, name, tasks, active, brokers, now)
            _show_sum(store, ts, row, tasks, now, hb_timeout)
        except Exception as e:  # noqa: BLE001 - reported per connector
            context.log.error(f"{name}: tasks: {type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                store.record(name, f"scheduler: tasks failed: {type(e).__name__}: {e}")
    return requests


def _drop_untasked(
    store: MetaStore,
    ts: TaskStore,
    rows: Sequence[ConnectorRow],
    task_rows: dict[str, ConnectorRow],
) -> None:
    """Connectors back to one run, or deleted, lose their tasks: their task runs end fenced."""
    by_name = {r.name: r for r in rows}
    for name in ts.connectors():
        if name not in task_rows:
            ts.drop(name)
            if name in by_name:  # Idle and fenced: assigned as one run by the next tick
                store.apply(
                    name,
                    by_name[name].generation,
                    StateChange.reset(),
                    "tasks: back to one run (tasks.max 1); its task runs end",
                )


def _load_groups(
    context: Any,
    store: MetaStore,
    ts: TaskStore,
    task_rows: dict[str, ConnectorRow],
    now: float,
    launchable: set[str] | None,
    launch_timeout_s: float,
) -> tuple[list[TaskGroup], dict[str, int]]:
    """The tasks to plan for and the epoch each connector's were read at.

    A stopped connector is shown Stopped once its task runs ended, one whose job is not in
    the code location yet waits; one connector's failure never stops the others."""
    groups: list[TaskGroup] = []
    epochs: dict[str, int] = {}
    for name, row in sorted(task_rows.items()):
        if row.desired == DesiredState.STOPPED:
            _show_stopped(store, ts, row, now)
            continue
        if launchable is not None and job_name(name) not in launchable:
            continue  # its job is not in the code location yet
        if row.broker_id is not None:
            # It ran as one run until its spec asked for tasks: fence that run first (its
            # next commit or heartbeat is refused and it ends); tasks start from its commits.
            store.apply(
                name,
                row.generation,
                StateChange.reset(),
                "tasks: the connector now runs as partition tasks; its single run is fenced",
            )
        try:
            group, epoch = _load_group(context, ts, row, now, launch_timeout_s)
            groups.append(group)
            epochs[name] = epoch
        except Exception as e:  # noqa: BLE001 - one connector never stops the others
            context.log.error(f"{name}: tasks: {type(e).__name__}: {e}")
    return groups, epochs


def _load_group(
    context: Any, ts: TaskStore, row: ConnectorRow, now: float, launch_timeout_s: float
) -> tuple[TaskGroup, int]:
    """One connector's tasks after forcing the handovers its owners did not make in time,
    its partitions discovered from the cluster when none are known yet."""
    name = row.name
    spec = tasks_spec(row)
    assert spec is not None
    policy = TaskPolicy.from_spec(
        spec,
        heartbeat_timeout_s=float((row.spec or {}).get("heartbeat_timeout_s", 30.0)),
        launch_timeout_s=launch_timeout_s,
    )
    moved = ts.force_handovers(
        name,
        now - policy.heartbeat_timeout_s,
        reason=f"owner did not hand over within {policy.heartbeat_timeout_s:.0f} s",
    )
    if moved:
        context.log.info(f"{name}: handover forced for {', '.join(map(str, moved))}")
    parts = ts.partitions(name)
    if not parts:
        parts = discover_partitions(row)
        if parts:
            ts.set_partitions(name, parts)
    return ts.load_group(name, policy, parts)


def _apply_plan(
    context: Any,
    ts: TaskStore,
    name: str,
    plan: TaskPlan,
    groups: Sequence[TaskGroup],
    epoch: int,
) -> None:
    """Write the connector's decisions (and a new ceiling), fenced on the epoch planned on."""
    decisions = plan.for_connector(name)
    if decisions or plan.ceilings.get(name) != next(
        (g.ceiling for g in groups if g.connector == name), None
    ):
        ts.apply(name, decisions, expected_epoch=epoch, ceiling=plan.ceilings.get(name))
    for d in decisions:
        context.log.info(f"{name}: {type(d).__name__}: {d.reason}")


def _request_runs(
    requests: list[RunRequest],
    name: str,
    tasks: Sequence[TaskRow],
    active: dict[tuple[int, int], Any],
    brokers: dict[str, Broker],
    now: float,
) -> None:
    """Appends a run request for every task without an active run."""
    for task in tasks:
        if (task.task_id, task.generation) in active:
            continue
        if task.status == "Ending" or (task.heartbeat_at or 0) > now - 5:
            continue  # handing over its last partitions / its run is still there
        broker = brokers.get(task.broker_id or "")
        requests.append(
            RunRequest(
                run_key=f"{name}:task{task.task_id}:{task.generation}",
                job_name=job_name(name),
                tags={
                    **(broker.run_tags if broker else {}),
                    TAG_CONNECTOR: name,
                    TAG_BROKER: task.broker_id or "",
                    TAG_TASK: str(task.task_id),
                    TAG_TASK_GENERATION: str(task.generation),
                },
            )
        )


def _show_sum(
    store: MetaStore,
    ts: TaskStore,
    row: ConnectorRow,
    tasks: Sequence[TaskRow],
    now: float,
    hb_timeout: float,
) -> None:
    """The connector's row shows its tasks' sum: Running while one heartbeats, their rate and lag."""
    live = 0
    rate = 0.0
    lag = 0
    for task in tasks:
        if task.heartbeat_at is not None and now - task.heartbeat_at < hb_timeout:
            live += 1
        latest = task.latest()
        if latest is not None:
            rate += latest.rate
            lag += latest.lag
    status = ConnectorStatus.RUNNING if live else ConnectorStatus.IDLE
    counters = {
        **row.counters,
        "msgs_per_s": rate,
        "lag": lag,
        "tasks": len(ts.tasks(row.name)),
    }
    store.apply(
        row.name,
        row.generation,
        StateChange(status=status, counters=counters),
        f"tasks: {live} task run(s) heartbeating",
    )


def _show_stopped(store: MetaStore, ts: TaskStore, row: ConnectorRow, now: float) -> None:
    """A stopped connector's task runs end on their next heartbeat; then it shows Stopped."""
    if row.status == ConnectorStatus.STOPPED:
        return
    if any(t.heartbeat_at is not None and now - t.heartbeat_at < 5 for t in ts.tasks(row.name)):
        return
    store.apply(
        row.name, row.generation, StateChange(status=ConnectorStatus.STOPPED), "tasks: stopped"
    )
