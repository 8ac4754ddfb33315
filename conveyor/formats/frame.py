"""Confluent's wire format: the frame in front of each record (the only bytes read here).

A framed record is a magic byte 0, the writer schema's id as a big-endian int32, then (for
Protobuf only) the list of message indexes selecting the message type in the schema's file
(zigzag varints, a single 0 for the first message), then the payload in the schema's own
encoding. confluent-kafka's ``SchemaId`` reads it (its ``from_bytes`` is what its own
deserializers call); this module only turns its failures into one error with a reason.
Magic byte 1 (a schema GUID instead of an id, written by confluent-kafka >= 2.11 when
configured so) is refused: the decoders look schemas up by id.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

from confluent_kafka.schema_registry.serde import SchemaId
from confluent_kafka.serialization import SerializationError

HEADER_BYTES = 5  # magic byte + int32 schema id


class FrameError(ValueError):
    """A payload that is not a Confluent-framed record; the message says what is wrong."""


@dataclass(frozen=True)
class Frame:
    """A framed record: its writer schema's id, the Protobuf message indexes (None for
    other formats) and the payload after the frame."""

    schema_id: int
    message_indexes: tuple[int, ...] | None
    payload: bytes


def read_frame(value: bytes, *, protobuf: bool = False) -> Frame:
    """The frame of ``value`` (``protobuf``: with message indexes); FrameError says why not."""
    if len(value) < HEADER_BYTES:
        raise FrameError(f"corrupt frame: {len(value)} bytes, shorter than the 5-byte header")
    if value[0] != 0:
        raise FrameError(
            f"corrupt frame: magic byte {value[0]}, not 0 (not Confluent's wire format with a "
            "schema id)"
        )
    sid = SchemaId("PROTOBUF" if protobuf else "AVRO")
    buf = io.BytesIO(value)
    try:
        rest = sid.from_bytes(buf)
    except (SerializationError, EOFError, struct.error, ValueError) as e:
        raise FrameError(f"corrupt frame: {e}") from None
    assert sid.id is not None
    indexes = tuple(sid.message_indexes) if protobuf and sid.message_indexes is not None else None
    return Frame(int(sid.id), indexes, rest.read())
