"""The lag check on a real DagsterInstance: materializations with lag in, check evaluations out."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from dagster import (
    AssetCheckKey,
    AssetKey,
    AssetMaterialization,
    DagsterInstance,
    instance_for_test,
)

from conveyor.dagster.assets import checks
from conveyor.dagster.assets.checks import LAG_CHECK_NAME, LAG_CHECKS_JOB
from conveyor.dagster.tags import TAG_CONNECTOR

SPEC = """
name: {name}
source: {{topics: [{name}]}}
sink: {{type: localfile, path: {path}}}
"""
# A window of 4 s, filled with one sample a second. The check's clock is frozen half a
# second after the last sample (``frozen_clock``): however long the job takes to start on
# a loaded machine, it sees the samples where the test put them.
WINDOW_S = 4.0
GAP_S = 1.0


def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    frozen = time.time() + 0.5
    monkeypatch.setattr(checks, "clock", lambda: frozen)


@pytest.fixture
def defs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    connectors = tmp_path / "connectors"
    connectors.mkdir()
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_CONNECTORS_DIR", str(connectors))
    monkeypatch.delenv("CONVEYOR_META_URL", raising=False)
    monkeypatch.setenv("CONVEYOR_LAG_CHECK_MINUTES", str(WINDOW_S / 60))
    for name in ("orders", "clicks"):
        (connectors / f"{name}.yaml").write_text(SPEC.format(name=name, path=tmp_path / name))
    from conveyor.dagster.definitions import build_defs

    return build_defs()


def sink_key(defs, connector: str) -> AssetKey:
    graph = defs.resolve_asset_graph()
    [key] = [
        k
        for k in graph.get_all_asset_keys()
        if k.path[0] == "localfile" and graph.get(k).group_name == f"connector_{connector}"
    ]
    return key


def report_lags(instance: DagsterInstance, key: AssetKey, connector: str, lags: list[int]) -> None:
    """One materialization per lag value, a second apart: the first ones end up older than the window."""
    for i, lag in enumerate(lags):
        if i:
            time.sleep(GAP_S)
        instance.report_runless_asset_event(
            AssetMaterialization(
                asset_key=key,
                metadata={"lag": lag, "messages_out": 10 * i},
                tags={TAG_CONNECTOR: connector},
            )
        )


def evaluation(instance: DagsterInstance, key: AssetKey):
    check_key = AssetCheckKey(key, LAG_CHECK_NAME)
    record = instance.event_log_storage.get_latest_asset_check_execution_by_key([check_key])[
        check_key
    ]
    assert record is not None
    return record.event.dagster_event.event_specific_data


def test_every_sink_asset_has_a_lag_check_and_a_running_schedule(defs):
    graph = defs.resolve_asset_graph()
    checks = {ck for ck in graph.asset_check_keys}
    assert {
        AssetCheckKey(sink_key(defs, c), LAG_CHECK_NAME) for c in ("orders", "clicks")
    } <= checks
    schedule = defs.resolve_schedule_def("conveyor_lag_checks")
    assert schedule.job_name == LAG_CHECKS_JOB
    assert schedule.default_status.value == "RUNNING"
    assert schedule.cron_schedule == "*/5 * * * *"


def test_rising_lag_fails_and_flat_lag_passes(defs, monkeypatch):
    orders, clicks = sink_key(defs, "orders"), sink_key(defs, "clicks")
    job = defs.resolve_job_def(LAG_CHECKS_JOB)
    with instance_for_test() as instance:
        # No data yet: both checks pass and say why.
        result = job.execute_in_process(instance=instance)
        assert result.success
        first = evaluation(instance, orders)
        assert first.passed and first.description.startswith("too little data")

        # Rising lag on orders, flat lag on clicks, interleaved in time.
        for i in range(7):
            if i:
                time.sleep(GAP_S)
            instance.report_runless_asset_event(
                AssetMaterialization(
                    asset_key=orders,
                    metadata={"lag": 100 * (i + 1)},
                    tags={TAG_CONNECTOR: "orders"},
                )
            )
            instance.report_runless_asset_event(
                AssetMaterialization(
                    asset_key=clicks, metadata={"lag": 40}, tags={TAG_CONNECTOR: "clicks"}
                )
            )
        frozen_clock(monkeypatch)
        result = job.execute_in_process(instance=instance)
        assert result.success  # a failed check is a result, not a run failure
        rising = evaluation(instance, orders)
        assert not rising.passed
        assert rising.description.startswith("orders: lag grew for ")
        assert rising.metadata["lag_latest"].value == 700
        flat = evaluation(instance, clicks)
        assert flat.passed
        assert flat.description.startswith("clicks: lag is flat or falling")
        assert {e.asset_check_key for e in result.get_asset_check_evaluations()} == {
            AssetCheckKey(orders, LAG_CHECK_NAME),
            AssetCheckKey(clicks, LAG_CHECK_NAME),
        }


def test_falling_lag_passes(defs, monkeypatch):
    orders = sink_key(defs, "orders")
    job = defs.resolve_job_def(LAG_CHECKS_JOB)
    with instance_for_test() as instance:
        report_lags(instance, orders, "orders", [1300, 1100, 900, 700, 500, 300, 100])
        frozen_clock(monkeypatch)
        job.execute_in_process(instance=instance)
        v = evaluation(instance, orders)
        assert v.passed
        assert "1300" not in v.description  # the baseline is the newest sample before the window
        assert v.metadata["lag_growth"].value < 0
