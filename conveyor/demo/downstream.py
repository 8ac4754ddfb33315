"""The demo's downstream assets: orders per minute, run as the demo connectors' watermarks pass.

A user's code location beside Conveyor's (``conveyor dev`` loads both in one workspace):
``orders_per_minute``, partitioned by minute, counts the demo's orders of its minute (by
``created_at``) in the JSONL files the ``demo_orders`` connector writes, and appends one line
per run to ``<out>/orders_per_minute/counts.jsonl``. ``landed_through`` runs each minute once
the connector's watermark on its sink asset has passed the minute's end, and again when late
orders for it land.

Beside it, the same asset over a table, reading exactly its minute's rows: with the PostgreSQL
demo connector (``$CONVEYOR_DEMO_PG_URL``), ``orders_per_minute_pg`` runs one ``SELECT ...
WHERE created_at >= start AND created_at < end``; with the Delta one
(``$CONVEYOR_DEMO_LAKE=1``), ``orders_per_minute_lake`` scans the table with the same bounds
(and the day partitions they fall in). Each is defined when its connector's spec is installed.

The minutes begin at ``$CONVEYOR_DEMO_START`` (Unix seconds; ``conveyor dev`` sets it to the
minute it started in), so a new demo asks for the minutes it produced, not a backlog of empty
ones.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dagster import (
    AssetKey,
    AssetsDefinition,
    Definitions,
    MetadataValue,
    SensorDefinition,
    TimeWindowPartitionsDefinition,
    asset,
    in_process_executor,
)

from conveyor.config.specs import LoadedSpec, connectors_dir, load_file, resolved
from conveyor.core.host.home import conveyor_home
from conveyor.dagster.landed import TAG_LANDED, landed_through

DEMO_CONNECTOR = "demo_orders"
PG_CONNECTOR = "demo_orders_pg"
LAKE_CONNECTOR = "demo_orders_lake"
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


def pg_orders_in(
    url: str, schema: str, table: str, start: datetime, end: datetime
) -> tuple[int, float]:
    """The orders (and their total amount) of the table whose ``created_at`` is in
    ``[start, end)``: exactly the partition's rows, counted by PostgreSQL."""
    import psycopg2
    from psycopg2 import sql

    query = sql.SQL(
        "SELECT count(*), coalesce(sum(amount), 0) FROM {} WHERE created_at >= %s AND created_at < %s"
    ).format(sql.Identifier(schema, table))
    with psycopg2.connect(url) as conn, conn.cursor() as cur:
        # created_at is a timestamp without time zone holding UTC: compare in UTC.
        cur.execute(query, (start.replace(tzinfo=None), end.replace(tzinfo=None)))
        n, amount = cur.fetchone()
    conn.close()
    return int(n), round(float(amount), 2)


def delta_orders_in(path: str, start: datetime, end: datetime) -> tuple[int, float]:
    """The orders (and their total amount) of the Delta table whose ``created_at`` is in
    ``[start, end)``: the day partitions the minute falls in, then the rows of the minute."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        dataset = DeltaTable(path).to_pyarrow_dataset()
    except TableNotFoundError:
        return 0, 0.0
    when = ds.field("created_at")
    days = (ds.field("day") >= start.date()) & (ds.field("day") <= end.date())
    rows = dataset.to_table(columns=["amount"], filter=days & (when >= start) & (when < end))
    total = pc.sum(rows.column("amount")).as_py() or 0.0
    return rows.num_rows, round(float(total), 2)


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


def installed(name: str) -> LoadedSpec | None:
    """A demo connector's spec when ``conveyor dev`` installed it (and it is valid)."""
    path = connectors_dir() / f"{name}.yaml"
    if not path.exists():
        return None
    loaded = load_file(path)
    return loaded if loaded.ok and loaded.sink is not None else None


def table_minutes(
    name: str, loaded: LoadedSpec, count: Callable[[datetime, datetime], tuple[int, float]]
) -> tuple[AssetsDefinition, SensorDefinition]:
    """``orders_per_minute_<name>``: each minute's orders of a demo connector's table, and the
    sensor that runs it as that connector's watermark passes each minute."""
    assert loaded.sink is not None
    key = AssetKey(loaded.sink.asset_key_path())

    @asset(
        name=f"orders_per_minute_{name}",
        partitions_def=MINUTES,
        deps=[key],
        group_name="demo_downstream",
        kinds={"python", loaded.sink.type},
        description=f"The demo's orders of each minute, read from {loaded.name}'s table: "
        "exactly the rows whose created_at is in the minute.",
    )
    def minute_of_table(context) -> None:  # bare: dagster reads the annotation at runtime
        window = context.partition_time_window
        n, amount = count(window.start, window.end)
        context.log.info(f"{context.partition_key}: {n} orders, amount {amount}")
        context.add_output_metadata(
            {"orders": MetadataValue.int(n), "amount": MetadataValue.float(amount)}
        )

    sensor = landed_through(
        key,
        MINUTES,
        target=minute_of_table,
        name=f"demo_orders_per_minute_{name}",
        start=MINUTES.start,
    )
    return minute_of_table, sensor


def table_assets() -> tuple[list[AssetsDefinition], list[SensorDefinition]]:
    """The PostgreSQL and Delta demo assets, for the demo connectors installed."""
    assets: list[AssetsDefinition] = []
    sensors: list[SensorDefinition] = []
    pg = installed(PG_CONNECTOR)
    if pg is not None:
        sink: Any = pg.sink

        def in_pg(start: datetime, end: datetime) -> tuple[int, float]:
            live: Any = resolved(pg).sink  # the URL is a secret reference: read when it runs
            return pg_orders_in(live.url.get_secret_value(), sink.schema_, sink.table, start, end)

        a, s = table_minutes("pg", pg, in_pg)
        assets.append(a)
        sensors.append(s)
    lake = installed(LAKE_CONNECTOR)
    if lake is not None:
        from conveyor.sinks.lakehouse import local_location

        path = local_location(getattr(lake.sink, "path", ""))
        a, s = table_minutes("lake", lake, lambda start, end: delta_orders_in(path, start, end))
        assets.append(a)
        sensors.append(s)
    return assets, sensors


TABLE_ASSETS, TABLE_SENSORS = table_assets()

defs = Definitions(
    assets=[orders_per_minute, *TABLE_ASSETS],
    sensors=[
        landed_through(
            SINK_KEY,
            MINUTES,
            target=orders_per_minute,
            name="demo_orders_per_minute",
            start=MINUTES.start,
        ),
        *TABLE_SENSORS,
    ],
    executor=in_process_executor,
)
