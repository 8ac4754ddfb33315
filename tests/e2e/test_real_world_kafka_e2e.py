"""Real-world Kafka through Dagster: what librdkafka producers send, over TLS, into PostgreSQL.

A TLS terminator (socat) fronts a tansu broker; confluent-kafka (librdkafka) produces over
TLS, configured from the connector's own connection model, with each of gzip, snappy, lz4
and zstd from an idempotent producer, headers, null keys, a record near 1 MB and
tombstones. A connector with default settings (but the TLS connection) runs under a real
Dagster instance: every id arrives in the table, the tombstones are skipped and counted as
filtered. The same connector with a CA that did not sign the broker's certificate ends in
Error at once, its message naming the certificate problem.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import psycopg2
import pytest

from conveyor.brokers.connection import librdkafka_config
from conveyor.core.model import ConnectorStatus, SourceSpec
from tests.e2e.conftest import SETTLE_S, STOP_S, DagsterHarness, wait_for
from tests.e2e.test_errors_e2e import run_to_error
from tests.sources.producers import CODECS, Msg, create_topic, produce
from tests.sources.tls import TlsBroker, socat_available, tls_tansu

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PER_CODEC = 250
BIG_ID = len(CODECS) * PER_CODEC  # the record near 1 MB
TOMBSTONES = 5


@pytest.fixture(scope="module")
def tls_broker(dagster: DagsterHarness) -> Iterator[TlsBroker]:
    if not socat_available():
        pytest.skip("needs Debian's socat and openssl (.ci/run installs socat)")
    # The certificates live under the harness's $CONVEYOR_HOME: a spec may name files under
    # its roots only (core/trust/paths.py), as an operator's would.
    directory = dagster.home / f"tls_e2e_{uuid.uuid4().hex[:6]}"
    directory.mkdir()
    with tls_tansu(directory) as broker:
        yield broker


def source(broker: TlsBroker, topic: str, ca: str) -> dict:
    return {
        "topics": [topic],
        "bootstrap_servers": broker.bootstrap,
        "security_protocol": "SSL",
        "ssl_cafile": ca,
    }


def spec(name: str, src: dict, pg_url: str, schema: str) -> dict:
    return {
        "name": name,
        "source": src,
        "transform": {"decode": "json", "schema": "id BIGINT, name STRING, codec STRING"},
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": schema,
            "table": "orders",
            "create_table": True,
        },
    }


def ids(pg_url: str, schema: str) -> list[int]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{schema}".orders',))
        if cur.fetchone()[0] is None:
            return []
        cur.execute(f'SELECT id FROM "{schema}".orders ORDER BY id')
        return [r[0] for r in cur.fetchall()]


def test_librdkafka_messages_of_every_codec_over_tls_all_arrive(
    dagster: DagsterHarness, tls_broker: TlsBroker, pg_url, pg_schema, monkeypatch
):
    topic = f"rw_{uuid.uuid4().hex[:8]}"
    src = source(tls_broker, topic, str(tls_broker.certs.ca))
    # The producer's settings come from the model the connector validates, under its home.
    monkeypatch.setenv("CONVEYOR_HOME", str(dagster.home))
    conf = librdkafka_config(SourceSpec.model_validate(src), prefix="source")
    conf.pop("bootstrap.servers")
    create_topic(tls_broker.bootstrap, topic, 2, **conf)
    for n, codec in enumerate(CODECS):
        msgs = [
            Msg(
                json.dumps({"id": i, "name": f"order {i} " + "x" * 40, "codec": codec}).encode(),
                key=None if i % 3 == 0 else str(i).encode(),
                headers=[("trace", f"t{i}".encode()), ("codec", codec.encode())],
            )
            for i in range(n * PER_CODEC, (n + 1) * PER_CODEC)
        ]
        if codec == "zstd":
            big = {"id": BIG_ID, "name": "y" * 1_000_000, "codec": codec}
            msgs.append(Msg(json.dumps(big).encode(), key=b"big"))
            msgs += [Msg(None, key=str(i).encode()) for i in range(TOMBSTONES)]
        produce(
            tls_broker.bootstrap,
            topic,
            msgs,
            **conf,
            **{
                "compression.type": codec,
                "enable.idempotence": True,
                "message.max.bytes": 2_000_000,
            },
        )
    name = f"rw_{uuid.uuid4().hex[:6]}"
    dagster.write_spec(spec(name, src, pg_url, pg_schema))
    dagster.reload()
    run_id = dagster.launch(name)
    try:
        wait_for(lambda: len(ids(pg_url, pg_schema)) >= BIG_ID + 1, 240, "every id")
        assert ids(pg_url, pg_schema) == list(range(BIG_ID + 1))
        with psycopg2.connect(pg_url) as c, c.cursor() as cur:
            cur.execute(f'SELECT length(name) FROM "{pg_schema}".orders WHERE id = %s', (BIG_ID,))
            assert cur.fetchone()[0] == 1_000_000
            cur.execute(f'SELECT codec, count(*) FROM "{pg_schema}".orders GROUP BY codec')
            per_codec = dict(cur.fetchall())
        assert per_codec == {"gzip": 250, "snappy": 250, "lz4": 250, "zstd": 251}
        total = BIG_ID + 1 + TOMBSTONES

        def caught_up() -> bool:
            row = dagster.store.get(name)
            c = row.counters or {}
            return (
                row.status == ConnectorStatus.RUNNING
                and c.get("messages_in") == total
                and c.get("lag") == 0
            )

        wait_for(caught_up, SETTLE_S, "the heartbeat reporting every message and lag 0")
        counters = dagster.store.get(name).counters or {}
        assert counters["filtered"] == TOMBSTONES and counters["failed"] == 0
        assert sum(dagster.store.committed_offsets(name).values()) == total
    finally:
        dagster.terminate(run_id)
        dagster.wait_status(run_id, {"CANCELED", "FAILURE", "SUCCESS"}, STOP_S)


def test_a_ca_that_did_not_sign_the_broker_is_an_error_naming_the_certificate(
    dagster: DagsterHarness, tls_broker: TlsBroker, pg_url, pg_schema
):
    topic = f"rw_{uuid.uuid4().hex[:8]}"
    name = f"rwca_{uuid.uuid4().hex[:6]}"
    src = source(tls_broker, topic, str(tls_broker.certs.other_ca))
    error, log = run_to_error(dagster, spec(name, src, pg_url, pg_schema))
    assert "TLS certificate of 127.0.0.1:" in error
    assert "unable to get local issuer certificate" in error
    assert "\n" not in error and error in log
    assert dagster.store.get(name).status == ConnectorStatus.ERROR
