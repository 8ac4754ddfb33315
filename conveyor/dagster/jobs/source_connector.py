"""The source connector job: one long-running Dagster run reading a system into topics.

The op's body is ``SourceRun``, the source kind of the one run template
(``jobs/run_template.py``, as Kafka Connect's ``WorkerSourceTask``): the same lifecycle as a
sink connector's run (``connector__<name>``, launched by the scheduler sensor, claimed and
fenced by generation, supervised, terminated as a Dagster interrupt, ended by the outcome
table). It checks the stored state's version, builds the source, the Spark transform, the
Route and the producer, and the template supervises ``core.engine.source_loop``. Topic assets
(``kafka/<topic>``) get a materialization per destination at most once a minute and at the
end of each loop.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from dagster import (
    AssetMaterialization,
    Failure,
    JobDefinition,
    MetadataValue,
    OpExecutionContext,
    in_process_executor,
    job,
    op,
)

from conveyor.brokers.producer import DestinationProducer
from conveyor.config.specs import LoadedSpec, resolved, sync_one
from conveyor.core.engine.routing import Route
from conveyor.core.engine.source_loop import (
    SourceLoop,
    SourceLoopConfig,
    checked_state,
)
from conveyor.core.engine.stopping import Directive, LoopControl, directive_for
from conveyor.core.errors import (
    ConfigError,
)
from conveyor.core.model import ConnectorStatus, Counters
from conveyor.dagster.assets.lineage import static_destinations, topic_key
from conveyor.dagster.jobs.allocators import use_run_allocators
from conveyor.dagster.jobs.run_template import RunTemplate
from conveyor.dagster.jobs.runs import claim_run, scrubbed_errors
from conveyor.dagster.resources.conveyor import ConveyorResource
from conveyor.dagster.tags import TAG_CONNECTOR, TAG_KIND, job_name
from conveyor.sources import build_source
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer
from conveyor.store.meta import MetaStore

MAPPING_FETCH_TIMEOUT_S = 10.0


def fetch_mapping(url: str) -> bytes:
    """GET a Route mapping (once, at start); any failure refuses to start."""
    with urllib.request.urlopen(url, timeout=MAPPING_FETCH_TIMEOUT_S) as resp:  # noqa: S310 - http(s) checked by the spec
        status = getattr(resp, "status", 200)
        if status != 200:
            raise ConfigError(f"GET {url} answered {status}", field="routing.route.url")
        body: bytes = resp.read()
        return body


class StoreStateWriter:
    """The run's fenced writes for a source connector: state and heartbeats."""

    def __init__(
        self,
        store: MetaStore,
        name: str,
        generation: int,
        version: int,
        spec_hash: str | None,
        on_heartbeat: Any = None,
    ):
        self.store, self.name, self.generation = store, name, generation
        self.version = version
        self.spec_hash = spec_hash
        self.on_heartbeat = on_heartbeat

    def save(self, state: dict[str, Any], *, abandoned: bool = False) -> None:
        self.store.save_source_state(
            self.name, self.generation, state, version=self.version, abandoned=abandoned
        )

    def heartbeat(
        self, counters: dict[str, Any], status: ConnectorStatus, reason: str | None
    ) -> Directive:
        reply = self.store.heartbeat(
            self.name, self.generation, counters, status=status, reason=reason
        )
        if self.on_heartbeat is not None:
            self.on_heartbeat(counters, False)
        return directive_for(reply, self.spec_hash)


def _topic_materializer(context: OpExecutionContext, name: str, every_s: float = 60.0) -> Any:
    """Logs a materialization of each destination topic with its routed count (throttled)."""
    last = {"at": 0.0}
    seen: dict[str, int] = {}

    def log(counters: dict[str, Any], final: bool) -> None:
        now = time.monotonic()
        if not final and now - last["at"] < every_s:
            return
        last["at"] = now
        dests = (counters.get("routing") or {}).get("destinations") or {}
        for topic, d in sorted(dests.items()):
            routed = int(d.get("routed") or 0)
            if routed == seen.get(topic) and not final:
                continue
            seen[topic] = routed
            context.log_event(
                AssetMaterialization(
                    asset_key=topic_key(topic),
                    description=f"source connector {name}: {routed} messages produced"
                    + (" (final)" if final else ""),
                    metadata={
                        "routed_by_run": MetadataValue.int(routed),
                        "breaker": MetadataValue.text(str(d.get("breaker"))),
                        "connector": MetadataValue.text(name),
                    },
                    tags={TAG_CONNECTOR: name},
                )
            )

    return log


class SourceRun(RunTemplate):
    """A source connector's run (``WorkerSourceTask``): claims the connector, checks the stored
    state's version and builds the source loop (source, transform, route, producer, fenced
    state writer); its topics are materialized at most once a minute and as each loop ends."""

    label = "source connector"
    terminated = "state stored up to the last produced batch"

    def claim(self) -> bool:
        spec = self.ls.source_spec
        assert spec is not None
        claim = claim_run(self.context, self.store, self.name, spec.heartbeat_timeout_s)
        if claim is None:
            return False
        self.generation = claim.generation
        broker = self.store.get_broker(claim.broker_id) if claim.broker_id else None
        self.remote = broker.spark_remote if broker else self.conveyor.default_remote()
        self.materialize = _topic_materializer(self.context, self.name)
        return True

    def build_loop(
        self, ls: LoadedSpec, spec_hash: str | None, canceled: Callable[[], bool]
    ) -> LoopControl:
        counters = self.loop.counters if self.loop is not None else None
        return _build_loop(
            self.context, self.conveyor, self.store, ls, spec_hash, self.generation,
            self.remote, counters, self.materialize,
        )  # fmt: skip

    def loop_ended(self, loop: LoopControl) -> None:
        assert isinstance(loop, SourceLoop)
        self.materialize(loop.heartbeat_payload(), True)

    def final_counters(self) -> dict[str, Any]:
        return self.loop.heartbeat_payload() if isinstance(self.loop, SourceLoop) else {}


def run_source_connector(
    context: OpExecutionContext, conveyor: ConveyorResource, name: str, loaded: LoadedSpec
) -> None:
    """The op body: the source connector's run (``SourceRun``)."""
    store = conveyor.run_store()
    sync_one(store, loaded)
    if not loaded.ok or loaded.source_spec is None:
        raise Failure(description=f"connector {name!r} cannot start: {loaded.error}")
    SourceRun(context, conveyor, loaded, store).execute()


def _build_loop(
    context: OpExecutionContext,
    conveyor: ConveyorResource,
    store: MetaStore,
    ls: LoadedSpec,
    spec_hash: str | None,
    gen: int,
    remote: str,
    counters: Counters | None,
    materialize: Any,
) -> SourceLoop:
    """Source, transform, route and producer for one spec, its references resolved (in the run)."""
    name = ls.name
    live = resolved(ls)  # holds secrets: used to build clients, never logged or stored
    assert live.source_spec is not None and live.source_config is not None
    spec = live.source_spec
    source = build_source(live.source_config.for_connector(name))  # e.g. its slot's name
    state = checked_state(name, store.source_state(name), source.state_version)
    info = store.source_state_info(name)
    abandon = bool(info and info["abandon_requested"])
    if abandon:
        context.log.warning(
            f"source connector {name}: abandon-batch requested; the first batch is skipped (data loss)"
        )
    kafka = spec.kafka.with_default_bootstrap(conveyor.bootstrap())
    route = (
        Route.build(spec.routing.route, fetch_mapping) if spec.routing.route is not None else None
    )
    context.log.info(
        f"source connector {name} generation {gen} (Spark {remote}); source {source.describe()} "
        f"({source.mode.value}{', destructive' if source.destructive else ''}); resuming from "
        f"{json.dumps(state) if state is not None else 'the beginning'}"
    )
    return SourceLoop(
        SourceLoopConfig(
            name=name,
            routing=spec.routing,
            batch=spec.batch,
            retry=spec.retry,
            commit_failure_threshold=spec.commit_failure_threshold,
            select_routes=spec.select_routes(),
            prewarm_timeout_s=kafka.prewarm_timeout_s,
            abandon_first_batch=abandon,
        ),
        source=source,
        transform=SparkTransformer(
            spec.transform_for(source.config.builds_tombstones()), lambda: spark_session(remote)
        ),
        producer=DestinationProducer(kafka, client_id=f"conveyor-{name}"),
        writer=StoreStateWriter(
            store, name, gen, source.state_version, spec_hash, on_heartbeat=materialize
        ),
        state=state,
        route=route,
        counters=counters,
    )


def source_connector_job(ls: LoadedSpec) -> JobDefinition:
    """``connector__<name>`` for a source connector: one op, in-process executor, no retries."""
    name = ls.name
    if ls.source_config is not None:
        what = "/".join(ls.source_config.asset_key_path())
        topics = ", ".join(static_destinations(ls)) or "topics chosen per message"
        desc = (
            ls.source_spec.description if ls.source_spec else None
        ) or f"Source connector {name}: {what} -> {topics}"
    else:
        desc = f"Connector {name} has an invalid spec: {ls.error}"

    @op(name=f"run_connector__{name}", description=desc, tags={"kind": "spark"})
    @scrubbed_errors
    def run_source_connector_op(context, conveyor: ConveyorResource) -> None:  # type: ignore[no-untyped-def]
        use_run_allocators()  # as a sink connector's run (conveyor/dagster/jobs/allocators.py)
        run_source_connector(context, conveyor, name, ls)

    @job(
        name=job_name(name),
        description=desc,
        executor_def=in_process_executor,
        tags={TAG_CONNECTOR: name, "dagster/max_retries": "0", TAG_KIND: "source"},
    )
    def source_connector_job_def() -> None:
        run_source_connector_op()

    return source_connector_job_def
