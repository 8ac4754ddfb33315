"""The auto-replay decision of ``conveyor_dead_letter_replay`` on a real meta store."""

from __future__ import annotations

from conveyor.core.model import ConnectorSpec
from conveyor.dagster.sensors.dead_letters import replay_requests
from conveyor.store.meta import MetaStore


def spec(name: str, auto: bool) -> str:
    return ConnectorSpec.model_validate(
        {
            "name": name,
            "source": {"topics": ["t"]},
            "sink": {"type": "localfile", "path": "x"},
            "failure": {
                "policy": "dead_letter",
                "dead_letter": {"auto_replay": auto, "replay_after_s": 60},
            },
        }
    ).model_dump_json()


def test_replays_once_healthy_for_the_set_time_and_only_new_dead_letters(tmp_path):
    clock = [1_000.0]
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}", clock=lambda: clock[0])
    for name, auto in (("auto", True), ("manual", False)):
        store.sync_spec(name, spec_json=spec(name, auto), spec_hash="x", source="t", error=None)
        g = store.claim(
            name, run_id=f"r-{name}", expected_generation=None, holder_alive=lambda r: False
        ).generation
        store.heartbeat(name, g, {"dead_lettered": 3})  # Running since t=1000

    todo, cursor = replay_requests(store.list(), {}, now=1_059)
    assert todo == []  # healthy for 59 s < replay_after_s
    todo, cursor = replay_requests(store.list(), cursor, now=1_060)
    assert todo == [("auto", 3)]  # never the connector without auto_replay
    todo, cursor = replay_requests(store.list(), cursor, now=1_200)
    assert todo == []  # nothing new since the last replay
    clock[0] = 1_100.0
    store.heartbeat("auto", store.get("auto").generation, {"dead_lettered": 5})
    todo, _ = replay_requests(store.list(), cursor, now=1_300)
    assert todo == [("auto", 5)]
