"""The sink contract suite: one set of behaviours every sink passes.

Subclass ``SinkContract`` once per sink (``tests/sinks/test_<sink>.py``) and fill in
the hooks. pytest collects the subclass's ``test_*`` methods; the base class is not
collected (its name does not start with ``Test``).

What the suite checks (DESIGN.md section 5, the ``conveyor.sinks.base`` contract):

- delivery of N messages, with keys, headers and timestamps where the target holds them;
- a replay of the same batch: no duplicates where the sink is idempotent, exactly
  one documented duplicate per message where it is not;
- per-message data errors reported with their index, the other rows delivered;
- an outage (a closed loopback port) reported as ``TransientSinkError``;
- ``cleanup_sink`` twice;
- ``validate`` / config parsing rejecting each bad field with a message naming it.

Batches look like what the connector loop hands a sink after Spark decoded JSON
payloads: payload columns ``id`` (int64), ``name`` (string), ``amount`` (double)
plus the metadata columns.
"""

from __future__ import annotations

import datetime as dt
import re
import socket
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import pyarrow as pa
import pytest

from conveyor.core.errors import ConfigError, PermanentSinkError, TransientSinkError
from conveyor.core.model import META_COLUMNS
from conveyor.sinks import build_sink
from conveyor.sinks.base import ErrorKind, Sink

N = 500
BASE_TS = dt.datetime(2026, 11, 1, 12, 0, 0, tzinfo=dt.timezone.utc)

HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def make_batch(
    n: int = N,
    *,
    start: int = 0,
    topic: str = "orders",
    partition: int = 0,
    names: dict[int, Any] | None = None,
    amounts: dict[int, Any] | None = None,
) -> pa.Table:
    """A decoded batch of ``n`` messages with ids ``start..start+n-1``.

    Message ``i`` has key ``k<i>``, one header ``h=<i>``, timestamp BASE_TS + i ms,
    name ``name <i>`` (with a space: a value must never split) and amount ``i * 1.5``.
    ``names`` / ``amounts`` override single rows (to make poison rows).
    """
    ids = list(range(start, start + n))
    names = names or {}
    amounts = amounts or {}
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([names.get(i, f"name {i}") for i in ids], pa.string()),
            "amount": pa.array([amounts.get(i, i * 1.5) for i in ids], pa.float64()),
            "__topic": pa.array([topic] * n, pa.string()),
            "__partition": pa.array([partition] * n, pa.int32()),
            "__offset": pa.array(ids, pa.int64()),
            "__timestamp": pa.array(
                [BASE_TS + dt.timedelta(milliseconds=i) for i in ids], pa.timestamp("ms", tz="UTC")
            ),
            "__key": pa.array([f"k{i}".encode() for i in ids], pa.binary()),
            "__headers": pa.array(
                [[{"key": "h", "value": str(i).encode()}] for i in ids], HEADERS_TYPE
            ),
            "__destination": pa.nulls(n, pa.string()),
        }
    )


def closed_port() -> int:
    """A loopback port nothing listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SinkContract:
    """Base of the per-sink contract tests. Subclasses set the class attributes and hooks."""

    #: the sink's registered type
    sink_type: ClassVar[str]
    #: a replayed batch leaves no duplicates
    idempotent: ClassVar[bool]
    #: the target keeps the message key / headers / timestamp (when configured to)
    keeps_keys: ClassVar[bool] = False
    keeps_headers: ClassVar[bool] = False
    keeps_timestamps: ClassVar[bool] = False

    # -- hooks ---------------------------------------------------------------------

    def make_target(self) -> Iterator[str]:
        """Create a fresh, empty target (table, key prefix, topic, queue...), yield its name, drop it."""
        raise NotImplementedError

    def config(self, target: str) -> dict[str, Any]:
        """The raw sink config (with ``type``) writing to ``target``."""
        raise NotImplementedError

    def read_back(self, target: str) -> list[dict[str, Any]]:
        """Everything stored in ``target``, one dict per stored message: ``id`` (int) always,
        ``name`` always, and ``key`` (bytes), ``headers`` (dict[str, bytes]), ``timestamp``
        (aware datetime) where the class says the target keeps them."""
        raise NotImplementedError

    def poison_batch(self, target: str) -> tuple[pa.Table, set[int]] | None:
        """A batch with rows the target rejects for their content, and their indexes;
        ``None`` (with ``poison_skip_reason``) when the system cannot reject a row."""
        return None

    poison_skip_reason: ClassVar[str] = ""

    def outage_config(self, target: str) -> dict[str, Any] | None:
        """A config whose server is unreachable (a closed loopback port); ``None`` with
        ``outage_skip_reason`` when the sink has no server."""
        return None

    outage_skip_reason: ClassVar[str] = ""

    #: with ``fail_fast`` the sink writes nothing after the first failed row (False: its
    #: client reports failures only after the whole batch went out; see the sink's docs)
    stops_at_first_failure: ClassVar[bool] = True

    #: (override of config fields, the field name the error must mention)
    bad_fields: ClassVar[list[tuple[dict[str, Any], str]]] = []

    def stored(self, sink: Sink, target: str) -> list[dict[str, Any]]:
        """``read_back`` once what the sink acknowledged is durable: a sink that acknowledges at
        its own commit (``core.sink.AcknowledgesAtCommit``, the lakehouse sinks' buffer) makes
        that commit first, as the runtime does before it commits offsets."""
        from conveyor.core.sink import commit_held

        commit_held(sink)
        return self.read_back(target)

    # -- fixtures ------------------------------------------------------------------

    @pytest.fixture
    def target(self) -> Iterator[str]:
        yield from self.make_target()

    @pytest.fixture
    def sink(self, target: str) -> Iterator[Sink]:
        s = build_sink(self.config(target))
        s.init_sink()
        try:
            yield s
        finally:
            s.cleanup_sink()

    # -- the contract --------------------------------------------------------------

    def test_delivers_every_message_with_metadata(self, sink: Sink, target: str) -> None:
        batch = make_batch(N)
        result = sink.send_batch(batch)
        assert result.rows == N and result.failed == ()
        stored = self.stored(sink, target)
        assert sorted(r["id"] for r in stored) == list(range(N))
        by_id = {r["id"]: r for r in stored}
        assert by_id[7]["name"] == "name 7"
        if self.keeps_keys:
            assert by_id[7]["key"] == b"k7"
        if self.keeps_headers:
            assert by_id[7]["headers"] == {"h": b"7"}
        if self.keeps_timestamps:
            assert by_id[7]["timestamp"] == BASE_TS + dt.timedelta(milliseconds=7)

    def test_replay_of_a_batch(self, sink: Sink, target: str) -> None:
        from conveyor.core.sink import commit_held

        batch = make_batch(N)
        sink.send_batch(batch)
        commit_held(sink)  # the replay comes after the target committed the batch
        again = sink.send_batch(batch)
        assert again.failed == ()
        ids = sorted(r["id"] for r in self.stored(sink, target))
        if self.idempotent:
            assert ids == list(range(N)), "an idempotent sink must not duplicate a replayed batch"
        else:
            # Documented: at-least-once without idempotence means one copy per replay.
            assert ids == sorted(list(range(N)) * 2)

    def test_data_errors_are_reported_with_their_index(self, sink: Sink, target: str) -> None:
        poison = self.poison_batch(target)
        if poison is None:
            pytest.skip(self.poison_skip_reason or "this system cannot reject a single message")
        batch, bad = poison
        from conveyor.core.errors import BatchRejected

        try:
            result = sink.send_batch(batch)
        except BatchRejected:
            # Allowed by the contract: the runtime bisects. Check each bad row alone is rejected
            # and the good rows go through on their own.
            for i in sorted(bad):
                with pytest.raises(BatchRejected):
                    sink.send_batch(batch.slice(i, 1))
            good = [i for i in range(batch.num_rows) if i not in bad]
            for i in good:
                assert sink.send_batch(batch.slice(i, 1)).failed == ()
        else:
            assert {f.index for f in result.failed} == bad
            assert all(f.kind is ErrorKind.DATA and f.message for f in result.failed)
        stored = sorted(r["id"] for r in self.stored(sink, target))
        ids = batch.column("id").to_pylist()
        assert stored == sorted(ids[i] for i in range(batch.num_rows) if i not in bad)

    def test_hostile_corpus_every_row_written_or_failed_never_a_batch_error(
        self, sink: Sink, target: str
    ) -> None:
        from conveyor.core.sink import send_isolating
        from tests.hostile import hostile_batch

        batch, what = hostile_batch()
        failed = send_isolating(sink, batch)  # the runtime's send, with its bisection
        bad = {f.index for f in failed}
        stored = [r["id"] for r in self.stored(sink, target)]
        assert len(stored) == len(set(stored)), "a row was written twice"
        assert not set(stored) & bad, "a row was both written and failed"
        assert set(stored) | bad == set(range(batch.num_rows)), "a row was lost"
        assert not [what[i] for i in bad if what[i] == "good"], "a good row failed"
        assert all(f.message for f in failed)

    def test_fail_fast_writes_nothing_after_the_first_failed_row(
        self, sink: Sink, target: str
    ) -> None:
        from conveyor.core.sink import send_isolating

        poison = self.poison_batch(target)
        if poison is None:
            pytest.skip(self.poison_skip_reason or "this system cannot reject a single message")
        batch, bad = poison
        first = min(bad)
        failed = send_isolating(sink, batch, fail_fast=True)
        assert [f.index for f in failed] == [first]
        ids = batch.column("id").to_pylist()
        stored = sorted(r["id"] for r in self.stored(sink, target))
        if self.stops_at_first_failure:
            assert stored == sorted(ids[:first])
        else:
            assert set(ids[:first]) <= set(stored)

    def test_invalid_utf8_in_a_text_column_is_a_row_failure(self, sink: Sink, target: str) -> None:
        """A string column holding invalid UTF-8 (Arrow does not check buffers it did not
        build, e.g. Spark casting bytes to a string): that row fails with a reason naming
        invalid UTF-8 and the rest is written; under fail_fast nothing after it."""
        from conveyor.core.sink import send_isolating
        from tests.hostile import with_invalid_utf8

        batch = with_invalid_utf8(make_batch(20), "name", {7, 12})
        failed = send_isolating(sink, batch, fail_fast=True)
        assert [f.index for f in failed] == [7]
        assert re.search("utf-?8", failed[0].message, re.I), failed[0].message
        first = sorted(r["id"] for r in self.stored(sink, target))
        assert first == list(range(7))
        sink.fail_fast = False  # send_isolating sets it; the other policies leave it off
        failed = send_isolating(sink, batch.slice(8))
        assert [f.index for f in failed] == [4]
        stored = {r["id"] for r in self.stored(sink, target)} | set(first)  # a queue is drained
        assert stored == set(range(20)) - {7, 12}

    def test_outage_is_transient(self, target: str) -> None:
        cfg = self.outage_config(target)
        if cfg is None:
            pytest.skip(self.outage_skip_reason or "this sink has no server to lose")
        s = build_sink(cfg)
        try:
            with pytest.raises(TransientSinkError):
                s.init_sink()
                s.send_batch(make_batch(10))
        finally:
            s.cleanup_sink()

    def test_cleanup_twice(self, target: str) -> None:
        s = build_sink(self.config(target))
        s.init_sink()
        assert s.send_batch(make_batch(3)).failed == ()
        s.cleanup_sink()
        s.cleanup_sink()
        # and cleanup of a sink that never started
        build_sink(self.config(target)).cleanup_sink()
        # the target is still usable afterwards by a new sink
        again = build_sink(self.config(target))
        again.init_sink()
        try:
            assert again.send_batch(make_batch(3)).failed == ()
        finally:
            again.cleanup_sink()

    def test_validate_rejects_each_bad_field(self) -> None:
        assert self.bad_fields, "list at least one bad field"
        for override, field_name in self.bad_fields:
            cfg = {**self.config("contract_target"), **override}
            with pytest.raises(ConfigError) as err:
                build_sink(cfg)
            assert field_name in str(err.value), f"{override}: {err.value}"

    def test_rejects_unknown_field(self) -> None:
        with pytest.raises(ConfigError, match="no_such_option"):
            build_sink({**self.config("contract_target"), "no_such_option": 1})


def unique(prefix: str = "c") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


__all__ = [
    "BASE_TS",
    "META_COLUMNS",
    "N",
    "PermanentSinkError",
    "SinkContract",
    "closed_port",
    "make_batch",
    "unique",
]
