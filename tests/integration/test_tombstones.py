"""Tombstones and empty payloads on real servers.

Through the real loop (tansu -> Spark Connect -> PostgreSQL), a keyed topic written by
librdkafka holds upserts, a tombstone (null value), an empty value and a tombstone
followed by a re-insert, under each ``transform.null_values`` mode; with ``pass`` and
``delete_enabled`` the tombstones delete their rows. The MySQL and Redis delete modes
are checked at the sink against the machine's servers.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg2
import pyarrow as pa
import pytest

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.engine.loop import ConnectorLoop, DataPolicyError, LoopConfig, run_loop
from conveyor.core.model import ConnectorSpec, Counters
from conveyor.dagster.jobs.committer import StoreCommitter
from conveyor.sinks import build_sink
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer
from conveyor.store.meta import MetaStore
from tests.sinks.contract import make_batch
from tests.sources.producers import Msg, create_topic, produce

pytestmark = pytest.mark.integration


def messages() -> list[Msg]:
    def key(i: int) -> bytes:
        return json.dumps({"id": i}).encode()

    def order(i: int, name: str) -> bytes:
        return json.dumps({"id": i, "name": name, "amount": i * 1.5}).encode()

    msgs = [Msg(order(i, f"n{i}"), key(i)) for i in range(1, 7)]
    msgs.append(Msg(None, key(2)))  # a tombstone (Debezium-style JSON key)
    msgs.append(Msg(b"", b"3"))  # an empty value with a plain key
    msgs.append(Msg(None, key(4)))  # a tombstone ...
    msgs.append(Msg(order(4, "again"), key(4)))  # ... then the key written again
    return msgs


N = len(messages())


def table_rows(pg_url: str, schema: str) -> dict[int, str]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(f'SELECT id, name FROM "{schema}".orders ORDER BY id')
        return dict(cur.fetchall())


@pytest.fixture
def orders(pg_url: str, pg_schema: str) -> str:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{pg_schema}".orders (id BIGINT PRIMARY KEY, name TEXT NOT NULL, '
            "amount DOUBLE PRECISION)"
        )
    return pg_schema


def run(
    tmp_path: Path,
    tansu: str,
    spark_remote: str,
    pg_url: str,
    schema: str,
    topic: str,
    *,
    transform: dict[str, Any],
    sink: dict[str, Any] | None = None,
    failure: dict[str, Any] | None = None,
) -> Counters | Exception:
    name = f"tb_{uuid.uuid4().hex[:6]}"
    spec = ConnectorSpec.model_validate(
        {
            "name": name,
            "source": {"topics": [topic], "bootstrap_servers": tansu},
            "batch": {"max_records": 100, "max_wait_ms": 300},
            "transform": {
                "decode": "json",
                "schema": "id BIGINT, name STRING, amount DOUBLE",
                **transform,
            },
            "sink": {
                "type": "postgres",
                "url": pg_url,
                "schema": schema,
                "table": "orders",
                "upsert_keys": ["id"],
                **(sink or {}),
            },
            "failure": failure or {"policy": "fail"},
        }
    )
    store = MetaStore(f"sqlite:///{tmp_path / f'{name}.db'}")
    store.sync_spec(name, spec_json=spec.model_dump_json(), spec_hash="x", source="t", error=None)
    claim = store.claim(name, run_id="t", expected_generation=None, holder_alive=lambda r: False)
    spark = spark_session(spark_remote)
    source = KafkaSource(spec.source, group_id=name)
    loop = ConnectorLoop(
        LoopConfig(name=name, batch=spec.batch, retry=spec.retry, failure=spec.failure),
        source=source,
        transform=SparkTransformer(spec.transform, lambda: spark),
        sink=build_sink(spec.sink.model_dump()),
        committer=StoreCommitter(store, name, claim.generation, source),
        committed={},
        stop_requested=lambda: sum(loop.committed.values()) >= N,
    )
    try:
        return run_loop(loop)
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return e


@pytest.fixture
def keyed_topic(tansu: str, topic_name: str) -> str:
    create_topic(tansu, topic_name, 1)
    produce(tansu, topic_name, messages())
    return topic_name


EXPECTED = {1: "n1", 2: "n2", 3: "n3", 4: "again", 5: "n5", 6: "n6"}


def test_skip_by_default_tombstones_and_empty_payloads_are_filtered(
    tmp_path, tansu, spark_remote, pg_url, orders, keyed_topic
):
    result = run(tmp_path, tansu, spark_remote, pg_url, orders, keyed_topic, transform={})
    assert isinstance(result, Counters), result
    assert table_rows(pg_url, orders) == EXPECTED
    assert result.filtered == 3 and result.failed == 0 and result.messages_in == N


def test_fail_makes_them_failed_messages_for_the_failure_policy(
    tmp_path, tansu, spark_remote, pg_url, orders, keyed_topic
):
    result = run(
        tmp_path,
        tansu,
        spark_remote,
        pg_url,
        orders,
        keyed_topic,
        transform={"null_values": "fail"},
        failure={"policy": "discard"},
    )
    assert isinstance(result, Counters), result
    assert table_rows(pg_url, orders) == EXPECTED
    assert result.failed == 3 and result.discarded == 3 and result.filtered == 0
    stopped = run(
        tmp_path,
        tansu,
        spark_remote,
        pg_url,
        orders,
        keyed_topic,
        transform={"null_values": "fail"},
    )
    assert isinstance(stopped, DataPolicyError)
    assert "null payload (a tombstone); transform.null_values is 'fail'" in str(stopped)


def test_pass_with_delete_enabled_deletes_by_key_in_order(
    tmp_path, tansu, spark_remote, pg_url, orders, keyed_topic
):
    result = run(
        tmp_path,
        tansu,
        spark_remote,
        pg_url,
        orders,
        keyed_topic,
        transform={"null_values": "pass"},
        sink={"delete_enabled": True},
    )
    assert isinstance(result, Counters), result
    # 2: deleted by its JSON key; 3: deleted by its plain key "3"; 4: deleted, then written again
    assert table_rows(pg_url, orders) == {1: "n1", 4: "again", 5: "n5", 6: "n6"}
    assert result.failed == 0 and result.filtered == 0 and result.messages_out == N


def test_pass_without_delete_mode_writes_null_payload_rows(
    tmp_path, tansu, spark_remote, pg_url, orders, keyed_topic
):
    # The sink gets the tombstones as rows without payload: here name is NOT NULL, so
    # they are data errors, handled by the failure policy; nothing is deleted.
    result = run(
        tmp_path,
        tansu,
        spark_remote,
        pg_url,
        orders,
        keyed_topic,
        transform={"null_values": "pass"},
        failure={"policy": "discard"},
    )
    assert isinstance(result, Counters), result
    assert table_rows(pg_url, orders) == EXPECTED
    assert result.discarded == 3


# -- MySQL and Redis delete modes at the sink ------------------------------------------------


def tombstone_batch(ids_to_delete: list[int], *, keys: list[bytes]) -> pa.Table:
    """Rows as the transform passes tombstones: payload columns null, __tombstone true."""
    batch = make_batch(len(ids_to_delete))
    n = batch.num_rows
    out = batch.set_column(0, "id", pa.nulls(n, pa.int64()))
    out = out.set_column(1, "name", pa.nulls(n, pa.string()))
    out = out.set_column(2, "amount", pa.nulls(n, pa.float64()))
    out = out.set_column(out.schema.get_field_index("__key"), "__key", pa.array(keys, pa.binary()))
    return out.append_column("__tombstone", pa.array([True] * n, pa.bool_()))


def test_mysql_delete_mode_deletes_with_upsert_keys():
    import pymysql

    table = f"tomb_{uuid.uuid4().hex[:8]}"
    conn = pymysql.connect(host="127.0.0.1", user="root", database="test", autocommit=True)
    cfg = {
        "type": "mysql",
        "host": "127.0.0.1",
        "database": "test",
        "table": table,
        "upsert_keys": ["id"],
        "create_table": True,
        "delete_enabled": True,
        "columns": {"id": "id", "name": "name"},
    }
    sink = build_sink(cfg)
    sink.init_sink()
    try:
        assert sink.send_batch(make_batch(5)).failed == ()
        deletes = tombstone_batch([1, 3, 9], keys=[b'{"id": 1}', b"3", b"not-a-number"])
        result = sink.send_batch(deletes)
        # MariaDB would compare "not-a-number" with the BIGINT key as 0 and delete row 0:
        # the sink makes it a data error for that tombstone instead.
        assert [f.index for f in result.failed] == [2]
        assert "'not-a-number' is not a number for bigint column id" in result.failed[0].message
        again = sink.send_batch(make_batch(1, start=3))  # a deleted key written again
        assert again.failed == ()
        with conn.cursor() as cur:
            cur.execute(f"SELECT id FROM `{table}` ORDER BY id")
            assert [r[0] for r in cur.fetchall()] == [0, 2, 3, 4]
        missing = sink.send_batch(tombstone_batch([0], keys=[None]))
        assert [f.index for f in missing.failed] == [0]
        assert "tombstone without a value for key column(s) id" in missing.failed[0].message
    finally:
        sink.cleanup_sink()
        with conn.cursor() as cur:
            cur.execute(f"DROP TABLE IF EXISTS `{table}`")
        conn.close()


@pytest.mark.parametrize("fail_fast", [False, True], ids=["pipelines", "script"])
def test_redis_delete_mode_runs_del_on_each_templates_key(fail_fast: bool):
    import redis

    prefix = f"tomb:{uuid.uuid4().hex[:8]}"
    r = redis.Redis(host="127.0.0.1", port=6379)
    cfg = {
        "type": "redis",
        "commands": [
            f"SET {prefix}:${{key}} ${{payload.name}}",
            f"HSET {prefix}:h:${{key}} n ${{payload.name}}",
        ],
        "delete_enabled": True,
    }
    sink = build_sink(cfg)
    sink.init_sink()
    sink.fail_fast = fail_fast  # the fail policy: each chunk in one script
    try:
        assert sink.send_batch(make_batch(4)).failed == ()
        assert r.get(f"{prefix}:k1") == b"name 1"
        result = sink.send_batch(tombstone_batch([1, 2], keys=[b"k1", b"k2"]))
        assert result.failed == ()
        assert sorted(r.scan_iter(f"{prefix}:*")) == sorted(
            [f"{prefix}:{k}".encode() for k in ("k0", "k3", "h:k0", "h:k3")]
        )
        mixed = make_batch(2, start=5).append_column("__tombstone", pa.array([False, False]))
        mixed = pa.concat_tables([mixed, tombstone_batch([0], keys=[b"k0"])])
        assert sink.send_batch(mixed).failed == ()
        assert r.get(f"{prefix}:k5") == b"name 5" and r.get(f"{prefix}:k0") is None
    finally:
        sink.cleanup_sink()
        for k in r.scan_iter(f"{prefix}:*"):
            r.delete(k)
        r.close()
