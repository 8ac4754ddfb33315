"""The run's supervisor: the loop (sink, source or task) on a thread of its own, heartbeats and
stage deadlines from the op's thread (``core.engine.liveness.Supervisor``), and the terminate path."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from dagster import DagsterExecutionInterruptedError, OpExecutionContext

from conveyor.config.specs import LoadedSpec
from conveyor.core.engine.liveness import Supervisor
from conveyor.core.engine.loop import run_loop
from conveyor.core.engine.stopping import LoopControl
from conveyor.core.errors import FencedError, StageHungError
from conveyor.core.model import Counters
from conveyor.dagster.jobs.progress import record_stuck_stage
from conveyor.dagster.jobs.runs import hold_interrupts

# After a stop or a terminate: how long the op waits for the loop to finish its batch.
STOP_GRACE_S = 30.0


def supervise(
    context: OpExecutionContext,
    loop: LoopControl,
    loaded: LoadedSpec,
    canceled: Callable[[], bool],
    *,
    clock: Callable[[], float] = time.monotonic,
) -> Counters:
    """Run ``loop`` on its own thread; this thread heartbeats for it and judges its stages.

    Returns the loop's counters or raises its error. A terminate (Dagster's interrupt, or
    the run seen CANCELING) asks the loop to stop and waits up to ``STOP_GRACE_S`` for it
    to commit what was acknowledged, then raises the interrupt. A stage past
    ``liveness.restart_after_s`` raises StageHungError: the run fails and the scheduler
    relaunches it; the stuck call is left behind, fenced by the next generation (it checks
    its generation before any send and commits nothing once fenced).
    """
    sup = _supervisor(context, loop, loaded, clock)
    worker, done, outcome = _start_loop(loop, loaded.name)
    interrupted = _watch(context, loop, loaded, sup, done, canceled)
    if interrupted is not None:
        _stop_after_interrupt(context, loop, loaded, sup, worker, done, clock)
        raise interrupted
    if "error" in outcome:
        raise outcome["error"]
    return outcome["counters"]


def _supervisor(
    context: OpExecutionContext,
    loop: LoopControl,
    loaded: LoadedSpec,
    clock: Callable[[], float],
) -> Supervisor:
    """Marks the loop supervised and builds its Supervisor from the spec's liveness and batch
    settings (a sink or a source connector's); its reports go to the op's log."""
    spec = loaded.spec or loaded.source_spec
    assert spec is not None
    loop.supervised = True
    return Supervisor(
        loop,
        spec.liveness,
        read_wait_s=spec.batch.max_wait_ms / 1000,
        interval_s=loop.cfg.heartbeat_interval_s,
        clock=clock,
        on_report=lambda msg: context.log.warning(f"connector {loaded.name}: {msg}"),
    )


def _start_loop(
    loop: LoopControl, name: str
) -> tuple[threading.Thread, threading.Event, dict[str, Any]]:
    """Starts the loop on a daemon thread; returns the thread, the Event set when the loop
    ends, and the outcome it fills (``counters`` or ``error``)."""
    outcome: dict[str, Any] = {}
    # The loop's end, as an Event: Thread.join() interrupted by Dagster's terminate (an
    # exception raised by a signal handler) marks a running thread as stopped on CPython
    # 3.11 (bpo-45274's fix in _wait_for_tstate_lock), so is_alive() cannot be trusted
    # after a terminate; Event.wait() can.
    done = threading.Event()

    def body() -> None:
        try:
            outcome["counters"] = run_loop(loop)
        except BaseException as e:  # noqa: BLE001 - handed to the op's thread
            outcome["error"] = e
        finally:
            done.set()

    worker = threading.Thread(target=body, name=f"conveyor-loop-{name}", daemon=True)
    worker.start()
    return worker, done, outcome


def _watch(
    context: OpExecutionContext,
    loop: LoopControl,
    loaded: LoadedSpec,
    sup: Supervisor,
    done: threading.Event,
    canceled: Callable[[], bool],
) -> BaseException | None:
    """Ticks the supervisor until the loop ends; returns the interrupt if the run was
    terminated or seen canceling, else None. Raises StageHungError for a stage past its
    restart deadline; records a stuck stage once as it crosses its deadline."""
    reported = None
    try:
        while not done.is_set():
            if done.wait(sup.poll_s):
                break
            if canceled():
                return DagsterExecutionInterruptedError()
            try:
                v = sup.tick()
            except FencedError:
                continue  # the loop was told; it ends and raises FencedError
            if v.restart:
                loop.request_stop()
                record_stuck_stage(context, loaded, v.reason())
                raise StageHungError(v.reason())
            if v.stage != reported:
                reported = v.stage  # once per stuck stage, as it crosses its deadline
                if v.stuck:
                    record_stuck_stage(context, loaded, v.reason())
    except DagsterExecutionInterruptedError as e:
        return e
    return None


def _stop_after_interrupt(
    context: OpExecutionContext,
    loop: LoopControl,
    loaded: LoadedSpec,
    sup: Supervisor,
    worker: threading.Thread,
    done: threading.Event,
    clock: Callable[[], float],
) -> None:
    """Asks the loop to stop and waits up to ``STOP_GRACE_S`` for it, still heartbeating; a
    loop that does not stop is left behind, its stack logged."""
    hold_interrupts()  # the terminate's interrupt may follow the poll: let the stop finish
    loop.request_stop()
    deadline = clock() + STOP_GRACE_S
    while not done.is_set() and clock() < deadline:
        done.wait(sup.poll_s)
        with contextlib.suppress(Exception):  # fenced or store trouble: leaving anyway
            sup.tick()
    if not done.is_set():
        frame = sys._current_frames().get(worker.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
        context.log.warning(
            f"connector {loaded.name}: the loop did not stop within {STOP_GRACE_S:.0f}s of the "
            f"terminate; leaving it (offsets are committed only by the loop). Its stack:\n{stack}"
        )
