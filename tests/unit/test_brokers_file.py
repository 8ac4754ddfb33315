"""The brokers file: one pydantic model, errors that name the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.core.errors import ConfigError
from conveyor.dagster.resources.conveyor import load_brokers


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "brokers.yaml"
    p.write_text(text)
    return p


def test_brokers_load_with_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_SPARK_REMOTE", "sc://spark.test:15002")
    path = write(
        tmp_path,
        "brokers:\n  - id: a\n  - id: b\n    capacity: 2\n    spark_remote: sc://b:1\n"
        "    run_tags: {queue: b}\n",
    )
    a, b = load_brokers(path)
    assert (a.id, a.capacity, a.spark_remote, a.run_tags, a.draining) == (
        "a",
        8,
        "sc://spark.test:15002",
        {},
        False,
    )
    assert (b.capacity, b.spark_remote, b.run_tags) == (2, "sc://b:1", {"queue": "b"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("brokers:\n  - id: a\n    capacity: 0\n", "brokers.0.capacity: Input should be greater"),
        ("brokers:\n  - id: a\n    capcity: 2\n", "brokers.0.capcity: Extra inputs"),
        ("brokers:\n  - capacity: 2\n", "brokers.0.id: Field required"),
        ("brokers: []\n", "brokers: List should have at least 1 item"),
        ("brokers:\n  - id: a\n  - id: a\n", "broker id 'a' appears twice"),
        ("brokers:\n  - id: a\n    spark_remote: http://x\n", "brokers.0.spark_remote"),
        ("- id: a\n", "Input should be a valid dictionary"),
    ],
)
def test_a_bad_brokers_file_names_the_file_and_the_field(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_brokers(path)
    assert str(e.value).startswith(f"{path}: ")
    assert expected in str(e.value)
