"""The meta store's transient trouble (a real SQLite lock, a dropped PostgreSQL connection),
generation checks before a send, and brokers gone from the brokers file."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid

import psycopg2
import pytest
import sqlalchemy as sa

from conveyor.core.engine.liveness import Supervisor
from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, run_loop
from conveyor.core.errors import FencedError, TransientStoreError
from conveyor.core.model import (
    BatchPolicy,
    Broker,
    ConnectorStatus,
    LivenessSpec,
    RetrySpec,
    TopicPartition,
)
from conveyor.dagster.jobs.committer import StoreCommitter
from conveyor.store import schema as t
from conveyor.store.meta import MetaStore
from tests.unit.test_loop import Events, FakeSink, FakeSource, json_transform, source_batch

TP0 = TopicPartition("t", 0)


class NoMirror:
    """The Kafka source's offset mirror, not under test here."""

    def mirror_commit(self, offsets):
        pass


def claimed(store: MetaStore, name: str) -> int:
    store.sync_spec(name, spec_json="{}", spec_hash="h", source="f.yaml", error=None)
    return store.claim(
        name, run_id="r1", expected_generation=None, holder_alive=lambda r: False
    ).generation


def hold_exclusive_lock(path, seconds: float, locked: threading.Event) -> None:
    """A second connection holding BEGIN EXCLUSIVE: every writer gets "database is locked"."""
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("BEGIN EXCLUSIVE")
    locked.set()
    time.sleep(seconds)
    c.execute("COMMIT")
    c.close()


def test_sqlite_lock_is_a_transient_store_error(tmp_path):
    path = tmp_path / "meta.db"
    store = MetaStore(f"sqlite:///{path}", busy_timeout_s=0.2)
    gen = claimed(store, "c1")
    locked = threading.Event()
    holder = threading.Thread(target=hold_exclusive_lock, args=(path, 2.0, locked))
    holder.start()
    locked.wait(5)
    try:
        with pytest.raises(TransientStoreError, match="database is locked"):
            store.commit("c1", gen, {TP0: 5})
        with pytest.raises(TransientStoreError, match="database is locked"):
            store.heartbeat("c1", gen, {})
    finally:
        holder.join()
    store.commit("c1", gen, {TP0: 5})
    assert store.committed_offsets("c1") == {TP0: 5}


def test_a_run_rides_out_a_meta_store_lock_without_loss_and_reports_it(tmp_path):
    """A loop with its supervisor against a real SQLite store that another connection locks
    for 3 s: every message delivered once, committed, and the trouble in the history."""
    path = tmp_path / "meta.db"
    store = MetaStore(f"sqlite:///{path}", busy_timeout_s=0.2)
    gen = claimed(store, "c1")
    events = Events()
    n_batches = 30
    source = FakeSource([source_batch(i * 10, 10) for i in range(n_batches)], events)
    sink = FakeSink(events)
    slow_send = sink.send_batch

    def send(batch):  # 0.2 s per batch, so that the lock lands mid-stream
        time.sleep(0.2)
        return slow_send(batch)

    sink.send_batch = send
    committer = StoreCommitter(store, "c1", gen, NoMirror())  # type: ignore[arg-type]
    done = threading.Event()
    loop = ConnectorLoop(
        LoopConfig(
            name="c1",
            batch=BatchPolicy(max_wait_ms=10),
            retry=RetrySpec(delay=0.2, max_delay=0.5, jitter="none"),
        ),
        source=source,
        transform=json_transform,
        sink=sink,
        committer=committer,
        committed={},
        stop_requested=done.is_set,
    )
    loop.supervised = True
    sup = Supervisor(loop, LivenessSpec(), clock=time.monotonic)
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.setdefault("c", run_loop(loop)))
    worker.start()
    locked = threading.Event()
    holder = threading.Thread(target=hold_exclusive_lock, args=(path, 3.0, locked))
    try:
        deadline = time.monotonic() + 60
        started = False
        while time.monotonic() < deadline:
            if not started and len(sink.rows) >= 50:
                holder.start()
                started = True
            sup.tick()
            if len(sink.rows) >= n_batches * 10 and loop.committed.get(TP0) == n_batches * 10:
                break
            time.sleep(sup.poll_s)
        for _ in range(8):  # the last status change reaches the store
            sup.tick()
            time.sleep(sup.poll_s)
    finally:
        done.set()
        worker.join(30)
        if started:
            holder.join()
    assert "c" in outcome, "the loop must end cleanly"
    assert sorted(sink.rows) == list(range(n_batches * 10))  # once each
    assert store.committed_offsets("c1") == {TP0: n_batches * 10}
    history = store.history("c1", 100)
    reasons = " | ".join(h.reason for h in history)
    assert "database is locked" in reasons
    assert any(h.to_status == "Degraded" for h in history)
    assert store.get("c1").status == ConnectorStatus.RUNNING


def test_a_dropped_postgresql_connection_is_transient_then_the_pool_recovers(pg_url):
    db = f"conveyor_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(
        pg_url.replace("postgresql://", "postgresql+psycopg2://"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{db}"')
    url = sa.make_url(pg_url).set(database=db).render_as_string(hide_password=False)
    store = MetaStore(url)
    try:
        gen = claimed(store, "c1")
        store.commit("c1", gen, {TP0: 1})
        # Kill the store's pooled sessions (a failover, a restart of the server).
        killer = psycopg2.connect(pg_url)
        killer.autocommit = True
        with killer.cursor() as cur:
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (db,),
            )
        killer.close()
        errors = 0
        for _ in range(5):  # pre-ping replaces dead connections; an error is transient
            try:
                store.commit("c1", gen, {TP0: 2})
                break
            except TransientStoreError:
                errors += 1
        assert store.committed_offsets("c1") == {TP0: 2} and errors <= 1
    finally:
        store.close()
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE "{db}" WITH (FORCE)')
        admin.dispose()


def test_generation_check_before_a_send(tmp_path):
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    gen = claimed(store, "c1")
    store.ensure_current("c1", gen)
    store.claim("c1", run_id="r2", expected_generation=None, holder_alive=lambda r: False)
    with pytest.raises(FencedError, match="no longer current"):
        store.ensure_current("c1", gen)


def test_brokers_marked_gone_and_revived(tmp_path):
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    store.upsert_broker(Broker(id="b1"))
    store.upsert_broker(Broker(id="b2"))
    store.mark_gone(["b1"])
    assert store.gone_brokers() == {"b1"}
    store.upsert_broker(Broker(id="b1"))  # back in the file
    assert store.gone_brokers() == set()


def test_sync_brokers_marks_a_removed_broker_gone(tmp_path, monkeypatch):
    from conveyor.dagster.resources.conveyor import ConveyorResource

    brokers = tmp_path / "brokers.yaml"
    brokers.write_text("brokers:\n  - id: b1\n  - id: b2\n")
    monkeypatch.setenv("CONVEYOR_BROKERS_FILE", str(brokers))
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    res = ConveyorResource(meta_url=store.url)
    res.sync_brokers(store)
    brokers.write_text("brokers:\n  - id: b2\n")
    res.sync_brokers(store)
    assert store.gone_brokers() == {"b1"}
    assert {b.id for b in store.list_brokers()} == {"b1", "b2"}  # kept, for the history


def test_a_version_1_store_is_migrated(tmp_path):
    url = f"sqlite:///{tmp_path / 'meta.db'}"
    store = MetaStore(url)
    store.ensure_schema()
    with store.engine.begin() as c:  # back to version 1: no gone_at column
        c.exec_driver_sql("ALTER TABLE conveyor_brokers DROP COLUMN gone_at")
        c.execute(t.schema_version.update().values(version=1))
    store.close()
    fresh = MetaStore(url)
    fresh.upsert_broker(Broker(id="b1"))
    fresh.mark_gone(["b1"])
    assert fresh.schema_version() == t.SCHEMA_VERSION and fresh.gone_brokers() == {"b1"}
