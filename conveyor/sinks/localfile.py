"""LocalFile sink: JSON lines, rotated by size, hour or day, fsynced before acknowledging."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import errno
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field, model_validator

from conveyor.core.asset_keys import key_part
from conveyor.core.errors import PermanentSinkError, TransientSinkError, rule
from conveyor.core.references import known_now
from conveyor.sinks.base import SendResult, Sink, SinkConfig, iter_records, json_default


class LocalFileSinkConfig(SinkConfig):
    """JSONL files in a directory; one line per message."""

    type: Literal["localfile"] = "localfile"
    path: str = Field(description="Directory of the files (created if missing).")
    prefix: str = Field(
        default="data", description="File name prefix: <prefix>-YYYYMMDD[-HH][-NNNN].jsonl."
    )
    rotation: Literal["none", "size", "hourly", "daily"] = Field(
        default="daily", description="When a new file starts."
    )
    max_bytes: int = Field(
        default=128 << 20, ge=1024, description="Size rotation threshold in bytes."
    )
    fields: Literal["payload", "envelope"] = Field(
        default="payload",
        description="payload: the payload as one JSON value per line; envelope: topic, partition, offset, timestamp, key, headers and payload.",
    )
    fsync: bool = Field(
        default=True,
        description="fsync each batch before acknowledging it (durability on power loss).",
    )

    def asset_key_path(self) -> list[str]:
        name = key_part(Path(self.path).name or "root").strip("_") or "root"
        return ["localfile", name]

    def kind(self) -> str:
        return "file"

    @model_validator(mode="after")
    def _rules(self) -> LocalFileSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        rule(bool(self.path.strip()), "must not be empty", field="path")
        rule(
            not known_now(self.prefix) or bool(re.fullmatch(r"[A-Za-z0-9._-]+", self.prefix)),
            "letters, digits, '.', '_' and '-' only",
            field="prefix",
        )
        return self


def _b(v: bytes | None) -> str | None:
    if v is None:
        return None
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(v).decode()


class LocalFileSink(Sink):
    """Appends JSON lines; a batch is written, flushed and fsynced before send_batch returns."""

    config_class = LocalFileSinkConfig
    config: LocalFileSinkConfig

    def __init__(
        self, config: LocalFileSinkConfig, *, clock: Callable[[], dt.datetime] | None = None
    ):
        super().__init__(config)
        self._clock = clock or (lambda: dt.datetime.now(dt.timezone.utc))
        self._file: Any = None
        self._file_path: Path | None = None
        self._dir = Path(config.path)

    def init_sink(self) -> None:
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
        except PermissionError as e:
            raise PermanentSinkError(f"cannot create {self._dir}: permission denied") from e
        except OSError as e:
            raise self._os_error(e) from e
        if not os.access(self._dir, os.W_OK):
            raise PermanentSinkError(f"directory {self._dir} is not writable")

    def _target(self, incoming: int) -> Path:
        now = self._clock()
        stamp = {"daily": now.strftime("%Y%m%d"), "hourly": now.strftime("%Y%m%d-%H")}.get(
            self.config.rotation, ""
        )
        base = f"{self.config.prefix}-{stamp}" if stamp else self.config.prefix
        if self.config.rotation != "size":
            return self._dir / f"{base}.jsonl"
        # Size rotation: the newest numbered file while it has room, else the next number.
        existing = sorted(self._dir.glob(f"{self.config.prefix}-*.jsonl"))
        n = len(existing)
        if existing:
            last = existing[-1]
            if last.stat().st_size + incoming <= self.config.max_bytes or last.stat().st_size == 0:
                return last
        return self._dir / f"{self.config.prefix}-{n:06d}.jsonl"

    def _line(self, rec: Any) -> str:
        if self.config.fields == "envelope":
            obj = {
                "topic": rec.topic,
                "partition": rec.partition,
                "offset": rec.offset,
                "timestamp": rec.timestamp.isoformat() if rec.timestamp else None,
                "key": _b(rec.key),
                "headers": {k: _b(v) for k, v in rec.headers},
                "payload": rec.payload_json(),
            }
        else:
            obj = rec.payload_json()
        return json.dumps(obj, default=_default, ensure_ascii=False, separators=(",", ":"))

    def send_batch(self, batch: pa.Table) -> SendResult:
        from conveyor.sinks.base import RowFailure

        failed: list[RowFailure] = []
        lines = []
        for rec in iter_records(batch):
            try:
                lines.append(self._line(rec))
            except (TypeError, ValueError) as e:
                failed.append(RowFailure(rec.index, f"not serialisable as JSON: {e}"))
                if self.fail_fast:
                    break  # nothing after the first failed row is written
        data = ("\n".join(lines) + "\n").encode() if lines else b""
        if data:
            try:
                self._append(self._target(len(data)), data)
            except OSError as e:
                raise self._os_error(e) from e
        return SendResult(rows=batch.num_rows, failed=tuple(failed))

    def _append(self, path: Path, data: bytes) -> None:
        """Append whole lines or nothing: a write that fails midway (disk full, I/O error)
        is cut back to the file's previous size, so no partial line stays and the retry of
        the batch does not append it twice."""
        new = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            before = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if self.config.fsync:
                    os.fsync(fd)
            except BaseException:
                with contextlib.suppress(OSError):  # the write's own error is what counts
                    os.ftruncate(fd, before)
                raise
        finally:
            os.close(fd)
        if new and self.config.fsync:
            fd = os.open(self._dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _os_error(self, e: OSError) -> Exception:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return PermanentSinkError(f"{self._dir}: {e.strerror}")
        return TransientSinkError(f"{self._dir}: {e.strerror}")  # ENOSPC, EIO, ...: may clear up

    def cleanup_sink(self) -> None:
        """Nothing stays open between batches."""


def _default(o: Any) -> Any:
    if isinstance(o, bytes):
        return _b(o)
    return json_default(o)
