"""pgoutput decoder: logical replication messages (protocol version 1) and exact values.

Pure: no I/O, no client library. ``parse_message`` turns one pgoutput message (the ``data``
of ``pg_logical_slot_peek_binary_changes(slot, ..., 'proto_version', '1',
'publication_names', ...)`` or of a walsender's XLogData) into a frozen dataclass; malformed,
truncated or unknown bytes raise ``ProtocolError`` naming the tag and offset (never
IndexError or struct.error). Tuple values stay as the server sent them: text-format bytes,
None for NULL, or ``UNCHANGED_TOAST`` for a TOASTed value the change did not touch (pgoutput's
``'u'``: its value is not in the WAL record, so it is not known here).

``ValueDecoder`` turns those text values into JSON-able values, exactly. It assumes the
replication connection set ``TimeZone=UTC``, ``DateStyle=ISO``, ``IntervalStyle=iso_8601``,
``extra_float_digits=3`` and ``bytea_output=hex``, and that the database encoding is UTF8; a
value printed otherwise (a ``+02`` offset, ``01/02/2024``, ``1 day``) raises
``ValueDecodeError`` naming the setting rather than being passed on wrongly.

Conversion table (``ValueDecoder.value``):

==========================================  ===================================================
PostgreSQL type                             JSON value
==========================================  ===================================================
int2, int4, int8, oid, xid, xid8, cid       integer
float4, float8                              number (shortest exact text); NaN, Infinity and
                                            -Infinity as the strings "NaN", "Infinity",
                                            "-Infinity" (JSON has no such numbers)
numeric                                     string, exactly as printed ("12345678901234567.89",
                                            "NaN", "Infinity", "-Infinity"); never a float
bool                                        true / false
json, jsonb                                 the parsed JSON value, numbers exact: an integer or
                                            a float whose text Python writes back unchanged
                                            stays int / float, any other number (1.10, 1e5,
                                            -0, 1e400) is a ``JsonNumber`` that ``dumps``
                                            writes back byte for byte (``json.dumps`` with
                                            ``default=str`` writes it as a string); the JSON
                                            value null is then None like SQL NULL. With
                                            ``ValueDecoder(json_text=True)``: the JSON text as
                                            a string (Debezium's io.debezium.data.Json), so
                                            'null' stays distinct from NULL
bytea                                       string: base64 of the bytes
date                                        string as printed: "2024-01-31", "infinity",
                                            "-infinity", "0044-03-15 BC"
timestamp                                   string "YYYY-MM-DDTHH:MM:SS[.ffffff]" (fraction as
                                            printed, trailing zeros dropped); " BC" kept;
                                            "infinity" / "-infinity"
timestamptz                                 the same in UTC with "Z": "2024-01-31T12:00:00Z"
time, timetz                                string as printed ("12:00:00.5", "12:00:00+02")
interval                                    string, ISO 8601 as printed ("P1Y2M3DT4H5M6.5S")
int2vector, oidvector                       list of integers
enum                                        string: the label
domain                                      decoded as its base type
array of any of these                       list (nested for several dimensions), each
                                            element decoded by its type, NULL as null;
                                            explicit lower bounds ("[0:1]={...}") are dropped
text, varchar, bpchar, name, char, citext,  string as printed
xml, uuid, inet, cidr, macaddr, macaddr8,
money, bit, varbit, tsvector, tsquery,
point, line, lseg, box, path, polygon,
circle, ranges, multiranges, composite,
pg_lsn, reg* and any other type
==========================================  ===================================================

An OID that is not built in (enums, domains, extension types like citext, arrays of them) is
resolved once through the caller's ``lookup`` (``ValueDecoder.TYPE_QUERY`` on pg_type); with
no lookup, or an OID the lookup does not know, the value is the string as printed.

Notes: bpchar keeps its padding ("ab   "); money follows the server's lc_monetary; bytea in
the escape format is read too; a json value with a key twice keeps the last (as PostgreSQL's
``->`` does); JSON nested deeper than Python's recursion limit (~1000) is a
``ValueDecodeError``. Write decoded rows with ``strict_json.dumps`` (``json.dumps`` with
``separators=(",", ":")`` and ``default=str``, plus JsonNumber literals written raw).
"""

from __future__ import annotations

import base64
import binascii
import enum
import functools
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, TypeAlias

from conveyor.sources.strict_json import EXACT_DECODER


class Unchanged(enum.Enum):
    """The type of ``UNCHANGED_TOAST`` (an enum member, so type checkers can narrow it)."""

    TOAST = "unchanged toast"


UNCHANGED_TOAST: Final = Unchanged.TOAST
Value: TypeAlias = bytes | None | Literal[Unchanged.TOAST]

# Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
PG_EPOCH_US: Final = 946_684_800_000_000
REPLICA_IDENTITIES: Final = frozenset("dnfi")
MAX_ARRAY_DEPTH: Final = 6  # PostgreSQL's MAXDIM


class ProtocolError(ValueError):
    """Bytes that are not a well-formed pgoutput (version 1) message."""


class ValueDecodeError(ProtocolError):
    """A value whose text is not what PostgreSQL prints for its type (or a setting differs)."""


# ---------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Column:
    name: str
    type_oid: int
    type_modifier: int
    key: bool


@dataclass(frozen=True)
class Relation:
    oid: int
    namespace: str  # "" for pg_catalog, as sent
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[Column, ...]

    @property
    def qualified(self) -> str:
        return f"{self.namespace or 'pg_catalog'}.{self.name}"

    @property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.key)


@dataclass(frozen=True)
class Begin:
    final_lsn: int
    commit_time_us: int  # microseconds since the Unix epoch
    xid: int


@dataclass(frozen=True)
class Commit:
    commit_lsn: int
    end_lsn: int
    commit_time_us: int  # microseconds since the Unix epoch


@dataclass(frozen=True)
class Origin:
    commit_lsn: int  # the commit's LSN on the origin server
    name: str


@dataclass(frozen=True)
class Message:
    """A logical decoding message (``pg_logical_emit_message``), only sent with 'messages'."""

    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True)
class TypeMessage:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True)
class Insert:
    relation_oid: int
    new: tuple[Value, ...]


@dataclass(frozen=True)
class Update:
    relation_oid: int
    old: tuple[Value, ...] | None  # None: the key did not change and identity is not FULL
    old_is_key: bool  # True: ``old`` holds the replica identity's columns, others NULL
    new: tuple[Value, ...]


@dataclass(frozen=True)
class Delete:
    relation_oid: int
    old: tuple[Value, ...]
    old_is_key: bool


@dataclass(frozen=True)
class Truncate:
    relation_oids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


PgOutputMessage: TypeAlias = (
    Begin | Commit | Relation | TypeMessage | Insert | Update | Delete | Truncate | Origin | Message
)


_STRUCTS: Final = {fmt: struct.Struct(">" + fmt) for fmt in "BhiIqQ"}


class _Reader:
    """Reads big-endian fields off one message; any shortfall is a ProtocolError."""

    def __init__(self, data: bytes, tag: str) -> None:
        self.data = data
        self.pos = 1
        self.tag = tag

    def fail(self, what: str) -> ProtocolError:
        return ProtocolError(f"pgoutput {self.tag!r} message: {what} at byte offset {self.pos}")

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise self.fail(
                f"truncated {what} ({n} bytes wanted, {len(self.data) - self.pos} left)"
            )
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def unpack(self, fmt: str, what: str) -> int:
        s = _STRUCTS[fmt]
        value: int = s.unpack(self.take(s.size, what))[0]
        return value

    def string(self, what: str) -> str:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise self.fail(f"{what}: string without its terminating zero byte")
        raw = self.data[self.pos : end]
        try:
            text = raw.decode()
        except UnicodeDecodeError as e:
            raise self.fail(f"{what}: not UTF-8 ({e.reason})") from None
        self.pos = end + 1
        return text

    def done(self) -> None:
        if self.pos != len(self.data):
            raise self.fail(f"{len(self.data) - self.pos} unexpected trailing bytes")

    def tuple_data(self) -> tuple[Value, ...]:
        n = self.unpack("h", "tuple column count")
        if n < 0:
            raise self.fail(f"negative tuple column count {n}")
        data, end = self.data, len(self.data)
        out: list[Value] = []
        for i in range(n):  # the hot loop: fields read in place, errors re-read by _bad_column
            pos = self.pos
            kind = data[pos] if pos < end else -1
            if kind == 0x74 and pos + 5 <= end:  # 't': Int32 length, then the text
                stop = pos + 5 + int.from_bytes(data[pos + 1 : pos + 5], "big", signed=True)
                if pos + 5 <= stop <= end:
                    out.append(data[pos + 5 : stop])
                    self.pos = stop
                    continue
            elif kind == 0x6E:  # 'n'
                out.append(None)
                self.pos = pos + 1
                continue
            elif kind == 0x75:  # 'u'
                out.append(UNCHANGED_TOAST)
                self.pos = pos + 1
                continue
            raise self._bad_column(i)
        return tuple(out)

    def _bad_column(self, i: int) -> ProtocolError:
        kind = self.take(1, f"kind of tuple column {i}")
        if kind == b"t":
            self.take(self.unpack("i", f"length of column {i}"), f"column {i}")
        if kind == b"b":
            return self.fail(f"binary value in tuple column {i} (binary mode not requested)")
        return self.fail(f"unknown tuple column kind {kind!r} in column {i}")


def _begin(r: _Reader) -> Begin:
    lsn = r.unpack("Q", "final LSN")
    ts = r.unpack("q", "commit timestamp")
    return Begin(final_lsn=lsn, commit_time_us=ts + PG_EPOCH_US, xid=r.unpack("I", "xid"))


def _commit(r: _Reader) -> Commit:
    r.unpack("B", "flags")
    lsn, end = r.unpack("Q", "commit LSN"), r.unpack("Q", "end LSN")
    ts = r.unpack("q", "commit timestamp")
    return Commit(commit_lsn=lsn, end_lsn=end, commit_time_us=ts + PG_EPOCH_US)


def _origin(r: _Reader) -> Origin:
    return Origin(commit_lsn=r.unpack("Q", "origin LSN"), name=r.string("origin name"))


def _message(r: _Reader) -> Message:
    flags = r.unpack("B", "flags")
    lsn = r.unpack("Q", "LSN")
    prefix = r.string("prefix")
    content = r.take(r.unpack("i", "content length"), "content")
    return Message(transactional=bool(flags & 1), lsn=lsn, prefix=prefix, content=content)


def _relation(r: _Reader) -> Relation:
    oid = r.unpack("I", "relation OID")
    namespace, name = r.string("namespace"), r.string("relation name")
    ident = chr(r.unpack("B", "replica identity"))
    if ident not in REPLICA_IDENTITIES:
        raise r.fail(f"unknown replica identity {ident!r}")
    n = r.unpack("h", "column count")
    if n < 0:
        raise r.fail(f"negative column count {n}")
    columns = []
    for i in range(n):
        flags = r.unpack("B", f"flags of column {i}")
        col_name = r.string(f"name of column {i}")
        type_oid = r.unpack("I", f"type of column {i}")
        columns.append(
            Column(col_name, type_oid, r.unpack("i", f"typmod of column {i}"), bool(flags & 1))
        )
    return Relation(oid, namespace, name, ident, tuple(columns))


def _type(r: _Reader) -> TypeMessage:
    oid = r.unpack("I", "type OID")
    return TypeMessage(oid=oid, namespace=r.string("namespace"), name=r.string("type name"))


def _insert(r: _Reader) -> Insert:
    oid = r.unpack("I", "relation OID")
    if r.take(1, "new tuple marker") != b"N":
        raise r.fail("expected 'N' before the new tuple")
    return Insert(relation_oid=oid, new=r.tuple_data())


def _update(r: _Reader) -> Update:
    oid = r.unpack("I", "relation OID")
    marker = r.take(1, "tuple marker")
    old: tuple[Value, ...] | None = None
    if marker in (b"K", b"O"):
        old = r.tuple_data()
        new_marker = r.take(1, "new tuple marker")
    else:
        new_marker = marker
    if new_marker != b"N":
        raise r.fail(f"expected 'K', 'O' or 'N', got {new_marker!r}")
    return Update(relation_oid=oid, old=old, old_is_key=marker == b"K", new=r.tuple_data())


def _delete(r: _Reader) -> Delete:
    oid = r.unpack("I", "relation OID")
    marker = r.take(1, "old tuple marker")
    if marker not in (b"K", b"O"):
        raise r.fail(f"expected 'K' or 'O', got {marker!r}")
    return Delete(relation_oid=oid, old=r.tuple_data(), old_is_key=marker == b"K")


def _truncate(r: _Reader) -> Truncate:
    n = r.unpack("i", "relation count")
    options = r.unpack("B", "options")
    if n < 0 or n * 4 > len(r.data) - r.pos:
        raise r.fail(f"relation count {n} does not fit the message")
    oids = tuple(r.unpack("I", f"relation OID {i}") for i in range(n))
    return Truncate(
        relation_oids=oids, cascade=bool(options & 1), restart_identity=bool(options & 2)
    )


_PARSERS: dict[int, Callable[[_Reader], PgOutputMessage]] = {
    ord("B"): _begin,
    ord("C"): _commit,
    ord("O"): _origin,
    ord("M"): _message,
    ord("R"): _relation,
    ord("Y"): _type,
    ord("I"): _insert,
    ord("U"): _update,
    ord("D"): _delete,
    ord("T"): _truncate,
}


def parse_message(data: bytes) -> PgOutputMessage:
    """One pgoutput protocol-1 message; ProtocolError for anything malformed or unknown."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"pgoutput message must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise ProtocolError("empty pgoutput message")
    parse = _PARSERS.get(data[0])
    if parse is None:
        raise ProtocolError(
            f"unknown pgoutput message tag {data[:1]!r} at byte offset 0 (protocol version 1)"
        )
    r = _Reader(data, chr(data[0]))
    out = parse(r)
    r.done()
    return out


# ---------------------------------------------------------------------------- JSON numbers


def parse_json(text: str) -> Any:
    """A JSON text with its numbers exact (see ``JsonNumber``); ValueDecodeError if invalid."""
    try:
        return EXACT_DECODER.decode(text)
    except RecursionError:
        raise ValueDecodeError("JSON nested deeper than the decoder's recursion limit") from None
    except ValueError as e:
        raise ValueDecodeError(f"invalid JSON: {e}") from None


# ---------------------------------------------------------------------------- arrays

# PostgreSQL's array whitespace (scanner_isspace): ASCII only, unlike Python's \s.
_WS: Final = r"[ \t\n\r\v\f]"
_BOUNDS_RE = re.compile(
    rf"{_WS}*(?:\[{_WS}*[+-]?[0-9]+{_WS}*(?::{_WS}*[+-]?[0-9]+{_WS}*)?\]{_WS}*)+="
)


@functools.lru_cache(maxsize=16)
def _array_token_re(delim: str) -> re.Pattern[str]:
    d = re.escape(delim)
    plain = rf'[^"\\{{}}{d}]'
    edge = rf'(?:[^"\\{{}}{d} \t\n\r\v\f]|\\.)'
    return re.compile(
        rf'{_WS}*(?:(?P<open>\{{)|(?P<close>\}})|(?P<delim>{d})|"(?P<quoted>(?:[^"\\]|\\.)*)"'
        rf"|(?P<bare>{edge}(?:(?:{plain}|\\.)*{edge})?))",
        re.S,
    )


_ESCAPE_RE = re.compile(r"\\(.)", re.S)


def parse_array(text: str, delim: str = ",") -> list[Any]:
    """PostgreSQL's array text (``array_out``; what ``array_in`` reads) as nested lists of
    str and None: quoted elements with backslash escapes, unquoted NULL (any case) as None
    but "NULL" quoted as the string, several dimensions, ``{}``, a ``[lb:ub]=`` prefix
    (dropped), and the element type's delimiter (``;`` for box)."""
    m = _BOUNDS_RE.match(text)
    pos = m.end() if m else 0
    token_re = _array_token_re(delim)
    stack: list[list[Any]] = []
    result: list[Any] | None = None
    expect_item = True  # after '{' or a delimiter
    while True:
        t = token_re.match(text, pos)
        if t is None or (result is not None):
            break
        pos = t.end()
        kind = t.lastgroup
        if not stack and kind != "open":
            raise _array_error(text, t.start(), "an array starts with '{' (after any bounds)")
        if kind == "open":
            if not expect_item or len(stack) >= MAX_ARRAY_DEPTH:
                raise _array_error(text, t.start(), "unexpected '{' (or deeper than 6)")
            sub: list[Any] = []
            if stack:
                stack[-1].append(sub)
            stack.append(sub)
        elif kind == "close":
            if expect_item and stack[-1]:
                raise _array_error(text, t.start(), "unexpected '}'")
            done = stack.pop()
            result = done if not stack else None
        elif kind == "delim":
            if expect_item:
                raise _array_error(text, t.start(), f"unexpected {delim!r}")
        elif not expect_item:
            raise _array_error(text, t.start(), "element where a delimiter was expected")
        else:
            stack[-1].append(_element(t))
        expect_item = kind in ("open", "delim")
    if result is None or text[pos:].strip(" \t\n\r\v\f"):
        raise _array_error(text, pos, "malformed array")
    _check_shape(text, result)
    return result


def _element(t: re.Match[str]) -> str | None:
    quoted = t.group("quoted")
    if quoted is not None:
        return _ESCAPE_RE.sub(r"\1", quoted) if "\\" in quoted else quoted
    bare = t.group("bare")
    if "\\" in bare:  # an escaped \NULL is text
        return _ESCAPE_RE.sub(r"\1", bare)
    return None if bare.isascii() and bare.upper() == "NULL" else bare


def _check_shape(text: str, arr: list[Any]) -> None:
    """Every level holds only sub-arrays or only elements, sub-arrays of one size."""
    level = [arr]
    while level:
        subs = [x for a in level for x in a]
        nested = [isinstance(x, list) for x in subs]
        if any(nested) and not all(nested):
            raise _array_error(text, 0, "elements and sub-arrays mixed at one level")
        if not any(nested):
            return
        if len({len(a) for a in subs}) > 1:
            raise _array_error(text, 0, "sub-arrays of different sizes")
        level = subs


def _array_error(text: str, pos: int, what: str) -> ValueDecodeError:
    around = text[max(0, pos - 20) : pos + 20]
    return ValueDecodeError(f"array text: {what} at character {pos} (near {around!r})")


# ---------------------------------------------------------------------------- values

_INT_RE = re.compile(r"-?[0-9]+")
_FLOAT_RE = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_NUMERIC_RE = re.compile(r"-?[0-9]+(?:\.[0-9]+)?|NaN|-?Infinity")
_HEX_RE = re.compile(r"\\x((?:[0-9a-fA-F]{2})*)")
_BYTEA_ESCAPE_RE = re.compile(r"\\(\\|[0-3][0-7]{2})")
_DATE_RE = re.compile(r"[0-9]{4,}-[0-9]{2}-[0-9]{2}(?: BC)?|-?infinity")
_TIME_PART = r"([0-9]{4,}-[0-9]{2}-[0-9]{2}) ([0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,6})?)"
_TIMESTAMP_RE = re.compile(_TIME_PART + r"( BC)?")
_TIMESTAMPTZ_RE = re.compile(_TIME_PART + r"([+-][0-9]{2}(?::[0-9]{2}){0,2})( BC)?")
_INTERVAL_RE = re.compile(r"-?P[0-9A-Z.+-]*|-?infinity")
_SPECIAL_FLOATS = frozenset({"NaN", "Infinity", "-Infinity"})


def _int(text: str) -> int:
    if not _INT_RE.fullmatch(text) or len(text) > 20:
        raise ValueError("not an integer")
    return int(text)


def _float(text: str) -> float | str:
    if text in _SPECIAL_FLOATS:
        return text
    if not _FLOAT_RE.fullmatch(text):
        raise ValueError("not a float (is extra_float_digits=3?)")
    return float(text)


def _numeric(text: str) -> str:
    if not _NUMERIC_RE.fullmatch(text):
        raise ValueError("not a numeric")
    return text


def _bool(text: str) -> bool:
    if text not in ("t", "f"):
        raise ValueError("not 't' or 'f'")
    return text == "t"


def _bytea(text: str) -> str:
    m = _HEX_RE.fullmatch(text)
    if m is not None:
        raw = binascii.unhexlify(m.group(1))
    elif text.startswith("\\x"):
        raise ValueError("malformed hex bytea")
    else:  # the escape format (bytea_output=escape)
        if not text.isascii() or _BYTEA_ESCAPE_RE.sub("", text).count("\\"):
            raise ValueError("malformed escape-format bytea")
        raw = _BYTEA_ESCAPE_RE.sub(
            lambda e: "\\" if e.group(1) == "\\" else chr(int(e.group(1), 8)), text
        ).encode("latin-1")
    return base64.b64encode(raw).decode("ascii")


def _date(text: str) -> str:
    if not _DATE_RE.fullmatch(text):
        raise ValueError("not an ISO date (is DateStyle=ISO?)")
    return text


def _timestamp(text: str) -> str:
    if text in ("infinity", "-infinity"):
        return text
    m = _TIMESTAMP_RE.fullmatch(text)
    if m is None:
        raise ValueError("not an ISO timestamp (is DateStyle=ISO?)")
    return f"{m.group(1)}T{m.group(2)}{m.group(3) or ''}"


def _timestamptz(text: str) -> str:
    if text in ("infinity", "-infinity"):
        return text
    m = _TIMESTAMPTZ_RE.fullmatch(text)
    if m is None:
        raise ValueError("not an ISO timestamptz (is DateStyle=ISO?)")
    if m.group(3) != "+00":
        raise ValueError(f"offset {m.group(3)}, not UTC (is TimeZone=UTC?)")
    return f"{m.group(1)}T{m.group(2)}Z{m.group(4) or ''}"


def _interval(text: str) -> str:
    if not _INTERVAL_RE.fullmatch(text):
        raise ValueError("not an ISO 8601 interval (is IntervalStyle=iso_8601?)")
    return text


def _int_vector(text: str) -> list[int]:
    return [_int(t) for t in text.split()]


def _text(text: str) -> str:
    return text


Converter: TypeAlias = Callable[[str], Any]

_SCALARS: Final[dict[int, Converter]] = {
    16: _bool,
    17: _bytea,
    20: _int,
    21: _int,
    22: _int_vector,  # int2vector
    23: _int,
    26: _int,  # oid
    28: _int,  # xid
    29: _int,  # cid
    30: _int_vector,  # oidvector
    114: parse_json,
    700: _float,
    701: _float,
    1082: _date,
    1114: _timestamp,
    1184: _timestamptz,
    1186: _interval,
    1700: _numeric,
    3802: parse_json,
    5069: _int,  # xid8
}
_JSON_OIDS: Final = frozenset({114, 3802})  # json, jsonb
BOX_OID: Final = 603  # the one built-in type whose array delimiter is ';'

# Built-in array type -> element type (pg_type, oid < 10000, PostgreSQL 15).
BUILTIN_ARRAYS: Final[dict[int, int]] = {
    143: 142, 199: 114, 210: 71, 270: 75, 271: 5069, 272: 81, 273: 83, 629: 628, 651: 650,
    719: 718, 775: 774, 791: 790, 1000: 16, 1001: 17, 1002: 18, 1003: 19, 1005: 21, 1006: 22,
    1007: 23, 1008: 24, 1009: 25, 1010: 27, 1011: 28, 1012: 29, 1013: 30, 1014: 1042,
    1015: 1043, 1016: 20, 1017: 600, 1018: 601, 1019: 602, 1020: 603, 1021: 700, 1022: 701,
    1027: 604, 1028: 26, 1034: 1033, 1040: 829, 1041: 869, 1115: 1114, 1182: 1082,
    1183: 1083, 1185: 1184, 1187: 1186, 1263: 2275, 1270: 1266, 1561: 1560, 1563: 1562,
    1231: 1700, 2201: 1790, 2207: 2202, 2208: 2203, 2209: 2204, 2210: 2205, 2211: 2206,
    2949: 2970, 2951: 2950, 3221: 3220, 3643: 3614, 3644: 3642, 3645: 3615, 3735: 3734,
    3770: 3769, 3807: 3802, 3905: 3904, 3907: 3906, 3909: 3908, 3911: 3910, 3913: 3912,
    3927: 3926, 4073: 4072, 4090: 4089, 4097: 4096, 4192: 4191, 5039: 5038, 6150: 4451,
    6151: 4532, 6152: 4533, 6153: 4534, 6155: 4535, 6157: 4536,
}  # fmt: skip
BUILTIN_MAX_OID: Final = 10_000  # below: fixed by PostgreSQL; above: looked up


@dataclass(frozen=True)
class PgType:
    """One pg_type row as the decoder needs it.

    ``category``: 'D' for a domain (typtype 'd'), else typcategory ('A' array, 'E' enum, 'C'
    composite, 'R' range, 'B', 'N', 'S', 'U' ...). ``element_oid``: typelem (arrays);
    ``base_oid``: typbasetype (domains); 0 when not applicable.
    """

    oid: int
    name: str
    category: str
    element_oid: int
    base_oid: int

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> PgType:
        """From a ``ValueDecoder.TYPE_QUERY`` row: oid, typname, typtype, typcategory,
        typelem, typbasetype."""
        oid, name, typtype, category, elem, base = row
        return cls(
            oid=int(oid),
            name=str(name),
            category="D" if typtype == "d" else str(category),
            element_oid=int(elem),
            base_oid=int(base) if typtype == "d" else 0,
        )


_MAX_TYPE_DEPTH: Final = 32  # domains of domains, arrays of domains: far deeper is a cycle


class ValueDecoder:
    """Text values of a relation's columns as exact JSON-able values (the module's table).

    ``lookup(oid)`` resolves an OID that is not built in (it runs ``TYPE_QUERY`` and returns
    ``PgType.from_row(row)``, or None when there is no such type); each OID is looked up once.
    """

    TYPE_QUERY: ClassVar[str] = (
        "SELECT oid, typname, typtype, typcategory, typelem, typbasetype FROM pg_type"
        " WHERE oid = %s"
    )

    def __init__(
        self, lookup: Callable[[int], PgType | None] | None = None, *, json_text: bool = False
    ) -> None:
        self._lookup = lookup
        self._json_text = json_text  # json/jsonb as their text, not the parsed value
        self._types: dict[int, PgType | None] = {}
        self._converters: dict[int, Converter] = {}

    def value(self, type_oid: int, text: bytes) -> Any:
        """One value's text (as pgoutput sends it) as its JSON-able value."""
        try:
            s = text.decode() if isinstance(text, bytes) else bytes(text).decode()
        except UnicodeDecodeError as e:
            raise ValueDecodeError(f"type {type_oid}: value is not UTF-8 ({e.reason})") from None
        return self._convert(type_oid, s)

    def row(
        self, relation: Relation, data: tuple[Value, ...]
    ) -> tuple[dict[str, Any], tuple[str, ...]]:
        """(values by column name, unchanged-TOAST columns left out; their names)."""
        if len(data) != len(relation.columns):
            raise ProtocolError(
                f"{relation.qualified}: tuple has {len(data)} columns, "
                f"the relation message {len(relation.columns)}"
            )
        out: dict[str, Any] = {}
        unchanged: list[str] = []
        for col, raw in zip(relation.columns, data, strict=True):
            if raw is UNCHANGED_TOAST:
                unchanged.append(col.name)
            elif raw is None:
                out[col.name] = None
            else:
                try:
                    out[col.name] = self.value(col.type_oid, raw)
                except ValueDecodeError as e:
                    raise ValueDecodeError(f"{relation.qualified}.{col.name}: {e}") from None
        return out, tuple(unchanged)

    def _convert(self, type_oid: int, text: str) -> Any:
        convert = self._converters.get(type_oid)
        if convert is None:
            convert = self._converters[type_oid] = self._converter(type_oid, 0)
        try:
            return convert(text)
        except ValueDecodeError as e:
            raise ValueDecodeError(f"type {type_oid}: {e}") from None
        except ValueError as e:  # the converters' own checks (int, bytes.fromhex ...)
            raise ValueDecodeError(f"type {type_oid}: {e}: {text[:60]!r}") from None

    def _converter(self, oid: int, depth: int) -> Converter:
        if depth > _MAX_TYPE_DEPTH:
            raise ValueDecodeError(f"type {oid}: domains/arrays nested too deep (a cycle?)")
        if self._json_text and oid in _JSON_OIDS:
            return _text
        scalar = _SCALARS.get(oid)
        if scalar is not None:
            return scalar
        element = BUILTIN_ARRAYS.get(oid)
        if element is not None:
            return self._array_converter(element, depth)
        if oid < BUILTIN_MAX_OID:
            return _text
        t = self._type(oid)
        if t is None:
            return _text
        if t.base_oid:
            return self._converter(t.base_oid, depth + 1)
        if t.category == "A" and t.element_oid:
            return self._array_converter(t.element_oid, depth)
        return _text  # enum label, composite, range, extension types: as printed

    def _array_converter(self, element_oid: int, depth: int) -> Converter:
        convert = self._converter(element_oid, depth + 1)
        delim = ";" if self._base(element_oid, depth) == BOX_OID else ","

        def each(items: list[Any]) -> list[Any]:
            return [
                each(x) if isinstance(x, list) else None if x is None else convert(x) for x in items
            ]

        return lambda text: each(parse_array(text, delim))

    def _base(self, oid: int, depth: int) -> int:
        """The type under any domains (a domain's arrays use its base type's delimiter)."""
        for _ in range(_MAX_TYPE_DEPTH - depth):
            t = self._type(oid) if oid >= BUILTIN_MAX_OID else None
            if t is None or not t.base_oid:
                return oid
            oid = t.base_oid
        raise ValueDecodeError(f"type {oid}: domains nested too deep (a cycle?)")

    def _type(self, oid: int) -> PgType | None:
        if oid not in self._types:
            self._types[oid] = self._lookup(oid) if self._lookup is not None else None
        return self._types[oid]
