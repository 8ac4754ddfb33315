"""A resolved secret quoted by a client's error leaves no trace under ``conveyor dev`` (issue 34,
H1), end to end: the same stack as tests/e2e/test_api_e2e.py (dagster dev, the scheduler
sensor, the REST API).

A PostgreSQL connector created over the API takes its URL's user from a ``${file:...}``
reference to a canary role that does not exist; the scheduler launches it and libpq refuses
it with ``role "<canary>" does not exist``. Once its Dagster run has failed, the API's status
shows the error with the reference in place of the value, and the canary is searched byte by
byte in every file of the state directory (meta store and WAL, Dagster's run and event
storage, compute logs, every log) and in ``conveyor dev``'s output: absent.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.e2e.conftest import STOP_S, wait_for
from tests.e2e.test_api_e2e import Stack, stack  # noqa: F401 - the stack fixture, this module's own

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def test_a_client_error_quoting_a_resolved_user_leaves_no_trace(stack: Stack) -> None:  # noqa: F811
    s = stack
    canary = f"canaryrole{uuid.uuid4().hex[:12]}"
    secret = Path(s.env["E2E_SECRET_FILE"]).parent / "canary_user"
    secret.write_text(canary + "\n")
    reference = f"${{file:{secret}}}"
    name = f"leak_{uuid.uuid4().hex[:6]}"
    config = {
        "source": {"topics": [f"t_{name}"]},
        "transform": {"decode": "json", "schema": "id BIGINT"},
        "sink": {
            "type": "postgres",
            "url": f"postgresql://{reference}@127.0.0.1:5432/test",
            "table": "never_written",
        },
    }
    r = s.call("POST", "/connectors", json={"name": name, "config": config})
    assert r.status_code == 201, r.text
    try:
        wait_for(
            lambda: "does not exist" in json.dumps(s.status(name)),
            STOP_S,
            "the connector to fail on the canary's role",
        )
        trace = s.status(name)["connector"].get("trace", "")
        assert f'role "{reference}" does not exist' in trace, trace
        wait_for(lambda: _failed_runs(s, name) > 0, STOP_S, "its Dagster run to end failed")
    finally:
        s.call("DELETE", f"/connectors/{name}")
    files = {f: f.read_bytes() for f in s.home.rglob("*") if f.is_file()}
    hits = [str(f) for f, data in files.items() if canary.encode() in data]
    assert hits == [], hits
    assert canary.encode() not in (s.cwd / "conveyor-dev.log").read_bytes()
    # The search covered where the error went: Dagster's storage holds it, scrubbed.
    recorded = [str(f) for f, data in files.items() if b"does not exist" in data]
    assert any("/dagster/" in f for f in recorded), (recorded, sorted(map(str, files)))


def _failed_runs(s: Stack, name: str) -> int:
    from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

    instance = DagsterInstance.from_config(str(s.home / "dagster"))
    try:
        runs = instance.get_runs(
            RunsFilter(job_name=f"connector__{name}", statuses=[DagsterRunStatus.FAILURE])
        )
        return len(runs)
    finally:
        instance.dispose()
