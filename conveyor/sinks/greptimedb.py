"""GreptimeDB sink: InfluxDB line protocol over GreptimeDB's HTTP API (requests).

One ``POST /v1/influxdb/api/v2/write?db=<database>&precision=<p>`` per batch; GreptimeDB
answers 204 once the rows are written, and only then does ``send_batch`` return. Tables
are created and columns added by GreptimeDB itself: tags become the primary key, fields
the value columns, the timestamp the time index (``greptime_timestamp``).

Why line protocol over HTTP rather than the PostgreSQL port: it needs no SQL generation
or identifier quoting, GreptimeDB creates and widens tables from it, one request carries
a whole batch, and ``requests`` is the only dependency.

Escaping follows the InfluxDB line protocol as GreptimeDB parses it (its parser comes
from InfluxDB IOx): in the measurement, backslash, comma and space are escaped; in tag
keys, tag values and field keys, backslash, comma, equals sign and space; string field
values are double-quoted with backslash and double quote escaped. Backslashes are
escaped too, so a value ending in a backslash or containing ``\\,`` survives. Raw
newlines, carriage returns and (outside string fields) tabs cannot be escaped: see the
``newlines`` option.

Idempotence: GreptimeDB keeps one row per (tags, timestamp) (the last write wins), so a
replayed batch overwrites its own rows as long as tags + timestamp identify a message.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field, SecretStr, field_validator, model_validator

from conveyor.core.asset_keys import key_part
from conveyor.core.errors import (
    BatchRejected,
    ConfigError,
    PermanentSinkError,
    SinkError,
    TransientSinkError,
    rule,
)
from conveyor.core.trust import paths
from conveyor.core.trust.references import known_now
from conveyor.sinks import templates
from conveyor.sinks.base import (
    Record,
    RowFailure,
    SendResult,
    Sink,
    SinkConfig,
    credential_rules,
    iter_records,
    mapped_errors,
    payload_columns,
    secret,
    text_of,
)

log = logging.getLogger("conveyor.sinks.greptimedb")

Precision = Literal["s", "ms", "us", "ns"]
NANOS: dict[str, int] = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}
META_SOURCES = ("$key", "$topic", "$partition", "$offset")
#: What a measurement template may use.
MEASUREMENT_FIELDS = ("topic", "destination")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# GreptimeDB status codes (common_error::StatusCode) sent in x-greptime-err-code or "code".
PERMANENT_CODES = frozenset({4001, 4002, 4004, 7000, 7001, 7002, 7003, 7004, 7005, 7006})
TRANSIENT_CODES = frozenset({1005, 4007, 4008, 4009, 5000, 6000, 6001})


class GreptimeDBSinkConfig(SinkConfig):
    """Rows into a GreptimeDB table through the InfluxDB line protocol."""

    type: Literal["greptimedb"] = "greptimedb"
    url: str = Field(description="Base URL of GreptimeDB's HTTP API, e.g. http://127.0.0.1:4000.")
    database: str = Field(default="public", description="Database (GreptimeDB schema) to write to.")
    measurement: str = Field(
        description="Table (measurement) name or template: ${topic} (source topic), ${destination} (the row's __destination).",
    )

    @field_validator("measurement", mode="before")
    @classmethod
    def _upgrade_measurement(cls, v: Any) -> Any:
        return templates.upgrade_legacy(v, "sink.measurement")

    tags: dict[str, str] = Field(
        default_factory=dict,
        description="Tag (primary key column) -> source: a payload column, or $key, $topic, $partition, $offset. "
        "Null or empty values leave the tag out.",
    )
    fields: dict[str, str] | None = Field(
        default=None,
        description="Field column -> source (a payload column, or $key, $topic, $partition, $offset). "
        "Default: every payload column not used as a tag or as the timestamp.",
    )
    timestamp: str = Field(
        default="$timestamp",
        description="Where the time index comes from: $timestamp (the message timestamp) or a payload column "
        "(datetime, ISO 8601 text, or a number in timestamp_unit).",
    )
    timestamp_unit: Precision = Field(
        default="ms", description="Unit of a numeric payload timestamp column."
    )
    precision: Precision = Field(
        default="ms",
        description="Precision of the timestamps sent (s, ms, us, ns); finer parts are truncated.",
    )
    newlines: Literal["reject", "replace", "keep"] = Field(
        default="reject",
        description="CR/LF in values (and tabs outside string fields), which line protocol cannot escape: "
        "reject (the row is a data error), replace (by a space), or keep (raw inside string field values, "
        "which GreptimeDB's parser accepts; still rejected in names and tags).",
    )
    username: str | None = Field(
        default=None,
        description="User (with `password`), sent as 'Authorization: token user:password'.",
    )
    password: SecretStr | None = Field(default=None, description="Password (secret).")
    token: SecretStr | None = Field(
        default=None,
        description="InfluxDB v2 token sent as 'Authorization: token <token>' (for GreptimeDB: 'user:password'); secret.",
    )
    tls_ca_file: str | None = Field(default=None, description="CA bundle to verify an https URL.")
    verify_tls: bool = Field(default=True, description="Verify the server's TLS certificate.")
    timeout_s: float = Field(
        default=30.0, gt=0, le=3600, description="Timeout of one HTTP request (connect and read)."
    )

    def asset_key_path(self) -> list[str]:
        table = templates.static_text(self.measurement, "x")
        return [
            "greptimedb",
            key_part(self.database),
            key_part(table, "_"),
        ]

    def kind(self) -> str:
        return "greptimedb"

    @model_validator(mode="after")
    def _rules(self) -> GreptimeDBSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        self._url_rules()
        self._database_rules()
        if known_now(self.measurement):
            self._measurement_rules()
        self._tag_rules()
        if self.fields is not None:
            self._field_rules(self.fields)
        self._timestamp_rules()
        self._auth_rules()
        return self

    def _url_rules(self) -> None:
        """The URL is an http(s) base URL without credentials."""
        rule(
            not known_now(self.url) or bool(re.match(r"^https?://[^\s/]+", self.url)),
            "must be an http:// or https:// base URL",
            field="url",
        )
        rule(
            not known_now(self.url) or "@" not in self.url.split("//", 1)[-1].split("/", 1)[0],
            "credentials do not belong in the URL (it is not secret); use username/password or token",
            field="url",
        )

    def _database_rules(self) -> None:
        """The database is a name that can go in a query string."""
        rule(
            not known_now(self.database)
            or (bool(self.database.strip()) and not re.search(r"[\s&?#/]", self.database)),
            "must be a database name",
            field="database",
        )

    def _measurement_rules(self) -> None:
        """The measurement is a table name or a valid template, on one line."""
        problems = templates.problems(self.measurement, MEASUREMENT_FIELDS)
        rule(not problems, "; ".join(problems), field="measurement")
        static = templates.static_text(self.measurement)
        rule(
            bool(self.measurement.strip()) and "{" not in static and "}" not in static,
            "must be a table name or template",
            field="measurement",
        )
        rule(
            not _LINE_BREAKS_AND_TABS.search(self.measurement),
            "must not contain line breaks or tabs",
            field="measurement",
        )

    def _tag_rules(self) -> None:
        """Every tag has a valid name and a known source."""
        for key, src in self.tags.items():
            rule(
                bool(key) and not _LINE_BREAKS_AND_TABS.search(key),
                f"{key!r}: not a valid tag name",
                field="tags",
            )
            rule(
                bool(src) and (not src.startswith("$") or src in META_SOURCES),
                f"{key}: unknown source {src!r}; one of a payload column, {', '.join(META_SOURCES)}",
                field="tags",
            )

    def _field_rules(self, fields: dict[str, str]) -> None:
        """At least one field; each with a valid name, a known source, and not also a tag."""
        rule(bool(fields), "must map at least one field", field="fields")
        for key, src in fields.items():
            rule(
                bool(key) and not _LINE_BREAKS_AND_TABS.search(key),
                f"{key!r}: not a valid field name",
                field="fields",
            )
            rule(
                bool(src) and (not src.startswith("$") or src in META_SOURCES),
                f"{key}: unknown source {src!r}",
                field="fields",
            )
            rule(key not in self.tags, f"{key!r} is both a tag and a field", field="fields")

    def _timestamp_rules(self) -> None:
        """The timestamp is ``$timestamp`` or a payload column."""
        rule(
            self.timestamp == "$timestamp"
            or (bool(self.timestamp) and not self.timestamp.startswith("$")),
            "must be $timestamp or a payload column",
            field="timestamp",
        )

    def _auth_rules(self) -> None:
        """Username and password together or not at all, not with a token; a CA file only
        with https."""
        credential_rules(self.username, self.password, self.token, token_field="token")
        if self.tls_ca_file is not None:
            rule(
                not known_now(self.url) or self.url.startswith("https://"),
                "tls_ca_file needs an https:// URL",
                field="tls_ca_file",
            )


# -- line protocol (pure) ---------------------------------------------------------------------------


_MEASUREMENT_ESCAPES = str.maketrans({"\\": "\\\\", ",": "\\,", " ": "\\ "})
_KEY_ESCAPES = str.maketrans({"\\": "\\\\", ",": "\\,", "=": "\\=", " ": "\\ "})
_STRING_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"'})
_LINE_BREAKS = re.compile(r"\r\n|\r|\n")
_LINE_BREAKS_AND_TABS = re.compile(r"\r\n|\r|\n|\t")


def _name_text(s: str, newlines: str, what: str) -> str:
    """A measurement, tag or field key: CR, LF and tabs cannot appear, escaped or not."""
    if _LINE_BREAKS_AND_TABS.search(s):
        if newlines != "replace":
            raise ValueError(
                f"{what} {s[:40]!r} contains a line break or tab, which line protocol cannot carry"
            )
        s = _LINE_BREAKS_AND_TABS.sub(" ", s)
    return s


def escape_measurement(s: str, newlines: str = "reject") -> str:
    if not s:
        raise ValueError("empty measurement")
    return _name_text(s, newlines, "measurement").translate(_MEASUREMENT_ESCAPES)


def escape_key(s: str, newlines: str = "reject", what: str = "key") -> str:
    """A tag key, tag value or field key."""
    return _name_text(s, newlines, what).translate(_KEY_ESCAPES)


def string_field(s: str, newlines: str = "reject") -> str:
    """A string field value, quoted."""
    if _LINE_BREAKS.search(s):
        if newlines == "reject":
            raise ValueError(
                f"string value {s[:40]!r} contains a line break (set newlines: replace or keep)"
            )
        if newlines == "replace":
            s = _LINE_BREAKS.sub(" ", s)
    return '"' + s.translate(_STRING_ESCAPES) + '"'


def format_float(v: float) -> str:
    """A float in a form both the Go and the Rust line protocol parsers read (the exponent needs a decimal point)."""
    if not math.isfinite(v):
        raise ValueError(f"{v} cannot be written (line protocol has no NaN or infinity)")
    text = repr(float(v))
    mantissa, e, exponent = text.partition("e")
    if e and "." not in mantissa:
        text = f"{mantissa}.0e{exponent}"
    return text


def field_value(v: Any, newlines: str = "reject") -> str | None:
    """A field value in line protocol, or None for a null (the field is left out)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        if not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"integer {v} does not fit in 64 bits")
        return f"{v}i"
    if isinstance(v, float):
        return format_float(v)
    if isinstance(v, decimal.Decimal):
        if not v.is_finite():
            raise ValueError(f"{v} cannot be written (line protocol has no NaN or infinity)")
        return format_float(float(v))
    if isinstance(v, bytes):
        return string_field(text_of(v), newlines)
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return string_field(v.isoformat(), newlines)
    if isinstance(v, (dict, list, tuple)):
        return string_field(
            json.dumps(v, default=str, separators=(",", ":"), ensure_ascii=False), newlines
        )
    return string_field(str(v), newlines)


def tag_value(v: Any) -> str | None:
    """The text of a tag value, or None to leave the tag out (null or empty)."""
    if v is None:
        return None
    if isinstance(v, bytes):
        v = text_of(v)
    elif isinstance(v, bool):
        v = "true" if v else "false"
    elif isinstance(v, (dt.datetime, dt.date, dt.time)):
        v = v.isoformat()
    text = str(v)
    return text or None


def to_precision(ts: dt.datetime, precision: str) -> int:
    """A datetime as an integer number of ``precision`` units since the epoch (naive = UTC; floor)."""
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=dt.timezone.utc)
    micros = (ts - _EPOCH) // dt.timedelta(microseconds=1)
    return (micros * 1000) // NANOS[precision]


def convert_epoch(value: int | float, unit: str, precision: str) -> int:
    """A number of ``unit``s since the epoch as ``precision`` units (floor; floats rounded to the nanosecond)."""
    nanos = value * NANOS[unit] if isinstance(value, int) else round(value * NANOS[unit])
    return int(nanos) // NANOS[precision]


def timestamp_value(v: Any, unit: str, precision: str) -> int:
    """The timestamp of a point from a payload value; ValueError when there is none."""
    if v is None:
        raise ValueError("timestamp is null")
    if isinstance(v, bool):
        raise ValueError("timestamp is a boolean")
    if isinstance(v, dt.datetime):
        return to_precision(v, precision)
    if isinstance(v, dt.date):
        return to_precision(dt.datetime(v.year, v.month, v.day), precision)
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"timestamp {v} is not a number")
        return convert_epoch(v, unit, precision)
    if isinstance(v, str):
        return to_precision(dt.datetime.fromisoformat(v.strip().replace("Z", "+00:00")), precision)
    raise ValueError(f"cannot use a {type(v).__name__} as timestamp")


def render_measurement(template: str, record: Record) -> str:
    """The measurement of one row; TemplateError when the row cannot fill the template."""
    return templates.render(template, record)


def _source_value(record: Record, source: str) -> Any:
    if source == "$key":
        return record.key
    if source == "$topic":
        return record.topic
    if source == "$partition":
        return record.partition
    if source == "$offset":
        return record.offset
    return record.fields.get(source)


def field_sources(config: GreptimeDBSinkConfig, columns: list[str]) -> dict[str, str]:
    """Field column -> source: the configured mapping, or every payload column not used as tag or timestamp."""
    if config.fields is not None:
        return dict(config.fields)
    used = set(config.tags.values()) | {config.timestamp}
    return {c: c for c in columns if c not in used}


def line_of(record: Record, config: GreptimeDBSinkConfig, fields: Mapping[str, str]) -> str:
    """One point in line protocol; ValueError when the row cannot be written."""
    nl = config.newlines
    parts = [escape_measurement(render_measurement(config.measurement, record), nl)]
    for key in sorted(config.tags):
        value = tag_value(_source_value(record, config.tags[key]))
        if value is not None:
            parts.append(f"{escape_key(key, nl, 'tag key')}={escape_key(value, nl, 'tag value')}")
    series = ",".join(parts)
    field_set = []
    for key, source in fields.items():
        value = field_value(_source_value(record, source), nl)
        if value is not None:
            field_set.append(f"{escape_key(key, nl, 'field key')}={value}")
    if not field_set:
        raise ValueError("no non-null field: a point needs at least one field")
    if config.timestamp == "$timestamp":
        if record.timestamp is None:
            raise ValueError("message has no timestamp")
        ts = to_precision(record.timestamp, config.precision)
    else:
        ts = timestamp_value(
            record.fields.get(config.timestamp), config.timestamp_unit, config.precision
        )
    return f"{series} {','.join(field_set)} {ts}"


@dataclass
class LinePlan:
    """The body of one write: ``lines[i]`` is batch row ``rows[i]``."""

    lines: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    failures: list[RowFailure] = field(default_factory=list)

    def body(self) -> bytes:
        return ("\n".join(self.lines) + "\n").encode("utf-8")


def build_lines(
    records: Iterable[Record], config: GreptimeDBSinkConfig, columns: list[str]
) -> LinePlan:
    """Line protocol for a batch (no I/O); rows that cannot be written are data errors."""
    plan = LinePlan()
    fields = field_sources(config, columns)
    for rec in records:
        try:
            line = line_of(rec, config, fields)
        except (ValueError, TypeError, ArithmeticError) as e:
            plan.failures.append(RowFailure(rec.index, f"{type(e).__name__}: {e}"))
            continue
        plan.lines.append(line)
        plan.rows.append(rec.index)
    return plan


# -- HTTP (pure parts) ------------------------------------------------------------------------------


def auth_header(config: GreptimeDBSinkConfig) -> dict[str, str]:
    """The Authorization header GreptimeDB's InfluxDB endpoints accept ('token user:password')."""
    if config.token is not None:
        return {"Authorization": f"token {secret(config.token)}"}
    if config.username is not None:
        return {"Authorization": f"token {config.username}:{secret(config.password) or ''}"}
    return {}


def basic_auth(config: GreptimeDBSinkConfig) -> tuple[str, str] | None:
    """Credentials for GreptimeDB's other HTTP endpoints (Basic), from username/password or a 'user:password' token."""
    if config.username is not None:
        return (config.username, secret(config.password) or "")
    if config.token is not None:
        user, sep, password = (secret(config.token) or "").partition(":")
        if sep:
            return (user, password)
    return None


def write_request(config: GreptimeDBSinkConfig, body: bytes) -> Any:
    """The ``requests.Request`` of one write (prepare it to send)."""
    import requests

    return requests.Request(
        "POST",
        config.url.rstrip("/") + "/v1/influxdb/api/v2/write",
        params={"db": config.database, "precision": config.precision},
        data=body,
        headers={"Content-Type": "text/plain; charset=utf-8", **auth_header(config)},
    )


def _error_code(headers: Mapping[str, str], body: str) -> int | None:
    for k, v in headers.items():
        if k.lower() == "x-greptime-err-code":
            with contextlib.suppress(ValueError):
                return int(v)
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        code = json.loads(body).get("code")
        return int(code) if code is not None else None
    return None


def _error_text(body: str) -> str:
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        parsed = json.loads(body)
        if isinstance(parsed, dict) and parsed.get("error"):
            return str(parsed["error"])[:500]
    return body.strip()[:500]


def map_response(status: int, headers: Mapping[str, str], body: str) -> SinkError | None:
    """None for success; otherwise the sink error a write response means."""
    if 200 <= status < 300:
        return None
    code = _error_code(headers, body)
    text = (
        f"HTTP {status}" + (f", code {code}" if code is not None else "") + f": {_error_text(body)}"
    )
    if code in TRANSIENT_CODES:
        return TransientSinkError(f"GreptimeDB temporarily unavailable ({text})")
    if code in PERMANENT_CODES or status in (401, 403) or "database not found" in body.lower():
        return PermanentSinkError(f"GreptimeDB refused the write ({text})")
    if status in (408, 429) or status >= 500:
        return TransientSinkError(f"GreptimeDB unavailable ({text})")
    if status in (400, 413, 422):
        # Parse errors and type conflicts are reported for the whole request: bisect.
        return BatchRejected(f"GreptimeDB rejected the lines ({text})")
    if status == 404:
        return PermanentSinkError(f"no InfluxDB write API at this URL ({text})")
    return PermanentSinkError(f"GreptimeDB error ({text})")


def map_request_error(e: BaseException) -> SinkError | None:
    """The sink error for a requests exception; None if it is not one."""
    import requests

    if isinstance(e, requests.exceptions.SSLError):
        if "certificate verify failed" in str(e).lower():
            return PermanentSinkError(
                f"TLS certificate of GreptimeDB not trusted (set tls_ca_file): {e}"
            )
        return TransientSinkError(f"GreptimeDB TLS handshake failed: {e}")
    if isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
        return TransientSinkError(f"GreptimeDB unreachable: {e}")
    if isinstance(
        e,
        requests.exceptions.InvalidURL
        | requests.exceptions.MissingSchema
        | requests.exceptions.InvalidSchema,
    ):
        return PermanentSinkError(f"invalid GreptimeDB URL: {e}")
    if isinstance(e, requests.exceptions.RequestException):
        return TransientSinkError(f"GreptimeDB request failed: {e}")
    return None


# -- the sink ------------------------------------------------------------------------------------------


class GreptimeDBSink(Sink):
    """Writes each batch as one line protocol request; a rejected request is bisected by the runtime."""

    config_class = GreptimeDBSinkConfig
    config: GreptimeDBSinkConfig

    def __init__(self, config: GreptimeDBSinkConfig):
        super().__init__(config)
        self._session: Any = None

    def _verify(self) -> bool | str:
        """requests' ``verify``: the CA file's real path (``core.trust.paths``, resolved at each
        request), else whether to verify."""
        ca = paths.resolve_file(self.config.tls_ca_file, field="sink.tls_ca_file")
        return ca or self.config.verify_tls

    def init_sink(self) -> None:
        import requests

        c = self.config
        session = requests.Session()
        base = c.url.rstrip("/")
        with mapped_errors(
            map_request_error, cleanup=session.close, catching=requests.RequestException
        ):
            health = session.get(f"{base}/health", timeout=c.timeout_s, verify=self._verify())
            if health.status_code >= 500:
                raise TransientSinkError(f"GreptimeDB is not healthy: HTTP {health.status_code}")
            # The database must exist and the credentials be valid (SQL endpoint, Basic auth).
            check = session.post(
                f"{base}/v1/sql",
                params={"db": c.database},
                data={"sql": "SHOW TABLES"},
                auth=basic_auth(c),
                timeout=c.timeout_s,
                verify=self._verify(),
            )
        error = map_response(check.status_code, check.headers, check.text)
        if error is not None:
            session.close()
            if isinstance(
                error, BatchRejected
            ):  # a 400 to SHOW TABLES: the database is missing or unusable
                error = PermanentSinkError(f"database {c.database!r} is not usable: {error}")
            raise error
        self._session = session

    def send_batch(self, batch: pa.Table) -> SendResult:
        import requests

        if batch.num_rows == 0:
            return SendResult(rows=0)
        if self._session is None:
            self.init_sink()
        for src in {
            *self.config.tags.values(),
            *(self.config.fields or {}).values(),
            self.config.timestamp,
        }:
            if not src.startswith("$") and src not in batch.schema.names:
                raise ConfigError(
                    f"source column {src!r} is not in the transformed batch (columns: {payload_columns(batch)})",
                    field="sink",
                )
        plan = build_lines(iter_records(batch), self.config, payload_columns(batch))
        failures = list(plan.failures)
        if self.fail_fast and failures:
            # Nothing after the first row that cannot be written is sent.
            first = min(f.index for f in failures)
            failures = [f for f in failures if f.index == first]
            keep = [k for k, row in enumerate(plan.rows) if row < first]
            plan = LinePlan([plan.lines[k] for k in keep], [plan.rows[k] for k in keep], failures)
        if plan.lines:
            prepared = self._session.prepare_request(write_request(self.config, plan.body()))
            with mapped_errors(map_request_error, catching=requests.RequestException):
                resp = self._session.send(
                    prepared, timeout=self.config.timeout_s, verify=self._verify()
                )
            error = map_response(resp.status_code, resp.headers, resp.text)
            if error is not None:
                raise error
        failures.sort(key=lambda f: f.index)
        return SendResult(rows=batch.num_rows, failed=tuple(failures))

    def cleanup_sink(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()
