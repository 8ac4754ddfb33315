"""The run's terminate path (jobs/supervision.py): a terminate seen by the cancel poll and then
delivered again as Dagster's interrupt still lets the loop commit, close and report."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from dagster import DagsterExecutionInterruptedError

from conveyor.core.model import BatchPolicy, LivenessSpec
from conveyor.dagster.jobs.supervision import supervise
from tests.unit.test_loop import FakeSink, make_loop, source_batch


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)

    warning = debug = info


class InterruptingSink(FakeSink):
    """Closing takes a while, and the terminate's interrupt arrives meanwhile (as Dagster's
    DefaultRunLauncher sends it after marking the run CANCELING, which the poll saw first)."""

    def cleanup_sink(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the main thread handles the signal while the loop is still closing
        super().cleanup_sink()


@pytest.fixture
def dagster_interrupts():
    """Dagster's op-time SIGINT handler: raise DagsterExecutionInterruptedError in the op's thread."""

    def raise_interrupt(signo, frame):
        raise DagsterExecutionInterruptedError()

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, raise_interrupt)
    signal.signal(signal.SIGTERM, raise_interrupt)
    yield
    for s, h in before.items():
        signal.signal(s, h)


def test_an_interrupt_after_the_cancel_poll_does_not_cut_the_stop_short(dagster_interrupts):
    assert threading.current_thread() is threading.main_thread()
    events: list = []
    loop, _source, sink, committer, _, _ = make_loop(
        [source_batch(0, 100)],
        sink=InterruptingSink(events),
        events=events,
        stop_when_drained=False,
    )
    reports = []
    loop.on_progress = reports.append
    delivered = lambda: committer.offsets != {}  # noqa: E731 - the batch sent and committed
    loaded = SimpleNamespace(
        name="c", spec=SimpleNamespace(liveness=LivenessSpec(), batch=BatchPolicy(max_wait_ms=10))
    )
    context = SimpleNamespace(log=Log())

    with pytest.raises(DagsterExecutionInterruptedError):
        supervise(context, loop, loaded, canceled=delivered)  # type: ignore[arg-type]

    # The stop ran to its end: the sink closed, the final progress reported, offsets kept.
    assert sink.cleanups == 1
    assert reports and reports[-1].final and reports[-1].counters.messages_out == 100
    assert sum(committer.offsets.values()) == 100
    assert not any("did not stop" in line for line in context.log.lines), context.log.lines
    # Until Dagster puts its handler back at the step's end, another interrupt is only logged.
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
