"""The loop with a sink that acknowledges at its own commit (``core.sink.AcknowledgesAtCommit``,
the lakehouse sinks' buffering): offsets reach the meta store only after the sink's commit, the
batches held meanwhile all at once; a quiet source commits a buffer whose time has come; a
stop commits it, a fence does not; the watermark moves only with committed rows."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, Progress, run_loop
from conveyor.core.errors import FencedError, TransientSinkError
from conveyor.core.model import (
    BatchPolicy,
    FailureSpec,
    RetrySpec,
    TopicPartition,
    WatermarkSpec,
)
from conveyor.core.sink import AcknowledgesAtCommit
from tests.unit.test_loop import Events, FakeCommitter, FakeSink, FakeSource, json_transform
from tests.unit.test_watermarks import T0, timed_batch

TP0 = TopicPartition("t", 0)


class BufferingSink(FakeSink):
    """Accepts rows into a buffer; commits when ``every`` batches are buffered (in
    ``send_batch``), when asked (``commit_held``), or fails to (``fail_commits``)."""

    def __init__(self, events, *, every=3, due=False, fail_commits=0):
        super().__init__(events)
        self.every, self.due, self.fail_commits = every, due, fail_commits
        self.buffer: list[list[int]] = []
        self.table: list[int] = []

    def send_batch(self, batch):
        result = super().send_batch(batch)  # FakeSink records the rows it accepted
        held = {i for b in self.buffer for i in b}  # a batch sent again is buffered once
        self.buffer.append([i for i in batch.column("id").to_pylist() if i not in held])
        if len(self.buffer) >= self.every:
            self.commit_held()
        return result

    def uncommitted_rows(self):
        return sum(len(b) for b in self.buffer)

    def commit_due(self):
        return self.due

    def commit_held(self):
        if not self.buffer:
            return
        if self.fail_commits:
            self.fail_commits -= 1
            self.events.append(("table-commit-failed",))
            raise TransientSinkError("commit lost a race")
        self.table += [i for b in self.buffer for i in b]
        self.events.append(("table-commit", sum(len(b) for b in self.buffer)))
        self.buffer = []


def loop_over(batches, sink, events, *, stop=None, committer=None, clock=None, **cfg):
    source = FakeSource(batches, events)
    committer = committer or FakeCommitter(events)
    reports: list[Progress] = []
    now = clock or [T0 + 500]
    loop = ConnectorLoop(
        LoopConfig(
            name="c",
            batch=BatchPolicy(max_wait_ms=10),
            retry=RetrySpec(delay=1, jitter="none"),
            failure=FailureSpec(policy="discard"),
            prefetch=False,
            progress_interval_s=0,
            **cfg,
        ),
        source=source,
        transform=json_transform,
        sink=sink,
        committer=committer,
        committed={},
        stop_requested=stop or (lambda: not source.batches),
        on_progress=lambda p: (reports.append(p), events.append(("report", p))),
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    return loop, committer, reports


def kinds(events):
    return [e[0] for e in events if e[0] in ("commit", "table-commit", "send")]


def test_the_protocol_is_recognised_and_a_plain_sink_is_not():
    assert isinstance(BufferingSink(Events()), AcknowledgesAtCommit)
    assert not isinstance(FakeSink(Events()), AcknowledgesAtCommit)


def test_offsets_are_committed_only_with_the_sinks_commit_held_batches_together():
    events = Events()
    sink = BufferingSink(events, every=3)
    batches = [timed_batch(10 * i, [i * 10.0 + s for s in range(10)]) for i in range(4)]
    loop, committer, reports = loop_over(batches, sink, events)
    run_loop(loop)
    # Three sends, then the sink's commit inside the third, then one meta store commit of the
    # three batches' offsets; the fourth batch is committed by the clean stop.
    assert kinds(events) == [
        "send",
        "send",
        "send",
        "table-commit",
        "commit",
        "send",
        "table-commit",
        "commit",
    ]
    commits = [e[1] for e in events if e[0] == "commit"]
    assert commits == [{TP0: 30}, {TP0: 40}]
    assert sink.table == list(range(40)) and committer.offsets == {TP0: 40}
    # The watermark never ran ahead of the table: each report's high mark is a committed one.
    marks = [r.watermark.by_partition.get("t[0]") for r in reports if r.watermark]
    assert set(marks) <= {None, T0 + 29, T0 + 39}
    assert reports[-1].watermark.by_partition == {"t[0]": T0 + 39}


def test_a_quiet_source_commits_a_buffer_whose_time_has_come_and_only_then():
    events = Events()
    sink = BufferingSink(events, every=100)
    source_batches = [timed_batch(0, [1.0, 2.0])]
    reads = {"n": 0}

    def stop():
        reads["n"] += 1
        return reads["n"] > 6

    loop, committer, _ = loop_over(source_batches, sink, events, stop=stop)
    # Quiet reads while the buffer is not due: nothing committed anywhere.
    original = loop._commit_held

    def spy(*, due_only):
        if reads["n"] == 4:
            sink.due = True  # its interval passes while the source is quiet
        return original(due_only=due_only)

    loop._commit_held = spy
    run_loop(loop)
    commits = [e for e in events if e[0] in ("commit", "table-commit")]
    assert commits == [("table-commit", 2), ("commit", {TP0: 2})]
    assert reads["n"] > 4  # committed while quiet, before the stop


def test_a_failed_sink_commit_is_an_outage_retried_and_nothing_is_committed_before_it():
    events = Events()
    sink = BufferingSink(events, every=2, fail_commits=2)
    committer = FakeCommitter(events)
    loop, _, _ = loop_over(
        [timed_batch(0, [1.0]), timed_batch(1, [2.0])],
        sink,
        events,
        committer=committer,
        stop=lambda: committer.offsets == {TP0: 2},
    )
    run_loop(loop)
    seq = [e[0] for e in events if e[0] in ("commit", "table-commit", "table-commit-failed")]
    assert seq == ["table-commit-failed", "table-commit-failed", "table-commit", "commit"]
    # The batch whose send (and commit) failed was sent again: buffered once, written once.
    assert sink.table == [0, 1]


def test_a_fenced_run_commits_neither_the_buffer_nor_its_offsets():
    events = Events()
    sink = BufferingSink(events, every=100)

    class Fencing(FakeCommitter):
        def ensure_current(self):  # asked before each send
            if len([e for e in events if e[0] == "send"]) >= 2:
                raise FencedError("stale generation")

    loop, committer, _ = loop_over(
        [timed_batch(0, [1.0]), timed_batch(1, [2.0]), timed_batch(2, [3.0])],
        sink,
        events,
        committer=Fencing(events),
        stop=lambda: False,
    )
    with pytest.raises(FencedError):
        run_loop(loop)
    assert sink.table == [] and committer.offsets == {}
    assert not [e for e in events if e[0] in ("table-commit", "commit")]


def test_an_error_commits_the_buffer_once_then_its_offsets():
    events = Events()
    sink = BufferingSink(events, every=100)

    class Interrupting(FakeSource):
        def read(self, policy):
            if not self.batches:
                raise KeyboardInterrupt  # stands for Dagster's interrupt, a BaseException
            return super().read(policy)

    source = Interrupting([timed_batch(0, [1.0]), timed_batch(1, [2.0])], events)
    loop, committer, _ = loop_over([], sink, events, stop=lambda: False)
    loop.source = source
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    assert sink.table == [0, 1] and committer.offsets == {TP0: 2}
    assert kinds(events)[-2:] == ["table-commit", "commit"]


def test_an_error_whose_buffer_cannot_be_committed_commits_no_offsets():
    events = Events()
    sink = BufferingSink(events, every=100, fail_commits=1)

    class Interrupting(FakeSource):
        def read(self, policy):
            if not self.batches:
                raise KeyboardInterrupt
            return super().read(policy)

    loop, committer, _ = loop_over([], sink, events, stop=lambda: False)
    loop.source = Interrupting([timed_batch(0, [1.0])], events)
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    assert sink.table == [] and committer.offsets == {}


def test_the_watermark_is_not_idle_while_rows_are_held_and_completes_after_the_commit():
    """A held batch is lag: its partition is not idle, however quiet the source is, so the
    clock cannot carry the watermark past rows the table does not hold yet; once committed
    and quiet for idle_after_s, the watermark follows the quiet reads."""
    events = Events()
    sink = BufferingSink(events, every=100)
    now = [T0 + 500]
    ticks = {"n": 0}

    def stop():
        ticks["n"] += 1
        now[0] += 5  # each loop turn 5 s later
        if ticks["n"] == 8:
            sink.due = True
        return ticks["n"] > 16

    loop, _, _ = loop_over(
        [timed_batch(0, [400.0, 410.0])],
        sink,
        events,
        stop=stop,
        clock=now,
        watermark=WatermarkSpec(idle_after_s=10),
    )
    run_loop(loop)
    seq = [e for e in events if e[0] in ("report", "table-commit")]
    at = next(i for i, e in enumerate(seq) if e[0] == "table-commit")
    before = [e[1].watermark.low for e in seq[:at] if e[1].watermark]
    assert before and all(low is None for low in before), "a watermark before the table commit"
    after = [e[1].watermark.low for e in seq[at:] if e[0] == "report"]
    assert after[0] == T0 + 410  # the committed rows' high mark
    assert after[-1] > T0 + 500 + 8 * 5  # idle: complete through the quiet reads since


def test_watermark_reports_come_when_it_crosses_a_minute_at_most_once_a_second():
    """Between progress reports (every 60 s) a watermark-only report as soon as the watermark
    passes a minute, not for every batch."""
    events = Events()
    now = [0.0]
    minute = (T0 // 60 + 10) * 60
    # Event times 20 s apart: three of them cross a minute.
    seconds = [minute + 20 * i - T0 for i in range(9)]
    batches = [timed_batch(i, [s]) for i, s in enumerate(seconds)]
    now[0] = minute + 1
    clock_steps = iter(range(1000))

    def stop():
        next(clock_steps)
        now[0] += 20  # the loop reads one batch per 20 s of wall clock
        return not source_left[0].batches

    loop, _, reports = loop_over(batches, FakeSink(events), events, stop=stop, clock=now)
    source_left = [loop.source]
    loop.cfg.progress_interval_s = 3600
    run_loop(loop)
    only = [r for r in reports if r.watermark_only]
    lows = [r.watermark.low for r in only]
    assert lows, "no watermark report"
    # One report when it became known, then one per minute crossed: never two in a minute.
    minutes = [int(low // 60) for low in lows]
    assert minutes == sorted(set(minutes)), lows
    assert len(only) <= 4
    assert datetime.fromtimestamp(lows[-1], timezone.utc).second in (0, 20, 40)
