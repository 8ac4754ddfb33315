"""A resolved secret never leaves a failing run (issue 34, H1), on real servers.

A PostgreSQL sink connector whose URL takes its user from ``${env:CONVEYOR_CANARY_USER}``, a
role that does not exist, runs through the real connector op (Dagster, in process: claim,
Spark Connect, tansu, the loop) until libpq refuses it with ``role "<canary>" does not
exist``. The canary is then searched byte by byte in the meta store's file (status,
last error, history), in every log record and in everything written to stdout/stderr, in
the run's Dagster event log (each event serialized, the step failure's error with its cause
chain) and in the exception the op raised: absent. The error is still there, with the
reference in place of the value.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
import yaml
from dagster import DagsterInstance, serialize_value

from conveyor.config.specs import load_file
from conveyor.core.model import ConnectorStatus
from conveyor.dagster.jobs.connector import connector_job
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.store.meta import MetaStore

pytestmark = pytest.mark.integration

REFERENCE = "${env:CONVEYOR_CANARY_USER}"


@pytest.fixture
def canary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    value = f"canary_role_{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("CONVEYOR_CANARY_USER", value)
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CONVEYOR_SECRET_ENV", raising=False)
    return value


def test_a_libpq_error_quoting_a_resolved_user_leaves_no_trace_of_it(
    canary: str,
    tmp_path: Path,
    tansu: str,
    spark_remote: str,
    topic_name: str,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    name = f"leak_{uuid.uuid4().hex[:6]}"
    spec = {
        "name": name,
        "source": {"topics": [topic_name], "bootstrap_servers": tansu},
        "transform": {"decode": "json", "schema": "id BIGINT"},
        "sink": {
            "type": "postgres",
            "url": f"postgresql://{REFERENCE}@127.0.0.1:5432/test",
            "table": "never_written",
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_file(path)
    assert loaded.ok, loaded.error
    meta_db = tmp_path / "meta.db"
    resource = ConveyorResource(
        meta_url=f"sqlite:///{meta_db}", kafka_bootstrap=tansu, spark_remote=spark_remote
    )
    caplog.set_level(logging.DEBUG)
    with DagsterInstance.ephemeral() as instance:
        result = connector_job(loaded).execute_in_process(
            instance=instance, resources={"conveyor": resource}, raise_on_error=False
        )
        assert not result.success
        events = instance.all_logs(result.run_id)
        failures = [e for e in events if e.is_dagster_event and e.dagster_event.is_step_failure]
        assert failures, [e.message for e in events]
        error = failures[0].dagster_event.step_failure_data.error
        assert error is not None
        error_text = error.to_string()
        event_log = "\n".join(serialize_value(e) for e in events)

    store = MetaStore(f"sqlite:///{meta_db}")
    row = store.get(name)
    history = store.history(name)
    store.close()
    # It did fail for the canary's role: the reference stands where libpq quoted the value.
    assert row.status == ConnectorStatus.ERROR
    assert row.last_error is not None and "does not exist" in row.last_error
    assert f'role "{REFERENCE}" does not exist' in row.last_error
    assert f'role "{REFERENCE}"' in error_text

    out, err = capfd.readouterr()
    places = {
        "meta store file": _store_bytes(tmp_path),
        "last_error": (row.last_error or "").encode(),
        "history": "\n".join(h.reason for h in history).encode(),
        "log records": "\n".join(_record_text(r) for r in caplog.records).encode(),
        "stdout": out.encode(),
        "stderr": err.encode(),
        "event log": event_log.encode(),
        "step failure with its chain": error_text.encode(),
    }
    leaked = [where for where, data in places.items() if canary.encode() in data]
    assert not leaked, f"the canary {canary!r} is in: {leaked}"


def _store_bytes(tmp_path: Path) -> bytes:
    """The meta store's file and its journal, every byte (freed pages included)."""
    return b"".join(p.read_bytes() for p in sorted(tmp_path.glob("meta.db*")))


def _record_text(record: logging.LogRecord) -> str:
    formatted = logging.Formatter("%(message)s").format(record)
    return f"{formatted}\n{record.exc_text or ''}\n{record.stack_info or ''}"
