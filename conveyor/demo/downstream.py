"""The demo's downstream asset: orders per minute, run as the demo connector's watermark passes.

A user's code location beside Conveyor's (``conveyor dev`` loads both in one workspace):
``orders_per_minute``, partitioned by minute, counts the demo's orders of its minute (by
``created_at``) in the JSONL files the ``demo_orders`` connector writes, and appends one line
per run to ``<out>/orders_per_minute/counts.jsonl``. ``landed_through`` runs each minute once
the connector's watermark on its sink asset has passed the minute's end, and again when late
orders for it land.

The minutes begin at ``$CONVEYOR_DEMO_START`` (Unix seconds; ``conveyor dev`` sets it to the
minute it started in), so a new demo asks for the minutes it produced, not a backlog of empty
ones.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dagster import (
    AssetKey,
    Definitions,
    MetadataValue,
    TimeWindowPartitionsDefinition,
    asset,
    in_process_executor,
)

from conveyor.config.specs import connectors_dir, load_file
from conveyor.core.home import conveyor_home
from conveyor.dagster.landed import TAG_LANDED, landed_through

DEMO_CONNECTOR = "demo_orders"
# The demo spec's sink (conveyor/demo/orders_localfile.yaml), when its file cannot be read
# (under $CONVEYOR_HOME).
DEFAULT_SINK_DIR = Path("out/orders")
DEFAULT_SINK_KEY = ["localfile", "orders"]
START_ENV = "CONVEYOR_DEMO_START"
COUNTS_FILE = "counts.jsonl"


def demo_sink() -> tuple[Path, AssetKey]:
    """The demo connector's sink directory and asset key, from its spec file."""
    loaded = load_file(connectors_dir() / f"{DEMO_CONNECTOR}.yaml")
    sink = loaded.sink
    if loaded.error or sink is None or not hasattr(sink, "directory"):
        return conveyor_home() / DEFAULT_SINK_DIR, AssetKey(DEFAULT_SINK_KEY)
    return sink.directory(), AssetKey(sink.asset_key_path())


def demo_start() -> datetime:
    """The first minute: ``$CONVEYOR_DEMO_START``, else the minute this module was loaded in."""
    raw = os.environ.get(START_ENV)
    ts = float(raw) if raw else time.time()
    return datetime.fromtimestamp(int(ts // 60) * 60, timezone.utc)


def counts_path(sink_dir: Path) -> Path:
    """Where the runs' counts go: ``orders_per_minute/counts.jsonl`` beside the sink's folder."""
    return sink_dir.parent / "orders_per_minute" / COUNTS_FILE


def orders_in(sink_dir: Path, start: datetime, end: datetime) -> tuple[int, float]:
    """The orders (and their total amount) whose ``created_at`` is in ``[start, end)``."""
    n, amount = 0, 0.0
    for row in _rows(sink_dir, start.timestamp()):
        created = row.get("created_at")
        if not isinstance(created, str):
            continue
        t = datetime.fromisoformat(created)
        if t.tzinfo is None:
            t = t.replace(tzinfo=timezone.utc)
        if start <= t < end:
            n += 1
            amount += float(row.get("amount") or 0.0)
    return n, round(amount, 2)


def _rows(sink_dir: Path, since: float) -> Iterator[dict[str, Any]]:
    """Every complete JSON line of the sink's files written to since ``since`` (a file the
    sink is appending to may end in a partial line: skipped, it is newer than any minute
    the watermark passed)."""
    for f in sorted(sink_dir.glob("*.jsonl")):
        if f.stat().st_mtime < since:
            continue
        with f.open() as lines:
            for line in lines:
                if not line.endswith("\n"):
                    break
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict):
                    yield row


SINK_DIR, SINK_KEY = demo_sink()
MINUTES = TimeWindowPartitionsDefinition(
    start=demo_start(),
    cron_schedule="* * * * *",
    fmt="%Y-%m-%d-%H:%M",
    timezone="UTC",
)


@asset(
    partitions_def=MINUTES,
    deps=[SINK_KEY],
    group_name="demo_downstream",
    kinds={"python", "file"},
    description="The demo's orders of each minute, counted from the demo_orders connector's "
    "files once its watermark has passed the minute (conveyor.dagster.landed_through).",
)
def orders_per_minute(context) -> None:  # bare: dagster reads the annotation at runtime
    """Count the minute's orders in the sink files; one line per run in counts.jsonl."""
    window = context.partition_time_window
    n, amount = orders_in(SINK_DIR, window.start, window.end)
    out = counts_path(SINK_DIR)
    out.parent.mkdir(parents=True, exist_ok=True)
    line = {
        "minute": context.partition_key,
        "orders": n,
        "amount": amount,
        "run_id": context.run_id,
        "reason": context.run.tags.get(TAG_LANDED, "manual"),
        "at": datetime.now(timezone.utc).isoformat(),
    }
    with out.open("a") as f:
        f.write(json.dumps(line) + "\n")
    context.log.info(f"{context.partition_key}: {n} orders, amount {amount}")
    context.add_output_metadata(
        {
            "orders": MetadataValue.int(n),
            "amount": MetadataValue.float(amount),
            "counts_file": MetadataValue.path(str(out)),
        }
    )


defs = Definitions(
    assets=[orders_per_minute],
    sensors=[
        landed_through(
            SINK_KEY,
            MINUTES,
            target=orders_per_minute,
            name="demo_orders_per_minute",
            minimum_interval_seconds=10,
        )
    ],
    executor=in_process_executor,
)
