"""Changing a stopped connector's positions: offsets (KIP-875, resets), a source's state.

Offsets change only while the connector is stopped, checked and fenced by the meta store
in the transaction that writes them. A connector whose target keeps its offsets (exactly
once) has them moved there first, fenced (``_move_target_offsets``), then in the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conveyor.config.specs import load_source, resolved
from conveyor.control.operation_context import (
    ConflictError,
    InvalidOptionError,
    InvalidRequestError,
    OperationsPart,
    found,
)
from conveyor.control.reads import connector_kind
from conveyor.core.errors import ConfigError
from conveyor.core.model import SourceSpec, TopicPartition
from conveyor.core.positions import PositionError, checked_position, parse_positions, topics_read
from conveyor.store.meta import ConnectorRow, offsets_editable

OFFSETS_ALTERED = "The offsets for this connector have been altered successfully"
OFFSETS_RESET = "The offsets for this connector have been reset successfully"


class ConnectorOffsets(OperationsPart):
    """KIP-875's offsets changes, the CLI's resets, a source's state reset and abandoned batch."""

    def reset_source_state(self, name: str) -> dict[str, Any]:
        """Forget a STOPPED source connector's state: it reads from the beginning again."""
        row = self.row(name)
        self._require_stopped(row)
        with found(name):
            existed = self.store.reset_source_state(
                name, reason=f"source state reset from {self.actor}"
            )
        return {"name": name, "reset": existed}

    def abandon_batch(self, name: str) -> dict[str, Any]:
        """Ask a STOPPED source connector's next run to skip its first batch (data loss, on purpose)."""
        row = self.row(name)
        if connector_kind(row) != "source":
            raise ConflictError(
                f"{name} is a sink connector; abandon-batch is for source connectors"
            )
        self._require_stopped(row)
        self.store.request_abandon(name)
        return {"name": name, "abandon_requested": True}

    def alter_offsets(self, name: str, body: Any) -> dict[str, str]:
        """PATCH: set (or with ``"offset": null`` forget) the given partitions; stopped only."""
        row = self.row(name)
        offsets, forget = parse_kip875(body, reads=topics_read(row.spec))
        self._require_stopped(row)
        reason = f"offsets altered from {self.actor}"
        with found(name):
            self._move_target_offsets(row, offsets, forget=forget, reason=reason)
            self.store.reset_offsets(name, offsets, forget=forget, reason=reason)
        return {"message": OFFSETS_ALTERED}

    def reset_offsets(self, name: str) -> dict[str, str]:
        """DELETE: forget every offset; the connector starts over from ``source.start_from``."""
        row = self.row(name)
        self._require_stopped(row)
        reason = f"offsets reset from {self.actor}"
        with found(name):
            self._move_target_offsets(row, {}, replace=True, reason=reason)
            self.store.reset_offsets(name, {}, replace=True, reason=reason)
        return {"message": OFFSETS_RESET}

    def reset_offsets_to(
        self,
        name: str,
        to: str | None = None,
        *,
        to_datetime: str | None = None,
        from_group: str | None = None,
    ) -> dict[TopicPartition, int]:
        """The CLI's ``--to earliest|latest|TOPIC:PARTITION:OFFSET[,...]``, ``--to-datetime TIME``
        or ``--from-group GROUP`` (all but explicit offsets ask Kafka, through the connector's
        own source connection: TLS, SASL)."""
        row = self.row(name)
        self._require_stopped(row)
        given = [v for v in (to, to_datetime, from_group) if v]
        if len(given) != 1:
            raise InvalidRequestError("give exactly one of --to, --to-datetime and --from-group")
        if to is not None and to not in ("earliest", "latest"):
            try:
                new = parse_positions(to, topics_read(row.spec))
            except PositionError as e:
                raise InvalidOptionError("--to", str(e)) from None
        else:
            new = self._offsets_from_kafka(row, to or to_datetime, from_group)
        reason = f"offsets reset from {self.actor}"
        with found(name):
            self._move_target_offsets(row, new, reason=reason)
            self.store.reset_offsets(name, new, reason=reason)
        return new

    def _offsets_from_kafka(
        self, row: ConnectorRow, at: str | None, from_group: str | None
    ) -> dict[TopicPartition, int]:
        """Each partition's offset at ``at`` (earliest, latest, a time), or group ``from_group``'s."""
        from conveyor.brokers.kafka import KafkaSource, source_time

        if at not in (None, "earliest", "latest"):
            source_time(at)  # a bad time is a config error before anything connects
        loaded = load_source(row.name, row.spec_source)
        if not loaded.ok:
            raise ConfigError(str(loaded.error))
        live = resolved(loaded)  # the source may need a secret (SASL) to connect
        assert live.spec is not None
        source = KafkaSource(live.spec.source, group_id=row.name)
        try:
            source.open(self.store.committed_offsets(row.name), wait_for_topics_s=5)
            if from_group is None:
                return source.offsets_at(at or "earliest")
            new = source.group_offsets(from_group)
            if not new:
                raise InvalidRequestError(
                    f"consumer group {from_group!r} has no committed offsets for {row.name}'s topics"
                )
            return new
        finally:
            source.close()

    def _require_stopped(self, row: ConnectorRow) -> None:
        if not offsets_editable(row):
            raise ConflictError(
                f"connector {row.name!r} is {row.status.value} (desired {row.desired.value}); "
                "offsets can be changed only when it is stopped: stop it first"
            )

    def _move_target_offsets(
        self,
        row: ConnectorRow,
        offsets: dict[TopicPartition, int],
        *,
        forget: list[TopicPartition] | None = None,
        replace: bool = False,
        reason: str,
    ) -> None:
        """A connector whose target keeps its offsets (exactly once; they win over the meta
        store's on start): the change made in the target first, fenced (``fence_writers``
        raises every writer's generation; the target refuses an older run from then on),
        then by the caller in the meta store, its mirror. A crash between the two leaves the
        target's value, which wins on start. ConflictError when the sink cannot move them or
        a run started meanwhile; nothing is changed in the meta store then."""
        loaded = load_source(row.name, row.spec_source)
        if not (loaded.ok and loaded.sink is not None and loaded.sink.offsets_in_target()):
            return
        from conveyor.core.errors import FencedError, PermanentSinkError
        from conveyor.core.sink import OffsetsInTarget
        from conveyor.sinks import build_sink

        live = resolved(loaded)  # holds secrets: used to connect, never shown
        assert live.sink is not None
        sink = build_sink(live.sink)
        if not isinstance(sink, OffsetsInTarget):
            raise ConflictError(f"connector {row.name!r}: sink {sink.describe()} keeps no offsets")
        from conveyor.core.positions import writer_id

        fenced = self.store.fence_writers(row.name, reason=reason)
        generations = {writer_id(w, row.incarnation): g for w, g in fenced.items()}
        try:
            sink.move_target_offsets(
                writer_id(row.name, row.incarnation),
                generations,
                offsets,
                forget=forget or [],
                replace=replace,
            )
        except FencedError as e:
            raise ConflictError(f"connector {row.name!r}: {e}") from None
        except PermanentSinkError as e:
            raise ConflictError(
                f"connector {row.name!r} keeps its offsets in its target (sink "
                f"{loaded.sink.type}, delivery {getattr(loaded.sink, 'delivery', 'exactly_once')}), "
                f"which win over the meta store's on start, and they could not be moved there: "
                f"{e} (docs/OPERATIONS.md, 'Exactly once and offsets')"
            ) from None


def parse_kip875(
    body: Any, *, reads: SourceSpec | None = None
) -> tuple[dict[TopicPartition, int], list[TopicPartition]]:
    """KIP-875's request body for a sink connector -> (offsets to set, partitions to forget);
    each partition and offset checked by ``core.positions.checked_position`` (``reads``: the
    topics the connector reads). InvalidRequestError naming the item and the rule."""
    if not isinstance(body, Mapping) or not isinstance(body.get("offsets"), list):
        raise InvalidRequestError(
            'expected {"offsets": [{"partition": {"kafka_topic": ..., "kafka_partition": ...}, '
            '"offset": {"kafka_offset": ...}}, ...]}'
        )
    if not body["offsets"]:
        raise InvalidRequestError("offsets: the list is empty")
    offsets: dict[TopicPartition, int] = {}
    forget: list[TopicPartition] = []
    for i, item in enumerate(body["offsets"]):
        where = f"offsets[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"{where}: expected an object")
        part = item.get("partition")
        if not isinstance(part, Mapping):
            raise InvalidRequestError(f"{where}.partition: expected an object")
        if "offset" not in item:
            raise InvalidRequestError(f"{where}.offset: missing (an object, or null to reset)")
        off = item["offset"]
        if off is not None and not isinstance(off, Mapping):
            raise InvalidRequestError(f"{where}.offset: expected an object or null")
        if off is not None and off.get("kafka_offset") is None:
            raise InvalidRequestError(
                f"{where}.offset.kafka_offset: missing (the next offset to read; "
                '"offset": null resets the partition)'
            )
        try:
            tp, value = checked_position(
                part.get("kafka_topic"),
                part.get("kafka_partition"),
                None if off is None else off["kafka_offset"],
                reads,
            )
        except PositionError as e:
            raise InvalidRequestError(f"{where}.{_KIP875_FIELDS[e.part]}: {e}") from None
        if tp in offsets or tp in forget:
            raise InvalidRequestError(f"{where}: partition {tp} is given twice")
        if value is None:
            forget.append(tp)
        else:
            offsets[tp] = value
    return offsets, forget


#: Where each part of a position is in a KIP-875 body.
_KIP875_FIELDS = {
    "topic": "partition.kafka_topic",
    "partition": "partition.kafka_partition",
    "offset": "offset.kafka_offset",
}
