"""Lineage: source system -> topics (source connectors) -> each sink connector's asset -> dead letters.

All are external ``AssetSpec``s: connector runs record materializations on them
(throttled to once a minute) with messages, offsets, lag and throughput.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict

from dagster import AssetKey, AssetSpec, FreshnessPolicy

from conveyor.config.specs import LoadedSpec
from conveyor.core.asset_keys import key_part


def topic_key(topic: str) -> AssetKey:
    return AssetKey(["kafka", _part(topic)])


def dead_letter_key(connector: str) -> AssetKey:
    return AssetKey(["dead_letters", connector])


def _part(s: str) -> str:
    return key_part(s)


def group_of(connector: str) -> str:
    return f"connector_{connector}"


def lineage_specs(specs: list[LoadedSpec]) -> list[AssetSpec]:
    """Asset specs for every valid connector; assets shared by connectors are merged."""
    topic_users, topic_producers, systems, sinks = _index_specs(specs)
    out = _source_system_specs(systems)
    _add_allowlist_producers(topic_users, topic_producers, systems)
    out += _topic_specs(topic_users, topic_producers)
    for key, users in sinks.items():
        out.append(_sink_spec(key, users))
        out += _dead_letter_specs(key, users)
    return out


def _index_specs(
    specs: list[LoadedSpec],
) -> tuple[
    dict[str, list[str]],
    dict[str, list[LoadedSpec]],
    dict[AssetKey, list[LoadedSpec]],
    dict[AssetKey, list[LoadedSpec]],
]:
    """Who uses what: the sink connectors reading each topic, the source connectors naming
    each topic, the source connectors per source system, the sink connectors per sink asset."""
    topic_users: dict[str, list[str]] = defaultdict(list)
    topic_producers: dict[str, list[LoadedSpec]] = defaultdict(list)
    systems: dict[AssetKey, list[LoadedSpec]] = defaultdict(list)
    sinks: dict[AssetKey, list[LoadedSpec]] = defaultdict(list)
    for ls in specs:
        if ls.ok and ls.source_spec is not None and ls.source_config is not None:
            systems[AssetKey(ls.source_config.asset_key_path())].append(ls)
            for t in static_destinations(ls):
                topic_producers[t].append(ls)
        if not ls.ok or ls.spec is None or ls.sink is None:
            continue
        for t in ls.spec.source.topics:
            topic_users[t].append(ls.name)
        sinks[AssetKey(ls.sink.asset_key_path())].append(ls)
    return topic_users, topic_producers, systems, sinks


def _source_system_specs(systems: dict[AssetKey, list[LoadedSpec]]) -> list[AssetSpec]:
    """One asset per source system (a table, a queue...), shared by the connectors reading it."""
    out: list[AssetSpec] = []
    for key, producers in systems.items():
        first = producers[0]
        assert first.source_config is not None
        out.append(
            AssetSpec(
                key=key,
                description=f"{first.source_config.kind()} read by source connector(s) "
                f"{', '.join(p.name for p in producers)}.",
                group_name=group_of(first.name) if len(producers) == 1 else "sources",
                kinds={first.source_config.kind()},
                metadata={"source": (first.display() or {}).get("source") or {}},
            )
        )
    return out


def _add_allowlist_producers(
    topic_users: dict[str, list[str]],
    topic_producers: dict[str, list[LoadedSpec]],
    systems: dict[AssetKey, list[LoadedSpec]],
) -> None:
    """Adds to ``topic_producers`` the source connectors whose allowlist admits a topic a sink
    connector reads."""
    # A topic a sink connector reads that a source connector's allowlist admits: the source
    # may produce into it (destinations taken from the data are known only at run time).
    for topic in topic_users:
        for producers in systems.values():
            for p in producers:
                if p in topic_producers[topic] or p.source_spec is None:
                    continue
                adm = p.source_spec.routing.admission
                if adm.mode == "allowlist" and adm.admits(topic) is None:
                    topic_producers[topic].append(p)


def _topic_specs(
    topic_users: dict[str, list[str]], topic_producers: dict[str, list[LoadedSpec]]
) -> list[AssetSpec]:
    """One asset per topic, depending on the source systems of the connectors producing it."""
    out: list[AssetSpec] = []
    for topic in sorted(set(topic_users) | set(topic_producers)):
        users = topic_users.get(topic, [])
        producers = topic_producers.get(topic, [])
        described = []
        if producers:
            described.append(f"produced by {', '.join(sorted(p.name for p in producers))}")
        if users:
            described.append(f"read by {', '.join(sorted(users))}")
        owner = users[0] if users else producers[0].name
        out.append(
            AssetSpec(
                key=topic_key(topic),
                deps=sorted(
                    {
                        AssetKey(p.source_config.asset_key_path())
                        for p in producers
                        if p.source_config
                    },
                    key=lambda k: k.to_user_string(),
                ),
                description=f"Kafka topic {topic!r}, {' and '.join(described)}.",
                group_name=group_of(owner) if len(users) + len(producers) == 1 else "topics",
                kinds={"kafka"},
                metadata={"topic": topic},
            )
        )
    return out


def _sink_spec(key: AssetKey, users: list[LoadedSpec]) -> AssetSpec:
    """The sink target's asset, written by ``users``: depends on the topics they read, with
    a freshness policy from the tightest expected latency."""
    first = users[0]
    assert first.spec is not None and first.sink is not None
    deps = sorted(
        {topic_key(t) for u in users if u.spec for t in u.spec.source.topics},
        key=lambda k: k.to_user_string(),
    )
    owners = sorted({o for u in users if u.spec for o in u.spec.owners})
    latency = min(u.spec.expected_latency_s for u in users if u.spec)
    return AssetSpec(
        key=key,
        deps=deps,
        description=(
            first.spec.description
            or f"{first.sink.kind()} target written by connector(s) {', '.join(u.name for u in users)}."
        ),
        group_name=group_of(first.name) if len(users) == 1 else "sinks",
        kinds={first.sink.kind()},
        owners=owners,
        tags={"conveyor/connector": first.name} if len(users) == 1 else {},
        metadata={
            "connectors": ", ".join(u.name for u in users),
            # As written, secrets masked, ${env:...} references shown.
            "sink": (first.display() or {}).get("sink") or first.sink.redacted(),
        },
        freshness_policy=FreshnessPolicy.time_window(
            fail_window=dt.timedelta(seconds=max(latency * 2, 120)),
            warn_window=dt.timedelta(seconds=max(latency, 60)),
        ),
    )


def _dead_letter_specs(key: AssetKey, users: list[LoadedSpec]) -> list[AssetSpec]:
    """One dead-letter asset per connector writing the sink asset ``key``."""
    return [
        AssetSpec(
            key=dead_letter_key(u.name),
            deps=[key],
            description=f"Messages connector {u.name} could not deliver, with their errors (replayable).",
            group_name=group_of(u.name),
            kinds={"parquet"}
            if u.spec and u.spec.failure.dead_letter.store == "parquet"
            else {"kafka"},
            owners=sorted(u.spec.owners) if u.spec else [],
            tags={"conveyor/connector": u.name},
        )
        for u in users
    ]


def static_destinations(ls: LoadedSpec) -> list[str]:
    """The topics a source connector's spec names: per-table destination, Route mapping and
    default, default_destination, the allowlist's literal topics. Destinations taken from
    the data (a column, a select) are known only at run time; runs materialize them."""
    spec, config = ls.source_spec, ls.source_config
    if spec is None or config is None:
        return []
    found: set[str] = set()
    dest = getattr(config, "destination", None)
    if isinstance(dest, str):
        found.add(dest)
    for per_table in (getattr(config, "destinations", None) or {}).values():
        found.add(per_table)
    r = spec.routing
    if r.route is not None:
        found |= set((r.route.mapping or {}).values())
        if r.route.default:
            found.add(r.route.default)
    if r.default_destination:
        found.add(r.default_destination)
    found |= set(r.admission.literal_topics())
    return sorted(found)
