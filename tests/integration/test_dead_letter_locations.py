"""Parquet dead letters on whatever file system Spark writes: URLs kept, relative paths
resolved once under $CONVEYOR_HOME, listing/counting/replay marks through Spark.

The Spark Connect server of the session runs in a working directory of its own (see
tests/conftest.py), different from this process's, which is moved elsewhere again here.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from conveyor.core.engine.failure import FailedMessage
from conveyor.core.engine.loop import DeadLetter
from conveyor.core.model import ConnectorSpec
from conveyor.spark.deadletters import SparkParquetDeadLetters, dead_letter_location
from conveyor.spark.session import spark_session


def letters(n: int) -> list[DeadLetter]:
    now = time.time()
    return [
        DeadLetter(
            FailedMessage("orders", 0, i, "sink rejected it", "data", 2),
            None,
            f'{{"id": {i}}}'.encode(),
            [],
            1_700_000_000_000 + i,
            now,
            now,
        )
        for i in range(n)
    ]


def spec(path: str | None) -> ConnectorSpec:
    failure: dict = {"policy": "dead_letter"}
    if path is not None:
        failure["dead_letter"] = {"path": path}
    return ConnectorSpec.model_validate(
        {
            "name": "orders_dl",
            "source": {"topics": ["orders"]},
            "sink": {"type": "localfile", "path": "x"},
            "failure": failure,
        }
    )


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """CONVEYOR_HOME under tmp_path; this process's working directory somewhere else;
    tmp_path/srv a root of spec paths besides the home (CONVEYOR_FILE_ROOTS)."""
    home = tmp_path / "home"
    home.mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (tmp_path / "srv").mkdir()
    monkeypatch.setenv("CONVEYOR_HOME", str(home))
    monkeypatch.setenv("CONVEYOR_FILE_ROOTS", str(tmp_path / "srv"))
    monkeypatch.chdir(cwd)
    return home


def test_locations_are_resolved_once_to_absolute_urls(elsewhere, tmp_path):
    assert dead_letter_location(spec(None)) == (elsewhere / "dead_letters" / "orders_dl").as_uri()
    assert dead_letter_location(spec("dl/orders")) == (elsewhere / "dl" / "orders").as_uri()
    srv = tmp_path / "srv" / "dl"
    assert dead_letter_location(spec(str(srv))) == srv.as_uri()
    assert dead_letter_location(spec("s3a://bucket/dl/")) == "s3a://bucket/dl"
    assert dead_letter_location(spec(srv.as_uri())) == srv.as_uri()
    for outside in ("/srv/dl", "file:///srv/dl", str(tmp_path / "cwd" / "dl")):  # no root's
        with pytest.raises(ValidationError, match="outside the roots"):
            spec(outside)


@pytest.mark.parametrize("kind", ["relative", "url"])
def test_write_count_list_and_mark_through_spark(elsewhere, tmp_path, spark_remote, kind):
    path = "dl/orders" if kind == "relative" else (tmp_path / "srv" / "by_url").as_uri()
    location = dead_letter_location(spec(path))
    store = SparkParquetDeadLetters(
        location, lambda: spark_session(spark_remote), connector="orders_dl"
    )
    assert store.count() == 0  # nothing written yet: no error, no local check
    store.write(letters(5))
    on_disk = (elsewhere / "dl" / "orders") if kind == "relative" else (tmp_path / "srv" / "by_url")
    assert any((on_disk / "letters").rglob("*.parquet"))  # where the URL says, not Spark's cwd
    assert not (tmp_path / "cwd" / "dl").exists()
    assert store.count() == 5
    assert [r["offset"] for r in store.pending().to_pylist()] == [0, 1, 2, 3, 4]
    store.mark_replayed(["orders-0-1", "orders-0-3"], at=time.time() + 1)
    assert store.count() == 3
    # Another reader (the CLI, the replay job) with the same spec sees the same store.
    again = SparkParquetDeadLetters(
        dead_letter_location(spec(path)), lambda: spark_session(spark_remote)
    )
    assert [r["offset"] for r in again.pending().to_pylist()] == [0, 2, 4]
