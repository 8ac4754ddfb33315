"""Scrape /metrics from a real `conveyor metrics serve` process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conveyor.brokers.embedded import free_port, port_open
from conveyor.core.model import TopicPartition
from conveyor.store.meta import MetaStore


def test_metrics_reflect_the_meta_store(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    store = MetaStore(url)
    store.sync_spec("orders", spec_json=json.dumps({"heartbeat_timeout_s": 30}), spec_hash="h", source="f", error=None)
    g = store.claim("orders", run_id="r1", expected_generation=None, holder_alive=lambda r: False).generation
    store.commit("orders", g, {TopicPartition("orders", 0): 1234, TopicPartition("orders", 1): 766})
    store.heartbeat("orders", g, {"messages_out": 2000, "failed": 3, "dead_lettered": 2, "discarded": 1, "retries": 5, "lag": 17, "msgs_per_s": 99.5})
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "--meta-url", url, "metrics", "serve", "--port", str(port)])
    try:
        deadline = time.monotonic() + 30
        while not port_open("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.1)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'conveyor_connector_messages_sent_total{connector="orders"} 2000.0' in text
        assert 'conveyor_connector_messages_failed_total{connector="orders"} 3.0' in text
        assert 'conveyor_connector_messages_dead_lettered_total{connector="orders"} 2.0' in text
        assert 'conveyor_connector_lag{connector="orders"} 17.0' in text
        assert 'conveyor_connector_up{connector="orders"} 1.0' in text
        assert 'conveyor_connector_state{connector="orders",state="Running"} 1.0' in text
        detail = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/connectors/orders", timeout=5).read())
        assert detail["partitions"] == [
            {"topic": "orders", "partition": 0, "committed": 1234},
            {"topic": "orders", "partition": 1, "committed": 766},
        ]
        assert detail["lag"] == 17
    finally:
        proc.terminate()
        proc.wait(10)
