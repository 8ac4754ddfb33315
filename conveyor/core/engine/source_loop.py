"""The source connector loop: poll -> transform -> route -> admit -> produce -> store state -> commit.

Strictly ordered, one batch at a time::

    validate; prepare transform; init producer (pre-warm the allowlist); init source(state)
    while not stopped:
        polled = source.poll(state)           # the messages after the stored state
        commit(pending) if a commit is owed   # re-run after that poll: it skipped what state covers
        out    = transform(polled)            # Spark: decode, filter, select (may set __destination)
        plan   = route + admission + cap + breakers     # rows grouped by destination
        produce every group (bounded parallelism), waiting for real acknowledgements
        store state (fenced by generation, one transaction)
        source.commit(state)                  # slot advance, deferred DELETE/UPDATE, acks
        heartbeat

- One failed destination fails the batch: nothing is stored or committed, and the next
  poll, from the same stored state, returns the same rows (after the retry delay).
  Groups that were acknowledged are produced again then: at least once.
- A crash anywhere duplicates at most the batch in flight: before the state write the
  batch is polled again; after it, the next run starts past it and only owes the
  commit, which it runs after its first poll.
- A failed commit is not retried at once: the loop polls (from the stored state, so the
  rows the commit covers do not come back), then runs the owed commit again. After
  ``commit_failure_threshold`` failures in a row the connector is ``Degraded``; one
  success clears it.
- A routing rule that says ``error`` stops the connector (``RoutingError``) with
  nothing of the batch stored. An open breaker under ``error`` holds the batch back
  (retried after the delay) instead of losing its rows.

All collaborators are injected; the module performs no I/O of its own.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import pyarrow as pa

from conveyor.core.engine.failure import OutageTracker
from conveyor.core.engine.liveness import Stage, stage_of
from conveyor.core.engine.loop import Transformed, Transformer
from conveyor.core.engine.routing import (
    BreakerBoard,
    Reason,
    Route,
    Router,
    RoutingError,
    RoutingSpec,
    Row,
    SourceMode,
)
from conveyor.core.engine.stopping import Directive, LoopControl, Stopping
from conveyor.core.errors import (
    OUTAGES,
    ConfigError,
    ConveyorError,
    FencedError,
    PermanentSinkError,
    TransientSinkError,
)
from conveyor.core.model import (
    DESTINATION_COL,
    HEADERS_COL,
    KEY_COL,
    MESSAGE_SCHEMA,
    META_COLUMNS,
    PARTITION_COL,
    TIMESTAMP_COL,
    TOMBSTONE_COL,
    BatchPolicy,
    ConnectorStatus,
    Counters,
    RetrySpec,
)

log = logging.getLogger("conveyor.source_loop")

State = dict[str, Any]


class SourceStateVersionError(ConveyorError):
    """The stored state was written by another version of the source: refusing to start
    (a reset is an explicit operator command, never silent)."""


def checked_state(name: str, stored: tuple[int, State] | None, version: int) -> State | None:
    """The stored state if the running source writes its version; SourceStateVersionError
    otherwise (never a silent reset: ``conveyor connector reset-state`` is explicit)."""
    if stored is None:
        return None
    found, state = stored
    if found != version:
        raise SourceStateVersionError(
            f"the stored state of {name} has version {found}, this source writes version "
            f"{version}; refusing to start (reset it explicitly: conveyor connector reset-state {name})"
        )
    return state


class PolledLike(Protocol):
    messages: list[Any]  # SourceMessage
    state: State
    origin: str


class SourceLike(Protocol):
    mode: SourceMode

    @property
    def destructive(self) -> bool: ...
    @property
    def column_routing(self) -> bool: ...
    def init(self, state: State | None) -> None: ...
    def poll(self, state: State | None, max_records: int, max_wait_s: float) -> Any: ...
    def commit(self, state: State) -> None: ...
    def close(self) -> None: ...
    def describe(self) -> str: ...


@dataclass(frozen=True)
class Record:
    """One message to produce."""

    value: bytes | None
    key: bytes | None = None
    partition: int | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int | None = None


class Producer(Protocol):
    """Produces into destination topics; thread-safe for ``ensure`` and ``produce``."""

    def init(self) -> None:
        """Connect; TransientSinkError when the cluster is unreachable."""

    def ensure(self, topic: str) -> int:
        """The topic's partition count, creating it first (topic defaults) when missing."""

    def produce(self, topic: str, records: Sequence[Record]) -> None:
        """Returns once every record is acknowledged; raises TransientSinkError or
        PermanentSinkError for the destination otherwise."""

    def close(self) -> None: ...


class StateWriter(Protocol):
    """The run's fenced writes: the source state, heartbeats."""

    def save(self, state: State, *, abandoned: bool = False) -> None:
        """Store the state for this generation in one transaction; FencedError when superseded.
        ``abandoned``: the batch was skipped on the operator's request (recorded with it)."""

    def heartbeat(
        self, counters: dict[str, Any], status: ConnectorStatus, reason: str | None
    ) -> Directive | bool | None: ...


@dataclass
class SourceLoopConfig:
    name: str
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    batch: BatchPolicy = field(default_factory=BatchPolicy)
    retry: RetrySpec = field(default_factory=RetrySpec)
    commit_failure_threshold: int = 16
    select_routes: bool = False  # the transform's select sets __destination
    prewarm_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    paused_poll_s: float = 0.25
    breaker_threshold: int = 5
    breaker_cooldown_s: float = 30.0
    # `conveyor connector abandon-batch`: store the position after the first batch without
    # producing it (a documented data-loss escape for a batch that can never be delivered).
    abandon_first_batch: bool = False


@dataclass
class RoutingStats:
    """The routing metrics: per destination and per reason (reported with heartbeats)."""

    routed: Tally[str] = field(default_factory=Tally)
    rejected: Tally[str] = field(default_factory=Tally)
    unmatched: Tally[str] = field(default_factory=Tally)
    create_ms: dict[str, float] = field(default_factory=dict)
    last_error: dict[str, str] = field(default_factory=dict)

    def as_dict(self, board: BreakerBoard, now: float, active: int) -> dict[str, Any]:
        destinations = {}
        for topic in sorted(set(self.routed) | set(board.breakers) | set(self.create_ms)):
            b = board.breakers.get(topic)
            destinations[topic] = {
                "routed": self.routed.get(topic, 0),
                "breaker": b.state(now) if b else "closed",
                "consecutive_failures": b.failures if b else 0,
                "last_error": (b.last_error if b else None) or self.last_error.get(topic),
                "create_ms": self.create_ms.get(topic),
            }
        return {
            "routed": sum(self.routed.values()),
            "destinations_active": active,
            "rejected": dict(self.rejected),
            "unmatched": dict(self.unmatched),
            "open_breakers": board.open_count(now),
            "destinations": destinations,
        }


class SourceLoop(LoopControl):
    """Runs one source connector until stopped or an error. Call ``run()`` once."""

    def __init__(
        self,
        config: SourceLoopConfig,
        *,
        source: SourceLike,
        transform: Transformer,
        producer: Producer,
        writer: StateWriter,
        state: State | None,
        route: Route | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
        counters: Counters | None = None,
    ):
        self.cfg = config
        self.source = source
        self.transform = transform
        self.producer = producer
        self.writer = writer
        self.state = state
        self.route = route
        self.clock = clock
        self._init_control(config.name, stop_requested, sleep, counters, config.paused_poll_s)
        self.stats = RoutingStats()
        self.board = BreakerBoard(config.breaker_threshold, config.breaker_cooldown_s)
        self.router = Router(config.routing, mode=source.mode, destructive=source.destructive)
        self._outage = OutageTracker(config.retry, rng or random.Random())
        self._pending_commit: State | None = state  # a restart owes the stored state's commit
        self.commit_failures_in_row = 0
        self._partitions: dict[str, int] = {}
        self._lock = threading.Lock()  # stats and breakers, read by heartbeats and metrics
        self._last_heartbeat = 0.0
        self._closed = False

    # -- public ---------------------------------------------------------------

    def run(self) -> Counters:
        try:
            self._check_routing_kinds()
            prepare = getattr(self.transform, "prepare", None)
            if prepare is not None:
                self._retrying("prepare transform", prepare)
            self._retrying("connect producer", self.producer.init)
            self._prewarm()
            self._retrying("init source", lambda: self.source.init(self.state))
            self._heartbeat(force=True)
            while not self._should_stop():
                if self._pause_event.is_set():
                    self._paused()
                    continue
                self._step()
            if self._fenced is not None:
                raise self._fenced
            return self.counters
        except Stopping:
            return self.counters
        finally:
            self._stop_event.set()
            self._close()

    # -- one step ----------------------------------------------------------------

    def _check_routing_kinds(self) -> None:
        if self.route is not None and (self.source.column_routing or self.cfg.select_routes):
            which = (
                "the source's destination column / per-table destinations"
                if self.source.column_routing
                else "a select setting __destination"
            )
            raise ConfigError(
                f"both column-derived routing ({which}) and a Route transform are configured; "
                "choose one",
                field="routing.route",
            )

    def _prewarm(self) -> None:
        """Create (or check) the allowlist's literal topics within the deadline."""
        topics = self.cfg.routing.admission.literal_topics()
        if not topics:
            return
        deadline = self.clock() + self.cfg.prewarm_timeout_s
        for topic in topics[: self.cfg.routing.max_destinations]:
            if self.clock() > deadline:
                log.warning("%s: pre-warm deadline passed before %s", self.cfg.name, topic)
                return
            try:
                self._ensure(topic)
            except (TransientSinkError, PermanentSinkError) as e:
                self.stats.last_error[topic] = str(e)
                log.warning("%s: pre-warming %s failed: %s", self.cfg.name, topic, e)

    def _step(self) -> None:
        batch = self.cfg.batch
        polled = self._retrying(
            "poll",
            lambda: self.source.poll(self.state, batch.max_records, batch.max_wait_ms / 1000),
        )
        if self._pending_commit is not None:
            self._commit(self._pending_commit)
        if polled is None:
            self._heartbeat()
            return
        if self.cfg.abandon_first_batch:
            self.cfg.abandon_first_batch = False
            log.warning(
                "%s: abandoning %d messages up to %s on the operator's request (not produced)",
                self.cfg.name,
                len(polled.messages),
                polled.state,
            )
            self._retrying("store state", lambda: self.writer.save(polled.state, abandoned=True))
            self.state = polled.state
            with self._lock:
                self.stats.rejected["abandoned"] += len(polled.messages)
            self._commit(polled.state)
            self._heartbeat(force=True)
            return
        started = self.clock()
        try:
            produced = self._deliver(polled)
        except OUTAGES as e:
            # Nothing stored, nothing committed: the next poll returns the same rows.
            self._outage_wait("batch", e)
            return
        # Every group acknowledged: the state may move, then the source's side effects.
        self._retrying("store state", lambda: self.writer.save(polled.state))
        self.state = polled.state
        self._outage.recovered()
        self._commit(polled.state)
        c = self.counters
        self.counters = replace(
            c,
            messages_in=c.messages_in + len(polled.messages),
            messages_out=c.messages_out + produced.sent,
            filtered=c.filtered + produced.filtered,
            failed=c.failed + produced.rejected,
            batches=c.batches + 1,
        )
        self._rate(len(polled.messages), self.clock() - started)
        with self._lock:
            now = self.clock()
            open_now = sorted(t for t, b in self.board.breakers.items() if b.state(now) != "closed")
        if open_now:
            # Progressing, but a destination is refused: shown, not hidden behind Running.
            self._set_status(
                ConnectorStatus.DEGRADED, f"circuit breaker open for {', '.join(open_now[:5])}"
            )
        elif self.status == ConnectorStatus.DEGRADED and self.commit_failures_in_row == 0:
            self._set_status(ConnectorStatus.RUNNING, "recovered: batch produced")
        self._heartbeat()

    def _commit(self, state: State) -> None:
        try:
            with self.stages.stage(Stage.COMMIT):
                self.source.commit(state)
        except FencedError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure is re-run after the next poll
            self._pending_commit = state
            self.commit_failures_in_row += 1
            self._count(commit_failures=1)
            log.warning(
                "%s: commit failed (%d in a row), re-run after the next poll: %s",
                self.cfg.name,
                self.commit_failures_in_row,
                e,
            )
            if self.commit_failures_in_row >= self.cfg.commit_failure_threshold:
                self._set_status(
                    ConnectorStatus.DEGRADED,
                    f"commit failed {self.commit_failures_in_row} times in a row: {e}",
                )
            return
        self._pending_commit = None
        if self.commit_failures_in_row:
            self.commit_failures_in_row = 0
            if self.status == ConnectorStatus.DEGRADED:
                self._set_status(ConnectorStatus.RUNNING, "recovered: commit succeeded")

    # -- transform, route, produce ---------------------------------------------------

    def _deliver(self, polled: PolledLike) -> _Delivered:
        if not polled.messages:
            return _Delivered()
        table = messages_to_table(polled.messages, polled.origin)
        tr: Transformed = self._retrying("transform", lambda: self.transform(table))
        out = tr.table
        records = table_records(out)
        dests = self._destinations(out, records)
        parts = out.column(PARTITION_COL).to_pylist() if PARTITION_COL in out.column_names else []
        rows = [Row(i, dests[i], parts[i] if parts else None) for i in range(out.num_rows)]
        now = self.clock()
        # Counted only once the batch went through: a failed batch comes back and is counted then.
        rejected: Tally[str] = Tally()
        unmatched: Tally[str] = Tally()
        if tr.rejected:
            if self.router.on_failure == "error":
                first = tr.rejected[0]
                raise RoutingError(f"message {first.index}: {first.message}")
            rejected["undecodable"] += len(tr.rejected)
        with self._lock:
            plan = self.router.plan(
                rows,
                breaker_open=lambda t: self.board.is_open(t, now),
                partitions=lambda t: self._partitions.get(t),
            )
        unmatched["default"] += plan.unmatched_defaulted
        unmatched["drop"] += len(plan.unmatched_dropped)
        for reason, idx in plan.rejected.items():
            rejected[reason.value] += len(idx)
        if plan.deferred:
            raise TransientSinkError(
                f"{len(plan.deferred)} rows wait for destinations whose circuit breaker is open"
            )
        with self.stages.stage(Stage.SEND):
            results = self._produce_groups(plan.groups, records)
        with self._lock:
            self.board.record({t: r.error for t, r in results.items()}, self.clock())
            for topic, r in results.items():
                if r.error:
                    self.stats.last_error[topic] = r.error
        permanent = [r for r in results.values() if r.permanent]
        failed = {t: r.error for t, r in results.items() if r.error}
        if failed:
            summary = "; ".join(f"{t}: {e}" for t, e in sorted(failed.items()))
            if permanent and len(permanent) == len(results):
                raise PermanentSinkError(f"every destination failed: {summary}")
            raise TransientSinkError(
                f"{len(failed)} of {len(results)} destinations failed: {summary}"
            )
        for r in results.values():
            rejected[Reason.PARTITION_OUT_OF_RANGE.value] += r.out_of_range
        sent = 0
        with self._lock:
            for topic, r in results.items():
                self.stats.routed[topic] += r.sent
                sent += r.sent
            self.stats.rejected.update(+rejected)
            self.stats.unmatched.update(+unmatched)
        return _Delivered(
            sent=sent,
            filtered=tr.filtered + len(plan.unmatched_dropped),
            rejected=sum(rejected.values()),
        )

    def _destinations(self, out: pa.Table, records: list[Record]) -> list[str | None]:
        if self.route is not None:
            return [
                self.route.destination(r.value) if r.value is not None else self.route.default
                for r in records
            ]
        if DESTINATION_COL in out.column_names:
            return [d if d else None for d in out.column(DESTINATION_COL).to_pylist()]
        return [None] * out.num_rows

    def _produce_groups(
        self, groups: dict[str, list[int]], records: list[Record]
    ) -> dict[str, _GroupResult]:
        if not groups:
            return {}
        workers = min(self.cfg.routing.max_parallel_destinations, len(groups))

        def one(topic: str) -> _GroupResult:
            return self._produce_group(topic, [records[i] for i in groups[topic]])

        if workers == 1:
            return {t: one(t) for t in groups}
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="produce") as pool:
            futures = {t: pool.submit(one, t) for t in groups}
            return {t: f.result() for t, f in futures.items()}

    def _produce_group(self, topic: str, records: list[Record]) -> _GroupResult:
        try:
            count = self._ensure(topic)
            ok = [r for r in records if r.partition is None or 0 <= r.partition < count]
            out_of_range = len(records) - len(ok)
            if ok:
                self.producer.produce(topic, ok)
            return _GroupResult(sent=len(ok), out_of_range=out_of_range)
        except TransientSinkError as e:
            return _GroupResult(error=str(e))
        except PermanentSinkError as e:
            return _GroupResult(error=str(e), permanent=True)

    def _ensure(self, topic: str) -> int:
        if topic in self._partitions:
            return self._partitions[topic]
        started = self.clock()
        count = self.producer.ensure(topic)
        with self._lock:
            self.stats.create_ms[topic] = round((self.clock() - started) * 1000, 3)
        self._partitions[topic] = count
        return count

    # -- plumbing --------------------------------------------------------------------

    def _retrying(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` inside its stage until it succeeds, retrying outages (``OUTAGES``)."""
        while True:
            try:
                with self.stages.stage(stage_of(what)):
                    return fn()
            except OUTAGES as e:
                self._outage_wait(what, e)

    def heartbeat_payload(self) -> dict[str, Any]:
        now = self.clock()
        d = self.counters.as_dict()
        with self._lock:
            d["routing"] = self.stats.as_dict(self.board, now, len(self.router.active))
        d["commit_failures_in_row"] = self.commit_failures_in_row
        gauges = getattr(self.source, "metrics", None)  # optional (Source.metrics)
        if gauges is not None:
            d.update(gauges())
        return d

    def _heartbeat(self, force: bool = False) -> None:
        now = self.clock()
        changed = bool(self._transitions)  # a status change is reported at once
        if not force and not changed and now - self._last_heartbeat < self.cfg.heartbeat_interval_s:
            return
        self._last_heartbeat = now
        self._beat_now(force or changed)

    def _send_heartbeat(
        self, status: ConnectorStatus, reason: str | None
    ) -> Directive | bool | None:
        return self.writer.heartbeat(self.heartbeat_payload(), status, reason)

    def _rate(self, n: int, seconds: float) -> None:
        if seconds > 0:
            self.counters = replace(self.counters, msgs_per_s=round(n / seconds, 1))

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.producer.close()
        finally:
            self.source.close()


@dataclass(frozen=True)
class _Delivered:
    sent: int = 0
    filtered: int = 0
    rejected: int = 0


@dataclass(frozen=True)
class _GroupResult:
    sent: int = 0
    out_of_range: int = 0
    error: str | None = None
    permanent: bool = False


def messages_to_table(messages: Sequence[Any], origin: str) -> pa.Table:
    """Polled messages as the Arrow batch the transform takes (``MESSAGE_SCHEMA``)."""
    import datetime as dt

    def ts(ms: int | None) -> dt.datetime | None:
        return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc)

    cols: dict[str, list[Any]] = {
        "__topic": [origin] * len(messages),
        "__partition": [m.partition for m in messages],
        "__offset": list(range(len(messages))),
        "__timestamp": [ts(m.timestamp_ms) for m in messages],
        "__timestamp_type": ["create" if m.timestamp_ms is not None else None for m in messages],
        "__key": [m.key for m in messages],
        "__headers": [[{"key": k, "value": v} for k, v in m.headers] for m in messages],
        "__destination": [m.destination for m in messages],
        "__value": [m.payload for m in messages],
    }
    return pa.table(cols, schema=MESSAGE_SCHEMA)


def table_records(out: pa.Table) -> list[Record]:
    """The transform's output rows as records: payload columns as the JSON value, the
    message columns as key, partition, headers and timestamp."""
    payload_cols = [c for c in out.column_names if c not in META_COLUMNS]
    n = out.num_rows
    if payload_cols == ["value"]:
        raw = out.column("value").to_pylist()
        values: list[bytes | None] = [
            v if isinstance(v, bytes) or v is None else str(v).encode() for v in raw
        ]
    else:
        rows = out.select(payload_cols).to_pylist()
        values = [json.dumps(r, default=str, separators=(",", ":")).encode() for r in rows]

    def col(name: str) -> list[Any]:
        return out.column(name).to_pylist() if name in out.column_names else [None] * n

    keys, parts, headers, stamps, tombs = (
        col(KEY_COL),
        col(PARTITION_COL),
        col(HEADERS_COL),
        col(TIMESTAMP_COL),
        col(TOMBSTONE_COL),  # a tombstone stays one whatever its (null) payload columns
    )
    out_records = []
    for i in range(n):
        key = keys[i]
        if isinstance(key, str):
            key = key.encode()
        stamp = stamps[i]
        out_records.append(
            Record(
                value=None if tombs[i] else values[i],
                key=key or None,
                partition=parts[i],
                headers=tuple((h["key"], h["value"]) for h in (headers[i] or [])),
                timestamp_ms=int(stamp.timestamp() * 1000) if stamp is not None else None,
            )
        )
    return out_records
