"""Kafka sink: the contract suite and Kafka-specific behaviour against a real tansu broker."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from conveyor.brokers.embedded import EmbeddedBroker, start_embedded_broker
from conveyor.core.errors import PermanentSinkError, TransientSinkError
from conveyor.sinks import build_sink
from conveyor.sinks.base import ErrorKind
from tests.sinks.contract import BASE_TS, SinkContract, closed_port, make_batch, unique

pytestmark = pytest.mark.integration


def create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        admin.close()


def delete_topics(bootstrap: str, *topics: str) -> None:
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    try:
        admin.delete_topics(list(topics))
    except Exception:  # noqa: BLE001 - teardown is best effort (the broker is in memory anyway)
        pass
    finally:
        admin.close()


def consume_all(bootstrap: str, topic: str, timeout_s: float = 15.0) -> list[Any]:
    """Every record of every partition of ``topic``, read from the beginning up to the highwater.

    tansu's ``end_offsets`` is wrong (DESIGN.md section 7), so the end is the highwater the
    fetch responses report.
    """
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=50
    )
    try:
        parts = c.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for msgs in c.poll(timeout_ms=200).values():
                out.extend(msgs)
            hws = [c.highwater(tp) for tp in tps]
            if all(hw is not None for hw in hws) and all(
                c.position(tp) >= hw for tp, hw in zip(tps, hws, strict=True)
            ):
                return out
        raise AssertionError(
            f"could not read {topic} to its end within {timeout_s}s ({len(out)} records read)"
        )
    finally:
        c.close()


def as_row(rec: Any) -> dict[str, Any]:
    value = json.loads(rec.value)
    return {
        "id": value["id"],
        "name": value["name"],
        "key": rec.key,
        "headers": dict(rec.headers or []),
        "timestamp": dt.datetime.fromtimestamp(rec.timestamp / 1000, dt.timezone.utc),
        "partition": rec.partition,
        "topic": rec.topic,
    }


class TestKafkaContract(SinkContract):
    """The contract on kafka-python's producer (``sink.client: kafka-python``)."""

    sink_type = "kafka"
    client = "kafka-python"
    idempotent = False  # append-only log: a replay is written again (documented)
    # fail_fast stops at a record the producer refuses (above max_request_size, no topic)
    # and at one above the topic's max.message.bytes (checked before sending); another
    # broker-side refusal is known only after the batch was produced (see the sink's docs).
    keeps_keys = keeps_headers = keeps_timestamps = True
    bootstrap = "127.0.0.1:9092"

    @pytest.fixture(autouse=True)
    def _broker(self, tansu: str) -> None:
        type(self).bootstrap = tansu

    def make_target(self) -> Iterator[str]:
        topic = unique("ksink")
        create_topic(self.bootstrap, topic)
        yield topic
        delete_topics(self.bootstrap, topic)

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "kafka",
            "client": self.client,
            "bootstrap_servers": self.bootstrap,
            "topic": target,
            "max_request_size": 10_240,
            "linger_ms": 2,
            "request_timeout_ms": 5_000,
            "delivery_timeout_ms": 15_000,
            "max_block_ms": 10_000,
            "connect_timeout_ms": 10_000,
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        return [as_row(r) for r in consume_all(self.bootstrap, target)]

    def poison_batch(self, target: str) -> tuple[pa.Table, set[int]]:
        # Rows 250 and 400 exceed max_request_size (10 KiB): the producer refuses them.
        huge = "x" * 20_000
        return make_batch(500, names={250: huge, 400: huge + "y"}), {250, 400}

    def outage_config(self, target: str) -> dict[str, Any]:
        return {
            **self.config(target),
            "bootstrap_servers": f"127.0.0.1:{closed_port()}",
            "connect_timeout_ms": 1_000,
        }

    bad_fields = [
        ({"topic": "bad topic!"}, "topic"),
        ({"topic": "orders-${nope}"}, "topic"),
        ({"topic": ""}, "topic"),
        ({"key": "${payload.}"}, "key"),
        ({"bootstrap_servers": "localhost"}, "bootstrap_servers"),
        ({"compression": "brotli"}, "compression"),
        ({"acks": "1"}, "acks"),
        ({"acks": "0", "idempotent": False}, "acks"),
        ({"linger_ms": -1}, "linger_ms"),
        ({"delivery_timeout_ms": 1_000}, "delivery_timeout_ms"),
        ({"security_protocol": "SASL_SSL"}, "sasl_mechanism"),
        ({"sasl_username": "u"}, "sasl_username"),
        ({"ssl_cafile": "tls/ca.pem"}, "ssl_cafile"),
        ({"timestamp": "broker"}, "timestamp"),
        ({"client": "librdkafka"}, "client"),
    ]


class TestKafkaContractConfluent(TestKafkaContract):
    """The same contract on librdkafka's producer (``sink.client: confluent``): the poison
    rows are refused by ``produce()`` (MSG_SIZE_TOO_LARGE above message.max.bytes)."""

    client = "confluent"


# -- Kafka-specific behaviour ------------------------------------------------------------------


@pytest.fixture(params=["confluent", "kafka-python"])
def client(request: pytest.FixtureRequest) -> str:
    """Each Kafka-specific test runs on both producers."""
    return str(request.param)


@pytest.fixture
def kafka_topic(tansu: str) -> Iterator[str]:
    topic = unique("ks")
    create_topic(tansu, topic)
    yield topic
    delete_topics(tansu, topic)


@pytest.fixture
def own_broker(tmp_path: Any) -> Iterator[EmbeddedBroker]:
    """A tansu of the test's own, to kill or stop; stopped when the test ends, pass or fail."""
    broker = start_embedded_broker(log_path=tmp_path / "tansu.log")
    try:
        yield broker
    finally:
        broker.stop()


def _sink(**cfg: Any) -> Any:
    s = build_sink(
        {
            "type": "kafka",
            "linger_ms": 1,
            "request_timeout_ms": 5_000,
            "delivery_timeout_ms": 15_000,
            **cfg,
        }
    )
    s.init_sink()
    return s


def test_a_record_above_the_topic_limit_fails_before_sending(client: str, tansu: str) -> None:
    """The topic's max.message.bytes (5,000) is below the producer's max_request_size (1 MiB):
    the broker would refuse row 40 after the batch went out. The sink reads the limit
    (DescribeConfigs) and refuses the row before sending: under fail_fast nothing after it is
    produced. (tansu stores the limit but does not enforce it, so without the check every
    record would be written; the other policies leave the refusal to the broker.)"""
    from kafka.admin import KafkaAdminClient, NewTopic

    from conveyor.core.sink import send_isolating

    topic = unique("klimit")
    admin = KafkaAdminClient(bootstrap_servers=tansu, request_timeout_ms=10_000)
    try:
        admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"max.message.bytes": "5000"})])
    finally:
        admin.close()
    batch = make_batch(100, names={40: "x" * 6_000, 70: "y" * 6_000})
    s = _sink(client=client, bootstrap_servers=tansu, topic=topic, max_request_size=1 << 20)
    try:
        assert s.topic_limit(topic) == 5000
        failed = send_isolating(s, batch, fail_fast=True)
        assert [f.index for f in failed] == [40]
        assert "max.message.bytes 5000" in failed[0].message
        assert sorted(as_row(r)["id"] for r in consume_all(tansu, topic)) == list(range(40))
        assert [f.index for f in send_isolating(s, batch.slice(41), fail_fast=True)] == [29]
        ids = sorted(as_row(r)["id"] for r in consume_all(tansu, topic))
        assert ids == [i for i in range(70) if i != 40]
    finally:
        s.cleanup_sink()
        delete_topics(tansu, topic)


def test_idempotent_producer_gets_a_producer_id_from_tansu(
    client: str, tansu: str, kafka_topic: str
) -> None:
    s = _sink(client=client, bootstrap_servers=tansu, topic=kafka_topic)
    try:
        assert s.send_batch(make_batch(5)).failed == ()
        if client == "confluent":
            assert _librdkafka_eos(s)["idemp_state"] == "Assigned"
            assert _librdkafka_eos(s)["producer_id"] >= 0
        else:
            tm = s._producer._transaction_manager
            assert tm is not None and tm.producer_id_and_epoch.producer_id >= 0
    finally:
        s.cleanup_sink()


def _librdkafka_eos(s: Any) -> dict[str, Any]:
    """The idempotence state librdkafka reports (statistics) for a producer made from the
    sink's own properties, after one record."""
    from confluent_kafka import Producer

    from conveyor.sinks.kafka_confluent import producer_config

    stats: list[dict[str, Any]] = []
    conf = {
        **producer_config(s.config),
        "statistics.interval.ms": 100,
        "stats_cb": lambda j: stats.append(json.loads(j)),
    }
    p = Producer(conf)
    p.produce(s.config.topic, value=b"x")
    assert p.flush(10) == 0
    stats.clear()  # the state after the record was acknowledged
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not stats:
        p.poll(0.1)
    assert stats, "no statistics from librdkafka"
    return dict(stats[-1].get("eos", {}))  # only an idempotent producer reports it


def test_non_idempotent_acks_leader(client: str, tansu: str, kafka_topic: str) -> None:
    s = _sink(client=client, bootstrap_servers=tansu, topic=kafka_topic, idempotent=False, acks="1")
    try:
        assert s.send_batch(make_batch(20)).failed == ()
        if client == "confluent":
            assert _librdkafka_eos(s) == {}  # not idempotent: never asks for a producer id
        else:
            assert s._producer._transaction_manager is None
    finally:
        s.cleanup_sink()
    assert len(consume_all(tansu, kafka_topic)) == 21 if client == "confluent" else 20


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_compression_round_trip(client: str, tansu: str, kafka_topic: str, codec: str) -> None:
    s = _sink(client=client, bootstrap_servers=tansu, topic=kafka_topic, compression=codec)
    try:
        assert s.send_batch(make_batch(200)).failed == ()
    finally:
        s.cleanup_sink()
    rows = [as_row(r) for r in consume_all(tansu, kafka_topic)]
    assert sorted(r["id"] for r in rows) == list(range(200))


def test_topic_template_destination_and_missing_field(client: str, tansu: str) -> None:
    prefix = unique("kt")
    batch = make_batch(6)
    # name "name <i>" has a space, so route on a payload field that makes legal names: id parity
    # through the __destination column for rows 0-1, the template for the others.
    dest = pa.array([f"{prefix}-dest", f"{prefix}-dest", None, None, None, None], pa.string())
    batch = batch.set_column(batch.schema.get_field_index("__destination"), "__destination", dest)
    s = _sink(client=client, bootstrap_servers=tansu, topic=prefix + "-${topic}-${payload.id}")
    try:
        result = s.send_batch(batch)
        assert result.failed == ()
        bad = s.send_batch(make_batch(2).drop_columns(["id"]))  # ${payload.id} cannot be filled
        assert [f.index for f in bad.failed] == [0, 1] and "id" in bad.failed[0].message
        assert all(f.kind is ErrorKind.DATA for f in bad.failed)
        illegal = build_sink(
            {
                "type": "kafka",
                "client": client,
                "bootstrap_servers": tansu,
                "topic": prefix + "-${payload.name}",
            }
        )
        illegal.init_sink()
        try:
            res = illegal.send_batch(make_batch(2))  # "name 0" has a space: not a legal topic name
            assert {f.index for f in res.failed} == {0, 1} and "legal topic name" in res.failed[
                0
            ].message
        finally:
            illegal.cleanup_sink()
    finally:
        s.cleanup_sink()
    assert [as_row(r)["id"] for r in consume_all(tansu, f"{prefix}-dest")] == [0, 1]
    for i in range(2, 6):
        assert [as_row(r)["id"] for r in consume_all(tansu, f"{prefix}-orders-{i}")] == [i]
    delete_topics(tansu, f"{prefix}-dest", *(f"{prefix}-orders-{i}" for i in range(2, 6)))


def test_key_template_timestamp_now_and_coordinate_headers(
    client: str, tansu: str, kafka_topic: str
) -> None:
    before = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)
    s = _sink(
        bootstrap_servers=tansu,
        topic=kafka_topic,
        key="id-${payload.id}",
        timestamp="now",
        coordinate_headers=True,
        keep_headers=False,
    )
    try:
        assert s.send_batch(make_batch(3, topic="src", partition=0)).failed == ()
    finally:
        s.cleanup_sink()
    recs = {as_row(r)["id"]: r for r in consume_all(tansu, kafka_topic)}
    assert recs[2].key == b"id-2"
    assert dict(recs[2].headers) == {
        "x-conveyor-topic": b"src",
        "x-conveyor-partition": b"0",
        "x-conveyor-offset": b"2",
    }
    assert as_row(recs[2])["timestamp"] >= before > BASE_TS


def test_partitioning_source_keeps_partition_numbers(client: str, tansu: str) -> None:
    topic = unique("kp")
    create_topic(tansu, topic, partitions=3)
    try:
        s = _sink(client=client, bootstrap_servers=tansu, topic=topic, partitioning="source")
        try:
            b = pa.concat_tables(
                [make_batch(4, start=0, partition=0), make_batch(4, start=4, partition=2)]
            )
            assert s.send_batch(b).failed == ()
            with pytest.raises(PermanentSinkError, match="partition"):
                s.send_batch(make_batch(1, start=10, partition=7))
        finally:
            s.cleanup_sink()
        rows = [as_row(r) for r in consume_all(tansu, topic)]
        assert {r["id"]: r["partition"] for r in rows} == {
            0: 0,
            1: 0,
            2: 0,
            3: 0,
            4: 2,
            5: 2,
            6: 2,
            7: 2,
        }
    finally:
        delete_topics(tansu, topic)


def test_tombstone_for_a_null_value(client: str, tansu: str, kafka_topic: str) -> None:
    batch = pa.table(
        {"value": pa.array([b"v", None], pa.binary()), "__key": pa.array([b"a", b"b"], pa.binary())}
    )
    s = _sink(client=client, bootstrap_servers=tansu, topic=kafka_topic)
    try:
        assert s.send_batch(batch).failed == ()
        # no key and no value: Kafka cannot hold it -> a data error for that row only
        nokey = pa.table({"value": pa.array([None, b"ok"], pa.binary())})
        res = s.send_batch(nokey)
        assert [f.index for f in res.failed] == [0]
    finally:
        s.cleanup_sink()
    recs = consume_all(tansu, kafka_topic)
    assert [(r.key, r.value) for r in recs] == [(b"a", b"v"), (b"b", None), (None, b"ok")]


def test_a_producer_queue_smaller_than_the_batch_waits_for_room(own_broker: EmbeddedBroker) -> None:
    """librdkafka's local queue holds 7 records, the batch 200: ``produce`` refuses with
    BufferError and the sink serves delivery reports until there is room, so every row is
    written once and in order. With the broker gone the queue never drains: the batch fails
    as an outage within ``max_block_ms``, not a hang."""
    broker = own_broker
    s = None
    try:
        topic = unique("kq")
        create_topic(broker.bootstrap, topic, partitions=1)
        s = _sink(
            client="confluent",
            bootstrap_servers=broker.bootstrap,
            topic=topic,
            max_block_ms=2_000,
            request_timeout_ms=1_000,
            delivery_timeout_ms=3_000,
            client_options={"queue.buffering.max.messages": 7},
        )
        waits: list[int] = []
        wait = s._producer._wait_for_room
        s._producer._wait_for_room = lambda args: waits.append(1) or wait(args)
        assert s.send_batch(make_batch(200)).failed == ()
        assert waits  # the queue was full: produce refused and the sink waited
        ids = [as_row(r)["id"] for r in consume_all(broker.bootstrap, topic)]
        assert ids == list(range(200))
        broker.process.kill()
        broker.process.wait(5)
        started = time.monotonic()
        with pytest.raises(TransientSinkError):
            s.send_batch(make_batch(50, start=200))
        assert time.monotonic() - started < 15
    finally:
        if s is not None:
            s.cleanup_sink()


def test_broker_lost_after_start_is_transient_and_bounded(
    client: str, own_broker: EmbeddedBroker
) -> None:
    broker = own_broker
    s = None
    try:
        topic = unique("kl")
        create_topic(broker.bootstrap, topic)
        s = _sink(
            bootstrap_servers=broker.bootstrap,
            topic=topic,
            request_timeout_ms=1_000,
            delivery_timeout_ms=3_000,
            max_block_ms=3_000,
        )
        assert s.send_batch(make_batch(5)).failed == ()
        broker.process.kill()  # tansu waits ~5 s on SIGTERM while clients are connected
        broker.process.wait(5)
        started = time.monotonic()
        with pytest.raises(TransientSinkError):
            s.send_batch(make_batch(5))
        assert time.monotonic() - started < 15
        assert s._producer is None  # dropped; the next batch reconnects
    finally:
        if s is not None:
            s.cleanup_sink()


def test_missing_ssl_file_is_permanent(client: str, tansu: str) -> None:
    s = build_sink(
        {
            "type": "kafka",
            "client": client,
            "bootstrap_servers": tansu,
            "topic": "t",
            "security_protocol": "SSL",
            "ssl_cafile": "nonexistent/ca.pem",  # under $CONVEYOR_HOME, missing
        }
    )
    with pytest.raises(PermanentSinkError, match="ssl_cafile"):
        s.init_sink()
    s.cleanup_sink()


@pytest.mark.parametrize("owner", ["sink", "dead-letters", "source-producer"])
def test_a_producer_closed_with_records_in_flight_stops_its_network_thread(
    owner: str, own_broker: EmbeddedBroker
) -> None:
    """kafka-python's producers as Conveyor drops them after an outage, while their records
    are still in flight (the broker hangs): the Kafka sink's, the dead-letter topic's and the
    source connectors' producer each stop their network thread and connections.
    kafka-python's ``close`` flushes first, even with timeout 0, and raises with records in
    flight before stopping that thread: closed that way, every outage left one running for
    the process's life."""
    import os
    import signal
    import threading

    from conveyor.brokers.producer import DestinationProducer
    from conveyor.core.connection import KafkaConnection
    from conveyor.core.source_connector import ProducerSpec
    from conveyor.spark.deadletters import KafkaDeadLetters

    broker = own_broker
    topic = unique("kdrop")
    create_topic(broker.bootstrap, topic)
    sink = _sink(client="kafka-python", bootstrap_servers=broker.bootstrap, topic=topic)
    letters = KafkaDeadLetters(KafkaConnection(bootstrap_servers=broker.bootstrap), topic)
    source = DestinationProducer(
        ProducerSpec(bootstrap_servers=broker.bootstrap), client_id="conveyor-test"
    )
    if owner == "sink":
        assert sink.send_batch(make_batch(10)).failed == ()
        producer, close = sink._producer, sink._drop_producer  # as after a failed batch
    elif owner == "dead-letters":
        producer, close = letters._get_producer(), letters.close
    else:
        source.init()
        producer, close = source._producer, source.close
    producer.send(topic, value=b"{}").get(timeout=30)  # connected
    network = producer._sender
    assert network.is_alive()
    try:
        os.kill(broker.process.pid, signal.SIGSTOP)
        try:
            for i in range(100):
                producer.send(topic, value=b"{}", key=str(i).encode())  # in flight, unanswered
            close()  # the records are abandoned (the batch is sent again)
            network.join(10)
            leaked = [t.name for t in threading.enumerate() if t is network]
        finally:
            os.kill(broker.process.pid, signal.SIGCONT)
        assert not leaked, f"the closed producer's network thread still runs: {leaked}"
        if owner == "sink":
            assert sink._producer is None
            assert sink.send_batch(make_batch(10)).failed == ()  # a new producer after it
    finally:
        sink.cleanup_sink()
        letters.close()
        source.close()


def test_a_broker_stopped_mid_batch_loses_nothing(client: str, own_broker: EmbeddedBroker) -> None:
    """tansu is SIGSTOPped while batches are being produced (requests hang, connections stay
    open) for longer than delivery_timeout_ms, then continued. As the runtime does, a batch
    that raised TransientSinkError is sent again whole, and the rows reported unacknowledged
    are sent again alone: every row ends up in the topic, and the duplicates are at most
    the rows sent again."""
    import os
    import signal
    import threading

    broker = own_broker
    s = None
    try:
        topic = unique("kstop")
        create_topic(broker.bootstrap, topic, partitions=2)
        s = _sink(
            client=client,
            bootstrap_servers=broker.bootstrap,
            topic=topic,
            request_timeout_ms=1_000,
            delivery_timeout_ms=2_000,
            max_block_ms=3_000,
        )
        batches, size = 12, 5_000
        resent = 0
        errors: list[BaseException] = []
        progress = threading.Event()

        def produce_all() -> None:
            nonlocal resent
            try:
                for b in range(batches):
                    pending = make_batch(size, start=b * size)
                    for _attempt in range(30):
                        progress.set()
                        try:
                            result = s.send_batch(pending)
                        except TransientSinkError:
                            resent += pending.num_rows
                            time.sleep(0.5)  # the runtime's backoff
                            continue
                        assert all(f.kind is ErrorKind.TRANSIENT for f in result.failed)
                        if not result.failed:
                            break
                        pending = pending.take([f.index for f in result.failed])
                        resent += pending.num_rows
                    else:
                        raise AssertionError(f"batch {b} never acknowledged")
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)

        worker = threading.Thread(target=produce_all, daemon=True)
        worker.start()
        assert progress.wait(10)
        time.sleep(0.3)  # mid-batch
        os.kill(broker.process.pid, signal.SIGSTOP)
        try:
            time.sleep(4)  # past delivery_timeout_ms: records expire unacknowledged
        finally:
            os.kill(broker.process.pid, signal.SIGCONT)
        worker.join(180)
        assert not worker.is_alive(), "the producer did not finish after the broker came back"
        assert not errors, errors
        ids = [json.loads(r.value)["id"] for r in consume_all(broker.bootstrap, topic, 60)]
        assert set(ids) == set(range(batches * size))  # nothing lost
        assert len(ids) - batches * size <= resent  # duplicates bounded by the rows sent again
    finally:
        if s is not None:
            s.cleanup_sink()
