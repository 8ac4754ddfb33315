"""Avro payloads into Arrow: Confluent-framed records with a registry, or plain Avro with a schema file.

Each record is read by fastavro's ``schemaless_reader(payload, writer, reader)``: the writer
schema is the one the record's frame names (looked up by id once, parsed once, cached), the
reader schema the one shape every record of the batch decodes into, so records written with
several schema versions land in one table (fields added with a default appear, removed ones
go, as Avro's schema resolution says). The reader schema is:

- the ``reader_schema`` given (Avro schema JSON text); or
- ``latest``: the subject's newest version, asked again when a batch holds a record whose
  writer id is newer (greater) than the reader's, so a field added mid-stream is a column
  from the batch that first carries it; or
- none given: the newest writer schema seen so far (the greatest id), so the shape only
  grows as newer writers appear, and older records read with it (their missing fields get
  the newer schema's defaults).

A record the reader schema cannot read (an incompatible change) is a failed row naming
fastavro's reason. Types map as ``conveyor.formats.avro_arrow`` says.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import fastavro
from fastavro.read import SchemaResolutionError
from fastavro.schema import SchemaParseException

from conveyor.core.errors import ConfigError
from conveyor.core.trust import paths
from conveyor.formats.avro_arrow import AvroTypeError, record_type
from conveyor.formats.caches import LruCache
from conveyor.formats.decoded import Convert, Decoded, converted, payloads, table_of_records
from conveyor.formats.frame import FrameError, read_frame
from conveyor.formats.limits import (
    MAX_TYPE_DEPTH,
    ReferenceWalk,
    SchemaLimit,
    SchemaName,
    check_schema_text,
    schema_error,
    type_depth_limit,
)
from conveyor.formats.registry import Registry, UnknownSchema

LATEST = "latest"


class ParsedSchema:
    """A parsed Avro schema with its named types, its Arrow row type and converter."""

    def __init__(self, raw: Any, named: dict[str, Any] | None = None):
        self.named: dict[str, Any] = dict(named or {})
        self.parsed = fastavro.parse_schema(raw, named_schemas=self.named)
        check_type_depth(self.parsed, self.named)  # before record_type recurses through it
        self.row_type, self.convert = record_type(self.parsed, self.named)


def check_type_depth(schema: Any, named: dict[str, Any]) -> None:
    """SchemaLimit when records, arrays and maps nest deeper than ``MAX_TYPE_DEPTH``, named
    types (from references too) followed; each named type is measured once. A type that
    contains itself is left to ``record_type``, which refuses it."""
    memo: dict[str, int] = {}

    def depth(node: Any, level: int, path: frozenset[str]) -> int:
        if level > MAX_TYPE_DEPTH:
            raise type_depth_limit(level)
        if isinstance(node, list):  # a union
            return max((depth(m, level, path) for m in node), default=0)
        if isinstance(node, str):
            if node not in named or node in path:
                return 0
            if node not in memo:
                memo[node] = depth(named[node], level, path | {node})
            if level + memo[node] > MAX_TYPE_DEPTH:
                raise type_depth_limit(level + memo[node])
            return memo[node]
        if not isinstance(node, dict):
            return 0
        kind = node.get("type")
        if isinstance(kind, (dict, list)):
            return depth(kind, level, path)
        name = node.get("name")
        inner = {"array": [node.get("items")], "map": [node.get("values")]}.get(str(kind))
        if kind in ("record", "error"):
            inner = [f.get("type") for f in node.get("fields") or []]
            path = path | {name} if isinstance(name, str) else path
        if inner is None:
            return 0
        below = 1 + max((depth(t, level + 1, path) for t in inner), default=0)
        if kind in ("record", "error") and isinstance(name, str):
            memo[name] = below
        return below

    depth(schema, 1, frozenset())


def parse_avro(text: str, *, what: str, named: dict[str, Any] | None = None) -> ParsedSchema:
    """``text`` (Avro schema JSON) parsed; ValueError naming ``what`` when it is not one
    (SchemaLimit when it is beyond the limits, ``conveyor.formats.limits``)."""
    check_schema_text(text, json_text=True)
    try:
        return ParsedSchema(json.loads(text), named)
    except AvroTypeError as e:
        raise ValueError(f"{what} has no Arrow shape: {e}") from None
    except (ValueError, TypeError, KeyError, fastavro.schema.SchemaParseException) as e:
        raise ValueError(f"{what} is not an Avro schema: {e}") from None


def schema_file_text(path: str, *, field: str) -> str:
    """The text of an Avro schema file, resolved under a root as it is opened
    (``core.trust.paths``: a spec may not make the run read any file of its host, nor a secret);
    ConfigError naming ``field``, raised outside any handler so that no exception holding
    the file's bytes rides along as its context."""
    real = paths.resolve(path, field=field)
    try:
        data = Path(real).read_bytes()
    except OSError as e:
        raise ConfigError(f"{path!r} cannot be read: {e.strerror}", field=field) from None
    try:
        return data.decode()
    except UnicodeDecodeError:
        pass
    raise ConfigError(f"{path!r} is not UTF-8 text", field=field)


def load_schema_file(path: str, *, field: str) -> ParsedSchema:
    """The Avro schema in the file ``path`` (``schema_file_text``). A file that is not one is
    a ConfigError saying where and what kind of problem, never quoting the file: it may be
    any file a root holds, and the error reaches the connector's status. Raised outside the
    handlers: the parser's exception (which holds the document) is not its context."""
    text = schema_file_text(path, field=field)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:  # its msg is fixed text, never the document's
        problem = f"is not JSON: {e.msg} at line {e.lineno}, column {e.colno}"
    else:
        try:
            return ParsedSchema(raw)
        except (ValueError, TypeError, KeyError, AttributeError, SchemaParseException) as e:
            problem = (  # AvroTypeError (no Arrow shape) is a ValueError
                f"is JSON but not an Avro schema with an Arrow shape ({type(e).__name__}; the "
                "file's content is not shown: check it with fastavro.schema.load_schema)"
            )
    raise ConfigError(f"{path!r} {problem}", field=field)


class AvroDecoder:
    """Confluent-framed Avro with a registry, or (``schema_file``) plain Avro binary."""

    def __init__(
        self,
        registry: Registry | None,
        reader_schema: str | None,
        subject: str | None,
        schema_file: str | None,
        *,
        prefix: str = "transform",
    ):
        self.registry, self.subject, self.prefix = registry, subject, prefix
        self.latest = reader_schema == LATEST
        self._fixed = reader_schema is not None and not self.latest  # a reader schema given
        self._checked_id = -1  # the newest writer id the latest version was asked for
        capacity = registry.spec.cache_capacity if registry is not None else 1
        self._writers: LruCache[int, ParsedSchema] = LruCache(capacity)  # parsed, by id
        self._reader: ParsedSchema | None = None
        self._reader_id = -1
        self._file: ParsedSchema | None = None
        if reader_schema is not None and not self.latest:
            self._reader = _config_schema(reader_schema, field=f"{prefix}.reader_schema")
        if schema_file is not None:
            self._file = load_schema_file(schema_file, field=f"{prefix}.schema_file")
        elif registry is None:
            raise ConfigError("decode avro needs schema_registry or schema_file", field=prefix)
        if self.latest and not subject:
            raise ConfigError("reader_schema latest needs the subject", field=f"{prefix}.subject")

    def decode(self, values: Any) -> Decoded:
        raw = payloads(values)
        failed: dict[int, str] = {}
        if self._file is not None:
            return self._decode_plain(raw, self._file, failed)
        frames: list[tuple[int, bytes] | None] = []
        for i, value in enumerate(raw):
            try:
                framed = read_frame(value)
                frames.append((framed.schema_id, framed.payload))
            except FrameError as e:
                frames.append(None)
                failed[i] = str(e)
        writers, problems = self._load_writers({f[0] for f in frames if f is not None})
        reader = self._choose_reader(writers)
        records: list[dict[str, Any] | None] = []
        for i, entry in enumerate(frames):
            record = None
            if entry is not None:
                sid, payload = entry
                if sid in problems:
                    failed[i] = problems[sid]
                else:
                    record = self._read(i, payload, writers[sid], reader, failed)
            records.append(record)
        assert reader is not None or not writers
        row_type = reader.row_type if reader is not None else _EMPTY.row_type
        return Decoded(table_of_records(records, row_type, failed), failed)

    def _decode_plain(
        self, raw: list[bytes], writer: ParsedSchema, failed: dict[int, str]
    ) -> Decoded:
        reader = self._reader or writer
        records = [self._read(i, v, writer, reader, failed) for i, v in enumerate(raw)]
        return Decoded(table_of_records(records, reader.row_type, failed), failed)

    def _read(
        self,
        i: int,
        payload: bytes,
        writer: ParsedSchema,
        reader: ParsedSchema | None,
        failed: dict[int, str],
    ) -> dict[str, Any] | None:
        reader = reader or writer
        buf = io.BytesIO(payload)
        try:
            value = fastavro.schemaless_reader(
                buf,
                writer.parsed,
                None if reader is writer else reader.parsed,
                return_named_type=True,
            )
        except SchemaResolutionError as e:
            failed[i] = f"not readable with the reader schema: {e}"
            return None
        except Exception as e:  # fastavro raises what its reading hits (EOFError, ValueError...)
            failed[i] = f"not Avro of its writer schema: {type(e).__name__}: {e}"
            return None
        if buf.tell() != len(payload):
            failed[i] = (
                f"not Avro of its writer schema: {len(payload) - buf.tell()} bytes left over"
            )
            return None
        return _convert_record(i, value, reader.convert, failed)

    def _load_writers(self, ids: set[int]) -> tuple[dict[int, ParsedSchema], dict[int, str]]:
        """The batch's writer schemas (cached, else fetched and parsed) by id, and the ids
        that failed -> why. A writer schema beyond the limits is a ConfigError naming it."""
        assert self.registry is not None
        problems: dict[int, str] = {}
        writers: dict[int, ParsedSchema] = {}
        for sid in sorted(ids):
            cached = self._writers.get(sid)
            if cached is not None:
                writers[sid] = cached
                continue
            try:
                schema = self.registry.schema(sid)
            except UnknownSchema as e:
                problems[sid] = str(e)
                continue
            if (schema.schema_type or "AVRO") != "AVRO":
                problems[sid] = f"schema id {sid} is a {schema.schema_type} schema, not Avro"
                continue
            try:
                writers[sid] = self._parse_registered(schema, what=f"schema id {sid}")
            except ValueError as e:
                problems[sid] = str(e)
                continue
            except (SchemaLimit, RecursionError) as e:
                name = self.registry.schema_name(sid)
                raise schema_error(name, e, field=self.registry.prefix) from None
            self._writers.put(sid, writers[sid])
        return writers, problems

    def _parse_registered(self, schema: Any, *, what: str) -> ParsedSchema:
        """A registered schema with the named types of its references, within the limits."""
        named = self._references(schema.references or [], ReferenceWalk(), {})
        return parse_avro(schema.schema_str or "", what=what, named=named)

    def _references(
        self, refs: list[Any], walk: ReferenceWalk, named: dict[str, Any]
    ) -> dict[str, Any]:
        """Named types of a schema's references (recursively, each once), for fastavro's
        parser."""
        assert self.registry is not None
        for ref in refs:
            with walk.enter(ref.subject, ref.version) as new:
                if not new:
                    continue
                found = self.registry.version(ref.subject, ref.version)
                text = found.schema.schema_str or ""
                check_schema_text(text, json_text=True)
                self._references(found.schema.references or [], walk, named)
                fastavro.parse_schema(json.loads(text), named_schemas=named)
        return named

    def _choose_reader(self, writers: dict[int, ParsedSchema]) -> ParsedSchema | None:
        """The reader of a batch with these writers (by id): the one given, the subject's
        latest, or the newest writer seen so far (it only grows)."""
        if self._fixed:
            return self._reader
        newest = max(writers, default=-1)
        if newest > self._reader_id:
            if self.latest:
                if newest > self._checked_id:
                    self._refresh_latest()
                    self._checked_id = newest
            else:
                self._reader, self._reader_id = writers[newest], newest
        return self._reader

    def _refresh_latest(self) -> None:
        assert self.registry is not None and self.subject is not None
        latest = self.registry.latest(self.subject)
        sid = int(latest.schema_id or -1)
        if sid == self._reader_id:
            return
        field = f"{self.prefix}.reader_schema"
        try:
            self._reader = self._parse_registered(latest.schema, what=f"subject {self.subject!r}")
        except ValueError as e:
            raise ConfigError(str(e), field=field) from None
        except (SchemaLimit, RecursionError) as e:
            name = SchemaName(sid, ((self.subject, int(latest.version or 0)),))
            raise schema_error(name, e, field=field) from None
        self._reader_id = sid


def _convert_record(
    i: int, value: Any, convert: Convert, failed: dict[int, str]
) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = converted(convert, value)
    except (ValueError, TypeError) as e:
        failed[i] = f"not convertible to Arrow: {e}"
        return None
    return record


def _config_schema(text: str, *, field: str) -> ParsedSchema:
    try:
        return parse_avro(text, what="the schema")
    except ValueError as e:
        raise ConfigError(str(e), field=field) from None
    except (SchemaLimit, RecursionError) as e:
        raise schema_error("the schema", e, field=field) from None


_EMPTY = ParsedSchema({"type": "record", "name": "Empty", "fields": []})
