"""Iceberg sink: the contract suite on real tables (warehouse on local disk under
$CONVEYOR_HOME; the SQL catalog on SQLite and on the machine's PostgreSQL), and what the
lakehouse sinks promise: partitions in the table metadata, upsert, auto_evolve, the offsets each
snapshot carries, a zombie's commit refused, buffering.

Read back with pyiceberg's ``scan().to_arrow()`` (DuckDB's iceberg extension cannot be
installed offline) and, for the data files, DuckDB's own Parquet reader.
"""

from __future__ import annotations

import datetime as dt
import decimal
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pyarrow as pa
import pytest

from conveyor.core.errors import ConfigError, FencedError, TransientSinkError
from conveyor.core.model import TopicPartition
from conveyor.core.positions import TargetBinding
from conveyor.sinks import build_sink
from tests.conftest import PG_URL
from tests.hostile import with_invalid_utf8
from tests.positions import offsets_of
from tests.sinks.contract import SinkContract, closed_port, make_batch, unique

pytest.importorskip("pyiceberg")

PG_CATALOG = "postgresql+psycopg2://" + PG_URL.split("://", 1)[1]


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    return tmp_path


def load_table(cfg: dict[str, Any]) -> Any:
    """The table as a reader sees it: a fresh catalog, the same properties."""
    from pyiceberg.catalog import load_catalog

    from conveyor.sinks.iceberg import catalog_properties

    config = build_sink(cfg).config
    catalog = load_catalog(config.catalog.name, **catalog_properties(config))  # type: ignore[attr-defined]
    return catalog.load_table((cfg["namespace"], cfg["table"]))


def rows_of(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    from pyiceberg.exceptions import NoSuchTableError

    try:
        return load_table(cfg).scan().to_arrow().to_pylist()
    except NoSuchTableError:
        return []


class IcebergContract(SinkContract):
    sink_type = "iceberg"
    idempotent = True  # rows the table's offsets already cover are not written again
    keeps_keys = keeps_headers = keeps_timestamps = True
    outage_skip_reason = "the SQLite catalog has no server to lose"
    catalog: dict[str, Any] = {}
    cadence: dict[str, Any] = {}  # the default: buffered, committed by commit_held

    def make_target(self) -> Iterator[str]:
        yield unique("orders")

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "iceberg",
            "catalog": self.catalog,
            "namespace": "contract",
            "table": target,
            "message_columns": True,
            **self.cadence,
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        return [
            {
                "id": r["id"],
                "name": r["name"],
                "key": r["__key"],
                "headers": {h["key"]: h["value"] for h in r["__headers"] or []},
                "timestamp": r["__timestamp"],
            }
            for r in rows_of(self.config(target))
        ]

    def poison_batch(self, target: str) -> tuple[pa.Table, set[int]]:
        # Parquet would store any bytes: text that is not UTF-8 is the one row content refused.
        return with_invalid_utf8(make_batch(500), "name", {250, 400}), {250, 400}

    bad_fields = [
        ({"namespace": " "}, "namespace"),
        ({"table": ""}, "table"),
        ({"warehouse": "/etc/lake"}, "warehouse"),
        ({"warehouse": "../lake"}, "warehouse"),
        ({"warehouse": "file:///tmp/elsewhere"}, "warehouse"),
        ({"partition_by": [{"column": "ts", "transform": "week"}]}, "partition_by"),
        ({"catalog": {"type": "rest"}}, "catalog.uri"),
        ({"commit_interval_s": -1}, "commit_interval_s"),
        ({"upsert_keys": ["id", "id"]}, "upsert_keys"),
    ]


class TestIcebergOnSQLite(IcebergContract):
    catalog = {"type": "sql"}  # the default: SQLite in $CONVEYOR_HOME


@pytest.mark.integration
class TestIcebergOnPostgres(IcebergContract):
    catalog = {"type": "sql", "uri": PG_CATALOG, "name": "conveyor_contract"}
    cadence = {"commit_interval_s": 0}  # each batch its own commit
    outage_skip_reason = ""

    def outage_config(self, target: str) -> dict[str, Any]:
        uri = f"postgresql+psycopg2://postgres@127.0.0.1:{closed_port()}/test"
        return {**self.config(target), "catalog": {"type": "sql", "uri": uri}}


ICEBERG_REST_URL = os.environ.get("CONVEYOR_TEST_ICEBERG_REST_URL", "")


@pytest.mark.integration
@pytest.mark.skipif(
    not ICEBERG_REST_URL,
    reason="CONVEYOR_TEST_ICEBERG_REST_URL not set: no Iceberg REST catalog on this machine "
    "(see docs/FULL_SUITE.md)",
)
class TestIcebergOnRestCatalog(IcebergContract):
    """The REST catalog by URL (a real one: docs/FULL_SUITE.md has a container), the warehouse
    the catalog's own."""

    catalog = {"type": "rest", "uri": ICEBERG_REST_URL, "name": "conveyor_rest"}
    outage_skip_reason = ""

    def outage_config(self, target: str) -> dict[str, Any]:
        uri = f"http://127.0.0.1:{closed_port()}"
        return {**self.config(target), "catalog": {"type": "rest", "uri": uri}}


# -- beyond the contract --------------------------------------------------------------------------


def cfg(**over: Any) -> dict[str, Any]:
    """Each batch its own table commit (``commit_interval_s: 0``): the marks' tests; the
    default cadence has tests of its own."""
    return {
        "type": "iceberg",
        "namespace": "lake",
        "table": unique("t"),
        "commit_interval_s": 0,
        **over,
    }


def started(config: dict[str, Any], connector: str = "", generation: int = 0) -> Any:
    sink = build_sink(config)
    sink.bind(TargetBinding(connector, generation))  # type: ignore[attr-defined]
    sink.init_sink()
    return sink


def test_types_partitioned_by_day_in_the_table_metadata(home: Path) -> None:
    """Decimals, timestamptz, structs and lists arrive natively; the table is partitioned by
    day of the timestamp (its spec and each data file's partition say so)."""
    c = cfg(
        partition_by=[
            {"column": "ts", "transform": "day"},
            {"column": "id", "transform": "bucket[4]"},
        ]
    )
    days = [dt.datetime(2026, 3, d, 10, tzinfo=dt.timezone.utc) for d in (1, 1, 2, 3)]
    batch = make_batch(4).append_column("ts", pa.array(days, pa.timestamp("ms", tz="UTC")))
    batch = batch.append_column(
        "price", pa.array([decimal.Decimal("1.25")] * 4, pa.decimal128(12, 2))
    )
    batch = batch.append_column("tags", pa.array([["a", "b"]] * 4))
    batch = batch.append_column("addr", pa.array([{"city": "Oslo", "zip": 150}] * 4))
    sink = started(c)
    assert sink.send_batch(batch).failed == ()
    sink.cleanup_sink()
    table = load_table(c)
    assert str(table.schema().find_field("ts").field_type) == "timestamptz"
    assert str(table.schema().find_field("price").field_type) == "decimal(12, 2)"
    assert [(f.name, str(f.transform)) for f in table.spec().fields] == [
        ("ts_day", "day"),
        ("id_bucket_4", "bucket[4]"),
    ]
    files = list(table.inspect.files().to_pylist())
    assert {f["partition"]["ts_day"] for f in files} == {dt.date(2026, 3, d) for d in (1, 2, 3)}
    rows = sorted(table.scan().to_arrow().to_pylist(), key=lambda r: r["id"])
    assert rows[3]["ts"] == days[3] and rows[3]["price"] == decimal.Decimal("1.25")
    assert rows[0]["tags"] == ["a", "b"] and rows[0]["addr"] == {"city": "Oslo", "zip": 150}
    # an independent Parquet reader sees the same rows in the files the snapshot lists
    import duckdb

    paths = [f["file_path"].removeprefix("file://") for f in files]
    got = duckdb.sql(f"SELECT id FROM read_parquet({paths!r}) ORDER BY id").fetchall()
    assert [r[0] for r in got] == [0, 1, 2, 3]


def test_offsets_round_trip_through_the_snapshot_summary(home: Path) -> None:
    c = cfg()
    sink = started(c, "orders-to-lake", 3)
    assert offsets_of(sink.target_offsets()) is None  # no table yet
    sink.send_batch(make_batch(5, partition=0))
    sink.send_batch(make_batch(7, start=100, partition=1))
    summary = load_table(c).current_snapshot().summary.additional_properties
    assert summary["conveyor.connector"] == "orders-to-lake"
    assert summary["conveyor.generation"] == "3"
    assert summary["conveyor.offsets"] == '{"orders/0":5,"orders/1":107}'
    sink.cleanup_sink()
    fresh = build_sink(c)  # what the run reads before starting the loop: no init_sink yet
    fresh.bind(TargetBinding("orders-to-lake", 4))  # type: ignore[attr-defined]
    assert offsets_of(fresh.target_offsets()) == {  # type: ignore[attr-defined]
        TopicPartition("orders", 0): 5,
        TopicPartition("orders", 1): 107,
    }
    fresh.cleanup_sink()
    again = started(c, "orders-to-lake", 4)
    assert offsets_of(again.target_offsets()) == {
        TopicPartition("orders", 0): 5,
        TopicPartition("orders", 1): 107,
    }
    # another connector's commits neither hide nor move this connector's offsets
    other = started(c, "someone-else", 1)
    other.send_batch(make_batch(2, start=50, partition=0))
    assert offsets_of(other.target_offsets()) == {TopicPartition("orders", 0): 52}
    assert offsets_of(again.target_offsets()) == {
        TopicPartition("orders", 0): 5,
        TopicPartition("orders", 1): 107,
    }
    # a replay from behind the table's offsets writes only the rows it does not hold
    again.send_batch(make_batch(8, partition=0))
    ids = sorted(r["id"] for r in rows_of(c))
    assert ids == [*range(8), 50, 51, *range(100, 107)]
    for s in (again, other):
        s.cleanup_sink()


def test_a_zombie_commit_is_refused(home: Path) -> None:
    c = cfg()
    old = started(c, "orders-to-lake", 1)
    old.send_batch(make_batch(3))
    new = started(c, "orders-to-lake", 2)
    new.send_batch(make_batch(3, start=3))
    with pytest.raises(FencedError, match="generation 2"):
        old.send_batch(make_batch(3, start=6))
    assert sorted(r["id"] for r in rows_of(c)) == list(range(6))
    old.cleanup_sink()  # its buffer held the refused rows: not committed on close either
    new.cleanup_sink()
    assert sorted(r["id"] for r in rows_of(c)) == list(range(6))


def test_upsert_by_key_keeps_the_last_row_per_key(home: Path) -> None:
    c = cfg(upsert_keys=["id"])
    sink = started(c)
    sink.send_batch(make_batch(5))
    # the same ids again at later offsets, one id twice in the batch: the last wins
    again = make_batch(3, start=10, names={10: "first", 12: "last"})
    again = again.set_column(0, "id", pa.array([1, 2, 1], pa.int64()))
    sink.send_batch(again)
    sink.cleanup_sink()
    rows = {r["id"]: r["name"] for r in rows_of(c)}
    assert len(rows_of(c)) == 5
    assert rows == {0: "name 0", 1: "last", 2: "name 11", 3: "name 3", 4: "name 4"}


def test_auto_evolve_adds_a_nullable_column_and_without_it_the_batch_is_refused(home: Path) -> None:
    from conveyor.core.errors import PermanentSinkError

    c = cfg(auto_evolve=True)
    sink = started(c)
    sink.send_batch(make_batch(2))
    wider = make_batch(2, start=2).append_column("color", pa.array(["red", None]))
    assert sink.send_batch(wider).failed == ()
    sink.cleanup_sink()
    rows = sorted(rows_of(c), key=lambda r: r["id"])
    assert [r["color"] for r in rows] == [None, None, "red", None]
    assert not load_table(c).schema().find_field("color").required
    strict = started({**c, "auto_evolve": False})
    with pytest.raises(PermanentSinkError, match="no column size .*auto_evolve"):
        strict.send_batch(make_batch(1, start=4).append_column("size", pa.array([1])))
    strict.cleanup_sink()


def test_by_default_batches_are_buffered_into_one_snapshot_a_minute(home: Path) -> None:
    """The default cadence (commit_interval_s 60): batches are accepted into a buffer, counted
    by ``uncommitted_rows``, and committed together once 60 s passed since the first (in the
    send that finds it due, or by ``commit_held``); a batch sent again while buffered is
    buffered once; closing never commits."""
    from conveyor.core.sink import AcknowledgesAtCommit

    now = [0.0]
    c = {"type": "iceberg", "namespace": "lake", "table": unique("t")}  # the defaults
    sink = started(c, "c", 1)
    sink._clock = lambda: now[0]  # the buffer's clock
    assert isinstance(sink, AcknowledgesAtCommit) and sink.config.commit_interval_s == 60
    for i in range(3):
        assert sink.send_batch(make_batch(10, start=10 * i)).failed == ()
        now[0] += 25
    assert sink.last_commit is None and sink.uncommitted_rows() == 30  # at 0, 25, 50 s
    assert not rows_of(c)
    sink.send_batch(make_batch(10, start=20))  # 75 s: sent again (a retry), then due
    assert sink.uncommitted_rows() == 0 and sink.last_commit is not None
    assert sink.last_commit.rows_added == 30
    sink.send_batch(make_batch(5, start=30))
    assert not sink.commit_due() and sink.uncommitted_rows() == 5
    sink.commit_held()  # what the loop calls on a stop
    sink.send_batch(make_batch(5, start=35))
    sink.cleanup_sink()  # never commits: these 5 were not acknowledged
    table = load_table(c)
    assert len(table.metadata.snapshots) == 2
    assert sorted(r["id"] for r in table.scan().to_arrow().to_pylist()) == list(range(35))
    assert table.properties["write.target-file-size-bytes"] == str(128 << 20)


def test_a_failed_commit_keeps_the_buffer_and_the_batch_sent_again_is_written_once(
    home: Path,
) -> None:
    c = cfg()  # each send commits
    sink = started(c, "c", 1)
    real = sink._write

    def unreachable(*args: Any) -> None:
        raise OSError("warehouse unreachable")

    sink._write = unreachable
    with pytest.raises(TransientSinkError, match="unavailable"):
        sink.send_batch(make_batch(10))
    assert sink.uncommitted_rows() == 10 and not rows_of(c)
    sink._write = real
    sink.send_batch(make_batch(10))  # the loop sends the batch again after the outage
    assert sink.uncommitted_rows() == 0
    assert sorted(r["id"] for r in rows_of(c)) == list(range(10))
    sink.cleanup_sink()


def test_the_warehouse_is_bounded_under_conveyor_home(home: Path) -> None:
    with pytest.raises(ConfigError, match="warehouse.*outside"):
        build_sink(cfg(warehouse=str(home.parent / "elsewhere")))
    link = home / "link"
    os.symlink("/tmp", link)
    with pytest.raises(ConfigError, match="warehouse.*outside"):
        build_sink(cfg(warehouse="link/lake"))
    assert build_sink(cfg(warehouse="s3://bucket/lake")).config.warehouse == "s3://bucket/lake"  # type: ignore[attr-defined]
    sink = started(cfg(warehouse=f"file://{home}/wh"))
    sink.send_batch(make_batch(2))
    sink.cleanup_sink()
    assert list((home / "wh").rglob("*.parquet"))


def test_an_unreachable_catalog_is_an_outage(home: Path) -> None:
    uri = f"postgresql+psycopg2://postgres@127.0.0.1:{closed_port()}/test"
    sink = build_sink(cfg(catalog={"type": "sql", "uri": uri}))
    with pytest.raises(TransientSinkError, match="unavailable"):
        sink.init_sink()
    sink.cleanup_sink()


@pytest.fixture(scope="module", autouse=True)
def _drop_pg_catalog() -> Iterator[None]:
    yield
    try:
        conn = psycopg2.connect(PG_URL)
    except psycopg2.OperationalError:
        return
    conn.autocommit = True
    with conn.cursor() as cur:
        for t in ("iceberg_tables", "iceberg_namespace_properties"):
            cur.execute(
                f"DELETE FROM {t} WHERE catalog_name = 'conveyor_contract'"  # noqa: S608
                if _exists(cur, t)
                else "SELECT 1"
            )
    conn.close()


def _exists(cur: Any, table: str) -> bool:
    cur.execute("SELECT to_regclass(%s) IS NOT NULL", (table,))
    return bool(cur.fetchone()[0])
