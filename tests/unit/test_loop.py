"""The connector loop with in-memory collaborators: ordering, failures, interrupts."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from conveyor.brokers.kafka import SOURCE_SCHEMA
from conveyor.core.engine.loop import (
    ConnectorLoop,
    DataPolicyError,
    Directive,
    LoopConfig,
    Rejected,
    SourceBatch,
    Transformed,
    next_offsets_of,
    offsets_before,
    run_loop,
)
from conveyor.core.errors import (
    BatchRejected,
    DeadLetterLimitError,
    FencedError,
    OutageBudgetExceeded,
    TransientSinkError,
    is_data_error,
)
from conveyor.core.model import (
    BatchPolicy,
    ConnectorStatus,
    DeadLetterSpec,
    FailurePolicyName,
    FailureSpec,
    RetrySpec,
    TopicPartition,
)
from conveyor.sinks.base import ErrorKind, RowFailure, SendResult

TP0 = TopicPartition("t", 0)


def source_batch(start: int, n: int, bad: set[int] = frozenset()) -> SourceBatch:
    rows = [
        {
            "__topic": "t",
            "__partition": 0,
            "__offset": o,
            "__timestamp": None,
            "__key": str(o).encode(),
            "__headers": [],
            "__destination": None,
            "__value": b"not json" if o in bad else json.dumps({"id": o}).encode(),
        }
        for o in range(start, start + n)
    ]
    table = pa.Table.from_pylist(rows, schema=SOURCE_SCHEMA)
    return SourceBatch(table=table, next_offsets=next_offsets_of(table))


class Events(list):
    pass


class FakeSource:
    def __init__(self, batches, events, *, stop_after=True):
        self.batches = list(batches)
        self.events = events
        self.closed = 0

    def read(self, policy):
        if self.batches:
            b = self.batches.pop(0)
            self.events.append(("read", b.table.column("__offset")[0].as_py()))
            return b
        return None

    def lag(self, committed):
        return 0

    def close(self):
        self.closed += 1


def json_transform(batch: pa.Table) -> Transformed:
    ids, rejected = [], []
    keep = []
    for i, v in enumerate(batch.column("__value").to_pylist()):
        try:
            ids.append(json.loads(v)["id"])
            keep.append(i)
        except ValueError:
            rejected.append(Rejected(i, "undecodable payload: not valid JSON"))
    out = (
        batch.take(pa.array(keep, pa.int64()))
        .drop_columns(["__value"])
        .append_column("id", pa.array(ids, pa.int64()))
    )
    return Transformed(table=out, rejected=tuple(rejected))


class FakeSink:
    def __init__(
        self,
        events,
        *,
        reject_ids=(),
        transient_failures=0,
        whole_request=False,
        fail_times=None,
        honours_fail_fast=True,
    ):
        self.events = events
        if honours_fail_fast:
            self.fail_fast = False  # set by the loop under the fail policy
        self.rows: list[int] = []
        self.reject_ids = set(reject_ids)
        self.transient_failures = transient_failures
        self.whole_request = whole_request
        self.fail_times = fail_times  # id -> how many sends it fails before succeeding
        self.cleanups = 0

    def validate(self):
        pass

    def init_sink(self):
        self.events.append(("init",))

    def describe(self):
        return "fake"

    def send_batch(self, batch):
        if self.transient_failures:
            self.transient_failures -= 1
            self.events.append(("send-outage",))
            raise TransientSinkError("connection refused")
        ids = batch.column("id").to_pylist()
        bad = []
        for i, v in enumerate(ids):
            if v in self.reject_ids:
                if self.fail_times is not None:
                    if self.fail_times.get(v, 0) > 0:
                        self.fail_times[v] -= 1
                        bad.append(i)
                else:
                    bad.append(i)
        if self.whole_request and bad:
            raise BatchRejected(f"request rejected: contains bad id {ids[bad[0]]}")
        if getattr(self, "fail_fast", False) and bad:
            ids, bad = ids[: bad[0] + 1], bad[:1]  # nothing after the first failed row
        good = [v for i, v in enumerate(ids) if i not in bad]
        self.rows.extend(good)
        self.events.append(("send", len(good)))
        return SendResult(
            rows=len(ids), failed=tuple(RowFailure(i, f"bad id {ids[i]}") for i in bad)
        )

    def cleanup_sink(self):
        self.cleanups += 1


class FakeCommitter:
    def __init__(
        self, events, *, fence_after=None, interrupt_first_commit=False, desired_running=True
    ):
        self.events = events
        self.offsets: dict = {}
        self.heartbeats: list = []
        self.fence_after = fence_after
        self.interrupt_first_commit = interrupt_first_commit
        self.desired_running = desired_running

    def commit(self, offsets):
        if self.interrupt_first_commit:
            self.interrupt_first_commit = False
            raise KeyboardInterrupt  # stands for DagsterExecutionInterruptedError, a BaseException
        if (
            self.fence_after is not None
            and len([e for e in self.events if e[0] == "commit"]) >= self.fence_after
        ):
            raise FencedError("stale generation")
        self.offsets.update(offsets)
        self.events.append(("commit", dict(offsets)))

    def heartbeat(self, counters, status, reason):
        self.heartbeats.append((status, reason, counters))
        return self.desired_running


class FakeDeadLetters:
    def __init__(self, events):
        self.events = events
        self.letters = []

    def write(self, letters):
        self.letters.extend(letters)
        self.events.append(("dead-letter", len(letters)))


def make_loop(
    batches,
    *,
    sink=None,
    committer=None,
    failure=None,
    retry=None,
    dead=None,
    events=None,
    stop_when_drained=True,
    transform=json_transform,
    destinations=None,
):
    events = events if events is not None else Events()
    source = FakeSource(batches, events)
    sink = sink or FakeSink(events)
    committer = committer or FakeCommitter(events)
    sleeps: list[float] = []
    clock = [1000.0]
    final = {}
    for b in batches:
        final.update(b.next_offsets)

    def sleep(s):
        sleeps.append(s)
        clock[0] += s

    loop = ConnectorLoop(
        LoopConfig(
            name="c",
            batch=BatchPolicy(max_wait_ms=10),
            retry=retry or RetrySpec(delay=1, jitter="none"),
            failure=failure or FailureSpec(),
            prefetch=False,
            destinations=destinations,
        ),
        source=source,
        transform=transform,
        sink=sink,
        committer=committer,
        committed={},
        dead_letters=dead,
        # "drained" = everything read and the last batch committed, or it failed for good
        stop_requested=(
            lambda: not source.batches and (committer.offsets == final or not loop._outage.active)
        )
        if stop_when_drained
        else (lambda: False),
        clock=lambda: clock[0],
        sleep=sleep,
    )
    return loop, source, sink, committer, events, sleeps


def test_delivers_every_message_and_commits_after_each_send():
    loop, source, sink, committer, events, _ = make_loop(
        [source_batch(0, 100), source_batch(100, 50)]
    )
    counters = run_loop(loop)
    assert sink.rows == list(range(150))
    assert committer.offsets == {TP0: 150}
    kinds = [e[0] for e in events]
    assert kinds == ["init", "read", "send", "commit", "read", "send", "commit"]
    assert counters.messages_in == 150 and counters.messages_out == 150 and counters.batches == 2
    assert sink.cleanups == 1 and source.closed == 1


def test_outage_retries_with_backoff_commits_nothing_meanwhile_and_shows_degraded():
    events = Events()
    sink = FakeSink(events, transient_failures=3)
    loop, _, sink, committer, events, sleeps = make_loop(
        [source_batch(0, 10)], sink=sink, events=events
    )
    run_loop(loop)
    assert sleeps == [1.0, 2.0, 4.0]  # exponential, no jitter
    kinds = [e[0] for e in events]
    assert kinds.index("commit") > max(i for i, k in enumerate(kinds) if k == "send-outage")
    statuses = [h[0] for h in committer.heartbeats]
    assert ConnectorStatus.DEGRADED in statuses
    assert statuses[-1] == ConnectorStatus.RUNNING
    assert sink.rows == list(range(10)) and committer.offsets == {TP0: 10}
    assert loop.counters.retries == 3


class SinkWhoseInitRacesOnce(FakeSink):
    """Its first ``init_sink`` loses a race for a shared table (an outage), the next works."""

    def init_sink(self):
        if not any(e == ("init-outage",) for e in self.events):
            self.events.append(("init-outage",))
            raise TransientSinkError("duplicate key value violates unique constraint")
        super().init_sink()


def test_a_connector_whose_start_ran_into_an_outage_is_running_again_before_any_batch():
    """An idle connector gets no batch to end the Degraded state an outage at its start set:
    the retry's success ends it (a fleet's sinks creating one offsets table at once)."""
    events = Events()
    loop, _, _, committer, events, sleeps = make_loop(
        [source_batch(0, 10)], sink=SinkWhoseInitRacesOnce(events), events=events
    )
    run_loop(loop)
    assert [e[0] for e in events][:2] == ["init-outage", "init"] and sleeps[0] == 1.0
    beats = [(h[0], h[1]) for h in committer.heartbeats]
    degraded = beats.index(next(b for b in beats if b[0] == ConnectorStatus.DEGRADED))
    assert beats[degraded + 1] == (ConnectorStatus.RUNNING, "recovered: init sink succeeded")
    assert beats[-1][0] == ConnectorStatus.RUNNING
    assert loop.counters.retries == 1 and committer.offsets == {TP0: 10}


def test_outage_budget_exhausted_raises_without_commit():
    events = Events()
    sink = FakeSink(events, transient_failures=100)
    loop, _, _, committer, _, _ = make_loop(
        [source_batch(0, 10)],
        sink=sink,
        events=events,
        retry=RetrySpec(max_retries=3, delay=1, jitter="none"),
    )
    with pytest.raises(OutageBudgetExceeded, match="4 attempts"):
        run_loop(loop)
    assert committer.offsets == {}
    assert sink.cleanups == 1


def test_fail_policy_stops_on_undecodable_payload_naming_the_offset():
    loop, _, sink, committer, _, _ = make_loop([source_batch(0, 10, bad={5})])
    with pytest.raises(
        DataPolicyError, match=r"data error: message t\[0\]@5 failed \(decode\): undecodable"
    ) as e:
        run_loop(loop)
    # The rows before it are delivered and committed, nothing after it is sent.
    assert sink.rows == [0, 1, 2, 3, 4]
    assert committer.offsets == {TP0: 5}
    assert (e.value.topic, e.value.partition, e.value.offset) == ("t", 0, 5)
    assert is_data_error(str(e.value))


@pytest.mark.parametrize("whole_request", [False, True])
def test_fail_policy_writes_nothing_after_the_failed_row_and_resumes_exactly_at_it(whole_request):
    events = Events()
    sink = FakeSink(events, reject_ids={37}, whole_request=whole_request)
    loop, source, _, committer, _, _ = make_loop(
        [source_batch(0, 100), source_batch(100, 100)], sink=sink, events=events
    )
    with pytest.raises(DataPolicyError, match=r"t\[0\]@37 failed \(data\): .*bad id 37") as e:
        run_loop(loop)
    assert sink.rows == list(range(37))  # each good row before it once, nothing after it
    assert committer.offsets == {TP0: 37}
    assert e.value.offset == 37 and len(source.batches) == 1  # the next batch is not read
    assert loop.counters.messages_out == 37 and loop.counters.failed == 1
    # "Restarted" after a fix: it resumes exactly at the bad message; nothing is written twice.
    sink.reject_ids = set()
    again, _, _, _, _, _ = make_loop(
        [source_batch(37, 63), source_batch(100, 100)], sink=sink, committer=committer
    )
    run_loop(again)
    assert sink.rows == list(range(200))
    assert committer.offsets == {TP0: 200}


def test_fail_policy_with_a_sink_that_cannot_stop_still_commits_only_before_the_failure():
    events = Events()
    sink = FakeSink(events, reject_ids={5, 8}, honours_fail_fast=False)
    loop, _, _, committer, _, _ = make_loop([source_batch(0, 10)], sink=sink, events=events)
    with pytest.raises(DataPolicyError, match=r"t\[0\]@5 failed"):
        run_loop(loop)
    assert committer.offsets == {TP0: 5}  # the rows it wrote after 5 are sent again on resume
    assert loop.counters.messages_out == 5


def test_offsets_before_a_cut_per_partition():
    rows = [("t", 0, 10), ("t", 1, 20), ("t", 0, 11), ("t", 1, 21), ("t", 2, 7)]
    table = pa.Table.from_pylist(
        [{"__topic": t, "__partition": p, "__offset": o} for t, p, o in rows]
    )
    nxt = next_offsets_of(table)
    tp = TopicPartition
    assert offsets_before(table, 2, nxt) == {tp("t", 0): 11, tp("t", 1): 21, tp("t", 2): 7}
    assert offsets_before(table, 0, nxt) == {tp("t", 0): 10, tp("t", 1): 20, tp("t", 2): 7}
    assert offsets_before(table, 5, nxt) == nxt


def test_dead_letter_policy_isolates_poison_row_and_commits_after_dead_letters():
    events = Events()
    dead = FakeDeadLetters(events)
    sink = FakeSink(events, reject_ids={500})
    loop, _, sink, committer, events, _ = make_loop(
        [source_batch(0, 1000)],
        sink=sink,
        dead=dead,
        events=events,
        failure=FailureSpec(policy=FailurePolicyName.DEAD_LETTER, retries=2),
    )
    counters = run_loop(loop)
    assert len(sink.rows) == 999 and 500 not in sink.rows
    assert [(d.failed.offset, d.failed.attempts) for d in dead.letters] == [(500, 3)]
    assert (
        dead.letters[0].value == json.dumps({"id": 500}).encode() and dead.letters[0].key == b"500"
    )
    kinds = [e[0] for e in events]
    assert kinds.index("dead-letter") < kinds.index("commit")
    assert committer.offsets == {TP0: 1000}
    assert counters.dead_lettered == 1 and counters.retries == 2


def test_discard_after_retry_delivers_a_row_that_succeeds_on_retry():
    events = Events()
    sink = FakeSink(events, reject_ids={3, 7}, fail_times={3: 1, 7: 99})
    loop, _, sink, committer, _, _ = make_loop(
        [source_batch(0, 10)],
        sink=sink,
        events=events,
        failure=FailureSpec(policy=FailurePolicyName.DISCARD_AFTER_RETRY, retries=2),
    )
    counters = run_loop(loop)
    assert sorted(sink.rows) == [0, 1, 2, 3, 4, 5, 6, 8, 9]
    assert counters.discarded == 1 and counters.messages_out == 9
    assert committer.offsets == {TP0: 10}


def test_discard_policy_counts_and_moves_on():
    events = Events()
    sink = FakeSink(events, reject_ids={1})
    loop, _, sink, committer, _, _ = make_loop(
        [source_batch(0, 20, bad={4})],
        sink=sink,
        events=events,
        failure=FailureSpec(policy=FailurePolicyName.DISCARD),
    )
    counters = run_loop(loop)
    assert counters.discarded == 2 and counters.messages_out == 18
    assert committer.offsets == {TP0: 20}


def test_whole_request_rejection_is_bisected_to_the_bad_row():
    events = Events()
    dead = FakeDeadLetters(events)
    sink = FakeSink(events, reject_ids={37}, whole_request=True)
    loop, _, sink, _, events, _ = make_loop(
        [source_batch(0, 64)],
        sink=sink,
        dead=dead,
        events=events,
        failure=FailureSpec(policy=FailurePolicyName.DEAD_LETTER, retries=0),
    )
    run_loop(loop)
    assert sorted(sink.rows) == [i for i in range(64) if i != 37]
    assert [d.failed.offset for d in dead.letters] == [37]
    assert "bad id 37" in dead.letters[0].failed.error
    # log2(64) levels: a handful of requests, not 64
    assert len([e for e in events if e[0] == "send"]) <= 2 * 7


def test_dead_letter_limit_stops_instead_of_draining():
    events = Events()
    dead = FakeDeadLetters(events)
    sink = FakeSink(events, reject_ids=set(range(100)))
    loop, _, _, committer, _, _ = make_loop(
        [source_batch(0, 100)],
        sink=sink,
        dead=dead,
        events=events,
        failure=FailureSpec(
            policy=FailurePolicyName.DEAD_LETTER,
            retries=0,
            dead_letter=DeadLetterSpec(max_ratio=0.5),
        ),
    )
    with pytest.raises(DeadLetterLimitError, match="100 of 100"):
        run_loop(loop)
    assert dead.letters == [] and committer.offsets == {}


def test_interrupt_between_ack_and_commit_still_commits_what_was_acknowledged():
    events = Events()
    committer = FakeCommitter(events, interrupt_first_commit=True)
    loop, _, sink, committer, _, _ = make_loop(
        [source_batch(0, 10), source_batch(10, 10)],
        committer=committer,
        events=events,
        stop_when_drained=False,
    )
    with pytest.raises(KeyboardInterrupt):
        run_loop(loop)
    assert committer.offsets == {TP0: 10}  # the acknowledged batch, and nothing of the next
    assert sink.rows == list(range(10)) and sink.cleanups == 1


def test_interrupt_during_send_commits_nothing_of_that_batch():
    events = Events()

    class InterruptingSink(FakeSink):
        def send_batch(self, batch):
            if batch.column("id")[0].as_py() == 10:
                raise KeyboardInterrupt
            return super().send_batch(batch)

    sink = InterruptingSink(events)
    loop, _, sink, committer, _, _ = make_loop(
        [source_batch(0, 10), source_batch(10, 10)],
        sink=sink,
        events=events,
        stop_when_drained=False,
    )
    with pytest.raises(KeyboardInterrupt):
        run_loop(loop)
    assert committer.offsets == {TP0: 10}
    assert sink.cleanups == 1


def test_fenced_run_stops_without_committing_further():
    events = Events()
    committer = FakeCommitter(events, fence_after=1)
    loop, _, sink, committer, _, _ = make_loop(
        [source_batch(0, 10), source_batch(10, 10)],
        committer=committer,
        events=events,
        stop_when_drained=False,
    )
    with pytest.raises(FencedError):
        run_loop(loop)
    assert committer.offsets == {TP0: 10}
    assert sink.cleanups == 1


def test_desired_stopped_seen_in_heartbeat_stops_the_loop():
    events = Events()
    committer = FakeCommitter(events, desired_running=False)
    loop, source, _, _, _, _ = make_loop(
        [source_batch(0, 10), source_batch(10, 10)],
        committer=committer,
        events=events,
        stop_when_drained=False,
    )
    run_loop(loop)
    assert source.batches  # it stopped before reading everything


def test_prefetch_reads_ahead_and_delivers_in_order():
    events = Events()
    batches = [source_batch(i * 10, 10) for i in range(20)]
    source = FakeSource(batches, events)
    sink = FakeSink(events)
    committer = FakeCommitter(events)
    loop = ConnectorLoop(
        LoopConfig(name="c", batch=BatchPolicy(max_wait_ms=10), prefetch=True),
        source=source,
        transform=json_transform,
        sink=sink,
        committer=committer,
        committed={},
        stop_requested=lambda: committer.offsets.get(TP0) == 200,
    )
    run_loop(loop)
    assert sink.rows == list(range(200))
    assert committer.offsets == {TP0: 200}


def test_transform_ahead_overlaps_the_next_batch_with_this_send_and_keeps_order():
    import threading

    events = Events()
    batches = [source_batch(i * 10, 10) for i in range(30)]
    source = FakeSource(batches, events)
    committer = FakeCommitter(events)
    in_send = threading.Event()
    overlapped = []

    class SlowSink(FakeSink):
        def send_batch(self, batch):
            in_send.set()
            try:
                threading.Event().wait(0.005)
                return super().send_batch(batch)
            finally:
                in_send.clear()

    def transform(batch):
        overlapped.append(in_send.is_set())  # a transform while a send is under way
        return json_transform(batch)

    sink = SlowSink(events)
    loop = ConnectorLoop(
        LoopConfig(name="c", batch=BatchPolicy(max_wait_ms=10)),  # prefetch + transform ahead
        source=source,
        transform=transform,
        sink=sink,
        committer=committer,
        committed={},
        stop_requested=lambda: committer.offsets.get(TP0) == 300,
    )
    run_loop(loop)
    assert sink.rows == list(range(300))
    commits = [e[1][TP0] for e in events if e[0] == "commit"]
    assert commits == list(range(10, 301, 10))  # one commit per batch, in order
    assert any(overlapped)  # the next batch was in the transform while this one was sent


def test_a_transform_that_fails_ahead_is_retried_on_the_loops_thread():
    import threading

    events = Events()
    batches = [source_batch(i * 10, 10) for i in range(5)]
    source = FakeSource(batches, events)
    committer = FakeCommitter(events)
    sink = FakeSink(events)
    calls: list[tuple[int, str]] = []
    fail_first = {20: 1}  # the batch starting at offset 20 fails its first transform

    def transform(batch):
        first = batch.column("__offset")[0].as_py()
        calls.append((first, threading.current_thread().name))
        if fail_first.get(first):
            fail_first[first] -= 1
            raise TransientSinkError("Spark Connect unreachable")
        return json_transform(batch)

    loop = ConnectorLoop(
        LoopConfig(
            name="c", batch=BatchPolicy(max_wait_ms=10), retry=RetrySpec(delay=0, jitter="none")
        ),
        source=source,
        transform=transform,
        sink=sink,
        committer=committer,
        committed={},
        stop_requested=lambda: committer.offsets.get(TP0) == 50,
        sleep=lambda s: None,
    )
    counters = run_loop(loop)
    assert sink.rows == list(range(50))
    assert committer.offsets == {TP0: 50}
    assert counters.messages_out == 50 and counters.batches == 5
    assert counters.retries == 1  # the outage met ahead was the first attempt, not an extra one
    # Batch 20 failed ahead, then ran again on the loop's (main) thread and passed.
    assert [t for first, t in calls if first == 20] == ["conveyor-transform", "MainThread"]
    assert all(t == "conveyor-transform" for first, t in calls if first != 20)


def test_a_transform_error_ahead_surfaces_from_the_loops_thread_with_nothing_committed():
    events = Events()
    batches = [source_batch(i * 10, 10) for i in range(3)]
    source = FakeSource(batches, events)
    committer = FakeCommitter(events)
    sink = FakeSink(events)

    def transform(batch):
        if batch.column("__offset")[0].as_py() == 10:
            raise ValueError("Spark rejected the plan")
        return json_transform(batch)

    loop = ConnectorLoop(
        LoopConfig(name="c", batch=BatchPolicy(max_wait_ms=10)),
        source=source,
        transform=transform,
        sink=sink,
        committer=committer,
        committed={},
    )
    with pytest.raises(ValueError, match="Spark rejected the plan"):
        run_loop(loop)
    assert sink.rows == list(range(10))
    assert committer.offsets == {TP0: 10}  # batch 0 only; nothing past the failed batch


def depth_loop(batches, transform, depth, sink_delay=0.0):
    """A loop with read-ahead and ``depth`` batches in the transform at once."""
    import threading

    events = Events()
    source = FakeSource(batches, events)
    committer = FakeCommitter(events)

    class SlowSink(FakeSink):
        def send_batch(self, batch):
            threading.Event().wait(sink_delay)
            return super().send_batch(batch)

    sink = SlowSink(events)
    final = sum(b.table.num_rows for b in batches)
    loop = ConnectorLoop(
        LoopConfig(name="c", batch=BatchPolicy(max_wait_ms=10), transform_depth=depth),
        source=source,
        transform=transform,
        sink=sink,
        committer=committer,
        committed={},
        stop_requested=lambda: committer.offsets.get(TP0) == final,
    )
    return loop, sink, committer, events


def test_several_batches_in_the_transform_at_once_are_sent_and_committed_in_source_order():
    import threading

    batches = [source_batch(i * 10, 10) for i in range(24)]
    lock = threading.Lock()
    running = [0]
    most = [0]

    def transform(batch):
        first = batch.column("__offset")[0].as_py()
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            # Later batches of each three end first: order comes from the loop, not Spark.
            threading.Event().wait(0.002 * (3 - (first // 10) % 3))
            return json_transform(batch)
        finally:
            with lock:
                running[0] -= 1

    loop, sink, committer, events = depth_loop(batches, transform, depth=3, sink_delay=0.005)
    run_loop(loop)
    assert sink.rows == list(range(240))
    commits = [e[1][TP0] for e in events if e[0] == "commit"]
    assert commits == list(range(10, 241, 10))  # one commit per batch, in source order
    assert 2 <= most[0] <= 3  # batches overlapped in the transform, never more than the depth


@pytest.mark.parametrize("failing", [0, 2, 4])
def test_an_error_in_any_batch_in_the_transform_surfaces_with_nothing_committed_past_it(failing):
    """Depth 3: the failing batch is in the transform with others, ahead of and behind it,
    and fails first (the others are slow). The batches before it are delivered and
    committed; it and everything after it are neither sent nor committed."""
    import threading

    batches = [source_batch(i * 10, 10) for i in range(8)]

    def transform(batch):
        first = batch.column("__offset")[0].as_py()
        if first == failing * 10:
            raise ValueError(f"Spark rejected batch {failing}")
        threading.Event().wait(0.02)
        return json_transform(batch)

    loop, sink, committer, events = depth_loop(batches, transform, depth=3)
    with pytest.raises(ValueError, match=f"Spark rejected batch {failing}"):
        run_loop(loop)
    assert sink.rows == list(range(failing * 10))
    commits = [e[1][TP0] for e in events if e[0] == "commit"]
    assert commits == list(range(10, failing * 10 + 1, 10))
    assert committer.offsets == ({TP0: failing * 10} if failing else {})


def test_next_offsets_per_partition():
    t = pa.Table.from_pylist(
        [
            {"__topic": "a", "__partition": 1, "__offset": 5},
            {"__topic": "a", "__partition": 1, "__offset": 9},
            {"__topic": "b", "__partition": 0, "__offset": 2},
        ]
    )
    assert next_offsets_of(t) == {TopicPartition("a", 1): 10, TopicPartition("b", 0): 3}
    assert pc.sum(t.column("__offset")).as_py() == 16


def test_heartbeat_reports_high_watermarks_per_partition_when_the_source_knows_them():
    loop, source, _, committer, _, _ = make_loop([source_batch(0, 100)])
    source.highwaters = lambda: {TP0: 120}  # type: ignore[attr-defined]
    counters = run_loop(loop)
    assert counters.highwaters == {str(TP0): 120}
    assert committer.heartbeats[-1][2].highwaters == {str(TP0): 120}


def test_heartbeat_has_no_high_watermarks_when_the_source_has_none():
    loop, _, _, _, _, _ = make_loop([source_batch(0, 10)])
    assert run_loop(loop).highwaters is None
    assert loop.counters.schema_registry is None  # no registry_metrics on the transform


def test_heartbeat_reports_the_transforms_schema_registry_lookups():
    loop, _, _, committer, _, _ = make_loop([source_batch(0, 100)])
    lookups = {"requests": 3, "lookups_cached": 97}
    loop.transform.registry_metrics = lambda: dict(lookups)  # type: ignore[attr-defined]
    counters = run_loop(loop)
    assert counters.schema_registry == lookups
    assert committer.heartbeats[-1][2].schema_registry == lookups


class EndlessSource:
    """Batches of 10 on demand; counts reads (thread-safe enough: one reader thread)."""

    def __init__(self):
        self.next = 0
        self.reads = 0
        self.closed = 0

    def read(self, policy):
        self.reads += 1
        b = source_batch(self.next, 10)
        self.next += 10
        return b

    def lag(self, committed):
        return 0

    def close(self):
        self.closed += 1


class ScriptedCommitter:
    """Answers each heartbeat with ``directive`` (set by the test); records what it saw."""

    def __init__(self):
        import threading

        self.directive = Directive.RUN
        self.offsets: dict = {}
        self.heartbeats: list = []
        self.changed = threading.Condition()

    def commit(self, offsets):
        with self.changed:
            self.offsets.update(offsets)
            self.changed.notify_all()

    def heartbeat(self, counters, status, reason):
        with self.changed:
            self.heartbeats.append((status, reason))
            self.changed.notify_all()
        return self.directive

    def wait(self, predicate, what, timeout=30.0):
        with self.changed:
            assert self.changed.wait_for(predicate, timeout), f"timed out waiting for {what}"


def run_in_thread(loop):
    import threading

    result: dict = {}

    def target():
        try:
            result["counters"] = run_loop(loop)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, result


def test_pause_holds_the_assignment_reads_nothing_heartbeats_and_resumes_where_it_was():
    source = EndlessSource()
    sink = FakeSink(Events())
    committer = ScriptedCommitter()
    loop = ConnectorLoop(
        LoopConfig(name="c", batch=BatchPolicy(max_wait_ms=10), paused_poll_s=0.01),
        source=source,
        transform=json_transform,
        sink=sink,
        committer=committer,
        committed={},
    )
    thread, result = run_in_thread(loop)
    committer.wait(lambda: committer.offsets.get(TP0, 0) >= 30, "three batches committed")
    committer.directive = Directive.PAUSE
    paused = lambda: [h for h in committer.heartbeats if h[0] == ConnectorStatus.PAUSED]  # noqa: E731
    committer.wait(lambda: len(paused()) >= 2, "the loop heartbeating as Paused")
    reads, delivered = source.reads, len(sink.rows)
    committer.wait(lambda: len(paused()) >= 40, "forty more heartbeats while paused")
    # At most a read that had already started when the pause landed; nothing is sent.
    assert source.reads - reads <= 1
    assert len(sink.rows) == delivered
    assert ("Paused", "paused") in [(s.value, r) for s, r in committer.heartbeats]
    committer.directive = Directive.RUN
    committer.wait(lambda: committer.offsets.get(TP0, 0) >= delivered + 50, "delivery resumed")
    assert (ConnectorStatus.RUNNING, "resumed") in committer.heartbeats
    committer.directive = Directive.STOP
    thread.join(30)
    assert not thread.is_alive() and "error" not in result, result
    # Nothing lost or repeated across the pause: every offset once, in order.
    assert sink.rows == list(range(len(sink.rows)))
    assert committer.offsets[TP0] == len(sink.rows)


def test_a_connector_paused_from_its_first_heartbeat_reads_nothing_until_resumed():
    source = EndlessSource()
    sink = FakeSink(Events())
    committer = ScriptedCommitter()
    committer.directive = Directive.PAUSE
    loop = ConnectorLoop(
        LoopConfig(name="c", batch=BatchPolicy(max_wait_ms=10), paused_poll_s=0.01),
        source=source,
        transform=json_transform,
        sink=sink,
        committer=committer,
        committed={TP0: 500},
    )
    thread, _ = run_in_thread(loop)
    committer.wait(lambda: len(committer.heartbeats) >= 20, "heartbeats while paused")
    assert source.reads == 0 and sink.rows == []
    committer.directive = Directive.STOP
    thread.join(30)
    assert not thread.is_alive() and source.closed == 1 and sink.cleanups == 1


def test_reconfigure_ends_the_loop_at_a_batch_boundary_with_everything_acknowledged_committed():
    source = EndlessSource()
    sink = FakeSink(Events())
    committer = ScriptedCommitter()
    loop = ConnectorLoop(
        LoopConfig(name="c", batch=BatchPolicy(max_wait_ms=10)),
        source=source,
        transform=json_transform,
        sink=sink,
        committer=committer,
        committed={},
    )
    thread, result = run_in_thread(loop)
    committer.wait(lambda: committer.offsets.get(TP0, 0) >= 20, "two batches committed")
    committer.directive = Directive.RECONFIGURE
    thread.join(30)
    assert not thread.is_alive() and "error" not in result, result
    assert loop.reconfigure_requested
    # Every row the sink acknowledged is committed; read-ahead batches are dropped uncommitted.
    assert committer.offsets[TP0] == len(sink.rows) and sink.rows == list(range(len(sink.rows)))
    assert sink.cleanups == 1 and source.closed == 1
    # The next loop (the new spec) goes on from the committed offsets and the counters.
    nxt = ConnectorLoop(
        LoopConfig(name="c", batch=BatchPolicy(max_wait_ms=10), prefetch=False),
        source=FakeSource([source_batch(committer.offsets[TP0], 10)], Events()),
        transform=json_transform,
        sink=sink,
        committer=FakeCommitter(Events()),
        committed=dict(committer.offsets),
        counters=result["counters"],
        stop_requested=lambda: len(sink.rows) >= committer.offsets[TP0] + 10,
    )
    counters = run_loop(nxt)
    assert sink.rows == list(range(len(sink.rows)))
    assert counters.messages_out == result["counters"].messages_out + 10


class PartlyAckingSink(FakeSink):
    """Acknowledges the first half of the first send, then reports the rest as not
    acknowledged because of an outage (a partial acknowledgement)."""

    def __init__(self, events, **kw):
        super().__init__(events, **kw)
        self.partial_once = True

    def send_batch(self, batch):
        if self.partial_once:
            self.partial_once = False
            ids = batch.column("id").to_pylist()
            half = len(ids) // 2
            self.rows.extend(ids[:half])
            return SendResult(
                rows=len(ids),
                failed=tuple(
                    RowFailure(i, "broker connection lost", ErrorKind.TRANSIENT)
                    for i in range(half, len(ids))
                ),
            )
        return super().send_batch(batch)


def test_an_outage_retry_resends_only_the_rows_not_acknowledged():
    events = Events()
    sink = PartlyAckingSink(events, reject_ids={8})
    dead = FakeDeadLetters(events)
    loop, _, _, committer, _, sleeps = make_loop(
        [source_batch(0, 10)],
        sink=sink,
        events=events,
        dead=dead,
        failure=FailureSpec(policy=FailurePolicyName.DEAD_LETTER, retries=0),
    )
    run_loop(loop)
    assert sink.rows == [0, 1, 2, 3, 4, 5, 6, 7, 9]  # each acknowledged row sent once
    assert [d.failed.offset for d in dead.letters] == [8]  # the data error, not the outage
    assert committer.offsets == {TP0: 10} and sleeps == [1.0]
    assert loop.counters.messages_out == 9 and loop.counters.dead_lettered == 1


# -- the one bisection (conveyor.core.sink.isolate_rows) ------------------------------------


def test_isolate_rows_bisects_a_whole_request_rejection_down_to_the_guilty_rows() -> None:
    from conveyor.core.sink import isolate_rows

    bad = {3, 11}
    attempts: list[list[int]] = []

    def attempt(rows: Sequence[int]) -> list[RowFailure]:
        attempts.append(list(rows))
        if bad & set(rows):
            raise ValueError(f"refused {sorted(bad & set(rows))}")
        return []

    def rejection(e: Exception) -> str | None:
        return str(e) if isinstance(e, ValueError) else None

    failures = isolate_rows(list(range(16)), attempt, rejection)
    assert [(f.index, f.message) for f in failures] == [(3, "refused [3]"), (11, "refused [11]")]
    written = [rows for rows in attempts if not bad & set(rows)]
    assert sorted(i for rows in written for i in rows) == [i for i in range(16) if i not in bad]


def test_isolate_rows_lets_other_errors_through_and_keeps_row_failures() -> None:
    from conveyor.core.errors import TransientSinkError
    from conveyor.core.sink import RowFailure, isolate_rows

    def outage(rows: Sequence[int]) -> list[RowFailure]:
        raise TransientSinkError("down")

    with pytest.raises(TransientSinkError):
        isolate_rows([0, 1], outage, lambda e: None)
    assert isolate_rows([5, 6], lambda rows: [RowFailure(6, "x")], lambda e: "no") == [
        RowFailure(6, "x")
    ]
    assert isolate_rows([], outage, lambda e: None) == []


# -- sinks that route rows: admission, cap and breakers (issue 17) -------------------------------


def routed_transform(batch: pa.Table) -> Transformed:
    """json_transform, then each row's destination: t<id % 3>."""
    tr = json_transform(batch)
    dests = [f"t{i % 3}" for i in tr.table.column("id").to_pylist()]
    table = tr.table
    if "__destination" in table.schema.names:
        table = table.drop_columns(["__destination"])
    return Transformed(
        table=table.append_column("__destination", pa.array(dests, pa.string())),
        rejected=tr.rejected,
    )


def test_refused_destinations_are_failed_messages_for_the_policy():
    from conveyor.core.engine.routing import AdmissionSpec, DestinationRulesSpec

    dead = FakeDeadLetters(Events())
    rules = DestinationRulesSpec(admission=AdmissionSpec(mode="denylist", patterns=["t2"]))
    loop, _, sink, committer, _, _ = make_loop(
        [source_batch(0, 30)],
        transform=routed_transform,
        destinations=rules,
        failure=FailureSpec(policy=FailurePolicyName.DEAD_LETTER, retries=0),
        dead=dead,
    )
    run_loop(loop)
    assert sorted(sink.rows) == [i for i in range(30) if i % 3 != 2]
    assert sorted(d.failed.offset for d in dead.letters) == [i for i in range(30) if i % 3 == 2]
    assert all("refused (denylist)" in d.failed.error for d in dead.letters)
    assert committer.offsets == {TP0: 30}  # every message accounted for


def test_the_cap_refuses_destinations_past_max_destinations():
    from conveyor.core.engine.routing import DestinationRulesSpec

    dead = FakeDeadLetters(Events())
    loop, _, sink, committer, _, _ = make_loop(
        [source_batch(0, 30)],
        transform=routed_transform,
        destinations=DestinationRulesSpec(max_destinations=2),
        failure=FailureSpec(policy=FailurePolicyName.DEAD_LETTER, retries=0),
        dead=dead,
    )
    run_loop(loop)
    assert sorted(sink.rows) == [i for i in range(30) if i % 3 != 2]  # t0 and t1 came first
    assert {d.failed.error.split("(")[1].split(")")[0] for d in dead.letters} == {"cap"}
    assert committer.offsets == {TP0: 30}


def test_a_failing_destination_opens_its_breaker_while_the_others_flow():
    from conveyor.core.engine.routing import DestinationRulesSpec

    events = Events()
    dead = FakeDeadLetters(events)
    sink = FakeSink(events, reject_ids={i for i in range(90) if i % 3 == 1})  # t1 refuses all
    loop, _, sink, committer, _, _ = make_loop(
        [source_batch(10 * b, 10) for b in range(9)],
        sink=sink,
        events=events,
        transform=routed_transform,
        destinations=DestinationRulesSpec(),
        failure=FailureSpec(policy=FailurePolicyName.DEAD_LETTER, retries=0),
        dead=dead,
    )
    run_loop(loop)
    # Five failed batches open t1's breaker: later t1 rows are refused without being sent.
    reasons = [d.failed.error for d in dead.letters if d.failed.offset % 3 == 1]
    assert sum("circuit_open" in r for r in reasons) == len(
        [i for i in range(50, 90) if i % 3 == 1]
    )
    assert all("bad id" in r for r in reasons[: len([i for i in range(50) if i % 3 == 1])])
    assert sorted(sink.rows) == [i for i in range(90) if i % 3 != 1]  # t0 and t2 flowed
    assert committer.offsets == {TP0: 90}
