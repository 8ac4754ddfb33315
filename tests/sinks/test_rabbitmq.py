"""RabbitMQ sink: the contract suite and AMQP-specific behaviour against the machine's RabbitMQ."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pika
import pyarrow as pa
import pytest

from conveyor.core.errors import PermanentSinkError, TransientSinkError
from conveyor.sinks import build_sink
from conveyor.sinks.base import ErrorKind
from conveyor.sinks.rabbitmq import sink_error
from tests.sinks.contract import BASE_TS, SinkContract, closed_port, make_batch, unique
from tests.sinks.relay import CuttingRelay

pytestmark = pytest.mark.integration

AMQP_URL = os.environ.get("CONVEYOR_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def amqp() -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(AMQP_URL))


def make_exchange_and_queue(name: str, *, exchange_type: str = "topic", binding: str = "*") -> None:
    """A non-durable exchange and a queue named ``name`` bound with ``binding`` (the queue expires if leaked)."""
    conn = amqp()
    try:
        ch = conn.channel()
        ch.exchange_declare(name, exchange_type=exchange_type, durable=False)
        ch.queue_declare(name, durable=False, arguments={"x-expires": 600_000})
        ch.queue_bind(name, name, routing_key=binding)
    finally:
        conn.close()


def drop(name: str, *, exchange: bool = True) -> None:
    conn = amqp()
    try:
        ch = conn.channel()
        ch.queue_delete(name)
        if exchange:
            ch.exchange_delete(name)
    finally:
        conn.close()


def drain(queue: str) -> list[tuple[Any, Any, bytes]]:
    """Every message of ``queue`` (basic_get until empty, acked)."""
    conn = amqp()
    out = []
    try:
        ch = conn.channel()
        while True:
            method, props, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                return out
            out.append((method, props, body))
    finally:
        conn.close()


def _b(v: Any) -> bytes | None:
    return v.encode() if isinstance(v, str) else v


def as_row(props: Any, body: bytes) -> dict[str, Any]:
    value = json.loads(body)
    h = props.headers or {}
    return {
        "id": value["id"],
        "name": value["name"],
        "key": _b(h.get("x-conveyor-key")),
        "headers": {k: _b(v) for k, v in h.items() if not k.startswith("x-conveyor-")},
        "timestamp": dt.datetime.fromtimestamp(h["x-conveyor-timestamp"] / 1000, dt.timezone.utc)
        if "x-conveyor-timestamp" in h
        else None,
        "props": props,
    }


class TestRabbitMQContract(SinkContract):
    """Topic exchange, queue bound with ``*``, routing key ``${payload.name}``, mandatory.

    Every contract name ("name 7") is one topic word, so it matches ``*``; a name with a
    dot ("poison.row") is two words: no queue takes it, it comes back unroutable.
    """

    sink_type = "rabbitmq"
    idempotent = False  # AMQP publish is not idempotent: a replay is published again (message_id lets consumers dedupe)
    # Returns arrive after the batch was published, so under fail_fast with mandatory the
    # sink waits for each confirm (a second channel): nothing after an unroutable row.
    stops_at_first_failure = True
    keeps_keys = keeps_headers = keeps_timestamps = True
    confirm_mode = "pipelined"

    def make_target(self) -> Iterator[str]:
        name = unique("rq")
        make_exchange_and_queue(name)
        yield name
        drop(name)

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "rabbitmq",
            "url": AMQP_URL,
            "exchange": target,
            "routing_key": "${payload.name}",
            "mandatory": True,
            "confirm_mode": self.confirm_mode,
            "confirm_timeout_s": 10,
            "connect_timeout_s": 3,
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        return [as_row(p, b) for _, p, b in drain(target)]

    def poison_batch(self, target: str) -> tuple[pa.Table, set[int]]:
        return make_batch(500, names={250: "poison.row", 400: "bad.route.x"}), {250, 400}

    def outage_config(self, target: str) -> dict[str, Any]:
        return {**self.config(target), "url": f"amqp://guest:guest@127.0.0.1:{closed_port()}/%2F"}

    bad_fields = [
        ({"url": "http://127.0.0.1:5672/"}, "url"),
        ({"url": None}, "url"),
        ({"host": "127.0.0.1"}, "url"),  # both url and host
        ({"exchange": "bad exchange!"}, "exchange"),
        ({"routing_key": "${nope}"}, "routing_key"),
        ({"routing_key": "x" * 300}, "routing_key"),
        ({"exchange_type": "x-delayed"}, "exchange_type"),
        ({"delivery_mode": 3}, "delivery_mode"),
        ({"confirm_mode": "none"}, "confirm_mode"),
        ({"confirm_timeout_s": 0}, "confirm_timeout_s"),
        ({"port": 70_000}, "port"),
        ({"ssl_cafile": "tls/ca.pem"}, "ssl_cafile"),
        ({"exchange": "", "declare_exchange": True}, "declare_exchange"),
    ]


class TestRabbitMQPerMessageContract(TestRabbitMQContract):
    """The same contract through pika's public per-message confirm API."""

    stops_at_first_failure = True  # one confirm per message: it stops at a refused one

    confirm_mode = "per_message"


# -- AMQP-specific behaviour --------------------------------------------------------------------


@pytest.fixture
def target() -> Iterator[str]:
    name = unique("rq")
    make_exchange_and_queue(name)
    yield name
    drop(name)


def _sink(**cfg: Any) -> Any:
    s = build_sink(
        {
            "type": "rabbitmq",
            "url": AMQP_URL,
            "confirm_timeout_s": 10,
            "connect_timeout_s": 3,
            **cfg,
        }
    )
    s.init_sink()
    return s


def test_fail_fast_pipelined_without_mandatory_stops_at_a_row_it_cannot_build(
    target: str,
) -> None:
    """Without mandatory nothing comes back: fail_fast pipelines and stops at the first row
    that cannot be published (a missing routing-key field); with mandatory it confirms one
    message at a time, on a second channel, and the pipelined channel still works."""
    from conveyor.core.sink import send_isolating

    s = _sink(exchange=target, routing_key="${payload.name}", mandatory=False)
    try:
        failed = send_isolating(s, make_batch(300, names={120: None}), fail_fast=True)
        assert [f.index for f in failed] == [120]
        assert sorted(json.loads(b)["id"] for _, _, b in drain(target)) == list(range(120))
        assert s._exact_channel is None  # never needed
    finally:
        s.cleanup_sink()
    s = _sink(exchange=target, routing_key="${payload.name}", mandatory=True)
    try:
        failed = send_isolating(s, make_batch(300, names={7: "un.routable"}), fail_fast=True)
        assert [f.index for f in failed] == [7]
        assert "unroutable" in failed[0].message
        assert sorted(json.loads(b)["id"] for _, _, b in drain(target)) == list(range(7))
        s.fail_fast = False  # the other policies pipeline on the first channel
        assert [f.index for f in s.send_batch(make_batch(20, names={3: "x.y"})).failed] == [3]
        assert len(drain(target)) == 19
    finally:
        s.cleanup_sink()


def test_message_properties(target: str) -> None:
    s = _sink(exchange=target, routing_key="${payload.name}")
    try:
        assert s.send_batch(make_batch(3, topic="orders", partition=2)).failed == ()
    finally:
        s.cleanup_sink()
    msgs = drain(target)
    assert len(msgs) == 3
    method, props, body = msgs[1]
    assert method.routing_key == "name 1"
    assert props.message_id == "orders-2-1"
    assert props.delivery_mode == 2
    assert props.content_type == "application/json"
    assert props.app_id == "conveyor"
    base_ms = int(BASE_TS.timestamp()) * 1000
    assert props.timestamp == base_ms // 1000  # AMQP timestamps have no milliseconds
    assert props.headers == {
        "h": "1",
        "x-conveyor-topic": "orders",
        "x-conveyor-partition": 2,
        "x-conveyor-offset": 1,
        "x-conveyor-timestamp": base_ms + 1,
        "x-conveyor-key": "k1",
    }
    assert json.loads(body) == {"id": 1, "name": "name 1", "amount": 1.5}


def test_default_exchange_routes_to_queue_by_name_and_destination_wins(target: str) -> None:
    other = unique("rq")
    make_exchange_and_queue(other)
    try:
        batch = make_batch(4)
        dest = pa.array([None, other, None, None], pa.string())
        batch = batch.set_column(
            batch.schema.get_field_index("__destination"), "__destination", dest
        )
        s = _sink(routing_key=target, header_values="bytes", delivery_mode="transient")
        try:
            assert s.send_batch(batch).failed == ()
        finally:
            s.cleanup_sink()
        mine = drain(target)
        assert sorted(json.loads(b)["id"] for _, _, b in mine) == [0, 2, 3]
        assert mine[0][1].delivery_mode == 1 and mine[0][1].headers["h"] == b"0"
        assert [json.loads(b)["id"] for _, _, b in drain(other)] == [1]
    finally:
        drop(other)


def test_declare_exchange_and_type_mismatch_is_permanent() -> None:
    name = unique("rqx")
    try:
        s = _sink(
            exchange=name,
            declare_exchange=True,
            exchange_type="fanout",
            exchange_durable=False,
            routing_key="ignored",
        )
        s.cleanup_sink()
        with pytest.raises(PermanentSinkError, match="406"):
            _sink(
                exchange=name, declare_exchange=True, exchange_type="direct", exchange_durable=False
            )
    finally:
        conn = amqp()
        conn.channel().exchange_delete(name)
        conn.close()


def test_missing_exchange_is_permanent_and_named() -> None:
    with pytest.raises(PermanentSinkError, match="no_such_exchange_"):
        _sink(exchange=unique("no_such_exchange"))


@pytest.mark.parametrize("mode", ["pipelined", "per_message"])
def test_exchange_deleted_while_running_is_permanent(target: str, mode: str) -> None:
    s = _sink(exchange=target, routing_key="${payload.name}", confirm_mode=mode)
    try:
        assert s.send_batch(make_batch(2)).failed == ()
        conn = amqp()
        conn.channel().exchange_delete(target)
        conn.close()
        with pytest.raises(PermanentSinkError, match=f"exchange '{target}'"):
            s.send_batch(make_batch(2))
        with pytest.raises(PermanentSinkError, match="not found"):
            s.send_batch(make_batch(2))  # reconnecting finds it still missing
    finally:
        s.cleanup_sink()


def test_wrong_password_is_permanent() -> None:
    with pytest.raises(PermanentSinkError, match="ACCESS_REFUSED|authentication"):
        _sink(url=None, host="127.0.0.1", username="guest", password="wrong-password")
    with pytest.raises(PermanentSinkError, match="vhost|NOT_ALLOWED|access"):
        _sink(url="amqp://guest:guest@127.0.0.1:5672/no_such_vhost")


@pytest.mark.parametrize("mode", ["pipelined", "per_message"])
def test_row_level_data_errors(target: str, mode: str) -> None:
    batch = make_batch(5)
    dest = pa.array(
        [None, "a" * 300, None, None, None], pa.string()
    )  # a routing key above 255 bytes
    batch = batch.set_column(batch.schema.get_field_index("__destination"), "__destination", dest)
    s = _sink(
        exchange=target, routing_key="${payload.id}", confirm_mode=mode, max_message_bytes=1_000
    )
    try:
        big = make_batch(3, start=10, names={11: "b" * 2_000})
        r1 = s.send_batch(batch)
        r2 = s.send_batch(big)
        r3 = s.send_batch(make_batch(2, start=20).drop_columns(["id"]))  # ${payload.id} missing
    finally:
        s.cleanup_sink()
    assert [f.index for f in r1.failed] == [1] and "255" in r1.failed[0].message
    assert [f.index for f in r2.failed] == [1] and "max_message_bytes" in r2.failed[0].message
    assert [f.index for f in r3.failed] == [0, 1] and all(
        f.kind is ErrorKind.DATA for f in r3.failed
    )
    assert sorted(json.loads(b)["id"] for _, _, b in drain(target)) == [0, 2, 3, 4, 10, 12]


def test_nack_from_a_full_reject_publish_queue_is_transient() -> None:
    name = unique("rqfull")
    conn = amqp()
    ch = conn.channel()
    ch.queue_declare(
        name, arguments={"x-max-length": 3, "x-overflow": "reject-publish", "x-expires": 600_000}
    )
    conn.close()
    try:
        for mode in ("pipelined", "per_message"):
            s = _sink(routing_key=name, confirm_mode=mode)
            try:
                with pytest.raises(TransientSinkError, match="nacked"):
                    s.send_batch(make_batch(10))
                assert len(drain(name)) == 3
                assert (
                    s.send_batch(make_batch(2)).failed == ()
                )  # the same sink goes on once there is room
                assert len(drain(name)) == 2
            finally:
                s.cleanup_sink()
    finally:
        drop(name, exchange=False)


def test_connection_closed_by_the_broker_between_batches_reconnects(target: str) -> None:
    s = _sink(exchange=target, routing_key="${payload.name}")
    try:
        assert s.send_batch(make_batch(2)).failed == ()
        s._conn.close()  # as if the broker dropped it while the connector was idle
        assert s.send_batch(make_batch(2, start=2)).failed == ()
    finally:
        s.cleanup_sink()
    assert sorted(json.loads(b)["id"] for _, _, b in drain(target)) == [0, 1, 2, 3]


def test_confirms_span_batches_on_one_channel(target: str) -> None:
    """Delivery tags keep counting across batches on the same channel."""
    s = _sink(exchange=target, routing_key="${payload.name}", mandatory=True)
    try:
        for k in range(3):
            b = make_batch(1500, start=k * 1500, names={k * 1500 + 7: "x.y"})
            assert [f.index for f in s.send_batch(b).failed] == [7]
        assert s._next_tag == 3 * 1500 + 1  # returned messages are published (and confirmed) too
    finally:
        s.cleanup_sink()
    assert len(drain(target)) == 3 * 1499


def test_connection_lost_in_the_middle_of_a_batch_is_transient(target: str) -> None:
    relay = CuttingRelay()
    s = _sink(
        url=f"amqp://guest:guest@127.0.0.1:{relay.port}/%2F",
        exchange=target,
        routing_key="${payload.name}",
    )
    try:
        assert s.send_batch(make_batch(10)).failed == ()
        relay.cut_in(50_000)  # a 5,000-row batch is ~1 MB on the wire
        started = time.monotonic()
        with pytest.raises(TransientSinkError):
            s.send_batch(make_batch(5_000, start=10))
        assert time.monotonic() - started < 10
        assert s._conn is None  # dropped; the next batch reconnects through the relay
        relay.cut_after = None
        assert s.send_batch(make_batch(5, start=10)).failed == ()
        relay.cut(listener=True)  # now the broker is unreachable
        with pytest.raises(TransientSinkError):
            s.send_batch(make_batch(5, start=20))
    finally:
        s.cleanup_sink()
        relay.cut(listener=True)
    ids = [json.loads(b)["id"] for _, _, b in drain(target)]
    assert set(range(15)) <= set(
        ids
    )  # what was confirmed is there; part of the cut batch may be too


@pytest.mark.skipif(
    shutil.which("rabbitmqctl") is None,
    reason="needs rabbitmqctl to close a connection from the broker side",
)
def test_connection_forced_closed_by_the_broker_reconnects(target: str) -> None:
    s = _sink(exchange=target, routing_key="${payload.name}")
    try:
        assert s.send_batch(make_batch(2)).failed == ()
        listing = subprocess.run(
            ["rabbitmqctl", "list_connections", "-q", "pid", "client_properties"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        mine = [
            line.split("\t")[0]
            for line in listing.splitlines()
            if f"conveyor-sink/{target}" in line
        ]
        assert len(mine) == 1, listing
        subprocess.run(
            ["rabbitmqctl", "close_connection", mine[0], "conveyor test"],
            capture_output=True,
            timeout=30,
            check=True,
        )
        seen = None
        deadline = time.monotonic() + 5
        while seen is None and time.monotonic() < deadline:
            try:
                s._conn.process_data_events(time_limit=0.05)
            except pika.exceptions.ConnectionClosedByBroker as e:
                seen = e
        assert seen is not None and seen.reply_code == 320
        # had it arrived during a batch, the batch would have been retried
        assert isinstance(sink_error(seen, "publishing"), TransientSinkError)
        assert s.send_batch(make_batch(2, start=2)).failed == ()
    finally:
        s.cleanup_sink()
    assert sorted(json.loads(b)["id"] for _, _, b in drain(target)) == [0, 1, 2, 3]
