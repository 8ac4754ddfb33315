"""The Dagster resource that carries Conveyor's settings and its meta store.

Every field falls back to an environment variable so that `dagster dev`,
the daemon and run workers agree without run config. Evaluating a sensor or
loading the code location never starts Spark: sessions are created lazily by the
connector op.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import urlparse

import yaml
from dagster import ConfigurableResource, EnvVar
from pydantic import Field, PrivateAttr, ValidationError

from conveyor.config.specs import connectors_dir
from conveyor.core.errors import ConfigError
from conveyor.core.host.home import conveyor_home
from conveyor.core.host.ports import port_open
from conveyor.core.model import Broker, BrokersFile
from conveyor.core.planning.scheduler import BrokerView, gone_brokers
from conveyor.core.registry import format_validation_error
from conveyor.store.meta import MetaStore, default_meta_url

log = logging.getLogger("conveyor")

DEFAULT_SPARK_REMOTE = "sc://127.0.0.1:15002"
DEFAULT_BROKER_ID = "local"


def default_spark_remote() -> str:
    return os.environ.get("CONVEYOR_SPARK_REMOTE", DEFAULT_SPARK_REMOTE)


def brokers_file() -> Path:
    return Path(
        os.environ.get("CONVEYOR_BROKERS_FILE") or (conveyor_home() / "brokers.yaml")
    ).resolve()


# How long a run's meta-store write waits for a SQLite lock before it counts as an outage.
RUN_BUSY_TIMEOUT_S = 5.0


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


def conveyor_resource() -> ConveyorResource:
    """The resource with each setting the environment gives as a Dagster ``EnvVar``.

    The UI then shows the variable's name, never its value (a meta store URL may hold a
    password), and every process (the code server, the daemon, run workers) reads it
    from its own environment.
    """
    settings = {
        field: EnvVar(var)
        for field, var in (
            ("meta_url", "CONVEYOR_META_URL"),
            ("kafka_bootstrap", "CONVEYOR_KAFKA_BOOTSTRAP"),
            ("spark_remote", "CONVEYOR_SPARK_REMOTE"),
        )
        if os.environ.get(var)
    }
    return ConveyorResource(**settings)


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

    def run_store(self) -> MetaStore:
        """The meta store as a connector run uses it: a SQLite lock held longer than
        ``RUN_BUSY_TIMEOUT_S`` is a TransientStoreError (retried, reported Degraded) well
        before the heartbeat timeout, instead of a silent 30 s stall."""
        return MetaStore(self.meta_url or default_meta_url(), busy_timeout_s=RUN_BUSY_TIMEOUT_S)

    def sync_brokers(self, store: MetaStore) -> None:
        """Upsert the brokers file into the store (edits apply without a reload) and mark the
        stored brokers it no longer names gone; a bad file keeps the stored brokers."""
        try:
            brokers = load_brokers()
        except ConfigError as e:
            log.error("%s; keeping the brokers in the meta store", e)
            return
        # Only what changed is written: a tick that writes nothing takes no write lock, so a
        # run that hangs holding the SQLite lock cannot wedge the scheduler before it decides.
        stored = {x.id: x for x in store.list_brokers()}
        marked_gone = store.gone_brokers()
        for b in brokers:
            old = stored.get(b.id)
            if (
                old is None
                or b.id in marked_gone
                or (old.capacity, old.spark_remote, old.run_tags)
                != (b.capacity, b.spark_remote, b.run_tags)
            ):
                store.upsert_broker(b)
        gone = gone_brokers([b.id for b in brokers], broker_views(store, check_endpoints=False))
        if gone:
            log.warning("brokers %s are no longer in the brokers file: marked gone", gone)
            store.mark_gone(gone)

    def bootstrap(self) -> str | None:
        return self.kafka_bootstrap or os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP")

    def default_remote(self) -> str:
        return self.spark_remote or default_spark_remote()

    def connectors_dir(self) -> Path:
        return connectors_dir()


def endpoint_up(remote: str, timeout: float = 0.3) -> bool:
    """Whether a Spark Connect endpoint accepts TCP connections."""
    u = urlparse(remote.replace("sc://", "http://", 1))
    return bool(u.hostname) and port_open(u.hostname or "", u.port or 15002, timeout=timeout)


def broker_views(store: MetaStore, *, check_endpoints: bool = True) -> list[BrokerView]:
    """The brokers as the scheduler plans with them: stored, gone or not, endpoint reachable."""
    gone = store.gone_brokers()
    return [
        BrokerView(
            id=b.id,
            capacity=b.capacity,
            spark_remote=b.spark_remote,
            run_tags=b.run_tags,
            draining=b.draining,
            endpoint_up=endpoint_up(b.spark_remote)
            if check_endpoints and b.id not in gone
            else True,
            gone=b.id in gone,
        )
        for b in store.list_brokers()
    ]
