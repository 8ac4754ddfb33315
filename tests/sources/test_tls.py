"""TLS for real: socat terminates TLS in front of tansu with certificates the test makes.

Every Kafka client Conveyor opens uses the one connection model: the source, the offsets
mirror, the Kafka sink, the Kafka dead-letter writer and ``offsets reset``'s group
takeover; the test producer is librdkafka configured from the same model
(``librdkafka_config``). Right CA: messages flow. Wrong CA or a host name the
certificate does not hold: a permanent error naming the certificate problem, at once.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.brokers.connection import librdkafka_config
from conveyor.brokers.kafka import KafkaSource
from conveyor.core.connection import KafkaConnection
from conveyor.core.engine.failure import FailedMessage
from conveyor.core.engine.loop import DeadLetter
from conveyor.core.errors import PermanentSinkError, PermanentSourceError
from conveyor.core.model import SourceSpec, TopicPartition
from conveyor.sinks import build_sink
from conveyor.spark.deadletters import KafkaDeadLetters
from tests.sinks.contract import make_batch
from tests.sources.contract import read_until, rows
from tests.sources.producers import Msg, create_topic, produce
from tests.sources.tls import TlsBroker, socat_available, tls_tansu

# The certificates are made under the system's temporary directory: a root of spec paths here.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("temp_root")]


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsBroker]:
    if not socat_available():
        pytest.skip("needs Debian's socat and openssl (.ci/run installs socat)")
    with tls_tansu(tmp_path_factory.mktemp("tls")) as broker:
        yield broker


def tls(broker: TlsBroker, **kw: object) -> dict[str, object]:
    return {
        "bootstrap_servers": broker.bootstrap,
        "security_protocol": "SSL",
        "ssl_cafile": str(broker.certs.ca),
        **kw,
    }


def test_right_ca_messages_flow_through_every_client(tls_broker: TlsBroker, tmp_path: Path):
    t = f"tls_{uuid.uuid4().hex[:8]}"
    spec = SourceSpec(topics=[t], **tls(tls_broker))  # type: ignore[arg-type]
    conf = librdkafka_config(spec, prefix="source")
    create_topic(
        tls_broker.bootstrap, t, 1, **{k: v for k, v in conf.items() if k != "bootstrap.servers"}
    )
    produce(
        tls_broker.bootstrap,
        t,
        [Msg(b'{"id": %d}' % i, key=b"k%d" % i) for i in range(20)],
        **{k: v for k, v in conf.items() if k != "bootstrap.servers"},
    )
    # the Kafka sink, through TLS, appends 5 more on each client
    for client in ("confluent", "kafka-python"):
        sink = build_sink({"type": "kafka", "client": client, "topic": t, **tls(tls_broker)})
        sink.init_sink()
        try:
            assert sink.send_batch(make_batch(5)).failed == ()
        finally:
            sink.cleanup_sink()
    # the dead-letter writer, through TLS, to <connector>.dlq
    dlq = f"{t}.dlq"
    create_topic(
        tls_broker.bootstrap, dlq, 1, **{k: v for k, v in conf.items() if k != "bootstrap.servers"}
    )
    letters = KafkaDeadLetters(
        KafkaConnection(**tls(tls_broker)), dlq, connector=t, compression="zstd"
    )  # type: ignore[arg-type]
    letters.write(
        [
            DeadLetter(
                failed=FailedMessage(t, 0, 3, "bad", "data"),
                key=b"k3",
                value=b"{}",
                headers=[],
                timestamp_ms=None,
                first_failure_at=1.0,
                last_failure_at=2.0,
            )
        ]
    )
    letters.close()
    source = KafkaSource(spec, group_id=f"g_{t}")
    source.open({})
    try:
        got = rows(read_until(source, 30))
        assert [r["__offset"] for r in got] == list(range(30))
        assert got[0]["__key"] == b"k0" and got[24]["__key"] == b"k4" and got[29]["__key"] == b"k4"
        # the offsets mirror commits through TLS; the takeover path reads it back
        source.mirror_commit({TopicPartition(t, 0): 30}, force=True)
        assert source.group_offsets(f"g_{t}") == {TopicPartition(t, 0): 30}
    finally:
        source.close()
    dl_source = KafkaSource(SourceSpec(topics=[dlq], **tls(tls_broker)), group_id="g_dlq")  # type: ignore[arg-type]
    dl_source.open({})
    try:
        (letter,) = rows(read_until(dl_source, 1))
        assert letter["__key"] == b"k3"
        assert {"key": "conveyor.error", "value": b"bad"} in letter["__headers"]
    finally:
        dl_source.close()


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("wrong_ca", "unable to get local issuer certificate"),
        ("wrong_host", "Hostname mismatch, certificate is not valid for 'localhost'"),
    ],
)
def test_wrong_ca_or_host_is_a_permanent_error_naming_the_certificate_problem(
    tls_broker: TlsBroker, override: str, problem: str
):
    kw = tls(tls_broker)
    if override == "wrong_ca":
        kw["ssl_cafile"] = str(tls_broker.certs.other_ca)
    else:
        kw["bootstrap_servers"] = f"localhost:{tls_broker.port}"
    source = KafkaSource(SourceSpec(topics=["any"], **kw), group_id="g")  # type: ignore[arg-type]
    try:
        with pytest.raises(PermanentSourceError, match="TLS certificate of .* rejected: ") as err:
            source.open({})
        assert problem in str(err.value) and "\n" not in str(err.value)
    finally:
        source.close()
    for client in ("confluent", "kafka-python"):
        sink = build_sink({"type": "kafka", "client": client, "topic": "any", **kw})
        try:
            with pytest.raises(PermanentSinkError, match=problem):
                sink.init_sink()
        finally:
            sink.cleanup_sink()
    letters = KafkaDeadLetters(KafkaConnection(**kw), "any.dlq", connector="c")  # type: ignore[arg-type]
    with pytest.raises(PermanentSinkError, match=problem):
        letters.write(
            [
                DeadLetter(
                    failed=FailedMessage("any", 0, 0, "bad", "data"),
                    key=None,
                    value=None,
                    headers=[],
                    timestamp_ms=None,
                    first_failure_at=1.0,
                    last_failure_at=1.0,
                )
            ]
        )
