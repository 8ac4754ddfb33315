"""The CLI against a real meta store (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from conveyor.control.cli import main
from conveyor.core.model import ConnectorStatus, TopicPartition
from conveyor.store.meta import MetaStore


@pytest.fixture(params=["sqlite", "postgresql"])
def meta_url(request, tmp_path, pg_url) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'meta.db'}"
        return
    db = f"conveyor_cli_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(
        pg_url.replace("postgresql://", "postgresql+psycopg2://"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{db}"')
    yield sa.make_url(pg_url).set(database=db).render_as_string(hide_password=False)
    with admin.connect() as c:
        c.exec_driver_sql(f'DROP DATABASE "{db}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture(autouse=True)
def connectors_dir(tmp_path, monkeypatch) -> Path:
    """`connector apply` copies specs here (never into the checkout's .conveyor)."""
    d = tmp_path / "connectors"
    monkeypatch.setenv("CONVEYOR_CONNECTORS_DIR", str(d))
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    return d


def cli(meta_url: str, *args: str, input: str | None = None):
    # A wide, fixed terminal: tables are not folded whatever runs the tests.
    return CliRunner(env={"COLUMNS": "200"}).invoke(
        main, ["--meta-url", meta_url, *args], input=input, catch_exceptions=False
    )


SPEC = """
name: orders
source: {topics: [orders]}
sink: {type: postgres, url: "postgresql://u@127.0.0.1/x?application_name=secret", table: orders, delivery: at_least_once}
"""


def test_apply_list_show_start_stop_history_delete(meta_url, tmp_path):
    spec = tmp_path / "orders.yaml"
    spec.write_text(SPEC)
    r = cli(meta_url, "connector", "apply", "-f", str(spec))
    assert r.exit_code == 0 and "orders applied (Idle, desired running)" in r.output
    # The spec is copied into the connectors directory (where the code location reads it);
    # the store keeps it with the password masked.
    copied = tmp_path / "connectors" / "orders.yaml"
    assert "secret" in copied.read_text()
    row = MetaStore(meta_url).get("orders")
    assert row.spec_source == str(copied) and "secret" not in (row.spec_json or "")

    r = cli(meta_url, "connector", "list", "--json")
    [row] = json.loads(r.output)
    assert row["name"] == "orders" and row["status"] == "Idle"
    r = cli(meta_url, "connector", "list")
    assert r.exit_code == 0 and "orders" in r.output and "Idle" in r.output

    r = cli(meta_url, "connector", "show", "orders")
    assert r.exit_code == 0 and "status: Idle" in r.output
    assert "secret" not in r.output  # the URL is a SecretStr (literal: masked whole)

    r = cli(meta_url, "connector", "stop", "orders")
    assert r.exit_code == 0
    assert MetaStore(meta_url).get("orders").status == ConnectorStatus.STOPPED
    r = cli(meta_url, "connector", "start", "orders")
    assert r.exit_code == 0 and MetaStore(meta_url).get("orders").status == ConnectorStatus.IDLE
    r = cli(meta_url, "connector", "restart", "orders")
    # The stop fenced generation 0 (it had no live run), the restart generation 1.
    assert r.exit_code == 0 and MetaStore(meta_url).get("orders").generation == 2

    r = cli(meta_url, "connector", "history", "orders")
    assert (
        r.exit_code == 0
        and "stopped from the CLI" in r.output
        and "started from the CLI" in r.output
    )

    r = cli(meta_url, "connector", "pause", "orders")
    assert r.exit_code == 0 and MetaStore(meta_url).get("orders").desired.value == "paused"
    r = cli(meta_url, "connector", "resume", "orders")
    assert r.exit_code == 0 and MetaStore(meta_url).get("orders").desired.value == "running"

    r = cli(meta_url, "connector", "delete", "orders", "--yes")
    assert r.exit_code == 0
    assert MetaStore(meta_url).list() == []
    assert not copied.exists()  # deleted with its file: no re-creation on the next scan


def test_bad_spec_and_unknown_connector_exit_non_zero_with_a_message(meta_url, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nsource: {topics: [t]}\nsink: {type: postgress}\n")
    r = cli(meta_url, "connector", "apply", "-f", str(bad))
    assert r.exit_code == 1 and "did you mean 'postgres'?" in r.output
    r = cli(meta_url, "connector", "show", "nope")
    assert r.exit_code == 1 and "connector 'nope' not found" in r.output
    assert "Traceback" not in r.output


def test_offsets_show_and_reset_refused_while_running(meta_url, tmp_path):
    spec = tmp_path / "orders.yaml"
    spec.write_text(SPEC)
    cli(meta_url, "connector", "apply", "-f", str(spec))
    store = MetaStore(meta_url)
    g = store.claim(
        "orders", run_id="r1", expected_generation=None, holder_alive=lambda r: False
    ).generation
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


@pytest.mark.parametrize(
    ("to", "message"),
    [
        ("orders:0:-5", "'orders:0:-5': offset: -5 is out of range: an offset (int64) is from 0"),
        ("orders:-1:3", "'orders:-1:3': partition: -1 is out of range: a partition number"),
        ("clicks:0:3", "'clicks:0:3': topic: the connector does not read topic 'clicks'"),
        (f"orders:0:{2**70}", f"'orders:0:{2**70}': offset: {2**70} is out of range"),
        (f"orders:{2**31}:1", f"'orders:{2**31}:1': partition: {2**31} is out of range"),
        ("orders:0:1,orders:0:2", "'orders:0:2': partition orders[0] is given twice"),
        ("orders:0", "'orders:0' is not TOPIC:PARTITION:OFFSET"),
    ],
)
def test_offsets_reset_to_takes_only_what_the_rest_api_takes(meta_url, tmp_path, to, message):
    """``--to`` passes the validator PATCH uses (core.positions): a usage error naming the item
    and the rule, nothing stored; never an OverflowError from the store."""
    spec = tmp_path / "orders.yaml"
    spec.write_text(SPEC)
    cli(meta_url, "connector", "apply", "-f", str(spec))
    assert cli(meta_url, "connector", "stop", "orders").exit_code == 0
    store = MetaStore(meta_url)
    assert cli(meta_url, "offsets", "reset", "orders", "--to", "orders:0:7").exit_code == 0
    r = cli(meta_url, "offsets", "reset", "orders", "--to", to)
    assert r.exit_code == 2, r.output
    assert "Usage:" in r.output
    assert f"Error: Invalid value for '--to': {message}" in " ".join(r.output.split())
    assert "Traceback" not in r.output
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


# -- dead-letters replay (through a real Spark Connect server) ---------------------------

DL_SPEC = """
name: orders_dl
source: {{topics: [orders]}}
sink: {{type: localfile, path: {out}, rotation: none}}
failure: {{policy: dead_letter, dead_letter: {{path: {dl}}}}}
"""


def write_letters(directory, spark_remote: str, payloads: list[bytes]) -> None:
    import time

    from conveyor.core.engine.failure import FailedMessage
    from conveyor.core.engine.loop import DeadLetter
    from conveyor.spark.deadletters import SparkParquetDeadLetters
    from conveyor.spark.session import spark_session

    now = time.time()
    letters = [
        DeadLetter(
            FailedMessage("orders", 0, i, "sink rejected it", "data", 2),
            None,
            p,
            [],
            1_700_000_000_000 + i,
            now,
            now,
        )
        for i, p in enumerate(payloads)
    ]
    SparkParquetDeadLetters(
        directory, lambda: spark_session(spark_remote), connector="orders_dl"
    ).write(letters)


@pytest.fixture
def dl_connector(meta_url, tmp_path, file_root, spark_remote, monkeypatch):
    monkeypatch.setenv("CONVEYOR_SPARK_REMOTE", spark_remote)  # file_root: out/ and dl/ in it
    spec = tmp_path / "orders_dl.yaml"
    spec.write_text(DL_SPEC.format(out=tmp_path / "out", dl=tmp_path / "dl"))
    r = cli(meta_url, "connector", "apply", "-f", str(spec))
    assert r.exit_code == 0, r.output
    return tmp_path


def delivered(tmp_path) -> list[dict]:
    return [
        json.loads(line)
        for f in sorted((tmp_path / "out").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]


def test_dead_letters_replay_shows_progress_and_delivers(meta_url, dl_connector, spark_remote):
    tmp_path = dl_connector
    write_letters(tmp_path / "dl", spark_remote, [json.dumps({"id": i}).encode() for i in range(5)])
    r = cli(meta_url, "dead-letters", "list")
    assert r.exit_code == 0 and "orders_dl" in r.output and "5" in r.output

    r = cli(meta_url, "dead-letters", "replay", "orders_dl", "--batch-size", "2")
    assert r.exit_code == 0, r.output
    assert "replaying orders_dl" in r.stderr and "100%" in r.stderr  # the progress bar, on stderr
    assert r.stdout.strip() == "orders_dl: 5 replayed: 5 delivered, 0 failed again, 0 pending"
    assert sorted(row["id"] for row in delivered(tmp_path)) == [0, 1, 2, 3, 4]
    assert any(
        "dead letters replayed from the CLI: 5 delivered" in h.reason
        for h in MetaStore(meta_url).history("orders_dl")
    )

    # Nothing left: a second replay is a no-op that still exits 0.
    r = cli(meta_url, "dead-letters", "replay", "orders_dl")
    assert r.exit_code == 0 and "0 replayed" in r.stdout


def test_dead_letters_replay_exits_non_zero_when_letters_fail_again(
    meta_url, dl_connector, spark_remote
):
    tmp_path = dl_connector
    write_letters(tmp_path / "dl", spark_remote, [b'{"id": 1}', b"<xml/>", b'{"id": 3}'])
    r = cli(meta_url, "dead-letters", "replay", "orders_dl")
    assert r.exit_code == 2, r.output
    assert r.stdout.strip() == "orders_dl: 3 replayed: 2 delivered, 1 failed again, 1 pending"
    assert sorted(row["id"] for row in delivered(tmp_path)) == [1, 3]
    r = cli(meta_url, "dead-letters", "show", "orders_dl")
    assert r.exit_code == 0 and "orders[0]@1" in r.output and "JSON" in r.output


def test_dead_letters_replay_of_unknown_connector_fails(meta_url):
    r = cli(meta_url, "dead-letters", "replay", "nope")
    assert r.exit_code == 1 and "connector 'nope' not found" in r.output


def test_offsets_reset_to_the_end_or_from_another_consumer_group(tmp_path, tansu):
    """``--to latest`` and ``--from-group`` read the cluster through the connector's source
    connection; a Kafka Connect group's commits are taken over as they are."""
    from confluent_kafka import Consumer
    from confluent_kafka import TopicPartition as CTP

    from tests.sources.producers import Msg, create_topic, produce

    meta_url = f"sqlite:///{tmp_path / 'meta.db'}"
    topic = f"reset_{uuid.uuid4().hex[:8]}"
    create_topic(tansu, topic, 2)
    produce(tansu, topic, [Msg(b"%d" % i, partition=i % 2) for i in range(10)], one_per_batch=True)
    spec = tmp_path / "orders.yaml"
    spec.write_text(
        f"name: orders\nsource: {{topics: [{topic}], bootstrap_servers: '{tansu}'}}\n"
        "sink: {type: localfile, path: unused}\ndesired: stopped\n"
    )
    assert cli(meta_url, "connector", "apply", "-f", str(spec)).exit_code == 0
    cli(meta_url, "connector", "stop", "orders")
    r = cli(meta_url, "offsets", "reset", "orders")
    assert (
        r.exit_code == 1 and "give exactly one of --to, --to-datetime and --from-group" in r.output
    )
    r = cli(meta_url, "offsets", "reset", "orders", "--to-datetime", "yesterday")
    assert r.exit_code == 1 and "is not an ISO 8601 time" in r.output
    r = cli(meta_url, "offsets", "reset", "orders", "--to", "latest")
    assert r.exit_code == 0, r.output
    store = MetaStore(meta_url)
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    assert store.committed_offsets("orders") == {tp0: 5, tp1: 5}
    other = Consumer(
        {"bootstrap.servers": tansu, "group.id": "connect-orders", "log.connection.close": False}
    )
    other.commit(offsets=[CTP(topic, 0, 2), CTP(topic, 1, 3)], asynchronous=False)
    other.close()
    r = cli(meta_url, "offsets", "reset", "orders", "--from-group", "connect-orders")
    assert r.exit_code == 0, r.output
    assert store.committed_offsets("orders") == {tp0: 2, tp1: 3}
    r = cli(meta_url, "offsets", "reset", "orders", "--from-group", "nobody")
    assert r.exit_code == 1 and "has no committed offsets" in r.output


def test_list_shows_a_rate_only_for_a_moving_connector(meta_url, tmp_path):
    """A connector in Error showed its last rate (5703 msgs/s) as if it were still moving."""
    spec = tmp_path / "orders.yaml"
    spec.write_text(SPEC)
    cli(meta_url, "connector", "apply", "-f", str(spec))
    store = MetaStore(meta_url)
    g = store.claim(
        "orders", run_id="r1", expected_generation=None, holder_alive=lambda r: False
    ).generation
    store.heartbeat("orders", g, {"msgs_per_s": 5703.0})
    assert "5703" in cli(meta_url, "connector", "list").output
    store.release("orders", g, ConnectorStatus.ERROR, "target refused")
    listed = cli(meta_url, "connector", "list").output
    assert "Error" in listed and "5703" not in listed
