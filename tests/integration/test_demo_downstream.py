"""The demo's table assets read exactly their minute's rows: a PostgreSQL table and a Delta table
written by the demo connectors' own sinks (their spec files, as ``conveyor dev`` installs them),
rows on both edges of a minute (the start counts, the end does not), in a minute that spans
midnight (two day partitions of the Delta table); and the demo's code location defines
``orders_per_minute_pg`` / ``_lake`` with their ``landed_through`` sensors when the specs are
installed."""

from __future__ import annotations

import importlib
import sys
from datetime import datetime, timedelta, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg2
import pyarrow as pa
import pytest
import yaml

from conveyor.core.sink import commit_held
from conveyor.sinks import build_sink

pytest.importorskip("deltalake")

MIDNIGHT = datetime(2026, 11, 2, 0, 0, tzinfo=timezone.utc)
# (id, created_at): the minute 23:59 (from 23:59:00.000 to 23:59:59.999), its neighbours.
ROWS = [
    (1, MIDNIGHT - timedelta(minutes=1, microseconds=1)),  # 23:58:59.999999: before
    (2, MIDNIGHT - timedelta(minutes=1)),  # 23:59:00: the first instant, in
    (3, MIDNIGHT - timedelta(seconds=30)),  # in
    (4, MIDNIGHT - timedelta(microseconds=1)),  # the last instant, in
    (5, MIDNIGHT),  # 00:00: the next minute, out
    (6, MIDNIGHT + timedelta(seconds=1)),  # out
]


def batch() -> pa.Table:
    """The rows as the demo's transform hands them to the sink (its select's columns)."""
    n = len(ROWS)
    ts = pa.array([t for _, t in ROWS], pa.timestamp("us", tz="UTC"))
    return pa.table(
        {
            "id": pa.array([i for i, _ in ROWS], pa.int64()),
            "customer": pa.array(["ada"] * n),
            "amount": pa.array([float(i) for i, _ in ROWS]),
            "status": pa.array(["paid"] * n),
            "created_at": ts,
            "day": pa.array([t.date() for _, t in ROWS], pa.date32()),
            "__topic": pa.array(["orders"] * n),
            "__partition": pa.array([0] * n, pa.int32()),
            "__offset": pa.array(range(n), pa.int64()),
            "__timestamp": ts,
            "__key": pa.nulls(n, pa.binary()),
            "__headers": pa.nulls(
                n, pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
            ),
            "__destination": pa.nulls(n, pa.string()),
        }
    )


def demo_spec(name: str) -> dict[str, Any]:
    return yaml.safe_load(resources.files("conveyor.demo").joinpath(name).read_text())


def write(sink_cfg: dict[str, Any], table: pa.Table) -> None:
    sink = build_sink(sink_cfg)
    sink.init_sink()
    try:
        assert sink.send_batch(table).failed == ()
        commit_held(sink)
    finally:
        sink.cleanup_sink()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_CONNECTORS_DIR", str(tmp_path / "connectors"))
    return tmp_path


def test_the_delta_asset_reads_exactly_its_minute_across_day_partitions(home: Path) -> None:
    from conveyor.demo.downstream import delta_orders_in
    from conveyor.sinks.lakehouse import local_location

    sink = demo_spec("orders_delta.yaml")["sink"]
    write(sink, batch())
    path = local_location(sink["path"])
    minute = MIDNIGHT - timedelta(minutes=1)
    assert delta_orders_in(path, minute, MIDNIGHT) == (3, 2.0 + 3.0 + 4.0)
    assert delta_orders_in(path, MIDNIGHT, MIDNIGHT + timedelta(minutes=1)) == (2, 11.0)
    assert delta_orders_in(str(home / "lake" / "none"), minute, MIDNIGHT) == (0, 0.0)


def test_the_postgres_asset_reads_exactly_its_minute(
    home: Path, pg_url: str, pg_schema: str
) -> None:
    from conveyor.demo.downstream import pg_orders_in

    sink = {**demo_spec("orders_postgres.yaml")["sink"], "schema": pg_schema}
    sink.pop("url_env")
    write({**sink, "url": pg_url}, batch())
    minute = MIDNIGHT - timedelta(minutes=1)
    assert pg_orders_in(pg_url, pg_schema, "demo_orders", minute, MIDNIGHT) == (3, 9.0)
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            "SELECT data_type FROM information_schema.columns WHERE table_schema = %s "
            "AND table_name = 'demo_orders' AND column_name = 'created_at'",
            (pg_schema,),
        )
        assert cur.fetchone()[0].startswith("timestamp")


def test_the_demo_location_defines_the_table_assets_of_the_installed_connectors(
    home: Path, pg_url: str
) -> None:
    folder = home / "connectors"
    folder.mkdir()
    secret = home / "secrets" / "demo-pg-url"
    secret.parent.mkdir()
    secret.write_text(pg_url)
    pg = demo_spec("orders_postgres.yaml")
    pg["sink"].pop("url_env")
    pg["sink"]["url"] = f"${{file:{secret}}}"
    (folder / "demo_orders_pg.yaml").write_text(yaml.safe_dump(pg))
    (folder / "demo_orders_lake.yaml").write_text(
        resources.files("conveyor.demo").joinpath("orders_delta.yaml").read_text()
    )
    sys.modules.pop("conveyor.demo.downstream", None)
    try:
        module = importlib.import_module("conveyor.demo.downstream")
        keys = {k.to_user_string() for k in module.defs.resolve_all_asset_keys()}
        sensors = {s.name for s in module.defs.sensors or []}
    finally:
        sys.modules.pop("conveyor.demo.downstream", None)
    assert {"orders_per_minute", "orders_per_minute_pg", "orders_per_minute_lake"} <= keys
    assert {"postgres/public/demo_orders", "delta/demo_orders"} <= keys
    assert {"demo_orders_per_minute_pg", "demo_orders_per_minute_lake"} <= sensors
