"""Elasticsearch sink: the contract suite against a real cluster given by CONVEYOR_TEST_ES_URL.

There is no Elasticsearch on the CI machine, so these tests are skipped unless the
variable is set (see docs/FULL_SUITE.md: ``docker compose up -d elasticsearch`` and
``export CONVEYOR_TEST_ES_URL=http://127.0.0.1:9200``). Config validation is also
covered without a server in tests/unit/test_elasticsearch_requests.py.
"""

from __future__ import annotations

import datetime as dt
import os
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sinks.contract import SinkContract, closed_port, make_batch, unique

ES_URL = os.environ.get("CONVEYOR_TEST_ES_URL", "")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not ES_URL,
        reason="CONVEYOR_TEST_ES_URL not set: no Elasticsearch server on this machine (see docs/FULL_SUITE.md)",
    ),
]

# amount is an integer field: a value beyond 2^31 is rejected per document (400 item).
MAPPINGS = {
    "properties": {
        "id": {"type": "long"},
        "name": {"type": "keyword"},
        "amount": {"type": "integer"},
    }
}


def _split(url: str) -> tuple[str, str | None, str | None]:
    """The URL without credentials, and the credentials (the sink takes them as separate, secret fields)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    plain = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    user = urllib.parse.unquote(parts.username) if parts.username else None
    password = urllib.parse.unquote(parts.password or "") if parts.username else None
    return plain, user, password


def _client() -> Any:
    from elasticsearch import Elasticsearch

    return Elasticsearch(ES_URL, request_timeout=30)


class TestElasticsearchContract(SinkContract):
    """``index`` ops with ``_id`` = topic-partition-offset: a replay overwrites the same documents."""

    sink_type = "elasticsearch"
    idempotent = True
    keeps_keys = keeps_headers = keeps_timestamps = True
    # fail_fast sends _bulk requests of fail_fast_chunk_size (100) in order and stops after
    # the one holding the refused document: the rest of that request is written (bounded,
    # checked below); TestElasticsearchExactContract sets 1 and writes nothing after it.
    stops_at_first_failure = False

    def test_fail_fast_writes_at_most_the_rest_of_its_request(self, sink: Any, target: str) -> None:
        from conveyor.core.sink import send_isolating

        batch, bad = self.poison_batch(target)
        first = min(bad)
        failed = send_isolating(sink, batch, fail_fast=True)
        assert [f.index for f in failed] == [first]
        size = sink.config.fail_fast_chunk()
        end = (first // size + 1) * size  # requests start at rows 0, size, 2 * size, ...
        ids = batch.column("id").to_pylist()
        stored = sorted(r["id"] for r in self.read_back(target))
        assert set(ids[:first]) <= set(stored) <= set(ids[:first] + ids[first + 1 : end])

    def make_target(self) -> Iterator[str]:
        name = unique("orders")  # lower case already
        client = _client()
        try:
            client.indices.create(index=name, mappings=MAPPINGS)
            yield name
            client.indices.delete(index=name, ignore_unavailable=True)
        finally:
            client.close()

    def config(self, target: str) -> dict[str, Any]:
        url, user, password = _split(ES_URL or "http://127.0.0.1:9200")
        cfg: dict[str, Any] = {
            "type": "elasticsearch",
            "hosts": [url],
            "index": target,
            "metadata_field": "kafka",
            "max_retries": 0,
        }
        if user is not None:
            cfg.update(username=user, password=password)
        if url.startswith("https://"):
            cfg["verify_certs"] = False  # test clusters use self-signed certificates
        return cfg

    def read_back(self, target: str) -> list[dict[str, Any]]:
        client = _client()
        try:
            client.indices.refresh(index=target)
            hits = client.search(index=target, query={"match_all": {}}, size=10_000)["hits"]["hits"]
        finally:
            client.close()
        out = []
        for h in hits:
            src = h["_source"]
            meta = src["kafka"]
            out.append(
                {
                    "id": src["id"],
                    "name": src["name"],
                    "key": meta["key"].encode() if meta["key"] is not None else None,
                    "headers": {x["key"]: x["value"].encode() for x in meta["headers"]},
                    "timestamp": dt.datetime.fromisoformat(
                        meta["timestamp"].replace("Z", "+00:00")
                    ),
                }
            )
        return out

    def poison_batch(self, target: str):
        # Row 250: out of range for the integer mapping (rejected by Elasticsearch, item 400).
        # Row 400: NaN, which JSON cannot carry (rejected by the sink before sending).
        return make_batch(500, amounts={250: 1e12, 400: float("nan")}), {250, 400}

    def outage_config(self, target: str) -> dict[str, Any]:
        return {
            **self.config(target),
            "hosts": [f"http://127.0.0.1:{closed_port()}"],
            "request_timeout_s": 2,
        }

    bad_fields = [
        ({"index": "Orders"}, "index"),
        ({"index": "logs-{year}"}, "index"),
        ({"hosts": ["127.0.0.1:9200"]}, "hosts"),
        ({"op_type": "update"}, "op_type"),
        ({"username": "elastic"}, "password"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
    ]


class TestElasticsearchCreateContract(TestElasticsearchContract):
    """``create`` ops (as data streams need): a replay gets 409 per document, counted as stored."""

    def config(self, target: str) -> dict[str, Any]:
        return {**super().config(target), "op_type": "create", "refresh": "wait_for"}


class TestElasticsearchExactContract(TestElasticsearchContract):
    """``fail_fast_chunk_size: 1``: one document per request under fail_fast, nothing after the failed row."""

    stops_at_first_failure = True

    def config(self, target: str) -> dict[str, Any]:
        return {**super().config(target), "fail_fast_chunk_size": 1}
