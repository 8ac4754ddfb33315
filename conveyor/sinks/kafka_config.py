"""The Kafka sink's config model: ``KafkaSinkConfig``, its rules, and the record templates and
topic names they check (also used by the RabbitMQ sink's routing keys).

The sink (``conveyor.sinks.kafka``) and its librdkafka client (``conveyor.sinks.kafka_confluent``)
both read it; it imports neither, so the two import it one way only.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from typing import Any, Literal

from pydantic import Field, model_validator

from conveyor.core.asset_keys import key_part
from conveyor.core.connection import KafkaConnection
from conveyor.core.errors import rule
from conveyor.core.schema_registry import SchemaRegistrySpec
from conveyor.core.trust.references import known_now
from conveyor.sinks import templates
from conveyor.sinks.base import SinkConfig

# -- record templates (the syntax is conveyor.sinks.templates'; also used by the RabbitMQ sink) --

#: What a topic, key or routing-key template may use.
TEMPLATE_FIELDS = ("topic", "key", "partition", "offset", "destination", "payload")


def template_problems(template: str) -> list[str]:
    """What is wrong with a topic, key or routing-key template (empty when it is usable)."""
    return templates.problems(template, TEMPLATE_FIELDS)


# -- config ---------------------------------------------------------------------------------

_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
CODEC_MODULES = {"gzip": "gzip", "snappy": "snappy", "lz4": "lz4", "zstd": "zstandard"}


def topic_name_problem(name: str) -> str | None:
    """Why ``name`` is not a legal Kafka topic name, or None."""
    if not _TOPIC_NAME.match(name):
        return f"{name[:80]!r} is not a legal topic name (1-249 characters of A-Z a-z 0-9 . _ -)"
    if name in (".", ".."):
        return f"{name!r} is not a legal topic name"
    return None


def codec_available(codec: str) -> bool:
    """Whether kafka-python can compress with ``codec`` here (its library is importable)."""
    if codec == "none":
        return True
    mod = CODEC_MODULES[codec]
    if importlib.util.find_spec(mod) is not None:
        return True
    # kafka-python also accepts these alternative lz4 bindings
    return codec == "lz4" and any(
        importlib.util.find_spec(m) is not None for m in ("lz4f", "lz4framed")
    )


#: The sink's default client (docs/sinks/kafka.md, "Performance", says why).
DEFAULT_CLIENT: Literal["confluent", "kafka-python"] = "confluent"


class KafkaSinkConfig(SinkConfig, KafkaConnection):
    """Rows as records on a Kafka(-protocol) topic. The connection fields (TLS, SASL, client
    options) are the same as the source's."""

    type: Literal["kafka"] = "kafka"
    client: Literal["confluent", "kafka-python"] = Field(
        default=DEFAULT_CLIENT,
        description="The Kafka client that produces: confluent (librdkafka: batching, compression and "
        "partitioning in C threads, delivery reports per record) or kafka-python (pure Python). "
        "client_options are under the chosen client's names (librdkafka's dotted properties for confluent).",
    )
    bootstrap_servers: str = Field(  # type: ignore[assignment]
        description="Comma-separated host:port list of the target cluster's brokers."
    )
    topic: str = Field(
        description="Target topic, or a template: ${topic} (source topic), ${key}, ${partition}, ${offset}, "
        "${destination}, ${payload.<field>} (dotted path). A row's __destination, when set, wins (see use_destination)."
    )
    use_destination: bool = Field(
        default=True,
        description="A row with a __destination column value goes to that topic instead of `topic`.",
    )
    key: str | None = Field(
        default=None,
        description="Message key template (same placeholders as `topic`); default: the source message's key bytes, unchanged.",
    )
    keep_headers: bool = Field(default=True, description="Copy the source message's headers.")
    coordinate_headers: bool = Field(
        default=False,
        description="Add headers x-conveyor-topic, x-conveyor-partition, x-conveyor-offset (the source coordinates).",
    )
    timestamp: Literal["source", "now"] = Field(
        default="source",
        description="Record timestamp: the source message's timestamp, or the producer's clock.",
    )
    partitioning: Literal["key", "source"] = Field(
        default="key",
        description="`key`: murmur2 of the key, the same partition with either client (kafka-python's "
        "partitioner, librdkafka's murmur2_random); sticky when there is no key. "
        "`source`: the source partition number (the target topic needs at least as many partitions).",
    )
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        default="none",
        description="Compression codec; with kafka-python, snappy, lz4 and zstd need their Python library "
        "installed (librdkafka has them built in).",
    )
    idempotent: bool = Field(
        default=True,
        description="Idempotent producer (InitProducerId; no duplicates from the producer's own retries). Requires acks=all.",
    )
    acks: Literal["all", "1"] = Field(
        default="all",
        description="Acknowledgement level: all in-sync replicas, or the leader only.",
    )
    linger_ms: int = Field(
        default=5, ge=0, le=60_000, description="How long the producer waits to fill a batch."
    )
    batch_size: int = Field(
        default=256 * 1024,
        ge=1024,
        le=64 << 20,
        description="Producer batch size per partition, bytes.",
    )
    max_request_size: int = Field(
        default=1 << 20,
        ge=1024,
        le=1 << 30,
        description="Largest record (key + value + headers) accepted; a larger row is a data error "
        "(librdkafka: message.max.bytes, at most 1,000,000,000).",
    )
    request_timeout_ms: int = Field(
        default=30_000, ge=100, description="Timeout of one produce request."
    )
    delivery_timeout_ms: int = Field(
        default=120_000,
        ge=100,
        description="Upper bound for a record to be acknowledged, retries included; bounds send_batch.",
    )
    max_block_ms: int = Field(
        default=60_000,
        ge=100,
        description="How long producing may block waiting for topic metadata or for room in the "
        "producer's buffer.",
    )
    connect_timeout_ms: int = Field(
        default=30_000, ge=100, description="How long to try to reach a bootstrap server at start."
    )
    client_id: str | None = Field(
        default="conveyor-sink", description="Client id shown in broker logs and quotas."
    )
    delivery: Literal["at_least_once", "exactly_once"] = Field(
        default="at_least_once",
        description="exactly_once: each batch's records and the source offsets they end at in one "
        "Kafka transaction (transactional id and consumer group conveyor-<connector>; a newer run "
        "fences an older one); on start the offsets the target's group holds win over the meta "
        "store's. Consumers of the target read with isolation.level=read_committed. Needs client: "
        "confluent, acks: all and the source topics on the target's cluster (docs/sinks/kafka.md).",
    )
    value_format: Literal["json", "avro", "protobuf", "json_schema"] = Field(
        default="json",
        description="How each row's payload columns are written: json (a JSON object; a single "
        "value column as it is), or avro / protobuf / json_schema in Confluent's wire format, "
        "written by confluent-kafka's own serializers with the schema in schema_registry (so "
        "Confluent's deserializers, Kafka Connect's converters and ksqlDB read them). A row its "
        "schema does not allow is a failed message. protobuf writes with the subject's latest "
        "registered schema (auto_register: false, use_latest_version: true; value_message).",
    )
    value_message: str | None = Field(
        default=None,
        description="value_format protobuf: the full name of the message the rows are (e.g. "
        "shop.Order). Default: the schema file's first message.",
    )
    schema_registry: SchemaRegistrySpec | None = Field(
        default=None, description="With value_format avro or json_schema: the schema registry."
    )
    value_schema: str | None = Field(
        default=None,
        description="The writer schema (Avro schema or JSON Schema, as JSON text). Default: derived "
        "from the rows' columns (Avro record conveyor.<topic>; decimals, dates and timestamps as "
        "their logical types).",
    )
    subject_name_strategy: Literal["topic", "record", "topic_record"] = Field(
        default="topic",
        description="The subject the schema is registered under: topic (<topic>-value), record "
        "(the record's full name) or topic_record (<topic>-<record>), as Confluent's serializers "
        "(protobuf: the record is value_message).",
    )
    auto_register: bool = Field(
        default=True,
        description="Register the writer schema under its subject (false: it must be there).",
    )
    use_latest_version: bool = Field(
        default=False,
        description="Write with the subject's latest registered version instead of value_schema "
        "(with auto_register false).",
    )

    def asset_key_path(self) -> list[str]:
        name = (
            self.topic
            if templates.is_static(self.topic)
            else templates.PLACEHOLDER.sub(
                lambda m: m.group(1).strip().replace("payload.", ""), self.topic
            )
        )
        return ["kafka", key_part(name)]

    def kind(self) -> str:
        return "kafka"

    @model_validator(mode="before")
    @classmethod
    def _kafka_python_options_keep_their_client(cls, data: Any) -> Any:
        """A spec written before confluent became the default, with kafka-python's option
        names and no ``client``, keeps kafka-python (with a warning) instead of failing."""
        if not isinstance(data, dict) or "client" in data:
            return data
        options = data.get("client_options") or {}
        named = [n for n in options if isinstance(n, str) and "_" in n and "." not in n]
        if not named:
            return data
        warnings.warn(
            f"sink.client_options {named} are kafka-python names: this sink keeps the "
            "kafka-python client; set client: kafka-python to keep it, or client: confluent "
            "with librdkafka's dotted names",
            FutureWarning,
            stacklevel=2,
        )
        return {**data, "client": "kafka-python"}

    @model_validator(mode="after")
    def _delivery_rules(self) -> KafkaSinkConfig:
        """exactly_once is librdkafka's transactions: the confluent client, acks all, idempotent."""
        if self.delivery == "exactly_once":
            rule(self.client == "confluent", "exactly_once needs client: confluent", field="client")
            rule(self.acks == "all", "exactly_once needs acks: all", field="acks")
            rule(self.idempotent, "exactly_once needs idempotent: true", field="idempotent")
        return self

    @model_validator(mode="after")
    def _schema_rules(self) -> KafkaSinkConfig:
        """The schema settings go with value_format avro or json_schema, which needs a registry."""
        framed = self.value_format != "json"
        rule(
            not framed or self.schema_registry is not None,
            f"value_format {self.value_format} needs schema_registry",
            field="schema_registry",
        )
        for name in ("schema_registry", "value_schema"):
            rule(
                framed or getattr(self, name) is None,
                f"{name} is for value_format avro or json_schema",
                field=name,
            )
        rule(
            self.value_format != "protobuf"
            or (self.use_latest_version and not self.auto_register and not self.value_schema),
            "value_format protobuf writes with the subject's latest registered schema: set "
            "auto_register: false and use_latest_version: true (no value_schema)",
            field="use_latest_version",
        )
        rule(
            self.value_format == "protobuf" or self.value_message is None,
            "value_message is for value_format protobuf",
            field="value_message",
        )
        rule(
            not (self.use_latest_version and self.auto_register),
            "use_latest_version writes with the registered version: set auto_register: false",
            field="use_latest_version",
        )
        return self

    @model_validator(mode="after")
    def _rules(self) -> KafkaSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        servers = self.bootstrap_servers.split(",") if known_now(self.bootstrap_servers) else []
        for hp in servers:
            host, _, port = hp.strip().rpartition(":")
            rule(
                bool(host) and port.isdigit(),
                f"{hp.strip()!r} is not host:port",
                field="bootstrap_servers",
            )
        problems = template_problems(self.topic) if known_now(self.topic) else []
        rule(not problems, "; ".join(problems), field="topic")
        if known_now(self.topic) and templates.is_static(self.topic):
            problem = topic_name_problem(self.topic)
            rule(problem is None, problem or "", field="topic")
        if self.key is not None:
            problems = template_problems(self.key) if known_now(self.key) else []
            rule(not problems, "; ".join(problems), field="key")
        rule(
            not (self.idempotent and self.acks != "all"),
            "the idempotent producer needs acks: all (or set idempotent: false)",
            field="acks",
        )
        rule(
            self.delivery_timeout_ms >= self.linger_ms + self.request_timeout_ms,
            "must be at least linger_ms + request_timeout_ms",
            field="delivery_timeout_ms",
        )
        return self
