"""Issue 45 point 3 on real tables: the lakehouse sinks check their places again when they open
them (``conveyor.core.trust.paths``), not only when the spec is validated. A catalog may hold a
table (or a namespace) whose files are anywhere, and a directory accepted at validation may be
a link to elsewhere by the time the run opens it: each is refused naming the field, and
nothing is written outside the roots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conveyor.core.errors import ConfigError
from conveyor.core.positions import TargetBinding
from conveyor.sinks import build_sink
from tests.sinks.contract import make_batch

pytest.importorskip("pyiceberg")
pytest.importorskip("deltalake")


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("CONVEYOR_FILE_ROOTS", "CONVEYOR_SECRET_FILES", "CONVEYOR_META_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "outside").mkdir()
    return tmp_path / "home"


def outside_files(home: Path) -> list[Path]:
    return sorted(p for p in (home.parent / "outside").rglob("*") if p.is_file())


def iceberg(**over: Any) -> dict[str, Any]:
    return {"type": "iceberg", "namespace": "lake", "table": "orders", **over}


def catalog() -> Any:
    """The sink's default catalog (SQLite in the home), opened as another writer would."""
    from pyiceberg.catalog import load_catalog

    from conveyor.sinks.iceberg import catalog_properties

    config = build_sink(iceberg()).config
    return load_catalog("conveyor", **catalog_properties(config))  # type: ignore[arg-type]


def test_an_iceberg_table_the_catalog_holds_outside_the_roots_is_refused(home: Path) -> None:
    import pyarrow as pa

    elsewhere = home.parent / "outside" / "orders"
    other = catalog()
    other.create_namespace("lake")
    other.create_table(("lake", "orders"), schema=pa.schema([("id", pa.int64())]),
                       location=f"file://{elsewhere}")  # fmt: skip
    written = outside_files(home)  # the other writer's metadata file
    sink = build_sink(iceberg())
    sink.bind(TargetBinding("orders", 1))  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="sink.table: Iceberg table lake.orders: its location"):
        sink.init_sink()
    with pytest.raises(ConfigError, match="outside the roots"):
        sink.send_batch(make_batch(3))
        sink.commit_held()  # type: ignore[attr-defined]
    assert outside_files(home) == written  # no data file, no new metadata


def test_an_iceberg_namespace_whose_location_is_outside_gets_no_table(home: Path) -> None:
    other = catalog()
    other.create_namespace("lake", {"location": f"file://{home.parent / 'outside'}"})
    sink = build_sink(iceberg())
    sink.bind(TargetBinding("orders", 1))  # type: ignore[attr-defined]
    sink.init_sink()  # no table yet
    with pytest.raises(ConfigError, match="sink.namespace: Iceberg namespace lake: its location"):
        sink.send_batch(make_batch(3))
        sink.commit_held()  # the write happens at the commit (issue 48)
    assert outside_files(home) == []


def test_an_iceberg_warehouse_turned_into_a_link_after_validation_is_refused(home: Path) -> None:
    sink = build_sink(iceberg(warehouse="lake/warehouse"))
    (home / "lake").symlink_to(home.parent / "outside")
    with pytest.raises(ConfigError, match="sink.warehouse: .*through a symbolic link"):
        sink.init_sink()
    assert outside_files(home) == []


def test_a_delta_table_turned_into_a_link_after_validation_is_refused(home: Path) -> None:
    sink = build_sink({"type": "delta", "path": "lake/orders"})
    (home / "lake").symlink_to(home.parent / "outside")
    with pytest.raises(ConfigError, match="sink.path: .*through a symbolic link"):
        sink.init_sink()
    assert outside_files(home) == []


def test_the_review_spec_writes_nothing_outside_even_when_built_by_hand(home: Path) -> None:
    """A config object that skipped validation (model_construct) still cannot reach out: the
    warehouse and catalog are resolved at open, the table's location checked before a write."""
    from conveyor.sinks.iceberg import IcebergSinkConfig

    valid = IcebergSinkConfig.model_validate(iceberg())
    config = valid.model_copy(update={"table": "../../../../escaped"})
    sink = build_sink(config)
    sink.bind(TargetBinding("orders", 1))  # type: ignore[attr-defined]
    with pytest.raises(Exception):  # noqa: B017, PT011 - pyiceberg or the path rule, not a write
        sink.send_batch(make_batch(3))
        sink.commit_held()  # the write happens at the commit (issue 48)
    assert outside_files(home) == []
    assert not (home.parent.parent / "escaped").exists()
