"""Benchmarks reuse the test fixtures (tansu, Spark Connect, PostgreSQL)."""

from collections.abc import Iterator

import pytest

from tests.conftest import pg_schema, pg_url, spark_remote, tansu, topic_name  # noqa: F401


@pytest.fixture(scope="session")
def warm_spark_remote(spark_remote: str) -> Iterator[str]:  # noqa: F811
    """The Spark Connect endpoint after a JIT warm-up (bench/harness.py: ``warm_spark``)."""
    from bench.harness import BATCH, SPARK_WARMUP_S, warm_spark
    from conveyor.spark.session import spark_session

    queries, first, last = warm_spark(spark_session(spark_remote))
    print(
        f"\nSpark warm-up: {queries} transforms of {BATCH:,}-message and default-size batches in"
        f" {SPARK_WARMUP_S:.0f} s; {BATCH:,} messages: first {first:.0f} ms, median of the"
        f" last 50 {last:.0f} ms"
    )
    yield spark_remote
