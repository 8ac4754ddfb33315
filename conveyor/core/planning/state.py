"""A connector's state transitions as values.

Every decision that changes who owns a connector or what state it is in carries a
``StateChange``. The meta store applies it in one place (``MetaStore.apply``: one
conditional UPDATE fenced on the generation the decision was based on, plus a
history line), and the scheduler applies the same value to its in-memory view to
plan the rest of a tick (``StateChange.applied_to``). So "reset to Idle, broker
cleared, generation + 1" is written once, here, as ``StateChange.reset()``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypeVar

from conveyor.core.model import ConnectorStatus, DesiredState

V = TypeVar("V")


@dataclass(frozen=True)
class StateChange:
    """What one transition writes. Fields left at their default keep the stored value."""

    status: ConnectorStatus | None = None
    desired: DesiredState | None = None
    bump_generation: bool = False
    """Fences every run of the current generation: their commits and heartbeats are refused."""
    broker_id: str | None = None
    """Place the connector on this broker (an assignment)."""
    clear_broker: bool = False
    """The connector no longer holds a slot on its broker."""
    clear_run: bool = False
    """Forget the run (id, pid, heartbeat): a fresh assignment awaits its run."""
    clear_pid: bool = False
    """The run's process is ending (its run id stays for the record)."""
    error: str | None = None
    """The connector's last error; a change to Running or Idle without one clears it."""
    restarts: int | None = None
    """Set the restart count (and clear the pending restart time)."""
    moved_at: float | None = None
    """When the scheduler moved the connector off its broker (rebalance cool-down)."""
    counters: dict[str, Any] | None = None
    """The run's final counters."""
    noted: bool = False
    """A line in the history even without a change of status, generation or budget."""

    # -- the named transitions --------------------------------------------------------

    @classmethod
    def reset(cls, *, moved_at: float | None = None) -> StateChange:
        """To Idle, off its broker, generation bumped: the old run is fenced, a new one will come."""
        return cls(
            status=ConnectorStatus.IDLE, bump_generation=True, clear_broker=True, moved_at=moved_at
        )

    @classmethod
    def restart(cls, restarts: int) -> StateChange:
        """An Error connector back to Idle for an automatic restart, counted."""
        return replace(cls.reset(), restarts=restarts)

    @classmethod
    def stop(cls) -> StateChange:
        """To Stopped and desired stopped, fenced, off its broker."""
        return cls(
            status=ConnectorStatus.STOPPED,
            desired=DesiredState.STOPPED,
            bump_generation=True,
            clear_broker=True,
        )

    @classmethod
    def assign(cls, broker_id: str) -> StateChange:
        """Onto a broker with a new generation; the run that claims it is launched next."""
        return cls(broker_id=broker_id, bump_generation=True, clear_run=True)

    @classmethod
    def note(cls, reason: str) -> StateChange:
        """Nothing changes but the reason shown (the last error) and a line in the history:
        why a connector is not running, while it waits for something outside it."""
        return cls(error=reason, noted=True)

    @classmethod
    def mark_error(cls, message: str) -> StateChange:
        return cls(status=ConnectorStatus.ERROR, error=message)

    @classmethod
    def release(
        cls,
        status: ConnectorStatus,
        *,
        error: str | None = None,
        counters: dict[str, Any] | None = None,
    ) -> StateChange:
        """A run ends with ``status``; a stopped or failed connector holds no broker slot."""
        return cls(
            status=status,
            desired=DesiredState.STOPPED if status == ConnectorStatus.STOPPED else None,
            clear_broker=status in (ConnectorStatus.STOPPED, ConnectorStatus.ERROR),
            clear_pid=True,
            error=error,
            counters=counters,
        )

    # -- applying it ---------------------------------------------------------------------

    def is_recorded(self, old_status: ConnectorStatus) -> bool:
        """Whether the transition deserves a line in the connector's history."""
        return (
            (self.status is not None and self.status != old_status)
            or self.bump_generation
            or self.restarts is not None
            or self.noted
        )

    def applied_to(self, view: V) -> V:
        """``view`` (any dataclass with the connector's fields) as the store will hold it."""
        values: dict[str, Any] = {}
        if self.status is not None:
            values["status"] = self.status
        if self.desired is not None:
            values["desired"] = self.desired
        if self.bump_generation:
            values["generation"] = view.generation + 1  # type: ignore[attr-defined]
        if self.clear_broker:
            values["broker_id"] = None
        if self.broker_id is not None:
            values["broker_id"] = self.broker_id
        if self.restarts is not None:
            values["restarts"] = self.restarts
        if self.moved_at is not None:
            values["last_moved_at"] = self.moved_at
        return replace(view, **values)  # type: ignore[type-var]
