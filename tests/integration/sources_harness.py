"""Shared pieces of the source connector integration tests: a claimed connector in a
meta store, a loop built the way the job builds it, and reading topics back."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from conveyor.brokers.producer import DestinationProducer
from conveyor.core.engine.routing import Route
from conveyor.core.engine.source_loop import SourceLoop, SourceLoopConfig
from conveyor.core.source_connector import ProducerSpec, SourceConnectorSpec
from conveyor.dagster.jobs.source_connector import StoreStateWriter
from conveyor.sources import build_source
from conveyor.sources.base import Source
from conveyor.spark.transform import SparkTransformer
from conveyor.store.meta import MetaStore


def claimed_store(tmp_path: Path, name: str) -> tuple[MetaStore, int]:
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    store.sync_spec(name, spec_json="{}", spec_hash=None, source="test", error=None)
    claim = store.claim(
        name,
        run_id=f"run-{uuid.uuid4().hex[:6]}",
        expected_generation=None,
        holder_alive=lambda r: False,
    )
    return store, claim.generation


def build_loop(
    spec: dict[str, Any],
    *,
    store: MetaStore,
    generation: int,
    bootstrap: str,
    spark_remote: str,
    source: Source | None = None,
    fetch: Callable[[str], bytes] | None = None,
    **cfg: Any,
) -> SourceLoop:
    from conveyor.spark.session import spark_session

    s = SourceConnectorSpec.model_validate({"kind": "source", **spec})
    if source is None:
        source = build_source(s.source.model_dump())
    stored = store.source_state(s.name)
    kafka = ProducerSpec.model_validate(
        {**s.kafka.model_dump(exclude_unset=True), "bootstrap_servers": bootstrap}
    )
    route = Route.build(s.routing.route, fetch) if s.routing.route else None
    return SourceLoop(
        SourceLoopConfig(
            name=s.name,
            routing=s.routing,
            batch=s.batch,
            retry=s.retry,
            select_routes=s.select_routes(),
            commit_failure_threshold=s.commit_failure_threshold,
            **cfg,
        ),
        source=source,
        transform=SparkTransformer(
            s.transform_for(source.config.builds_tombstones()),
            lambda: spark_session(spark_remote),
        ),
        producer=DestinationProducer(kafka, client_id=f"conveyor-{s.name}"),
        writer=StoreStateWriter(store, s.name, generation, source.state_version, None),
        state=stored[1] if stored else None,
        route=route,
    )


@contextmanager
def running(loop: SourceLoop) -> Iterator[SourceLoop]:
    """The loop on a thread; stopped and joined at the end (its error re-raised)."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            loop.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        yield loop
    finally:
        loop.request_stop()
        t.join(60)
    if errors:
        raise errors[0]


def wait_for(cond: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def read_topic(bootstrap: str, topic: str, timeout_ms: int = 3_000) -> list[Any]:
    """Every record of ``topic`` (all partitions) from the beginning."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, consumer_timeout_ms=timeout_ms, enable_auto_commit=False
    )
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        if not parts:
            return []
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        return list(consumer)
    finally:
        consumer.close()


def topic_values(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    return [json.loads(m.value) for m in read_topic(bootstrap, topic)]


def run_sink(tmp_path: Path, spec: Any, spark_remote: str, total: int) -> Any:
    """A sink connector's loop (``spec``: a ConnectorSpec) in this thread, against a meta store
    of its own, until it has committed ``total`` messages; its counters."""
    from conveyor.brokers.kafka import KafkaSource
    from conveyor.core.engine.loop import ConnectorLoop, LoopConfig, run_loop
    from conveyor.dagster.jobs.committer import StoreCommitter
    from conveyor.sinks import build_sink
    from conveyor.spark.session import spark_session

    store = MetaStore(f"sqlite:///{tmp_path / 'sink.db'}")
    store.sync_spec(
        spec.name, spec_json=spec.model_dump_json(), spec_hash="x", source="t", error=None
    )
    claim = store.claim(
        spec.name, run_id="t", expected_generation=None, holder_alive=lambda r: False
    )
    spark = spark_session(spark_remote)
    source = KafkaSource(spec.source, group_id=spec.name)
    loop = ConnectorLoop(
        LoopConfig(name=spec.name, batch=spec.batch, retry=spec.retry, failure=spec.failure),
        source=source,
        transform=SparkTransformer(spec.transform, lambda: spark),
        sink=build_sink(spec.sink.model_dump()),
        committer=StoreCommitter(store, spec.name, claim.generation, source),
        committed={},
        stop_requested=lambda: sum(loop.committed.values()) >= total,
    )
    return run_loop(loop)
