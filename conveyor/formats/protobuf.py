"""Protobuf payloads into Arrow: Confluent-framed records, the writer schema from the registry.

The writer schema is read by id as a serialized ``FileDescriptorProto`` (``format=serialized``,
as confluent-kafka's own deserializer asks), with its references (imported files) added to
one ``DescriptorPool`` per schema id; the frame's message indexes select the message type,
``message_factory`` builds its class and protobuf parses the payload. Protobuf's schema
evolution is by field number, so each writer version is read in its own shape; the table's
columns are the union of the shapes in the batch, in the order first seen.

Types: message -> struct, repeated -> list, map fields -> map<K, V>, enum -> string (the
value's name; an unknown number as its digits), ``google.protobuf.Timestamp`` ->
timestamp(us, UTC), the wrapper types (``Int64Value``...) -> their nullable scalar, int32 /
sint32 / sfixed32 -> int32, int64 / sint64 / sfixed64 -> int64, uint32 / fixed32 -> int64,
uint64 / fixed64 -> decimal128(20, 0) (exact; Spark has no unsigned types), float -> float32,
double -> float64, bool, string, bytes -> binary. A scalar without presence (proto3) is its
default value when unset; a message field, a ``optional`` scalar or a oneof member that is
unset is null. A recursive message has no Arrow type: its records fail naming it.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import pyarrow as pa
from google.protobuf import (
    any_pb2,
    descriptor_pb2,
    duration_pb2,
    empty_pb2,
    field_mask_pb2,
    struct_pb2,
    timestamp_pb2,
    wrappers_pb2,
)
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from conveyor.formats.caches import LruCache
from conveyor.formats.decoded import Decoded, decode_each
from conveyor.formats.frame import FrameError, read_frame
from conveyor.formats.limits import (
    MAX_TYPE_DEPTH,
    ReferenceWalk,
    SchemaLimit,
    schema_error,
    type_depth_limit,
)
from conveyor.formats.registry import Registry, UnknownSchema

SERIALIZED = "serialized"
_WELL_KNOWN = (
    any_pb2,
    duration_pb2,
    empty_pb2,
    field_mask_pb2,
    struct_pb2,
    timestamp_pb2,
    wrappers_pb2,
    descriptor_pb2,
)
_F = FieldDescriptor
_SCALARS: dict[int, pa.DataType] = {
    _F.TYPE_DOUBLE: pa.float64(),
    _F.TYPE_FLOAT: pa.float32(),
    _F.TYPE_INT64: pa.int64(),
    _F.TYPE_SINT64: pa.int64(),
    _F.TYPE_SFIXED64: pa.int64(),
    _F.TYPE_UINT64: pa.decimal128(20, 0),
    _F.TYPE_FIXED64: pa.decimal128(20, 0),
    _F.TYPE_INT32: pa.int32(),
    _F.TYPE_SINT32: pa.int32(),
    _F.TYPE_SFIXED32: pa.int32(),
    _F.TYPE_UINT32: pa.int64(),
    _F.TYPE_FIXED32: pa.int64(),
    _F.TYPE_BOOL: pa.bool_(),
    _F.TYPE_STRING: pa.string(),
    _F.TYPE_BYTES: pa.binary(),
}
_WRAPPERS = {
    "google.protobuf.DoubleValue",
    "google.protobuf.FloatValue",
    "google.protobuf.Int64Value",
    "google.protobuf.UInt64Value",
    "google.protobuf.Int32Value",
    "google.protobuf.UInt32Value",
    "google.protobuf.BoolValue",
    "google.protobuf.StringValue",
    "google.protobuf.BytesValue",
}
Reader = Callable[[Any], Any]  # a field's value in a parsed message -> its Arrow value


class MessageShape:
    """A message type as an Arrow struct and the reader of a parsed message into a dict."""

    def __init__(self, desc: Descriptor):
        self.row_type, self.read = _message(desc, (desc.full_name,))


def _message(desc: Descriptor, seen: tuple[str, ...]) -> tuple[pa.StructType, Reader]:
    fields: list[pa.Field] = []
    readers: list[tuple[str, FieldDescriptor, Reader]] = []
    for fd in desc.fields:
        dtype, _, field_reader = _field(fd, seen)
        fields.append(
            pa.field(fd.name, dtype, True)
        )  # struct fields are all nullable: see STRUCT_FIELDS_NULLABLE in conveyor.formats.decoded
        readers.append((fd.name, fd, field_reader))

    def read(msg: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, fd, reader in readers:
            if fd.has_presence and not fd.is_repeated and not msg.HasField(name):
                out[name] = None
            else:
                out[name] = reader(getattr(msg, name))
        return out

    return pa.struct(fields), read


def _field(fd: FieldDescriptor, seen: tuple[str, ...]) -> tuple[pa.DataType, bool, Reader]:
    """(Arrow type, nullable, reader) of one field."""
    if fd.is_repeated and fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        key_type, _, key_read = _single(fd.message_type.fields_by_name["key"], seen)
        vtype, vnull, vread = _single(fd.message_type.fields_by_name["value"], seen)
        mtype = pa.map_(key_type, pa.field("value", vtype, vnull))
        return mtype, False, lambda m: [(key_read(k), vread(v)) for k, v in m.items()]
    dtype, nullable, read = _single(fd, seen)
    if fd.is_repeated:
        return pa.list_(pa.field("item", dtype, False)), False, lambda xs: [read(x) for x in xs]
    return dtype, nullable or fd.has_presence, read


def _single(fd: FieldDescriptor, seen: tuple[str, ...]) -> tuple[pa.DataType, bool, Reader]:
    """(Arrow type, nullable, reader) of one value of the field (an item when repeated)."""
    if fd.type == _F.TYPE_ENUM:
        enum = fd.enum_type

        def enum_name(n: int) -> str:
            v = enum.values_by_number.get(n)
            return v.name if v is not None else str(n)

        return pa.string(), False, enum_name
    if fd.message_type is None:
        return _SCALARS[fd.type], False, _identity
    name = fd.message_type.full_name
    if name == "google.protobuf.Timestamp":
        return pa.timestamp("us", tz="UTC"), True, lambda t: t.seconds * 1_000_000 + t.nanos // 1000
    if name in _WRAPPERS:
        vtype, _, vread = _single(fd.message_type.fields_by_name["value"], seen)
        return vtype, True, lambda w: vread(w.value)
    if name in seen:
        raise TypeError(f"message {name} contains itself: no Arrow type holds it")
    struct, read = _message(fd.message_type, (*seen, name))
    return struct, True, read


def _identity(v: Any) -> Any:
    return v


class ProtobufWriter:
    """A writer schema: its pool and, per message-index path, the class and shape."""

    def __init__(self, pool: DescriptorPool, fd_proto: descriptor_pb2.FileDescriptorProto):
        self.pool, self.fd_proto = pool, fd_proto
        self.messages: dict[tuple[int, ...], tuple[type[Any], MessageShape]] = {}

    def message(self, indexes: tuple[int, ...]) -> tuple[type[Any], MessageShape]:
        found = self.messages.get(indexes)
        if found is None:
            desc = self.pool.FindMessageTypeByName(_message_name(self.fd_proto, indexes))
            found = (GetMessageClass(desc), MessageShape(desc))
            self.messages[indexes] = found
        return found

    def message_class(self, name: str | None) -> type[Any]:
        """The class of the message ``name`` (its full name), or of the file's first message;
        ValueError when the schema has no such message."""
        full = name or _message_name(self.fd_proto, (0,))
        try:
            return GetMessageClass(self.pool.FindMessageTypeByName(full))
        except KeyError:
            raise ValueError(f"the schema has no message {full!r}") from None


def _message_name(fd: descriptor_pb2.FileDescriptorProto, indexes: tuple[int, ...]) -> str:
    """The full name of the message the frame's indexes select (a path through nested types)."""
    names: list[str] = []
    messages: Any = fd.message_type
    for i in indexes or (0,):
        if not 0 <= i < len(messages):
            raise ValueError(f"message index {i} is out of range ({len(messages)} messages)")
        names.append(messages[i].name)
        messages = messages[i].nested_type
    return ".".join(([fd.package] if fd.package else []) + names)


class ProtobufDecoder:
    """Confluent-framed Protobuf records, the writer schemas from the registry."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._writers: LruCache[int, ProtobufWriter] = LruCache(registry.spec.cache_capacity)

    def decode(self, values: Any) -> Decoded:
        problems: dict[int, str] = {}  # schema id -> why its records fail (this batch)
        return decode_each(values, lambda value: self._record(value, problems))

    def _record(self, value: bytes, problems: dict[int, str]) -> str | tuple[Any, Any]:
        """(the record, its shape's row type), or why it failed."""
        try:
            frame = read_frame(value, protobuf=True)
        except FrameError as e:
            return str(e)
        writer = self._writer(frame.schema_id, problems)
        if writer is None:
            return problems[frame.schema_id]
        try:
            cls, shape = writer.message(frame.message_indexes or (0,))
        except (KeyError, ValueError, TypeError) as e:
            return f"schema id {frame.schema_id}: {e}"
        msg = cls()
        try:
            msg.ParseFromString(frame.payload)
        except DecodeError as e:
            return f"not Protobuf of its writer schema: {e}"
        return shape.read(msg), shape.row_type

    def _writer(self, sid: int, problems: dict[int, str]) -> ProtobufWriter | None:
        cached = self._writers.get(sid)
        if cached is not None:
            return cached
        if sid in problems:
            return None
        try:
            schema = self.registry.schema(sid, SERIALIZED)
            writer = writer_of(self.registry, schema, f"schema id {sid}")
        except (UnknownSchema, ValueError, TypeError) as e:
            problems[sid] = str(e)
            return None
        except (SchemaLimit, RecursionError) as e:
            name = self.registry.schema_name(sid)
            raise schema_error(name, e, field=self.registry.prefix) from None
        self._writers.put(sid, writer)
        return writer


def writer_of(registry: Registry, schema: Any, what: str) -> ProtobufWriter:
    """A registered Protobuf schema (``format=serialized``) with its references, as a
    descriptor pool and its file; ValueError naming ``what`` when it is not one."""
    if schema.schema_type != "PROTOBUF":
        raise ValueError(f"{what} is a {schema.schema_type} schema, not Protobuf")
    pool = _base_pool()
    _add_references(registry, pool, schema.references or [], ReferenceWalk())
    fd_proto = _file_proto(schema.schema_str or "", what)
    pool.Add(fd_proto)
    check_message_depth(pool, fd_proto)
    return ProtobufWriter(pool, fd_proto)


def _add_references(
    registry: Registry, pool: DescriptorPool, refs: list[Any], walk: ReferenceWalk
) -> None:
    for ref in refs:
        try:
            pool.FindFileByName(ref.name)
            continue  # a well-known type, or added through another reference
        except KeyError:
            pass
        with walk.enter(ref.subject, ref.version) as new:
            if not new:
                continue
            found = registry.version(ref.subject, ref.version, SERIALIZED)
            _add_references(registry, pool, found.schema.references or [], walk)
            fd = _file_proto(found.schema.schema_str or "", f"reference {ref.name}")
            fd.name = ref.name
            pool.Add(fd)


def check_message_depth(pool: DescriptorPool, fd: descriptor_pb2.FileDescriptorProto) -> None:
    """SchemaLimit when a message of the file holds messages (field types, references'
    included) nested deeper than ``MAX_TYPE_DEPTH``; each type is measured once. A message
    that contains itself is left to ``MessageShape``, which refuses it per record."""
    memo: dict[str, int] = {}

    def depth(desc: Descriptor, level: int, path: frozenset[str]) -> int:
        if level > MAX_TYPE_DEPTH:
            raise type_depth_limit(level)
        below = 0
        for f in desc.fields:
            inner = f.message_type
            if inner is None or inner.full_name in path:
                continue
            if inner.full_name not in memo:
                memo[inner.full_name] = depth(inner, level + 1, path | {inner.full_name})
            if level + memo[inner.full_name] > MAX_TYPE_DEPTH:
                raise type_depth_limit(level + memo[inner.full_name])
            below = max(below, memo[inner.full_name])
        return 1 + below

    todo = [(fd.package, m) for m in fd.message_type]
    while todo:
        prefix, proto = todo.pop()
        full = f"{prefix}.{proto.name}" if prefix else proto.name
        todo.extend((full, n) for n in proto.nested_type)
        if full not in memo:
            memo[full] = depth(pool.FindMessageTypeByName(full), 1, frozenset({full}))


def _file_proto(text: str, what: str) -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto()
    try:
        fd.ParseFromString(base64.standard_b64decode(text))
    except (ValueError, DecodeError) as e:
        raise ValueError(
            f"{what} is not a serialized FileDescriptorProto (format=serialized): {e}"
        ) from None
    return fd


def _base_pool() -> DescriptorPool:
    pool = DescriptorPool()
    for module in _WELL_KNOWN:
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    return pool
