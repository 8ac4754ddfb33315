"""The lag-growth decision: pure, with a fixed clock."""

from __future__ import annotations

import pytest

from conveyor.dagster.assets.checks import (
    DEFAULT_LAG_CHECK_MINUTES,
    LagSample,
    lag_check_minutes,
    lag_verdict,
)

NOW = 1_700_000_000.0
WINDOW = 600.0


def series(*lags: int, step: float = 60.0) -> list[LagSample]:
    """One sample a minute, the last one at NOW."""
    n = len(lags)
    return [LagSample(NOW - (n - 1 - i) * step, lag) for i, lag in enumerate(lags)]


def test_steadily_rising_lag_fails():
    v = lag_verdict(series(*range(0, 1200, 100)), now=NOW, window_s=WINDOW)
    assert not v.passed
    assert v.description.startswith("lag grew for 10 minutes: 100 -> 1100")
    assert v.metadata["lag_baseline"] == 100
    assert v.metadata["lag_latest"] == 1100
    assert v.metadata["lag_growth"] == 1000
    assert v.metadata["samples_in_window"] == 10


def test_rising_with_plateaus_still_fails():
    v = lag_verdict(series(5, 5, 8, 8, 8, 9, 12, 12, 12, 20, 20, 30), now=NOW, window_s=WINDOW)
    assert not v.passed


def test_flat_lag_passes():
    v = lag_verdict(series(*[42] * 12), now=NOW, window_s=WINDOW)
    assert v.passed
    assert "flat or falling" in v.description


def test_zero_lag_passes():
    assert lag_verdict(series(*[0] * 12), now=NOW, window_s=WINDOW).passed


def test_decreasing_lag_passes():
    v = lag_verdict(series(*range(1200, 0, -100)), now=NOW, window_s=WINDOW)
    assert v.passed
    assert "flat or falling" in v.description
    assert v.metadata["lag_growth"] < 0


def test_lag_that_caught_up_inside_the_window_passes():
    # Higher at the end, but it dropped back to the baseline meanwhile: not growing for N minutes.
    v = lag_verdict(
        series(50, 50, 80, 90, 50, 10, 60, 70, 80, 90, 95, 100), now=NOW, window_s=WINDOW
    )
    assert v.passed
    assert "fell to 10" in v.description


def test_growth_only_in_the_last_minutes_passes():
    v = lag_verdict(series(*[0] * 9, 10, 20, 30), now=NOW, window_s=WINDOW)
    assert v.passed


def test_no_sample_old_enough_is_too_little_data():
    v = lag_verdict(series(1, 2, 3, 4, 5), now=NOW, window_s=WINDOW)
    assert v.passed
    assert v.description.startswith("too little data: no lag recorded 10 minutes ago")


def test_no_samples_at_all_is_too_little_data():
    v = lag_verdict([], now=NOW, window_s=WINDOW)
    assert v.passed
    assert v.description.startswith("too little data")


def test_too_few_samples_in_window_is_too_little_data():
    # The connector stopped reporting: only one recent sample besides the old ones.
    samples = [LagSample(NOW - 900, 1), LagSample(NOW - 700, 2), LagSample(NOW - 30, 500)]
    v = lag_verdict(samples, now=NOW, window_s=WINDOW)
    assert v.passed
    assert v.description == "too little data: 1 lag sample(s) in the last 10 minutes, need 2"


def test_samples_after_now_and_unordered_input_are_handled():
    samples = list(reversed(series(*range(0, 1200, 100)))) + [LagSample(NOW + 60, 0)]
    v = lag_verdict(samples, now=NOW, window_s=WINDOW)
    assert not v.passed
    assert v.metadata["lag_latest"] == 1100


def test_baseline_is_the_newest_sample_before_the_window():
    samples = [
        LagSample(NOW - 1000, 500),
        LagSample(NOW - 610, 10),
        LagSample(NOW - 300, 20),
        LagSample(NOW, 30),
    ]
    v = lag_verdict(samples, now=NOW, window_s=WINDOW)
    assert not v.passed
    assert v.metadata["lag_baseline"] == 10


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, DEFAULT_LAG_CHECK_MINUTES),
        ("", DEFAULT_LAG_CHECK_MINUTES),
        ("5", 5.0),
        ("0.5", 0.5),
        ("0", DEFAULT_LAG_CHECK_MINUTES),
        ("-3", DEFAULT_LAG_CHECK_MINUTES),
        ("ten", DEFAULT_LAG_CHECK_MINUTES),
    ],
)
def test_window_from_environment(monkeypatch: pytest.MonkeyPatch, raw: str | None, expected: float):
    if raw is None:
        monkeypatch.delenv("CONVEYOR_LAG_CHECK_MINUTES", raising=False)
    else:
        monkeypatch.setenv("CONVEYOR_LAG_CHECK_MINUTES", raw)
    assert lag_check_minutes() == expected
