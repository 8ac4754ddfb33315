"""The source loop's order and guarantees with in-memory fakes (core/engine/source_loop.py)."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.core.engine.loop import Transformed
from conveyor.core.engine.routing import RoutingSpec, SourceMode
from conveyor.core.engine.source_loop import SourceLoop, SourceLoopConfig
from conveyor.core.errors import FencedError, TransientSinkError
from conveyor.core.model import ConnectorStatus, RetrySpec
from conveyor.sources.base import Polled, SourceMessage


class Crash(BaseException):
    """Stands for kill -9 at a point of the loop."""


class FakeSource:
    """A table of rows with ids; state = last id; commit deletes up to it (destructive)."""

    mode = SourceMode.POLLING
    destructive = True
    column_routing = True

    def __init__(self, rows: list[tuple[int, str]], batch: int = 3):
        self.rows = list(rows)
        self.batch = batch
        self.log: list[str] = []
        self.commit_fails = 0
        self.commits: list[int] = []

    def init(self, state):
        self.log.append(f"init {state}")

    def poll(self, state, max_records, max_wait_s):
        last = (state or {}).get("last", 0)
        new = [r for r in self.rows if r[0] > last][: self.batch]
        self.log.append(f"poll {last}")
        if not new:
            return None
        msgs = [
            SourceMessage(json.dumps({"id": i}).encode(), destination=d, key=None) for i, d in new
        ]
        return Polled(msgs, {"last": new[-1][0]}, origin="t")

    def commit(self, state):
        self.log.append(f"commit {state['last']}")
        if self.commit_fails:
            self.commit_fails -= 1
            raise RuntimeError("cannot delete: lock timeout")
        self.rows = [r for r in self.rows if r[0] > state["last"]]
        self.commits.append(state["last"])

    def close(self):
        self.log.append("close")

    def describe(self):
        return "fake"


def identity(batch: pa.Table) -> Transformed:
    """Decode like transform.decode json without a schema: one 'value' string column."""
    out = batch.drop_columns(["__value"]).append_column(
        "value", pc.cast(batch.column("__value"), pa.string())
    )
    return Transformed(table=out)


class FakeProducer:
    def __init__(self, partitions: int = 1):
        self.topics: dict[str, list[Any]] = {}
        self.fail: dict[str, int] = {}  # topic -> failures left (-1: forever)
        self.partitions = partitions
        self.crash_after_produce = False

    def init(self):
        pass

    def ensure(self, topic):
        self.topics.setdefault(topic, [])
        return self.partitions

    def produce(self, topic, records):
        left = self.fail.get(topic, 0)
        if left:
            self.fail[topic] = left - 1 if left > 0 else -1
            raise TransientSinkError(f"{topic}: request timed out")
        self.topics[topic].extend(json.loads(r.value)["id"] for r in records)

    def close(self):
        pass


class FakeWriter:
    def __init__(self, stop_after_batches: int | None = None):
        self.saved: list[dict] = []
        self.abandoned: list[dict] = []
        self.statuses: list[ConnectorStatus] = []
        self.crash_on_save = False
        self.fenced = False

    def save(self, state, *, abandoned=False):
        if abandoned:
            self.abandoned.append(dict(state))
        if self.fenced:
            raise FencedError("generation 1 is no longer current")
        if self.crash_on_save:
            raise Crash()
        self.saved.append(dict(state))

    def heartbeat(self, counters, status, reason):
        self.statuses.append(status)
        return None


def make_loop(source, producer, writer, *, state=None, routing=None, stop_when=None, **cfg):
    clock = [0.0]

    def sleep(s):
        clock[0] += s

    loop = SourceLoop(
        SourceLoopConfig(
            name="src",
            routing=routing or RoutingSpec(),
            retry=RetrySpec(delay=0.01, max_retries=1_000, max_outage=10_000),
            **cfg,
        ),
        source=source,
        transform=identity,
        producer=producer,
        writer=writer,
        state=state,
        clock=lambda: clock[0],
        sleep=sleep,
    )
    loop.stop_requested = stop_when or (lambda: not source.rows or loop.counters.batches >= 50)
    return loop


def all_ids(producer):
    return sorted(i for ids in producer.topics.values() for i in ids)


ROWS = [(i, ["a", "b", "c"][i % 3]) for i in range(1, 13)]


def test_strict_order_per_batch():
    src, prod, w = FakeSource(ROWS), FakeProducer(), FakeWriter()
    make_loop(src, prod, w).run()
    assert all_ids(prod) == list(range(1, 13))
    assert [s["last"] for s in w.saved] == [3, 6, 9, 12]
    assert src.commits == [3, 6, 9, 12]
    # Each batch: poll, then (state stored) commit, before the next poll.
    assert src.log[:5] == ["init None", "poll 0", "commit 3", "poll 3", "commit 6"]
    assert prod.topics == {"a": [3, 6, 9, 12], "b": [1, 4, 7, 10], "c": [2, 5, 8, 11]}


def test_one_failed_destination_fails_the_batch_and_the_same_rows_come_back():
    src, prod, w = FakeSource(ROWS), FakeProducer(), FakeWriter()
    prod.fail = {"b": 2}
    loop = make_loop(src, prod, w)
    loop.run()
    assert [s["last"] for s in w.saved] == [3, 6, 9, 12]  # no state moved past a failed batch
    assert sorted(set(all_ids(prod))) == list(range(1, 13))
    # The first batch's other destinations were produced three times (at least once).
    assert prod.topics["a"].count(3) == 3 and prod.topics["b"].count(1) == 1
    assert loop.counters.retries == 2
    assert ConnectorStatus.DEGRADED in w.statuses


def test_crash_before_the_state_write_duplicates_only_the_batch_in_flight():
    src, prod, w = FakeSource(ROWS), FakeProducer(), FakeWriter()
    w_calls = {"n": 0}
    orig = w.save

    def save(state):
        w_calls["n"] += 1
        if w_calls["n"] == 2:
            raise Crash()  # produced batch 2, died before storing its state
        orig(state)

    w.save = save
    with pytest.raises(Crash):
        make_loop(src, prod, w).run()
    stored = w.saved[-1]
    assert stored == {"last": 3} and src.commits == [3]
    # The next run starts from the stored state: batch 2 is produced again, nothing lost.
    w.save = orig
    make_loop(src, prod, w, state=stored).run()
    ids = all_ids(prod)
    assert sorted(set(ids)) == list(range(1, 13))
    dupes = [i for i in set(ids) if ids.count(i) > 1]
    assert sorted(dupes) == [4, 5, 6]  # exactly the batch in flight


def test_crash_between_state_and_commit_reruns_the_commit_after_the_first_poll():
    src, prod, w = FakeSource(ROWS), FakeProducer(), FakeWriter()
    orig_commit = src.commit

    def commit(state):
        if state["last"] == 6:
            raise Crash()
        orig_commit(state)

    src.commit = commit
    with pytest.raises(Crash):
        make_loop(src, prod, w).run()
    assert w.saved[-1] == {"last": 6} and src.commits == [3]
    src.commit = orig_commit
    src.log.clear()
    make_loop(src, prod, w, state=w.saved[-1]).run()
    assert src.log[:3] == ["init {'last': 6}", "poll 6", "commit 6"]  # owed commit after the poll
    ids = all_ids(prod)
    assert sorted(ids) == list(range(1, 13))  # no duplicates, no loss
    assert src.commits == [3, 6, 9, 12]


def test_failed_commits_degrade_after_the_threshold_and_one_success_clears():
    rows = [(i, "a") for i in range(1, 40)]
    src, prod, w = FakeSource(rows, batch=1), FakeProducer(), FakeWriter()
    src.commit_fails = 4
    loop = make_loop(src, prod, w, commit_failure_threshold=3)
    loop.stop_requested = lambda: loop.counters.batches >= 10
    loop.run()
    assert loop.counters.commit_failures == 4
    assert ConnectorStatus.DEGRADED in w.statuses
    assert w.statuses[-1] == ConnectorStatus.RUNNING and loop.commit_failures_in_row == 0
    # Each failed commit was re-run after the next poll; rows already covered never came back.
    assert all_ids(prod) == list(range(1, 11))
    # Batches 1 and 2 had failed commits (each re-run once after a poll); the first success,
    # batch 3's, covers them too (commits cover everything up to their state).
    assert src.commits[0] == 3


def test_fenced_state_write_stops_without_commit():
    src, prod, w = FakeSource(ROWS), FakeProducer(), FakeWriter()
    w.fenced = True
    with pytest.raises(FencedError):
        make_loop(src, prod, w).run()
    assert src.commits == [] and "close" in src.log


def test_breaker_opens_on_a_black_hole_while_others_flow_then_probes():
    rows = [(i, ["a", "hole"][i % 2]) for i in range(1, 41)]
    src, prod, w = FakeSource(rows, batch=4), FakeProducer(), FakeWriter()
    src.destructive = False  # polling, non-destructive: admission failures drop
    prod.fail = {"hole": -1}
    loop = make_loop(src, prod, w, breaker_cooldown_s=30.0)
    loop.stop_requested = lambda: (
        not any(r[1] == "a" for r in src.rows) or loop.counters.batches >= 20
    )
    loop.run()
    a = prod.topics["a"]
    assert sorted(set(a)) == [i for i in range(1, 41) if i % 2 == 0]
    # Only the first batch's rows for 'a' were produced again, once per failed attempt (5).
    assert {i: a.count(i) for i in set(a) if a.count(i) > 1} == {2: 6, 4: 6}
    assert prod.topics["hole"] == []
    stats = loop.heartbeat_payload()["routing"]
    assert stats["rejected"]["circuit_open"] > 0
    assert stats["destinations"]["hole"]["breaker"] in ("open", "half_open")
    assert "timed out" in stats["destinations"]["hole"]["last_error"]
    assert w.statuses[-1] == ConnectorStatus.DEGRADED  # flowing, but a destination is refused


def test_partition_id_out_of_range_rejects_only_that_row():
    src, prod, w = (
        FakeSource([(1, "a"), (2, "a")], batch=2),
        FakeProducer(partitions=2),
        FakeWriter(),
    )
    orig = src.poll

    def poll(state, n, wait):
        p = orig(state, n, wait)
        if p is None:
            return None
        msgs = [
            SourceMessage(m.payload, destination=m.destination, partition=k * 5)
            for k, m in enumerate(p.messages)
        ]
        return Polled(msgs, p.state, origin="t")

    src.poll = poll
    loop = make_loop(src, prod, w)
    loop.run()
    assert prod.topics["a"] == [1]
    assert loop.heartbeat_payload()["routing"]["rejected"] == {"partition_id_out_of_range": 1}
    assert w.saved == [{"last": 2}]


def test_abandon_batch_skips_the_first_batch_only():
    src, prod, w = FakeSource(ROWS), FakeProducer(), FakeWriter()
    loop = make_loop(src, prod, w, abandon_first_batch=True)
    loop.run()
    assert all_ids(prod) == list(range(4, 13))  # rows 1-3 were abandoned, never produced
    assert w.abandoned == [{"last": 3}] and w.saved[0] == {"last": 3}
    assert src.commits[0] == 3  # the source's side effects still run for the skipped rows
    assert loop.heartbeat_payload()["routing"]["rejected"] == {"abandoned": 3}


def test_allowlist_literals_are_prewarmed_before_the_first_poll():
    src, prod, w = FakeSource(ROWS), FakeProducer(), FakeWriter()
    seen: list[str] = []
    orig_ensure, orig_poll = prod.ensure, src.poll

    def ensure(topic):
        seen.append(f"ensure {topic}")
        return orig_ensure(topic)

    def poll(state, n, wait):
        seen.append("poll")
        return orig_poll(state, n, wait)

    prod.ensure, src.poll = ensure, poll
    routing = RoutingSpec(admission={"mode": "allowlist", "patterns": ["a", "b", "c", "x.*"]})
    make_loop(src, prod, w, routing=routing).run()
    assert seen[:4] == ["ensure a", "ensure b", "ensure c", "poll"]  # 'x.*' cannot be created ahead
    assert all_ids(prod) == list(range(1, 13))
    assert seen.count("ensure a") == 1  # created once, remembered


@given(
    st.lists(
        st.sampled_from(
            ["ok", "fail_b", "crash_before_save", "crash_before_commit", "commit_fails"]
        ),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 5),
)
def test_no_loss_and_duplicates_bounded_by_the_batch_in_flight(events, batch):
    """Whatever fails when, every row arrives; each failure or crash re-sends at most one batch."""
    rows = [(i, ["a", "b", "c"][i % 3]) for i in range(1, 21)]
    src, prod, w = FakeSource(rows, batch=batch), FakeProducer(), FakeWriter()
    script = list(events)
    step = {"event": "ok"}
    orig_save, orig_commit, orig_produce, orig_poll = w.save, src.commit, prod.produce, src.poll

    def save(state, **kw):
        if step["event"] == "crash_before_save":
            step["event"] = "ok"
            raise Crash()
        orig_save(state, **kw)

    def commit(state):
        if step["event"] == "crash_before_commit":
            step["event"] = "ok"
            raise Crash()
        if step["event"] == "commit_fails":
            step["event"] = "ok"
            raise RuntimeError("commit refused")
        orig_commit(state)

    def produce(topic, records):
        if step["event"] == "fail_b" and topic == "b":
            step["event"] = "ok"
            raise TransientSinkError("b: timed out")
        orig_produce(topic, records)

    def poll(state, n, wait):
        step["event"] = script.pop(0) if script else "ok"
        return orig_poll(state, n, wait)

    w.save, src.commit, prod.produce, src.poll = save, commit, produce, poll
    incidents = 0
    for _ in range(200):
        state = w.saved[-1] if w.saved else None
        loop = make_loop(src, prod, w, state=state)
        try:
            loop.run()
        except Crash:
            incidents += 1
        incidents += loop.counters.retries
        if not src.rows:
            break
    ids = all_ids(prod)
    assert sorted(set(ids)) == [r[0] for r in rows]  # nothing lost
    assert len(ids) - len(set(ids)) <= batch * incidents  # at most the batch in flight each time
