"""The Meta scheduler's decisions, as a pure function.

``plan(connectors, brokers, runs, now, config) -> Plan`` looks at one snapshot of
the meta store and of Dagster's runs and returns what to do. It performs no I/O,
reads no clock and imports neither Dagster nor a client library; the
``conveyor_scheduler`` sensor translates the decisions into store writes,
``RunRequest``s and run terminations.

Each tick, in this order (one connector's exception becomes a ``Failed``
decision and never stops the others):

1. **reclaim**: a run of a deleted connector, of a desired-stopped connector, or of
   an older generation is terminated; a desired-stopped connector's run that released it
   itself is left ``release_grace_s`` to end on its own first. A run launched by hand (no
   generation tag) is adopted: the op claims the connector itself. A run stuck in CANCELING past
   ``cancel_grace_s`` is reported canceled.
2. **zombie**: the connector's current run is CANCELED (a force-terminate from the
   UI) but the connector is still Running or Degraded (its heartbeat fresh, or stale
   because the process hangs): the connector is stopped and fenced (generation
   bumped), and a process still alive is killed when the run launcher is local (first:
   a hung process may hold the SQLite meta store's write lock).
3. **heartbeat check**: a Running or Degraded connector whose heartbeat is older
   than its ``heartbeat_timeout_s`` goes back to Idle, its broker cleared, its
   generation bumped (which fences the lost run), and its old run terminated. A
   connector assigned but never started within ``launch_timeout_s`` is reset too.
4. **errors**: a *crash* and a *failure* are told apart. A failing connector releases
   itself as Error before its run ends; a connector still Running or Degraded whose
   current run failed, or whose local process is gone, had its process die under it
   (``kill -9``, the OOM killer): it is relaunched at once (a restart, counted), in the
   same tick. A crash again before the budget came back (``healthy_reset_s`` of running)
   is a failing restart: Error. An Error connector that should run is restarted after
   ``restart_backoff(restarts)``, growing with each restart, up to its ``max_restarts``,
   then left for the user. A *data error* (a message failed under the ``fail`` policy, or
   the dead-letter limit was hit: ``errors.is_data_error``) is never restarted
   automatically; crashes and outages keep the restart budget.
5. **drain / down brokers**: connectors on a draining broker, a broker that no
   longer exists or is gone (removed from the brokers file, see ``gone_brokers``), or (when another healthy broker has room) a broker whose Spark
   endpoint refuses connections are moved: reset to Idle with a bumped generation.
6. **waiting**: an assigned connector whose run has sat in Dagster's run queue (or was
   launched and has not started) longer than ``run_wait_s`` says why it has no run: a
   ``Waiting`` decision records the reason (the queue limit that holds the run, found by
   the glue) as its last error and in its history, once per reason.
7. **assignment**: Idle, unassigned connectors that should run go, in name order,
   to the healthy broker with the lowest load (sum of connector weights, a weight
   being ``1 + msgs_per_s / rate_unit``), ties broken by connector count then id,
   never beyond capacity.
8. **rebalance**: when the most loaded healthy broker exceeds the least loaded by
   more than ``rebalance_threshold`` and nothing moved in the last
   ``rebalance_cooldown_s``, one connector whose weight is smaller than the gap is
   moved (so the move strictly narrows the gap: no flapping).

Generations only grow: every decision that changes ownership bumps by one.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from conveyor.core.errors import is_data_error
from conveyor.core.model import ConnectorStatus, DesiredState
from conveyor.core.planning.state import StateChange

ACTIVE_RUN_STATUSES = frozenset({"QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING"})
# A run not yet running the connector's op: in the run queue, or launched and starting.
WAITING_RUN_STATUSES = frozenset({"QUEUED", "NOT_STARTED", "STARTING"})
# How a connector's last error begins while it waits for its run (``Waiting``).
WAITING_FOR_A_RUN = "waiting for a run"
# A run holds the connector and heartbeats (a paused one too: it keeps its assignment).
LIVE = (ConnectorStatus.RUNNING, ConnectorStatus.DEGRADED, ConnectorStatus.PAUSED)


# -- inputs ------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectorView:
    """A connector as the scheduler sees it (from the meta store)."""

    name: str
    desired: DesiredState = DesiredState.RUNNING
    status: ConnectorStatus = ConnectorStatus.IDLE
    broker_id: str | None = None
    generation: int = 0
    run_id: str | None = None
    heartbeat_at: float | None = None
    status_since: float = 0.0
    updated_at: float = 0.0
    heartbeat_timeout_s: float = 30.0
    msgs_per_s: float = 0.0
    restarts: int = 0
    max_restarts: int = 5
    next_restart_at: float | None = None
    last_error: str | None = None
    last_moved_at: float | None = None
    spec_error: str | None = None
    launchable: bool = (
        True  # its job is in the code location (False until a reload picks up a new spec)
    )

    def heartbeat_age(self, now: float) -> float | None:
        return None if self.heartbeat_at is None else now - self.heartbeat_at


@dataclass(frozen=True)
class BrokerView:
    """A broker executor and whether its Spark Connect endpoint accepted a connection."""

    id: str
    capacity: int
    spark_remote: str = ""
    run_tags: Mapping[str, str] = field(default_factory=dict)
    draining: bool = False
    endpoint_up: bool = True
    gone: bool = False  # removed from the brokers file (kept in the store, marked gone)


@dataclass(frozen=True)
class RunView:
    """A Dagster run of a connector job (tags and status)."""

    run_id: str
    connector: str
    generation: int | None  # None: launched by hand (no conveyor/generation tag)
    status: str  # DagsterRunStatus value, e.g. "STARTED"
    broker_id: str | None = None
    pid: int | None = None
    local: bool = False  # the process runs on this host under the default run launcher
    canceling_since: float | None = None
    process_alive: bool | None = None  # known only for local runs with a recorded pid
    status_since: float | None = None  # when the run entered its status (queued: enqueued)
    blocker: str | None = None  # a queued run: the run queue's limit that holds it, if known

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_RUN_STATUSES


@dataclass(frozen=True)
class SchedulerConfig:
    launch_timeout_s: float = 60.0
    """An assigned connector whose run has not claimed it by then is reset."""
    cancel_grace_s: float = 60.0
    """A run CANCELING longer than this is reported canceled (its code server is gone)."""
    restart_backoff_s: float = 10.0
    restart_backoff_max_s: float = 600.0
    healthy_reset_s: float = 600.0
    """A connector Running this long without trouble gets its restart budget back."""
    rebalance_threshold: float = 1.5
    rebalance_cooldown_s: float = 120.0
    rate_unit: float = 10_000.0
    """msgs/s that weigh as much as one more connector."""
    run_wait_s: float = 30.0
    """An assigned connector whose run is queued (or not started) longer than this says why."""
    release_grace_s: float = 30.0
    """A run whose loop released its stopped connector is left this long to end by itself
    before it is terminated (a terminate in the moment it ends would leave it CANCELING)."""

    def restart_backoff(self, restarts: int) -> float:
        return float(
            min(self.restart_backoff_max_s, self.restart_backoff_s * (2 ** min(restarts, 30)))
        )


# -- decisions -----------------------------------------------------------------------
#
# A decision that changes the connector's state carries that change (``change``), which
# the store applies fenced on the generation the decision was based on and the planner
# applies to its view; the others are side effects only (terminate, kill, report).


class _Decision:
    name: str
    reason: str

    @property
    def change(self) -> StateChange | None:
        """The state change this decision writes, or None for a side effect only."""
        return None

    @property
    def while_run(self) -> str | None:
        """A run that must still hold the connector live for the change to apply, or None.

        Set on the decisions that take a failed run for a crash: the snapshot of the
        connectors is read before the runs, and a run that released its connector as Error
        and then failed must not be taken for a process that died (the glue reads the
        connector again: the release happened before the failure it saw).
        """
        return None

    def expected_generation(self, planned_on: int) -> int:
        """The generation the store must still hold for the change to apply."""
        return planned_on


@dataclass(frozen=True)
class Reset(_Decision):
    """To Idle, broker cleared, generation bumped (fences the old run)."""

    name: str
    reason: str

    @property
    def change(self) -> StateChange:
        return StateChange.reset()


@dataclass(frozen=True)
class Terminate(_Decision):
    name: str
    run_id: str
    reason: str


@dataclass(frozen=True)
class KillZombie(_Decision):
    name: str
    run_id: str
    pid: int
    reason: str


@dataclass(frozen=True)
class ReportCanceled(_Decision):
    name: str
    run_id: str
    reason: str


@dataclass(frozen=True)
class Stop(_Decision):
    """To Stopped with desired stopped, generation bumped, broker cleared."""

    name: str
    reason: str

    @property
    def change(self) -> StateChange:
        return StateChange.stop()


@dataclass(frozen=True)
class MarkError(_Decision):
    name: str
    reason: str
    message: str
    run_id: str | None = None  # set when a crashed run is the cause (see ``while_run``)

    @property
    def change(self) -> StateChange:
        return StateChange.mark_error(self.message)

    @property
    def while_run(self) -> str | None:
        return self.run_id


@dataclass(frozen=True)
class Restart(_Decision):
    """Error -> Idle (unassigned) after the backoff; counts one restart."""

    name: str
    reason: str
    restarts: int

    @property
    def change(self) -> StateChange:
        return StateChange.restart(self.restarts)


@dataclass(frozen=True)
class Relaunch(_Decision):
    """The run's process died (no failure reported): to Idle at once, counted as a restart;
    the assignment step places it again in the same tick."""

    name: str
    run_id: str
    reason: str
    restarts: int

    @property
    def change(self) -> StateChange:
        return StateChange.restart(self.restarts)

    @property
    def while_run(self) -> str | None:
        return self.run_id


@dataclass(frozen=True)
class Waiting(_Decision):
    """Assigned, its run still queued or not started: the reason becomes its last error and a
    line of its history (no change of state, owner or generation)."""

    name: str
    run_id: str
    reason: str

    @property
    def change(self) -> StateChange:
        return StateChange.note(self.reason)


@dataclass(frozen=True)
class ClearRestarts(_Decision):
    name: str
    reason: str

    @property
    def change(self) -> StateChange:
        return StateChange(restarts=0)


@dataclass(frozen=True)
class Move(_Decision):
    """Off its broker (drain, down, rebalance): Reset plus terminating its run."""

    name: str
    from_broker: str
    run_id: str | None
    reason: str
    at: float = 0.0  # when: starts the rebalance cool-down

    @property
    def change(self) -> StateChange:
        return StateChange.reset(moved_at=self.at)


@dataclass(frozen=True)
class Assign(_Decision):
    """Place on a broker with generation ``generation`` (current + 1) and launch a run."""

    name: str
    broker_id: str
    generation: int
    tags: Mapping[str, str]
    reason: str

    @property
    def change(self) -> StateChange:
        return StateChange.assign(self.broker_id)

    def expected_generation(self, planned_on: int) -> int:
        # The plan may have reset the connector earlier in this tick (one bump already).
        return self.generation - 1


@dataclass(frozen=True)
class Failed(_Decision):
    name: str
    error: str
    reason: str = "scheduler error"


Decision = (
    Reset
    | Terminate
    | KillZombie
    | ReportCanceled
    | Stop
    | MarkError
    | Restart
    | Relaunch
    | Waiting
    | ClearRestarts
    | Move
    | Assign
    | Failed
)


@dataclass
class Plan:
    decisions: list[Decision] = field(default_factory=list)
    down_brokers: set[str] = field(default_factory=set)
    loads: dict[str, float] = field(default_factory=dict)

    def of(self, kind: type) -> list[Decision]:
        return [d for d in self.decisions if isinstance(d, kind)]


# -- the plan ------------------------------------------------------------------------


def weight(c: ConnectorView, cfg: SchedulerConfig) -> float:
    return 1.0 + max(0.0, c.msgs_per_s) / cfg.rate_unit


def down_brokers(
    connectors: Iterable[ConnectorView], brokers: Iterable[BrokerView], now: float
) -> set[str]:
    """Brokers whose endpoint refuses connections, or whose live connectors all lost their heartbeat."""
    live: dict[str, list[ConnectorView]] = defaultdict(list)
    for c in connectors:
        if c.broker_id and c.status in LIVE and c.heartbeat_at is not None:
            live[c.broker_id].append(c)
    out = set()
    for b in brokers:
        if (
            not b.endpoint_up
            or live[b.id]
            and all(now - (c.heartbeat_at or 0.0) > c.heartbeat_timeout_s for c in live[b.id])
        ):
            out.add(b.id)
    return out


def gone_brokers(in_file: Iterable[str], stored: Iterable[BrokerView]) -> list[str]:
    """Stored brokers the brokers file no longer names, not yet marked gone: to mark gone.

    A gone broker stays in the store (the history names it) but counts as missing: it
    gets no connector and its connectors move. Naming it in the file again revives it.
    """
    keep = set(in_file)
    return sorted(b.id for b in stored if b.id not in keep and not b.gone)


def plan(
    connectors: Sequence[ConnectorView],
    brokers: Sequence[BrokerView],
    runs: Sequence[RunView],
    now: float,
    config: SchedulerConfig | None = None,
) -> Plan:
    """Decisions for one tick; see the module docstring."""
    cfg = config or SchedulerConfig()
    out = Plan()
    by_name = {c.name: c for c in connectors}
    brokers = [b for b in brokers if not b.gone]  # a gone broker counts as missing
    broker_ids = {b.id for b in brokers}
    runs_of: dict[str, list[RunView]] = defaultdict(list)
    for r in runs:
        runs_of[r.connector].append(r)
    run_by_id = {r.run_id: r for r in runs}
    down = down_brokers(connectors, brokers, now)
    out.down_brokers = down

    # 1. reclaim runs that no connector wants
    for r in runs:
        if not r.active:
            continue
        try:
            out.decisions.extend(_reclaim(r, by_name.get(r.connector), now, cfg))
        except Exception as e:  # noqa: BLE001 - one connector never fails the tick
            out.decisions.append(Failed(r.connector, f"{type(e).__name__}: {e}"))

    # 2-6. per connector
    settled: dict[str, ConnectorView] = {}  # connector state after this tick's decisions
    healthy = {b.id for b in brokers if not b.draining and b.id not in down}
    room = _room(connectors, brokers, healthy)
    tick = _Tick(runs_of, run_by_id, broker_ids, down, room, brokers, now, cfg)
    for c in sorted(connectors, key=lambda c: c.name):
        try:
            decisions = _connector(c, tick)
        except Exception as e:  # noqa: BLE001
            out.decisions.append(Failed(c.name, f"{type(e).__name__}: {e}"))
            continue
        out.decisions.extend(decisions)
        settled[c.name] = _after(c, decisions)

    # 7. assignment
    assigned = _assign(list(settled.values()), brokers, healthy, runs_of, cfg)
    out.decisions.extend(assigned)

    # 8. rebalance (only when nothing else moved this tick)
    if not assigned and not any(isinstance(d, (Move, Reset)) for d in out.decisions):
        move = _rebalance(list(settled.values()), brokers, healthy, now, cfg)
        if move is not None:
            out.decisions.append(move)
    decided: dict[str, list[Decision]] = defaultdict(list)
    for d in out.decisions:
        decided[getattr(d, "name", "")].append(d)
    out.loads = _loads([_after(c, decided.get(c.name, [])) for c in settled.values()], brokers, cfg)
    return out


def _reclaim(
    r: RunView, c: ConnectorView | None, now: float, cfg: SchedulerConfig
) -> list[Decision]:
    if r.status == "CANCELING":
        if r.process_alive is False:
            return [
                ReportCanceled(
                    r.connector,
                    r.run_id,
                    f"run {r.run_id} canceling and its process {r.pid} is gone",
                )
            ]
        since = r.canceling_since if r.canceling_since is not None else now
        if now - since > cfg.cancel_grace_s:
            return [
                ReportCanceled(
                    r.connector,
                    r.run_id,
                    f"run {r.run_id} canceling for {now - since:.0f}s; its process is gone",
                )
            ]
        return []
    if c is None:
        return [Terminate(r.connector, r.run_id, "connector deleted")]
    if r.generation is None:
        # Launched by hand: adopted; the op claims the connector (or refuses to).
        return []
    if c.desired == DesiredState.STOPPED:
        if ending_itself(r.run_id, c, now, cfg):
            return []
        return [Terminate(c.name, r.run_id, "connector is desired stopped")]
    if r.generation < c.generation:
        return [
            Terminate(
                c.name,
                r.run_id,
                f"run of generation {r.generation} superseded by generation {c.generation}",
            )
        ]
    if c.broker_id and r.broker_id and r.broker_id != c.broker_id:
        return [
            Terminate(c.name, r.run_id, f"connector reassigned from {r.broker_id} to {c.broker_id}")
        ]
    return []


def ending_itself(run_id: str, c: ConnectorView, now: float, cfg: SchedulerConfig) -> bool:
    """Whether ``run_id`` released ``c`` itself, less than ``release_grace_s`` ago: its loop saw
    the stop, and the run is ending on its own. A terminate then would race its end (Dagster
    marks a run CANCELING even after its success, and nothing is left to end it)."""
    return (
        c.run_id == run_id
        and c.status in (ConnectorStatus.STOPPED, ConnectorStatus.ERROR)
        and now - c.status_since <= cfg.release_grace_s
    )


@dataclass(frozen=True)
class _Tick:
    """What every per-connector step may look at, besides the connector itself."""

    runs_of: Mapping[str, list[RunView]]
    run_by_id: Mapping[str, RunView]
    broker_ids: set[str]
    down: set[str]
    room: Mapping[str, int]
    brokers: Sequence[BrokerView]
    now: float
    cfg: SchedulerConfig


@dataclass(frozen=True)
class _Connector:
    """One connector in one tick, with its runs and heartbeat age worked out once."""

    c: ConnectorView
    runs: list[RunView]
    current: RunView | None
    age: float | None

    @property
    def active_current(self) -> bool:
        return self.current is not None and self.current.active

    @property
    def fresh(self) -> bool:
        return self.age is not None and self.age <= self.c.heartbeat_timeout_s

    @property
    def any_active(self) -> bool:
        return any(r.active for r in self.runs)


# Each step returns None when its rule does not apply (the next step is asked), else the
# decisions (possibly none) and no later step runs. The order is the module docstring's.
Step = Callable[[_Connector, _Tick], "list[Decision] | None"]


def _invalid_spec(x: _Connector, t: _Tick) -> list[Decision] | None:
    c = x.c
    if not c.spec_error or c.status in LIVE:
        return None  # a live run goes on with its last valid spec
    if c.status == ConnectorStatus.IDLE and c.desired.wants_run:
        return [MarkError(c.name, "invalid spec", c.spec_error)]
    return []


def _zombie(x: _Connector, t: _Tick) -> list[Decision] | None:
    """The current run is CANCELED (a force-terminate in the UI, or a run reported canceled
    after its grace period) but the connector was never released. Whether its heartbeat is
    still fresh does not matter: a hung process stops heartbeating, and a tick that comes
    late must still stop it, fence it and kill what is left of it."""
    c, current = x.c, x.current
    if current is None or current.status != "CANCELED" or c.status not in LIVE:
        return None
    state = "still heartbeats" if x.fresh else "was never released"
    out: list[Decision] = []
    if current.local and current.pid and current.process_alive is not False:
        # The kill comes first: a hung process may hold the meta store's write lock (SQLite),
        # and the Stop below could not be written until it is gone.
        out.append(
            KillZombie(
                c.name,
                current.run_id,
                current.pid,
                f"zombie run {current.run_id} (pid {current.pid})",
            )
        )
    out.append(Stop(c.name, f"run {current.run_id} was canceled but {state}: fenced as a zombie"))
    return out


def _desired_stopped(x: _Connector, t: _Tick) -> list[Decision] | None:
    c = x.c
    if c.desired != DesiredState.STOPPED:
        return None
    if c.status in (*LIVE, ConnectorStatus.IDLE) and not x.active_current and not x.any_active:
        return [Stop(c.name, "desired stopped and no run is active")]
    return []


def _lost_heartbeat(x: _Connector, t: _Tick) -> list[Decision] | None:
    c, age = x.c, x.age
    if c.status not in LIVE or age is None or age <= c.heartbeat_timeout_s:
        return None
    out: list[Decision] = [
        Reset(
            c.name,
            f"heartbeat {age:.0f}s old (timeout {c.heartbeat_timeout_s:.0f}s) on broker {c.broker_id or '-'}",
        )
    ]
    for r in x.runs:
        if not r.active:
            continue
        if r.process_alive is False:
            # Its process is gone (kill -9, OOM): nobody can acknowledge a terminate.
            out.append(ReportCanceled(c.name, r.run_id, f"run {r.run_id}: process {r.pid} is gone"))
        else:
            out.append(Terminate(c.name, r.run_id, "lost run (heartbeat timed out)"))
    return out


def _never_heartbeated(x: _Connector, t: _Tick) -> list[Decision] | None:
    c = x.c
    if (
        c.status not in LIVE
        or x.age is not None
        or t.now - c.status_since <= t.cfg.launch_timeout_s
        or x.any_active
    ):
        return None
    return [
        Reset(c.name, f"no heartbeat {t.now - c.status_since:.0f}s after start and no active run")
    ]


def _process_died(x: _Connector, t: _Tick) -> list[Decision] | None:
    """The connector is live, but its current run failed or its local process is gone.

    A connector that fails releases itself as Error before its run ends, so this one
    reported nothing: its process died (``kill -9``, the OOM killer, a crashed
    interpreter). That is no reason to wait: it is relaunched at once, counted as a
    restart. A crash again before the budget came back (``healthy_reset_s`` of running,
    ``_healthy_again``) means the restarts keep failing: Error, and the growing backoff
    of ``_restart_after_error`` from there.
    """
    c, run = x.c, x.current
    if c.status not in LIVE or run is None:
        return None
    out: list[Decision] = []
    if run.status == "FAILURE":
        how = f"run {run.run_id} failed while the connector was {c.status.value}"
    elif run.active and run.status != "CANCELING" and run.process_alive is False:
        how = f"run {run.run_id}'s process {run.pid} is gone"
        # Nobody is left to end the run: Dagster would show it running forever.
        out.append(ReportCanceled(c.name, run.run_id, f"{how} (it died)"))
    else:
        return None
    budget = f"restart {c.restarts}/{c.max_restarts}"
    if c.restarts >= c.max_restarts:
        why = f"its process died and no automatic restart is left ({budget})"
    elif c.restarts > 0:
        why = f"its process died again before running {t.cfg.healthy_reset_s:.0f}s ({budget})"
    else:
        why = None
    if why is not None:  # the restarts do not hold: Error, then the growing backoff
        out.append(MarkError(c.name, f"{how}: {why}", f"{how}: {why}", run_id=run.run_id))
        return out
    out.append(
        Relaunch(
            c.name,
            run.run_id,
            f"{how}: its process died; relaunched at once "
            f"(restart {c.restarts + 1}/{c.max_restarts})",
            c.restarts + 1,
        )
    )
    return out


def _launch_never_came(x: _Connector, t: _Tick) -> list[Decision] | None:
    c = x.c
    if c.status != ConnectorStatus.IDLE or c.broker_id is None:
        return None
    pending = [
        r for r in x.runs if r.active and (r.generation is None or r.generation == c.generation)
    ]
    if pending or t.now - c.updated_at <= t.cfg.launch_timeout_s:
        return None
    return [
        Reset(
            c.name, f"assigned to {c.broker_id} {t.now - c.updated_at:.0f}s ago but no run started"
        )
    ]


def _restart_after_error(x: _Connector, t: _Tick) -> list[Decision] | None:
    c = x.c
    if c.status != ConnectorStatus.ERROR:
        return None
    if x.any_active or c.restarts >= c.max_restarts or is_data_error(c.last_error):
        # A data error needs a person: restarting would fail on the same message again.
        return []
    wait = t.cfg.restart_backoff(c.restarts)
    if t.now - c.status_since < wait:
        return []
    return [
        Restart(
            c.name,
            f"automatic restart {c.restarts + 1}/{c.max_restarts} after {wait:.0f}s backoff",
            c.restarts + 1,
        )
    ]


def _healthy_again(x: _Connector, t: _Tick) -> list[Decision] | None:
    c = x.c
    if (
        c.status != ConnectorStatus.RUNNING
        or c.restarts <= 0
        or t.now - c.status_since <= t.cfg.healthy_reset_s
    ):
        return None
    return [
        ClearRestarts(c.name, f"running for {t.now - c.status_since:.0f}s: restart budget restored")
    ]


def _off_a_bad_broker(x: _Connector, t: _Tick) -> list[Decision] | None:
    c = x.c
    if c.broker_id is None or c.status not in (*LIVE, ConnectorStatus.IDLE):
        return None
    b = next((b for b in t.brokers if b.id == c.broker_id), None)
    run_id = x.current.run_id if x.active_current and x.current else None
    if c.broker_id not in t.broker_ids:
        why = f"broker {c.broker_id} no longer exists (gone from the brokers file)"
    elif b is not None and b.draining:
        why = f"broker {c.broker_id} is draining"
    elif c.broker_id in t.down and any(n > 0 for bid, n in t.room.items() if bid != c.broker_id):
        why = f"broker {c.broker_id} is down"
    else:
        return None
    return [Move(c.name, c.broker_id, run_id, why, at=t.now)]


def _run_waits(x: _Connector, t: _Tick) -> list[Decision] | None:
    """Assigned, and the run launched for it is still in the run queue (or launched and not
    started) after ``run_wait_s``: the connector says why, once per reason."""
    c = x.c
    if c.status != ConnectorStatus.IDLE or c.broker_id is None or not c.desired.wants_run:
        return None
    waiting = [
        r
        for r in x.runs
        if r.status in WAITING_RUN_STATUSES
        and r.generation == c.generation
        and r.status_since is not None
        and t.now - r.status_since > t.cfg.run_wait_s
    ]
    if not waiting:
        return None
    r = waiting[0]
    if r.status == "QUEUED":
        why = r.blocker or "not dequeued (is dagster-daemon running?)"
        how = f"run {r.run_id[:8]} queued over {t.cfg.run_wait_s:.0f}s, {why}"
    else:
        how = f"run {r.run_id[:8]} launched, not started after {t.cfg.run_wait_s:.0f}s"
    reason = f"{WAITING_FOR_A_RUN} on {c.broker_id}: {how}"
    if c.last_error == reason:
        return []  # said already
    return [Waiting(c.name, r.run_id, reason)]


STEPS: tuple[Step, ...] = (
    _invalid_spec,
    _zombie,
    _desired_stopped,
    _lost_heartbeat,
    _never_heartbeated,
    _process_died,
    _launch_never_came,
    _restart_after_error,
    _healthy_again,
    _off_a_bad_broker,
    _run_waits,
)


def _connector(c: ConnectorView, t: _Tick) -> list[Decision]:
    """The first step whose rule applies decides (see STEPS)."""
    x = _Connector(
        c=c,
        runs=t.runs_of.get(c.name, []),
        current=t.run_by_id.get(c.run_id) if c.run_id else None,
        age=c.heartbeat_age(t.now),
    )
    for step in STEPS:
        decided = step(x, t)
        if decided is not None:
            return decided
    return []


def _after(c: ConnectorView, decisions: Sequence[Decision]) -> ConnectorView:
    """The connector as the store will hold it once ``decisions`` are applied."""
    for d in decisions:
        if d.change is not None:
            c = d.change.applied_to(c)
    return c


def _occupies(c: ConnectorView) -> bool:
    """Whether the connector holds a slot on its broker."""
    return (
        c.broker_id is not None
        and c.status in (*LIVE, ConnectorStatus.IDLE)
        and c.desired.wants_run
    )


def _room(
    connectors: Sequence[ConnectorView], brokers: Sequence[BrokerView], healthy: set[str]
) -> dict[str, int]:
    used: dict[str, int] = defaultdict(int)
    for c in connectors:
        if _occupies(c):
            used[c.broker_id or ""] += 1
    return {b.id: b.capacity - used[b.id] for b in brokers if b.id in healthy}


def _loads(
    connectors: Sequence[ConnectorView], brokers: Sequence[BrokerView], cfg: SchedulerConfig
) -> dict[str, float]:
    loads = {b.id: 0.0 for b in brokers}
    for c in connectors:
        if _occupies(c) and c.broker_id in loads:
            loads[c.broker_id] += weight(c, cfg)
    return loads


def _assign(
    connectors: list[ConnectorView],
    brokers: Sequence[BrokerView],
    healthy: set[str],
    runs_of: Mapping[str, list[RunView]],
    cfg: SchedulerConfig,
) -> list[Decision]:
    wanting = [
        c
        for c in connectors
        if c.desired.wants_run
        and c.status == ConnectorStatus.IDLE
        and c.broker_id is None
        and not c.spec_error
        and c.launchable
        and not any(
            r.active and (r.generation is None or r.generation >= c.generation)
            for r in runs_of.get(c.name, [])
        )
    ]
    if not wanting:
        return []
    loads = _loads(connectors, brokers, cfg)
    counts: dict[str, int] = defaultdict(int)
    for c in connectors:
        if _occupies(c):
            counts[c.broker_id or ""] += 1
    by_id = {b.id: b for b in brokers}
    heap = [
        (loads[b.id], counts[b.id], b.id)
        for b in brokers
        if b.id in healthy and counts[b.id] < b.capacity
    ]
    heapq.heapify(heap)
    out: list[Decision] = []
    for c in sorted(wanting, key=lambda c: c.name):
        if not heap:
            break
        load, count, bid = heapq.heappop(heap)
        b = by_id[bid]
        gen = c.generation + 1
        out.append(
            Assign(
                c.name,
                bid,
                gen,
                dict(b.run_tags),
                f"assigned to {bid} (load {load:.2f}, {count}/{b.capacity} connectors)",
            )
        )
        if count + 1 < b.capacity:
            heapq.heappush(heap, (load + weight(c, cfg), count + 1, bid))
    return out


def _rebalance(
    connectors: list[ConnectorView],
    brokers: Sequence[BrokerView],
    healthy: set[str],
    now: float,
    cfg: SchedulerConfig,
) -> Decision | None:
    last_move = max((c.last_moved_at or -math.inf for c in connectors), default=-math.inf)
    if now - last_move < cfg.rebalance_cooldown_s:
        return None
    pool = [b for b in brokers if b.id in healthy]
    if len(pool) < 2:
        return None
    loads = _loads(connectors, pool, cfg)
    counts: dict[str, int] = defaultdict(int)
    for c in connectors:
        if _occupies(c):
            counts[c.broker_id or ""] += 1
    hi = max(pool, key=lambda b: (loads[b.id], b.id))
    targets = [b for b in pool if counts[b.id] < b.capacity and b.id != hi.id]
    if not targets:
        return None
    lo = min(targets, key=lambda b: (loads[b.id], b.id))
    gap = loads[hi.id] - loads[lo.id]
    if gap <= cfg.rebalance_threshold:
        return None
    # Only a settled, running connector moves, and only one whose weight is below the gap,
    # so the move strictly narrows it (min + w < max): the next tick cannot move it back.
    movable = [
        c
        for c in connectors
        if c.broker_id == hi.id
        and c.status == ConnectorStatus.RUNNING
        and _occupies(c)
        and weight(c, cfg) < gap
    ]
    if not movable:
        return None
    pick = min(movable, key=lambda c: (abs(gap / 2 - weight(c, cfg)), c.name))
    return Move(
        pick.name,
        hi.id,
        pick.run_id,
        f"rebalance: {hi.id} load {loads[hi.id]:.2f} vs {lo.id} {loads[lo.id]:.2f}",
        at=now,
    )
