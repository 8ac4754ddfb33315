"""Pulsar sink: the contract suite against a real broker given by CONVEYOR_TEST_PULSAR_URL.

There is no Pulsar broker on the CI machine, so these tests are skipped unless the
variable is set (see docs/FULL_SUITE.md: ``docker compose up -d pulsar`` and
``export CONVEYOR_TEST_PULSAR_URL=pulsar://127.0.0.1:6650``; topics are deleted through
the admin API at CONVEYOR_TEST_PULSAR_ADMIN_URL, default http://127.0.0.1:8080). Config
validation is also covered without a broker in tests/unit/test_pulsar_options.py.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sinks.contract import SinkContract, closed_port, make_batch, unique

PULSAR_URL = os.environ.get("CONVEYOR_TEST_PULSAR_URL", "")
ADMIN_URL = os.environ.get("CONVEYOR_TEST_PULSAR_ADMIN_URL", "http://127.0.0.1:8080")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not PULSAR_URL,
        reason="CONVEYOR_TEST_PULSAR_URL not set: no Pulsar broker on this machine (see docs/FULL_SUITE.md)",
    ),
]

NAMESPACE = "public/default"


class TestPulsarContract(SinkContract):
    """Producer with batching: at-least-once, a replayed batch is published again (documented)."""

    sink_type = "pulsar"
    idempotent = False
    keeps_keys = keeps_headers = keeps_timestamps = True
    # fail_fast sends one message at a time, each acknowledged before the next
    # (tests/unit/test_pulsar_options.py checks it with a fake producer).
    stops_at_first_failure = True

    def make_target(self) -> Iterator[str]:
        name = unique("orders")
        yield f"persistent://{NAMESPACE}/{name}"
        import requests

        # Best effort: the producer is closed by now; force in case a reader lingers.
        requests.delete(
            f"{ADMIN_URL}/admin/v2/persistent/{NAMESPACE}/{name}",
            params={"force": "true"},
            timeout=30,
        )

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "pulsar",
            "service_url": PULSAR_URL or "pulsar://127.0.0.1:6650",
            "topic": target,
            "batching_enabled": True,
            "compression": "LZ4",
            "send_timeout_ms": 10_000,
            "operation_timeout_s": 10,
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        import pulsar

        client = pulsar.Client(PULSAR_URL)
        out = []
        try:
            reader = client.create_reader(target, pulsar.MessageId.earliest)
            while True:
                try:
                    msg = reader.read_next(timeout_millis=3000)
                except pulsar.Timeout:
                    break
                payload = json.loads(msg.data())
                out.append(
                    {
                        "id": payload["id"],
                        "name": payload["name"],
                        "key": msg.partition_key().encode(),
                        "headers": {k: v.encode() for k, v in msg.properties().items()},
                        "timestamp": dt.datetime.fromtimestamp(
                            msg.event_timestamp() / 1000, dt.timezone.utc
                        ),
                    }
                )
            reader.close()
        finally:
            client.close()
        return out

    def poison_batch(self, target: str):
        # Row 250 is larger than the broker's 5 MB message limit: MessageTooBig for that row only.
        return make_batch(500, names={250: "x" * (6 * 1024 * 1024)}), {250}

    def outage_config(self, target: str) -> dict[str, Any]:
        return {
            **self.config(target),
            "service_url": f"pulsar://127.0.0.1:{closed_port()}",
            "operation_timeout_s": 3,
            "connection_timeout_ms": 1000,
        }

    bad_fields = [
        ({"service_url": "http://127.0.0.1:8080"}, "service_url"),
        ({"topic": "{partition}"}, "topic"),
        ({"compression": "GZIP"}, "compression"),
        ({"send_timeout_ms": 0}, "send_timeout_ms"),
        ({"chunking_enabled": True, "batching_enabled": True}, "chunking_enabled"),
    ]


class TestPulsarUnbatchedContract(TestPulsarContract):
    """One message per send (batching off), ZSTD."""

    def config(self, target: str) -> dict[str, Any]:
        return {**super().config(target), "batching_enabled": False, "compression": "ZSTD"}
