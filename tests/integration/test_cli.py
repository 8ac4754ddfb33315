"""The CLI against a real meta store (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from conveyor.cli import main
from conveyor.core.model import ConnectorStatus, TopicPartition
from conveyor.store.meta import MetaStore


@pytest.fixture(params=["sqlite", "postgresql"])
def meta_url(request, tmp_path, pg_url) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'meta.db'}"
        return
    db = f"conveyor_cli_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_url.replace("postgresql://", "postgresql+psycopg2://"), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{db}"')
    yield sa.make_url(pg_url).set(database=db).render_as_string(hide_password=False)
    with admin.connect() as c:
        c.exec_driver_sql(f'DROP DATABASE "{db}" WITH (FORCE)')
    admin.dispose()


def cli(meta_url: str, *args: str, input: str | None = None):
    return CliRunner().invoke(main, ["--meta-url", meta_url, *args], input=input, catch_exceptions=False)


SPEC = """
name: orders
source: {topics: [orders]}
sink: {type: postgres, url: "postgresql://u:secret@127.0.0.1/x", table: orders}
"""


def test_apply_list_show_start_stop_history_delete(meta_url, tmp_path):
    spec = tmp_path / "orders.yaml"
    spec.write_text(SPEC)
    r = cli(meta_url, "connector", "apply", "-f", str(spec))
    assert r.exit_code == 0 and "orders applied (Idle, desired running)" in r.output

    r = cli(meta_url, "connector", "list", "--json")
    [row] = json.loads(r.output)
    assert row["name"] == "orders" and row["status"] == "Idle"
    r = cli(meta_url, "connector", "list")
    assert r.exit_code == 0 and "orders" in r.output and "Idle" in r.output

    r = cli(meta_url, "connector", "show", "orders")
    assert r.exit_code == 0 and "status: Idle" in r.output
    assert "secret" not in r.output  # the DSN password is a SecretStr

    r = cli(meta_url, "connector", "stop", "orders")
    assert r.exit_code == 0
    assert MetaStore(meta_url).get("orders").status == ConnectorStatus.STOPPED
    r = cli(meta_url, "connector", "start", "orders")
    assert r.exit_code == 0 and MetaStore(meta_url).get("orders").status == ConnectorStatus.IDLE
    r = cli(meta_url, "connector", "restart", "orders")
    assert r.exit_code == 0 and MetaStore(meta_url).get("orders").generation == 1

    r = cli(meta_url, "connector", "history", "orders")
    assert r.exit_code == 0 and "stopped from the CLI" in r.output and "started from the CLI" in r.output

    r = cli(meta_url, "connector", "delete", "orders", "--yes")
    assert r.exit_code == 0
    assert MetaStore(meta_url).list() == []


def test_bad_spec_and_unknown_connector_exit_non_zero_with_a_message(meta_url, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nsource: {topics: [t]}\nsink: {type: postgress}\n")
    r = cli(meta_url, "connector", "apply", "-f", str(bad))
    assert r.exit_code == 1 and "did you mean 'postgres'?" in r.output
    r = cli(meta_url, "connector", "show", "nope")
    assert r.exit_code == 1 and "no connector named 'nope'" in r.output
    assert "Traceback" not in r.output


def test_offsets_show_and_reset_refused_while_running(meta_url, tmp_path):
    spec = tmp_path / "orders.yaml"
    spec.write_text(SPEC)
    cli(meta_url, "connector", "apply", "-f", str(spec))
    store = MetaStore(meta_url)
    g = store.claim("orders", run_id="r1", expected_generation=None, holder_alive=lambda r: False).generation
    store.commit("orders", g, {TopicPartition("orders", 0): 42})
    store.heartbeat("orders", g, {})
    r = cli(meta_url, "offsets", "show", "orders")
    assert r.exit_code == 0 and "42" in r.output
    r = cli(meta_url, "offsets", "reset", "orders", "--to", "orders:0:7")
    assert r.exit_code == 1 and "stop" in r.output
    assert store.committed_offsets("orders") == {TopicPartition("orders", 0): 42}
    store.release("orders", g, ConnectorStatus.STOPPED, "stopped")
    r = cli(meta_url, "offsets", "reset", "orders", "--to", "orders:0:7")
    assert r.exit_code == 0
    assert store.committed_offsets("orders") == {TopicPartition("orders", 0): 7}


def test_broker_list_drain_undrain(meta_url):
    from conveyor.core.model import Broker

    MetaStore(meta_url).upsert_broker(Broker(id="b1", capacity=3))
    r = cli(meta_url, "broker", "drain", "b1")
    assert r.exit_code == 0
    r = cli(meta_url, "broker", "list")
    assert "b1" in r.output and "yes" in r.output
    r = cli(meta_url, "broker", "undrain", "b1")
    assert MetaStore(meta_url).list_brokers()[0].draining is False
    r = cli(meta_url, "broker", "drain", "nope")
    assert r.exit_code == 1 and "no broker named 'nope'" in r.output
