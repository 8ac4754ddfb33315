"""The run's supervisor: the loop on a thread of its own, heartbeats and stage deadlines from
the op's thread (``core.liveness.Supervisor``), and the terminate path."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from dagster import DagsterExecutionInterruptedError, OpExecutionContext

from conveyor.core.errors import FencedError, StageHungError
from conveyor.core.liveness import Supervisor
from conveyor.core.loop import ConnectorLoop, run_loop
from conveyor.core.model import Counters
from conveyor.jobs.progress import record_stuck_stage
from conveyor.jobs.runs import hold_interrupts
from conveyor.specs import LoadedSpec

# After a stop or a terminate: how long the op waits for the loop to finish its batch.
STOP_GRACE_S = 30.0


def supervise(
    context: OpExecutionContext,
    loop: ConnectorLoop,
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
    assert loaded.spec is not None
    spec = loaded.spec
    loop.supervised = True
    sup = Supervisor(
        loop,
        spec.liveness,
        read_wait_s=spec.batch.max_wait_ms / 1000,
        interval_s=loop.cfg.heartbeat_interval_s,
        clock=clock,
        on_report=lambda msg: context.log.warning(f"connector {loaded.name}: {msg}"),
    )
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

    worker = threading.Thread(target=body, name=f"conveyor-loop-{loaded.name}", daemon=True)
    worker.start()
    interrupted: BaseException | None = None
    reported = None
    try:
        while not done.is_set():
            if done.wait(sup.poll_s):
                break
            if canceled():
                interrupted = DagsterExecutionInterruptedError()
                break
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
        interrupted = e
    if interrupted is not None:
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
        raise interrupted
    if "error" in outcome:
        raise outcome["error"]
    return outcome["counters"]  # type: ignore[no-any-return]
