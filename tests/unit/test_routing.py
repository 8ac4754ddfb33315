"""Route, admission grammar, cap, missing destinations and breakers (pure, core/engine/routing.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from conveyor.core.engine.routing import (
    AdmissionSpec,
    BreakerBoard,
    CircuitBreaker,
    Reason,
    Route,
    Router,
    RouteSpec,
    RoutingError,
    RoutingSpec,
    Row,
    SourceMode,
    admission_failure_default,
    pattern_matches,
    pattern_problem,
)
from conveyor.core.errors import ConfigError

segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=6)
topics = st.lists(segment, min_size=1, max_size=4).map(".".join)


# -- Route ---------------------------------------------------------------------------------


def test_route_follows_a_dotted_path_through_objects_only():
    r = Route.build(
        RouteSpec(path="order.region", mapping={"eu": "t.eu", "1": "t.one"}, default="t.rest")
    )
    assert r.destination(b'{"order": {"region": "eu"}}') == "t.eu"
    assert r.destination({"order": {"region": 1}}) == "t.one"  # scalars compared as JSON text
    assert r.destination({"order": {"region": "mars"}}) == "t.rest"  # unmatched: default
    assert r.destination({"order": [{"region": "eu"}]}) == "t.rest"  # arrays are not walked
    assert r.destination({"order": {"region": {"x": 1}}}) == "t.rest"  # an object is no key
    assert r.destination(b"not json") == "t.rest"
    assert Route.build(RouteSpec(path="a", mapping={"x": "t"})).destination({"a": "y"}) is None


def test_route_mapping_fetched_once_and_a_bad_fetch_refuses_to_start():
    calls = []

    def fetch(url: str) -> bytes:
        calls.append(url)
        return json.dumps({"eu": "orders.eu"}).encode()

    r = Route.build(RouteSpec(path="region", url="http://cfg/map.json"), fetch)
    assert [r.destination({"region": "eu"}) for _ in range(3)] == ["orders.eu"] * 3
    assert calls == ["http://cfg/map.json"]
    for body, match in [
        (b"[]", "non-empty JSON object"),
        (b"{}", "non-empty"),
        (b"{", "not JSON"),
        (b'{"a": 1}', "topic"),
    ]:
        with pytest.raises(ConfigError, match=match):
            Route.build(RouteSpec(path="region", url="http://cfg/x"), lambda _u, b=body: b)

    def down(_url: str) -> bytes:
        raise OSError("connection refused")

    with pytest.raises(ConfigError, match="cannot fetch the mapping.*connection refused"):
        Route.build(RouteSpec(path="region", url="http://cfg/x"), down)


def test_route_spec_needs_exactly_one_mapping_source_and_valid_topics():
    for bad in (
        {"path": "a"},
        {"path": "a", "mapping": {"x": "t"}, "url": "http://h/m"},
        {"path": "a", "url": "ftp://h/m"},
        {"path": "a..b", "mapping": {"x": "t"}},
        {"path": "a", "mapping": {"x": "bad topic"}},
    ):
        with pytest.raises(ValidationError):
            RouteSpec.model_validate(bad)


@given(st.dictionaries(segment, topics, min_size=1), segment, st.one_of(st.none(), topics))
def test_route_is_the_mapping_or_the_default(mapping, value, default):
    r = Route.build(RouteSpec(path="k", mapping=mapping, default=default))
    assert r.destination({"k": value}) == mapping.get(value, default)


# -- admission -------------------------------------------------------------------------------


def test_narrow_grammar():
    assert pattern_problem("orders.*") is None and pattern_problem("a.*.c") is None
    assert "admits every destination" in str(pattern_problem("*"))
    assert "admits every destination" in str(pattern_problem("*.*"))
    for bad in ("orders.eu*", "orders.**", "a..b", "", "a.#", "a.>"):
        assert pattern_problem(bad) is not None, bad
    with pytest.raises(ValidationError, match="admits every destination"):
        AdmissionSpec(mode="allowlist", patterns=["*.*"])
    with pytest.raises(ValidationError, match="needs patterns"):
        AdmissionSpec(mode="denylist")
    assert pattern_matches("orders.*", "orders.eu") and not pattern_matches(
        "orders.*", "orders.eu.x"
    )
    assert not pattern_matches("orders.*", "orders") and not pattern_matches("orders.*", "orders.")


@given(st.lists(segment, min_size=1, max_size=4), st.data())
def test_star_matches_exactly_one_segment(segments, data):
    topic = ".".join(segments)
    stars = data.draw(st.lists(st.booleans(), min_size=len(segments), max_size=len(segments)))
    if all(stars):
        stars[0] = False
    pattern = ".".join("*" if s else seg for s, seg in zip(stars, segments, strict=True))
    assert pattern_problem(pattern) is None
    assert pattern_matches(pattern, topic)
    assert not pattern_matches(pattern, topic + ".more")
    literal = stars.index(False)  # a changed literal segment no longer matches
    changed = [*segments[:literal], segments[literal] + "x", *segments[literal + 1 :]]
    assert not pattern_matches(pattern, ".".join(changed))


@given(topics, st.lists(topics, min_size=1, max_size=4))
def test_allowlist_and_denylist_are_complements(topic, patterns):
    allow = AdmissionSpec(mode="allowlist", patterns=patterns)
    deny = AdmissionSpec(mode="denylist", patterns=patterns)
    assert (allow.admits(topic) is None) != (deny.admits(topic) is None)
    assert allow.admits(topic) in (None, Reason.UNKNOWN)
    assert deny.admits(topic) in (None, Reason.DENYLIST)


def test_admission_failure_defaults_by_mode():
    assert admission_failure_default(SourceMode.CDC, False) == "error"
    assert admission_failure_default(SourceMode.POLLING, True) == "error"
    assert admission_failure_default(SourceMode.POLLING, False) == "drop"
    assert admission_failure_default(SourceMode.OPAQUE, False) == "drop"


# -- the plan ----------------------------------------------------------------------------------


def rows(*dests, partitions=None):
    return [Row(i, d, (partitions or {}).get(i)) for i, d in enumerate(dests)]


def test_cap_holds_across_batches_and_modes():
    for mode in ("open", "denylist", "allowlist"):
        adm = {"mode": mode, "patterns": ["x.*"]} if mode != "open" else {}
        if mode == "denylist":
            adm["patterns"] = ["zz.*"]
        router = Router(RoutingSpec(max_destinations=2, admission=adm))
        p = router.plan(rows("x.a", "x.b", "x.c", "x.a"))
        assert p.groups == {"x.a": [0, 3], "x.b": [1]} and p.rejected == {Reason.CAP: [2]}
        p = router.plan(rows("x.c", "x.b"))  # the cap remembers the destinations in use
        assert p.groups == {"x.b": [1]} and p.rejected == {Reason.CAP: [0]}


@given(st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), max_size=40), st.integers(1, 5))
def test_never_more_destinations_than_the_cap(dests, cap):
    router = Router(RoutingSpec(max_destinations=cap))
    seen: set[str] = set()
    for chunk in (dests[: len(dests) // 2], dests[len(dests) // 2 :]):
        p = router.plan(rows(*chunk))
        seen |= set(p.groups)
        assert p.routed + sum(len(v) for v in p.rejected.values()) == len(chunk)
    assert len(seen) <= cap


def test_missing_destination_default_drop_error():
    p = Router(RoutingSpec(default_destination="dflt")).plan(rows("a", None, ""))
    assert p.groups == {"a": [0], "dflt": [1, 2]} and p.unmatched_defaulted == 2
    p = Router(RoutingSpec(on_missing_destination="drop")).plan(rows("a", None))
    assert p.groups == {"a": [0]} and p.unmatched_dropped == [1]
    with pytest.raises(RoutingError, match="no destination"):
        Router(RoutingSpec(on_missing_destination="error")).plan(rows(None))
    with pytest.raises(RoutingError, match="no default_destination"):
        Router(RoutingSpec()).plan(rows(None))


def test_admission_failure_drop_or_error_by_mode():
    spec = RoutingSpec(admission={"mode": "denylist", "patterns": ["secret.*"]})
    p = Router(spec, mode=SourceMode.POLLING).plan(rows("ok", "secret.x"))
    assert p.groups == {"ok": [0]} and p.rejected == {Reason.DENYLIST: [1]}
    with pytest.raises(RoutingError, match="denylist"):
        Router(spec, mode=SourceMode.CDC).plan(rows("ok", "secret.x"))
    with pytest.raises(RoutingError, match="unknown"):
        Router(
            RoutingSpec(admission={"mode": "allowlist", "patterns": ["a.*"]}),
            mode=SourceMode.POLLING,
            destructive=True,
        ).plan(rows("b.c"))
    loose = RoutingSpec(
        admission={"mode": "allowlist", "patterns": ["a.*"]}, on_admission_failure="drop"
    )
    assert Router(loose, mode=SourceMode.CDC).plan(rows("b.c")).rejected == {Reason.UNKNOWN: [0]}


def test_partition_out_of_range_rejects_the_row_only():
    p = Router(RoutingSpec()).plan(
        rows("t", "t", "t", partitions={0: 0, 1: 3, 2: -1}), partitions=lambda _t: 3
    )
    assert p.groups == {"t": [0]} and p.rejected == {Reason.PARTITION_OUT_OF_RANGE: [1, 2]}


def test_open_breaker_rejects_under_drop_and_defers_under_error():
    p = Router(RoutingSpec(), mode=SourceMode.OPAQUE).plan(
        rows("bad", "good"), breaker_open=lambda t: t == "bad"
    )
    assert p.groups == {"good": [1]} and p.rejected == {Reason.CIRCUIT_OPEN: [0]}
    p = Router(RoutingSpec(), mode=SourceMode.CDC).plan(
        rows("bad", "good"), breaker_open=lambda t: t == "bad"
    )
    assert p.deferred == [0] and p.groups == {"good": [1]}


# -- breakers --------------------------------------------------------------------------------------


def test_breaker_opens_after_five_cools_down_and_probes_once():
    b = CircuitBreaker()
    for i in range(4):
        b.failure(float(i), "timeout")
        assert b.state(float(i)) == "closed"
    b.failure(4.0, "timeout")
    assert b.state(4.0) == "open" and not b.allows(20.0)
    assert b.state(34.0) == "half_open"
    assert b.allows(34.0) and not b.allows(34.1)  # one probe at a time
    b.failure(35.0, "timeout")  # the probe failed: open again for a full cool-down
    assert b.state(60.0) == "open" and b.state(65.0) == "half_open"
    assert b.allows(65.0)
    b.success()
    assert b.state(65.0) == "closed" and b.failures == 0


def test_failures_of_every_destination_at_once_do_not_trip_breakers():
    board = BreakerBoard()
    for i in range(10):
        board.record({"a": "broker gone", "b": "broker gone"}, float(i))
    assert board.open_count(10.0) == 0
    for i in range(5):
        board.record({"a": "black hole", "b": None}, 20.0 + i)
    assert board.get("a").state(25.0) == "open" and board.get("b").state(25.0) == "closed"
    assert board.open_count(25.0) == 1
