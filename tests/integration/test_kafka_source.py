"""kafka-python specifics of the Kafka source against a real tansu broker: a failed read
loses nothing, a corrupt record or a missing codec library is a permanent error, not an
outage loop. (What every client does is in tests/sources/contract.py.)"""

from __future__ import annotations

import pytest
from kafka.errors import CorruptRecordError, KafkaConnectionError

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.errors import PermanentSourceError, TransientSourceError
from conveyor.core.model import BatchPolicy, SourceSpec
from tests.e2e.conftest import produce

pytestmark = pytest.mark.integration


def test_a_read_that_fails_midway_rewinds_so_no_record_is_skipped(tansu, topic_name):
    produce(tansu, topic_name, 300, partitions=1)
    source = KafkaSource(
        SourceSpec(topics=[topic_name], bootstrap_servers=tansu, client="kafka-python"),
        group_id="t",
    )
    source.open({})
    real_poll = source._consumer.poll
    calls = {"n": 0}

    def poll_then_fail(*a, **kw):
        # The first poll returns records (the consumer's position moves past them),
        # the second fails like a connection lost mid-fetch.
        calls["n"] += 1
        if calls["n"] == 2:
            raise KafkaConnectionError("injected")
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


def test_a_corrupt_record_is_permanent_not_an_outage_loop(tansu, topic_name):
    produce(tansu, topic_name, 10, partitions=1)
    source = KafkaSource(
        SourceSpec(topics=[topic_name], bootstrap_servers=tansu, client="kafka-python"),
        group_id="t",
    )
    source.open({})

    def corrupt(*a, **kw):
        raise CorruptRecordError("Record is corrupt (stored crc = 1, computed crc = 2)")

    source._consumer.poll = corrupt
    try:
        with pytest.raises(PermanentSourceError, match="CorruptRecordError: Record is corrupt"):
            source.read(BatchPolicy(max_records=10, max_wait_ms=1_000))
    finally:
        source.close()


def test_a_codec_whose_library_is_missing_is_a_permanent_error_naming_it(
    tansu, topic_name, monkeypatch
):
    import kafka.codec

    from tests.sources.producers import Msg, create_topic
    from tests.sources.producers import produce as produce_rd

    create_topic(tansu, topic_name, 1)
    payloads = [Msg(b'{"id": %d, "pad": "%s"}' % (i, b"ab" * 100)) for i in range(20)]
    produce_rd(tansu, topic_name, payloads, **{"compression.type": "snappy"})
    # As on a machine without python-snappy (the dependency is declared; this is the path
    # a missing one takes): kafka-python raises UnsupportedCodecError while decoding.
    monkeypatch.setattr(kafka.codec, "has_snappy", lambda: False)
    source = KafkaSource(
        SourceSpec(topics=[topic_name], bootstrap_servers=tansu, client="kafka-python"),
        group_id="t",
    )
    source.open({})
    try:
        with pytest.raises(PermanentSourceError, match="snappy") as err:
            for _ in range(20):  # the first polls may return nothing while fetching
                source.read(BatchPolicy(max_records=10, max_wait_ms=500))
        assert "\n" not in str(err.value)
    finally:
        source.close()


def test_every_codec_library_is_installed():
    from kafka import codec

    assert codec.has_gzip() and codec.has_snappy() and codec.has_lz4() and codec.has_zstd()


def test_each_codec_is_really_decoded(tansu, topic_name, monkeypatch):
    """librdkafka sends a batch uncompressed when compressing does not pay: check that the
    contract's codec batches were compressed, by counting kafka-python's decoder calls."""
    from kafka.record import default_records

    from tests.sources.producers import CODECS, Msg, create_topic
    from tests.sources.producers import produce as produce_rd

    calls: dict[str, int] = {}
    for codec in CODECS:
        name = f"{codec}_decode"
        real = getattr(default_records, name)

        def counted(data, _real=real, _codec=codec):
            calls[_codec] = calls.get(_codec, 0) + 1
            return _real(data)

        monkeypatch.setattr(default_records, name, counted)
    create_topic(tansu, topic_name, 1)
    for codec in CODECS:
        msgs = [
            Msg(b'{"codec": "%s", "pad": "%s"}' % (codec.encode(), b"ab" * 100)) for _ in range(20)
        ]
        produce_rd(tansu, topic_name, msgs, **{"compression.type": codec})
    source = KafkaSource(
        SourceSpec(topics=[topic_name], bootstrap_servers=tansu, client="kafka-python"),
        group_id="t",
    )
    source.open({})
    try:
        n = 0
        for _ in range(40):
            batch = source.read(BatchPolicy(max_records=1_000, max_wait_ms=500))
            n += batch.table.num_rows if batch else 0
            if n >= 80:
                break
    finally:
        source.close()
    assert n == 80
    assert set(calls) == set(CODECS), calls
