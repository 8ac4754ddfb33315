"""LocalFile sink: the contract suite on a real directory."""

from __future__ import annotations

import base64
import datetime as dt
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.sinks.contract import SinkContract


class TestLocalFileContract(SinkContract):
    sink_type = "localfile"
    idempotent = False  # an append-only file: a replayed batch is appended again
    keeps_keys = keeps_headers = keeps_timestamps = True
    poison_skip_reason = "JSONL accepts every decoded row; LocalFile has no per-message data errors"
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
