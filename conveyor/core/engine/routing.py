"""Per-message routing: where a row goes, whether it may go there, and when to stop trying.

Pure decisions shared by source connectors (each message produced into the topic it
names) and sinks that route rows to several destinations:

- ``Route``: a dotted path into the JSON payload (``a.b.c``, objects only), its value
  looked up in a static mapping (written inline, or fetched once at start from an HTTP
  URL: a failed or malformed fetch refuses to start, never an empty mapping), a
  ``default`` for values the mapping does not hold.
- Admission: ``open``, ``allowlist`` or ``denylist``. A pattern is dot-separated
  segments, each a literal or ``*`` (one whole segment); an entry of only ``*``
  segments would admit everything and is rejected. ``max_destinations`` caps the
  distinct destinations a connector produces into, in every mode.
- ``on_missing_destination`` (a row without a destination): ``default`` (to
  ``default_destination``), ``drop`` or ``error``. ``on_admission_failure`` (cap,
  denylist, not on the allowlist, an open breaker): ``drop`` or ``error``, with the
  default set by the source's mode (``admission_failure_default``).
- ``CircuitBreaker``: per destination, opens after 5 consecutive failures, stays open
  30 s, then lets one probe through (half-open); a success closes it. Failures that
  hit every destination of a batch at once (the broker is gone) are not the
  destination's fault and do not count (``BreakerBoard.record``).

Nothing here does I/O except ``fetch_mapping``'s injected fetcher.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from conveyor.core.errors import ConfigError, ConveyorError

_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_SEGMENT_RE = re.compile(r"^(\*|[A-Za-z0-9_-]+)$")
_PATH_SEGMENT_RE = re.compile(r"^[^.\s]+$")


class RoutingError(ConveyorError):
    """A batch cannot be routed under the connector's rules (``error`` was chosen): the
    connector stops with nothing produced, stored or committed for that batch."""


class SourceMode(str, enum.Enum):
    """How a source's reads relate to its system, which sets the failure defaults."""

    CDC = "cdc"  # a change stream: what is skipped is lost
    POLLING = "polling"  # queries a table; destructive when commit deletes or marks rows
    OPAQUE = "opaque"  # pushed to us (webhook, MQTT); the sender holds it until acknowledged


class Reason(str, enum.Enum):
    """Why a row was not produced (the ``rejected`` metric's label)."""

    CAP = "cap"
    DENYLIST = "denylist"
    UNKNOWN = "unknown"  # not on the allowlist
    CIRCUIT_OPEN = "circuit_open"
    PARTITION_OUT_OF_RANGE = "partition_id_out_of_range"
    INVALID = "invalid_topic"


def admission_failure_default(mode: SourceMode, destructive: bool) -> Literal["drop", "error"]:
    """``on_admission_failure`` when the spec leaves it out (DESIGN: source connectors).

    | mode | default | why |
    |---|---|---|
    | cdc | error | the slot moves past what is dropped: a change would be lost for good |
    | polling, destructive | error | commit deletes or marks the rows: dropped rows are gone |
    | polling | drop | the rows stay in the table and can be read again |
    | opaque | drop | a rejected message is acknowledged to its sender, counted and logged |
    """
    if mode == SourceMode.CDC or (mode == SourceMode.POLLING and destructive):
        return "error"
    return "drop"


def topic_problem(name: str) -> str | None:
    if not _TOPIC_RE.match(name):
        return "a topic name is 1-249 characters of letters, digits, '.', '_' and '-'"
    if name in (".", ".."):
        return "'.' and '..' are not topic names"
    return None


# -- Route ---------------------------------------------------------------------------------


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RouteSpec(_Spec):
    """Route transform: a value in the JSON payload, looked up in a static mapping."""

    path: str = Field(
        description="Dotted path into the JSON payload, e.g. 'order.region' (objects only; no array "
        "indexes)."
    )
    mapping: dict[str, str] | None = Field(
        default=None, description="Value at the path -> destination topic. Give mapping or url."
    )
    url: str | None = Field(
        default=None,
        description="http(s) URL of a JSON object {value: topic}, fetched once when the connector starts; "
        "a failed or malformed fetch refuses to start.",
    )
    default: str | None = Field(
        default=None,
        description="Destination of values the mapping does not hold (and of payloads without the path); "
        "without it such rows have no destination (routing.on_missing_destination).",
    )

    @field_validator("path")
    @classmethod
    def _path_ok(cls, v: str) -> str:
        parts = v.split(".")
        if not v or any(not _PATH_SEGMENT_RE.match(p) for p in parts):
            raise ValueError(f"{v!r} is not a dotted path such as 'order.region'")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> RouteSpec:
        if (self.mapping is None) == (self.url is None):
            raise ValueError("give exactly one of mapping and url")
        if self.url is not None and not re.match(r"^https?://", self.url):
            raise ValueError("url must be http:// or https://")
        for topic in [*(self.mapping or {}).values(), *([self.default] if self.default else [])]:
            problem = topic_problem(topic)
            if problem:
                raise ValueError(f"destination {topic!r}: {problem}")
        return self


def parse_mapping(body: bytes | str, *, where: str) -> dict[str, str]:
    """A fetched mapping: a non-empty JSON object of strings; ConfigError otherwise."""
    try:
        data = json.loads(body)
    except ValueError as e:
        raise ConfigError(
            f"mapping from {where} is not JSON: {e}", field="routing.route.url"
        ) from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(
            f"mapping from {where} must be a non-empty JSON object {{value: topic}}",
            field="routing.route.url",
        )
    out: dict[str, str] = {}
    for k, v in data.items():
        if not isinstance(v, str) or topic_problem(v):
            raise ConfigError(
                f"mapping from {where}: value for {k!r} is not a topic name",
                field="routing.route.url",
            )
        out[str(k)] = v
    return out


def lookup(payload: Any, path: Sequence[str]) -> Any:
    """The value at ``path`` in nested JSON objects; None when a step is missing or not an object."""
    cur = payload
    for p in path:
        if not isinstance(cur, dict) or p not in cur:
            return None
        cur = cur[p]
    return cur


def _key(value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list)):
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    return json.dumps(value)


@dataclass(frozen=True)
class Route:
    """A ready Route transform: ``destination(payload)`` is the topic, or None (no match, no default)."""

    path: tuple[str, ...]
    mapping: Mapping[str, str]
    default: str | None = None

    @classmethod
    def build(cls, spec: RouteSpec, fetch: Callable[[str], bytes] | None = None) -> Route:
        """The mapping inline, or fetched once with ``fetch(url)`` (any error refuses to start)."""
        if spec.mapping is not None:
            mapping = dict(spec.mapping)
        else:
            assert spec.url is not None
            if fetch is None:
                raise ConfigError("no fetcher for a mapping URL", field="routing.route.url")
            try:
                body = fetch(spec.url)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure refuses to start
                raise ConfigError(
                    f"cannot fetch the mapping from {spec.url}: {e}", field="routing.route.url"
                ) from None
            mapping = parse_mapping(body, where=spec.url)
        return cls(tuple(spec.path.split(".")), mapping, spec.default)

    def destination(self, payload: Any) -> str | None:
        if isinstance(payload, (bytes, str)):
            try:
                payload = json.loads(payload)
            except ValueError:
                return self.default
        key = _key(lookup(payload, self.path))
        if key is not None and key in self.mapping:
            return self.mapping[key]
        return self.default


# -- admission ---------------------------------------------------------------------------------


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` is not in the narrow grammar (literal segments or ``*``), or None."""
    segments = pattern.split(".")
    if any(not _SEGMENT_RE.match(s) for s in segments):
        return f"{pattern!r}: each dot-separated segment is a literal (letters, digits, '_', '-') or '*'"
    if all(s == "*" for s in segments):
        return f"{pattern!r} admits every destination; list real names, or use mode: open"
    return None


def pattern_matches(pattern: str, topic: str) -> bool:
    """``*`` stands for exactly one non-empty segment; literals match exactly."""
    ps, ts = pattern.split("."), topic.split(".")
    return len(ps) == len(ts) and all(
        p == "*" and t != "" or p == t for p, t in zip(ps, ts, strict=True)
    )


class AdmissionSpec(_Spec):
    """Which destinations a connector may produce into."""

    mode: Literal["open", "allowlist", "denylist"] = Field(
        default="open",
        description="open: any valid topic; allowlist: only topics matching a pattern; denylist: any "
        "but those matching a pattern.",
    )
    patterns: list[str] = Field(
        default_factory=list,
        description="Dot-separated segments, each a literal or '*' (exactly one segment), e.g. "
        "'orders.*'. An entry of only '*' segments is rejected.",
    )

    @field_validator("patterns")
    @classmethod
    def _grammar(cls, v: list[str]) -> list[str]:
        for p in v:
            problem = pattern_problem(p)
            if problem:
                raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _patterns_for_lists(self) -> AdmissionSpec:
        if self.mode != "open" and not self.patterns:
            raise ValueError(f"mode {self.mode} needs patterns")
        return self

    def admits(self, topic: str) -> Reason | None:
        """None when admitted, else the reason it is not."""
        if topic_problem(topic):
            return Reason.INVALID
        hit = any(pattern_matches(p, topic) for p in self.patterns)
        if self.mode == "allowlist" and not hit:
            return Reason.UNKNOWN
        if self.mode == "denylist" and hit:
            return Reason.DENYLIST
        return None

    def literal_topics(self) -> list[str]:
        """Allowlist entries without '*': the destinations that can be created ahead (pre-warm)."""
        if self.mode != "allowlist":
            return []
        return [p for p in self.patterns if "*" not in p.split(".")]


class RoutingSpec(_Spec):
    """Where each message goes and which destinations are allowed (section `routing`)."""

    route: RouteSpec | None = Field(
        default=None,
        description="Route transform: destination from a value in the JSON payload (after the transform). "
        "Not together with column-derived routing (a source's destination column or a select setting "
        "__destination).",
    )
    default_destination: str | None = Field(
        default=None,
        description="Topic of rows without a destination when on_missing_destination is default.",
    )
    on_missing_destination: Literal["default", "drop", "error"] = Field(
        default="default",
        description="A row without a destination: default (to default_destination), drop (counted), or "
        "error (the connector stops, nothing of the batch is produced).",
    )
    admission: AdmissionSpec = Field(
        default_factory=AdmissionSpec, description="open, allowlist or denylist of destinations."
    )
    max_destinations: int = Field(
        default=100,
        ge=1,
        le=100_000,
        description="Hard cap on distinct destinations this connector produces into, in every mode; rows "
        "for more are admission failures (reason cap).",
    )
    on_admission_failure: Literal["drop", "error"] | None = Field(
        default=None,
        description="A row refused by admission, the cap or an open breaker: drop (counted by reason) or "
        "error. Default by source mode: error for cdc and destructive polling, drop otherwise.",
    )
    max_parallel_destinations: int = Field(
        default=4, ge=1, le=64, description="Destination groups produced at once."
    )

    @field_validator("default_destination")
    @classmethod
    def _topic_ok(cls, v: str | None) -> str | None:
        if v is not None and topic_problem(v):
            raise ValueError(f"{v!r}: {topic_problem(v)}")
        return v


# -- the batch's routing plan -------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """What routing needs of one output row: its index, destination and explicit partition."""

    index: int
    destination: str | None
    partition: int | None = None


@dataclass
class Plan:
    """One batch's routing: rows grouped by destination, and what was left out and why."""

    groups: dict[str, list[int]] = field(default_factory=dict)
    rejected: dict[Reason, list[int]] = field(default_factory=dict)
    unmatched_dropped: list[int] = field(default_factory=list)
    unmatched_defaulted: int = 0
    deferred: list[int] = field(default_factory=list)  # breaker open under 'error': retry later

    def reject(self, reason: Reason, index: int) -> None:
        self.rejected.setdefault(reason, []).append(index)

    @property
    def routed(self) -> int:
        return sum(len(v) for v in self.groups.values())


class Router:
    """Applies a ``RoutingSpec`` to batches; remembers the destinations seen (for the cap).

    ``breakers`` (optional) refuses rows for destinations whose breaker is open.
    ``partitions(topic)`` is the topic's partition count, or None when unknown (not checked).
    """

    def __init__(
        self,
        spec: RoutingSpec,
        *,
        mode: SourceMode = SourceMode.OPAQUE,
        destructive: bool = False,
        known: Iterable[str] = (),
    ):
        self.spec = spec
        self.on_failure = spec.on_admission_failure or admission_failure_default(mode, destructive)
        self.active: set[str] = set(known)

    def plan(
        self,
        rows: Iterable[Row],
        *,
        breaker_open: Callable[[str], bool] = lambda _t: False,
        partitions: Callable[[str], int | None] = lambda _t: None,
    ) -> Plan:
        """Group rows by destination. Raises RoutingError when a rule says ``error``."""
        spec = self.spec
        plan = Plan()
        admitted: dict[str, Reason | None] = {}
        open_now: dict[str, bool] = {}
        new_here: set[str] = set()
        for row in rows:
            dest = row.destination
            if dest is None or dest == "":
                if spec.on_missing_destination == "drop":
                    plan.unmatched_dropped.append(row.index)
                    continue
                if spec.on_missing_destination == "error" or spec.default_destination is None:
                    raise RoutingError(
                        f"row {row.index} has no destination and routing.on_missing_destination is "
                        f"{spec.on_missing_destination!r}"
                        + ("" if spec.default_destination else " (no default_destination)")
                    )
                dest = spec.default_destination
                plan.unmatched_defaulted += 1
            if dest not in admitted:
                reason = spec.admission.admits(dest)
                if reason is None and dest not in self.active and dest not in new_here:
                    if len(self.active) + len(new_here) >= spec.max_destinations:
                        reason = Reason.CAP
                    else:
                        new_here.add(dest)
                admitted[dest] = reason
            reason = admitted[dest]
            if reason is None:
                if dest not in open_now:
                    open_now[dest] = breaker_open(
                        dest
                    )  # once per batch: a half-open probe is the group
                if open_now[dest]:
                    reason = Reason.CIRCUIT_OPEN
            if reason is not None:
                if self.on_failure == "error":
                    if reason == Reason.CIRCUIT_OPEN:
                        plan.deferred.append(row.index)
                        continue
                    raise RoutingError(
                        f"row {row.index}: destination {dest!r} refused ({reason.value}) and "
                        "routing.on_admission_failure is 'error'"
                    )
                plan.reject(reason, row.index)
                continue
            if row.partition is not None:
                count = partitions(dest)
                if count is not None and not 0 <= row.partition < count:
                    plan.reject(Reason.PARTITION_OUT_OF_RANGE, row.index)
                    continue
            plan.groups.setdefault(dest, []).append(row.index)
        self.active |= {d for d in new_here if d in plan.groups}
        return plan


# -- circuit breaker -------------------------------------------------------------------------------


@dataclass
class CircuitBreaker:
    """One destination's breaker: closed -> open after ``threshold`` consecutive failures ->
    half-open after ``cooldown_s`` (one probe) -> closed on success, open again on failure."""

    threshold: int = 5
    cooldown_s: float = 30.0
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False
    last_error: str | None = None

    def state(self, now: float) -> Literal["closed", "open", "half_open"]:
        if self.opened_at is None:
            return "closed"
        if now - self.opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def allows(self, now: float) -> bool:
        """Whether a send may go to the destination now (one probe while half-open)."""
        st = self.state(now)
        if st == "closed":
            return True
        if st == "half_open" and not self.probing:
            self.probing = True
            return True
        return False

    def success(self) -> None:
        self.failures, self.opened_at, self.probing = 0, None, False

    def failure(self, now: float, error: str) -> None:
        self.last_error = error
        self.probing = False
        self.failures += 1
        if self.opened_at is not None or self.failures >= self.threshold:
            self.opened_at = now


@dataclass
class BreakerBoard:
    """The breakers of a connector's destinations."""

    threshold: int = 5
    cooldown_s: float = 30.0
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)

    def get(self, topic: str) -> CircuitBreaker:
        if topic not in self.breakers:
            self.breakers[topic] = CircuitBreaker(self.threshold, self.cooldown_s)
        return self.breakers[topic]

    def is_open(self, topic: str, now: float) -> bool:
        return not self.get(topic).allows(now)

    def record(self, results: Mapping[str, str | None], now: float) -> None:
        """One batch's outcome per destination (None = acknowledged, else the error).

        When every destination of a batch with more than one failed, the cause is common
        (the broker connection): no breaker counts it.
        """
        failed = {t for t, e in results.items() if e is not None}
        common = len(results) > 1 and failed == set(results)
        for topic, error in results.items():
            b = self.get(topic)
            if error is None:
                b.success()
            elif common:
                b.probing = False
                b.last_error = error
            else:
                b.failure(now, error)

    def open_count(self, now: float) -> int:
        return sum(1 for b in self.breakers.values() if b.state(now) != "closed")


# -- sinks that route rows (__destination) ------------------------------------------------------


class DestinationRulesSpec(_Spec):
    """Admission, cap and breakers for a sink connector whose rows choose their destination
    (``__destination``: a Kafka topic, a RabbitMQ routing key, a Redis key...), section
    ``destinations``. A refused row is a failed message, handled by the failure policy."""

    admission: AdmissionSpec = Field(
        default_factory=AdmissionSpec, description="Which destinations rows may go to."
    )
    max_destinations: int | None = Field(
        default=None,
        ge=1,
        description="Hard cap on distinct destinations since the run started; rows to more are refused (cap).",
    )
    breaker: bool = Field(
        default=True,
        description="A per-destination circuit breaker: opens after 5 consecutive failed batches to a "
        "destination (not when every destination failed at once), 30 s cool-down, one probe; rows to an "
        "open destination are refused (circuit_open) while the others flow.",
    )


class DestinationGate:
    """Applies a sink connector's destination rules to each batch's rows (pure; ``now`` passed in)."""

    def __init__(self, spec: DestinationRulesSpec, board: BreakerBoard | None = None):
        self.spec = spec
        self.board = board or BreakerBoard()
        self.seen: set[str] = set()

    def screen(self, destinations: Sequence[str | None], now: float) -> list[Reason | None]:
        """Per row: None when it may be sent (rows without a destination always may)."""
        out: list[Reason | None] = []
        for d in destinations:
            if not d:
                out.append(None)
                continue
            reason: Reason | None
            if self.spec.admission.mode == "open":
                reason = None  # any name the sink accepts: a routing key need not be a topic name
            else:
                hit = any(pattern_matches(p, d) for p in self.spec.admission.patterns)
                allowlist = self.spec.admission.mode == "allowlist"
                reason = (Reason.UNKNOWN if allowlist and not hit else None) or (
                    Reason.DENYLIST if not allowlist and hit else None
                )
            if reason is None and d not in self.seen:
                cap = self.spec.max_destinations
                if cap is not None and len(self.seen) >= cap:
                    reason = Reason.CAP
                else:
                    self.seen.add(d)
            if reason is None and self.spec.breaker and self.board.is_open(d, now):
                reason = Reason.CIRCUIT_OPEN
            out.append(reason)
        return out

    def record(self, results: Mapping[str, str | None], now: float) -> None:
        """The batch's outcome per destination (None = delivered, else an error) for the breakers."""
        if self.spec.breaker and results:
            self.board.record(results, now)
