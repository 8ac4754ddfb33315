"""LocalFile sink: the contract suite on a real directory."""

from __future__ import annotations

import base64
import datetime as dt
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from conveyor.sinks import build_sink
from tests.hostile import HOSTILE_BYTES, hostile_bytes_batch, with_invalid_utf8
from tests.sinks.contract import SinkContract, make_batch

# The sink writes into directories the tests make under the system's temporary directory.
pytestmark = pytest.mark.usefixtures("temp_root")


class TestLocalFileContract(SinkContract):
    sink_type = "localfile"
    idempotent = False  # an append-only file: a replayed batch is appended again
    keeps_keys = keeps_headers = keeps_timestamps = True
    outage_skip_reason = (
        "a local directory has no server to lose (I/O errors are unit-tested in the loop)"
    )

    def make_target(self) -> Iterator[str]:
        with tempfile.TemporaryDirectory(prefix="conveyor-lf-") as d:
            yield d

    def config(self, target: str) -> dict[str, Any]:
        return {"type": "localfile", "path": target, "fields": "envelope", "rotation": "none"}

    def read_back(self, target: str) -> list[dict[str, Any]]:
        out = []
        for f in sorted(Path(target).glob("*.jsonl")):
            for line in f.read_text().splitlines():
                r = json.loads(line)
                p = r["payload"]
                out.append(
                    {
                        "id": p["id"],
                        "name": p["name"],
                        "key": _unb(r["key"]),
                        "headers": {k: _unb(v) for k, v in r["headers"].items()},
                        "timestamp": dt.datetime.fromisoformat(r["timestamp"]),
                    }
                )
        return out

    def poison_batch(self, target: str) -> tuple[pa.Table, set[int]]:
        # Rows 250 and 400 hold a name that is not valid UTF-8 (a string column Arrow did
        # not check): each is a row failure naming the column and the byte offset.
        return with_invalid_utf8(make_batch(500), "name", {250, 400}), {250, 400}

    bad_fields = [
        ({"rotation": "weekly"}, "rotation"),
        ({"max_bytes": 10}, "max_bytes"),
        ({"fields": "all"}, "fields"),
        ({"path": None}, "path"),
    ]


def _unb(v: str | None) -> bytes | None:
    if v is None:
        return None
    return base64.b64decode(v[7:]) if v.startswith("base64:") else v.encode()


def test_a_failed_append_leaves_no_partial_line_and_the_retry_writes_the_batch_once(
    monkeypatch: Any,
) -> None:
    """Disk full halfway through a batch: the file is cut back, the outage is transient,
    and the retry appends each line exactly once."""
    import errno
    import os

    import pytest

    from conveyor.core.errors import TransientSinkError
    from conveyor.sinks import build_sink
    from tests.sinks.contract import make_batch

    with tempfile.TemporaryDirectory(prefix="conveyor-lf-") as d:
        sink = build_sink({"type": "localfile", "path": d, "fields": "payload", "rotation": "none"})
        sink.init_sink()
        assert sink.send_batch(make_batch(10)).failed == ()
        real_write = os.write
        calls = []

        def half_then_full(fd: int, data: Any) -> int:
            calls.append(len(data))
            if len(calls) == 1:
                return real_write(fd, bytes(data[: len(data) // 2]))  # a partial write
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", half_then_full)
        with pytest.raises(TransientSinkError, match="No space left"):
            sink.send_batch(make_batch(10, start=10))
        monkeypatch.setattr(os, "write", real_write)
        (path,) = Path(d).glob("*.jsonl")
        text = path.read_text()
        assert text.endswith("\n") and len(text.splitlines()) == 10  # no partial line
        assert sink.send_batch(make_batch(10, start=10)).failed == ()
        ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
        assert ids == list(range(20))
        sink.cleanup_sink()


def _lines(path: Path) -> list[dict[str, Any]]:
    text = path.read_bytes()
    assert text.endswith(b"\n")
    return [json.loads(line) for line in text.decode().splitlines()]


@pytest.mark.parametrize("rotation", ["none", "daily", "size"])
def test_a_partial_last_line_left_by_a_killed_process_is_cut_at_start(
    tmp_path: Path, rotation: str
) -> None:
    """A run killed (kill -9) mid-append left half a line; the next sink's start cuts it, so
    no corrupt line remains and the batch (never acknowledged) is appended whole."""
    cfg = {"type": "localfile", "path": str(tmp_path), "rotation": rotation}
    first = build_sink(cfg)
    first.init_sink()
    assert first.send_batch(make_batch(5)).failed == ()
    (path,) = tmp_path.glob("*.jsonl")
    with open(path, "ab") as f:  # what a kill -9 between two write() calls leaves
        f.write(b'{"id":5,"name":"na')
    second = build_sink(cfg)
    second.init_sink()
    assert [r["id"] for r in _lines(path)] == list(range(5))  # cut at start, before any send
    assert second.send_batch(make_batch(5, start=5)).failed == ()
    assert [r["id"] for r in _lines(path)] == list(range(10))


def test_a_partial_line_without_any_newline_and_one_appearing_later_are_cut(
    tmp_path: Path,
) -> None:
    cfg = {"type": "localfile", "path": str(tmp_path), "rotation": "none"}
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"id":0,"na')  # the very first line was cut short
    sink = build_sink(cfg)
    sink.init_sink()
    assert path.read_bytes() == b""
    assert sink.send_batch(make_batch(3)).failed == ()
    with open(path, "ab") as f:  # a partial line appearing while the sink runs
        f.write(b'{"id":3,"name":"x' * 10_000)  # longer than one read-back chunk
    assert sink.send_batch(make_batch(3, start=3)).failed == ()
    assert [r["id"] for r in _lines(path)] == list(range(6))


def test_invalid_utf8_payloads_fail_with_their_own_reason(tmp_path: Path) -> None:
    """The hostile bytes corpus: each invalid payload is a row failure saying invalid UTF-8
    and the byte offset (never written with replacement characters); under fail_fast
    nothing after the first one is written."""
    from conveyor.core.sink import send_isolating

    batch, what = hostile_bytes_batch()
    sink = build_sink({"type": "localfile", "path": str(tmp_path), "rotation": "none"})
    sink.init_sink()
    failed = send_isolating(sink, batch)
    assert [what[f.index] for f in failed] == [label for label, _, _ in HOSTILE_BYTES]
    for f, (_label, _payload, offset) in zip(failed, HOSTILE_BYTES, strict=True):
        assert f.message.startswith("payload is not valid UTF-8: "), f.message
        assert f.message.endswith(f"at byte offset {offset}"), f.message
    path = tmp_path / "data.jsonl"
    assert [r["id"] for r in _lines(path)] == [i for i, w in enumerate(what) if w == "good"]
    assert "\ufffd" not in path.read_text()
    path.unlink()
    failed = send_isolating(sink, batch, fail_fast=True)
    assert [f.index for f in failed] == [what.index(HOSTILE_BYTES[0][0])]
    assert [r["id"] for r in _lines(path)] == list(range(what.index(HOSTILE_BYTES[0][0])))


def test_invalid_utf8_in_a_text_column_names_the_column(tmp_path: Path) -> None:
    batch = with_invalid_utf8(make_batch(6), "name", {3})
    sink = build_sink({"type": "localfile", "path": str(tmp_path), "rotation": "none"})
    sink.init_sink()
    (f,) = sink.send_batch(batch).failed
    assert f.index == 3
    assert f.message == "column 'name' is not valid UTF-8: invalid start byte ff at byte offset 2"
    assert [r["id"] for r in _lines(tmp_path / "data.jsonl")] == [0, 1, 2, 4, 5]


def test_only_the_sinks_own_files_are_cut_at_start(tmp_path: Path) -> None:
    """Another prefix in the same directory ("data-eu" next to "data") is left alone."""
    other = tmp_path / "data-eu-20261125.jsonl"
    other.write_bytes(b'{"id":1}\n{"id":2,"na')
    build_sink({"type": "localfile", "path": str(tmp_path), "rotation": "daily"}).init_sink()
    assert other.read_bytes() == b'{"id":1}\n{"id":2,"na'
