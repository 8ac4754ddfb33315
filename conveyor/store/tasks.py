"""Partition tasks in the meta store: who owns each partition, fenced commits, the handover.

Three tables (``store/schema.py``): a group row per connector (an *epoch* that grows at
every ownership change, the next task id, the cool-down and the remembered ceiling),
a row per task (broker, generation, run, heartbeat, its last load samples), and an
owner row per partition (task id, the epoch at which it got the partition, and the task
it is being handed over to, if any).

**Fencing per partition.** A task run holds a *grant*: its generation and, per
partition, the epoch at which it got it. ``commit`` writes an offset only for a
partition whose owner row still names this task at that epoch, in the same transaction
that checks it; a partition that moved away (even one that came back later, at a newer
epoch) is refused and reported. A task whose generation was bumped (restarted) or that
was removed is refused as a whole (``FencedError``). The operator's stop, offsets reset,
state reset and delete bump (or remove) every task's generation in the same transaction as
the connector's (``store/meta.py``): a task run caught mid-batch cannot undo them.

**Handover** (the lightweight-consumer coordinator's protocol). A split or merge does
not take partitions from a live owner: it marks them *releasing* (``pending_task_id``).
The owner learns it in its heartbeat's grant, stops fetching them at its next batch
boundary, and calls ``release`` with their offsets: one transaction commits them and
gives them to the new owner at a new epoch. The new owner's next grant includes them and
it reads from exactly the committed offsets. An owner that does not release within the
heartbeat timeout (it died) is overtaken by ``force_handovers``: the partitions move
with their last committed offsets, so nothing is lost and at most the batch in flight is
read twice. A dead task's partitions move at once (``TaskChange.immediate``).

Every write locks the connector's group row first (``SELECT ... FOR UPDATE`` on
PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` serialises writers), so the scheduler's changes,
commits and releases of one connector never interleave.

The tables' rows, locks and reads are ``store/task_tables.py``'s; the scheduler's writes
``store/task_assignments.py``'s; the task runs' writes ``store/task_ledger.py``'s.
``TaskStore`` is the facade over the three.
"""

from __future__ import annotations

from conveyor.store.facade import Delegate
from conveyor.store.meta import MetaStore
from conveyor.store.task_assignments import TaskAssignments
from conveyor.store.task_ledger import CommitResult, Grant, TaskLedger
from conveyor.store.task_tables import (
    ENDING,
    SAMPLES_KEPT,
    TaskRow,
    TaskTables,
    samples_from_json,
    samples_to_json,
)

# The names callers import from here, wherever they are written now.
__all__ = [
    "ENDING",
    "SAMPLES_KEPT",
    "CommitResult",
    "Grant",
    "TaskRow",
    "TaskStore",
    "samples_from_json",
    "samples_to_json",
]


class TaskStore:
    """The task tables of one meta store."""

    def __init__(self, meta: MetaStore):
        self.meta = meta
        self.tables = TaskTables(meta.db, meta.offsets)
        self.assignments = TaskAssignments(meta.db, meta.offsets)
        self.ledger = TaskLedger(meta.db, meta.offsets)

    # -- reading (store/task_tables.py) -------------------------------------------------------

    tasks = Delegate("tables", TaskTables.tasks)
    connectors = Delegate("tables", TaskTables.connectors)
    epoch = Delegate("tables", TaskTables.epoch)
    partitions = Delegate("tables", TaskTables.partitions)
    set_partitions = Delegate("tables", TaskTables.set_partitions)
    load_group = Delegate("tables", TaskTables.load_group)

    # -- the scheduler's writes (store/task_assignments.py) -----------------------------------

    apply = Delegate("assignments", TaskAssignments.apply)
    force_handovers = Delegate("assignments", TaskAssignments.force_handovers)
    drop = Delegate("assignments", TaskAssignments.drop)

    # -- the task run's writes (store/task_ledger.py) -----------------------------------------

    ensure_current = Delegate("ledger", TaskLedger.ensure_current)
    grant = Delegate("ledger", TaskLedger.grant)
    heartbeat = Delegate("ledger", TaskLedger.heartbeat)
    commit = Delegate("ledger", TaskLedger.commit)
    release = Delegate("ledger", TaskLedger.release)
