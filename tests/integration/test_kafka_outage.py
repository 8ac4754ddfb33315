"""A Kafka broker that goes away (SIGSTOP: it stops answering) and comes back (SIGCONT):
the read is retried as an outage, shown Degraded, and every message is delivered once."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from conveyor.brokers.embedded import start_embedded_broker
from conveyor.brokers.kafka import KafkaSource
from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, run_loop
from conveyor.core.model import BatchPolicy, ConnectorStatus, RetrySpec, SourceSpec
from tests.e2e.conftest import produce, wait_for
from tests.unit.test_loop import Events, FakeCommitter, FakeSink, json_transform


def test_a_broker_that_stops_answering_is_an_outage_then_reading_goes_on(tmp_path):
    broker = start_embedded_broker(log_path=tmp_path / "tansu.log")
    paused = False
    try:
        produce(broker.bootstrap, "orders", 300, partitions=2)
        source = KafkaSource(
            SourceSpec(topics=["orders"], bootstrap_servers=broker.bootstrap),
            group_id="outage",
            request_timeout_ms=3_000,  # the client's bound on one request
            probe_interval_s=1.0,
        )
        events = Events()
        sink = FakeSink(events)
        committer = FakeCommitter(events)
        done = threading.Event()
        loop = ConnectorLoop(
            LoopConfig(
                name="outage",
                batch=BatchPolicy(max_records=50, max_wait_ms=200),
                retry=RetrySpec(delay=0.5, max_delay=2, jitter="none"),
            ),
            source=source,
            transform=json_transform,
            sink=sink,
            committer=committer,
            committed={},
            stop_requested=done.is_set,
        )
        outcome: dict = {}
        worker = threading.Thread(target=lambda: outcome.setdefault("c", run_loop(loop)))
        worker.start()
        try:
            wait_for(lambda: len(sink.rows) == 300, 60, "first 300")
            os.killpg(broker.process.pid, signal.SIGSTOP)
            paused = True
            wait_for(
                lambda: any(
                    h[0] == ConnectorStatus.DEGRADED and "do not answer" in (h[1] or "")
                    for h in committer.heartbeats
                ),
                60,
                "the outage reported Degraded",
            )
            os.killpg(broker.process.pid, signal.SIGCONT)
            paused = False
            produce(broker.bootstrap, "orders", 200, partitions=2, start=300)
            wait_for(lambda: len(sink.rows) >= 500, 120, "all 500 after the broker came back")
            time.sleep(1)  # nothing more arrives: no message read twice
        finally:
            done.set()
            worker.join(60)
        assert "c" in outcome, "the loop must end cleanly, not with the outage"
        assert sorted(sink.rows) == list(range(500))
        assert loop.counters.retries >= 1
        assert committer.heartbeats[-1][0] == ConnectorStatus.RUNNING
    finally:
        if paused:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(broker.process.pid, signal.SIGCONT)
        broker.stop()
