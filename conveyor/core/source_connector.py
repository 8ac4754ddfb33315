"""The spec of a source connector: a system read into Kafka-protocol topics, routed per message.

A spec file is a source connector when it says ``kind: source`` (or when its
``source.type`` names a source other than Kafka); everything else about it reads like a
sink connector's spec: ``batch``, ``transform``, ``retry``, ``desired`` and the run
settings are the same sections. ``kafka`` is where the topics live (the one Kafka
connection model plus per-connector topic defaults) and ``routing`` says which topic
each message goes to.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from conveyor.core.connection import KafkaConnection
from conveyor.core.engine.routing import RoutingSpec
from conveyor.core.model import (
    BatchPolicy,
    ConnectorRunSpec,
    NullValues,
    RetrySpec,
    TransformSpec,
    _Spec,
)


class ProducerSpec(KafkaConnection, _Spec):
    """Where the destination topics live, and how new ones are created (section `kafka`)."""

    partitions: int = Field(
        default=1,
        ge=1,
        le=10_000,
        description="Partitions of a destination topic created on first use.",
    )
    replication_factor: int = Field(
        default=1,
        ge=1,
        le=32,
        description="Replication factor of a destination topic created on first use.",
    )
    create_topics: bool = Field(
        default=True,
        description="Create a missing destination topic on first use (with partitions and "
        "replication_factor); false: a missing topic is an error of its destination.",
    )
    prewarm_timeout_s: float = Field(
        default=30.0,
        ge=0,
        le=600,
        description="At start, the allowlist's literal topics are created (or checked) within this deadline.",
    )
    acks: Literal["all", "1"] = Field(
        default="all",
        description="Acknowledgement a produce waits for: all (in-sync replicas) or 1.",
    )
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        default="none", description="Producer compression codec."
    )
    request_timeout_ms: int = Field(
        default=30_000,
        ge=1_000,
        le=600_000,
        description="How long one produce may wait for its acknowledgement.",
    )


class SourceRef(BaseModel):
    """A source's config as written in the spec; validated against the source's own model later."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str = Field(description="Source type: postgres_polling, postgres_cdc, webhook, mqtt.")


class SourceConnectorSpec(ConnectorRunSpec):
    """One source connector: a system, the topics it produces into, and how rows are routed."""

    kind: Literal["source"] = Field(
        default="source", description="`source`: this spec is a source connector."
    )
    source: SourceRef = Field(
        description="What to read: `type` plus that source's fields (section Sources)."
    )
    kafka: ProducerSpec = Field(
        default_factory=ProducerSpec,
        description="Where to produce: the cluster and topic defaults (section `kafka`).",
    )
    routing: RoutingSpec = Field(
        default_factory=RoutingSpec,
        description="Destination per message and admission (section `routing`).",
    )
    batch: BatchPolicy = Field(
        default_factory=BatchPolicy, description="When a batch closes (section `batch`)."
    )
    transform: TransformSpec = Field(
        default_factory=TransformSpec,
        description="Decoding and Spark SQL shaping; a select may set __destination (section `transform`).",
    )
    retry: RetrySpec = Field(
        default_factory=RetrySpec, description="Outage retries (section `retry`)."
    )
    commit_failure_threshold: int = Field(
        default=16,
        ge=1,
        le=1_000_000,
        description="Consecutive failed commits (slot advance, deferred DELETE/UPDATE, acknowledgements) "
        "after which the connector shows Degraded; one success clears it.",
    )

    def select_routes(self) -> bool:
        """Whether the transform's select sets ``__destination`` (column-derived routing)."""
        return any("__destination" in s for s in (self.transform.select or []))

    def transform_for(self, builds_tombstones: bool) -> TransformSpec:
        """The transform a run uses: a source that builds null-value messages on purpose
        (tombstones, ``SourceConfig.builds_tombstones``) has them pass unless the spec sets
        ``transform.null_values`` (its default, skip, is for payloads missing by accident)."""
        if not builds_tombstones or "null_values" in self.transform.model_fields_set:
            return self.transform
        return self.transform.model_copy(update={"null_values": NullValues.PASS})


def is_source_connector(data: object) -> bool:
    """Whether a spec mapping describes a source connector (``kind: source``, or a ``source.type``
    other than kafka)."""
    if not isinstance(data, dict):
        return False
    if data.get("kind") == "source":
        return True
    src = data.get("source")
    return isinstance(src, dict) and "type" in src and str(src["type"]).lower() != "kafka"
