"""Benchmarks reuse the test fixtures (tansu, Spark Connect, PostgreSQL)."""

from tests.conftest import pg_schema, pg_url, spark_remote, tansu, topic_name  # noqa: F401
