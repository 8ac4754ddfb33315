"""The hostile-payload corpus (tests/hostile.py) through the request builders of the sinks
without a server here (Elasticsearch, MongoDB, GreptimeDB): every row is either in the
request or a row failure with its index, exactly once, and never an exception. What the
server then refuses per row is mapped back by the response tests of each sink.
"""

from __future__ import annotations

import pytest

from conveyor.sinks.base import iter_records, payload_columns
from conveyor.sinks.elasticsearch import ElasticsearchSinkConfig, build_bulk
from conveyor.sinks.greptimedb import GreptimeDBSinkConfig, build_lines
from conveyor.sinks.mongodb import MongoDBSinkConfig, build_operations
from tests.hostile import HOSTILE, hostile_batch


def _es(batch):
    cfg = ElasticsearchSinkConfig.model_validate(
        {"type": "elasticsearch", "hosts": ["http://127.0.0.1:9200"], "index": "orders"}
    )
    return build_bulk(iter_records(batch), cfg)


def _mongo(batch):
    cfg = MongoDBSinkConfig.model_validate(
        {"type": "mongodb", "url": "mongodb://127.0.0.1:27017", "database": "db", "collection": "o"}
    )
    return build_operations(iter_records(batch), cfg)


def _greptime(batch):
    cfg = GreptimeDBSinkConfig.model_validate(
        {"type": "greptimedb", "url": "http://127.0.0.1:4000", "measurement": "orders"}
    )
    return build_lines(iter_records(batch), cfg, payload_columns(batch))


@pytest.mark.parametrize(
    "build", [_es, _mongo, _greptime], ids=["elasticsearch", "mongodb", "greptimedb"]
)
def test_every_hostile_row_is_planned_or_a_row_failure(build) -> None:
    batch, what = hostile_batch()
    plan = build(batch)
    failed = [f.index for f in plan.failures]
    planned = list(plan.rows) + list(getattr(plan, "superseded", []))
    assert sorted(planned + failed) == list(range(batch.num_rows)), "a row lost or doubled"
    assert not [what[i] for i in failed if what[i] == "good"], "a good row failed"
    assert all(f.message for f in plan.failures)


def test_nan_and_infinity_are_refused_where_json_has_none() -> None:
    batch, what = hostile_batch()
    failed = {what[f.index] for f in _es(batch).failures}
    assert {"NaN", "+Infinity", "-Infinity"} <= failed
    assert len(HOSTILE) > len(failed)  # the others are valid JSON documents
