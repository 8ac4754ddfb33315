"""The source contract for the librdkafka client (``source.client: confluent``), against
tansu; and TLS for real (socat in front of tansu, as in test_tls.py): right CA, messages
flow; wrong CA or host name, a permanent error naming the certificate problem."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conveyor.brokers.confluent import ConfluentSource
from conveyor.brokers.connection import librdkafka_config
from conveyor.brokers.kafka import KafkaSource
from conveyor.core.errors import ConfigError, PermanentSourceError, TransientSourceError
from conveyor.core.model import BatchPolicy, SourceSpec, TopicPartition
from tests.sources.contract import SourceContract, read_until, rows
from tests.sources.producers import Msg, create_topic, produce
from tests.sources.tls import TlsBroker, socat_available, tls_tansu

pytestmark = pytest.mark.integration


class TestConfluentSource(SourceContract):
    client = "confluent"

    def make_source(self, spec: SourceSpec, group_id: str) -> Any:
        source = KafkaSource(spec.model_copy(update={"client": "confluent"}), group_id=group_id)
        assert isinstance(source, ConfluentSource)  # KafkaSource builds the spec's client
        return source


class _FailingSecondConsume:
    """The consumer, with its second ``consume`` failing like a connection lost mid-fetch."""

    def __init__(self, consumer: Any):
        self.consumer = consumer
        self.calls = 0

    def consume(self, *a: Any) -> Any:
        self.calls += 1
        if self.calls == 2:
            from confluent_kafka import KafkaError, KafkaException

            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "injected"))
        return self.consumer.consume(*a)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.consumer, name)


def test_a_read_that_fails_midway_rewinds_so_no_record_is_skipped(tansu: str) -> None:
    t = f"src_{uuid.uuid4().hex[:10]}"
    create_topic(tansu, t, 1)
    produce(tansu, t, [Msg(b"%d" % i) for i in range(300)])
    source = KafkaSource(
        SourceSpec(topics=[t], bootstrap_servers=tansu, client="confluent"), group_id="t"
    )
    source.open({})
    real = source._consumer
    source._consumer = _FailingSecondConsume(real)
    try:
        with pytest.raises(TransientSourceError, match="injected"):
            # 1,000 records asked for, 300 there: the first consume returns some, the
            # second fails; the consumer's position has moved past the first ones.
            source.read(BatchPolicy(max_records=1_000, max_wait_ms=2_000))
        source._consumer = real
        offsets: list[int] = []
        while len(offsets) < 300:
            batch = source.read(BatchPolicy(max_records=300, max_wait_ms=2_000))
            assert batch is not None, f"only {len(offsets)} of 300 read back"
            offsets += batch.table.column("__offset").to_pylist()
        assert offsets == list(range(300))  # from offset 0 again: nothing skipped
    finally:
        source._consumer = real
        source.close()


def test_client_options_take_librdkafka_names(tansu: str) -> None:
    t = f"src_{uuid.uuid4().hex[:10]}"
    create_topic(tansu, t, 1)
    produce(tansu, t, [Msg(b"%d" % i) for i in range(5)])
    spec = SourceSpec(
        topics=[t],
        bootstrap_servers=tansu,
        client="confluent",
        client_options={"fetch.min.bytes": 1, "check.crcs": True},
    )
    s = KafkaSource(spec, group_id="g_opts")
    s.open({})
    try:
        assert [r["__value"] for r in rows(read_until(s, 5))] == [b"%d" % i for i in range(5)]
    finally:
        s.close()
    for options, problem in (
        ({"group.id": "x"}, "set by Conveyor"),
        ({"fetch_min_bytes": 1}, "dotted names"),
    ):
        bad = KafkaSource(spec.model_copy(update={"client_options": options}), group_id="g")
        with pytest.raises(ConfigError, match=problem):
            bad.open({})
    unknown = KafkaSource(
        spec.model_copy(update={"client_options": {"no.such.property": 1}}), group_id="g"
    )
    with pytest.raises(PermanentSourceError, match="No such configuration property"):
        unknown.open({})


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsBroker]:
    """socat's TLS in front of tansu; its certificates under the system's temporary
    directory, which the tests using it declare a root of spec paths (``temp_root``)."""
    if not socat_available():
        pytest.skip("needs Debian's socat and openssl (.ci/run installs socat)")
    with tls_tansu(tmp_path_factory.mktemp("tls")) as broker:
        yield broker


def _tls(broker: TlsBroker, **kw: object) -> dict[str, object]:
    return {
        "bootstrap_servers": broker.bootstrap,
        "security_protocol": "SSL",
        "ssl_cafile": str(broker.certs.ca),
        "client": "confluent",
        **kw,
    }


def test_tls_right_ca_messages_flow_and_offsets_mirror(
    tls_broker: TlsBroker, temp_root: Path
) -> None:
    t = f"tls_{uuid.uuid4().hex[:8]}"
    spec = SourceSpec(topics=[t], **_tls(tls_broker))  # type: ignore[arg-type]
    conf = {
        k: v
        for k, v in librdkafka_config(spec, prefix="source").items()
        if k != "bootstrap.servers"
    }
    create_topic(tls_broker.bootstrap, t, 1, **conf)
    produce(
        tls_broker.bootstrap, t, [Msg(b'{"id": %d}' % i, key=b"k%d" % i) for i in range(20)], **conf
    )
    source = KafkaSource(spec, group_id=f"g_{t}")
    source.open({})
    try:
        got = rows(read_until(source, 20))
        assert [r["__offset"] for r in got] == list(range(20))
        assert got[0]["__key"] == b"k0" and got[19]["__key"] == b"k19"
        source.mirror_commit({TopicPartition(t, 0): 20}, force=True)
        assert source.group_offsets(f"g_{t}") == {TopicPartition(t, 0): 20}
    finally:
        source.close()


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("wrong_ca", "unable to get local issuer certificate"),
        ("wrong_host", "Hostname mismatch, certificate is not valid for 'localhost'"),
    ],
)
def test_tls_wrong_ca_or_host_is_a_permanent_error_naming_the_problem(
    tls_broker: TlsBroker, temp_root: Path, override: str, problem: str
) -> None:
    kw = _tls(tls_broker)
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
