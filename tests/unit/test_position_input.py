"""``core/positions.py``'s validator of positions given from outside (issue 45): the KIP-875
PATCH body, ``offsets reset --to`` and backfill ranges share it (their own tests: tests/integration
test_api.py, test_cli.py, test_backfill_requests.py, test_backfill.py)."""

from __future__ import annotations

import pytest

from conveyor.core.model import SourceSpec, TopicPartition
from conveyor.core.positions import PositionError, checked_position, parse_positions, topics_read

TP = TopicPartition("orders", 0)


def reads(topics: list[str] | None = None, regex: str | None = None) -> SourceSpec:
    return SourceSpec(topics=topics or [], topics_regex=regex)


@pytest.mark.parametrize(
    ("topic", "partition", "offset", "part", "message"),
    [
        ("orders", -1, 3, "partition", "-1 is out of range: a partition number (int32) is from 0"),
        ("orders", 2**31, 3, "partition", "2147483648 is out of range"),
        ("orders", "x", 3, "partition", "'x' is not a partition number (int32)"),
        ("orders", True, 3, "partition", "True is not a partition number"),
        ("orders", 1.0, 3, "partition", "1.0 is not a partition number"),
        ("orders", 0, -5, "offset", "-5 is out of range: an offset (int64) is from 0"),
        ("orders", 0, 2**70, "offset", "1180591620717411303424 is out of range"),
        ("orders", 0, 2**63, "offset", "9223372036854775808 is out of range"),
        ("orders", 0, 10**400, "offset", "a 1329-bit number is out of range"),
        ("orders", 0, "9" * 5000, "offset", "9999999999999999999999999999999999999999... is out"),
        ("orders", 0, "-5", "offset", "-5 is out of range"),
        ("orders", 0, " 5", "offset", "' 5' is not an offset"),
        ("orders", 0, "٥", "offset", "'٥' is not an offset"),  # int() reads it; Kafka does not
        ("orders", 0, [], "offset", "[] is not an offset"),
        ("", 0, 1, "topic", "expected a topic name"),
        (None, 0, 1, "topic", "expected a topic name"),
        (
            "clicks",
            0,
            1,
            "topic",
            "the connector does not read topic 'clicks' (it reads orders, /ord.*/)",
        ),
        ("__ordx", 0, 1, "topic", "the connector does not read topic '__ordx'"),
    ],
)
def test_a_position_breaking_a_rule_names_its_part_and_the_rule(
    topic, partition, offset, part, message
):
    with pytest.raises(PositionError) as e:
        checked_position(topic, partition, offset, reads(["orders"], "ord.*"))
    assert e.value.part == part
    assert str(e.value).startswith(message), str(e.value)


def test_positions_within_kafkas_bounds_of_topics_the_connector_reads_are_taken() -> None:
    r = reads(["orders"], "ord.*")
    assert checked_position("orders", 0, 0, r) == (TP, 0)
    top = (TopicPartition("orders", 2**31 - 1), 2**63 - 1)
    assert checked_position("orders", 2**31 - 1, 2**63 - 1, r) == top
    assert checked_position("ordx", "7", "12", r) == (TopicPartition("ordx", 7), 12)  # regex
    assert checked_position("orders", 3, None, r) == (TopicPartition("orders", 3), None)
    assert checked_position("anything", 0, 1, None) == (TopicPartition("anything", 0), 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("orders:0:-5", "'orders:0:-5': offset: -5 is out of range"),
        ("orders:-1:3", "'orders:-1:3': partition: -1 is out of range"),
        ("clicks:0:5", "'clicks:0:5': topic: the connector does not read topic 'clicks'"),
        (f"orders:0:{2**70}", f"'orders:0:{2**70}': offset: {2**70} is out of range"),
        ("orders:0", "'orders:0' is not TOPIC:PARTITION:OFFSET"),
        ("orders:0:5,", "'' is not TOPIC:PARTITION:OFFSET"),
        ("orders:0:5, orders:0:7", "'orders:0:7': partition orders[0] is given twice"),
        (":0:5", "':0:5': topic: expected a topic name"),
        ("orders:x:5", "'orders:x:5': partition: 'x' is not a partition number"),
    ],
)
def test_a_list_of_positions_is_refused_naming_the_item_and_the_rule(text, message):
    with pytest.raises(PositionError) as e:
        parse_positions(text, reads(["orders"]))
    assert str(e.value).startswith(message), str(e.value)


def test_a_list_of_positions_is_read_into_offsets() -> None:
    assert parse_positions(" orders:0:5, orders:1:7 ,ordx:2:0", reads(["orders"], "ord.")) == {
        TopicPartition("orders", 0): 5,
        TopicPartition("orders", 1): 7,
        TopicPartition("ordx", 2): 0,
    }


def test_the_topics_a_stored_spec_reads() -> None:
    r = topics_read({"source": {"topics": ["orders"], "topics_regex": "cl.*"}, "sink": {}})
    assert r is not None and r.matches("orders") and r.matches("clicks") and not r.matches("x")
    assert topics_read({"source": {"topics_regex": "a.*"}}).matches("ab")  # type: ignore[union-attr]
    assert topics_read(None) is None
    assert topics_read({"kind": "source", "source": {"type": "postgres"}}) is None
    assert topics_read({"source": {"topics": ["bad name"]}}) is None  # not a spec Conveyor wrote
