"""Avro types as Arrow types, both ways, with the logical types exact.

Avro -> Arrow (``avro_shape``; the values are fastavro's, read with ``return_named_type``):

| Avro | Arrow |
|---|---|
| boolean, int, long, float, double | bool, int32, int64, float32, float64 |
| string, enum, uuid (string) | string (an enum as its symbol) |
| bytes, fixed | binary, fixed_size_binary(size) |
| decimal (bytes or fixed) | decimal128(p, s); p > 38: decimal256(p, s) (Spark holds 38 digits) |
| date | date32 |
| time-millis, time-micros | int64, microseconds since midnight (Spark 4's server refuses TIME: ``UNSUPPORTED_TIME_TYPE``) |
| timestamp-millis, -micros, -nanos | timestamp(ms / us / ns, tz=UTC) |
| local-timestamp-millis, -micros, -nanos | timestamp(ms / us / ns), no time zone |
| record | struct (its fields nullable, whatever the schema: see ``decoded``) |
| array, map | list<item>, map<string, value> |
| union [null, X] (either order) | X, nullable |
| other unions | struct with one field per member (named by its type: ``int``, ``string``, a named type's short name), exactly one set; nullable when null is a member |

A recursive record (a type containing itself) has no Arrow type: ``AvroTypeError``.

Arrow -> Avro (``avro_schema_of``, for the encoders): the inverse; int8/16/uint8/16 -> int,
uint32 -> long, a time zone makes a timestamp ``timestamp-*`` (else ``local-timestamp-*``),
nanosecond timestamps and times are written as micros (fastavro writes no nanos from Python
datetimes), a nullable field is ``["null", X]`` with default null, a struct a record named
after its field path.
"""

from __future__ import annotations

import datetime as dt
import decimal
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from conveyor.formats.decoded import Convert, converted

MAX_DECIMAL128 = 38
MAX_DECIMAL256 = 76

_PRIMITIVE: dict[str, pa.DataType] = {
    "boolean": pa.bool_(),
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(),
    "bytes": pa.binary(),
    "null": pa.null(),
}
_TIMESTAMPS = {"millis": "ms", "micros": "us", "nanos": "ns"}


class AvroTypeError(ValueError):
    """An Avro schema with no Arrow shape (a recursive record, a decimal over 76 digits)."""


@dataclass(frozen=True)
class Shape:
    """An Avro type as Arrow: its type, whether it may be null, and the converter of
    fastavro's value into what ``pa.array`` takes (None: taken as it is)."""

    type: pa.DataType
    nullable: bool
    convert: Convert = None


def avro_shape(schema: Any, named: Mapping[str, Any]) -> Shape:
    """The Arrow shape of a parsed Avro schema (``fastavro.parse_schema``; ``named`` its
    ``__named_schemas``). Raises AvroTypeError."""
    return _shape(schema, named, ())


def record_type(schema: Any, named: Mapping[str, Any]) -> tuple[pa.StructType, Convert]:
    """A record schema's row type and converter (the top level of a decoded table)."""
    shape = avro_shape(schema, named)
    if not pa.types.is_struct(shape.type):
        raise AvroTypeError(f"the schema is a {schema!r}, not a record")
    assert isinstance(shape.type, pa.StructType)
    return shape.type, shape.convert


def _shape(schema: Any, named: Mapping[str, Any], seen: tuple[str, ...]) -> Shape:
    if isinstance(schema, str):
        if schema in _PRIMITIVE:
            return Shape(_PRIMITIVE[schema], schema == "null")
        if schema not in named:
            raise AvroTypeError(f"unknown Avro type {schema!r}")
        if schema in seen:
            raise AvroTypeError(f"record {schema!r} contains itself: no Arrow type holds it")
        return _shape(named[schema], named, (*seen, schema))
    if isinstance(schema, list):
        return _union(schema, named, seen)
    kind = schema["type"]
    logical = schema.get("logicalType")
    if logical is not None:
        shape = _logical(schema, kind, logical)
        if shape is not None:
            return shape
    if kind == "record" or kind == "error":
        return _record(schema, named, (*seen, schema["name"]))
    if kind == "enum":
        return Shape(pa.string(), False)
    if kind == "fixed":
        return Shape(pa.binary(int(schema["size"])), False)
    if kind == "array":
        item = _shape(schema["items"], named, seen)
        conv = None if item.convert is None else _each(item.convert)
        return Shape(pa.list_(pa.field("item", item.type, item.nullable)), False, conv)
    if kind == "map":
        value = _shape(schema["values"], named, seen)
        mtype = pa.map_(pa.string(), pa.field("value", value.type, value.nullable))
        conv = None if value.convert is None else _each_value(value.convert)
        return Shape(mtype, False, conv)
    return _shape(kind, named, seen)


def _logical(schema: Mapping[str, Any], kind: str, logical: str) -> Shape | None:
    """The Arrow shape of a logical type, or None for one Avro says to read as its base."""
    if logical == "decimal" and kind in ("bytes", "fixed"):
        p, s = int(schema["precision"]), int(schema.get("scale", 0))
        if p > MAX_DECIMAL256:
            raise AvroTypeError(f"decimal({p}, {s}) is wider than Arrow's {MAX_DECIMAL256} digits")
        dtype = pa.decimal128(p, s) if p <= MAX_DECIMAL128 else pa.decimal256(p, s)
        return Shape(dtype, False)
    if logical == "uuid" and kind in ("string", "fixed"):
        return Shape(pa.string(), False, str)
    if logical == "date" and kind == "int":
        return Shape(pa.date32(), False)
    if logical in ("time-millis", "time-micros") and kind in ("int", "long"):
        # Spark Connect's server refuses TIME columns (UNSUPPORTED_TIME_TYPE, Spark 4.x), so a
        # time of day crosses as its microseconds since midnight.
        return Shape(pa.int64(), False, micros_of_day)
    m = re.fullmatch(r"(local-)?timestamp-(millis|micros|nanos)", logical)
    if m and kind == "long":
        tz = None if m.group(1) else "UTC"
        return Shape(pa.timestamp(_TIMESTAMPS[m.group(2)], tz=tz), False)
    return None  # an unknown logical type: its base type (the Avro specification)


def micros_of_day(t: dt.time) -> int:
    """A time of day as microseconds since midnight (how Avro's time-micros stores it)."""
    return ((t.hour * 60 + t.minute) * 60 + t.second) * 1_000_000 + t.microsecond


def _record(schema: Mapping[str, Any], named: Mapping[str, Any], seen: tuple[str, ...]) -> Shape:
    fields: list[pa.Field] = []
    convs: list[tuple[str, Callable[[Any], Any]]] = []
    for f in schema["fields"]:
        shape = _shape(f["type"], named, seen)
        fields.append(
            pa.field(f["name"], shape.type, True)
        )  # struct fields are all nullable: see STRUCT_FIELDS_NULLABLE in conveyor.formats.decoded
        if shape.convert is not None:
            convs.append((f["name"], shape.convert))
    if not convs:
        return Shape(pa.struct(fields), False)

    def convert(record: dict[str, Any]) -> dict[str, Any]:
        out = dict(record)
        for name, conv in convs:
            out[name] = converted(conv, out.get(name))
        return out

    return Shape(pa.struct(fields), False, convert)


def _each(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda items: [converted(conv, v) for v in items]


def _each_value(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda m: [(k, converted(conv, v)) for k, v in m.items()]


def _untag(value: Any) -> Any:
    """fastavro's (name, value) of a named union member (``return_named_type``), as the value."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        return value[1]
    return value


def _untag_then(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: conv(_untag(v))


def _union(members: list[Any], named: Mapping[str, Any], seen: tuple[str, ...]) -> Shape:
    non_null = [m for m in members if m != "null"]
    has_null = len(non_null) < len(members)
    if len(non_null) == 1:
        inner = _shape(non_null[0], named, seen)
        conv = inner.convert
        if _is_named(non_null[0], named):
            conv = _untag if conv is None else _untag_then(conv)
        return Shape(inner.type, has_null or inner.nullable, conv)
    branches = [(_branch_name(m, named), m, _shape(m, named, seen)) for m in non_null]
    fields = [pa.field(name, shape.type, True) for name, _, shape in branches]
    pick = _branch_picker(branches, named)

    def convert(value: Any) -> dict[str, Any]:
        name, conv, inner = pick(value)
        return {name: converted(conv, inner)}

    return Shape(pa.struct(fields), has_null, convert)


def _is_named(schema: Any, named: Mapping[str, Any]) -> bool:
    if isinstance(schema, str):
        return schema in named
    return isinstance(schema, dict) and schema.get("type") in ("record", "error", "enum", "fixed")


def _full_name(schema: Any) -> str:
    return schema if isinstance(schema, str) else str(schema.get("name"))


def _branch_name(schema: Any, named: Mapping[str, Any]) -> str:
    if _is_named(schema, named):
        return _full_name(schema).rsplit(".", 1)[-1]
    if isinstance(schema, dict):
        return str(schema.get("logicalType") or schema["type"]).replace("-", "_")
    return str(schema)


# Which Python values (as fastavro returns them) belong to an unnamed union member.
def _value_fits(schema: Any, value: Any) -> bool:
    kind = schema if isinstance(schema, str) else schema.get("type")
    logical = None if isinstance(schema, str) else schema.get("logicalType")
    if logical == "decimal":
        return isinstance(value, decimal.Decimal)
    if logical == "uuid":
        return isinstance(value, uuid.UUID)
    if logical == "date":
        return isinstance(value, dt.date) and not isinstance(value, dt.datetime)
    if logical in ("time-millis", "time-micros"):
        return isinstance(value, dt.time)
    if logical is not None and "timestamp" in logical and isinstance(value, dt.datetime):
        return (value.tzinfo is None) == logical.startswith("local-")
    checks: dict[str, Callable[[Any], bool]] = {
        "boolean": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "long": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, float),
        "double": lambda v: isinstance(v, float),
        "string": lambda v: isinstance(v, str),
        "bytes": lambda v: isinstance(v, bytes),
        "array": lambda v: isinstance(v, list),
        "map": lambda v: isinstance(v, dict),
    }
    check = checks.get(str(kind))
    return bool(check and check(value))


def _branch_picker(
    branches: list[tuple[str, Any, Shape]], named: Mapping[str, Any]
) -> Callable[[Any], tuple[str, Convert, Any]]:
    by_name = {
        _full_name(m): (name, shape.convert) for name, m, shape in branches if _is_named(m, named)
    }

    def pick(value: Any) -> tuple[str, Convert, Any]:
        if isinstance(value, tuple) and len(value) == 2 and value[0] in by_name:
            name, conv = by_name[value[0]]
            return name, conv, value[1]
        for name, member, shape in branches:
            if not _is_named(member, named) and _value_fits(member, value):
                return name, shape.convert, value
        raise ValueError(f"no member of the union holds a {type(value).__name__}")

    return pick


# -- Arrow -> Avro ------------------------------------------------------------------------------

_AVRO_NAME = re.compile(r"[^A-Za-z0-9_]")


def avro_name(text: str) -> str:
    """``text`` as an Avro name ([A-Za-z_][A-Za-z0-9_]*)."""
    name = _AVRO_NAME.sub("_", text) or "_"
    return name if not name[0].isdigit() else f"_{name}"


def avro_schema_of(schema: pa.Schema, name: str, namespace: str = "conveyor") -> dict[str, Any]:
    """An Avro record schema for rows of ``schema`` (the inverse of ``avro_shape``)."""
    fields = [_avro_field(f, avro_name(name)) for f in schema]
    return {"type": "record", "name": avro_name(name), "namespace": namespace, "fields": fields}


def _avro_field(f: pa.Field, path: str) -> dict[str, Any]:
    avro = _avro_type(f.type, f"{path}_{avro_name(f.name)}")
    if f.nullable:
        return {"name": f.name, "type": ["null", avro], "default": None}
    return {"name": f.name, "type": avro}


def _avro_type(t: pa.DataType, path: str) -> Any:
    simple = _avro_simple(t)
    if simple is not None:
        return simple
    if pa.types.is_decimal(t):
        return {
            "type": "bytes",
            "logicalType": "decimal",
            "precision": t.precision,
            "scale": t.scale,
        }
    if pa.types.is_timestamp(t):
        unit = "millis" if t.unit in ("s", "ms") else "micros"
        prefix = "timestamp" if t.tz is not None else "local-timestamp"
        return {"type": "long", "logicalType": f"{prefix}-{unit}"}
    if pa.types.is_time32(t):
        return {"type": "int", "logicalType": "time-millis"}
    if pa.types.is_time64(t):
        return {"type": "long", "logicalType": "time-micros"}
    if pa.types.is_fixed_size_binary(t):
        return {"type": "fixed", "name": avro_name(path), "size": t.byte_width}
    if pa.types.is_map(t):
        if not pa.types.is_string(t.key_type) and not pa.types.is_large_string(t.key_type):
            raise AvroTypeError(f"map keys of type {t.key_type}: Avro maps have string keys")
        return {"type": "map", "values": _nullable(t.item_field, f"{path}_value")}
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return {"type": "array", "items": _nullable(t.value_field, f"{path}_item")}
    if pa.types.is_struct(t):
        fields = [_avro_field(t.field(i), path) for i in range(t.num_fields)]
        return {"type": "record", "name": avro_name(path), "fields": fields}
    if pa.types.is_dictionary(t):
        return _avro_type(t.value_type, path)
    raise AvroTypeError(f"Arrow type {t} has no Avro type")


def _nullable(f: pa.Field, path: str) -> Any:
    inner = _avro_type(f.type, path)
    return ["null", inner] if f.nullable else inner


def _avro_simple(t: pa.DataType) -> str | dict[str, str] | None:
    if pa.types.is_boolean(t):
        return "boolean"
    if t in (pa.int8(), pa.int16(), pa.int32(), pa.uint8(), pa.uint16()):
        return "int"
    if t in (pa.int64(), pa.uint32()):
        return "long"
    if t in (pa.float16(), pa.float32()):
        return "float"
    if t == pa.float64():
        return "double"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "bytes"
    if pa.types.is_date(t):
        return {"type": "int", "logicalType": "date"}
    return None
