"""Fixtures that start real servers: tansu (Kafka protocol) and Spark Connect.

PostgreSQL, MariaDB, Redis and RabbitMQ are the machine's own services
(.ci/run starts any that is down). Set CONVEYOR_TEST_SPARK_REMOTE to reuse a
running Spark Connect server instead of starting one per session.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from conveyor.brokers.embedded import start_embedded_broker

# Property tests: a quick profile in the default run, HYPOTHESIS_PROFILE=thorough for many more cases.
settings.register_profile("default", max_examples=60, deadline=None)
settings.register_profile("thorough", max_examples=2_000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# pytest-xdist runs the suite on two workers with `--dist loadfile`: a file's tests run
# in order on one worker (they may share fixed resources), files run side by side. Each
# worker starts its own tansu, Spark Connect server and, for e2e files, Dagster webserver.
# The longest files start first so that the two workers finish together.
SLOW_FIRST = [
    "tests/e2e/test_scheduler_e2e.py",  # the longest of -m slow
    "tests/e2e/test_sinks_e2e.py",
    "tests/e2e/test_api_e2e.py",
    "tests/e2e/test_connector_e2e.py",
    "tests/e2e/test_ui_screenshot.py",
    "tests/integration/test_source_postgres_polling.py",  # the longest of the default run
    "tests/integration/test_source_postgres_polling_races.py",
    "tests/sinks/test_kafka.py",
    "tests/integration/test_spark_transform.py",
    "tests/integration/test_fencing_races.py",
    "tests/integration/test_cli.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the order within a file is kept


PG_URL = os.environ.get("CONVEYOR_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A tansu broker on a free loopback port; yields its bootstrap address."""
    log = tmp_path_factory.mktemp("tansu") / "tansu.log"
    with start_embedded_broker(log_path=log) as broker:
        yield broker.bootstrap


@pytest.fixture(scope="session")
def apache_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Apache Kafka 3.8 (SASL/SCRAM, its log on disk) for this worker: ``tests/apache_kafka.py``.
    Skipped without ``../shared/kafka`` (a failure where CI requires it)."""
    from tests.apache_kafka import ApacheKafka, require_apache_kafka

    require_apache_kafka()
    broker = ApacheKafka(tmp_path_factory.mktemp("apache-kafka"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def spark_remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark Connect endpoint: $CONVEYOR_TEST_SPARK_REMOTE, or a local server for the session."""
    remote = os.environ.get("CONVEYOR_TEST_SPARK_REMOTE")
    if remote:
        yield remote
        return
    from conveyor.spark.server import start_spark_connect

    with start_spark_connect(work_dir=Path(tmp_path_factory.mktemp("spark"))) as server:
        yield server.remote


@pytest.fixture
def file_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path`` declared a root of the paths a spec names (``$CONVEYOR_FILE_ROOTS``,
    conveyor/core/trust/paths.py), for a test that writes or reads files there. Only this test's
    roots grow: the default (``$CONVEYOR_HOME`` alone) stays the strict one everywhere else."""
    monkeypatch.setenv("CONVEYOR_FILE_ROOTS", str(tmp_path))
    return tmp_path


@pytest.fixture
def temp_root(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system's temporary directory declared a root of a spec's paths, for tests whose
    sinks write into directories made there (``tempfile``, ``tmp_path``) by the test itself."""
    import tempfile

    root = Path(tempfile.gettempdir()).resolve()
    monkeypatch.setenv("CONVEYOR_FILE_ROOTS", str(root))
    return root


@pytest.fixture
def topic_name() -> str:
    return f"t_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def pg_url() -> str:
    return PG_URL


@pytest.fixture
def pg_schema(pg_url: str) -> Iterator[str]:
    """A fresh PostgreSQL schema for one test, dropped afterwards."""
    import psycopg2

    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'CREATE SCHEMA "{name}"')
    try:
        yield name
    finally:
        with conn.cursor() as cur:
            cur.execute(f'DROP SCHEMA "{name}" CASCADE')
        conn.close()
