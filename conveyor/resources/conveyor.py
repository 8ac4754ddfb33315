"""The Dagster resource that carries Conveyor's settings and its meta store.

Every field falls back to an environment variable so that `dagster dev`,
the daemon and run workers agree without run config. Evaluating a sensor or
loading the code location never starts Spark: sessions are created lazily by the
connector op.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from dagster import ConfigurableResource
from pydantic import Field, PrivateAttr, ValidationError

from conveyor.core.errors import ConfigError
from conveyor.core.model import Broker, BrokersFile
from conveyor.sinks import format_validation_error
from conveyor.specs import LoadedSpec, all_specs, connectors_dir, sync
from conveyor.store.meta import MetaStore, conveyor_home, default_meta_url

log = logging.getLogger("conveyor")

DEFAULT_SPARK_REMOTE = "sc://127.0.0.1:15002"
DEFAULT_BROKER_ID = "local"


def default_spark_remote() -> str:
    return os.environ.get("CONVEYOR_SPARK_REMOTE", DEFAULT_SPARK_REMOTE)


def brokers_file() -> Path:
    return Path(
        os.environ.get("CONVEYOR_BROKERS_FILE") or (conveyor_home() / "brokers.yaml")
    ).resolve()


def load_brokers(path: Path | None = None) -> list[Broker]:
    """Broker executors from YAML (``core.model.BrokersFile``), or the one default broker."""
    path = path or brokers_file()
    if not path.exists():
        return [
            Broker(
                id=DEFAULT_BROKER_ID,
                capacity=int(os.environ.get("CONVEYOR_BROKER_CAPACITY", "8")),
                spark_remote=default_spark_remote(),
            )
        ]
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML: {e}", source=str(path)) from None
    try:
        spec = BrokersFile.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e), source=str(path)) from None
    return [b.broker(default_spark_remote()) for b in spec.brokers]


@dataclass(frozen=True)
class Catalog:
    """What the code location is built from: specs and brokers (and whether the store answered)."""

    specs: list[LoadedSpec]
    brokers: list[Broker]
    store_error: str | None = None


def load_catalog(store_url: str | None = None) -> Catalog:
    """Load specs and brokers and sync them into the meta store; never raises.

    A broken spec, a broken brokers file or an unreachable store must not break the
    code location: the problem is reported and the rest still loads.
    """
    store_error = None
    store: MetaStore | None = None
    try:
        store = MetaStore(store_url)
        store.ensure_schema()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        store_error = f"meta store unavailable: {e}"
        log.error(store_error)
        store = None
    try:
        brokers = load_brokers()
    except ConfigError as e:
        log.error("%s; using the default broker", e)
        brokers = [Broker(id=DEFAULT_BROKER_ID, spark_remote=default_spark_remote())]
    try:
        specs = all_specs(store)
    except Exception as e:  # noqa: BLE001
        log.error("cannot read connector specs: %s", e)
        specs = []
    if store is not None:
        try:
            for b in brokers:
                store.upsert_broker(b)
            sync(store, specs)
        except Exception as e:  # noqa: BLE001
            store_error = f"meta store sync failed: {e}"
            log.error(store_error)
        finally:
            store.close()
    return Catalog(specs=specs, brokers=brokers, store_error=store_error)


class ConveyorResource(ConfigurableResource):
    """Conveyor's settings: meta store, connectors directory, Kafka and Spark defaults."""

    meta_url: str | None = Field(
        default=None,
        description="Meta store URL; default $CONVEYOR_META_URL or SQLite in $CONVEYOR_HOME.",
    )
    kafka_bootstrap: str | None = Field(
        default=None, description="Default bootstrap servers; default $CONVEYOR_KAFKA_BOOTSTRAP."
    )
    spark_remote: str | None = Field(
        default=None,
        description="Spark Connect endpoint when the broker has none; default $CONVEYOR_SPARK_REMOTE.",
    )

    _store: MetaStore | None = PrivateAttr(default=None)

    def store(self) -> MetaStore:
        if self._store is None:
            self._store = MetaStore(self.meta_url or default_meta_url())
            self._store.ensure_schema()
        return self._store

    def sync_brokers(self, store: MetaStore) -> None:
        """Upsert the brokers file into the store (edits apply without a reload); a bad file keeps the stored brokers."""
        try:
            brokers = load_brokers()
        except ConfigError as e:
            log.error("%s; keeping the brokers in the meta store", e)
            return
        for b in brokers:
            store.upsert_broker(b)

    def bootstrap(self) -> str | None:
        return self.kafka_bootstrap or os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP")

    def default_remote(self) -> str:
        return self.spark_remote or default_spark_remote()

    def connectors_dir(self) -> Path:
        return connectors_dir()
