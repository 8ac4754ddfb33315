"""Reading connectors: their config, status, history, tasks, offsets and destinations, as shown.

Everything returned is safe to show: specs are redacted (``LoadedSpec.display``), secrets
never leave the file they are written in. Kafka Connect's shapes (status, info, KIP-875
offsets) carry Conveyor's own view alongside.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from conveyor.config.specs import load_source
from conveyor.control.metrics import destinations_json, row_head
from conveyor.control.operation_context import OperationsPart
from conveyor.core.model import ConnectorStatus
from conveyor.store.meta import ConnectorRow

# Kafka Connect's connector and task states, from Conveyor's statuses.
KAFKA_CONNECT_STATE = {
    ConnectorStatus.IDLE: "UNASSIGNED",
    ConnectorStatus.RUNNING: "RUNNING",
    ConnectorStatus.DEGRADED: "RUNNING",
    ConnectorStatus.PAUSED: "PAUSED",
    ConnectorStatus.STOPPED: "STOPPED",
    ConnectorStatus.ERROR: "FAILED",
}


class ConnectorReads(OperationsPart):
    """What the CLI and the API show of a connector."""

    def config(self, name: str) -> dict[str, Any]:
        """The spec as written, secrets redacted (the current file; the stored copy if it is gone)."""
        row = self.row(name)
        loaded = load_source(name, row.spec_source)
        if loaded.ok and loaded.display() is not None:
            return loaded.display() or {}
        return row.spec or {}

    def info(self, name: str) -> dict[str, Any]:
        """Kafka Connect's connector info: name, config, tasks, type."""
        row = self.row(name)
        return {
            "name": name,
            "config": self.config(name),
            "tasks": [{"connector": name, "task": 0}],
            "type": connector_kind(row),
            "spec_source": row.spec_source,
        }

    def status(self, name: str) -> dict[str, Any]:
        """Kafka Connect's status (connector, one task per run, trace of the last error) plus
        Conveyor's own view under ``conveyor``. A connector run as partition tasks lists
        its tasks (RUNNING while heartbeating)."""
        status = status_of(self.row(name))
        tasks = self.tasks(name)
        if tasks:
            timeout = float((self.row(name).spec or {}).get("heartbeat_timeout_s", 30.0))
            status["tasks"] = [
                {
                    "id": t["task"],
                    "state": "RUNNING"
                    if t["heartbeat_age_s"] is not None and t["heartbeat_age_s"] < timeout
                    else "UNASSIGNED",
                    "worker_id": t["broker"] or "-",
                }
                for t in tasks
            ]
        return status

    def summary(self, name: str) -> dict[str, Any]:
        return row_summary(self.row(name))

    def history(self, name: str, limit: int = 30) -> list[dict[str, Any]]:
        self.row(name)
        return [
            {
                "at": h.at,
                "at_iso": _iso(h.at),
                "from": h.from_status,
                "to": h.to_status,
                "generation": h.generation,
                "run_id": h.run_id,
                "reason": h.reason,
            }
            for h in self.store.history(name, limit)
        ]

    def tasks(self, name: str) -> list[dict[str, Any]]:
        """A connector's partition tasks (``tasks.max > 1``): partitions, rate and lag of each."""
        import time

        from conveyor.store.tasks import TaskStore

        self.row(name)
        now = time.time()
        out = []
        for t in TaskStore(self.store).tasks(name):
            latest = t.latest()
            out.append(
                {
                    "task": t.task_id,
                    "status": t.status,
                    "broker": t.broker_id,
                    "generation": t.generation,
                    "run_id": t.run_id,
                    "heartbeat_age_s": None
                    if t.heartbeat_at is None
                    else round(now - t.heartbeat_at, 1),
                    "partitions": [str(tp) for tp in sorted(t.partitions)],
                    "releasing": {str(tp): to for tp, to in sorted(t.releasing.items())},
                    "incoming": [str(tp) for tp in sorted(t.incoming)],
                    "msgs_per_s": round(latest.rate, 1) if latest else None,
                    "lag": latest.lag if latest else None,
                    "by_partition": {
                        str(tp): {
                            "msgs_per_s": round(latest.rates.get(tp, 0.0), 1),
                            "lag": latest.lags.get(tp),
                        }
                        for tp in sorted(set(t.owned) | t.partitions)  # with those moving out
                    }
                    if latest
                    else {},
                }
            )
        return out

    def offsets(self, name: str) -> dict[str, Any]:
        """KIP-875: ``{"offsets": [{"partition": {...}, "offset": {"kafka_offset": n}}]}``,
        the next offset to read per partition."""
        self.row(name)
        return {
            "offsets": [
                {
                    "partition": {"kafka_topic": tp.topic, "kafka_partition": tp.partition},
                    "offset": {"kafka_offset": off},
                }
                for tp, off in sorted(self.store.committed_offsets(name).items())
            ]
        }

    def destination(self, name: str) -> dict[str, Any]:
        """Where the connector writes: the sink, its Dagster asset, and delivery counters."""
        row = self.row(name)
        loaded = load_source(name, row.spec_source)
        sink = (self.config(name) or {}).get("sink") or {}
        counters = row.counters
        return {
            "name": name,
            "type": sink.get("type"),
            "asset_key": "/".join(loaded.sink.asset_key_path()) if loaded.sink else None,
            "config": sink,
            "delivered": counters.get("messages_out", 0),
            "failed": counters.get("failed", 0),
            "dead_lettered": counters.get("dead_lettered", 0),
            "msgs_per_s": counters.get("msgs_per_s", 0.0),
            "lag": counters.get("lag"),
            "routed": bool(
                any("__destination" in s for s in (loaded.spec.transform.select or []))
                if loaded.spec
                else False
            ),
        }

    def destinations(self, name: str) -> dict[str, Any]:
        """A source connector's destinations: produced count, breaker, failures, last error;
        and its routing totals (rejected by reason, unmatched by action)."""
        row = self.row(name)
        routing = row.counters.get("routing") or {}
        info = self.store.source_state_info(name)
        return {
            "name": name,
            "kind": connector_kind(row),
            "destinations": destinations_json(row.counters),
            "routed": routing.get("routed", 0),
            "destinations_active": routing.get("destinations_active", 0),
            "rejected": routing.get("rejected", {}),
            "unmatched": routing.get("unmatched", {}),
            "open_breakers": routing.get("open_breakers", 0),
            "commit_failures_in_row": row.counters.get("commit_failures_in_row", 0),
            "state": (info or {}).get("state"),
            "abandon_requested": bool((info or {}).get("abandon_requested")),
            "last_abandon_at": (info or {}).get("last_abandon_at"),
        }


def _iso(ts: float | None) -> str | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat()


def row_summary(r: ConnectorRow) -> dict[str, Any]:
    """One connector's state as the CLI's ``--json`` and the API's ``conveyor`` section show it."""
    return {
        **row_head(r),
        "run_id": r.run_id,
        "heartbeat_at": r.heartbeat_at,
        "counters": r.counters,
        "last_error": r.last_error,
        "spec_source": r.spec_source,
        "spec_error": r.spec_error,
        "kind": connector_kind(r),
    }


def connector_kind(r: ConnectorRow) -> str:
    """``source`` for a source connector (its stored spec says ``kind: source``), else ``sink``."""
    return "source" if (r.spec or {}).get("kind") == "source" else "sink"


def status_of(r: ConnectorRow, now: float | None = None) -> dict[str, Any]:
    import time

    now = time.time() if now is None else now
    state = KAFKA_CONNECT_STATE[r.status]
    worker = r.broker_id or "-"
    trace = r.last_error or r.spec_error
    task: dict[str, Any] = {"id": 0, "state": state, "worker_id": worker}
    connector: dict[str, Any] = {"state": state, "worker_id": worker}
    if trace:
        task["trace"] = trace
        if r.status == ConnectorStatus.ERROR:
            connector["trace"] = trace
    counters = r.counters
    return {
        "name": r.name,
        "connector": connector,
        "tasks": [task] if r.run_id or r.status != ConnectorStatus.STOPPED else [],
        "type": connector_kind(r),
        "conveyor": {
            **row_summary(r),
            "status_since": _iso(r.status_since),
            "heartbeat_age_s": None if r.heartbeat_at is None else round(now - r.heartbeat_at, 3),
            "lag": counters.get("lag"),
            "msgs_per_s": counters.get("msgs_per_s", 0.0),
            "delivered": counters.get("messages_out", 0),
            "restarts": r.restarts,
        },
    }
