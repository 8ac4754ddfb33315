"""Debezium's value encodings (Kafka Connect logical types), both ways, pure.

Debezium writes a column's value by its Kafka Connect schema: a ``numeric(12,3)`` as the
unscaled integer's two's-complement bytes with the scale in the schema
(``org.apache.kafka.connect.data.Decimal``), a ``date`` as days since 1970-01-01
(``io.debezium.time.Date``), a ``timestamp(6)`` as microseconds (``MicroTimestamp``) and so
on; JsonConverter then writes bytes as base64 and, with ``schemas.enable``, the schema
beside the payload (``{"schema": ..., "payload": ...}``). This module holds what both sides
of Conveyor need of that: the logical names, the calendar and decimal arithmetic
(``conveyor.sources.debezium`` encodes PostgreSQL's values with them), and
``plain_event`` / ``plain_value``, which turn such an encoded event back into plain values
by its schema (the sink side's ``transform.envelope: debezium``):

| logical type (schema ``name``) | encoded | plain |
|---|---|---|
| Decimal (bytes, ``scale``) | ``"AL68IA=="`` | ``"12.500"`` (exact, the scale's digits) |
| VariableScaleDecimal | ``{"scale": 5, "value": "BMsv"}`` | ``"3.14159"`` |
| Date, connect Date (days) / IsoDate | ``19753`` / ``"2024-01-31Z"`` | ``"2024-01-31"`` (``"0044-03-15 BC"``) |
| Time (ms), MicroTime, NanoTime, connect Time / IsoTime | ``43200500000`` | ``"12:00:00.5"`` |
| Timestamp (ms), MicroTimestamp, NanoTimestamp, connect Timestamp / IsoTimestamp | ``1706702400500000`` | ``"2024-01-31T12:00:00.5"`` |
| ZonedTimestamp | ``"-0043-03-15T12:00:00.000000Z"`` | ``"0044-03-15T12:00:00.000000Z BC"`` (other values as they are) |
| MicroDuration (interval, numeric mode) | ``-93600000000`` | ``"PT-93600S"`` |
| Bits (bytes, little-endian, ``length``) | ``"Cg=="`` | ``"1010"`` |
| geometry.Point | ``{"x": 1.5, "y": 2.0, "wkb": ..}`` | ``"(1.5,2.0)"`` |
| arrays of these | lists | lists of plain values |

Debezium's encodings of ``infinity`` and ``-infinity`` (dates, timestamps: fixed far-off
values) become those words. Anything else (strings, numbers, plain bytes as base64,
``Json``, ``ZonedTime``, ``Interval``, ``Enum``, ``Uuid``, an unknown name) stays as it
is. The plain forms are what PostgreSQL reads back and what ``format: conveyor`` writes.
A value that does not fit its schema (bytes that are not base64, a date out of range, a
scale beyond PostgreSQL's) raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from typing import Any, Final

DECIMAL: Final = "org.apache.kafka.connect.data.Decimal"
VARIABLE_DECIMAL: Final = "io.debezium.data.VariableScaleDecimal"
DATE: Final = "io.debezium.time.Date"
TIME_MS: Final = "io.debezium.time.Time"
MICRO_TIME: Final = "io.debezium.time.MicroTime"
NANO_TIME: Final = "io.debezium.time.NanoTime"
TIMESTAMP_MS: Final = "io.debezium.time.Timestamp"
MICRO_TIMESTAMP: Final = "io.debezium.time.MicroTimestamp"
NANO_TIMESTAMP: Final = "io.debezium.time.NanoTimestamp"
ZONED_TIMESTAMP: Final = "io.debezium.time.ZonedTimestamp"
ZONED_TIME: Final = "io.debezium.time.ZonedTime"
ISO_DATE: Final = "io.debezium.time.IsoDate"
ISO_TIME: Final = "io.debezium.time.IsoTime"
ISO_TIMESTAMP: Final = "io.debezium.time.IsoTimestamp"
MICRO_DURATION: Final = "io.debezium.time.MicroDuration"
INTERVAL: Final = "io.debezium.time.Interval"
CONNECT_DATE: Final = "org.apache.kafka.connect.data.Date"
CONNECT_TIME: Final = "org.apache.kafka.connect.data.Time"
CONNECT_TIMESTAMP: Final = "org.apache.kafka.connect.data.Timestamp"
JSON: Final = "io.debezium.data.Json"
UUID: Final = "io.debezium.data.Uuid"
XML: Final = "io.debezium.data.Xml"
TSVECTOR: Final = "io.debezium.data.Tsvector"
ENUM: Final = "io.debezium.data.Enum"
BITS: Final = "io.debezium.data.Bits"
POINT: Final = "io.debezium.data.geometry.Point"

DAYS_PER_MONTH_AVG: Final = 365.25 / 12.0  # MicroDuration's month
US_PER_DAY: Final = 86_400_000_000
# How Debezium writes PostgreSQL's infinities (pgjdbc's constants read as its units). A
# date: the stream's, then the snapshot's (pgjdbc reads those differently).
DATE_INFINITY: Final = {-2147472692: "infinity", -2147472691: "-infinity"}
DATE_INFINITY_SNAPSHOT: Final = {-622191234: "infinity", -625821272: "-infinity"}
ISO_DATE_INFINITY: Final = {
    "-5877611-06-21Z": "infinity",
    "-5877611-06-22Z": "-infinity",
    "+292278994-08-16Z": "infinity",
    "+292269055-12-02Z": "-infinity",
}
TIMESTAMP_INFINITY_US: Final = {9223372036825200000: "infinity", -9223372036832400000: "-infinity"}
ISO_TIMESTAMP_INFINITY: Final = {
    "+294247-01-10T04:00:25.2Z": "infinity",
    "-290308-12-21T19:59:27.6Z": "-infinity",
}
MAX_SCALE: Final = 16_383  # PostgreSQL's numeric: digits after the point
MAX_DECIMAL_BYTES: Final = 8_192  # an unscaled value of ~19,700 digits (numeric's 131,072 + 16,383)
_NAMES_TO_PLAIN: Final = (  # a payload naming none of these needs no conversion
    b"org.apache.kafka.connect.data.",
    b"io.debezium.time.",
    b"io.debezium.data.VariableScaleDecimal",
    b"io.debezium.data.Bits",
    b"io.debezium.data.geometry.Point",
)


# -- calendar ----------------------------------------------------------------------------


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (``year`` astronomical: 1 BC is 0)."""
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    return era * 146097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719468


def civil_from_days(days: int) -> tuple[int, int, int]:
    """(astronomical year, month, day) of a day count since 1970-01-01."""
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, doy - (153 * mp + 2) // 5 + 1


def java_year(year: int) -> str:
    """A year as java.time's ISO formatters write it: 4 digits at least, '+' past 9999, '-'
    before year 0."""
    if year > 9999:
        return f"+{year}"
    return f"-{-year:04d}" if year < 0 else f"{year:04d}"


def fraction(us: int, width: int | None = None) -> str:
    """Microseconds as a second's fraction: ``width`` digits, or as few as needed (none for 0)."""
    digits = f"{us:06d}"
    if width is None:
        digits = digits.rstrip("0")
        return f".{digits}" if digits else ""
    return "." + (digits + "000")[:width] if width > 0 else ""


def clock(us: int) -> str:
    """Microseconds into a day as ``HH:MM:SS[.f]`` (24:00:00 kept)."""
    s, us = divmod(us, 1_000_000)
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}{fraction(us)}"


def _pg_date(days: int) -> str:
    year, month, day = civil_from_days(days)
    if year <= 0:
        return f"{1 - year:04d}-{month:02d}-{day:02d} BC"
    return f"{year:04d}-{month:02d}-{day:02d}"


def _pg_timestamp(us: int) -> str:
    days, rest = divmod(us, US_PER_DAY)
    date = _pg_date(days)
    if date.endswith(" BC"):
        return f"{date[:-3]}T{clock(rest)} BC"
    return f"{date}T{clock(rest)}"


_SIGNED_YEAR_RE = re.compile(r"([+-])([0-9]{4,})-(.*)", re.S)


def _pg_iso(text: str) -> str:
    """java.time's ISO date (or date-time) text, its year signed, as PostgreSQL writes it
    (``-0043-..`` is ``0044-.. BC``; a ``Z`` offset stays); other text as it is."""
    m = _SIGNED_YEAR_RE.fullmatch(text)
    if m is None:
        return text
    sign, year, rest = m.groups()
    return f"{year}-{rest}" if sign == "+" else f"{1 + int(year):04d}-{rest} BC"


# -- decimals ----------------------------------------------------------------------------


def decimal_bytes(unscaled: int) -> bytes:
    """A BigInteger's ``toByteArray``: big-endian two's complement, as short as it goes."""
    return unscaled.to_bytes(unscaled.bit_length() // 8 + 1, "big", signed=True)


def unscaled_of(encoded: str) -> int:
    """The unscaled integer of a Decimal's base64 bytes."""
    raw = base64.b64decode(encoded, validate=True)
    if len(raw) > MAX_DECIMAL_BYTES:
        raise ValueError(f"a decimal of {len(raw)} bytes")
    return int.from_bytes(raw, "big", signed=True)


def plain_decimal(unscaled: int, scale: int) -> str:
    """``unscaled * 10**-scale`` written out, with the scale's digits (BigDecimal's
    ``toPlainString``; exact, whatever the number of digits)."""
    if not -MAX_SCALE <= scale <= MAX_SCALE:
        raise ValueError(f"decimal scale {scale} out of range")
    sign, digits = ("-", str(-unscaled)) if unscaled < 0 else ("", str(unscaled))
    if scale <= 0:
        return sign + digits + "0" * -scale if unscaled else "0"
    digits = digits.rjust(scale + 1, "0")
    return f"{sign}{digits[:-scale]}.{digits[-scale:]}"


# -- the sink side: an encoded event as plain values ----------------------------------------


def needs_plain(payload: bytes) -> bool:
    """Whether a message may carry values ``plain_event`` changes (a schema part naming a
    logical type to convert); cheap, so that other payloads are never parsed here."""
    return b'"schema"' in payload and any(n in payload for n in _NAMES_TO_PLAIN)


def plain_event(doc: Any) -> Any:
    """A JsonConverter document ``{"schema", "payload"}`` of a Debezium change event as the
    bare event with ``before`` and ``after`` in plain values; anything else unchanged."""
    if not (isinstance(doc, dict) and isinstance(doc.get("schema"), dict) and "payload" in doc):
        return doc
    event = doc["payload"]
    fields = doc["schema"].get("fields")
    if not isinstance(event, dict) or not isinstance(fields, list):
        return doc
    out = dict(event)
    for f in fields:
        if isinstance(f, dict) and f.get("field") in ("before", "after"):
            name = f["field"]
            if isinstance(out.get(name), dict):
                out[name] = plain_value(f, out[name], name)
    return out


def plain_value(schema: dict[str, Any], value: Any, path: str = "value") -> Any:
    """``value`` written by ``schema`` (a JsonConverter field schema) as its plain value."""
    if value is None or not isinstance(schema, dict):
        return value
    kind = schema.get("type")
    if kind == "struct" and schema.get("name") not in _STRUCTS:
        return _plain_struct(schema, value, path)
    if kind == "array" and isinstance(value, list):
        items = schema.get("items")
        return [plain_value(items, v, f"{path}[]") for v in value] if items else value
    convert = _PLAIN.get(schema.get("name", ""))
    if convert is None:
        return value
    try:
        return convert(value, schema.get("parameters") or {})
    except (ValueError, TypeError, KeyError, OverflowError, binascii.Error) as e:
        raise ValueError(f"{path}: not a {schema['name']} ({e})") from None


def _plain_struct(schema: dict[str, Any], value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for f in schema.get("fields") or []:
        if isinstance(f, dict) and f.get("field") in out:
            out[f["field"]] = plain_value(f, out[f["field"]], f"{path}.{f['field']}")
    return out


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{type(value).__name__}, not an integer")
    return value


def _decimal(value: Any, params: dict[str, Any]) -> str:
    return plain_decimal(unscaled_of(value), int(params["scale"]))


def _variable_decimal(value: Any, _params: dict[str, Any]) -> str:
    return plain_decimal(unscaled_of(value["value"]), _int(value["scale"]))


def _date(value: Any, _params: dict[str, Any]) -> str:
    days = _int(value)
    special = DATE_INFINITY.get(days) or DATE_INFINITY_SNAPSHOT.get(days)
    return special or _pg_date(days)


def _iso_date(value: Any, _params: dict[str, Any]) -> str:
    if value in ISO_DATE_INFINITY:
        return ISO_DATE_INFINITY[value]
    return _pg_iso(value.removesuffix("Z"))


def _time(scale: int) -> Any:
    return lambda value, _params: clock(_int(value) * 1000 // scale)


def _iso_time(value: Any, _params: dict[str, Any]) -> str:
    return str(value).removesuffix("Z")


def _timestamp(scale: int) -> Any:
    def convert(value: Any, _params: dict[str, Any]) -> str:
        us = _int(value) * 1000 // scale
        return TIMESTAMP_INFINITY_US.get(us) or _pg_timestamp(us)

    return convert


def _iso_timestamp(value: Any, _params: dict[str, Any]) -> str:
    if value in ISO_TIMESTAMP_INFINITY:
        return ISO_TIMESTAMP_INFINITY[value]
    text = _pg_iso(value)
    if text.endswith(" BC"):
        return text[:-3].removesuffix("Z") + " BC"
    return text.removesuffix("Z")


def _zoned_timestamp(value: Any, _params: dict[str, Any]) -> str:
    text = _pg_iso(value)
    return text[:-3] + " BC" if text.endswith(" BC") else text


def _micro_duration(value: Any, _params: dict[str, Any]) -> str:
    us = _int(value)
    sign, us = ("-", -us) if us < 0 else ("", us)
    s, us = divmod(us, 1_000_000)
    return f"PT{sign}{s}{fraction(us)}S"


def _bits(value: Any, params: dict[str, Any]) -> str:
    raw = base64.b64decode(value, validate=True)
    n = int.from_bytes(raw, "little")
    length = int(params.get("length", 0))
    bits = format(n, "b") if n else ""
    if 0 < length <= 83_886_080 and length != 2_147_483_647:  # bit(n): n digits
        bits = bits.zfill(length)
    return bits


def _point(value: Any, _params: dict[str, Any]) -> str:
    return f"({float(value['x'])!r},{float(value['y'])!r})"


_PLAIN: Final[dict[str, Any]] = {
    DECIMAL: _decimal,
    VARIABLE_DECIMAL: _variable_decimal,
    DATE: _date,
    CONNECT_DATE: _date,
    ISO_DATE: _iso_date,
    TIME_MS: _time(1),
    CONNECT_TIME: _time(1),
    MICRO_TIME: _time(1000),
    NANO_TIME: _time(1_000_000),
    ISO_TIME: _iso_time,
    TIMESTAMP_MS: _timestamp(1),
    CONNECT_TIMESTAMP: _timestamp(1),
    MICRO_TIMESTAMP: _timestamp(1000),
    NANO_TIMESTAMP: _timestamp(1_000_000),
    ISO_TIMESTAMP: _iso_timestamp,
    ZONED_TIMESTAMP: _zoned_timestamp,
    MICRO_DURATION: _micro_duration,
    BITS: _bits,
    POINT: _point,
}
_STRUCTS: Final = frozenset({VARIABLE_DECIMAL, POINT})  # structs converted as one value


def point_wkb(x: float, y: float) -> bytes:
    """A point as little-endian WKB (Debezium's ``geometry.Point`` ``wkb``)."""
    return b"\x01" + struct.pack("<Idd", 1, x, y)
