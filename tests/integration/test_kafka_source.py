"""The Kafka source against a real tansu broker: a failed read loses nothing."""

from __future__ import annotations

import pytest
from kafka.errors import CorruptRecordError

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.errors import TransientSourceError
from conveyor.core.model import BatchPolicy, SourceSpec
from tests.e2e.conftest import produce

pytestmark = pytest.mark.integration


def test_a_read_that_fails_midway_rewinds_so_no_record_is_skipped(tansu, topic_name):
    produce(tansu, topic_name, 300, partitions=1)
    source = KafkaSource(SourceSpec(topics=[topic_name], bootstrap_servers=tansu), group_id="t")
    source.open({})
    real_poll = source._consumer.poll
    calls = {"n": 0}

    def poll_then_fail(*a, **kw):
        # The first poll returns records (the consumer's position moves past them),
        # the second fails like a fetch kafka-python cannot parse.
        calls["n"] += 1
        if calls["n"] == 2:
            raise CorruptRecordError("injected")
        return real_poll(*a, **kw)

    source._consumer.poll = poll_then_fail
    policy = BatchPolicy(max_records=300, max_wait_ms=2_000)
    try:
        with pytest.raises(TransientSourceError, match="injected"):
            source.read(BatchPolicy(max_records=1_000, max_wait_ms=2_000))
        source._consumer.poll = real_poll
        ids: list[int] = []
        while len(ids) < 300:
            batch = source.read(policy)
            assert batch is not None, f"only {len(ids)} of 300 read back"
            ids += batch.table.column("__offset").to_pylist()
        assert ids == list(range(300))  # from offset 0 again: nothing skipped
    finally:
        source.close()


def test_record_checksums_are_verified_in_c():
    # kafka-python verifies each record batch's CRC-32C and falls back to a pure-Python
    # implementation when the `crc32c` package is missing; that fallback was most of the
    # source's CPU time. The dependency is declared; this guards against losing it.
    from kafka.record import util

    assert util.crc32c_c is not None, "the crc32c package is not installed"
    assert util.calc_crc32c(memoryview(b"123456789")) == 0xE3069283  # the CRC-32C check value
