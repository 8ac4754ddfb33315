"""A connector's dead letters: where they are kept, how many are pending, the oldest ones."""

from __future__ import annotations

from typing import Any

from conveyor.config.specs import LoadedSpec, load_source
from conveyor.control.operation_context import ConflictError, OperationsPart


class ConnectorDeadLetters(OperationsPart):
    """The dead letters of a connector, read from its Parquet store (Kafka: a topic to consume)."""

    def dead_letter_store(self, name: str) -> tuple[LoadedSpec, Any]:
        """The connector's spec and its Parquet dead-letter store (ConflictError for Kafka)."""
        from conveyor.dagster.resources.conveyor import default_spark_remote
        from conveyor.spark.deadletters import SparkParquetDeadLetters, dead_letter_location
        from conveyor.spark.session import spark_session

        row = self.row(name)
        loaded = load_source(name, row.spec_source)
        if not loaded.ok or loaded.spec is None:
            raise ConflictError(f"{name} has an invalid spec: {loaded.error}")
        if loaded.spec.failure.dead_letter.store != "parquet":
            raise ConflictError(
                f"{name} dead-letters to the Kafka topic {name}.dlq; read it with any Kafka consumer"
            )
        broker = self.store.get_broker(row.broker_id) if row.broker_id else None
        remote = broker.spark_remote if broker else default_spark_remote()
        session: dict[str, Any] = {}

        def spark() -> Any:
            if "s" not in session:
                session["s"] = spark_session(remote)
            return session["s"]

        return loaded, SparkParquetDeadLetters(
            dead_letter_location(loaded.spec), spark, connector=name
        )

    def dead_letters(self, name: str, limit: int = 20) -> dict[str, Any]:
        """Pending dead letters: count and the oldest ``limit`` with their errors."""
        from conveyor.spark.deadletters import dlq_topic, sample_rows

        row = self.row(name)
        failure = (row.spec or {}).get("failure") or {}
        store_kind = (failure.get("dead_letter") or {}).get("store", "parquet")
        dead_by_run = row.counters.get("dead_lettered", 0)
        if failure.get("policy") != "dead_letter":
            return {"name": name, "policy": failure.get("policy", "fail"), "store": None}
        if store_kind == "kafka":
            return {
                "name": name,
                "policy": "dead_letter",
                "store": "kafka",
                "topic": dlq_topic(name),
                "dead_lettered_by_current_run": dead_by_run,
            }
        _, dl = self.dead_letter_store(name)
        rows = sample_rows(dl.pending(limit=limit), n=limit)
        return {
            "name": name,
            "policy": "dead_letter",
            "store": "parquet",
            "pending": dl.count(),
            "dead_lettered_by_current_run": dead_by_run,
            "letters": rows,
        }
