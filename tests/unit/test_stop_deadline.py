"""A terminated run whose op's thread is stuck still ends (jobs/stop_deadline.py)."""

from __future__ import annotations

import io
import threading

from conveyor.dagster.jobs.stop_deadline import StopDeadline


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 10.0  # each look at the clock is ten seconds later
        return self.now


def deadline(statuses: list[str], **kw):
    seen = iter(statuses)
    ended = threading.Event()
    reports: list[str] = []
    stream = io.StringIO()
    d = StopDeadline(
        lambda: next(seen, statuses[-1]),
        reports.append,
        deadline_s=30.0,
        poll_s=0.001,
        clock=Clock(),
        exit_process=lambda code: ended.set(),
        stream=stream,
        **kw,
    )
    return d, ended, reports, stream


def test_a_run_stuck_canceling_past_the_deadline_dumps_its_stacks_reports_and_ends() -> None:
    d, ended, reports, stream = deadline(["STARTED", "STARTED", "CANCELING"])
    d.start()
    assert ended.wait(10), "the process was not ended"
    d.join(10)
    assert d.ended
    assert reports and "did not end within 30s of its terminate" in reports[0]
    text = stream.getvalue()
    assert "did not end within 30s" in text
    # Every thread's stack, the test's own (the stuck op's thread in a run) among them.
    assert "test_a_run_stuck_canceling_past_the_deadline" in text


def test_a_run_that_ends_in_time_is_left_alone() -> None:
    d, ended, reports, _ = deadline(["CANCELING"])
    d.finished()  # the op ended (the terminate's normal path)
    d.start()
    d.join(10)
    assert not ended.is_set() and not d.ended and reports == []


def test_a_running_run_is_never_ended() -> None:
    d, ended, reports, _ = deadline(["STARTED"])
    d.start()
    assert not ended.wait(0.5)
    d.finished()
    d.join(10)
    assert not d.ended and reports == []


def test_a_report_that_hangs_does_not_hold_the_end(monkeypatch) -> None:
    from conveyor.dagster.jobs import stop_deadline

    monkeypatch.setattr(stop_deadline, "REPORT_S", 0.2)
    hold = threading.Event()
    d, ended, _, _ = deadline(["CANCELING"])
    d.report = lambda message: hold.wait(30)  # the instance held by the stuck thread
    d.start()
    assert ended.wait(10)
    hold.set()
