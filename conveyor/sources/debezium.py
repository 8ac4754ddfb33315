"""Debezium's change events for ``postgres_cdc`` (``format: debezium``): what Debezium's
PostgreSQL connector writes, as Kafka Connect's JsonConverter serializes it.

A table's ``TableCodec`` (built from its columns: type, typmod, NOT NULL, default) holds
the Kafka Connect schema of its key and its envelope and one ``Codec`` per column, which
turns the column's value as ``conveyor.sources.pgoutput`` decodes it (the same for snapshot
rows and the stream) into Debezium's encoding under Debezium's modes
(``decimal.handling.mode``, ``time.precision.mode``, ``binary.handling.mode``,
``interval.handling.mode``): ``numeric(12,3)`` 12.5 is ``"MNQ="`` with the scale in the
schema, a date the days since 1970-01-01, and so on (the logical types and their arithmetic
are ``conveyor.formats.debezium``'s). ``Envelope`` puts a change together: key, value
(``{"schema", "payload"}`` with ``schemas.enable``, else the bare event), the ``source``
block and the key-change headers. Which differences from Debezium remain, and why, is
docs/CONFIG.md's (``postgres_cdc``, "Debezium's consumers").
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from conveyor.formats import debezium as dbz

# PostgreSQL type OIDs the codecs tell apart.
BOOL, BYTEA, INT8, INT2, INT4, OID, JSON_OID, XML, POINT = 16, 17, 20, 21, 23, 26, 114, 142, 600
FLOAT4, FLOAT8, MONEY, DATE, TIME, TIMESTAMP = 700, 701, 790, 1082, 1083, 1114
TIMESTAMPTZ, INTERVAL, TIMETZ, BIT, VARBIT, NUMERIC = 1184, 1186, 1266, 1560, 1562, 1700
UUID_OID, TSVECTOR, JSONB = 2950, 3614, 3802
STRINGS: Final = frozenset(
    {18, 19, 25, 650, 774, 829, 869, 1042, 1043}  # char, name, text, cidr, macaddr8, macaddr,
)  # inet, bpchar, varchar
RANGES: Final = frozenset({3904, 3906, 3908, 3910, 3912, 3926})
# Array element types Debezium writes (others: the column is left out by Debezium).
ARRAY_ELEMENTS: Final = frozenset(
    {INT2, INT4, INT8, OID, 18, 25, 1042, 1043, NUMERIC, FLOAT4, FLOAT8, BOOL, DATE, 869, 650}
    | {829, 774, UUID_OID, JSON_OID, JSONB, TIME, TIMETZ, TIMESTAMP, TIMESTAMPTZ, BYTEA}
    | RANGES
)
TEXT_ARRAY_PLACEHOLDER: Final = frozenset({25, 1043, 1042, JSON_OID, JSONB})
INT_ARRAY_PLACEHOLDER: Final = frozenset({INT4, DATE, INT8})
VARIABLE_LENGTH: Final = 2_147_483_647  # a varbit without a length

SNAPSHOT_MARKERS: Final = (
    "true,first,first_in_data_collection,last_in_data_collection,last,false,incremental"
)
SOURCE_SCHEMA: Final[dict[str, Any]] = {
    "type": "struct",
    "fields": [
        {"type": "string", "optional": False, "field": "version"},
        {"type": "string", "optional": False, "field": "connector"},
        {"type": "string", "optional": False, "field": "name"},
        {"type": "int64", "optional": False, "field": "ts_ms"},
        {
            "type": "string",
            "optional": True,
            "name": dbz.ENUM,
            "version": 1,
            "parameters": {"allowed": SNAPSHOT_MARKERS},
            "default": "false",
            "field": "snapshot",
        },
        {"type": "string", "optional": False, "field": "db"},
        {"type": "string", "optional": True, "field": "sequence"},
        {"type": "int64", "optional": True, "field": "ts_us"},
        {"type": "int64", "optional": True, "field": "ts_ns"},
        {"type": "string", "optional": False, "field": "schema"},
        {"type": "string", "optional": False, "field": "table"},
        {"type": "int64", "optional": True, "field": "txId"},
        {"type": "int64", "optional": True, "field": "lsn"},
        {"type": "int64", "optional": True, "field": "xmin"},
        {"type": "string", "optional": True, "field": "origin"},
        {"type": "int64", "optional": True, "field": "origin_lsn"},
    ],
    "optional": False,
    "name": "io.debezium.connector.postgresql.Source",
    "version": 1,
    "field": "source",
}
TRANSACTION_SCHEMA: Final[dict[str, Any]] = {
    "type": "struct",
    "fields": [
        {"type": "string", "optional": False, "field": "id"},
        {"type": "int64", "optional": False, "field": "total_order"},
        {"type": "int64", "optional": False, "field": "data_collection_order"},
    ],
    "optional": True,
    "name": "event.block",
    "version": 1,
    "field": "transaction",
}
# A column's catalog facts the schema needs; ``TYPE_QUERY`` resolves domains, arrays, enums.
COLUMNS_QUERY: Final = (
    "SELECT a.attname, a.attnotnull, pg_get_expr(d.adbin, d.adrelid) FROM pg_attribute a "
    "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
    "LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
    "WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped"
)
TYPE_QUERY: Final = (
    "SELECT t.typname, t.typtype, t.typcategory, t.typelem::int, t.typbasetype::int, "
    "t.typtypmod, ARRAY(SELECT e.enumlabel::text FROM pg_enum e WHERE e.enumtypid = t.oid "
    "ORDER BY e.enumsortorder) FROM pg_type t WHERE t.oid = %s"
)


@dataclass(frozen=True)
class Modes:
    """Debezium's value modes (its property names, snake_cased) and its placeholder."""

    decimal: str = "precise"  # decimal.handling.mode: precise | string | double
    time: str = "adaptive"  # time.precision.mode: adaptive | adaptive_time_microseconds ...
    binary: str = "bytes"  # binary.handling.mode: bytes | base64 | base64-url-safe | hex
    interval: str = "numeric"  # interval.handling.mode: numeric | string
    placeholder: str = "__debezium_unavailable_value"  # unavailable.value.placeholder

    @property
    def placeholder_bytes(self) -> bytes:
        p = self.placeholder
        return bytes.fromhex(p[4:]) if p.startswith("hex:") else p.encode()


@dataclass(frozen=True)
class ColumnType:
    """A column's type as the codecs need it: domains resolved to their base type."""

    oid: int
    typmod: int = -1
    name: str = ""  # pg_type.typname (extension types: citext, ltree)
    labels: tuple[str, ...] | None = None  # an enum's labels, in order
    element: ColumnType | None = None  # an array's element type


@dataclass(frozen=True)
class Codec:
    """One column's Kafka Connect schema (without ``field``/``optional``), its encoder of
    decoded values, and its unchanged-TOAST placeholder."""

    schema: dict[str, Any]
    encode: Callable[[Any], Any]
    unchanged: Any = None
    items_optional: bool = True  # as an array's element


def codec(t: ColumnType, modes: Modes) -> Codec:
    """The codec of a column type under ``modes`` (Debezium's PostgresValueConverter)."""
    if t.labels is not None:
        allowed = {"allowed": ",".join(t.labels)}
        return Codec(_named("string", dbz.ENUM, allowed), str, modes.placeholder, False)
    if t.element is not None:
        return _array(t, modes)
    maker = _CODECS.get(t.oid)
    if maker is not None:
        return maker(t, modes)
    if t.name == "ltree":
        return Codec(_named("string", "io.debezium.data.Ltree"), str, modes.placeholder)
    if t.oid in STRINGS or t.oid in RANGES or t.name == "citext":
        return Codec({"type": "string"}, str, modes.placeholder)
    # Types Debezium leaves out (box, polygon, pg_lsn, interval[] ...): their text.
    return Codec({"type": "string"}, _as_text, modes.placeholder)


def _named(kind: str, name: str, parameters: dict[str, str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": kind, "name": name, "version": 1}
    if parameters:
        out["parameters"] = parameters
    return out


def _as_text(value: Any) -> Any:
    if isinstance(value, list):
        return json.dumps(value, separators=(",", ":"), default=str)
    return value if isinstance(value, str) else str(value)


def _plain(kind: str) -> Callable[[ColumnType, Modes], Codec]:
    return lambda _t, modes: Codec({"type": kind}, lambda v: v, modes.placeholder)


def _string(name: str) -> Callable[[ColumnType, Modes], Codec]:
    return lambda _t, modes: Codec(_named("string", name), str, modes.placeholder)


# -- numbers -------------------------------------------------------------------------------

_NUMERIC_SPECIAL: Final = {
    "NaN": ("NAN", "NaN"),
    "Infinity": ("POSITIVE_INFINITY", "Infinity"),
    "-Infinity": ("NEGATIVE_INFINITY", "-Infinity"),
}


def numeric_typmod(typmod: int) -> tuple[int, int] | None:
    """(precision, scale) of ``numeric(p,s)``; None without one."""
    if typmod < 4:
        return None
    t = typmod - 4
    return (t >> 16) & 0xFFFF, ((t & 0x7FF) ^ 1024) - 1024


def _numeric(t: ColumnType, modes: Modes) -> Codec:
    ps = numeric_typmod(t.typmod)
    if modes.decimal == "string":
        return Codec({"type": "string"}, _decimal_string, modes.placeholder)
    if modes.decimal == "double":
        return Codec({"type": "double"}, _decimal_double, modes.placeholder)
    if ps is None:
        fields = [
            {"type": "int32", "optional": False, "field": "scale"},
            {"type": "bytes", "optional": False, "field": "value"},
        ]
        schema = {"type": "struct", "fields": fields, "name": dbz.VARIABLE_DECIMAL, "version": 1}
        schema["doc"] = "Variable scaled decimal"
        return Codec(schema, _variable_decimal, modes.placeholder)
    precision, scale = ps
    params = {"scale": str(scale), "connect.decimal.precision": str(precision)}
    return Codec(
        _named("bytes", dbz.DECIMAL, params), lambda v: _fixed_decimal(v, scale), modes.placeholder
    )


def _decimal_string(text: str) -> str:
    special = _NUMERIC_SPECIAL.get(text)
    return special[0] if special else text


def _decimal_double(text: str) -> Any:
    special = _NUMERIC_SPECIAL.get(text)
    return special[1] if special else float(text)


def _fixed_decimal(text: str, scale: int) -> str | None:
    if text in _NUMERIC_SPECIAL:
        return None  # Debezium's precise mode has no NaN or infinity
    return base64.b64encode(dbz.decimal_bytes(unscaled_at(text, scale))).decode()


def unscaled_at(text: str, scale: int) -> int:
    """The unscaled integer of a decimal's text at ``scale`` (exact: no context precision;
    digits past the scale are cut, as the column's type already rounded them)."""
    whole, _, frac = text.partition(".")
    if scale <= 0:
        return (
            int(whole) // 10**-scale if not whole.startswith("-") else -(-int(whole) // 10**-scale)
        )
    return int(whole + frac.ljust(scale, "0")[:scale])


def _variable_decimal(text: str) -> dict[str, Any] | None:
    """Debezium's VariableScaleDecimal: the value with its trailing zeros stripped (an
    integer at scale 0)."""
    if text in _NUMERIC_SPECIAL:
        return None
    whole, _, frac = text.partition(".")
    frac = frac.rstrip("0")
    unscaled = int(whole + frac)
    return {"scale": len(frac), "value": base64.b64encode(dbz.decimal_bytes(unscaled)).decode()}


_MONEY_RE = re.compile(r"[^0-9.]")


def _money(_t: ColumnType, modes: Modes) -> Codec:
    if modes.decimal == "string":
        return Codec({"type": "string"}, lambda v: f"{_money_value(v):f}", modes.placeholder)
    if modes.decimal == "double":
        return Codec({"type": "double"}, lambda v: float(_money_value(v)), modes.placeholder)
    return Codec(
        _named("bytes", dbz.DECIMAL, {"scale": "2"}),
        lambda v: _fixed_decimal(str(_money_value(v)), 2),
        modes.placeholder,
    )


def _money_value(text: str) -> Decimal:
    """money as printed (``$1,234.56``, ``-$1.00``, ``($1.00)``) at 2 fraction digits."""
    negative = "-" in text or "(" in text
    try:
        value = Decimal(_MONEY_RE.sub("", text)).quantize(Decimal("0.01"))
    except InvalidOperation:
        raise ValueError(f"money {text!r} not read") from None
    return -value if negative else value


# -- dates and times -----------------------------------------------------------------------

_DATE_RE = re.compile(r"([0-9]{4,})-([0-9]{2})-([0-9]{2})( BC)?")
_CLOCK_RE = re.compile(r"([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,6}))?")
_OFFSET_RE = re.compile(r"([+-])([0-9]{2})(?::?([0-9]{2}))?(?::?([0-9]{2}))?")
_INTERVAL_RE = re.compile(
    r"P(?:(-?\d+)Y)?(?:(-?\d+)M)?(?:(-?\d+)D)?"
    r"(?:T(?:(-?\d+)H)?(?:(-?\d+)M)?(?:(-?)(\d+)(?:\.(\d{1,6}))?S)?)?"
)
DATE_INFINITY: Final = {"infinity": -2147472692, "-infinity": -2147472691}  # Debezium's stream
TIMESTAMP_INFINITY: Final = {"infinity": 9223372036825200000, "-infinity": -9223372036832400000}


def epoch_days(text: str) -> int:
    """A date as printed (``2024-01-31``, ``0044-03-15 BC``, ``infinity``) in days."""
    if text in DATE_INFINITY:
        return DATE_INFINITY[text]
    m = _DATE_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"date {text!r} not read")
    year = int(m.group(1))
    return dbz.days_from_civil(1 - year if m.group(4) else year, int(m.group(2)), int(m.group(3)))


def clock_us(text: str) -> int:
    m = _CLOCK_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"time {text!r} not read")
    h, mi, s, frac = m.groups()
    return ((int(h) * 60 + int(mi)) * 60 + int(s)) * 1_000_000 + int((frac or "").ljust(6, "0"))


def epoch_us(text: str) -> int:
    """A timestamp as decoded (``2024-01-31T12:00:00.5``, ``Z`` and `` BC`` allowed) in
    microseconds."""
    if text in TIMESTAMP_INFINITY:
        return TIMESTAMP_INFINITY[text]
    bc = text.endswith(" BC")
    date, _, rest = text.removesuffix(" BC").partition("T")
    days = epoch_days(date + (" BC" if bc else ""))
    return days * dbz.US_PER_DAY + clock_us(rest.removesuffix("Z"))


def iso_datetime(us: int, width: int | None = None) -> str:
    """Microseconds since the epoch as java.time's ISO text with ``Z``."""
    days, rest = divmod(us, dbz.US_PER_DAY)
    year, month, day = dbz.civil_from_days(days)
    s, frac = divmod(rest, 1_000_000)
    clock = f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}{dbz.fraction(frac, width)}"
    return f"{dbz.java_year(year)}-{month:02d}-{day:02d}T{clock}Z"


def _precision(t: ColumnType) -> int:
    return t.typmod if t.typmod >= 0 else 6


def _date(_t: ColumnType, modes: Modes) -> Codec:
    if modes.time == "isostring":

        def iso(v: str) -> str:
            year, month, day = dbz.civil_from_days(epoch_days(v))
            return f"{dbz.java_year(year)}-{month:02d}-{day:02d}Z"

        return Codec(_named("string", dbz.ISO_DATE), iso)
    name = dbz.CONNECT_DATE if modes.time == "connect" else dbz.DATE
    return Codec(_named("int32", name), epoch_days)


def _time(t: ColumnType, modes: Modes) -> Codec:
    p = _precision(t)
    if modes.time == "isostring":
        iso = _named("string", dbz.ISO_TIME)
        return Codec(iso, lambda v: dbz.clock(clock_us(v) % dbz.US_PER_DAY) + "Z")
    if modes.time == "connect":
        return Codec(_named("int32", dbz.CONNECT_TIME), lambda v: clock_us(v) // 1000)
    if modes.time == "adaptive" and p <= 3:
        return Codec(_named("int32", dbz.TIME_MS), lambda v: clock_us(v) // 1000)
    return Codec(_named("int64", dbz.MICRO_TIME), clock_us)


def _timetz(_t: ColumnType, _modes: Modes) -> Codec:
    return Codec(_named("string", dbz.ZONED_TIME), zoned_time)


def zoned_time(text: str) -> str:
    """A timetz as printed (``12:00:00.5+02``) in UTC, as Debezium's ZonedTime writes it."""
    m = _OFFSET_RE.search(text, 8)
    if m is None:
        raise ValueError(f"timetz {text!r} not read")
    sign = -1 if m.group(1) == "-" else 1
    offset = (int(m.group(2)) * 3600 + int(m.group(3) or 0) * 60 + int(m.group(4) or 0)) * sign
    us = (clock_us(text[: m.start()]) - offset * 1_000_000) % dbz.US_PER_DAY
    return dbz.clock(us) + "Z"


def _timestamp(t: ColumnType, modes: Modes) -> Codec:
    p = _precision(t)
    if modes.time == "isostring":
        return Codec(_named("string", dbz.ISO_TIMESTAMP), lambda v: iso_datetime(epoch_us(v)))
    if modes.time == "connect":
        return Codec(_named("int64", dbz.CONNECT_TIMESTAMP), lambda v: epoch_us(v) // 1000)
    if p <= 3:
        return Codec(_named("int64", dbz.TIMESTAMP_MS), lambda v: epoch_us(v) // 1000)
    return Codec(_named("int64", dbz.MICRO_TIMESTAMP), epoch_us)


def _timestamptz(t: ColumnType, _modes: Modes) -> Codec:
    width = _precision(t) or None  # timestamptz(0): as few digits as needed (none)

    def zoned(v: str) -> str:
        return v if v in TIMESTAMP_INFINITY else iso_datetime(epoch_us(v), width)

    return Codec(_named("string", dbz.ZONED_TIMESTAMP), zoned)


def interval_parts(text: str) -> tuple[int, int, int, int, int, float]:
    """(years, months, days, hours, minutes, seconds) of an ISO 8601 interval as printed
    (``P1Y2M3DT4H5M6.5S``), seconds as pgjdbc's PGInterval gives them."""
    m = _INTERVAL_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"interval {text!r} not read")
    y, mo, d, h, mi, neg, s, frac = m.groups()
    micros = int((frac or "").ljust(6, "0"))
    seconds = int(s or 0) + micros / 1_000_000.0
    parts = (int(y or 0), int(mo or 0), int(d or 0), int(h or 0), int(mi or 0))
    return (*parts, -seconds if neg else seconds)


def micro_duration(text: str) -> int:
    """Debezium's MicroDuration: a month is 365.25 / 12 days (in doubles, as Debezium)."""
    y, mo, d, h, mi, s = interval_parts(text)
    days = (y * 12 + mo) * dbz.DAYS_PER_MONTH_AVG + d
    return int(((((days * 24 + h) * 60) + mi) * 60 + s) * 1e6)


def iso_interval(text: str) -> str:
    """Debezium's Interval string: every part written, seconds without trailing zeros."""
    y, mo, d, h, mi, s = interval_parts(text)
    seconds = Decimal(repr(s)).normalize()
    return f"P{y}Y{mo}M{d}DT{h}H{mi}M{seconds:f}S"


def _interval(_t: ColumnType, modes: Modes) -> Codec:
    if modes.interval == "string":
        return Codec(_named("string", dbz.INTERVAL), iso_interval)
    return Codec(_named("int64", dbz.MICRO_DURATION), micro_duration)


# -- bytes, bits, geometry -----------------------------------------------------------------


def _bytea(_t: ColumnType, modes: Modes) -> Codec:
    raw = modes.placeholder_bytes
    if modes.binary == "hex":
        return Codec({"type": "string"}, lambda v: base64.b64decode(v).hex(), modes.placeholder)
    if modes.binary == "base64-url-safe":
        return Codec(
            {"type": "string"}, lambda v: base64.urlsafe_b64encode(base64.b64decode(v)).decode()
        )
    if modes.binary == "base64":
        return Codec({"type": "string"}, str)
    return Codec({"type": "bytes"}, str, base64.b64encode(raw).decode())


def _bits(t: ColumnType, modes: Modes) -> Codec:
    length = t.typmod if t.typmod > 0 else VARIABLE_LENGTH
    if length == 1:
        return Codec({"type": "boolean"}, lambda v: v == "1", modes.placeholder)
    params = {"length": str(length)}

    def bits(v: str) -> str:
        n = int(v, 2) if v else 0
        return base64.b64encode(n.to_bytes((n.bit_length() + 7) // 8, "little")).decode()

    return Codec(_named("bytes", dbz.BITS, params), bits, modes.placeholder)


def _point(_t: ColumnType, modes: Modes) -> Codec:
    fields = [
        {"type": "double", "optional": False, "field": "x"},
        {"type": "double", "optional": False, "field": "y"},
        {"type": "bytes", "optional": True, "field": "wkb"},
        {"type": "int32", "optional": True, "field": "srid"},
    ]
    schema = {"type": "struct", "fields": fields, "name": dbz.POINT, "version": 1}
    schema["doc"] = "Geometry (POINT)"

    def point(v: str) -> dict[str, Any]:
        x, _, y = v.strip("()").partition(",")
        wkb = base64.b64encode(dbz.point_wkb(float(x), float(y))).decode()
        return {"x": float(x), "y": float(y), "wkb": wkb, "srid": None}

    return Codec(schema, point, modes.placeholder)


# -- arrays --------------------------------------------------------------------------------


def _array(t: ColumnType, modes: Modes) -> Codec:
    assert t.element is not None
    element = t.element
    if element.labels is None and element.oid not in ARRAY_ELEMENTS and element.name != "citext":
        return Codec({"type": "string"}, _as_text, modes.placeholder)  # left out by Debezium
    inner = codec(ColumnType(element.oid, t.typmod, element.name, element.labels), modes)
    items = {**inner.schema, "optional": inner.items_optional}
    items = _ordered(items)
    encode = inner.encode

    def each(values: list[Any]) -> list[Any]:
        return [
            each(v) if isinstance(v, list) else None if v is None else encode(v) for v in values
        ]

    return Codec({"type": "array", "items": items}, each, _array_placeholder(element, modes))


def _array_placeholder(element: ColumnType, modes: Modes) -> Any:
    raw = modes.placeholder_bytes
    if element.oid in TEXT_ARRAY_PLACEHOLDER:
        return [modes.placeholder]
    if element.oid in INT_ARRAY_PLACEHOLDER:
        return [b - 256 if b > 127 else b for b in raw]
    if element.oid == BYTEA:
        return [base64.b64encode(raw).decode()]
    if element.oid == UUID_OID:
        return [str(uuid.UUID(bytes=hashlib.md5(raw).digest(), version=3))]  # noqa: S324
    return modes.placeholder


_CODECS: Final[dict[int, Callable[[ColumnType, Modes], Codec]]] = {
    BOOL: _plain("boolean"),
    INT2: _plain("int16"),
    INT4: _plain("int32"),
    INT8: _plain("int64"),
    OID: _plain("int64"),
    FLOAT4: _plain("float"),
    FLOAT8: _plain("double"),
    NUMERIC: _numeric,
    MONEY: _money,
    JSON_OID: _string(dbz.JSON),
    JSONB: _string(dbz.JSON),
    UUID_OID: _string(dbz.UUID),
    XML: _string(dbz.XML),
    TSVECTOR: _string(dbz.TSVECTOR),
    BYTEA: _bytea,
    DATE: _date,
    TIME: _time,
    TIMETZ: _timetz,
    TIMESTAMP: _timestamp,
    TIMESTAMPTZ: _timestamptz,
    INTERVAL: _interval,
    BIT: _bits,
    VARBIT: _bits,
    POINT: _point,
}

_KEY_ORDER: Final = ("type", "fields", "items", "optional", "name", "version", "doc")
_KEY_ORDER_END: Final = ("parameters", "default", "field")


def _ordered(schema: dict[str, Any]) -> dict[str, Any]:
    """Keys in JsonConverter's order (type, fields/items, optional, name, version, doc,
    parameters, default, field)."""
    keys = [*_KEY_ORDER, *_KEY_ORDER_END]
    return {k: schema[k] for k in keys if k in schema}


# -- tables --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A column of a captured table: its name, type, NOT NULL and default expression."""

    name: str
    type: ColumnType
    optional: bool = True
    default: str | None = None  # pg_get_expr of its default, when it has one


_LITERAL_RE = re.compile(r"'((?:[^']|'')*)'(?:::[\w .\"\[\]()]+)?|(-?[0-9]+(?:\.[0-9]+)?)")


def default_literal(expression: str | None) -> str | None:
    """A default's constant as PostgreSQL prints its type (``'abc'::text`` -> ``abc``,
    ``5``, ``true`` -> ``t``); None for an expression (now(), nextval(...))."""
    if expression is None:
        return None
    if expression in ("true", "false"):
        return expression[0]
    m = _LITERAL_RE.fullmatch(expression)
    if m is None:
        return None
    return m.group(2) if m.group(2) is not None else m.group(1).replace("''", "'")


@dataclass
class TableCodec:
    """One table's codecs and Kafka Connect schemas (key, value envelope), JSON-ready."""

    server: str
    table: str  # schema.table
    columns: list[Column]
    key: list[str]
    modes: Modes
    decode_default: Callable[[ColumnType, str], Any] | None = None
    codecs: dict[str, Codec] = field(init=False)
    key_schema: dict[str, Any] = field(init=False)
    value_schema: dict[str, Any] = field(init=False)
    schema_json: tuple[str, str] | None = field(default=None, init=False)  # key's, value's

    def __post_init__(self) -> None:
        self.codecs = {c.name: codec(c.type, self.modes) for c in self.columns}
        by_name = {c.name: c for c in self.columns}
        prefix = f"{self.server}.{self.table}"
        key_fields = [self._field(by_name[k]) for k in self.key if k in by_name]
        self.key_schema = {
            "type": "struct",
            "fields": key_fields,
            "optional": False,
            "name": f"{prefix}.Key",
        }
        row = {
            "type": "struct",
            "fields": [self._field(c) for c in self.columns],
            "optional": True,
            "name": f"{prefix}.Value",
        }
        self.value_schema = {
            "type": "struct",
            "fields": [
                {**row, "field": "before"},
                {**row, "field": "after"},
                SOURCE_SCHEMA,
                TRANSACTION_SCHEMA,
                {"type": "string", "optional": False, "field": "op"},
                *({"type": "int64", "optional": True, "field": f} for f in _TS),
            ],
            "optional": False,
            "name": f"{prefix}.Envelope",
            "version": 2,
        }

    def _field(self, column: Column) -> dict[str, Any]:
        c = self.codecs[column.name]
        out = {**c.schema, "optional": column.optional, "field": column.name}
        default = self._default(column, c)
        if default is not None:
            out["default"] = default
        return _ordered(out)

    def _default(self, column: Column, c: Codec) -> Any:
        literal = default_literal(column.default)
        if literal is None or self.decode_default is None:
            return None
        try:
            return c.encode(self.decode_default(column.type, literal))
        except ValueError:
            return None  # a default Debezium would not read either: none in the schema

    def row(self, values: dict[str, Any] | None, unchanged: tuple[str, ...] = ()) -> Any:
        """Every column in table order: its encoded value, Debezium's placeholder for a
        TOASTed value the change left out, null for a column the change does not carry."""
        if values is None:
            return None
        out: dict[str, Any] = {}
        for c in self.columns:
            v = values.get(c.name)
            if c.name in unchanged:
                out[c.name] = self.codecs[c.name].unchanged
            else:
                out[c.name] = None if v is None else self.codecs[c.name].encode(v)
        return out

    def key_of(self, values: dict[str, Any]) -> dict[str, Any]:
        return {
            k: None if values.get(k) is None else self.codecs[k].encode(values[k]) for k in self.key
        }


_TS: Final = ("ts_ms", "ts_us", "ts_ns")


NEW_KEY_HEADER: Final = "__debezium.newkey"
OLD_KEY_HEADER: Final = "__debezium.oldkey"


@dataclass
class Envelope:
    """Debezium change events as message bytes: key, value and headers (JsonConverter)."""

    server: str  # topic.prefix: source.name and the schemas' names
    version: str
    schemas: bool  # JsonConverter's schemas.enable: {"schema", "payload"}

    def key(self, tc: TableCodec, key: dict[str, Any] | None) -> bytes | None:
        if key is None:
            return None
        return self._wrap(self._schemas(tc)[0], _dumps(key))

    def value(
        self,
        tc: TableCodec,
        op: str,
        before: Any,
        after: Any,
        source: dict[str, Any],
        now_ns: int,
        transaction: dict[str, Any] | None = None,
    ) -> bytes:
        event = {
            "before": before,
            "after": after,
            "source": source,
            "transaction": transaction,
            "op": op,
            "ts_ms": now_ns // 1_000_000,
            "ts_us": now_ns // 1000,
            "ts_ns": now_ns,
        }
        return self._wrap(self._schemas(tc)[1], _dumps(event))

    def source(
        self,
        table: str,
        *,
        db: str,
        ts_us: int,
        snapshot: str,
        last_commit: int | None,
        lsn: int,
        txid: int | None,
        origin: tuple[str, int] | None = None,
    ) -> dict[str, Any]:
        """The ``source`` block (``io.debezium.connector.postgresql.Source``)."""
        schema, _, name = table.partition(".")
        sequence = [None if last_commit is None else str(last_commit), str(lsn)]
        return {
            "version": self.version,
            "connector": "postgresql",
            "name": self.server,
            "ts_ms": ts_us // 1000,
            "snapshot": snapshot,
            "db": db,
            "sequence": json.dumps(sequence, separators=(",", ":")),
            "ts_us": ts_us,
            "ts_ns": ts_us * 1000,
            "schema": schema,
            "table": name,
            "txId": txid,
            "lsn": lsn,
            "xmin": None,
            "origin": None if origin is None else origin[0],
            "origin_lsn": None if origin is None else origin[1],
        }

    def _schemas(self, tc: TableCodec) -> tuple[str, str]:
        if tc.schema_json is None:
            tc.schema_json = (_dumps(tc.key_schema), _dumps(tc.value_schema))
        return tc.schema_json

    def _wrap(self, schema: str, payload: str) -> bytes:
        if not self.schemas:
            return payload.encode()
        return f'{{"schema":{schema},"payload":{payload}}}'.encode()


def _dumps(value: Any) -> str:
    from conveyor.sources.strict_json import dumps

    return dumps(value)


def snapshot_marker(first: bool, last: bool, first_in_table: bool, last_in_table: bool) -> str:
    """Debezium's ``source.snapshot`` of a snapshot row (its SnapshotMarkerResolver)."""
    if last:
        return "last"
    if first:
        return "first"
    if last_in_table:
        return "last_in_data_collection"
    return "first_in_data_collection" if first_in_table else "true"
