"""One contender's drain of a backlog, sampled: the figures both as-users-run-it benchmarks report.

A ``Sample`` is the target's row count with each process's CPU seconds and RSS at one
moment; a ``Result`` turns a drain's samples into the steady rate (20% to 90% of the
``n`` rows), the start-up-included rate, CPU seconds per 100,000 rows over the steady
window, and peak RSS, per process.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    t: float
    rows: int
    cpu: dict[str, float]
    rss: dict[str, int]


@dataclass
class Result:
    contender: str
    started: float
    n: int
    sink: str = "postgres"
    samples: list[Sample] = field(default_factory=list)
    loadavg: tuple[float, float, float] = (0.0, 0.0, 0.0)
    rows: int = 0

    def _at(self, rows: float) -> Sample:
        return next(s for s in self.samples if s.rows >= rows)

    def steady_rate(self) -> float:
        a, b = self._at(0.2 * self.n), self._at(0.9 * self.n)
        if a is b:
            raise AssertionError(
                f"{self.sink} {self.contender}: 20% to 90% of {self.n} rows in one write: raise n"
            )
        return (b.rows - a.rows) / (b.t - a.t)

    def total_rate(self) -> float:
        return self.n / (self._at(self.n).t - self.started)

    def cpu_per_100k(self) -> dict[str, float]:
        a, b = self._at(0.2 * self.n), self._at(0.9 * self.n)
        return {
            k: (b.cpu.get(k, 0.0) - a.cpu.get(k, 0.0)) * 100_000 / (b.rows - a.rows) for k in b.cpu
        }

    def peak_rss_mb(self) -> dict[str, float]:
        keys = {k for s in self.samples for k in s.rss}
        return {k: max(s.rss.get(k, 0) for s in self.samples) / 2**20 for k in keys}
