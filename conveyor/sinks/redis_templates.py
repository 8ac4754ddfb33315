"""Redis command templates (pure): parsed once, filled column by column per batch.

A template given as a string is split into arguments with ``shlex`` once, when the config is
validated; placeholders (the syntax of ``conveyor.sinks.templates``) are then filled *inside*
each argument, so a value never becomes two arguments, whatever spaces, quotes or newlines it
holds. ``render_batch`` gives every row's commands as Python lists (for redis-py's pipelines),
``EncodedBatch`` the same commands in the Redis protocol, built by Arrow. A row that cannot
fill a template (a missing field, a key under the reserved prefix) is reported with its error.
COMMAND INFO replies (read by the sink at start) tell each template which arguments are keys.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import itertools
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from conveyor.core.errors import FieldRuleError, PermanentSinkError
from conveyor.core.model import (
    DESTINATION_COL,
    HEADERS_COL,
    KEY_COL,
    OFFSET_COL,
    PARTITION_COL,
    TIMESTAMP_COL,
    TOPIC_COL,
)
from conveyor.core.trust.references import known_now
from conveyor.sinks import redis_keys, templates
from conveyor.sinks.base import json_default, payload_columns
from conveyor.sinks.templates import Placeholder, TemplateError, TemplateSyntaxError
from conveyor.sinks.tombstones import has_tombstones, tombstone_flags

RESERVED = redis_keys.RESERVED_PREFIX.decode()


_COMMAND_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.|-]*$")
#: Commands that would break the pipeline protocol or the connection's state.
FORBIDDEN_COMMANDS = frozenset(
    {"MULTI", "EXEC", "DISCARD", "WATCH", "UNWATCH", "SELECT", "AUTH", "HELLO", "QUIT", "RESET", "MONITOR", "SUBSCRIBE",
     "PSUBSCRIBE", "SSUBSCRIBE", "UNSUBSCRIBE", "PUNSUBSCRIBE", "SUNSUBSCRIBE", "SHUTDOWN", "CLIENT", "SYNC", "PSYNC"}
)  # fmt: skip

#: Commands that add something on every run: a replayed row adds it again.
NOT_IDEMPOTENT = frozenset(
    {"XADD", "LPUSH", "RPUSH", "LPUSHX", "RPUSHX", "LINSERT", "INCR", "INCRBY", "INCRBYFLOAT", "DECR", "DECRBY", "HINCRBY",
     "HINCRBYFLOAT", "ZINCRBY", "APPEND", "PUBLISH", "SPUBLISH", "SETRANGE", "LMOVE", "RPOPLPUSH"}
)  # fmt: skip


Part = bytes | Placeholder


@dataclasses.dataclass(frozen=True)
class CommandTemplate:
    """One parsed command: its arguments, each a sequence of literal bytes and placeholders."""

    source: str
    args: tuple[tuple[Part, ...], ...]
    # The arguments that are keys (``redis_keys.key_positions``, from COMMAND INFO at start);
    # None: not known, every argument is checked against the reserved prefix.
    keys: frozenset[int] | None = None

    def is_key(self, i: int) -> bool:
        """Whether argument ``i`` (0: the command name) may be a key."""
        return self.keys is None or i in self.keys

    @property
    def name(self) -> str:
        first = self.args[0]
        return first[0].decode().upper() if first and isinstance(first[0], bytes) else ""

    def placeholders(self) -> set[str]:
        return {p.name for arg in self.args for p in arg if isinstance(p, Placeholder)}


def parse_argument(text: str) -> tuple[Part, ...]:
    """Literal bytes and ``${...}`` placeholders of one argument (the syntax of conveyor.sinks.templates)."""
    try:
        parts = templates.parse(text)
    except TemplateSyntaxError as e:
        raise TemplateSyntaxError(
            f"{e} in argument {text!r}" if "unclosed" in str(e) else str(e)
        ) from None
    return tuple(p.encode() if isinstance(p, str) else p for p in parts) or (b"",)


def parse_command(spec: str | Sequence[str]) -> CommandTemplate:
    """Parse one command template (a string is split with shlex, once)."""
    if isinstance(spec, str):
        try:
            words = shlex.split(spec)
        except ValueError as e:
            raise TemplateSyntaxError(f"{spec!r}: {e}") from None
        source = spec
    else:
        words = [str(w) for w in spec]
        source = shlex.join(words)
    if not words:
        raise TemplateSyntaxError("empty command")
    if not _COMMAND_NAME.match(words[0]):
        raise TemplateSyntaxError(
            f"{words[0]!r} is not a command name (the command name cannot hold a placeholder)"
        )
    if words[0].upper() in FORBIDDEN_COMMANDS:
        raise TemplateSyntaxError(f"{words[0].upper()} cannot be used in a sink template")
    if words[0].upper() in redis_keys.UNCHECKABLE_COMMANDS:
        raise TemplateSyntaxError(
            f"{words[0].upper()} cannot be used in a sink template: it reaches keys its "
            f"arguments do not name, so the reserved prefix {RESERVED!r} could not be kept"
        )
    args = (words[0].encode(),), *(parse_argument(w) for w in words[1:])
    reserved = redis_keys.reserved_literal(args)
    if reserved is not None:
        raise TemplateSyntaxError(
            f"argument {reserved} ({words[reserved][:80]!r}) starts with {RESERVED!r}, the "
            "prefix of the keys Conveyor keeps in Redis (the exactly-once offsets); a template "
            "may not name them"
        )
    return CommandTemplate(source=source, args=tuple(args))


def value_bytes(v: Any) -> bytes:
    """One substituted value as an argument's bytes."""
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, bool):
        return b"true" if v else b"false"
    if isinstance(v, int):
        return str(v).encode()
    if isinstance(v, float):
        return repr(v).encode()
    if isinstance(v, decimal.Decimal):
        return str(v).encode()
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat().encode()
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(
            v, default=json_default, separators=(",", ":"), ensure_ascii=False
        ).encode()
    return str(v).encode()


def arrow_value_array(col: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array | None:
    """The column's values as ``value_bytes`` writes them, converted by Arrow to a binary
    column (None for a type it does not cover): integers (their decimal text) and
    text/binary (their bytes). Nulls stay null. Floats keep ``repr`` (Arrow's text differs:
    ``100`` for ``100.0``). Text holding invalid UTF-8 is left to the row path too, whose
    failure names it."""
    t = col.type
    if pa.types.is_integer(t):
        col = pc.cast(col, pa.large_string())
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        try:
            col.validate(full=True)
        except pa.ArrowInvalid:
            return None
    elif not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        return None
    return pc.cast(col, pa.large_binary())


_MISSING = object()


def _timestamps_ms(col: pa.ChunkedArray) -> list[int | None]:
    unit = col.type.unit
    ints = pc.cast(col, pa.int64()).to_pylist()
    div = {"s": None, "ms": 1, "us": 1000, "ns": 1_000_000}[unit]
    if div is None:
        return [None if v is None else v * 1000 for v in ints]
    return [None if v is None else v // div for v in ints]


class BatchValues:
    """The placeholder values of one batch, computed column by column and cached."""

    def __init__(self, batch: pa.Table):
        self.batch = batch
        self.n = batch.num_rows
        self.pcols = payload_columns(batch)
        self.single = self.pcols == ["value"]
        self._cache: dict[str, list[Any]] = {}

    def _col(self, name: str, default: Any = None) -> list[Any]:
        if name in self.batch.schema.names:
            return self.batch.column(name).to_pylist()
        return [default(i) if callable(default) else default for i in range(self.n)]

    def _payload_json(self) -> list[Any]:
        """Row payloads as JSON values (parsed once per batch)."""
        if "__payload_json" not in self._cache:
            if self.single:
                out = []
                for p in self._col("value"):
                    if isinstance(p, (bytes, str)):
                        try:
                            p = json.loads(p)
                        except ValueError:
                            p = _MISSING
                    out.append(p)
            else:
                out = self.batch.select(self.pcols).to_pylist()
            self._cache["__payload_json"] = out
        return self._cache["__payload_json"]

    def _headers(self) -> list[list[tuple[str, bytes | None]]]:
        if "__headers" not in self._cache:
            self._cache["__headers"] = [
                [(h["key"], h["value"]) for h in hs] if hs else []
                for hs in self._col(HEADERS_COL, None)
            ]
        return self._cache["__headers"]

    def values(self, ph: Placeholder) -> list[bytes | TemplateError]:
        """The bytes of ``ph`` for every row, or the TemplateError of a row that lacks it."""
        if ph.name not in self._cache:
            self._cache[ph.name] = self._compute(ph)
        return self._cache[ph.name]

    def _compute(self, ph: Placeholder) -> list[bytes | TemplateError]:
        name, root = ph.name, ph.root
        if name == "topic":
            return [value_bytes(v or "") for v in self._col(TOPIC_COL, "")]
        if name == "partition":
            return [value_bytes(v) for v in self._col(PARTITION_COL, 0)]
        if name == "offset":
            return [value_bytes(v) for v in self._col(OFFSET_COL, lambda i: i)]
        if name == "timestamp":
            if TIMESTAMP_COL not in self.batch.schema.names:
                return [TemplateError("message has no timestamp (${timestamp})")] * self.n
            return [
                TemplateError("message has no timestamp (${timestamp})")
                if v is None
                else str(v).encode()
                for v in _timestamps_ms(self.batch.column(TIMESTAMP_COL))
            ]
        if name == "key":
            return [
                TemplateError("message has no key (${key})") if v is None else value_bytes(v)
                for v in self._col(KEY_COL, None)
            ]
        if name == "destination":
            return [
                TemplateError("message has no destination (${destination})")
                if not v
                else value_bytes(v)
                for v in self._col(DESTINATION_COL, None)
            ]
        if name == "headers":
            return [
                value_bytes(
                    {k: (v.decode(errors="replace") if v is not None else None) for k, v in hs}
                )
                for hs in self._headers()
            ]
        if root == "headers":
            wanted = ph.rest
            out: list[bytes | TemplateError] = []
            for hs in self._headers():
                found: Any = _MISSING
                for k, v in hs:
                    if k == wanted:
                        found = v  # the last header of that name wins
                out.append(
                    TemplateError(f"message has no header {wanted!r} (${{{name}}})")
                    if found is _MISSING or found is None
                    else value_bytes(found)
                )
            return out
        if name == "payload":
            if self.single:
                return [
                    TemplateError("payload is null (${payload})") if v is None else value_bytes(v)
                    for v in self._col("value")
                ]
            return [value_bytes(row) for row in self._payload_json()]
        return self._payload_field(ph)

    def _arrow_field(self, ph: Placeholder) -> pa.ChunkedArray | pa.Array | None:
        """A top-level payload field's bytes converted by Arrow, when its type allows."""
        if ph.root != "payload" or self.single or len(ph.path) != 1 or ph.path[0] not in self.pcols:
            return None
        return arrow_value_array(self.batch.column(ph.path[0]))

    def arrow(self, ph: Placeholder) -> tuple[pa.Array, dict[int, str]]:
        """The bytes of ``ph`` for every row as one Arrow binary array, null for a row that
        lacks it, and those rows' errors: converted by Arrow where the type allows, else
        from ``values`` (the same bytes)."""
        key = f"\0arrow {ph.name}"
        if key not in self._cache:
            fast = self._arrow_field(ph)
            if fast is not None:
                arr = fast.combine_chunks() if isinstance(fast, pa.ChunkedArray) else fast
                errors: dict[int, str] = {}
                if arr.null_count:
                    nulls = pc.indices_nonzero(pc.is_null(arr)).to_pylist()
                    errors = dict.fromkeys(nulls, _null_field(ph))
            else:
                vals: list[Any] = self.values(ph)
                errors = {i: str(v) for i, v in enumerate(vals) if isinstance(v, TemplateError)}
                if errors:
                    vals = [None if isinstance(v, TemplateError) else v for v in vals]
                arr = pa.array(vals, pa.large_binary())
            self._cache[key] = [arr, errors]
        arr, errors = self._cache[key]
        return arr, errors

    def _payload_field(self, ph: Placeholder) -> list[bytes | TemplateError]:
        path = ph.path
        dotted = ".".join(path)
        fast_col = self._arrow_field(ph)
        if fast_col is not None:
            null = TemplateError(_null_field(ph))
            return [null if v is None else v for v in fast_col.to_pylist()]
        if not self.single and path[0] in self.pcols:
            firsts: list[Any] = self.batch.column(path[0]).to_pylist()
            rest = path[1:]
        elif not self.single:
            return [TemplateError(f"payload has no field {dotted!r} (${{{ph.name}}})")] * self.n
        else:
            firsts = self._payload_json()
            rest = path
        out: list[bytes | TemplateError] = []
        for v in firsts:
            for part in rest:
                v = v.get(part, _MISSING) if isinstance(v, dict) else _MISSING
                if v is _MISSING:
                    break
            if v is _MISSING:
                out.append(TemplateError(f"payload has no field {dotted!r} (${{{ph.name}}})"))
            elif v is None:
                out.append(TemplateError(_null_field(ph)))
            else:
                out.append(value_bytes(v))
        return out


def _null_field(ph: Placeholder) -> str:
    return f"payload field {'.'.join(ph.path)!r} is null (${{{ph.name}}})"


def render_batch(
    commands: Sequence[CommandTemplate], batch: pa.Table
) -> tuple[list[list[list[bytes | str]] | None], dict[int, str]]:
    """Every row's commands (name as str, arguments as bytes), and the rows that cannot fill them."""
    values = BatchValues(batch)
    n = batch.num_rows
    failures: dict[int, str] = {}
    # Per template, per argument: a constant, one value column, or parts to join.
    compiled = []
    for t in commands:
        args: list[tuple[str, Any]] = []
        for arg in t.args[1:]:
            if all(isinstance(p, bytes) for p in arg):
                args.append(("const", b"".join(arg)))  # type: ignore[arg-type]
            elif len(arg) == 1:
                args.append(("value", values.values(arg[0])))  # type: ignore[arg-type]
            else:
                args.append(
                    ("join", [p if isinstance(p, bytes) else values.values(p) for p in arg])
                )
        compiled.append((t, args))
    # Column by column: each argument becomes one list over the rows, then rows are zipped.
    per_template: list[list[list[bytes | str]]] = []
    for t, args in compiled:
        name = t.name
        columns: list[Any] = []
        for j, (kind, spec) in enumerate(args, 1):
            if kind == "const":
                columns.append(itertools.repeat(spec, n))
                continue
            if kind == "value":
                _note_errors(spec, failures)
                columns.append(spec)
            else:
                parts = []
                for p in spec:
                    if isinstance(p, bytes):
                        parts.append(itertools.repeat(p, n))
                    else:
                        _note_errors(p, failures)
                        parts.append(p)
                if failures:  # a row with an error cannot be joined; it is dropped below
                    columns.append(
                        [
                            b"" if i in failures else b"".join(ps)
                            for i, ps in enumerate(zip(*parts, strict=False))
                        ]
                    )
                else:
                    columns.append([b"".join(ps) for ps in zip(*parts, strict=False)])
            if t.is_key(j):
                _note_reserved(columns[-1], failures, name)
        if columns:
            per_template.append([[name, *a] for a in zip(*columns, strict=False)])
        else:
            per_template.append([[name] for _ in range(n)])
    rows: list[list[list[bytes | str]] | None]
    if len(per_template) == 1 and not failures:
        rows = [[cmd] for cmd in per_template[0]]
    else:
        rows = [None if i in failures else [cmds[i] for cmds in per_template] for i in range(n)]
    return rows, failures


_EMPTY = pa.scalar(b"", pa.large_binary())


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def encode_commands(
    commands: Sequence[CommandTemplate], values: BatchValues, *, argv: bool
) -> tuple[pa.Array, dict[int, str]]:
    """Every row's commands in the Redis protocol, built column by column by Arrow: one
    binary value per row (null for a row that cannot fill them), and those rows' errors
    (the first of a row, in ``render_batch``'s order). With ``argv`` each command is
    written as ``STOP_AT_FIRST_ERROR``'s ARGV wants it: its word count, then its words;
    otherwise as a command (``*<words>``). The bytes are those hiredis packs from
    ``render_batch``'s rows (tests/sinks/test_redis.py)."""
    n = values.n
    errors: dict[int, str] = {}
    pieces: list[Any] = []
    for t in commands:
        words = len(t.args)
        pieces.append(_bulk(b"%d" % words) if argv else b"*%d\r\n" % words)
        pieces.append(_bulk(t.name.encode()))
        for j, arg in enumerate(t.args[1:], 1):
            if all(isinstance(p, bytes) for p in arg):
                pieces.append(_bulk(b"".join(arg)))  # type: ignore[arg-type]
                continue
            parts: list[Any] = []
            for p in arg:
                if isinstance(p, bytes):
                    parts.append(pa.scalar(p, pa.large_binary()))
                else:
                    arr, errs = values.arrow(p)
                    for i, msg in errs.items():
                        errors.setdefault(i, msg)
                    parts.append(arr)
            joined = parts[0] if len(parts) == 1 else pc.binary_join_element_wise(*parts, _EMPTY)
            if t.is_key(j):
                _reserved_in(joined, errors, t.name)
            length = pc.cast(
                pc.cast(pc.binary_length(joined), pa.large_string()), pa.large_binary()
            )
            pieces += [b"$", length, b"\r\n", joined, b"\r\n"]
    # Adjacent literals as one; a command without placeholders is the same bytes every row.
    merged: list[Any] = []
    for piece in pieces:
        if isinstance(piece, bytes) and merged and isinstance(merged[-1], bytes):
            merged[-1] += piece
        else:
            merged.append(piece)
    if len(merged) == 1 and isinstance(merged[0], bytes):
        return pa.array([merged[0]] * n, pa.large_binary()), errors
    args = [pa.scalar(p, pa.large_binary()) if isinstance(p, bytes) else p for p in merged]
    out = args[0] if len(args) == 1 else pc.binary_join_element_wise(*args, _EMPTY)
    return out, errors


def _reserved_in(column: pa.Array, errors: dict[int, str], command: str) -> None:
    """``_note_reserved`` over an Arrow binary column (a row without a value is null)."""
    hits = pc.starts_with(column, pattern=RESERVED)
    if pc.any(hits).as_py():
        for i in pc.indices_nonzero(hits).to_pylist():
            errors.setdefault(i, redis_keys.reserved_key_error(command, column[i].as_py()))


def tombstone_rows(
    batch: pa.Table, bad: dict[int, str], dbad: dict[int, str], flags: list[bool] | None = None
) -> list[int]:
    """The tombstones of ``batch``, which run the delete templates: each takes its errors
    from those (``dbad``) in ``bad``, not the templates'."""
    rows = [i for i, tomb in enumerate(flags or tombstone_flags(batch)) if tomb]
    for i in rows:
        bad.pop(i, None)
        if i in dbad:
            bad[i] = dbad[i]
    return rows


class EncodedBatch:
    """A batch's commands in the Redis protocol, encoded by Arrow (``encode_commands``): a
    tombstone's row holds the delete templates' commands. ``bad`` are the rows that cannot
    fill their commands (null in ``resp``); ``names`` each row's command names and ``words``
    its ARGV words (each command's word count and words: STOP_AT_FIRST_ERROR's)."""

    def __init__(
        self,
        batch: pa.Table,
        commands: Sequence[CommandTemplate],
        deletes: Sequence[CommandTemplate] | None,
        *,
        argv: bool,
    ):
        n = batch.num_rows
        values = BatchValues(batch)
        resp, bad = encode_commands(commands, values, argv=argv)
        self.names: list[list[str]] = [[t.name for t in commands]] * n
        self.words: list[int] = [sum(1 + len(t.args) for t in commands)] * n
        if deletes is not None and has_tombstones(batch):
            dresp, dbad = encode_commands(deletes, values, argv=argv)
            flags = tombstone_flags(batch)
            resp = pc.if_else(pa.array(flags, pa.bool_()), dresp, resp)
            dnames = [t.name for t in deletes]
            dwords = sum(1 + len(t.args) for t in deletes)
            for i in tombstone_rows(batch, bad, dbad, flags):
                self.names[i] = dnames
                self.words[i] = dwords
        self.bad = bad
        self._offsets = np.frombuffer(resp.buffers()[1], np.int64)[
            resp.offset : resp.offset + n + 1
        ]
        self._data = resp.buffers()[2]

    def body(self, idx: Sequence[int]) -> bytes:
        """The commands of rows ``idx`` (sent rows: none of them in ``bad``), in order."""
        if not idx:
            return b""
        first, last = idx[0], idx[-1]
        if last - first + 1 == len(idx):  # a run of rows: one slice of the data
            o = self._offsets
            return self._data.slice(o[first], o[last + 1] - o[first]).to_pybytes()
        return b"".join(self.body([i]) for i in idx)


def _note_reserved(values: Sequence[Any], failures: dict[int, str], command: str) -> None:
    """Record the rows whose key argument was filled with a key under the reserved prefix."""
    prefix = redis_keys.RESERVED_PREFIX
    for i, v in enumerate(values):
        if isinstance(v, bytes) and v.startswith(prefix) and i not in failures:
            failures[i] = redis_keys.reserved_key_error(command, v)


def _note_errors(values: list[Any], failures: dict[int, str]) -> None:
    """Record the rows whose value is a TemplateError (the first error of a row wins)."""
    for i, v in enumerate(values):
        if isinstance(v, TemplateError) and i not in failures:
            failures[i] = str(v)


def checked_commands(
    specs: Sequence[str | Sequence[str]], field: str
) -> list[CommandTemplate] | None:
    """The parsed templates (FieldRuleError naming ``field[i]`` for one that does not parse); None
    when a template holds a reference, known only in the run."""
    if not all(known_now(a) for spec in specs for a in ([spec] if isinstance(spec, str) else spec)):
        return None
    parsed = []
    for i, spec in enumerate(specs):
        try:
            parsed.append(parse_command(spec))
        except TemplateSyntaxError as e:
            raise FieldRuleError(str(e), field=f"{field}[{i}]") from None
    return parsed


def default_delete_commands(commands: Sequence[CommandTemplate]) -> list[CommandTemplate]:
    """``DEL <key>`` for the key argument (the first) of each template, each key once."""
    out: list[CommandTemplate] = []
    seen: set[tuple[Part, ...]] = set()
    for t in commands:
        if len(t.args) < 2 or t.args[1] in seen:
            continue
        seen.add(t.args[1])
        out.append(CommandTemplate(source=f"DEL <key of {t.source}>", args=((b"DEL",), t.args[1])))
    return out


def with_keys(t: CommandTemplate, infos: Mapping[str, Any]) -> CommandTemplate:
    """``t`` knowing its key arguments from its command's COMMAND INFO reply."""
    return dataclasses.replace(t, keys=redis_keys.key_positions(infos.get(t.name), t.args))


def command_flags(info: Any) -> set[str]:
    """The flags of a raw COMMAND INFO reply (write, noscript...)."""
    if isinstance(info, list) and info and isinstance(info[0], list) and len(info[0]) > 2:
        flags = info[0][2]
        if isinstance(flags, (list, set, tuple)):
            return {f.decode() if isinstance(f, bytes) else str(f) for f in flags}
    return set()


def command_arity(info: Any, name: str) -> int | None:
    """The arity from a raw COMMAND INFO reply; None for an unknown command."""
    if isinstance(info, list) and info and isinstance(info[0], list) and len(info[0]) > 1:
        return int(info[0][1])
    return None


def check_arity(t: CommandTemplate, info: Any, where: str) -> None:
    """PermanentSinkError naming ``where`` when Redis does not know the template's command
    (``info``: its raw COMMAND INFO reply) or the template has a word count it refuses."""
    arity = command_arity(info, t.name)
    if arity is None:
        raise PermanentSinkError(
            f"{where}: Redis does not know the command {t.name!r} ({t.source})"
        )
    n = len(t.args)
    if (arity > 0 and n != arity) or (arity < 0 and n < -arity):
        want = f"exactly {arity}" if arity > 0 else f"at least {-arity}"
        raise PermanentSinkError(
            f"{where}: {t.name} takes {want} words with its name, the template has {n} ({t.source})"
        )
