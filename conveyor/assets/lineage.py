"""Lineage: source-topic assets -> each connector's sink asset -> its dead-letter asset.

All are external ``AssetSpec``s: connector runs record materializations on them
(throttled to once a minute) with messages, offsets, lag and throughput.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict

from dagster import AssetKey, AssetSpec, FreshnessPolicy

from conveyor.core.asset_keys import key_part
from conveyor.specs import LoadedSpec


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
    topic_users: dict[str, list[str]] = defaultdict(list)
    sinks: dict[AssetKey, list[LoadedSpec]] = defaultdict(list)
    out: list[AssetSpec] = []
    for ls in specs:
        if not ls.ok or ls.spec is None or ls.sink is None:
            continue
        for t in ls.spec.source.topics:
            topic_users[t].append(ls.name)
        sinks[AssetKey(ls.sink.asset_key_path())].append(ls)
    for topic, users in sorted(topic_users.items()):
        out.append(
            AssetSpec(
                key=topic_key(topic),
                description=f"Kafka topic {topic!r}, read by {', '.join(sorted(users))}.",
                group_name=group_of(users[0]) if len(users) == 1 else "topics",
                kinds={"kafka"},
                metadata={"topic": topic},
            )
        )
    for key, users in sinks.items():
        first = users[0]
        assert first.spec is not None and first.sink is not None
        deps = sorted(
            {topic_key(t) for u in users if u.spec for t in u.spec.source.topics},
            key=lambda k: k.to_user_string(),
        )
        owners = sorted({o for u in users if u.spec for o in u.spec.owners})
        latency = min(u.spec.expected_latency_s for u in users if u.spec)
        out.append(
            AssetSpec(
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
        )
        for u in users:
            out.append(
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
            )
    return out
