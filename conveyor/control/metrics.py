"""Prometheus exporter: ``conveyor metrics serve``.

Reads the meta store on every scrape (no state of its own), so any number of
exporters can run. Metric names use the ``conveyor_connector_`` prefix and carry
only the ``connector`` label (plus ``state`` on the state gauge): low cardinality.
``/connectors/<name>`` returns per-partition offsets and lag as JSON.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from conveyor.core.model import ConnectorStatus
from conveyor.store.meta import LIVE_STATUSES, ConnectorRow, MetaStore, UnknownConnectorError

COUNTERS = {
    "messages_out": (
        "conveyor_connector_messages_sent",
        "Messages delivered to the sink (current run).",
    ),
    "failed": (
        "conveyor_connector_messages_failed",
        "Messages that failed delivery or decoding (current run).",
    ),
    "discarded": (
        "conveyor_connector_messages_discarded",
        "Messages discarded by the failure policy (current run).",
    ),
    "dead_lettered": (
        "conveyor_connector_messages_dead_lettered",
        "Messages written to the dead-letter store (current run).",
    ),
    "retries": (
        "conveyor_connector_retries",
        "Retries of outages and failed messages (current run).",
    ),
    "commit_failures": (
        "conveyor_connector_offset_commit_failures",
        "Offset commits that failed (current run).",
    ),
}


# Gauges a source reports with its heartbeats (``Source.metrics``).
SOURCE_GAUGES = {
    "replication_lag_bytes": "postgres_cdc: WAL bytes between the server's end and the slot's "
    "confirmed position.",
    "retained_wal_bytes": "postgres_cdc: WAL bytes the server keeps for the slot (from its "
    "restart position).",
}


def collect(store: MetaStore, now: float | None = None) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    now = now or time.time()
    rows = store.list()
    families = {
        k: CounterMetricFamily(name, doc, labels=["connector"])
        for k, (name, doc) in COUNTERS.items()
    }
    lag = GaugeMetricFamily(
        "conveyor_connector_lag", "Messages behind the log's high watermark.", labels=["connector"]
    )
    rate = GaugeMetricFamily(
        "conveyor_connector_msgs_per_second",
        "Delivery rate over the last minute.",
        labels=["connector"],
    )
    up = GaugeMetricFamily(
        "conveyor_connector_up",
        "1 if Running, Degraded or Paused with a fresh heartbeat.",
        labels=["connector"],
    )
    state = GaugeMetricFamily(
        "conveyor_connector_state",
        "1 for the connector's current state.",
        labels=["connector", "state"],
    )
    heartbeat = GaugeMetricFamily(
        "conveyor_connector_heartbeat_age_seconds",
        "Seconds since the last heartbeat.",
        labels=["connector"],
    )
    gauges = {
        k: GaugeMetricFamily(f"conveyor_source_{k}", doc, labels=["connector"])
        for k, doc in SOURCE_GAUGES.items()
    }
    routing = RoutingFamilies()
    registry = RegistryFamilies()
    for r in rows:
        counters = r.counters
        routing.add(r.name, counters, now)
        registry.add(r.name, counters)
        for key, fam in families.items():
            fam.add_metric([r.name], float(counters.get(key, 0) or 0))
        if counters.get("lag") is not None:
            lag.add_metric([r.name], float(counters["lag"]))
        for k, fam in gauges.items():
            if counters.get(k) is not None:
                fam.add_metric([r.name], float(counters[k]))
        rate.add_metric([r.name], float(counters.get("msgs_per_s", 0) or 0))
        timeout = float((r.spec or {}).get("heartbeat_timeout_s", 30))
        alive = r.status in LIVE_STATUSES and r.heartbeat_fresh(now, timeout)
        up.add_metric([r.name], 1.0 if alive else 0.0)
        for s in ConnectorStatus:
            state.add_metric([r.name, s.value], 1.0 if r.status == s else 0.0)
        if r.heartbeat_at is not None:
            heartbeat.add_metric([r.name], max(0.0, now - r.heartbeat_at))
    yield from families.values()
    yield from (lag, rate, up, state, heartbeat)
    yield from gauges.values()
    yield from routing.families()
    yield from registry.families()


class RegistryFamilies:
    """A connector's schema registry lookups (decode avro, protobuf, json_schema): how each
    was answered, what the bounded caches dropped and hold (``formats.registry.Registry``)."""

    LOOKUPS = {
        "cached": "lookups_cached",
        "unknown_cached": "lookups_unknown_cached",
        "requested": "requests",
    }

    def __init__(self) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.lookups = CounterMetricFamily(
            "conveyor_connector_schema_lookups",
            "Schema lookups by how they were answered: cached (a schema in memory), "
            "unknown_cached (an id the registry did not know, remembered), requested (asked "
            "of the registry) (current run).",
            labels=["connector", "result"],
        )
        self.evictions = CounterMetricFamily(
            "conveyor_connector_schema_cache_evictions",
            "Entries dropped from the bounded caches: schemas, unknown ids (current run).",
            labels=["connector", "cache"],
        )
        self.entries = GaugeMetricFamily(
            "conveyor_connector_schema_cache_entries",
            "Entries in the bounded caches: schemas, unknown ids.",
            labels=["connector", "cache"],
        )

    def add(self, name: str, counters: dict[str, Any]) -> None:
        r = counters.get("schema_registry")
        if not isinstance(r, dict):
            return
        for result, key in self.LOOKUPS.items():
            self.lookups.add_metric([name, result], float(r.get(key, 0) or 0))
        self.evictions.add_metric([name, "schemas"], float(r.get("evictions", 0) or 0))
        self.evictions.add_metric([name, "unknown"], float(r.get("unknown_evictions", 0) or 0))
        self.entries.add_metric([name, "schemas"], float(r.get("schemas_cached", 0) or 0))
        self.entries.add_metric([name, "unknown"], float(r.get("unknown_cached", 0) or 0))

    def families(self) -> Iterator[Any]:
        yield from (self.lookups, self.evictions, self.entries)


class RoutingFamilies:
    """Source connectors' routing metrics: the connector label, plus a bounded reason or
    action label; never a destination name (unbounded: that detail is JSON,
    ``/connectors/<name>/destinations``)."""

    def __init__(self) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.routed = CounterMetricFamily(
            "conveyor_connector_routed",
            "Messages produced into their destination (current run).",
            labels=["connector"],
        )
        self.active = GaugeMetricFamily(
            "conveyor_connector_destinations_active",
            "Destinations produced into (current run).",
            labels=["connector"],
        )
        self.rejected = CounterMetricFamily(
            "conveyor_connector_rejected",
            "Rows refused by routing: cap, denylist, unknown, circuit_open, partition_id_out_of_range, undecodable.",
            labels=["connector", "reason"],
        )
        self.unmatched = CounterMetricFamily(
            "conveyor_connector_unmatched",
            "Rows without a destination, by action taken (default, drop).",
            labels=["connector", "action"],
        )
        self.create = GaugeMetricFamily(
            "conveyor_connector_destination_create_seconds_max",
            "Longest time a destination took to be created or checked on first use (current run).",
            labels=["connector"],
        )
        self.open = GaugeMetricFamily(
            "conveyor_connector_open_breakers",
            "Destinations whose circuit breaker is not closed.",
            labels=["connector"],
        )

    def add(self, name: str, counters: dict[str, Any], now: float) -> None:
        r = counters.get("routing")
        if not isinstance(r, dict):
            return
        self.routed.add_metric([name], float(r.get("routed", 0) or 0))
        self.active.add_metric([name], float(r.get("destinations_active", 0) or 0))
        for reason, n in (r.get("rejected") or {}).items():
            self.rejected.add_metric([name, str(reason)], float(n))
        for action, n in (r.get("unmatched") or {}).items():
            self.unmatched.add_metric([name, str(action)], float(n))
        times = [
            d.get("create_ms")
            for d in (r.get("destinations") or {}).values()
            if d.get("create_ms") is not None
        ]
        if times:
            self.create.add_metric([name], max(times) / 1000)
        self.open.add_metric([name], float(r.get("open_breakers", 0) or 0))

    def families(self) -> Iterator[Any]:
        yield from (self.routed, self.active, self.rejected, self.unmatched, self.create, self.open)


def destinations_json(counters: dict[str, Any]) -> dict[str, Any]:
    """Per destination: produced count, breaker state, consecutive failures, last error."""
    r = counters.get("routing")
    return dict(r.get("destinations") or {}) if isinstance(r, dict) else {}


def _highwaters(counters: dict[str, Any]) -> dict[str, int]:
    """Per-partition high watermarks a run may report with its heartbeat, keyed ``topic[partition]``."""
    hw = counters.get("highwaters")
    if not isinstance(hw, dict):
        return {}
    return {str(k): int(v) for k, v in hw.items() if isinstance(v, (int, float))}


def row_head(r: ConnectorRow) -> dict[str, Any]:
    """What every JSON view of a connector starts with (this exporter's, the CLI's and the
    API's): its name, status, desired state, broker and generation."""
    return {
        "name": r.name,
        "status": r.status.value,
        "desired": r.desired.value,
        "broker": r.broker_id,
        "generation": r.generation,
    }


def connector_json(store: MetaStore, name: str) -> dict[str, Any]:
    """Status, counters, and per partition the committed offset, high watermark and lag.

    A partition's lag is ``highwater - committed`` when the run reported its high
    watermarks (``highwaters`` in the heartbeat counters), else null; ``lag`` at
    the top is the run's total; ``given_up``: the messages the run gave up there (a stored
    position outside the log, ``source.out_of_range``).
    """
    r = store.get(name)
    offsets = store.committed_offsets(name)
    highwaters = _highwaters(r.counters)
    given_up = r.counters.get("given_up") or {}
    partitions = []
    for tp, off in sorted(offsets.items()):
        hw = highwaters.get(str(tp))
        partitions.append(
            {
                "topic": tp.topic,
                "partition": tp.partition,
                "committed": off,
                "highwater": hw,
                "lag": None if hw is None else max(0, hw - off),
                # Messages this run gave up (a position outside the log, core/positions.py).
                "given_up": int(given_up.get(str(tp), 0)),
            }
        )
    return {
        **row_head(r),
        "heartbeat_at": r.heartbeat_at,
        "lag": r.counters.get("lag"),
        "partitions": partitions,
        "counters": r.counters,
        "last_error": r.last_error,
    }


class StoreCollector:
    """A Prometheus collector that reads the meta store on each scrape."""

    def __init__(self, store: MetaStore):
        self.store = store

    def collect(self) -> Iterator[Any]:
        return collect(self.store)


def make_server(store: MetaStore, host: str = "127.0.0.1", port: int = 9464) -> ThreadingHTTPServer:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(StoreCollector(store))  # type: ignore[arg-type]

    def route(path: str) -> tuple[bytes, str, int]:
        if path == "/metrics":
            return generate_latest(registry), "text/plain; version=0.0.4; charset=utf-8", 200
        if m := re.fullmatch(r"/connectors/([^/]+)/destinations", path):
            try:
                row = store.get(unquote(m.group(1)))
            except UnknownConnectorError as e:
                return json.dumps({"error": str(e)}).encode(), "application/json", 404
            body = {"name": row.name, "destinations": destinations_json(row.counters)}
            return json.dumps(body).encode(), "application/json", 200
        if m := re.fullmatch(r"/connectors/([^/]+)", path):
            try:
                return (
                    json.dumps(connector_json(store, unquote(m.group(1)))).encode(),
                    "application/json",
                    200,
                )
            except UnknownConnectorError as e:
                return json.dumps({"error": str(e)}).encode(), "application/json", 404
        if path == "/connectors":
            return json.dumps([r.name for r in store.list()]).encode(), "application/json", 200
        return b"not found: try /metrics or /connectors/<name>\n", "text/plain", 404

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            path = urlsplit(self.path).path.rstrip("/") or "/"
            try:
                body, ctype, code = route(path)
            except Exception as e:  # noqa: BLE001 - a scrape must get an answer, not a closed socket
                body, ctype, code = (
                    f"meta store unavailable: {type(e).__name__}: {e}\n".encode(),
                    "text/plain",
                    503,
                )
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)
