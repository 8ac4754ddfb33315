"""End to end through Dagster into LocalFile: every message lands once, terminate stops cleanly."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from conveyor.core.model import ConnectorStatus, TopicPartition
from tests.e2e.conftest import SETTLE_S, STOP_S, DagsterHarness, produce, wait_for

pytestmark = pytest.mark.e2e


def lines(directory: Path) -> list[dict]:
    out = []
    for f in sorted(directory.glob("*.jsonl")):
        out.extend(json.loads(line) for line in f.read_text().splitlines() if line)
    return out


def test_localfile_connector_through_dagster(dagster: DagsterHarness, tansu, topic_name, tmp_path):
    n = 5_000
    produce(tansu, topic_name, n)
    name = f"lf_{uuid.uuid4().hex[:8]}"
    out = dagster.home / f"{name}_out"  # spec paths lie under $CONVEYOR_HOME
    dagster.write_spec(
        {
            "name": name,
            "source": {"topics": [topic_name]},
            "batch": {"max_records": 1000, "max_wait_ms": 200},
            "transform": {
                "decode": "json",
                "schema": "id BIGINT, name STRING, amount DOUBLE",
                "filter": "id % 2 = 0",
            },
            "sink": {"type": "localfile", "path": str(out), "fields": "envelope"},
        }
    )
    dagster.reload()
    run_id = dagster.launch(name)
    wait_for(lambda: len(lines(out)) >= n // 2, 120, "half the messages (even ids) in files")
    store = dagster.store
    wait_for(
        lambda: sum(store.committed_offsets(name).values()) == n,
        SETTLE_S,
        "offsets of every message committed (filtered ones too)",
    )
    got = lines(out)
    assert sorted(r["payload"]["id"] for r in got) == list(range(0, n, 2))
    assert {r["topic"] for r in got} == {topic_name}
    assert store.committed_offsets(name) == {
        TopicPartition(topic_name, 0): n // 2,
        TopicPartition(topic_name, 1): n // 2,
    }
    row = wait_for(
        lambda: (r := store.get(name)).counters.get("filtered") == n // 2 and r,
        SETTLE_S,
        "counters",
    )
    assert row.status == ConnectorStatus.RUNNING and row.counters["messages_out"] == n // 2

    dagster.terminate(run_id)
    assert dagster.wait_status(run_id, {"CANCELED", "FAILURE", "SUCCESS"}, STOP_S) == "CANCELED"
    assert store.get(name).status == ConnectorStatus.STOPPED
    # The run recorded an asset event for the sink with its counters.
    inst = dagster.instance()
    from dagster import AssetKey

    ev = inst.get_latest_materialization_event(AssetKey(["localfile", out.name]))
    assert ev is not None, dagster.run_log(run_id)
    assert ev.asset_materialization.metadata["messages_out"].value == n // 2, dagster.run_log(
        run_id
    )
