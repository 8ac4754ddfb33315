"""Scrape /metrics and /connectors/<name> from a real `conveyor metrics serve` process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.core.host.ports import free_port, port_open
from conveyor.core.model import ConnectorStatus, TopicPartition
from conveyor.store.meta import MetaStore

STATES = [s.value for s in ConnectorStatus]
ORDERS_COUNTERS = {
    "messages_in": 2010,
    "messages_out": 2000,
    "failed": 3,
    "dead_lettered": 2,
    "discarded": 1,
    "retries": 5,
    "commit_failures": 4,
    "lag": 17,
    "msgs_per_s": 99.5,
    "highwaters": {"orders[0]": 1244, "orders[1]": 773},
    # Schema registry lookups (issue 45): as formats.registry.Registry.metrics reports them.
    "schema_registry": {
        "lookups_cached": 9000,
        "lookups_unknown_cached": 800,
        "requests": 41,
        "evictions": 12,
        "unknown_evictions": 3,
        "schemas_cached": 29,
        "unknown_cached": 17,
    },
}
# Families with one more label than the connector, each from a fixed set of values.
BOUNDED_LABELS = {
    "conveyor_connector_state": "state",
    "conveyor_connector_schema_lookups_total": "result",
    "conveyor_connector_schema_cache_evictions_total": "cache",
    "conveyor_connector_schema_cache_entries": "cache",
}


def claim(store: MetaStore, name: str) -> int:
    return store.claim(
        name, run_id=f"run_{name}", expected_generation=None, holder_alive=lambda r: False
    ).generation


@pytest.fixture
def meta_url(tmp_path: Path) -> str:
    """A SQLite meta store with four connectors in known states and with known counters."""
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    store = MetaStore(url)
    for name in ("orders", "clicks", "fresh", "done"):
        store.sync_spec(
            name,
            spec_json=json.dumps({"name": name, "heartbeat_timeout_s": 30}),
            spec_hash=name,
            source=f"{name}.yaml",
            error=None,
        )
    # orders: running, 2000 messages delivered, offsets on two partitions.
    g = claim(store, "orders")
    store.commit("orders", g, {TopicPartition("orders", 0): 1234, TopicPartition("orders", 1): 766})
    store.heartbeat("orders", g, ORDERS_COUNTERS)
    # clicks: Running, but its last heartbeat is 120 s old (timeout 30 s): not up. No lag known yet.
    stale = MetaStore(url, clock=lambda: time.time() - 120)
    g = claim(stale, "clicks")
    stale.heartbeat("clicks", g, {"messages_out": 7, "lag": None})
    stale.close()
    # done: ran and stopped cleanly with final counters.
    g = claim(store, "done")
    store.commit("done", g, {TopicPartition("done", 0): 50})
    store.heartbeat("done", g, {"messages_out": 50, "lag": 0})
    store.release(
        "done", g, ConnectorStatus.STOPPED, "stopped", counters={"messages_out": 50, "lag": 0}
    )
    # fresh: never ran (Idle).
    store.close()
    return url


@pytest.fixture
def server(meta_url: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conveyor.control.cli",
            "--meta-url",
            meta_url,
            "metrics",
            "serve",
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while not port_open("127.0.0.1", port):
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "metrics server did not listen within 30 s"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            status = Path(f"/proc/{proc.pid}/status")
            masks = [ln for ln in status.read_text().splitlines() if ln.startswith("Sig")]
            proc.kill()
            proc.wait(10)
            # Seen once under full-suite load (2 of 1,200 tests): recorded, not hidden.
            warnings.warn(
                f"metrics server outlived SIGTERM by 10 s ({'; '.join(masks)})", stacklevel=1
            )


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def scrape(
    base: str,
) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], dict[str, str]]:
    """Samples keyed by (name, sorted labels), and each family's type."""
    status, ctype, body = get(f"{base}/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    samples, types = {}, {}
    for fam in text_string_to_metric_families(body.decode()):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def value(samples, name: str, connector: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted({"connector": connector, **labels}.items()))))


def test_metrics_reflect_the_meta_store(server: str):
    samples, types = scrape(server)
    expected = {
        "conveyor_connector_messages_sent_total": 2000,
        "conveyor_connector_messages_failed_total": 3,
        "conveyor_connector_messages_discarded_total": 1,
        "conveyor_connector_messages_dead_lettered_total": 2,
        "conveyor_connector_retries_total": 5,
        "conveyor_connector_offset_commit_failures_total": 4,
        "conveyor_connector_lag": 17,
        "conveyor_connector_msgs_per_second": 99.5,
        "conveyor_connector_up": 1,
    }
    for name, v in expected.items():
        assert value(samples, name, "orders") == v, name
    for state in STATES:
        assert value(samples, "conveyor_connector_state", "orders", state=state) == (
            1.0 if state == "Running" else 0.0
        ), state
    assert 0 <= value(samples, "conveyor_connector_heartbeat_age_seconds", "orders") < 30

    # Stale heartbeat: still Running in the store, but not up; lag unknown -> no lag series.
    assert value(samples, "conveyor_connector_up", "clicks") == 0
    assert value(samples, "conveyor_connector_state", "clicks", state="Running") == 1
    assert value(samples, "conveyor_connector_messages_sent_total", "clicks") == 7
    assert value(samples, "conveyor_connector_lag", "clicks") is None
    assert 119 <= value(samples, "conveyor_connector_heartbeat_age_seconds", "clicks") < 150

    # Stopped with its final counters; Idle with zeros and no heartbeat.
    assert value(samples, "conveyor_connector_state", "done", state="Stopped") == 1
    assert value(samples, "conveyor_connector_up", "done") == 0
    assert value(samples, "conveyor_connector_messages_sent_total", "done") == 50
    assert value(samples, "conveyor_connector_lag", "done") == 0
    assert value(samples, "conveyor_connector_state", "fresh", state="Idle") == 1
    assert value(samples, "conveyor_connector_messages_sent_total", "fresh") == 0
    assert value(samples, "conveyor_connector_heartbeat_age_seconds", "fresh") is None

    # The schema registry's lookups, by how they were answered, and its bounded caches.
    lookups = {
        r: value(samples, "conveyor_connector_schema_lookups_total", "orders", result=r)
        for r in ("cached", "unknown_cached", "requested")
    }
    assert lookups == {"cached": 9000, "unknown_cached": 800, "requested": 41}
    assert (
        value(samples, "conveyor_connector_schema_cache_evictions_total", "orders", cache="unknown")
        == 3
    )
    assert (
        value(samples, "conveyor_connector_schema_cache_entries", "orders", cache="schemas") == 29
    )
    assert types["conveyor_connector_schema_lookups"] == "counter"
    assert (
        value(samples, "conveyor_connector_schema_lookups_total", "done", result="cached") is None
    )

    # Low cardinality: the connector label only (plus one label of a fixed set: the state
    # gauge's state, the registry's result and cache), one prefix.
    for (name, labels), _ in samples.items():
        assert name.startswith("conveyor_connector_"), name
        keys = {k for k, _ in labels}
        extra = BOUNDED_LABELS.get(name)
        assert keys == ({"connector", extra} if extra else {"connector"}), (name, keys)
    assert types["conveyor_connector_messages_sent"] == "counter"
    assert types["conveyor_connector_lag"] == "gauge"
    assert sum(
        1 for (name, _), _ in samples.items() if name == "conveyor_connector_state"
    ) == 4 * len(STATES)


def test_connector_endpoint_returns_partitions_with_offsets_and_lag(server: str):
    status, ctype, body = get(f"{server}/connectors/orders")
    assert status == 200 and ctype == "application/json"
    detail = json.loads(body)
    assert detail["name"] == "orders"
    assert detail["status"] == "Running"
    assert detail["lag"] == 17
    assert detail["partitions"] == [
        {"topic": "orders", "partition": 0, "committed": 1234, "highwater": 1244, "lag": 10}
        | {"given_up": 0},
        {"topic": "orders", "partition": 1, "committed": 766, "highwater": 773, "lag": 7}
        | {"given_up": 0},
    ]
    assert detail["counters"]["messages_out"] == 2000

    # Without reported high watermarks the per-partition lag is unknown, not invented.
    detail = json.loads(get(f"{server}/connectors/done/")[2])
    assert detail["status"] == "Stopped"
    assert detail["partitions"] == [
        {"topic": "done", "partition": 0, "committed": 50, "highwater": None, "lag": None}
        | {"given_up": 0}
    ]

    assert sorted(json.loads(get(f"{server}/connectors")[2])) == [
        "clicks",
        "done",
        "fresh",
        "orders",
    ]
    status, _, body = get(f"{server}/connectors/nope")
    assert status == 404 and "nope" in json.loads(body)["error"]
    assert get(f"{server}/metrics?format=text")[0] == 200
    assert get(f"{server}/other")[0] == 404
