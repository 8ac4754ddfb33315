"""Rows of an Arrow table as Confluent-framed Avro, Protobuf or JSON Schema records, for the Kafka sink.

``payload_encoder`` builds an ``Encoder``; ``encode(table, topic)`` returns one payload per
row, written by confluent-kafka's own ``AvroSerializer`` / ``JSONSerializer`` (so Confluent's
deserializers read them), with the subject from the name strategy (``topic``:
``<topic>-value``; ``record``: the record's full name; ``topic_record``:
``<topic>-<record>``), registering the schema (``auto_register``) or using the subject's
latest version (``use_latest_version``). Without a schema, one is derived from the table's
Arrow schema: Avro as ``conveyor.formats.avro_arrow.avro_schema_of`` says (record
``conveyor.<topic>``); JSON Schema with object -> struct, list -> array, map -> object with
additionalProperties, integers -> integer, floats -> number, decimal -> string (exact),
timestamp -> string date-time, date -> string date, binary -> string (base64).

Protobuf (``ProtobufEncoder``) writes with the subject's latest registered schema: its message
class is built from the registry's serialized descriptor (confluent-kafka's
``ProtobufSerializer`` takes a message class, and no ``.proto`` compiler runs here), each row
filled in by protobuf's ``json_format.ParseDict``.

Failures: a registry outage raises ``TransientSinkError``, refused credentials
``ConfigError`` (``conveyor.formats.registry``); a row its schema does not allow raises
``EncodeError`` carrying the row's index.
"""

from __future__ import annotations

import abc
import base64
import datetime as dt
import decimal
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import pyarrow as pa
from confluent_kafka.schema_registry import (
    record_subject_name_strategy,
    topic_record_subject_name_strategy,
    topic_subject_name_strategy,
)
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from conveyor.core.errors import ConfigError
from conveyor.core.schema_registry import SchemaRegistrySpec
from conveyor.formats.avro_arrow import AvroTypeError, avro_schema_of
from conveyor.formats.limits import SchemaLimit, SchemaName, schema_error
from conveyor.formats.registry import Registry, UnknownSchema, registry_error

SubjectStrategy = Literal["topic", "record", "topic_record"]
STRATEGIES: dict[str, Callable[..., Any]] = {
    "topic": topic_subject_name_strategy,
    "record": record_subject_name_strategy,
    "topic_record": topic_record_subject_name_strategy,
}


class EncodeError(ValueError):
    """A row its schema does not allow; ``row`` is its index in the table."""

    def __init__(self, message: str, *, row: int):
        super().__init__(message)
        self.row = row


class Encoder(Protocol):
    """Encodes a table's rows for a topic: one payload per row, in order."""

    def encode(self, table: pa.Table, topic: str) -> list[bytes]: ...


def python_rows(table: pa.Table) -> list[dict[str, Any]]:
    """A table's rows as Python values, maps as dicts (Arrow gives them as pair lists)."""
    fix = {f.name: _map_fixer(f.type) for f in table.schema}
    fixers = {k: v for k, v in fix.items() if v is not None}
    rows: list[dict[str, Any]] = table.to_pylist()
    if fixers:
        for row in rows:
            for name, fn in fixers.items():
                if row[name] is not None:
                    row[name] = fn(row[name])
    return rows


def _map_fixer(t: pa.DataType) -> Callable[[Any], Any] | None:
    if pa.types.is_map(t):
        inner = _map_fixer(t.item_type)
        return lambda pairs: {k: (inner(v) if inner and v is not None else v) for k, v in pairs}
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        item = _map_fixer(t.value_type)
        return None if item is None else (lambda xs: [None if x is None else item(x) for x in xs])
    if pa.types.is_struct(t):
        subs = {t.field(i).name: _map_fixer(t.field(i).type) for i in range(t.num_fields)}
        subs_set = {k: v for k, v in subs.items() if v is not None}
        if not subs_set:
            return None
        return lambda d: {
            k: (subs_set[k](v) if k in subs_set and v is not None else v) for k, v in d.items()
        }
    return None


class _SerializingEncoder(abc.ABC):
    """Shared by both formats: one confluent serializer per (topic, Arrow schema)."""

    def __init__(self, registry: Registry, conf: dict[str, Any], schema: str | None):
        self.registry, self.conf, self.schema = registry, conf, schema
        self._serializers: dict[tuple[str, pa.Schema], Any] = {}

    @abc.abstractmethod
    def make(self, schema: str | None) -> Any:
        """The format's confluent serializer for ``schema`` (None: the subject's latest)."""

    @abc.abstractmethod
    def derive(self, arrow: pa.Schema, topic: str) -> str:
        """A writer schema for rows of ``arrow`` (no schema given)."""

    def prepare(self, row: dict[str, Any]) -> Any:
        return row

    def encode(self, table: pa.Table, topic: str) -> list[bytes]:
        key = (topic, table.schema)
        ser = self._serializers.get(key)
        if ser is None:
            use_latest = self.conf.get("use.latest.version") and self.schema is None
            schema = self.schema or (None if use_latest else self.derive(table.schema, topic))
            ser = self._serializers[key] = self.make(schema)
        ctx = SerializationContext(topic, MessageField.VALUE)
        out: list[bytes] = []
        for i, row in enumerate(python_rows(table)):
            try:
                out.append(ser(self.prepare(row), ctx))
            except SchemaRegistryError as e:
                raise registry_error(
                    e, self.registry.spec, prefix=self.registry.prefix, what=f"topic {topic!r}"
                ) from None
            except Exception as e:
                classified = registry_error(
                    e, self.registry.spec, prefix=self.registry.prefix, what=f"topic {topic!r}"
                )
                if classified is not e:
                    raise classified from None
                raise EncodeError(f"row {i}: {type(e).__name__}: {e}", row=i) from None
        return out


class AvroEncoder(_SerializingEncoder):
    """Rows as Avro through confluent-kafka's AvroSerializer."""

    def make(self, schema: str | None) -> Any:
        return AvroSerializer(self.registry.client, schema, conf=self.conf)

    def derive(self, arrow: pa.Schema, topic: str) -> str:
        try:
            return json.dumps(avro_schema_of(arrow, topic))
        except AvroTypeError as e:
            raise ConfigError(f"no Avro schema for the rows: {e}", field="schema") from None


class JsonSchemaEncoder(_SerializingEncoder):
    """Rows as JSON through confluent-kafka's JSONSerializer (validated against the schema)."""

    def __init__(self, registry: Registry, conf: dict[str, Any], schema: str | None):
        super().__init__(registry, conf, schema)
        self._node: Any = json.loads(schema) if schema else None

    def make(self, schema: str | None) -> Any:
        if schema is not None and self._node is None:
            self._node = json.loads(schema)
        return JSONSerializer(schema, self.registry.client, conf=self.conf)

    def derive(self, arrow: pa.Schema, topic: str) -> str:
        fields = {f.name: _json_field(f) for f in arrow}
        required = [f.name for f in arrow if not f.nullable]
        schema = {"$schema": "http://json-schema.org/draft-07/schema#", "title": topic}
        schema.update({"type": "object", "properties": fields})  # type: ignore[dict-item]
        if required:
            schema["required"] = required  # type: ignore[assignment]
        return json.dumps(schema)

    def prepare(self, row: dict[str, Any]) -> Any:
        return to_json_value(row, self._node or {})


class ProtobufEncoder:
    """Rows as Protobuf through confluent-kafka's ProtobufSerializer. The writer schema is the
    subject's latest registered version (Protobuf schemas come from ``.proto`` files, registered
    by whoever owns them; no ``.proto`` compiler runs here): its message ``message`` (or the
    file's first) built from the registry's serialized descriptor, each row filled in by
    protobuf's own ``json_format.ParseDict``."""

    def __init__(self, registry: Registry, conf: dict[str, Any], message: str | None):
        self.registry, self.conf, self.message = registry, conf, message
        self._serializers: dict[str, tuple[Any, type[Any]]] = {}

    def _serializer(self, topic: str) -> tuple[Any, type[Any]]:
        found = self._serializers.get(topic)
        if found is None:
            from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

            from conveyor.formats.protobuf import SERIALIZED, writer_of

            strategy = self.conf["subject.name.strategy"]
            subject = strategy(SerializationContext(topic, MessageField.VALUE), self.message)
            try:
                latest = self.registry.latest(subject, SERIALIZED)
                cls = writer_of(self.registry, latest.schema, f"subject {subject!r}").message_class(
                    self.message
                )
            except (UnknownSchema, ValueError) as e:
                raise ConfigError(
                    f"no usable Protobuf schema for topic {topic!r}: {e}",
                    field="sink.value_message",
                ) from None
            except (SchemaLimit, RecursionError) as e:
                name = SchemaName(None, ((subject, int(latest.version or 0)),))
                raise schema_error(name, e, field="sink.value_message") from None
            conf = {**self.conf, "use.deprecated.format": False}
            found = self._serializers[topic] = (
                ProtobufSerializer(cls, self.registry.client, conf),
                cls,
            )
        return found

    def encode(self, table: pa.Table, topic: str) -> list[bytes]:
        from google.protobuf.json_format import ParseDict, ParseError

        ser, cls = self._serializer(topic)
        ctx = SerializationContext(topic, MessageField.VALUE)
        out: list[bytes] = []
        for i, row in enumerate(python_rows(table)):
            try:
                msg = ParseDict(_set_fields(to_json_value(row, {})), cls())
            except (ParseError, ValueError, TypeError) as e:
                raise EncodeError(
                    f"row {i}: not a {cls.DESCRIPTOR.full_name}: {e}", row=i
                ) from None
            try:
                out.append(ser(msg, ctx))
            except Exception as e:  # noqa: BLE001 - classified: an outage, credentials or the row
                classified = registry_error(
                    e, self.registry.spec, prefix=self.registry.prefix, what=f"topic {topic!r}"
                )
                if classified is not e:
                    raise classified from None
                raise EncodeError(f"row {i}: {type(e).__name__}: {e}", row=i) from None
        return out


def _set_fields(value: Any) -> Any:
    """A JSON value without its null members: in Protobuf a null is a field left unset."""
    if isinstance(value, dict):
        return {k: _set_fields(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_set_fields(v) for v in value]
    return value


def _json_field(f: pa.Field) -> dict[str, Any]:
    node = _json_type(f.type)
    if f.nullable and "type" in node:
        node = {**node, "type": [node["type"], "null"]}
    return node


def _json_type(t: pa.DataType) -> dict[str, Any]:
    if pa.types.is_boolean(t):
        return {"type": "boolean"}
    if pa.types.is_integer(t):
        return {"type": "integer"}
    if pa.types.is_floating(t):
        return {"type": "number"}
    if pa.types.is_timestamp(t):
        return {"type": "string", "format": "date-time"}
    if pa.types.is_date(t):
        return {"type": "string", "format": "date"}
    if pa.types.is_map(t):
        return {"type": "object", "additionalProperties": _json_field(t.item_field)}
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return {"type": "array", "items": _json_field(t.value_field)}
    if pa.types.is_struct(t):
        fields = [t.field(i) for i in range(t.num_fields)]
        node: dict[str, Any] = {
            "type": "object",
            "properties": {f.name: _json_field(f) for f in fields},
        }
        required = [f.name for f in fields if not f.nullable]
        if required:
            node["required"] = required
        return node
    return {"type": "string"}  # strings, decimals (exact), binary (base64), times


def _json_types(node: Any) -> set[str]:
    if not isinstance(node, Mapping):
        return set()
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t or [])


def to_json_value(value: Any, node: Any) -> Any:
    """A Python value as JSON data, guided by its JSON Schema ``node`` where it matters (a
    decimal is a number where the schema says number or integer, else exact text)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, decimal.Decimal):
        types = _json_types(node)
        if "integer" in types and value == value.to_integral_value():
            return int(value)
        return float(value) if "number" in types else str(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, Mapping):
        props = node.get("properties", {}) if isinstance(node, Mapping) else {}
        extra = node.get("additionalProperties", {}) if isinstance(node, Mapping) else {}
        return {k: to_json_value(v, props.get(k, extra)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = node.get("items", {}) if isinstance(node, Mapping) else {}
        return [to_json_value(v, items) for v in value]
    return str(value)


def payload_encoder(
    fmt: Literal["avro", "protobuf", "json_schema"],
    registry: SchemaRegistrySpec,
    subject_strategy: SubjectStrategy,
    auto_register: bool,
    use_latest_version: bool,
    schema: str | None,
    *,
    message: str | None = None,
    prefix: str = "sink",
) -> Encoder:
    """The encoder of rows into ``fmt`` (see the module). ConfigError for settings that
    cannot work (Protobuf, both auto_register and use_latest_version, a schema that does
    not parse)."""
    if fmt == "protobuf" and (auto_register or not use_latest_version or schema is not None):
        raise ConfigError(
            "protobuf writes with the subject's latest registered schema: set auto_register: "
            "false and use_latest_version: true (and no value_schema; value_message names the "
            "message)",
            field=f"{prefix}.use_latest_version",
        )
    if auto_register and use_latest_version:
        raise ConfigError(
            "auto_register and use_latest_version exclude each other",
            field=f"{prefix}.auto_register",
        )
    if subject_strategy not in STRATEGIES:
        raise ConfigError(
            f"{subject_strategy!r}: one of {', '.join(STRATEGIES)}",
            field=f"{prefix}.subject_strategy",
        )
    if schema is not None:
        try:
            json.loads(schema)
        except ValueError as e:
            raise ConfigError(f"not JSON: {e}", field=f"{prefix}.schema") from None
    client = Registry(registry, prefix=f"{prefix}.schema_registry")
    conf = {
        "auto.register.schemas": auto_register,
        "use.latest.version": use_latest_version,
        "subject.name.strategy": STRATEGIES[subject_strategy],
    }
    if fmt == "avro":
        return AvroEncoder(client, conf, schema)
    if fmt == "json_schema":
        return JsonSchemaEncoder(client, conf, schema)
    if fmt == "protobuf":
        return ProtobufEncoder(client, conf, message)
    raise ConfigError(
        f"unknown format {fmt!r}: avro, protobuf or json_schema", field=f"{prefix}.format"
    )
