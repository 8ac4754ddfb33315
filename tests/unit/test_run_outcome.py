"""How an error ends a connector run: the outcome table in core.engine.failure, shared by sink and
source connectors."""

from __future__ import annotations

import pytest

from conveyor.core.engine.failure import RunEnding, run_outcome
from conveyor.core.engine.routing import RoutingError
from conveyor.core.errors import (
    ConfigError,
    DataPolicyError,
    DeadLetterLimitError,
    FencedError,
    OutageBudgetExceeded,
    PermanentSinkError,
    PermanentSourceError,
    StageHungError,
)


def test_fenced_runs_exit_without_writing() -> None:
    assert run_outcome(FencedError("gen 3 < 4")).ending is RunEnding.EXIT


def test_an_outage_past_its_budget_retries_the_op_then_errors() -> None:
    e = OutageBudgetExceeded("down for 300s")
    retry = run_outcome(e, op_retries_left=1)
    assert (retry.ending, retry.error) == (RunEnding.RETRY, "down for 300s")
    spent = run_outcome(e, op_retries_left=0)
    assert (spent.ending, spent.reason) == (RunEnding.ERROR, "outage budget spent")


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("bad", field="sink.table"),
        PermanentSinkError("auth"),
        PermanentSourceError("tls"),
        DataPolicyError("row 7"),
        DeadLetterLimitError("too many"),
        StageHungError("send"),
        RoutingError("cap"),
    ],
)
def test_our_errors_end_in_error_named_by_their_class(error: Exception) -> None:
    outcome = run_outcome(error)
    assert outcome.ending is RunEnding.ERROR
    assert outcome.reason == type(error).__name__ and outcome.error == str(error)


def test_anything_else_is_a_crash_with_its_class_in_the_message() -> None:
    outcome = run_outcome(KeyError("x"))
    assert outcome.ending is RunEnding.CRASH and outcome.error == "KeyError: 'x'"
