"""Pure failure decisions: delays, outage budget, dead-letter limit."""

from __future__ import annotations

import random

import pytest

from conveyor.core.engine.failure import (
    DeadLetterLimiter,
    OutageTracker,
    resend_attempts,
    retry_delay,
)
from conveyor.core.errors import DeadLetterLimitError
from conveyor.core.model import DeadLetterSpec, FailurePolicyName, RetrySpec


def test_exponential_linear_constant_and_cap():
    exp = RetrySpec(delay=1, backoff="exponential", jitter="none", max_delay=10)
    assert [retry_delay(exp, a) for a in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    lin = RetrySpec(delay=2, backoff="linear", jitter="none")
    assert [retry_delay(lin, a) for a in (1, 2, 3)] == [2, 4, 6]
    const = RetrySpec(delay=3, backoff="constant", jitter="none")
    assert retry_delay(const, 5) == 3
    with pytest.raises(ValueError):
        retry_delay(exp, 0)


def test_jitter_stays_in_its_band():
    rng = random.Random(1)
    full = RetrySpec(delay=4, backoff="constant", jitter="full")
    pm = RetrySpec(delay=4, backoff="constant", jitter="plus_minus")
    assert all(0 <= retry_delay(full, 1, rng) <= 4 for _ in range(200))
    assert all(3 <= retry_delay(pm, 1, rng) <= 5 for _ in range(200))


def test_outage_budget_by_time_and_by_attempts():
    t = OutageTracker(RetrySpec(max_retries=100, max_outage=30, jitter="none"))
    assert not t.active and not t.exhausted(0)
    t.failed(100.0)
    assert t.active and not t.exhausted(129.0) and t.exhausted(130.0)
    t.recovered()
    assert not t.active
    t2 = OutageTracker(RetrySpec(max_retries=2, max_outage=3600, jitter="none"))
    for now in (0, 1, 2):
        t2.failed(now)
    assert t2.exhausted(3)


def test_resend_attempts_per_policy():
    assert resend_attempts(FailurePolicyName.DISCARD, 5) == 0
    assert resend_attempts(FailurePolicyName.FAIL, 5) == 0
    assert resend_attempts(FailurePolicyName.DISCARD_AFTER_RETRY, 5) == 5
    assert resend_attempts(FailurePolicyName.DEAD_LETTER, 2) == 2


def test_dead_letter_limit_ratio_and_consecutive():
    lim = DeadLetterLimiter(DeadLetterSpec(max_ratio=0.5, max_consecutive=5))
    lim.check(100, [i % 10 == 0 for i in range(100)])  # 10% scattered: fine
    with pytest.raises(DeadLetterLimitError, match="51 of 100"):
        lim.check(100, [i < 51 for i in range(100)])
    lim2 = DeadLetterLimiter(DeadLetterSpec(max_ratio=1.0, max_consecutive=5))
    lim2.check(3, [True, True, True])
    with pytest.raises(DeadLetterLimitError, match="5 messages in a row"):
        lim2.check(3, [True, True, False][:2] + [True])  # 3 + 2 in a row across batches
    small = DeadLetterLimiter(DeadLetterSpec(max_ratio=0.5, max_consecutive=100))
    small.check(2, [True, True])  # tiny batches are judged by the consecutive rule only
