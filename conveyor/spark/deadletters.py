"""Dead-letter stores: Parquet through Spark (default) or a Kafka topic ``<connector>.dlq``.

Every record keeps the connector, generation, source coordinates, key, headers,
the original payload bytes, the error class and message, attempts, and first
and last failure time. ``write`` returns only once the records are durable: the
loop commits the batch's offsets after it.

The Parquet store is append-only, which makes it crash-safe without locks:

- ``<dir>/letters/``: every dead letter ever written (a re-failed replay appends
  the letter again with ``attempts`` raised);
- ``<dir>/replayed/``: ``(id, replayed_at)`` of letters a replay delivered.

The *pending* letters are, per id, the newest record with no replay after it.
Counting, listing and replaying are Spark SQL over these two datasets.

The store's location is a URL that Spark resolves (``file:///...``, ``s3a://...``,
``hdfs://...``), never a local path: the Spark server may run on another host or in
another working directory. ``dead_letter_location`` is the one place a configured path
becomes that URL; everything else (writing, listing, counting, replaying) goes through
Spark's file system, so whatever Spark can write, the CLI, the API, the sensors and the
replay job read back.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from conveyor.core.connection import KafkaConnection
from conveyor.core.engine.loop import DeadLetter
from conveyor.core.errors import ConveyorError, PermanentSinkError, TransientSinkError
from conveyor.core.model import ConnectorSpec
from conveyor.core.sink import ErrorKind

log = logging.getLogger("conveyor.spark.deadletters")

HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))

DEAD_LETTER_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("connector", pa.string()),
        ("generation", pa.int64()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("key", pa.binary()),
        ("headers", HEADERS_TYPE),
        ("value", pa.binary()),
        ("timestamp_ms", pa.int64()),
        ("error_class", pa.string()),
        ("error", pa.string()),
        ("attempts", pa.int32()),
        ("first_failure_at", pa.float64()),
        ("last_failure_at", pa.float64()),
    ]
)

REPLAYED_SCHEMA = pa.schema([("id", pa.string()), ("replayed_at", pa.float64())])


def letter_id(topic: str, partition: int, offset: int) -> str:
    return f"{topic}-{partition}-{offset}"


def dead_letter_location(spec: ConnectorSpec) -> str:
    """The Parquet store's absolute URL, resolved here once for every reader and writer.

    A URL of another scheme than ``file`` (``s3a://bucket/dl``) is kept as written. A path or
    ``file://`` URL becomes the ``file://`` URL of its real path under a root
    (``ConnectorSpec.dead_letter_place``, ``core.trust.paths``: a relative one under
    ``$CONVEYOR_HOME``, the same for the run, the CLI and the sensors, whatever their working
    directories; the Spark server's own working directory never matters), resolved again at
    each use. Default: ``$CONVEYOR_HOME/dead_letters/<connector>``. ConfigError naming
    ``failure.dead_letter.path`` when the place is refused.
    """
    place = spec.dead_letter_place()
    if place is None:
        return str(spec.failure.dead_letter.path).rstrip("/")
    return Path(place).as_uri()


def dlq_topic(connector: str) -> str:
    return f"{connector}.dlq"


def letters_to_table(connector: str, generation: int, letters: list[DeadLetter]) -> pa.Table:
    rows = [
        {
            "id": letter_id(d.failed.topic, d.failed.partition, d.failed.offset),
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


@dataclass
class SparkParquetDeadLetters:
    """Dead letters as Parquet datasets written and read through Spark (``location``: a URL,
    see ``dead_letter_location``)."""

    location: str | Path  # a Path (tests, tools) must be absolute: it becomes a file:// URL
    spark: Callable[[], Any]
    connector: str = ""
    generation: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.location, Path):
            self.location = self.location.as_uri()

    @property
    def letters_path(self) -> str:
        return f"{str(self.location).rstrip('/')}/letters"

    @property
    def replayed_path(self) -> str:
        return f"{str(self.location).rstrip('/')}/replayed"

    def write(self, letters: list[DeadLetter]) -> None:
        if letters:
            self.append(letters_to_table(self.connector, self.generation, letters))

    def append(self, table: pa.Table) -> None:
        """Append records (DEAD_LETTER_SCHEMA); durable when Spark's write job returns."""
        from conveyor.spark.session import discard_session, is_session_lost

        spark = self.spark()
        try:
            spark.createDataFrame(table).write.mode("append").parquet(self.letters_path)
        except Exception as e:
            if is_session_lost(e):
                discard_session(spark)  # the server restarted: the retry gets a new session
            raise TransientSinkError(
                f"dead-letter store {self.letters_path}: {str(e).splitlines()[0][:300]}"
            ) from e

    def mark_replayed(self, ids: list[str], at: float | None = None) -> None:
        if not ids:
            return
        at = at or time.time()
        table = pa.table(
            {
                "id": pa.array(ids, pa.string()),
                "replayed_at": pa.array([at] * len(ids), pa.float64()),
            }
        )
        self.spark().createDataFrame(table).write.mode("append").parquet(self.replayed_path)

    def _read(self, path: str, schema: pa.Schema) -> Any:
        """The dataset at ``path`` through Spark's file system; None when it does not exist."""
        spark = self.spark()
        df = spark.read.schema(_ddl(schema)).parquet(path)
        try:
            _ = df.schema  # analysed on the server: a missing path fails here
        except Exception as e:
            if _path_missing(e):
                return None
            raise
        return df

    def pending_df(self) -> Any:
        """A DataFrame of the pending letters (None when nothing was ever dead-lettered)."""
        letters = self._read(self.letters_path, DEAD_LETTER_SCHEMA)
        if letters is None:
            return None
        spark = self.spark()
        letters.createOrReplaceTempView("conveyor_letters")
        replayed = self._read(self.replayed_path, REPLAYED_SCHEMA)
        if replayed is not None:
            replayed.createOrReplaceTempView("conveyor_replayed")
        else:
            spark.sql(
                "SELECT CAST(NULL AS STRING) AS id, CAST(NULL AS DOUBLE) AS replayed_at WHERE false"
            ).createOrReplaceTempView("conveyor_replayed")
        return spark.sql(
            """
            SELECT l.* FROM (
              SELECT *, row_number() OVER (PARTITION BY id ORDER BY last_failure_at DESC, attempts DESC) AS rn
              FROM conveyor_letters) l
            LEFT ANTI JOIN conveyor_replayed r ON l.id = r.id AND r.replayed_at >= l.last_failure_at
            WHERE l.rn = 1
            """
        ).drop("rn")

    def pending(self, limit: int | None = None) -> pa.Table:
        df = self.pending_df()
        if df is None:
            return DEAD_LETTER_SCHEMA.empty_table()
        df = df.orderBy("topic", "partition", "offset")
        if limit is not None:
            df = df.limit(limit)
        return df.toArrow().select(DEAD_LETTER_SCHEMA.names).cast(DEAD_LETTER_SCHEMA)

    def count(self) -> int:
        df = self.pending_df()
        return 0 if df is None else int(df.count())


@dataclass
class KafkaDeadLetters:
    """Dead letters produced to ``<connector>.dlq``: original key, value and headers,
    plus ``conveyor.*`` headers with the source coordinates and the error.

    The topic lives on the source's cluster and is reached with the source's
    connection (TLS, SASL); ``compression`` is the producer's codec."""

    connection: KafkaConnection
    topic: str
    connector: str = ""
    generation: int = 0
    compression: str = "none"
    _producer: Any = None

    def _get_producer(self) -> Any:
        if self._producer is None:
            from kafka import KafkaProducer

            from conveyor.brokers.connection import kafka_python_options, tls_problem
            from conveyor.brokers.kafka import default_bootstrap

            options = {
                "acks": "all",
                "linger_ms": 5,
                "compression_type": None if self.compression == "none" else self.compression,
                "client_id": f"conveyor-{self.connector}-dlq",
                **kafka_python_options(
                    self.connection,
                    "producer",
                    prefix="source",
                    default_bootstrap=default_bootstrap,
                ),
            }
            problem = tls_problem(options)
            if problem:
                raise PermanentSinkError(f"dead-letter topic {self.topic}: {problem}")
            self._producer = KafkaProducer(**options)
        return self._producer

    def write(self, letters: list[DeadLetter]) -> None:
        if not letters:
            return
        from conveyor.brokers.connection import classify_kafka_error, describe_kafka_error

        try:
            p = self._get_producer()
            futures = []
            for d in letters:
                f = d.failed
                headers = list(d.headers) + [
                    ("conveyor.connector", self.connector.encode()),
                    ("conveyor.generation", str(self.generation).encode()),
                    ("conveyor.topic", f.topic.encode()),
                    ("conveyor.partition", str(f.partition).encode()),
                    ("conveyor.offset", str(f.offset).encode()),
                    ("conveyor.error_class", f.error_class.encode()),
                    ("conveyor.error", f.error.encode()[:4000]),
                    ("conveyor.attempts", str(f.attempts).encode()),
                    ("conveyor.first_failure_at", repr(d.first_failure_at).encode()),
                    ("conveyor.last_failure_at", repr(d.last_failure_at).encode()),
                ]
                futures.append(
                    p.send(
                        self.topic,
                        key=d.key,
                        value=d.value,
                        headers=headers,
                        timestamp_ms=d.timestamp_ms,
                    )
                )
            p.flush()
            for fut in futures:
                fut.get(timeout=30)
        except ConveyorError:
            raise
        except Exception as e:  # noqa: BLE001 - classified
            self.close()
            text = f"dead-letter topic {self.topic}: {describe_kafka_error(e)}"
            if classify_kafka_error(e) is ErrorKind.TRANSIENT:
                raise TransientSinkError(text) from e
            raise PermanentSinkError(text) from None

    def close(self) -> None:
        p, self._producer = self._producer, None
        if p is not None:
            from conveyor.brokers.connection import close_producer

            close_producer(p, timeout=5)


def dead_letter_writer(
    spec: ConnectorSpec, generation: int, *, spark: Callable[[], Any], connection: KafkaConnection
) -> Any:
    """The dead-letter store the connector's config asks for (``connection``: the source's)."""
    if spec.failure.dead_letter.store == "kafka":
        return KafkaDeadLetters(
            connection,
            dlq_topic(spec.name),
            connector=spec.name,
            generation=generation,
            compression=spec.failure.dead_letter.compression,
        )
    return SparkParquetDeadLetters(
        dead_letter_location(spec), spark, connector=spec.name, generation=generation
    )


def letters_as_source_batch(table: pa.Table) -> pa.Table:
    """Pending letters in the source layout, to run them through the transform and sink again."""
    from conveyor.brokers.kafka import SOURCE_SCHEMA

    ts = [None if v is None else v for v in table.column("timestamp_ms").to_pylist()]
    return pa.table(
        {
            "__topic": table.column("topic").cast(pa.string()),
            "__partition": table.column("partition").cast(pa.int32()),
            "__offset": table.column("offset").cast(pa.int64()),
            "__timestamp": pa.array(ts, pa.int64()).cast(pa.timestamp("ms", tz="UTC")),
            "__timestamp_type": pa.nulls(table.num_rows, pa.string()),
            "__key": table.column("key").cast(pa.binary()),
            "__headers": table.column("headers").cast(HEADERS_TYPE),
            "__destination": pa.nulls(table.num_rows, pa.string()),
            "__value": table.column("value").cast(pa.binary()),
        },
        schema=SOURCE_SCHEMA,
    )


def sample_rows(table: pa.Table, n: int = 5) -> list[dict[str, Any]]:
    """A small, printable sample (payloads shortened, bytes decoded) for the UI and CLI."""
    out = []
    for r in table.slice(0, n).to_pylist():
        value = r.get("value") or b""
        out.append(
            {
                "where": f"{r['topic']}[{r['partition']}]@{r['offset']}",
                "error_class": r["error_class"],
                "error": (r["error"] or "")[:200],
                "attempts": r["attempts"],
                "payload": value[:120].decode(errors="replace"),
            }
        )
    return out


def _path_missing(e: Exception) -> bool:
    text = str(e)
    return "PATH_NOT_FOUND" in text or "Path does not exist" in text


def _ddl(schema: pa.Schema) -> str:
    mapping = {
        pa.string(): "STRING",
        pa.int64(): "BIGINT",
        pa.int32(): "INT",
        pa.binary(): "BINARY",
        pa.float64(): "DOUBLE",
    }
    parts = []
    for f in schema:
        if f.type == HEADERS_TYPE:
            parts.append(f"`{f.name}` ARRAY<STRUCT<key: STRING, value: BINARY>>")
        else:
            parts.append(f"`{f.name}` {mapping[f.type]}")
    return ", ".join(parts)


def to_json(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, indent=2, default=str)
