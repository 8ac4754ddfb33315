"""JSON Schema payloads into Arrow: Confluent-framed JSON, validated against the writer's schema.

The writer schema is read from the registry by the record's id (cached), with its references
(``$ref`` to other subjects, resolved by their ``name`` through ``referencing``); each record
is validated by ``jsonschema`` (the draft its ``$schema`` names, else draft 7, as
confluent-kafka's ``JSONDeserializer`` does). A record that does not validate is a failed row
naming the first error's path (``$.items[2].qty: -1 is less than the minimum of 0``).

The Arrow type comes from the schema (``json_shape``): object with properties -> struct
(every property nullable, required or not: see ``decoded``; ``required`` is checked by
validation), object with only ``additionalProperties``
-> map<string, V>, array -> list, integer -> int64, number -> float64, boolean -> bool,
string -> string, except ``format: date-time`` -> timestamp(us, UTC) and ``format: date`` ->
date32; a type list with ``"null"`` is nullable; anything else (no type, several types,
``oneOf``/``anyOf``) -> string holding the value's JSON text. ``$ref`` is followed.
Records of several writer versions land in one table whose columns are the union of the
versions' top-level properties, in the order first seen.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
import pyarrow as pa
from referencing import Registry as RefRegistry
from referencing import Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT7

from conveyor.formats.caches import LruCache
from conveyor.formats.decoded import (
    Convert,
    Decoded,
    converted,
    decode_each,
)
from conveyor.formats.frame import FrameError, read_frame
from conveyor.formats.limits import (
    ReferenceWalk,
    SchemaLimit,
    check_schema_text,
    record_nesting_problem,
    schema_error,
)
from conveyor.formats.registry import Registry, UnknownSchema

MAX_DEPTH = 32


@dataclass(frozen=True)
class JsonShape:
    """A JSON Schema as Arrow: type, nullability and the converter of a parsed JSON value."""

    type: pa.DataType
    nullable: bool
    convert: Convert = None


def _datetime(value: Any) -> dt.datetime:
    parsed = dt.datetime.fromisoformat(str(value))
    if parsed.tzinfo is None:
        raise ValueError(
            f"{value!r} is a date-time without a time zone offset (RFC 3339 needs one)"
        )
    return parsed


def _date(value: Any) -> dt.date:
    return dt.date.fromisoformat(str(value))


def json_shape(schema: Any, resolver: Any, depth: int = 0) -> JsonShape:
    """The Arrow shape of a JSON Schema (``resolver`` follows ``$ref``; a ``referencing``
    resolver). Beyond ``MAX_DEPTH`` (a recursive schema) a value is kept as JSON text."""
    if depth > MAX_DEPTH or not isinstance(schema, Mapping):
        return JsonShape(pa.string(), True, json.dumps)
    if "$ref" in schema:
        resolved = resolver.lookup(schema["$ref"])
        return json_shape(resolved.contents, resolved.resolver, depth + 1)
    types = schema.get("type")
    names = [types] if isinstance(types, str) else list(types or [])
    nullable = "null" in names
    names = [n for n in names if n != "null"]
    if len(names) != 1 or any(k in schema for k in ("oneOf", "anyOf", "allOf")):
        return JsonShape(pa.string(), True, json.dumps)
    kind = names[0]
    if kind == "object":
        return _object(schema, resolver, depth, nullable)
    if kind == "array":
        item = json_shape(schema.get("items", {}), resolver, depth + 1)
        conv = None if item.convert is None else _each(item.convert)
        return JsonShape(pa.list_(pa.field("item", item.type, item.nullable)), nullable, conv)
    if kind == "string":
        fmt = schema.get("format")
        if fmt == "date-time":
            return JsonShape(pa.timestamp("us", tz="UTC"), nullable, _datetime)
        if fmt == "date":
            return JsonShape(pa.date32(), nullable, _date)
        return JsonShape(pa.string(), nullable)
    simple = {"integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}
    if kind in simple:
        return JsonShape(simple[kind], nullable, float if kind == "number" else None)
    return JsonShape(pa.string(), True, json.dumps)


def _object(schema: Mapping[str, Any], resolver: Any, depth: int, nullable: bool) -> JsonShape:
    props = schema.get("properties")
    if not props:
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping) and extra:
            value = json_shape(extra, resolver, depth + 1)
            mtype = pa.map_(pa.string(), pa.field("value", value.type, value.nullable))
            vconv = value.convert
            return JsonShape(
                mtype, nullable, lambda m: [(k, converted(vconv, v)) for k, v in m.items()]
            )
        return JsonShape(pa.string(), True, json.dumps)
    fields: list[pa.Field] = []
    convs: list[tuple[str, Callable[[Any], Any] | None]] = []
    for name, sub in props.items():
        shape = json_shape(sub, resolver, depth + 1)
        fields.append(
            pa.field(name, shape.type, True)
        )  # struct fields are all nullable: see STRUCT_FIELDS_NULLABLE in conveyor.formats.decoded
        convs.append((name, shape.convert))

    def convert(obj: Mapping[str, Any]) -> dict[str, Any]:
        return {name: converted(conv, obj.get(name)) for name, conv in convs}

    return JsonShape(pa.struct(fields), nullable, convert)


def _each(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda items: [converted(conv, v) for v in items]


def error_path(error: jsonschema.ValidationError) -> str:
    """A validation error as ``$.a.b[2]: message``."""
    path = "$"
    for part in error.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return f"{path}: {error.message}"


class _Writer:
    """A writer schema: its validator and Arrow shape."""

    def __init__(self, schema: Any, refs: RefRegistry):
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
        cls.check_schema(schema)
        resource = Resource.from_contents(schema, default_specification=DRAFT7)
        registry = refs.with_resource(str(schema.get("$id", "")), resource)
        self.validator = cls(schema, registry=registry)
        shape = json_shape(schema, registry.resolver_with_root(resource))
        if not pa.types.is_struct(shape.type) or shape.convert is None:
            raise ValueError("the schema is not an object with properties")
        self.row_type: pa.StructType = shape.type
        self.convert: Callable[[Any], Any] = shape.convert


class JsonSchemaDecoder:
    """Confluent-framed JSON records, validated against the writer schemas from the registry."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._writers: LruCache[int, _Writer] = LruCache(registry.spec.cache_capacity)

    def decode(self, values: Any) -> Decoded:
        problems: dict[int, str] = {}  # schema id -> why its records fail (this batch)
        return decode_each(values, lambda value: self._record(value, problems))

    def _record(self, value: bytes, problems: dict[int, str]) -> str | tuple[dict[str, Any], Any]:
        """(the record, its writer's row type), or why it failed."""
        try:
            frame = read_frame(value)
        except FrameError as e:
            return str(e)
        writer = self._writer(frame.schema_id, problems)
        if writer is None:
            return problems[frame.schema_id]
        too_deep = record_nesting_problem(frame.payload)
        if too_deep is not None:
            return too_deep
        try:
            doc = json.loads(frame.payload)
        except (ValueError, UnicodeDecodeError) as e:
            return f"not JSON: {e}"
        try:
            error = jsonschema.exceptions.best_match(writer.validator.iter_errors(doc))
            if error is not None:
                return f"does not validate against schema id {frame.schema_id}: {error_path(error)}"
            return writer.convert(doc), writer.row_type
        except (ValueError, TypeError) as e:
            return f"not convertible to Arrow: {e}"
        except RecursionError:  # a schema's $ref chain deeper than jsonschema recurses
            return f"nested deeper than schema id {frame.schema_id} can be validated"

    def _writer(self, sid: int, problems: dict[int, str]) -> _Writer | None:
        if sid in problems:
            return None
        cached = self._writers.get(sid)
        if cached is not None:
            return cached
        try:
            schema = self.registry.schema(sid)
            if schema.schema_type != "JSON":
                raise ValueError(f"schema id {sid} is a {schema.schema_type} schema, not JSON")
            refs = self._references(schema.references or [], RefRegistry(), ReferenceWalk())
            text = schema.schema_str or ""
            check_schema_text(text, json_text=True)
            writer = _Writer(json.loads(text), refs)
        except UnknownSchema as e:
            problems[sid] = str(e)
        except (ValueError, TypeError, Unresolvable, jsonschema.SchemaError) as e:
            problems[sid] = f"schema id {sid} is not a usable JSON Schema: {e}"
        except (SchemaLimit, RecursionError) as e:
            name = self.registry.schema_name(sid)
            raise schema_error(name, e, field=self.registry.prefix) from None
        else:
            self._writers.put(sid, writer)
            return writer
        return None

    def _references(self, refs: list[Any], known: RefRegistry, walk: ReferenceWalk) -> RefRegistry:
        for ref in refs:
            with walk.enter(ref.subject, ref.version) as new:
                if not new:
                    continue
                found = self.registry.version(ref.subject, ref.version)
                text = found.schema.schema_str or ""
                check_schema_text(text, json_text=True)
                known = self._references(found.schema.references or [], known, walk)
                resource = Resource.from_contents(json.loads(text), default_specification=DRAFT7)
                known = known.with_resource(ref.name, resource)
        return known
