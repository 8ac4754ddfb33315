"""The source connectors' producer: kafka-python, one client for every destination topic.

Connects with the connector's ``kafka`` section (the one ``KafkaConnection`` model,
``brokers.connection.kafka_python_options``); creates a missing destination on first
use with the connector's topic defaults; returns from ``produce`` only once every
record of the group is acknowledged (``acks`` all by default), so the loop stores its
state after real acknowledgements only. Errors are classified by
``classify_kafka_error``: outages are ``TransientSinkError`` (the batch is polled
again), the rest ``PermanentSinkError``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from conveyor.brokers.connection import (
    classify_kafka_error,
    close_producer,
    describe_kafka_error,
    kafka_python_options,
    tls_problem,
)
from conveyor.brokers.kafka import default_bootstrap
from conveyor.core.engine.source_loop import Record
from conveyor.core.errors import ConfigError, PermanentSinkError, TransientSinkError
from conveyor.core.source_connector import ProducerSpec

log = logging.getLogger("conveyor.producer")


class DestinationProducer:
    """Produces routed groups into their topics; thread-safe (kafka-python's producer is)."""

    def __init__(self, spec: ProducerSpec, *, client_id: str):
        self.spec = spec
        self.client_id = client_id
        self._producer: Any = None
        self._admin: Any = None
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"kafka@{self.spec.bootstrap_servers or default_bootstrap()}"

    def _options(self, role: str) -> dict[str, Any]:
        try:
            return kafka_python_options(
                self.spec,
                role,
                prefix="kafka",
                default_bootstrap=default_bootstrap,
                client_id=self.client_id,  # type: ignore[arg-type]
            )
        except ConfigError as e:
            raise PermanentSinkError(str(e)) from None

    def _error(self, exc: BaseException, context: str) -> Exception:
        if isinstance(exc, (TransientSinkError, PermanentSinkError)):
            return exc
        if classify_kafka_error(exc) == "transient":
            return TransientSinkError(f"{context}: {describe_kafka_error(exc)}")
        return PermanentSinkError(f"{context}: {describe_kafka_error(exc)}")

    def init(self) -> None:
        from kafka import KafkaProducer

        kw = self._options("producer")
        problem = tls_problem(kw)
        if problem:
            raise PermanentSinkError(f"cannot connect to Kafka at {self.describe()}: {problem}")
        try:
            self._producer = KafkaProducer(
                acks="all" if self.spec.acks == "all" else 1,
                compression_type=None if self.spec.compression == "none" else self.spec.compression,
                request_timeout_ms=self.spec.request_timeout_ms,
                max_block_ms=self.spec.request_timeout_ms,
                linger_ms=5,
                **kw,
            )
        except Exception as e:  # noqa: BLE001 - classified
            raise self._error(e, f"cannot connect to Kafka at {self.describe()}") from None

    def _admin_client(self) -> Any:
        from kafka.admin import KafkaAdminClient

        if self._admin is None:
            self._admin = KafkaAdminClient(**self._options("admin"))
        return self._admin

    def ensure(self, topic: str) -> int:
        """The partition count of ``topic``, created with the topic defaults when missing."""
        assert self._producer is not None, "init() first"
        with self._lock:
            try:
                names = set(self._admin_client().list_topics())
                if topic not in names:
                    if not self.spec.create_topics:
                        raise PermanentSinkError(
                            f"topic {topic!r} does not exist and kafka.create_topics is false"
                        )
                    self._create(topic)
                deadline = time.monotonic() + self.spec.request_timeout_ms / 1000
                while True:
                    parts = self._producer.partitions_for(topic)
                    if parts:
                        return len(parts)
                    if time.monotonic() > deadline:
                        raise TransientSinkError(f"topic {topic!r} shows no partitions yet")
                    time.sleep(0.1)
            except (TransientSinkError, PermanentSinkError):
                raise
            except Exception as e:  # noqa: BLE001 - classified
                self._drop_admin()
                raise self._error(e, f"destination {topic!r}") from None

    def _create(self, topic: str) -> None:
        from kafka.admin import NewTopic
        from kafka.errors import TopicAlreadyExistsError

        try:
            self._admin_client().create_topics(
                [NewTopic(topic, self.spec.partitions, self.spec.replication_factor)]
            )
            log.info("created destination topic %s (%d partitions)", topic, self.spec.partitions)
        except TopicAlreadyExistsError:
            pass

    def produce(self, topic: str, records: Sequence[Record]) -> None:
        assert self._producer is not None, "init() first"
        try:
            futures = [
                self._producer.send(
                    topic,
                    value=r.value,
                    key=r.key,
                    partition=r.partition,
                    headers=list(r.headers) or None,
                    timestamp_ms=r.timestamp_ms,
                )
                for r in records
            ]
            self._producer.flush(timeout=self.spec.request_timeout_ms / 1000)
            for f in futures:
                f.get(timeout=self.spec.request_timeout_ms / 1000)
        except Exception as e:  # noqa: BLE001 - classified
            raise self._error(e, f"produce to {topic!r}") from None

    def _drop_admin(self) -> None:
        a, self._admin = self._admin, None
        if a is not None:
            try:
                a.close()
            except Exception:  # noqa: BLE001 - best effort
                log.debug("closing admin client failed", exc_info=True)

    def close(self) -> None:
        self._drop_admin()
        p, self._producer = self._producer, None
        if p is not None:
            close_producer(p, timeout=5)
