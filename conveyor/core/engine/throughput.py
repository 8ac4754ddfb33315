"""A sink loop's throughput (``core.engine.loop``): its rate over the last minute and its batches'
latencies, reported with each heartbeat."""

from __future__ import annotations

from collections import deque


class Throughput:
    """The recent batches: (when it ended, messages sent) and how long each took."""

    def __init__(self) -> None:
        self._latencies: deque[float] = deque(maxlen=256)
        self._window: deque[tuple[float, int]] = deque(maxlen=64)

    def batch(self, now: float, seconds: float, sent: int) -> None:
        """A batch ended at ``now`` after ``seconds``, having sent ``sent`` messages."""
        self._latencies.append(seconds)
        self._window.append((now, sent))

    def rate(self, now: float) -> float:
        """Messages per second over the batches of the last minute (0 below two batches)."""
        window = [(t, n) for t, n in self._window if now - t <= 60]
        if not window:
            return 0.0
        span = max(now - window[0][0], 1e-3)
        return sum(n for _, n in window) / span if len(window) > 1 else 0.0

    def latency_ms(self, q: float) -> float | None:
        """The ``q`` quantile of the recent batches' latencies, in milliseconds."""
        if not self._latencies:
            return None
        s = sorted(self._latencies)
        return round(s[min(len(s) - 1, int(q * len(s)))] * 1000, 2)
