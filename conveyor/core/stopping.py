"""Stopping a loop: the sleep a stop request cuts short, and the exception that unwinds an outage wait.

The sink loop (``core.loop``) and the source loop (``core.source_loop``) wait out outages the same
way: they sleep in short ticks on their stop event, so a stop request (the event, a fenced run, the
desired state) ends the wait within a tick; a wait that ended on a stop raises :class:`Stopping`,
which ``run`` treats as a clean stop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# The longest a stop request waits for a sleeping loop to notice it.
TICK_S = 0.5


class Stopping(BaseException):
    """A stop was requested while waiting out an outage (internal to the loops: a clean stop)."""


def sleep_unless_stopped(
    seconds: float,
    stop_event: threading.Event,
    should_stop: Callable[[], bool],
    *,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Sleep ``seconds``, returning early once ``should_stop()`` is true (checked every tick; the
    wait on ``stop_event`` returns at once when it is set)."""
    deadline = clock() + seconds
    while not should_stop():
        left = deadline - clock()
        if left <= 0:
            return
        stop_event.wait(min(left, TICK_S))
