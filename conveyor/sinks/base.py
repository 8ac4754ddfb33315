"""The sink base class and the helpers sinks share (records, payload columns, config rules).

The contract every sink follows (call order, what ``send_batch`` returning or raising
means) is written once, in :mod:`conveyor.core.sink`.

Sinks import their client library lazily (inside ``init_sink``), so loading the
Dagster code location never imports pymongo or the Pulsar client.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import datetime as dt
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from conveyor.core.engine.loop import next_offsets_of
from conveyor.core.errors import (  # noqa: F401 - re-exported
    BatchRejected,
    ConfigError,
    FieldRuleError,
    SinkError,
    rule,
)
from conveyor.core.model import (
    DESTINATION_COL,
    HEADERS_COL,
    KEY_COL,
    META_COLUMNS,
    OFFSET_COL,
    PARTITION_COL,
    TIMESTAMP_COL,
    TOPIC_COL,
    Offsets,
    TopicPartition,
)
from conveyor.core.sink import (  # noqa: F401 - re-exported
    ErrorKind,
    RowFailure,
    SendResult,
    first_failure_only,
)
from conveyor.core.trust import paths


class SinkConfig(BaseModel):
    """Base of every sink's config model. Subclasses set ``type: Literal[...]``."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: str = Field(description="Sink type.")

    def asset_key_path(self) -> list[str]:
        """The sink asset's key, e.g. ["postgres", "public", "orders"]."""
        return [self.type]

    def kind(self) -> str:
        """The Dagster kind tag of the sink asset."""
        return self.type

    def redacted(self) -> dict[str, Any]:
        """The config as a dict with every secret replaced by '**********'."""
        return json.loads(self.model_dump_json(by_alias=True))

    def offsets_in_target(self) -> bool:
        """Whether the target keeps the connector's offsets with the data (exactly once: they
        win over the meta store's on start; ``conveyor.core.sink.OffsetsInTarget``)."""
        return getattr(self, "delivery", None) in ("exactly_once", "auto")

    @model_validator(mode="after")
    def _certificates_confined(self) -> SinkConfig:
        """Certificate and key files lie under a root, outside the secrets (``core.trust.paths``)."""
        found = paths.certificate_problem(self)
        if found is not None:
            raise FieldRuleError(found[1], field=found[0])
        return self


class Sink(abc.ABC):
    """Base class of sinks; the contract is in conveyor.core.sink."""

    config_class: ClassVar[type[SinkConfig]]

    def __init__(self, config: SinkConfig):
        self.config = config
        self.fail_fast = False  # set by the runtime under the fail policy (conveyor.core.sink)

    def validate(self) -> None:  # noqa: B027 - optional hook: most sinks need no such check
        """Check what the config model cannot know: the environment (an installed package, a
        value once its reference is resolved). No I/O. Raises ConfigError. The cross-field rules
        are the config model's validators (``core.errors.rule``)."""

    @abc.abstractmethod
    def init_sink(self) -> None:
        """Connect and check the target exists and is writable."""

    @abc.abstractmethod
    def send_batch(self, batch: pa.Table) -> SendResult:
        """Write one batch; see the contract in conveyor.core.sink."""

    @abc.abstractmethod
    def cleanup_sink(self) -> None:
        """Release connections and files. Idempotent."""

    def describe(self) -> str:
        """One line for logs and the UI: type and target, never secrets."""
        return "/".join(self.config.asset_key_path())


def payload_columns(batch: pa.Table | pa.Schema) -> list[str]:
    """The batch's payload columns (everything but the metadata columns), in order."""
    names = batch.schema.names if isinstance(batch, pa.Table) else batch.names
    return [n for n in names if n not in META_COLUMNS]


@dataclass
class Record:
    """One row of a batch as Python values, for sinks that write message by message."""

    index: int
    topic: str
    partition: int
    offset: int
    timestamp: dt.datetime | None
    key: bytes | None
    headers: list[tuple[str, bytes]]
    destination: str | None
    payload: Any  # the single 'value' column's value, or a dict of the payload columns
    fields: dict[str, Any] = field(default_factory=dict)

    def payload_bytes(self) -> bytes:
        """The payload as bytes: raw bytes stay, text is UTF-8, columns become JSON."""
        p = self.payload
        if isinstance(p, bytes):
            return p
        if isinstance(p, str):
            return p.encode()
        return _JSON.encode(p).encode()

    def payload_json(self) -> Any:
        """The payload as a JSON value: a JSON string column is parsed, columns are a dict."""
        p = self.payload
        if isinstance(p, (bytes, str)):
            try:
                return json.loads(p)
            except ValueError:
                return p.decode(errors="replace") if isinstance(p, bytes) else p
        return p


def json_default(o: Any) -> Any:
    if isinstance(o, (dt.datetime, dt.date, dt.time)):
        return o.isoformat()
    if isinstance(o, bytes):
        return o.decode(errors="replace")
    if hasattr(o, "as_tuple"):  # Decimal
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


# One encoder for every row (``json.dumps`` with arguments builds a new one per call).
_JSON = json.JSONEncoder(default=json_default, separators=(",", ":"))


def payload_values(batch: pa.Table) -> list[bytes | None]:
    """Every row's ``Record.payload_bytes()`` (None for a null single ``value``), column-wise."""
    pcols = payload_columns(batch)
    encode = _JSON.encode
    if pcols == ["value"]:
        out: list[bytes | None] = []
        for v in batch.column("value").to_pylist():
            if v is None or isinstance(v, bytes):
                out.append(v)
            elif isinstance(v, str):
                out.append(v.encode())
            else:
                out.append(encode(v).encode())
        return out
    objects = json_objects(batch.select(pcols))
    if objects is not None:
        return objects
    return [encode(d).encode() for d in batch.select(pcols).to_pylist()]


def json_objects(table: pa.Table) -> list[bytes | None] | None:
    """Each row as the JSON object ``_JSON.encode`` writes for its dict, byte for byte, built
    column by column: integers, finite floats, booleans and text (nulls as ``null``). None
    when a column has another type (or two columns share a name): the per-row encoder then.

    Arrow writes what it writes exactly as the encoder does, and joins each row's object
    (``binary_join_element_wise``): integers, booleans, text with nothing to escape, and
    doubles it writes in fixed notation within the range the encoder writes that way
    (``_double_text``). The rest is encoded value by value by the function ``_JSON`` uses
    for its type (``float.__repr__``, the C ``encode_basestring_ascii``). No dict and no
    encoder walk per row (the Kafka sink's ``send_batch`` went from 0.55 to 0.40 s of CPU
    per 100K rows column by column), and with Arrow joining the objects the JSON of four-field
    orders went from 0.08 to 0.05 s per 100K (docs/sinks/kafka.md).
    """
    import pyarrow.compute as pc

    names = table.schema.names
    if len(set(names)) != len(names):
        return None
    if not names:
        return [b"{}"] * table.num_rows
    parts: list[Any] = []
    for k, (name, column) in enumerate(zip(names, table.columns, strict=True)):
        text = _json_text(column.combine_chunks())
        if text is None:
            return None
        parts += ["{" if k == 0 else ",", _json_key(name), ":", text]
    parts.append("}")
    if all(isinstance(p, str) for p in parts):  # only null columns: one object for every row
        return ["".join(parts).encode()] * table.num_rows
    joined = pc.binary_join_element_wise(*parts, "")
    return joined.cast(pa.binary()).to_pylist()


def _json_key(name: str) -> str:
    from json.encoder import encode_basestring_ascii

    return str(encode_basestring_ascii(name))


# A character ``encode_basestring_ascii`` escapes: the quote, the backslash and anything
# outside printable ASCII.
_NEEDS_ESCAPE = r"[^ !#-\[\]-~]"


def _json_text(column: pa.Array) -> pa.Array | str | None:
    """The column's values as ``_JSON`` writes each (``null`` for a null; a string when
    every row has the same), or None when its type is not covered or (floats) a value is
    not finite (``NaN``: the encoder's own)."""
    from json.encoder import encode_basestring_ascii

    import pyarrow.compute as pc

    t = column.type
    covered = (
        pa.types.is_null(t)
        or pa.types.is_integer(t)
        or (pa.types.is_floating(t) and not pa.types.is_float16(t))
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
    )
    if not covered:
        return None
    if column.null_count == len(column):
        return "null"
    text: pa.Array
    if pa.types.is_integer(t):
        text = pc.cast(column, pa.string())
    elif pa.types.is_boolean(t):
        text = pc.if_else(column, "true", "false")
    elif pa.types.is_floating(t):
        if pc.any(pc.invert(pc.is_finite(column))).as_py():
            return None
        # A float32 is written as the double it widens to (its repr), which Arrow does not.
        text = _double_text(column) if pa.types.is_float64(t) else _each(column, float.__repr__)
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        column = column.cast(pa.string())
        if (
            not _valid_utf8(column)
            or pc.any(pc.match_substring_regex(column, _NEEDS_ESCAPE)).as_py()
        ):
            # to_pylist raises on invalid UTF-8 (that row fails, as in the per-row encoder)
            text = _each(column, encode_basestring_ascii)
        else:
            text = pc.binary_join_element_wise('"', column, '"', "")
    return pc.fill_null(text, "null") if column.null_count else text


def _valid_utf8(column: pa.Array) -> bool:
    """Whether every value is valid UTF-8 (Arrow does not check buffers it did not build:
    Spark casting bytes to a string, say)."""
    try:
        column.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _each(column: pa.Array, encode: Any) -> pa.Array:
    """The column's values encoded one by one in Python (nulls stay null)."""
    return pa.array([None if v is None else encode(v) for v in column.to_pylist()], pa.string())


def _double_text(column: pa.Array) -> pa.Array:
    """Finite doubles as ``float.__repr__`` writes them. Arrow's cast writes the same
    shortest digits; where both use fixed notation (Arrow: no exponent; repr: magnitudes
    from 1e-4 to below 1e16, and zero) only repr's ``.0`` of an integral value differs.
    The other values (an exponent in either) are written by repr, one by one
    (tests/unit/test_payload_json.py compares both over random doubles)."""
    import pyarrow.compute as pc

    text = pc.cast(column, pa.string())
    magnitude = pc.abs(column)
    by_repr = pc.fill_null(
        pc.or_(
            pc.match_substring(text, "e"),
            pc.or_(
                pc.greater_equal(magnitude, 1e16),
                pc.and_(pc.less(magnitude, 1e-4), pc.not_equal(magnitude, 0.0)),
            ),
        ),
        False,
    )
    text = pc.if_else(
        pc.match_substring(text, "."), text, pc.binary_join_element_wise(text, ".0", "")
    )
    if pc.any(by_repr).as_py():
        exact = [float.__repr__(v) for v in pc.filter(column, by_repr).to_pylist()]
        text = pc.replace_with_mask(text, by_repr, pa.array(exact, pa.string()))
    return text


def text_of(b: bytes) -> str:
    """Bytes as text for a system that takes only text: UTF-8 when valid, else 'base64:<base64>'."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(b).decode()


def iter_records(batch: pa.Table) -> Iterator[Record]:
    """Rows of a batch as ``Record``s (metadata columns may be missing in hand-made batches)."""
    cols = batch.to_pydict()
    n = batch.num_rows
    pcols = payload_columns(batch)
    single = pcols == ["value"]
    for i in range(n):
        fields = {c: cols[c][i] for c in pcols}
        headers = cols[HEADERS_COL][i] if HEADERS_COL in cols else None
        yield Record(
            index=i,
            topic=cols[TOPIC_COL][i] if TOPIC_COL in cols else "",
            partition=cols[PARTITION_COL][i] if PARTITION_COL in cols else 0,
            offset=cols[OFFSET_COL][i] if OFFSET_COL in cols else i,
            timestamp=cols[TIMESTAMP_COL][i] if TIMESTAMP_COL in cols else None,
            key=cols[KEY_COL][i] if KEY_COL in cols else None,
            headers=[(h["key"], h["value"]) for h in headers] if headers else [],
            destination=cols[DESTINATION_COL][i] if DESTINATION_COL in cols else None,
            payload=fields["value"] if single else fields,
            fields=fields,
        )


def secret(value: SecretStr | None) -> str | None:
    """The plain value of a secret, for handing to a client library (never to a log)."""
    return value.get_secret_value() if value is not None else None


def url_env_alias(data: Any) -> Any:
    """``url_env: NAME`` is an alias of ``url: ${env:NAME}`` (a model ``before`` validator).

    The variable is read only where references are resolved: inside the run.
    """
    if not isinstance(data, dict) or data.get("url_env") is None:
        return data
    if data.get("url") is not None:
        raise ValueError("give exactly one of url and url_env (url_env NAME means url ${env:NAME})")
    out = {k: v for k, v in data.items() if k != "url_env"}
    out["url"] = "${env:" + str(data["url_env"]) + "}"
    return out


class UrlSinkConfig(SinkConfig):
    """Base of sinks that connect with one URL (a secret): ``url``, or ``url_env`` as its alias.

    Subclasses redefine ``url`` with their system's example; the alias rule is written once.
    """

    url: SecretStr | None = Field(default=None, description="Connection URL (secret).")
    url_env: str | None = Field(
        default=None,
        description="Alias of `url: ${env:NAME}`: the name of an environment variable holding the URL, read inside the run.",
    )

    @model_validator(mode="before")
    @classmethod
    def _url_env(cls, data: Any) -> Any:
        return url_env_alias(data)


def credential_rules(username: Any, password: Any, token: Any, *, token_field: str) -> None:
    """Config rules of a sink that logs in by username and password or by a token (named
    ``token_field`` in its config): the two halves of a login together or not at all, and
    not with a token."""
    rule(
        (username is None) == (password is None),
        "give both username and password, or neither",
        field="password",
    )
    rule(
        not (token and username),
        f"give {token_field} or username/password, not both",
        field=token_field,
    )


def require(condition: bool, message: str, *, field: str) -> None:
    """Raise ConfigError naming ``field`` unless ``condition`` holds (in ``Sink.validate``; a
    config model's validator uses ``core.errors.rule``)."""
    if not condition:
        raise ConfigError(message, field=field)


# -- document ids: what the document sinks (Elasticsearch, MongoDB) frame alike -------------

#: A document sink's ``id_strategy``: none, key, coordinates or field:<dotted path>.
ID_STRATEGY_PATTERN = r"^(none|key|coordinates|field:[^\s]+)$"

_Id = TypeVar("_Id")


def id_field(id_strategy: str) -> str | None:
    """The payload path of ``field:<path>``; None under any other ``id_strategy``."""
    return id_strategy.split(":", 1)[1] if id_strategy.startswith("field:") else None


def tombstone_id_rule(id_strategy: str) -> None:
    """``delete_enabled``'s rule (a config model validator): a tombstone carries only its key,
    so the ``_id`` it deletes must come from the key."""
    rule(
        id_strategy == "key" or id_field(id_strategy) is not None,
        "a tombstone names its document by key: use id_strategy key or field:<name>",
        field="delete_enabled",
    )


def lookup_path(doc: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` of a document (None when a part is missing)."""
    cur: Any = doc
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def record_metadata(
    record: Record,
    *,
    timestamp: Callable[[dt.datetime], Any],
    key: Callable[[bytes], Any],
    header: Callable[[bytes], Any],
) -> dict[str, Any]:
    """A message's coordinates, timestamp, key and headers, as a document sink stores them
    beside the document (``metadata_field``): the timestamp, the key and each header's value
    in the sink's own types (``timestamp``, ``key``, ``header``); None stays None."""
    return {
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
        "timestamp": timestamp(record.timestamp) if record.timestamp is not None else None,
        "key": key(record.key) if record.key is not None else None,
        "headers": [{"key": k, "value": header(v)} for k, v in record.headers],
    }


def framed_id(
    record: Record,
    doc: Mapping[str, Any],
    id_strategy: str,
    *,
    of_key: Callable[[bytes], _Id],
    of_field: Callable[[str, Any], _Id],
    otherwise: Callable[[], _Id],
) -> str | _Id:
    """A message's ``_id`` under ``id_strategy``, framed alike in every document sink:
    ``coordinates`` is '<topic>-<partition>-<offset>'; ``key`` needs a message key (ValueError);
    ``field:<path>`` looks the dotted path up in ``doc`` (None when missing). The sink makes
    its own id of the key (``of_key``), of the path and its value (``of_field``, which raises
    ValueError for a value it cannot use) and under ``none`` (``otherwise``)."""
    if id_strategy == "coordinates":
        return f"{record.topic}-{record.partition}-{record.offset}"
    if id_strategy == "key":
        if record.key is None:
            raise ValueError("message has no key (id_strategy: key)")
        return of_key(record.key)
    path = id_field(id_strategy)
    if path is not None:
        return of_field(path, lookup_path(doc, path))
    return otherwise()


# -- client errors as sink errors -----------------------------------------------------------------


@contextlib.contextmanager
def mapped_errors(
    map_error: Callable[[BaseException], SinkError | None],
    *,
    cleanup: Callable[[], object] | None = None,
    catching: type[Exception] | tuple[type[Exception], ...] = Exception,
) -> Iterator[None]:
    """Raise what the block raises (of the ``catching`` types) as the sink error ``map_error``
    makes of it, without the client's exception chain; as it is when ``map_error`` makes none
    (not an error of the sink's client). ``cleanup`` (closing a client the block was checking)
    runs first."""
    try:
        yield
    except catching as e:
        if cleanup is not None:
            cleanup()
        mapped = map_error(e)
        if mapped is None:
            raise
        raise mapped from None


# -- exactly once: the offsets a target keeps (``conveyor.core.sink.OffsetsInTarget``) --------


def batch_offsets(table: pa.Table) -> Offsets:
    """Next offset per partition of the rows in ``table`` (none without the message columns):
    what a target that keeps offsets records with them."""
    if not {TOPIC_COL, PARTITION_COL, OFFSET_COL} <= set(table.schema.names):
        return {}
    return next_offsets_of(table)


def unseen_mask(table: pa.Table, offsets: Offsets) -> pa.Array | None:
    """Per row of ``table``: the target's ``offsets`` do not cover it yet (offset >= its next
    offset), so a batch sent again after its commit writes nothing twice. None: no row is
    covered (no offsets, or no message columns)."""
    if not offsets or not {TOPIC_COL, PARTITION_COL, OFFSET_COL} <= set(table.schema.names):
        return None
    import pyarrow.compute as pc

    topics = table.column(TOPIC_COL).to_pylist()
    partitions = table.column(PARTITION_COL).to_pylist()
    floor = pa.array(
        [offsets.get(TopicPartition(t, p), 0) for t, p in zip(topics, partitions, strict=True)],
        pa.int64(),
    )
    return pc.fill_null(pc.greater_equal(table.column(OFFSET_COL).cast(pa.int64()), floor), True)


def unseen_rows(table: pa.Table, offsets: Offsets) -> pa.Table:
    """The rows of ``table`` the target's ``offsets`` do not cover yet (``unseen_mask``)."""
    mask = unseen_mask(table, offsets)
    return table if mask is None else table.filter(mask)
