"""LocalFile sink: JSON lines, rotated by size, hour or day, fsynced before acknowledging.

A line is whole or absent: a write that fails midway is cut back, and a partial last line
left by a process killed mid-append (no trailing newline) is cut before the next append
(and at start, in the newest file). A payload that is not valid UTF-8 is a row failure
naming the byte offset (it is never written with replacement characters).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import errno
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field, model_validator

from conveyor.core.asset_keys import key_part
from conveyor.core.errors import PermanentSinkError, TransientSinkError, rule
from conveyor.core.sink import invalid_utf8, utf8_reason
from conveyor.core.trust import paths
from conveyor.core.trust.references import known_now
from conveyor.sinks.base import (
    Record,
    RowFailure,
    SendResult,
    Sink,
    SinkConfig,
    iter_records,
    json_default,
)

log = logging.getLogger("conveyor.sinks.localfile")


class LocalFileSinkConfig(SinkConfig):
    """JSONL files in a directory; one line per message."""

    type: Literal["localfile"] = "localfile"
    path: str = Field(
        description="Directory of the files (created if missing), under a root ($CONVEYOR_HOME, "
        "relative: from there; section Files a spec names)."
    )
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

    def directory(self) -> Path:
        """The real directory the files go to, resolved now (``core.trust.paths``); ConfigError
        naming ``sink.path`` when it is refused."""
        return Path(paths.resolve(self.path, field="sink.path"))

    @model_validator(mode="after")
    def _rules(self) -> LocalFileSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        problem = paths.problem(self.path)
        rule(problem is None, problem or "", field="path")
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
        self._dir = self.config.directory()  # resolved as it is opened, not only when validated
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
        except PermissionError as e:
            raise PermanentSinkError(f"cannot create {self._dir}: permission denied") from e
        except OSError as e:
            raise self._os_error(e) from e
        if not os.access(self._dir, os.W_OK):
            raise PermanentSinkError(f"directory {self._dir} is not writable")
        # A run killed mid-append wrote its last file most recently: cut its partial line
        # now (the target may have rotated since, so the next append would not see it).
        # Only this sink's own names: another prefix ("data-eu" next to "data") is not ours.
        own = re.compile(re.escape(self.config.prefix) + r"(-\d{8}(-\d{2})?|-\d{6})?\.jsonl")
        existing = [
            f
            for f in self._dir.glob(f"{self.config.prefix}*.jsonl")
            if own.fullmatch(f.name) and f.is_file()
        ]
        if existing:
            newest = max(existing, key=lambda f: f.stat().st_mtime)
            try:
                fd = os.open(newest, os.O_RDWR | os.O_NOFOLLOW)
            except OSError as e:
                raise self._os_error(e) from e
            try:
                cut_partial_line(fd, newest)
            except OSError as e:
                raise self._os_error(e) from e
            finally:
                os.close(fd)

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
        failed: list[RowFailure] = []
        lines = []
        for rec in records_or_failures(batch):
            if isinstance(rec, RowFailure):
                failed.append(rec)
            else:
                try:
                    if isinstance(rec.payload, bytes):
                        try:
                            rec.payload.decode("utf-8")
                        except UnicodeDecodeError as e:
                            raise InvalidUTF8(utf8_reason(e, "payload")) from None
                    lines.append(self._line(rec))
                except InvalidUTF8 as e:
                    failed.append(RowFailure(rec.index, str(e)))
                except (TypeError, ValueError) as e:
                    failed.append(RowFailure(rec.index, f"not serialisable as JSON: {e}"))
            if failed and self.fail_fast:
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
        # A link in the directory is not followed: the files are this sink's own.
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            before = cut_partial_line(fd, path)
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
        # ELOOP: a link where the sink's own file should be (never followed): not an outage.
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ELOOP):
            return PermanentSinkError(f"{self._dir}: {e.strerror}")
        return TransientSinkError(f"{self._dir}: {e.strerror}")  # ENOSPC, EIO, ...: may clear up

    def cleanup_sink(self) -> None:
        """Nothing stays open between batches."""


class InvalidUTF8(ValueError):
    """A payload or column value that is not valid UTF-8 (the message says where)."""


def records_or_failures(batch: pa.Table) -> list[Record | RowFailure]:
    """The batch's records; when a text column holds invalid UTF-8 (Arrow does not check
    buffers it did not build, e.g. a Spark cast of bytes to string), each row is converted
    alone and a row that cannot be is a RowFailure naming the column and the byte offset."""
    try:
        return list(iter_records(batch))
    except UnicodeDecodeError:
        pass
    out: list[Record | RowFailure] = []
    for i in range(batch.num_rows):
        row = batch.slice(i, 1)
        try:
            (rec,) = iter_records(row)
        except UnicodeDecodeError as e:
            out.append(RowFailure(i, invalid_utf8(row) or utf8_reason(e, "a text value")))
            continue
        rec.index = i
        out.append(rec)
    return out


def cut_partial_line(fd: int, path: Path) -> int:
    """Cut a last line without its newline (a process killed mid-append left it) back to
    the end of the last whole line; returns the file's size after."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size
    keep = 0
    while end > 0:
        start = max(0, end - 65536)
        chunk = os.pread(fd, end - start, start)
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            keep = start + nl + 1
            break
        end = start
    os.ftruncate(fd, keep)
    os.fsync(fd)
    log.warning(
        "%s ended in a partial line (%d bytes without a newline, left by an interrupted "
        "append): cut before appending",
        path,
        size - keep,
    )
    return keep


def _default(o: Any) -> Any:
    if isinstance(o, bytes):
        return _b(o)
    return json_default(o)
