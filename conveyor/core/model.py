"""The domain model: connector specs, states, brokers, offsets, batches.

Specs are pydantic models (validated, frozen, every field described); runtime
values are frozen dataclasses. Nothing here performs I/O but resolving the paths a spec
names (``core.trust.paths``: symbolic links are followed, no file is opened).
"""

from __future__ import annotations

import datetime as dt
import enum
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from conveyor.core.connection import KafkaConnection
from conveyor.core.engine.routing import DestinationRulesSpec
from conveyor.core.errors import FieldRuleError
from conveyor.core.schema_registry import SchemaRegistrySpec
from conveyor.core.spark_sql.sql_guard import GuardedSql, SqlGuardError, guard_transform
from conveyor.core.trust import paths

# Matched whole (``fullmatch``): with ``match`` and ``$`` a trailing newline would pass.
NAME_PATTERN = r"[a-z][a-z0-9_]{0,62}"
_NAME_RE = re.compile(NAME_PATTERN)

# Columns every batch carries next to the payload columns. They survive the
# Spark transform so that sinks can write keys, headers and timestamps and so
# that failures can be traced to topic/partition/offset.
TOPIC_COL = "__topic"
PARTITION_COL = "__partition"
OFFSET_COL = "__offset"
TIMESTAMP_COL = "__timestamp"
# How the log stamped __timestamp: 'create' (the producer's clock) or 'log_append' (the broker's).
TIMESTAMP_TYPE_COL = "__timestamp_type"
KEY_COL = "__key"
HEADERS_COL = "__headers"
DESTINATION_COL = "__destination"
# True for a message without a payload (a tombstone: null value, or an empty one), on rows
# that transform.null_values 'pass' lets through; sinks with delete_enabled delete by key.
TOMBSTONE_COL = "__tombstone"
# Set by a transform's select: true makes the row a truncate of the target table (the postgres
# sink with truncate_enabled); a message column, so never written as a payload column.
TRUNCATE_COL = "__truncate"
VALUE_COL = "__value"  # the raw payload bytes; only in source batches, before decoding
META_COLUMNS = (
    TOPIC_COL,
    PARTITION_COL,
    OFFSET_COL,
    TIMESTAMP_COL,
    TIMESTAMP_TYPE_COL,
    KEY_COL,
    HEADERS_COL,
    DESTINATION_COL,
    TOMBSTONE_COL,
    TRUNCATE_COL,
)

# A batch as read, before the transform: the message columns and the raw payload. The Kafka
# source reads into it, and a source connector's polled messages take it too, so that one
# transform serves sink and source connectors.
MESSAGE_SCHEMA = pa.schema(
    [
        (TOPIC_COL, pa.string()),
        (PARTITION_COL, pa.int32()),
        (OFFSET_COL, pa.int64()),
        (TIMESTAMP_COL, pa.timestamp("ms", tz="UTC")),
        (TIMESTAMP_TYPE_COL, pa.string()),
        (KEY_COL, pa.binary()),
        (HEADERS_COL, pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        (DESTINATION_COL, pa.string()),
        (VALUE_COL, pa.binary()),
    ]
)


class ConnectorStatus(str, enum.Enum):
    IDLE = "Idle"
    RUNNING = "Running"
    STOPPED = "Stopped"
    ERROR = "Error"
    DEGRADED = "Degraded"
    PAUSED = "Paused"  # its run holds the assignment and heartbeats, and reads nothing


class DesiredState(str, enum.Enum):
    RUNNING = "running"
    STOPPED = "stopped"
    PAUSED = "paused"

    @property
    def wants_run(self) -> bool:
        """Whether the connector should hold a run (a paused one keeps its run, idle)."""
        return self != DesiredState.STOPPED


@dataclass(frozen=True)
class HeartbeatReply:
    """The meta store's answer to a run's heartbeat: what the connector should do now.

    ``spec_hash`` is the hash of the spec the store holds; a run whose own spec hash
    differs takes the new spec on at its next batch boundary.
    """

    desired: DesiredState
    spec_hash: str | None = None


class Decode(str, enum.Enum):
    JSON = "json"
    RAW = "raw"
    TEXT = "text"
    AVRO = "avro"
    PROTOBUF = "protobuf"
    JSON_SCHEMA = "json_schema"


# Formats decoded in the run process into typed Arrow columns before Spark (conveyor.formats):
# Confluent's wire format, the writer schema looked up in a schema registry by the record's id.
SCHEMA_FORMATS = frozenset([Decode.AVRO, Decode.PROTOBUF, Decode.JSON_SCHEMA])


class FailurePolicyName(str, enum.Enum):
    FAIL = "fail"
    DISCARD = "discard"
    DISCARD_AFTER_RETRY = "discard_after_retry"
    DEAD_LETTER = "dead_letter"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class NullValues(str, enum.Enum):
    SKIP = "skip"
    PASS = "pass"
    FAIL = "fail"


def parse_start_timestamp(value: str) -> dt.datetime:
    """An ISO 8601 date-time (naive = UTC) as an aware datetime; ValueError otherwise."""
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    ts = dt.datetime.fromisoformat(text)
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=dt.timezone.utc)


class SourceSpec(KafkaConnection, _Spec):
    """Where a connector reads from: topics and the connection to their cluster."""

    topics: list[str] = Field(
        default_factory=list,
        description="Topics to read; every partition of each is read. Give topics, topics_regex, or both.",
    )
    topics_regex: str | None = Field(
        default=None,
        description="Also read every topic whose whole name matches this regular expression (Python syntax), "
        "including topics created while the connector runs. Names starting with '__' (internal topics) "
        "never match.",
    )
    start_from: str = Field(
        default="earliest",
        description="Where to start on a partition without a committed offset: earliest, latest, or an "
        "ISO 8601 time (e.g. 2026-11-01T00:00:00Z; naive = UTC): the first record stamped at or after it.",
    )
    out_of_range: Literal["earliest", "latest", "fail"] = Field(
        default="earliest",
        description="A stored offset outside the log (Kafka Connect's auto.offset.reset for it): below the log "
        "start (retention or delete_records removed records never read) or above its end (the log was reset). "
        "earliest: resume at the log start, reading every record still there; latest: at the log end; fail: the "
        "connector goes to Error until the offsets are moved. Each case is logged, recorded in the history and "
        "last error, and its skipped records counted per partition (given_up).",
    )
    isolation_level: Literal["read_committed", "read_uncommitted"] = Field(
        default="read_committed",
        description="read_committed: records of aborted transactions are skipped and those of open "
        "transactions wait for their commit. read_uncommitted: everything in the log.",
    )
    client: Literal["confluent", "kafka-python"] = Field(
        default="confluent",
        description="The Kafka client that reads: confluent (librdkafka: fetching, checksums and "
        "decompression in C threads, outside Python) or kafka-python (pure Python). client_options are "
        "under the chosen client's names (librdkafka's dotted properties for confluent).",
    )
    discovery_interval_s: float = Field(
        default=30.0,
        ge=1,
        le=3_600,
        description="How often the running connector looks for new partitions of its topics and new topics "
        "matching topics_regex; what it finds is read from the earliest offset.",
    )

    @field_validator("topics")
    @classmethod
    def _topics_valid(cls, v: list[str]) -> list[str]:
        for t in v:
            if not t or not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", t):
                raise ValueError(f"invalid topic name {t!r}")
        if len(set(v)) != len(v):
            raise ValueError("topics must be unique")
        return v

    @field_validator("topics_regex")
    @classmethod
    def _regex_valid(cls, v: str | None) -> str | None:
        if v is not None:
            if not v.strip():
                raise ValueError("must not be empty")
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a regular expression: {e}") from None
        return v

    @field_validator("start_from")
    @classmethod
    def _start_valid(cls, v: str) -> str:
        if v in ("earliest", "latest"):
            return v
        try:
            parse_start_timestamp(v)
        except ValueError:
            raise ValueError(
                f"{v!r} is not earliest, latest or an ISO 8601 time such as 2026-11-01T00:00:00Z"
            ) from None
        return v

    @model_validator(mode="after")
    def _some_topic(self) -> SourceSpec:
        if not self.topics and self.topics_regex is None:
            raise ValueError("give topics, topics_regex, or both")
        return self

    def matches(self, topic: str) -> bool:
        """Whether the connector reads ``topic`` (listed, or matching topics_regex)."""
        if topic in self.topics:
            return True
        if self.topics_regex is None or topic.startswith("__"):
            return False
        return re.fullmatch(self.topics_regex, topic) is not None

    def describe_topics(self) -> str:
        parts = list(self.topics)
        if self.topics_regex is not None:
            parts.append(f"/{self.topics_regex}/")
        return ", ".join(parts)


BATCH_PRESETS: dict[str, dict[str, int]] = {
    "low_latency": {"max_records": 1_000, "max_bytes": 1 << 20, "max_wait_ms": 100},
    # The default (measured: docs/BENCHMARKS.md, "Batch size and wait" and run T): large
    # batches while there is a backlog (one Spark round trip per batch; from 20,000 rows a
    # batch crosses to Spark as one row, spark/transform.py), a short wait when idle.
    "balanced": {"max_records": 40_000, "max_bytes": 16 << 20, "max_wait_ms": 100},
    "throughput": {"max_records": 100_000, "max_bytes": 64 << 20, "max_wait_ms": 2_000},
}


class BatchPolicy(_Spec):
    """When a batch closes: on size (records or bytes) or on age, whichever comes first."""

    max_records: int = Field(
        default=40_000, ge=1, le=1_000_000, description="Close the batch at this many records."
    )
    max_bytes: int = Field(
        default=16 << 20,
        ge=1024,
        le=1 << 30,
        description="Close the batch at this many payload bytes.",
    )
    max_wait_ms: int = Field(
        default=100,
        ge=1,
        le=60_000,
        description="Close the batch this long after its first record, once the source has caught up. "
        "While the partitions hold enough to fill it (a backlog), the batch keeps filling up to max_records or "
        "max_bytes, for at most 1 s (or max_wait_ms if longer) after its first record.",
    )

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = {"preset": data}
        if isinstance(data, dict) and "preset" in data:
            data = dict(data)
            name = data.pop("preset")
            if name not in BATCH_PRESETS:
                raise ValueError(f"unknown batch preset {name!r}; one of {sorted(BATCH_PRESETS)}")
            data = {**BATCH_PRESETS[name], **data}
        return data


class TransformSpec(_Spec):
    """How a batch is decoded and shaped in Spark (all expressions are Spark SQL)."""

    decode: Decode = Field(
        default=Decode.JSON,
        description="Payload decoding: json, raw (bytes), text (UTF-8), or a format with a schema: "
        "avro, protobuf or json_schema, in Confluent's wire format (a magic byte and the writer "
        "schema's id in front of each record; the schema from schema_registry). These decode in the "
        "run process into typed columns (decimals, dates and timestamps exact; records as structs) "
        "before Spark; a record with an unknown schema id, a corrupt frame or content its schema "
        "does not allow is a failed message (failure.policy).",
    )
    schema_registry: SchemaRegistrySpec | None = Field(
        default=None,
        description="With decode avro, protobuf or json_schema: the schema registry the writer "
        "schemas are read from (by the id in each record, cached). Unreachable: an outage (retried, "
        "Degraded).",
    )
    reader_schema: str | None = Field(
        default=None,
        description="decode avro: the one shape records of every writer version decode into: an "
        "Avro schema (JSON text), or 'latest' (the subject's newest version, looked up again when a "
        "record carries a newer id, so a field added mid-stream becomes a column at that batch). "
        "Default: the newest writer schema seen so far (the greatest id), so the shape only grows as "
        "newer writers appear and older records read with it (a field they lack gets its default). "
        "A record the reader schema cannot read (an incompatible change) is a failed message naming "
        "why.",
    )
    subject: str | None = Field(
        default=None,
        description="The registry subject reader_schema: latest reads (default: '<topic>-value', "
        "the topic name strategy).",
    )
    schema_file: str | None = Field(
        default=None,
        description="decode avro without a registry: an Avro schema file (.avsc) under a root "
        "($CONVEYOR_HOME, relative: from there; section Files a spec names); each payload is plain "
        "Avro binary, without the 5-byte frame.",
    )
    envelope: Literal["none", "debezium"] = Field(
        default="none",
        description="debezium: each decoded record is a Debezium change event ({before, after, op, "
        "source}; in JSON with or without Kafka Connect's {schema, payload} wrapper, or Avro): op c, r "
        "and u become the row `after` (an upsert with upsert_keys), d becomes a delete of the row "
        "`before` names (__tombstone true: sinks with delete_enabled delete by its key columns), t a "
        "truncate (__truncate true). With decode json, schema is the row's Spark DDL (the fields of "
        "after), not the envelope's; values in Debezium's encodings (a Decimal's bytes, a date's days, "
        "µs ...) are read back by the {schema, payload} wrapper's schema as their plain text (12.500, "
        "2024-01-31, 2024-01-31T12:00:00.5), so a field is declared as its own type or STRING. The "
        "filter and select see the row's columns and __op.",
    )
    null_values: NullValues = Field(
        default=NullValues.SKIP,
        description="Messages without a payload (a null value: a tombstone, as compacted topics and "
        "Debezium deletes write; or an empty one): skip (dropped and counted as filtered), pass (sent on "
        "with null payload columns and __tombstone true; sinks with delete_enabled delete by key), or "
        "fail (a failed message, handled by failure.policy).",
    )
    json_schema: str | None = Field(
        default=None,
        alias="schema",
        description="Spark DDL of the JSON payload, e.g. 'id BIGINT, name STRING'. With it the fields become "
        "columns; without it the payload stays one validated JSON string column 'value'.",
    )
    on_type_mismatch: Literal["fail", "null"] = Field(
        default="fail",
        description="With a schema: a JSON payload that is not an object, or has a field of the wrong type "
        "(a string where the schema says BIGINT): fail (a failed message, handled by failure.policy) or "
        "null (Spark's permissive decoding: the field becomes NULL, the message goes on).",
    )
    filter: str | None = Field(
        default=None,
        description="Spark SQL boolean expression; rows where it is not true are skipped (and committed). "
        "Like select, it reads only the batch (see select).",
    )
    select: list[str] | None = Field(
        default=None,
        description="Spark SQL expressions for the output columns (default: all payload columns). They may use "
        "the message columns __topic, __partition, __offset, __timestamp, __timestamp_type, __key, __headers "
        "and (with null_values: pass) __tombstone; "
        "an expression named __destination routes the row (sinks with use_destination or ${destination}); "
        "one named __truncate (boolean) makes the row a truncate of the target table (the postgres sink "
        "with truncate_enabled). "
        "Each is parsed and Spark runs the parse's canonical text: only Spark's built-in functions on "
        "Conveyor's allowlist may be called (not reflect, java_method, the XML, Avro and Protobuf functions, "
        "aggregates or window functions); no subquery, IDENTIFIER(...), hint, parameter or qualified "
        "function name. A column named like a keyword (select, from, order...) is written in backticks; "
        "\"...\" is a string, as '...' (docs/OPERATIONS.md, 'Spark SQL in a spec').",
    )
    rename: dict[str, str] = Field(
        default_factory=dict, description="Output column renames, old -> new."
    )
    pipeline_depth: int = Field(
        default=4,
        ge=1,
        le=8,
        description="Sink connectors: how many batches may be in Spark at once, transformed ahead while the "
        "loop sends the one before (sends and commits stay in source order). 1: one Spark round trip at a "
        "time. Each batch ahead is held in the run process's memory (the fourth: 10-18 MB more peak RSS at "
        "40,000 records of four fields, docs/BENCHMARKS.md run AU). Source connectors transform one batch "
        "at a time.",
    )

    @model_validator(mode="after")
    def _expressions_safe(self) -> TransformSpec:
        """Expressions that could reach beyond the batch on the Spark host are refused
        (``core.spark_sql.sql_guard``), each naming its field: transform.select[2]."""
        self.guarded_sql()
        return self

    def guarded_sql(self) -> GuardedSql:
        """The filter, select and schema as Spark is given them (``core.spark_sql.sql_guard``: the
        parse's canonical text, never the text as written); FieldRuleError naming the
        field the rule refuses."""
        try:
            return guard_transform(self.filter, self.select, self.json_schema)
        except SqlGuardError as e:
            raise FieldRuleError(str(e), field=e.field) from None

    @model_validator(mode="after")
    def _schema_file_confined(self) -> TransformSpec:
        """The schema file lies under a root, outside the secrets (``core.trust.paths``)."""
        problem = None if self.schema_file is None else paths.problem(self.schema_file)
        if problem:
            raise FieldRuleError(problem, field="schema_file")
        return self

    @model_validator(mode="after")
    def _schema_settings_fit_decode(self) -> TransformSpec:
        """The settings of a format with a schema go with that format, and it has its schema."""
        fmt = self.decode
        if fmt in SCHEMA_FORMATS:
            if self.json_schema is not None:
                raise FieldRuleError(
                    f"schema (Spark DDL) is for decode: json; decode: {fmt.value} takes its "
                    "schema from the writer's (schema_registry)",
                    field="schema",
                )
            if self.schema_registry is None and not (fmt == Decode.AVRO and self.schema_file):
                hint = " (or schema_file for Avro without a registry)" if fmt == Decode.AVRO else ""
                raise FieldRuleError(
                    f"decode: {fmt.value} needs schema_registry{hint}", field="schema_registry"
                )
        else:
            for name in ("schema_registry", "reader_schema", "subject", "schema_file"):
                if getattr(self, name) is not None:
                    raise FieldRuleError(
                        f"{name} is for decode avro, protobuf or json_schema, not {fmt.value}",
                        field=name,
                    )
        if self.schema_file is not None:
            if fmt != Decode.AVRO:
                raise FieldRuleError("schema_file is for decode: avro", field="schema_file")
            if self.schema_registry is not None:
                raise FieldRuleError(
                    "schema_file (plain Avro) and schema_registry (Confluent's framed records) "
                    "exclude each other",
                    field="schema_file",
                )
        if self.envelope == "debezium" and fmt in (Decode.RAW, Decode.TEXT):
            raise FieldRuleError(
                f"envelope: debezium needs a decoded record (decode json with schema, avro, "
                f"protobuf or json_schema), not decode: {fmt.value}",
                field="envelope",
            )
        if self.envelope == "debezium" and fmt == Decode.JSON and not self.json_schema:
            raise FieldRuleError(
                "envelope: debezium with decode: json needs schema (the Spark DDL of the row: "
                "the fields of after)",
                field="schema",
            )
        if self.reader_schema is not None and fmt != Decode.AVRO:
            raise FieldRuleError(
                f"reader_schema is for decode: avro, not {fmt.value}", field="reader_schema"
            )
        return self


class RetrySpec(_Spec):
    """Retries of outages, in Dagster's RetryPolicy vocabulary."""

    max_retries: int = Field(
        default=10,
        ge=0,
        le=1_000,
        description="Attempts per batch before the outage budget counts as spent.",
    )
    delay: float = Field(default=1.0, ge=0, le=3_600, description="Seconds before the first retry.")
    backoff: Literal["exponential", "linear", "constant"] = Field(
        default="exponential", description="How the delay grows."
    )
    jitter: Literal["full", "plus_minus", "none"] = Field(
        default="plus_minus", description="Randomisation of the delay."
    )
    max_delay: float = Field(
        default=60.0, ge=0, le=3_600, description="Upper bound of one delay, seconds."
    )
    max_outage: float = Field(
        default=600.0,
        ge=1,
        le=7 * 86_400,
        description="Seconds an outage may last before the run gives up.",
    )


class LivenessSpec(_Spec):
    """How a run judges its own stages (read, transform, send, commit); see core/engine/liveness.py."""

    stage_deadline_s: float = Field(
        default=30.0,
        gt=0,
        le=86_400,
        description="A stage under way longer than this (a read: plus batch.max_wait_ms) is "
        "reported Degraded with the stage named; the run keeps heartbeating.",
    )
    restart_after_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="A stage under way longer than this makes the run restart itself (the run "
        "fails, the scheduler relaunches it under max_restarts).",
    )

    @model_validator(mode="after")
    def _restart_after_deadline(self) -> LivenessSpec:
        if self.restart_after_s <= self.stage_deadline_s:
            raise ValueError("restart_after_s must be greater than stage_deadline_s")
        return self


class DeadLetterSpec(_Spec):
    """Where dead letters go and when the connector stops dead-lettering."""

    store: Literal["parquet", "kafka"] = Field(
        default="parquet",
        description="Parquet files (through Spark) or a Kafka topic '<connector>.dlq'.",
    )
    path: str | None = Field(
        default=None,
        description="Where Spark writes the Parquet dead letters: a URL Spark resolves (s3a://, "
        "hdfs://) or a path or file:// URL under a root ($CONVEYOR_HOME, relative: from there; "
        "section Files a spec names), not another connector's; default "
        "$CONVEYOR_HOME/dead_letters/<connector>. Listing, counting and replay read it through Spark.",
    )
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        default="none", description="With store: kafka, the producer's compression codec."
    )
    max_ratio: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Error when more than this share of one batch is dead-lettered.",
    )
    max_consecutive: int = Field(
        default=1_000, ge=1, description="Error after this many dead letters in a row."
    )
    auto_replay: bool = Field(
        default=False,
        description="Replay automatically once the connector has been healthy for replay_after_s.",
    )
    replay_after_s: float = Field(
        default=300.0, ge=0, description="Healthy time before an automatic replay."
    )


class FailureSpec(_Spec):
    """What happens to a message the sink rejects or that cannot be decoded."""

    policy: FailurePolicyName = Field(
        default=FailurePolicyName.FAIL,
        description="fail (the rows before the failed message are delivered and committed, nothing after it is "
        "written; the connector goes to Error naming the message and is not restarted automatically), discard, "
        "discard_after_retry or dead_letter.",
    )
    retries: int = Field(
        default=3,
        ge=0,
        le=100,
        description="Re-sends of a failed message before discard/dead-letter.",
    )
    dead_letter: DeadLetterSpec = Field(
        default_factory=DeadLetterSpec, description="Dead-letter store settings."
    )


class TasksSpec(_Spec):
    """How many task runs share the connector's partitions, and when the scheduler splits and merges them.

    A task is one Dagster run reading an explicit set of partitions. With ``max: 1`` (the default)
    the connector is one run reading every partition, as without this section. Split and merge
    are decided by the planner in ``conveyor/core/planning/tasks.py`` from the rate and lag each task
    reports per partition in its heartbeats.
    """

    min: int = Field(default=1, ge=1, le=256, description="Fewest task runs.")
    max: int = Field(
        default=1, ge=1, le=256, description="Most task runs (1: one run reads every partition)."
    )
    cooldown_s: float = Field(
        default=60.0,
        ge=0,
        le=86_400,
        description="Seconds after a split or merge before the next one (a dead task is handled at once).",
    )
    lag_samples: int = Field(
        default=5,
        ge=2,
        le=1_000,
        description="A task whose lag grew in this many consecutive heartbeat samples is split.",
    )
    sample_interval_s: float = Field(
        default=5.0, gt=0, le=3_600, description="Seconds between two load samples of a task."
    )
    ceiling_msgs_per_s: float | None = Field(
        default=None,
        gt=0,
        description="Messages/s one task can carry; by default measured (the highest rate a task sustained with a backlog).",
    )
    split_at: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Split a task whose rate reaches this fraction of the ceiling while it has a backlog.",
    )
    merge_below: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="Merge two tasks whose combined rate is below this fraction of the ceiling (the hysteresis band is between it and split_at).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> TasksSpec:
        if self.min > self.max:
            raise ValueError(f"tasks.min ({self.min}) is above tasks.max ({self.max})")
        if self.merge_below >= self.split_at:
            raise ValueError(
                f"tasks.merge_below ({self.merge_below}) must be below tasks.split_at "
                f"({self.split_at}), or a split would be merged back at once"
            )
        return self


class SinkRef(BaseModel):
    """A sink's config as written in the spec; validated against the sink's own model later."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str = Field(
        description="Sink type, e.g. postgres, localfile, mysql, redis, kafka, rabbitmq."
    )


class ConnectorRunSpec(_Spec):
    """What every connector spec, sink or source, says about its run: its name, the state it is
    created in, when its run counts as lost, how often it is restarted, its stages' deadlines, and
    its assets' owners and freshness. ``ConnectorSpec`` and ``SourceConnectorSpec`` add what they
    read and write."""

    name: str = Field(
        description="Unique name: lower case letters, digits, underscores. A sink connector's name "
        "is also its consumer group."
    )
    description: str | None = Field(default=None, description="Shown in the Dagster UI.")
    desired: DesiredState = Field(
        default=DesiredState.RUNNING,
        description="Created running, stopped or paused (applies when the connector is created).",
    )
    heartbeat_timeout_s: float = Field(
        default=30.0,
        ge=1,
        le=3_600,
        description="Heartbeat age after which the run counts as lost.",
    )
    max_restarts: int = Field(
        default=5,
        ge=0,
        le=1_000,
        description="Automatic restarts of an Error connector before it is left to the user.",
    )
    expected_latency_s: float = Field(
        default=300.0,
        gt=0,
        description="Freshness expectation of the connector's assets (a sink connector's sink "
        "asset, a source connector's topics).",
    )
    owners: list[str] = Field(
        default_factory=list, description="Asset owners (emails or team:name)."
    )
    liveness: LivenessSpec = Field(
        default_factory=LivenessSpec,
        description="Stage deadlines: Degraded, then a self-restart (section `liveness`).",
    )

    @field_validator("name")
    @classmethod
    def _name_valid(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise ValueError(
                f"{v!r} must match {NAME_PATTERN} whole: a lower-case letter, then up to 62 "
                "lower-case letters, digits or underscores (no spaces, newlines or other "
                "characters)"
            )
        return v


class WatermarkSpec(_Spec):
    """The connector's event-time watermark (core/engine/watermarks.py): how complete its sink is."""

    column: str | None = Field(
        default=None,
        min_length=1,
        description="Transform output column holding each row's event time (a timestamp; "
        "naive times are UTC). Default: the record timestamp `__timestamp`.",
    )
    allowed_lateness_s: float = Field(
        default=0.0,
        ge=0,
        le=30 * 86_400,
        description="The one lateness: how long after its event time an event may arrive and still "
        "be on time. The watermark stays this far behind the oldest partition's newest event time "
        "(and, all partitions idle, behind the moment the source was last seen caught up); an event "
        "below it is late (reported: landed_through runs its partition again). Cover out-of-order "
        "events and producers' clock skew with it.",
    )
    idle_after_s: float = Field(
        default=60.0,
        gt=0,
        le=30 * 86_400,
        description="A partition with no lag that delivered nothing for this long is idle: it no "
        "longer holds the watermark back. All partitions idle means complete: the watermark follows "
        "the clock (minus allowed_lateness_s), so the minute a stream stopped in runs too.",
    )


class ConnectorSpec(ConnectorRunSpec):
    """One connector: a source, a sink, and how the batch travels between them."""

    source: SourceSpec = Field(
        description="Where to read: topics and bootstrap servers (section `source`)."
    )
    sink: SinkRef = Field(
        description="Where to write: `type` plus that sink's fields (section Sinks)."
    )
    batch: BatchPolicy = Field(
        default_factory=BatchPolicy, description="When a batch closes (section `batch`)."
    )
    transform: TransformSpec = Field(
        default_factory=TransformSpec,
        description="Decoding and Spark SQL shaping (section `transform`).",
    )
    retry: RetrySpec = Field(
        default_factory=RetrySpec, description="Outage retries (section `retry`)."
    )
    failure: FailureSpec = Field(
        default_factory=FailureSpec, description="Failed messages (section `failure`)."
    )
    tasks: TasksSpec = Field(
        default_factory=TasksSpec,
        description="Task runs sharing the partitions, split and merged by load (section `tasks`).",
    )
    destinations: DestinationRulesSpec | None = Field(
        default=None,
        description="For sinks whose rows choose their destination (`__destination`): admission, cap "
        "and per-destination breakers (section `destinations`); refused rows go to the failure policy.",
    )
    watermark: WatermarkSpec = Field(
        default_factory=WatermarkSpec,
        description="Event-time watermark reported on the sink asset (section `watermark`).",
    )

    @model_validator(mode="after")
    def _dead_letters_confined(self) -> ConnectorSpec:
        """A local dead-letter place lies under a root and is not another connector's
        (``core.trust.paths``: ``$CONVEYOR_HOME/dead_letters/<name>`` is only ``<name>``'s)."""
        dl = self.failure.dead_letter
        if dl.store == "parquet" and dl.path is not None:
            problem = paths.location_problem(dl.path, owner=self.name)
            if problem:
                raise FieldRuleError(problem, field="failure.dead_letter.path")
        return self

    def dead_letter_place(self) -> str | None:
        """The real local directory of the Parquet dead letters (default
        ``$CONVEYOR_HOME/dead_letters/<name>``); None for another scheme's URL (``s3a://``).
        Resolved now (``core.trust.paths``): ConfigError naming the field when refused."""
        path = self.failure.dead_letter.path
        if path is not None and paths.is_url(path):
            return None
        where = path if path is not None else f"{paths.DEAD_LETTERS_DIR}/{self.name}"
        return paths.resolve_location(where, field="failure.dead_letter.path", owner=self.name)


@dataclass(frozen=True, order=True)
class TopicPartition:
    topic: str
    partition: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]"


# Next offset to read per partition (Kafka convention: committed = last processed + 1).
Offsets = dict[TopicPartition, int]


class BrokerSpec(_Spec):
    """One broker executor in the brokers file."""

    id: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="Broker (executor) name; connectors are placed on brokers by id.",
    )
    capacity: int = Field(
        default=8, ge=1, le=10_000, description="Connectors this broker runs at most."
    )
    spark_remote: str | None = Field(
        default=None,
        pattern=r"^sc://",
        description="Spark Connect endpoint the broker's connector runs use. "
        "Default: `$CONVEYOR_SPARK_REMOTE`.",
    )
    run_tags: dict[str, str] = Field(
        default_factory=dict,
        description="Tags merged into the tags of every run placed on this broker (run launcher "
        "placement: Kubernetes node selectors, Celery queues, ...).",
    )
    draining: bool = Field(
        default=False,
        description="A draining broker gets no new connectors and hands its connectors over. "
        "Kept across restarts once set with `conveyor broker drain`.",
    )

    def broker(self, default_remote: str) -> Broker:
        return Broker(
            id=self.id,
            capacity=self.capacity,
            spark_remote=self.spark_remote or default_remote,
            run_tags=dict(self.run_tags),
            draining=self.draining,
        )


class BrokersFile(_Spec):
    """The brokers file: the broker executors, under ``brokers:``."""

    brokers: list[BrokerSpec] = Field(min_length=1, description="The broker executors.")

    @field_validator("brokers")
    @classmethod
    def _ids_unique(cls, v: list[BrokerSpec]) -> list[BrokerSpec]:
        seen: set[str] = set()
        for b in v:
            if b.id in seen:
                raise ValueError(f"broker id {b.id!r} appears twice")
            seen.add(b.id)
        return v


@dataclass(frozen=True)
class Broker:
    """A broker executor: a lane with a capacity and a Spark Connect endpoint."""

    id: str
    capacity: int = 8
    spark_remote: str = "sc://127.0.0.1:15002"
    run_tags: dict[str, str] = field(default_factory=dict)
    draining: bool = False


@dataclass(frozen=True)
class Counters:
    """Cumulative counters a run reports with its heartbeat."""

    messages_in: int = 0
    messages_out: int = 0
    filtered: int = 0
    failed: int = 0
    discarded: int = 0
    dead_lettered: int = 0
    retries: int = 0
    commit_failures: int = 0
    batches: int = 0
    lag: int | None = None
    msgs_per_s: float = 0.0
    batch_latency_p50_ms: float | None = None
    batch_latency_p99_ms: float | None = None
    # High watermark per partition, keyed ``topic[partition]`` (None until a fetch reported one).
    highwaters: dict[str, int] | None = None
    # Messages given up per partition (``topic[partition]``): a position below the log start,
    # or one moved past by ``source.out_of_range`` (core/positions.py).
    given_up: dict[str, int] | None = None
    # Schema registry lookups of the decoders (``Registry.metrics``; None without a registry).
    schema_registry: dict[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
