"""The previous release's side of ``test_upgrade_e2e.py``: state written by that release's code.

Run as a script by that test, in a subprocess whose ``PYTHONPATH`` is a git worktree of the
release before issue 44, so ``conveyor`` here is that release's package. It uses only the API
that release had, driven the way its own tests drove it: ``connector_job(ls)
.execute_in_process`` with a ``ConveyorResource`` and an ephemeral Dagster instance, on a
thread, stopped through the meta store (``MetaStore.stop``), and its ``TaskStore`` methods.

``python upgrade_previous_release.py MODE CONFIG_JSON``; it writes JSON lines to stdout:

- ``run``: each connector runs until the meta store holds ``produced`` messages committed,
  then is stopped and its run ends; a partition-task group is written through ``TaskStore``
  (task 0 owns every partition, heartbeats, commits ``task_offset`` in each). The process
  then exits.
- ``kill``: one connector (exactly once into PostgreSQL) runs until it has committed a batch;
  then the meta store's write lock is held, so the run's next batch lands in the target (rows
  and the offsets table's row, one transaction) while the meta store's mirror of it cannot be
  written. Once the target is ahead, it says ``blocked`` and waits to be SIGKILLed.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DEADLINE_S = 240.0  # any wait here, on a loaded machine


def say(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def wait_for(
    what: str, predicate: Any, timeout: float = DEADLINE_S, runs: Iterable[JobThread] = ()
) -> Any:
    """``predicate()``'s first true value; an AssertionError when ``timeout`` passes first, or
    when one of ``runs`` has ended (each is stopped only after its wait)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        ended = [f"{r.path}: {r.outcome}" for r in runs if not r.thread.is_alive()]
        if ended:
            raise AssertionError(f"waiting for {what}, a run ended: {ended}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def check_release(worktree: str) -> None:
    """This process runs the previous release's package, not the checkout the test runs."""
    import conveyor

    where = Path(conveyor.__file__).resolve()
    if not where.is_relative_to(Path(worktree).resolve()):
        raise SystemExit(f"conveyor imported from {where}, not from the worktree {worktree}")
    say("conveyor", file=str(where))


class JobThread:
    """One connector's run (its job executed in process) on a thread of its own."""

    def __init__(self, path: str, cfg: dict[str, Any], tags: dict[str, str] | None = None):
        # Imported before any run's thread starts: its import sets logging's logger class to
        # PySparkLogger for a moment, and a run creating its Dagster logger on another thread
        # then would get one (``TypeError: ... unexpected keyword argument 'level'``).
        import pyspark.sql.connect.logging  # noqa: F401

        self.path, self.cfg, self.tags = path, cfg, tags or {}
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from dagster import DagsterInstance

        from conveyor.config.specs import load_file
        from conveyor.dagster.jobs.connector import connector_job
        from conveyor.dagster.resources.conveyor import ConveyorResource

        loaded = load_file(Path(self.path))
        resource = ConveyorResource(
            meta_url=self.cfg["meta_url"],
            kafka_bootstrap=self.cfg["tansu"],
            spark_remote=self.cfg["spark_remote"],
        )
        try:
            with DagsterInstance.ephemeral() as instance:
                result = connector_job(loaded).execute_in_process(
                    instance=instance,
                    resources={"conveyor": resource},
                    raise_on_error=False,
                    tags=self.tags,
                )
            self.outcome["success"] = result.success
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.outcome["error"] = repr(e)

    def join(self) -> dict[str, Any]:
        self.thread.join(DEADLINE_S)
        if self.thread.is_alive():
            self.outcome["error"] = "the run did not end"
        return self.outcome


def committed(store: Any, name: str) -> int:
    return sum(store.committed_offsets(name).values())


def live(store: Any, name: str) -> bool:
    from conveyor.core.model import ConnectorStatus

    return store.get(name).status in (ConnectorStatus.RUNNING, ConnectorStatus.DEGRADED)


def run_and_stop(cfg: dict[str, Any]) -> None:
    """Every connector of ``cfg`` runs until ``produced`` is committed, then stops (its run
    releases it, Stopped); then the task group."""
    from conveyor.store.meta import MetaStore

    store = MetaStore(cfg["meta_url"])
    runs = {c["name"]: JobThread(c["path"], cfg) for c in cfg["connectors"]}
    for c in cfg["connectors"]:
        name, produced = c["name"], c["produced"]
        wait_for(
            f"{name}: {produced} committed, running",
            lambda n=name, p=produced: committed(store, n) >= p and live(store, n),
            runs=runs.values(),
        )
        store.stop(name, reason="the previous release stops")
    report = {}
    for name, run in runs.items():
        report[name] = {
            **run.join(),
            "status": store.get(name).status.value,
            "committed": committed(store, name),
        }
    write_task_group(store, cfg["tasks"])
    say("stopped", connectors=report, schema_version=store.schema_version())
    store.close()


def write_task_group(store: Any, cfg: dict[str, Any]) -> None:
    """A connector run as partition tasks, as the scheduler and a task run write it: its group
    planned and applied, task 0 owning every partition, heartbeating, committing."""
    # The previous release's layout (this script runs under it): before core/ had sub-packages.
    from conveyor.config.specs import load_file, sync_one
    from conveyor.core import tasks as tk
    from conveyor.core.model import TopicPartition
    from conveyor.store.tasks import TaskStore

    name = cfg["name"]
    sync_one(store, load_file(Path(cfg["path"])))
    parts = [TopicPartition(cfg["topic"], p) for p in range(cfg["partitions"])]
    ts = TaskStore(store)
    group, epoch = ts.load_group(name, tk.TaskPolicy(min_tasks=1, max_tasks=2), parts)
    plan = tk.plan_tasks([group], [tk.BrokerSlot("local", free=4)], store.clock())
    ts.apply(name, plan.for_connector(name), expected_epoch=epoch)
    grant = ts.heartbeat(name, 0, 1)
    assert set(grant.owned) == set(parts), grant
    done = ts.commit(name, 0, 1, {p: cfg["task_offset"] for p in parts}, grant.owned)
    assert not done.refused, done
    say(
        "tasks",
        epoch=ts.epoch(name),
        owned={str(tp): e for tp, e in grant.owned.items()},
        tasks=[(r.task_id, r.generation) for r in ts.tasks(name)],
    )


def run_and_get_killed(cfg: dict[str, Any]) -> None:
    """The run commits a batch; the meta store's write lock is then taken, so its next batch
    is committed in the target and not in the meta store; then this process waits for its
    SIGKILL."""
    import psycopg2

    from conveyor.store.meta import MetaStore

    c = cfg["connector"]
    name, pg = c["name"], cfg["postgres"]
    store = MetaStore(cfg["meta_url"])
    run = JobThread(c["path"], cfg)
    wait_for(
        f"{name}: a batch committed",
        lambda: committed(store, name) > 0 and live(store, name),
        runs=[run],
    )
    lock = sqlite3.connect(cfg["meta_db"], timeout=60, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # every writer of the meta store waits from now on
    (mirror,) = lock.execute(
        "SELECT COALESCE(SUM(next_offset), 0) FROM conveyor_offsets WHERE connector = ?", (name,)
    ).fetchone()
    if mirror >= c["produced"]:
        raise SystemExit(f"{name}: every message was committed before the lock; nothing to cut")
    conn = psycopg2.connect(pg["url"])
    conn.autocommit = True
    ledger = f'"{pg["schema"]}".conveyor_offsets'

    def target() -> int:
        with conn.cursor() as cur:
            cur.execute(
                f"SELECT COALESCE(SUM(next_offset), 0) FROM {ledger} "
                'WHERE writer = %s AND "partition" >= 0',
                (name,),
            )
            return int(cur.fetchone()[0])

    ahead = wait_for(
        f"{name}: a batch in the target only", lambda: target() > mirror and target(), runs=[run]
    )
    say("blocked", target=ahead, meta_store=mirror)
    time.sleep(DEADLINE_S)  # the SIGKILL comes here
    raise SystemExit("previous release: not killed")


def main() -> None:
    mode, cfg = sys.argv[1], json.loads(sys.argv[2])
    check_release(cfg["worktree"])
    {"run": run_and_stop, "kill": run_and_get_killed}[mode](cfg)


if __name__ == "__main__":
    main()
