"""Delta Lake sink: the contract suite on real tables on local disk under $CONVEYOR_HOME,
and what the lakehouse sinks promise: partitions in the table metadata, merge by key,
auto_evolve, the offsets each commit carries, a zombie's commit refused, a lost commit race
as an outage.

Read back with deltalake's ``to_pyarrow_table()`` (DuckDB's delta extension cannot be installed
offline) and, for the data files, DuckDB's own Parquet reader.
"""

from __future__ import annotations

import datetime as dt
import decimal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from conveyor.core.errors import ConfigError, FencedError, PermanentSinkError, TransientSinkError
from conveyor.core.model import TopicPartition
from conveyor.core.positions import TargetBinding
from conveyor.sinks import build_sink
from tests.hostile import with_invalid_utf8
from tests.positions import offsets_of
from tests.sinks.contract import SinkContract, make_batch, unique

pytest.importorskip("deltalake")


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    return tmp_path


def table_of(path: str) -> Any:
    from deltalake import DeltaTable

    from conveyor.sinks.lakehouse import local_location

    return DeltaTable(local_location(path))


def rows_of(path: str) -> list[dict[str, Any]]:
    from deltalake.exceptions import TableNotFoundError

    try:
        return table_of(path).to_pyarrow_table().to_pylist()
    except TableNotFoundError:
        return []


class TestDeltaContract(SinkContract):
    sink_type = "delta"
    idempotent = True  # rows the table's offsets already cover are not written again
    keeps_keys = keeps_headers = keeps_timestamps = True
    outage_skip_reason = "a table on local disk has no server to lose"

    def make_target(self) -> Iterator[str]:
        yield f"delta/{unique('orders')}"

    cadence: dict[str, Any] = {}  # the default: buffered, committed by commit_held

    def config(self, target: str) -> dict[str, Any]:
        return {"type": "delta", "path": target, "message_columns": True, **self.cadence}

    def read_back(self, target: str) -> list[dict[str, Any]]:
        return [
            {
                "id": r["id"],
                "name": r["name"],
                "key": r["__key"],
                "headers": {h["key"]: h["value"] for h in r["__headers"] or []},
                "timestamp": r["__timestamp"],
            }
            for r in rows_of(target)
        ]

    def poison_batch(self, target: str) -> tuple[pa.Table, set[int]]:
        # Parquet would store any bytes: text that is not UTF-8 is the one row content refused.
        return with_invalid_utf8(make_batch(500), "name", {250, 400}), {250, 400}

    bad_fields = [
        ({"path": "/etc/delta"}, "path"),
        ({"path": "file:///var/tmp/x"}, "path"),
        ({"path": "a/../../b"}, "path"),
        ({"path": ""}, "path"),
        ({"mode": "merge"}, "upsert_keys"),
        ({"upsert_keys": ["id"]}, "upsert_keys"),
        ({"mode": "overwrite"}, "mode"),
        ({"partition_by": ["day", "day"]}, "partition_by"),
        ({"target_file_size_mb": 0}, "target_file_size_mb"),
    ]


class TestDeltaContractEachBatchCommitted(TestDeltaContract):
    cadence = {"commit_interval_s": 0}


# -- beyond the contract --------------------------------------------------------------------------


def cfg(**over: Any) -> dict[str, Any]:
    """Each batch its own table commit (``commit_interval_s: 0``): the marks' tests; the
    default cadence has tests of its own."""
    return {"type": "delta", "path": f"lake/{unique('t')}", "commit_interval_s": 0, **over}


def started(config: dict[str, Any], connector: str = "", generation: int = 0) -> Any:
    sink = build_sink(config)
    sink.bind(TargetBinding(connector, generation))  # type: ignore[attr-defined]
    sink.init_sink()
    return sink


def test_types_partitioned_by_day_in_the_table_metadata(home: Path) -> None:
    c = cfg(partition_by=["day"])
    days = [dt.datetime(2026, 3, d, 10, tzinfo=dt.timezone.utc) for d in (1, 1, 2, 3)]
    batch = make_batch(4).append_column("ts", pa.array(days, pa.timestamp("ms", tz="UTC")))
    batch = batch.append_column("day", pa.array([d.date() for d in days], pa.date32()))
    batch = batch.append_column(
        "price", pa.array([decimal.Decimal("1.25")] * 4, pa.decimal128(12, 2))
    )
    batch = batch.append_column("tags", pa.array([["a", "b"]] * 4))
    batch = batch.append_column("addr", pa.array([{"city": "Oslo", "zip": 150}] * 4))
    sink = started(c)
    assert sink.send_batch(batch).failed == ()
    sink.cleanup_sink()
    table = table_of(c["path"])
    assert table.metadata().partition_columns == ["day"]
    actions = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    assert {a["partition.day"] for a in actions} == {dt.date(2026, 3, d) for d in (1, 2, 3)}
    fields = {f.name: str(f.type) for f in table.schema().fields}
    assert "timestamp" in fields["ts"] and "decimal(12,2)" in fields["price"]
    rows = sorted(rows_of(c["path"]), key=lambda r: r["id"])
    assert rows[3]["ts"] == days[3] and rows[3]["price"] == decimal.Decimal("1.25")
    assert rows[0]["tags"] == ["a", "b"] and rows[0]["addr"] == {"city": "Oslo", "zip": 150}
    import duckdb

    got = duckdb.sql(f"SELECT id FROM read_parquet({table.file_uris()!r}) ORDER BY id").fetchall()
    assert [r[0] for r in got] == [0, 1, 2, 3]


def test_offsets_round_trip_through_the_commit_info(home: Path) -> None:
    c = cfg()
    sink = started(c, "orders-to-lake", 3)
    assert offsets_of(sink.target_offsets()) is None
    sink.send_batch(make_batch(5, partition=0))
    sink.send_batch(make_batch(7, start=100, partition=1))
    (info,) = table_of(c["path"]).history(limit=1)
    assert info["conveyor.connector"] == "orders-to-lake"
    assert info["conveyor.generation"] == "3"
    assert info["conveyor.offsets"] == '{"orders/0":5,"orders/1":107}'
    assert sink.last_commit.snapshot == "1" and sink.last_commit.rows_added == 7
    sink.cleanup_sink()
    expected = {TopicPartition("orders", 0): 5, TopicPartition("orders", 1): 107}
    fresh = build_sink(c)  # what the run reads before starting the loop: no init_sink yet
    fresh.bind(TargetBinding("orders-to-lake", 4))  # type: ignore[attr-defined]
    assert offsets_of(fresh.target_offsets()) == expected  # type: ignore[attr-defined]
    fresh.cleanup_sink()
    again = started(c, "orders-to-lake", 4)
    assert offsets_of(again.target_offsets()) == expected
    other = started(c, "someone-else", 1)
    other.send_batch(make_batch(2, start=50, partition=0))
    assert offsets_of(other.target_offsets()) == {TopicPartition("orders", 0): 52}
    assert offsets_of(again.target_offsets()) == expected
    again.send_batch(make_batch(8, partition=0))  # a replay from behind the table's offsets
    assert sorted(r["id"] for r in rows_of(c["path"])) == [*range(8), 50, 51, *range(100, 107)]
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
    old.cleanup_sink()
    new.cleanup_sink()
    assert sorted(r["id"] for r in rows_of(c["path"])) == list(range(6))


def test_a_commit_that_loses_a_race_is_an_outage_and_the_retry_writes_once(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer commits between this sink's read of the marks and its commit: the
    commit fails (tried once) as an outage; the retry reads again and commits."""
    from deltalake import write_deltalake

    import conveyor.sinks.delta as delta

    c = cfg()
    sink = started(c, "orders-to-lake", 1)
    sink.send_batch(make_batch(3))
    real = delta.DeltaSink._latest_mark

    def then_someone_commits(self: Any) -> Any:
        mark = real(self)
        write_deltalake(
            self._location, make_batch(1, start=900).select(["id", "name", "amount"]), mode="append"
        )
        return mark

    monkeypatch.setattr(delta.DeltaSink, "_latest_mark", then_someone_commits)
    with pytest.raises(TransientSinkError, match="changed under the commit|unavailable"):
        sink.send_batch(make_batch(3, start=3))
    monkeypatch.setattr(delta.DeltaSink, "_latest_mark", real)
    sink.commit_held()  # the loop's retry: the buffer is kept
    sink.cleanup_sink()
    assert sorted(r["id"] for r in rows_of(c["path"])) == [0, 1, 2, 3, 4, 5, 900]


def test_merge_by_key_keeps_the_last_row_per_key(home: Path) -> None:
    c = cfg(mode="merge", upsert_keys=["id"])
    sink = started(c)
    sink.send_batch(make_batch(5))
    again = make_batch(3, start=10, names={10: "first", 12: "last"})
    again = again.set_column(0, "id", pa.array([1, 2, 1], pa.int64()))
    sink.send_batch(again)
    sink.send_batch(make_batch(1, start=20).set_column(0, "id", pa.array([7], pa.int64())))
    assert sink.last_commit.rows_added == 1
    sink.cleanup_sink()
    rows = {r["id"]: r["name"] for r in rows_of(c["path"])}
    assert len(rows_of(c["path"])) == 6
    assert rows == {0: "name 0", 1: "last", 2: "name 11", 3: "name 3", 4: "name 4", 7: "name 20"}


def test_auto_evolve_adds_a_nullable_column_and_without_it_the_batch_is_refused(
    home: Path,
) -> None:
    c = cfg(auto_evolve=True)
    sink = started(c)
    sink.send_batch(make_batch(2))
    wider = make_batch(2, start=2).append_column("color", pa.array(["red", None]))
    assert sink.send_batch(wider).failed == ()
    sink.cleanup_sink()
    rows = sorted(rows_of(c["path"]), key=lambda r: r["id"])
    assert [r["color"] for r in rows] == [None, None, "red", None]
    strict = started({**c, "auto_evolve": False})
    with pytest.raises(PermanentSinkError, match="no column size .*auto_evolve"):
        strict.send_batch(make_batch(1, start=4).append_column("size", pa.array([1])))
    strict.cleanup_sink()
    merging = started({**c, "mode": "merge", "upsert_keys": ["id"]})
    later = make_batch(1, start=10).set_column(0, "id", pa.array([1], pa.int64()))
    merging.send_batch(later.append_column("size", pa.array([9])))
    merging.cleanup_sink()
    rows = sorted(rows_of(c["path"]), key=lambda r: r["id"])
    assert [r["size"] for r in rows] == [None, 9, None, None]


def test_the_path_is_bounded_under_conveyor_home(home: Path) -> None:
    with pytest.raises(ConfigError, match="path.*outside"):
        build_sink(cfg(path=str(home.parent / "elsewhere")))
    assert build_sink(cfg(path="s3://bucket/t")).config.asset_key_path() == ["delta", "t"]
    sink = started(cfg(path=f"file://{home}/tables/t1"))
    sink.send_batch(make_batch(2))
    sink.cleanup_sink()
    assert (home / "tables" / "t1" / "_delta_log").is_dir()


def test_storage_credentials_take_a_reference_in_a_spec(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Object store credentials are one secret field: a reference is accepted, a literal one is
    masked when shown, a reference elsewhere is refused; the run merges them over the options."""
    from conveyor.config.specs import from_mapping

    spec = {
        "name": "to_delta",
        "source": {"topics": ["orders"]},
        "sink": {
            "type": "delta",
            "path": "s3://bucket/orders",
            "storage_options": {"AWS_REGION": "eu-north-1"},
            "storage_credentials": "${env:LAKE_KEY}",
        },
    }
    loaded = from_mapping(spec, source="to_delta.yaml", fallback_name="to_delta")
    assert loaded.error is None, loaded.error
    assert loaded.display()["sink"]["storage_credentials"] == "${env:LAKE_KEY}"
    literal = {
        **spec,
        "sink": {**spec["sink"], "storage_credentials": "AWS_SECRET_ACCESS_KEY=abc123"},
    }
    shown = from_mapping(literal, source="to_delta.yaml", fallback_name="to_delta").display()
    assert "abc123" not in str(shown)
    elsewhere = {**spec, "sink": {**spec["sink"], "storage_options": {"AWS_REGION": "${env:R}"}}}
    refused = from_mapping(elsewhere, source="to_delta.yaml", fallback_name="to_delta")
    assert refused.error and "sink.storage_options.AWS_REGION" in refused.error
    with pytest.raises(ConfigError, match="storage_credentials: line 2 is not KEY=VALUE"):
        build_sink({**spec["sink"], "storage_credentials": "A=1\nnot a pair"})
    sink = build_sink({**spec["sink"], "storage_credentials": '{"AWS_ACCESS_KEY_ID": "id1"}'})
    assert sink._options() == {"AWS_REGION": "eu-north-1", "AWS_ACCESS_KEY_ID": "id1"}  # type: ignore[attr-defined]


def test_the_loop_commits_offsets_only_with_the_tables_commit(home: Path) -> None:
    """The default cadence under the real loop: batches are held (no offsets in the meta store)
    until the table's commit a minute after the first; then all at once; the stop commits the
    rest. The table and the committed offsets agree at every step."""
    from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, run_loop
    from conveyor.core.model import BatchPolicy, FailureSpec
    from tests.unit.test_loop import Events, FakeCommitter, FakeSource, json_transform, source_batch

    now = [1000.0]
    c = {"type": "delta", "path": f"lake/{unique('t')}", "message_columns": True}  # defaults
    sink = started(c, "c", 1)  # bound as the run binds it
    sink._clock = lambda: now[0]  # the buffer's clock
    events = Events()
    source = FakeSource([source_batch(10 * i, 10) for i in range(5)], events)
    committer = FakeCommitter(events)
    seen: list[tuple[int, dict]] = []

    def stop() -> bool:
        seen.append((len(rows_of(c["path"])), dict(committer.offsets)))
        now[0] += 25  # a batch every 25 s
        return not source.batches

    loop = ConnectorLoop(
        LoopConfig(
            name="c", batch=BatchPolicy(max_wait_ms=10), failure=FailureSpec(), prefetch=False
        ),
        source=source,
        transform=json_transform,
        sink=sink,
        committer=committer,
        committed={},
        stop_requested=stop,
        clock=lambda: now[0],
    )
    run_loop(loop)
    tp = TopicPartition("t", 0)
    # Batches at 0, 25, 50 s held; the one at 75 s makes the commit (due since 60 s): 40 rows.
    assert [(n, o.get(tp)) for n, o in seen] == [(0, None)] * 4 + [(40, 40)] * 2
    assert committer.offsets == {tp: 50} and len(rows_of(c["path"])) == 50  # the stop's commit
    assert sink.uncommitted_rows() == 0
