"""The meta store on SQLite and PostgreSQL: schema, claims, fenced commits, history."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from conveyor.core.errors import AlreadyClaimedError, ConveyorError, FencedError
from conveyor.core.model import (
    Broker,
    ConnectorStatus,
    DesiredState,
    HeartbeatReply,
    TopicPartition,
)
from conveyor.core.planning.state import StateChange
from conveyor.store import schema as t
from conveyor.store.meta import MetaStore, UnknownConnectorError

TP = TopicPartition("orders", 0)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path, pg_url) -> Iterator[MetaStore]:
    if request.param == "sqlite":
        s = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
        yield s
        s.close()
        return
    # A private database per test keeps PostgreSQL runs independent.
    db = f"conveyor_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(
        pg_url.replace("postgresql://", "postgresql+psycopg2://"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{db}"')
    url = sa.make_url(pg_url).set(database=db).render_as_string(hide_password=False)
    s = MetaStore(url)
    yield s
    s.close()
    with admin.connect() as c:
        c.exec_driver_sql(f'DROP DATABASE "{db}" WITH (FORCE)')
    admin.dispose()


def add(store: MetaStore, name: str = "c1", error: str | None = None):
    return store.sync_spec(
        name,
        spec_json=None if error else f'{{"name": "{name}"}}',
        spec_hash="h1",
        source="f.yaml",
        error=error,
    )


def test_schema_is_created_and_versioned(store):
    store.ensure_schema()
    assert store.schema_version() == t.SCHEMA_VERSION
    insp = sa.inspect(store.engine)
    assert {
        "conveyor_connectors",
        "conveyor_brokers",
        "conveyor_offsets",
        "conveyor_state_history",
        "conveyor_schema",
    } <= set(insp.get_table_names())


def test_newer_schema_is_refused(store):
    store.ensure_schema()
    with store.engine.begin() as c:
        c.execute(t.schema_version.update().values(version=t.SCHEMA_VERSION + 1))
    fresh = MetaStore(store.url)
    with pytest.raises(ConveyorError, match="newer than this Conveyor"):
        fresh.ensure_schema()
    fresh.close()


def test_new_connector_is_idle_and_history_records_creation(store):
    row = add(store)
    assert (
        row.status == ConnectorStatus.IDLE
        and row.desired == DesiredState.RUNNING
        and row.generation == 0
    )
    assert [h.reason for h in store.history("c1")] == ["created"]


def test_spec_error_shows_error_and_fix_returns_to_idle(store):
    add(store)
    row = store.sync_spec(
        "c1",
        spec_json=None,
        spec_hash=None,
        source="f.yaml",
        error="f.yaml: sink.table: Field required",
    )
    assert row.status == ConnectorStatus.ERROR and "sink.table" in row.last_error
    row = add(store)
    assert row.status == ConnectorStatus.IDLE and row.last_error is None


def test_claim_bumps_generation_and_commit_is_fenced(store):
    add(store)
    c1 = store.claim("c1", run_id="r1", expected_generation=None, holder_alive=lambda r: True)
    assert c1.generation == 1 and c1.offsets == {}
    store.commit("c1", 1, {TP: 10})
    store.heartbeat("c1", 1, {"messages_out": 10})
    assert store.get("c1").status == ConnectorStatus.RUNNING
    # A second launch while r1 is alive is refused with a message naming r1.
    with pytest.raises(AlreadyClaimedError, match="already running in run r1"):
        store.claim("c1", run_id="r2", expected_generation=None, holder_alive=lambda r: True)
    # r1 died: r2 takes over, resumes from r1's commit, and r1 can no longer commit.
    c2 = store.claim("c1", run_id="r2", expected_generation=None, holder_alive=lambda r: False)
    assert c2.generation == 2 and c2.offsets == {TP: 10}
    with pytest.raises(FencedError):
        store.commit("c1", 1, {TP: 99})
    with pytest.raises(FencedError):
        store.heartbeat("c1", 1, {})
    assert store.committed_offsets("c1") == {TP: 10}
    store.commit("c1", 2, {TP: 20})
    assert store.committed_offsets("c1") == {TP: 20}


def test_scheduler_launched_run_adopts_its_generation_or_is_superseded(store):
    add(store)
    store.upsert_broker(Broker(id="b1"))
    gen = store.assign("c1", "b1", expected_generation=0, reason="assigned to b1")
    assert gen == 1 and store.assign("c1", "b1", expected_generation=0, reason="x") is None
    claim = store.claim("c1", run_id="r1", expected_generation=1, holder_alive=lambda r: True)
    assert claim.generation == 1 and claim.broker_id == "b1"
    with pytest.raises(FencedError, match="superseded"):
        store.claim("c1", run_id="r0", expected_generation=0, holder_alive=lambda r: True)


def test_release_records_final_state_and_stopped_sets_desired(store):
    add(store)
    g = store.claim(
        "c1", run_id="r1", expected_generation=None, holder_alive=lambda r: False
    ).generation
    store.heartbeat("c1", g, {})
    assert store.release("c1", g, ConnectorStatus.STOPPED, "run terminated")
    row = store.get("c1")
    assert row.status == ConnectorStatus.STOPPED and row.desired == DesiredState.STOPPED
    assert not store.release("c1", g - 1, ConnectorStatus.ERROR, "stale")
    reasons = [h.reason for h in store.history("c1")]
    assert reasons[0] == "run terminated"


def test_heartbeat_returns_desired_state_and_the_stored_spec_hash(store):
    add(store)
    g = store.claim(
        "c1", run_id="r1", expected_generation=None, holder_alive=lambda r: False
    ).generation
    assert store.heartbeat("c1", g, {}) == HeartbeatReply(DesiredState.RUNNING, "h1")
    store.set_desired("c1", DesiredState.PAUSED)
    assert store.heartbeat("c1", g, {}).desired == DesiredState.PAUSED
    store.sync_spec("c1", spec_json='{"name": "c1"}', spec_hash="h2", source="s", error=None)
    assert store.heartbeat("c1", g, {}, status=ConnectorStatus.PAUSED) == HeartbeatReply(
        DesiredState.PAUSED, "h2"
    )
    assert store.get("c1").status == ConnectorStatus.PAUSED
    store.set_desired("c1", DesiredState.STOPPED)
    assert store.heartbeat("c1", g, {}).desired == DesiredState.STOPPED


def test_a_scheduled_claim_keeps_a_paused_connector_paused_a_launch_by_hand_runs_it(store):
    add(store)
    store.set_desired("c1", DesiredState.PAUSED)
    g = store.assign("c1", "b1", expected_generation=0, reason="t")
    store.claim("c1", run_id="r1", expected_generation=g, holder_alive=lambda r: False)
    assert store.get("c1").desired == DesiredState.PAUSED
    store.claim("c1", run_id="r2", expected_generation=None, holder_alive=lambda r: False)
    assert store.get("c1").desired == DesiredState.RUNNING


def test_an_invalid_new_spec_leaves_a_live_connector_running_with_the_error_shown(store):
    add(store)
    g = store.claim(
        "c1", run_id="r1", expected_generation=None, holder_alive=lambda r: False
    ).generation
    store.heartbeat("c1", g, {})
    row = store.sync_spec("c1", spec_json=None, spec_hash=None, source="s", error="bad field")
    assert row.status == ConnectorStatus.RUNNING and row.spec_error == "bad field"
    assert row.spec_hash == "h1"  # the last valid spec stays
    assert "invalid spec (the run goes on with the last valid one)" in store.history("c1")[0].reason


def test_offsets_forget_and_replace(store):
    add(store)
    store.set_desired("c1", DesiredState.STOPPED)
    store.apply("c1", None, StateChange(status=ConnectorStatus.STOPPED), "t")
    tp1 = TopicPartition("t", 1)
    store.reset_offsets("c1", {TP: 5, tp1: 9})
    store.reset_offsets("c1", {}, forget=[tp1])
    assert store.committed_offsets("c1") == {TP: 5}
    store.reset_offsets("c1", {}, replace=True)
    assert store.committed_offsets("c1") == {}


def test_offsets_reset_only_when_stopped(store):
    add(store)
    g = store.claim(
        "c1", run_id="r1", expected_generation=None, holder_alive=lambda r: False
    ).generation
    store.heartbeat("c1", g, {})
    with pytest.raises(ConveyorError, match="stop it first"):
        store.reset_offsets("c1", {TP: 0})
    store.release("c1", g, ConnectorStatus.STOPPED, "stopped")
    store.reset_offsets("c1", {TP: 0})
    assert store.committed_offsets("c1") == {TP: 0}


def test_brokers_roundtrip_and_drain(store):
    store.upsert_broker(
        Broker(id="b1", capacity=3, spark_remote="sc://127.0.0.1:1", run_tags={"q": "a"})
    )
    store.set_draining("b1", True)
    store.upsert_broker(Broker(id="b1", capacity=4, spark_remote="sc://127.0.0.1:1"))
    [b] = store.list_brokers()
    assert b.capacity == 4 and b.draining is True and b.run_tags == {}
    with pytest.raises(ConveyorError):
        store.set_draining("nope", True)


def test_unknown_connector(store):
    with pytest.raises(UnknownConnectorError):
        store.get("nope")
