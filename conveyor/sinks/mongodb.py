"""MongoDB sink (pymongo): unordered bulk inserts or upserts keyed by a deterministic ``_id``.

One ``bulk_write(ordered=False)`` per batch, at the configured write concern;
``send_batch`` returns once the server acknowledged the bulk at that write concern.
Under ``fail_fast`` the bulk is ordered: the server stops at the first refused document.

Identity and replays (``id_strategy``):

- ``coordinates`` (default): ``_id`` is ``"<topic>-<partition>-<offset>"``; a replayed
  message gets the same ``_id``. A payload ``_id`` is overwritten.
- ``key``: ``_id`` is the message key (UTF-8 text, or binary when not UTF-8).
- ``field:<path>``: ``_id`` is that payload field (dotted path allowed).
- ``none``: the payload's own ``_id`` if it has one, else the driver's ObjectId.

``write_mode: insert`` sends ``InsertOne``. With a deterministic ``id_strategy`` a
duplicate-key error (11000) on the ``_id`` index means "a document with this identity
is already stored" (a replay, or for ``key`` an older message with the same key: the
first one per key is kept) and counts as acknowledged; several rows of one batch with
the same ``_id`` are reduced to the first one before sending. With ``id_strategy: none``
a duplicate is a data error, because the sink cannot tell a replay from a collision.
A duplicate on any *other* unique index is always a data error.

``write_mode: upsert`` sends ``ReplaceOne({"_id": id}, doc, upsert=True)``: the latest
message per ``_id`` wins and replays overwrite with identical content. Within one batch
only the last row per ``_id`` is sent (an unordered bulk has no order guarantee); the
earlier rows are superseded and acknowledged with it.

A document that cannot be encoded as BSON (an integer beyond 64 bits, a value BSON has
no type for, more than 16 MiB) is found by encoding each document of the bulk, reported
as a data error, and the rest of the bulk is sent again once.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import logging
import os
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
from conveyor.core.sink import utf8_reason
from conveyor.core.trust import paths
from conveyor.core.trust.references import known_now
from conveyor.sinks.base import (
    ID_STRATEGY_PATTERN,
    Record,
    RowFailure,
    SendResult,
    Sink,
    UrlSinkConfig,
    framed_id,
    id_field,
    iter_records,
    mapped_errors,
    record_metadata,
    secret,
    tombstone_id_rule,
)
from conveyor.sinks.tombstones import delete_key, tombstone_flags  # noqa: E402

log = logging.getLogger("conveyor.sinks.mongodb")


# Server error codes that mean "try again later" (MongoDB's retryable-error list plus
# write-concern timeouts): the batch is retried as a whole, never dead-lettered.
TRANSIENT_CODES = frozenset(
    {
        6,  # HostUnreachable
        7,  # HostNotFound
        50,  # MaxTimeMSExpired
        64,  # WriteConcernFailed (wtimeout)
        89,  # NetworkTimeout
        91,  # ShutdownInProgress
        112,  # WriteConflict
        133,  # FailedToSatisfyReadPreference
        189,  # PrimarySteppedDown
        262,  # ExceededTimeLimit
        9001,  # SocketException
        10107,  # NotWritablePrimary
        11600,  # InterruptedAtShutdown
        11602,  # InterruptedDueToReplStateChange
        13435,  # NotPrimaryNoSecondaryOk
        13436,  # NotPrimaryOrSecondary
    }
)
# Codes no retry can fix: the connector goes to Error.
PERMANENT_CODES = frozenset({13, 18})  # Unauthorized, AuthenticationFailed
DUPLICATE_KEY = 11000
# Error labels the server or driver attaches to errors a retry may fix.
TRANSIENT_LABELS = (
    "RetryableWriteError",
    "NetworkError",
    "SystemOverloadedError",
    "TransientTransactionError",
)
# The server's limit on one document.
MAX_DOCUMENT_BYTES = 16 * 1024 * 1024


class MongoDBSinkConfig(UrlSinkConfig):
    """Documents into a MongoDB collection."""

    type: Literal["mongodb"] = "mongodb"
    url: SecretStr | None = Field(
        default=None,
        description="Connection string, e.g. mongodb://user:${file:/run/secrets/mongo}@127.0.0.1:27017/?authSource=admin (secret; a password in it must be a reference).",
    )
    database: str = Field(description="Database name.")
    collection: str = Field(description="Collection name.")
    write_mode: Literal["insert", "upsert"] = Field(
        default="insert",
        description="insert: InsertOne per message (a duplicate _id from a deterministic id_strategy counts as already written); "
        "upsert: ReplaceOne(upsert=True) on _id, the latest message per _id wins.",
    )
    id_strategy: str = Field(
        default="coordinates",
        pattern=ID_STRATEGY_PATTERN,
        description="Where _id comes from: coordinates ('<topic>-<partition>-<offset>'), key (the message key), "
        "field:<path> (a payload field, dotted path allowed), or none (the payload's _id, else an ObjectId; replays may duplicate).",
    )
    delete_enabled: bool = Field(
        default=False,
        description="A tombstone (transform.null_values: pass) deletes the document with its _id (DeleteOne). "
        "Needs write_mode upsert and id_strategy key or field:<name> (a tombstone's field comes from its JSON key).",
    )
    metadata_field: str | None = Field(
        default=None,
        description="When set, each document gets this field with the message's topic, partition, offset, timestamp, key and headers.",
    )
    w: int | str | None = Field(
        default=None,
        description="Write concern w: a number of members, 'majority' or a tag set name. Default: the server's.",
    )
    j: bool | None = Field(
        default=None, description="Write concern j: wait for the journal. Default: the server's."
    )
    wtimeout_ms: int | None = Field(
        default=None,
        ge=0,
        description="Write concern wtimeout in milliseconds (a timeout is retried as an outage).",
    )
    bypass_document_validation: bool = Field(
        default=False,
        description="Skip the collection's schema validation (needs the bypassDocumentValidation privilege).",
    )
    tls_ca_file: str | None = Field(
        default=None,
        description="CA bundle to verify the server's certificate (tlsCAFile); TLS itself is switched on in the URL (tls=true).",
    )
    server_selection_timeout_ms: int = Field(
        default=10_000,
        ge=100,
        description="How long to wait for a usable server before the batch counts as an outage.",
    )
    connect_timeout_ms: int = Field(default=10_000, ge=100, description="TCP connect timeout.")
    socket_timeout_ms: int = Field(
        default=60_000,
        ge=100,
        description="Timeout of one request on the socket (bounds how long send_batch can block).",
    )

    @field_validator("w", mode="before")
    @classmethod
    def _numeric_w(cls, v: Any) -> Any:
        # "2" from YAML or an env var means two members, not a tag set named "2".
        if isinstance(v, str) and v.strip().lstrip("-").isdigit():
            return int(v.strip())
        return v

    def asset_key_path(self) -> list[str]:
        return ["mongodb", _part(self.database), _part(self.collection)]

    def kind(self) -> str:
        return "mongodb"

    @model_validator(mode="after")
    def _rules(self) -> MongoDBSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        if self.delete_enabled:
            rule(
                self.write_mode == "upsert",
                "deletes need write_mode: upsert (the latest operation per _id wins)",
                field="delete_enabled",
            )
            tombstone_id_rule(self.id_strategy)
        rule(bool(self.url), "is required (a connection string, or ${env:NAME})", field="url")
        rule(
            not known_now(secret(self.url))
            or (secret(self.url) or "").startswith(("mongodb://", "mongodb+srv://")),
            "must start with mongodb:// or mongodb+srv://",
            field="url",
        )
        rule(
            not known_now(self.database)
            or (
                bool(self.database)
                and len(self.database) < 64
                and not re.search(r"[/\\. \"$\x00*<>:|?]", self.database)
            ),
            'must be a valid database name (1-63 characters, none of / \\ . space " $ * < > : | ?)',
            field="database",
        )
        rule(
            not known_now(self.collection)
            or (
                bool(self.collection)
                and "$" not in self.collection
                and "\x00" not in self.collection
                and not self.collection.startswith(("system.", "."))
            ),
            "must be a valid collection name (no $, not starting with '.' or 'system.')",
            field="collection",
        )
        if isinstance(self.w, int):
            rule(
                self.w >= 1,
                "must be 1 or more: w 0 (unacknowledged) cannot confirm a batch; or use 'majority'",
                field="w",
            )
        elif isinstance(self.w, str):
            rule(bool(self.w.strip()), "must be a number, 'majority' or a tag set name", field="w")
        if self.write_mode == "upsert":
            rule(
                self.id_strategy != "none",
                "upsert needs an id_strategy other than none",
                field="id_strategy",
            )
        if self.metadata_field is not None:
            rule(
                bool(self.metadata_field)
                and not self.metadata_field.startswith("$")
                and self.metadata_field != "_id"
                and "." not in self.metadata_field,
                "must be a top-level field name (not _id, no '.', not starting with $)",
                field="metadata_field",
            )
        if self.tls_ca_file is not None:
            rule(bool(self.tls_ca_file.strip()), "must not be empty", field="tls_ca_file")
        return self


def _part(s: str) -> str:
    return key_part(s, "_")


def redact_url(text: str) -> str:
    """Remove credentials of connection strings from a message."""
    return re.sub(r"(mongodb(?:\+srv)?://)[^@/\s]*@", r"\1***@", text)


# -- request building (pure) -------------------------------------------------------------


@dataclass
class MongoPlan:
    """The operations of one batch: ``ops[i]`` writes batch row ``rows[i]``."""

    ops: list[Any] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    failures: list[RowFailure] = field(default_factory=list)  # rejected before sending
    superseded: list[int] = field(
        default_factory=list
    )  # rows acknowledged through another row with the same _id

    def without(self, positions: set[int]) -> MongoPlan:
        """The plan minus the operations at ``positions``."""
        keep = [p for p in range(len(self.ops)) if p not in positions]
        return MongoPlan(
            ops=[self.ops[p] for p in keep],
            rows=[self.rows[p] for p in keep],
            failures=list(self.failures),
            superseded=list(self.superseded),
        )


class InvalidUTF8(ValueError):
    """A raw payload that is not valid UTF-8 (the message says where)."""


def document_of(record: Record) -> dict[str, Any]:
    """The document for one message: the payload object, or ``{"value": payload}`` for a non-object payload.

    A raw payload that is not valid UTF-8 raises InvalidUTF8 naming the byte offset (it is
    never stored with replacement characters)."""
    if isinstance(record.payload, bytes):
        try:
            record.payload.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidUTF8(utf8_reason(e, "payload")) from None
    payload = record.payload if isinstance(record.payload, dict) else record.payload_json()
    doc = dict(payload) if isinstance(payload, dict) else {"value": payload}
    return {str(k): bson_value(v) for k, v in doc.items()}


def bson_value(v: Any) -> Any:
    """A Python value BSON can encode (Decimal -> Decimal128, date -> datetime, time -> ISO text)."""
    if isinstance(v, dict):
        return {str(k): bson_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [bson_value(x) for x in v]
    if isinstance(v, decimal.Decimal):
        from bson.decimal128 import Decimal128

        return Decimal128(v)
    if isinstance(v, dt.datetime):
        return v
    if isinstance(v, dt.date):
        return dt.datetime(v.year, v.month, v.day, tzinfo=dt.timezone.utc)
    if isinstance(v, dt.time):
        return v.isoformat()
    return v


def _key_value(key: bytes) -> str | bytes:
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return key


def document_id(record: Record, doc: Mapping[str, Any], id_strategy: str) -> Any:
    """The ``_id`` for a message, or None for ``none`` without a payload ``_id``. Raises ValueError when unavailable."""

    def of_field(path: str, value: Any) -> Any:
        if value is None:
            raise ValueError(f"payload has no field {path!r} (id_strategy: {id_strategy})")
        if isinstance(value, list):
            raise ValueError(
                f"payload field {path!r} is an array; MongoDB does not allow an array _id"
            )
        return value

    return framed_id(
        record,
        doc,
        id_strategy,
        of_key=_key_value,
        of_field=of_field,
        otherwise=lambda: doc.get("_id"),
    )


def metadata_of(record: Record) -> dict[str, Any]:
    """The message's coordinates, timestamp, key and headers (header values stay bytes: BSON binary)."""
    return record_metadata(record, timestamp=lambda ts: ts, key=_key_value, header=lambda v: v)


def build_operations(
    records: Iterable[Record],
    config: MongoDBSinkConfig,
    tombstones: frozenset[int] = frozenset(),
    *,
    ordered: bool = False,
) -> MongoPlan:
    """The pymongo write operations for a batch (no I/O). With delete_enabled, the rows in
    ``tombstones`` delete their ``_id`` (the latest operation per ``_id`` wins).

    ``ordered`` (fail_fast: an ordered bulk): upserts keep every row's operation, in order
    (the server applies them in order, so the last still wins, and a row is never left
    to a later one that an earlier failure stops)."""
    from pymongo import DeleteOne, InsertOne, ReplaceOne

    plan = MongoPlan()
    staged: list[tuple[int, Any, dict[str, Any] | None]] = []
    for rec in records:
        if config.delete_enabled and rec.index in tombstones:
            try:
                staged.append((rec.index, tombstone_id(rec, config.id_strategy), None))
            except (ValueError, TypeError) as e:
                plan.failures.append(RowFailure(rec.index, f"{type(e).__name__}: {e}"))
            continue
        try:
            doc = document_of(rec)
            _id = document_id(rec, doc, config.id_strategy)
        except InvalidUTF8 as e:
            plan.failures.append(RowFailure(rec.index, str(e)))
            continue
        except (ValueError, TypeError, ArithmeticError) as e:
            plan.failures.append(RowFailure(rec.index, f"{type(e).__name__}: {e}"))
            continue
        if _id is not None:
            doc["_id"] = _id
        else:
            doc.pop("_id", None)  # a null payload _id: the driver assigns an ObjectId
        if config.metadata_field:
            doc[config.metadata_field] = metadata_of(rec)
        staged.append((rec.index, _id, doc))

    deterministic = config.id_strategy != "none"
    if config.write_mode == "upsert":
        last: dict[Any, int] = {}
        for pos, (_row, _id, _doc) in enumerate(staged):
            last[_hashable(_id)] = pos
        if ordered:
            last = {}
        for pos, (row, _id, doc) in enumerate(staged):
            if last.get(_hashable(_id), pos) != pos:
                plan.superseded.append(row)
                continue
            if doc is None:
                plan.ops.append(DeleteOne({"_id": _id}))
            else:
                plan.ops.append(ReplaceOne({"_id": _id}, doc, upsert=True))
            plan.rows.append(row)
    else:
        seen: set[Any] = set()
        for row, _id, doc in staged:
            if deterministic:
                h = _hashable(_id)
                if h in seen:
                    # Same identity as an earlier row of this batch: the first one is kept.
                    plan.superseded.append(row)
                    continue
                seen.add(h)
            plan.ops.append(InsertOne(doc))
            plan.rows.append(row)
    return plan


def tombstone_id(record: Record, id_strategy: str) -> Any:
    """The ``_id`` a tombstone deletes: its key, or the id field of its JSON key."""
    path = id_field(id_strategy)
    if path is not None:
        (value,) = delete_key([path], {}, record.key)
        return value
    return document_id(record, {}, id_strategy)


def _hashable(v: Any) -> Any:
    """A hashable stand-in for an ``_id`` that is equal exactly when MongoDB's ``_id``s are."""
    if isinstance(v, dict):
        return ("object", tuple((k, _hashable(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return ("array", tuple(_hashable(x) for x in v))
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, (int, float)):
        return ("number", v)  # 1 and 1.0 are the same _id in MongoDB
    return (type(v).__name__, v)


def unencodable(plan: MongoPlan) -> list[tuple[int, str]]:
    """Positions in ``plan.ops`` whose document BSON cannot encode or that exceed 16 MiB, with the reason."""
    import bson

    bad = []
    for pos, op in enumerate(plan.ops):
        doc = op._doc  # InsertOne and ReplaceOne keep their document here
        try:
            size = len(bson.encode(doc))
        except (bson.errors.InvalidDocument, OverflowError, TypeError, ValueError) as e:
            bad.append((pos, f"document cannot be encoded as BSON: {type(e).__name__}: {e}"))
            continue
        if size > MAX_DOCUMENT_BYTES:
            bad.append(
                (pos, f"document too large: {size} bytes (MongoDB's limit is {MAX_DOCUMENT_BYTES})")
            )
    return bad


# -- response mapping (pure) ---------------------------------------------------------------


def _duplicate_on_id(err: Mapping[str, Any]) -> bool:
    pattern = err.get("keyPattern")
    if isinstance(pattern, Mapping) and pattern:
        return list(pattern.keys()) == ["_id"]
    return "index: _id_ " in str(err.get("errmsg", ""))


def map_bulk_write_error(
    details: Mapping[str, Any], plan: MongoPlan, config: MongoDBSinkConfig, *, resend: bool = False
) -> list[RowFailure]:
    """Per-row failures from ``BulkWriteError.details``; raises for outages and refusals.

    ``writeErrors[i].index`` is the index of the operation in ``plan.ops`` (pymongo maps
    the server's per-command indexes back to the position in the request list).
    ``resend``: the same operations (same ``_id``s) were partly sent before, so a
    duplicate ``_id`` means "stored by the first attempt" whatever the id_strategy.
    """
    failures: list[RowFailure] = []
    transient: list[str] = []
    for err in details.get("writeErrors") or []:
        code = err.get("code")
        msg = str(err.get("errmsg", "")).strip()
        if code in PERMANENT_CODES:
            raise PermanentSinkError(f"MongoDB refused the write (code {code}): {msg}")
        if code in TRANSIENT_CODES:
            transient.append(f"code {code}: {msg}")
            continue
        if (
            code == DUPLICATE_KEY
            and _duplicate_on_id(err)
            and (config.id_strategy != "none" or resend)
        ):
            if config.write_mode == "insert":
                continue  # already stored under this identity: a replay
            # Two upserts raced on the same new _id; a retry matches and replaces.
            transient.append(f"code {code}: {msg}")
            continue
        failures.append(RowFailure(plan.rows[err["index"]], f"E{code}: {msg}"))
    wce = details.get("writeConcernErrors") or []
    if wce:
        first = wce[0]
        raise TransientSinkError(
            f"MongoDB write concern not satisfied (code {first.get('code')}: {first.get('errmsg')}); the batch is retried"
        )
    if transient:
        raise TransientSinkError(
            f"MongoDB: {len(transient)} write(s) failed transiently, e.g. {transient[0]}"
        )
    return failures


def map_error(e: BaseException) -> SinkError | None:
    """The sink error for a pymongo error raised by a command (not a BulkWriteError); None if not a pymongo error."""
    from pymongo.errors import ConfigurationError, ConnectionFailure, OperationFailure, PyMongoError

    if isinstance(e, ConnectionFailure):
        # AutoReconnect, NetworkTimeout, NotPrimaryError, ServerSelectionTimeoutError, WaitQueueTimeoutError
        return TransientSinkError(
            f"MongoDB unreachable ({type(e).__name__}): {redact_url(str(e))[:500]}"
        )
    if isinstance(e, OperationFailure):
        code = e.code
        details = e.details or {}
        msg = redact_url(str(details.get("errmsg") or e))[:500]
        if code in PERMANENT_CODES:
            return PermanentSinkError(f"MongoDB refused the connector (code {code}): {msg}")
        if code in TRANSIENT_CODES or any(e.has_error_label(label) for label in TRANSIENT_LABELS):
            return TransientSinkError(f"MongoDB temporarily unavailable (code {code}): {msg}")
        return PermanentSinkError(f"MongoDB error (code {code}): {msg}")
    if isinstance(e, ConfigurationError):
        return PermanentSinkError(f"MongoDB configuration error: {redact_url(str(e))[:500]}")
    if isinstance(e, PyMongoError):
        if any(e.has_error_label(label) for label in TRANSIENT_LABELS):
            return TransientSinkError(f"MongoDB: {redact_url(str(e))[:500]}")
        return PermanentSinkError(f"MongoDB error ({type(e).__name__}): {redact_url(str(e))[:500]}")
    return None


# -- the sink -------------------------------------------------------------------------------


class MongoDBSink(Sink):
    """Writes each batch with one unordered bulk_write at the configured write concern."""

    config_class = MongoDBSinkConfig
    config: MongoDBSinkConfig

    def __init__(self, config: MongoDBSinkConfig):
        super().__init__(config)
        self._client: Any = None
        self._collection: Any = None

    def _url(self) -> str:
        return secret(self.config.url) or ""

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for ``pymongo.MongoClient`` (besides the URL)."""
        c = self.config
        kwargs: dict[str, Any] = {
            "appname": "conveyor",
            "serverSelectionTimeoutMS": c.server_selection_timeout_ms,
            "connectTimeoutMS": c.connect_timeout_ms,
            "socketTimeoutMS": c.socket_timeout_ms,
        }
        if c.tls_ca_file:
            kwargs["tlsCAFile"] = paths.resolve(c.tls_ca_file, field="sink.tls_ca_file")
        return kwargs

    def write_concern(self) -> Any:
        from pymongo.write_concern import WriteConcern

        c = self.config
        return WriteConcern(w=c.w, wtimeout=c.wtimeout_ms, j=c.j)

    def init_sink(self) -> None:
        import pymongo
        from pymongo.errors import ConfigurationError

        c = self.config
        ca = paths.resolve_file(c.tls_ca_file, field="sink.tls_ca_file")
        if ca is not None and not os.path.isfile(ca):
            raise PermanentSinkError(f"tls_ca_file {c.tls_ca_file!r} does not exist")
        try:
            client = pymongo.MongoClient(self._url(), **self.client_options())
        except ConfigurationError as e:
            raise ConfigError(
                f"invalid MongoDB connection string or option: {redact_url(str(e))}",
                field="sink.url",
            ) from None
        try:
            wc = self.write_concern()
        except (ConfigurationError, ValueError, TypeError) as e:
            client.close()
            raise ConfigError(f"invalid write concern: {e}", field="sink.w") from None
        with mapped_errors(map_error, cleanup=client.close):
            client.admin.command("ping")
        self._client = client
        self._collection = client[c.database].get_collection(c.collection, write_concern=wc)

    def send_batch(self, batch: pa.Table) -> SendResult:
        if batch.num_rows == 0:
            return SendResult(rows=0)
        if self._collection is None:
            self.init_sink()
        plan = build_operations(
            iter_records(batch),
            self.config,
            frozenset(i for i, t in enumerate(tombstone_flags(batch)) if t),
            ordered=self.fail_fast,
        )
        failures = list(plan.failures)
        if self.fail_fast:
            # One ordered bulk: the server stops at the first refused document and writes
            # nothing after it; a row refused before sending cuts the bulk there too.
            if failures:
                first = min(f.index for f in failures)
                failures = [f for f in failures if f.index == first]
                plan = plan.without({p for p, row in enumerate(plan.rows) if row > first})
            refused = self._bulk_in_order(plan) if plan.ops else []
            failures = sorted(failures + refused, key=lambda f: f.index)[:1]
        elif plan.ops:
            failures.extend(self._bulk(plan, isolate=True))
        failures.sort(key=lambda f: f.index)
        return SendResult(rows=batch.num_rows, failed=tuple(failures))

    def _bulk_in_order(self, plan: MongoPlan, *, resend: bool = False) -> list[RowFailure]:
        """fail_fast: ``bulk_write(ordered=True)``; the first refused row (at most one) is the
        failure and nothing after it was written. A duplicate ``_id`` that means "already
        stored" (a replay) also stops an ordered bulk: the operations stored already are
        looked up once (one ``find`` by ``_id``) and the rest is sent again."""
        from bson.errors import InvalidDocument
        from pymongo.errors import BulkWriteError

        looked_up = False
        while plan.ops:
            with mapped_errors(map_error):
                try:
                    self._collection.bulk_write(
                        plan.ops,
                        ordered=True,
                        bypass_document_validation=self.config.bypass_document_validation or None,
                    )
                    return []
                except BulkWriteError as e:
                    failures = map_bulk_write_error(e.details, plan, self.config, resend=resend)
                    if failures:
                        return failures[:1]
                    errors = e.details.get("writeErrors") or []
                    if not errors:
                        return []
                    stop = int(errors[0]["index"])  # a replayed _id, acknowledged: go on after it
                    plan = plan.without(set(range(stop + 1)))
                    if not looked_up:
                        plan, looked_up = self._without_stored(plan), True
                except (InvalidDocument, OverflowError) as e:
                    # The driver encodes while sending: the sub-batches before the bad document
                    # may be stored already (resent below as a replay); nothing after it is sent.
                    bad = unencodable(plan)
                    if not bad:
                        raise BatchRejected(f"document cannot be encoded as BSON: {e}") from None
                    pos, reason = bad[0]
                    before = plan.without(set(range(pos, len(plan.ops))))
                    return self._bulk_in_order(before, resend=True) or [
                        RowFailure(plan.rows[pos], reason)
                    ]
        return []

    def _without_stored(self, plan: MongoPlan) -> MongoPlan:
        """The plan minus the inserts whose ``_id`` is stored already (a replayed batch)."""
        ids = [
            op._doc["_id"]
            for op in plan.ops
            if isinstance(getattr(op, "_doc", None), dict) and "_id" in op._doc
        ]
        if not ids or self.config.write_mode != "insert":
            return plan
        with mapped_errors(map_error):
            stored = {
                _hashable(d["_id"])
                for d in self._collection.find({"_id": {"$in": ids}}, {"_id": 1})
            }
        return plan.without(
            {
                p
                for p, op in enumerate(plan.ops)
                if _hashable(getattr(op, "_doc", {}).get("_id")) in stored
            }
        )

    def _bulk(self, plan: MongoPlan, *, isolate: bool) -> list[RowFailure]:
        from bson.errors import InvalidDocument
        from pymongo.errors import BulkWriteError

        with mapped_errors(map_error):
            try:
                self._collection.bulk_write(
                    plan.ops,
                    ordered=False,
                    bypass_document_validation=self.config.bypass_document_validation or None,
                )
            except BulkWriteError as e:
                return map_bulk_write_error(e.details, plan, self.config, resend=not isolate)
            except (InvalidDocument, OverflowError) as e:
                # The driver encodes while sending and stops at the first bad document (earlier
                # sub-batches may be stored already; resending them is a replay).
                bad = unencodable(plan) if isolate else []
                if not bad:
                    raise BatchRejected(f"document cannot be encoded as BSON: {e}") from None
                failures = [RowFailure(plan.rows[pos], reason) for pos, reason in bad]
                rest = plan.without({pos for pos, _ in bad})
                if rest.ops:
                    failures.extend(self._bulk(rest, isolate=False))
                return failures
        return []

    def cleanup_sink(self) -> None:
        client, self._client, self._collection = self._client, None, None
        if client is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                client.close()
