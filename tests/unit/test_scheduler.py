"""The pure scheduler: unit tests with a fixed clock, and properties over random clusters."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from conveyor.core.model import ConnectorStatus, DesiredState
from conveyor.core.planning import scheduler as s

NOW = 1_000_000.0
IDLE, RUNNING, STOPPED, ERROR, DEGRADED = (
    ConnectorStatus.IDLE,
    ConnectorStatus.RUNNING,
    ConnectorStatus.STOPPED,
    ConnectorStatus.ERROR,
    ConnectorStatus.DEGRADED,
)


def conn(name: str, **kw) -> s.ConnectorView:
    kw.setdefault("status_since", NOW - 1000)
    kw.setdefault("updated_at", NOW - 1000)
    return s.ConnectorView(name=name, **kw)


def running(name: str, broker: str, gen: int = 1, hb_age: float = 1.0, **kw) -> s.ConnectorView:
    return conn(
        name,
        status=RUNNING,
        broker_id=broker,
        generation=gen,
        run_id=f"run-{name}-{gen}",
        heartbeat_at=NOW - hb_age,
        **kw,
    )


def run_of(c: s.ConnectorView, status: str = "STARTED", **kw) -> s.RunView:
    kw.setdefault("generation", c.generation)
    kw.setdefault("broker_id", c.broker_id)
    return s.RunView(
        run_id=c.run_id or f"run-{c.name}-{c.generation}", connector=c.name, status=status, **kw
    )


def brokers(*ids: str, capacity: int = 8, **kw) -> list[s.BrokerView]:
    return [s.BrokerView(id=i, capacity=capacity, **kw) for i in ids]


def kinds(plan: s.Plan) -> list[tuple[str, str]]:
    return [(type(d).__name__, d.name) for d in plan.decisions]


# -- assignment -----------------------------------------------------------------------


def test_idle_connectors_spread_evenly_in_name_order_with_generation_tags():
    cs = [conn(f"c{i}") for i in range(6)]
    p = s.plan(cs, brokers("b1", "b2", "b3"), [], NOW)
    assigns = p.of(s.Assign)
    assert [a.name for a in assigns] == [f"c{i}" for i in range(6)]
    assert Counter(a.broker_id for a in assigns) == {"b1": 2, "b2": 2, "b3": 2}
    assert all(a.generation == 1 for a in assigns)


def test_assignment_is_stable_for_the_same_input():
    cs = [conn(f"c{i}") for i in range(7)]
    bs = brokers("b1", "b2", "b3")
    assert (
        s.plan(cs, bs, [], NOW).decisions
        == s.plan(list(reversed(cs)), list(reversed(bs)), [], NOW).decisions
    )


def test_least_loaded_is_weighted_by_throughput():
    busy = running("busy", "b1", msgs_per_s=50_000)  # weight 6
    cs = [busy, running("x", "b2"), running("y", "b2"), conn("new")]
    p = s.plan(cs, brokers("b1", "b2"), [run_of(busy), run_of(cs[1]), run_of(cs[2])], NOW)
    assert [(a.name, a.broker_id) for a in p.of(s.Assign)] == [("new", "b2")]


def test_capacity_is_respected_and_the_rest_wait():
    cs = [conn(f"c{i}") for i in range(5)]
    p = s.plan(cs, brokers("b1", "b2", capacity=2), [], NOW)
    assert len(p.of(s.Assign)) == 4
    assert "c4" not in {a.name for a in p.of(s.Assign)}


def test_draining_and_down_brokers_get_nothing_new():
    bs = [
        s.BrokerView("drain", 8, draining=True),
        s.BrokerView("down", 8, endpoint_up=False),
        s.BrokerView("ok", 8),
    ]
    p = s.plan([conn("a"), conn("b")], bs, [], NOW)
    assert {a.broker_id for a in p.of(s.Assign)} == {"ok"}
    assert p.down_brokers == {"down"}


def test_broker_whose_connectors_all_lost_heartbeat_is_down():
    cs = [running("a", "b1", hb_age=100), running("b", "b1", hb_age=90), running("c", "b2")]
    assert s.down_brokers(cs, brokers("b1", "b2"), NOW) == {"b1"}


def test_run_tags_of_the_broker_go_on_the_assignment():
    p = s.plan([conn("a")], [s.BrokerView("b1", 2, run_tags={"pool": "spark-a"})], [], NOW)
    assert p.of(s.Assign)[0].tags == {"pool": "spark-a"}


def test_spec_error_is_never_assigned_and_marked_error():
    p = s.plan([conn("bad", spec_error="sink.table: field required")], brokers("b1"), [], NOW)
    assert kinds(p) == [("MarkError", "bad")]


def test_hand_launched_run_is_adopted_not_doubled():
    c = conn("a")
    ui_run = s.RunView("ui-1", "a", generation=None, status="STARTING")
    p = s.plan([c], brokers("b1"), [ui_run], NOW)
    assert p.decisions == []


# -- heartbeat, reclaim, zombies --------------------------------------------------------


def test_stale_heartbeat_resets_to_idle_and_terminates_the_lost_run():
    c = running("a", "b1", hb_age=31)
    p = s.plan([c], brokers("b1", "b2"), [run_of(c)], NOW)
    assert ("Reset", "a") in kinds(p)
    assert [t.run_id for t in p.of(s.Terminate)] == [c.run_id]
    assert p.of(s.Assign) == [] or p.of(s.Assign)[0].generation == c.generation + 2


def test_heartbeat_within_timeout_is_left_alone():
    c = running("a", "b1", hb_age=29)
    assert s.plan([c], brokers("b1"), [run_of(c)], NOW).decisions == []


def test_per_connector_heartbeat_timeout():
    c = running("a", "b1", hb_age=45, heartbeat_timeout_s=60)
    assert s.plan([c], brokers("b1"), [run_of(c)], NOW).decisions == []


def test_runs_of_older_generations_and_stopped_or_deleted_connectors_are_terminated():
    c = running("a", "b1", gen=5)
    old = s.RunView("old", "a", generation=4, status="STARTED", broker_id="b1")
    stopped = conn("s", desired=DesiredState.STOPPED, status=STOPPED, generation=2)
    s_run = s.RunView("s-run", "s", generation=2, status="STARTED")
    ghost = s.RunView("ghost", "deleted", generation=1, status="STARTED")
    p = s.plan([c, stopped], brokers("b1"), [run_of(c), old, s_run, ghost], NOW)
    assert {(t.run_id, t.reason.split()[0]) for t in p.of(s.Terminate)} == {
        ("old", "run"),
        ("s-run", "connector"),
        ("ghost", "connector"),
    }


def test_run_left_on_the_old_broker_after_reassignment_is_terminated():
    c = running("a", "b2", gen=3)
    stray = s.RunView("stray", "a", generation=3, status="STARTED", broker_id="b1")
    p = s.plan([c], brokers("b1", "b2"), [run_of(c), stray], NOW)
    assert [t.run_id for t in p.of(s.Terminate)] == ["stray"]


def test_zombie_is_fenced_stopped_and_killed_when_local():
    c = running("a", "b1", hb_age=2)
    z = run_of(c, status="CANCELED", pid=4242, local=True)
    p = s.plan([c], brokers("b1"), [z], NOW)
    assert kinds(p) == [("KillZombie", "a"), ("Stop", "a")]
    assert p.of(s.KillZombie)[0].pid == 4242


def test_zombie_on_a_remote_launcher_is_fenced_but_not_killed():
    c = running("a", "b1", hb_age=2)
    p = s.plan([c], brokers("b1"), [run_of(c, status="CANCELED", pid=4242, local=False)], NOW)
    assert kinds(p) == [("Stop", "a")]


def test_zombie_whose_heartbeat_went_stale_is_still_stopped_and_killed():
    # A hung (SIGSTOPped) process stops heartbeating; a tick that comes after the heartbeat
    # timeout must not merely reset the connector and leave the process alive (CI, 2026-11-23).
    c = running("a", "b1", hb_age=45)
    z = run_of(c, status="CANCELED", pid=4242, local=True, process_alive=True)
    p = s.plan([c], brokers("b1", "b2"), [z], NOW)
    assert kinds(p) == [("KillZombie", "a"), ("Stop", "a")]
    assert p.of(s.Assign) == []


def test_zombie_whose_process_is_gone_is_stopped_without_a_kill():
    c = running("a", "b1", hb_age=45)
    z = run_of(c, status="CANCELED", pid=4242, local=True, process_alive=False)
    assert kinds(s.plan([c], brokers("b1"), [z], NOW)) == [("Stop", "a")]


def test_canceling_past_grace_is_reported_canceled():
    c = running("a", "b1", hb_age=100)
    r = run_of(c, status="CANCELING", canceling_since=NOW - 61)
    p = s.plan([c], brokers("b1"), [r], NOW)
    assert ("ReportCanceled", "a") in kinds(p)
    assert (
        s.plan([c], brokers("b1"), [replace(r, canceling_since=NOW - 10)], NOW).of(s.ReportCanceled)
        == []
    )


def test_assignment_whose_run_never_came_is_reset_after_launch_timeout():
    c = conn("a", broker_id="b1", generation=2, updated_at=NOW - 200)
    assert kinds(s.plan([c], brokers("b1"), [], NOW))[0] == ("Reset", "a")
    queued = s.RunView("q", "a", generation=2, status="QUEUED")
    assert s.plan([c], brokers("b1"), [queued], NOW).decisions == []


def test_a_run_that_released_its_stopped_connector_is_left_to_end_then_terminated():
    # Its loop saw the stop and released the connector: the run is ending by itself. A
    # terminate in that moment would mark it CANCELING after its end, with nothing to end it.
    released = conn(
        "a", desired=DesiredState.STOPPED, status=STOPPED, generation=3, run_id="r",
        status_since=NOW - 2,
    )  # fmt: skip
    run = s.RunView("r", "a", generation=3, status="STARTED")
    assert s.plan([released], brokers("b1"), [run], NOW).of(s.Terminate) == []
    # One that does not end within the grace is terminated, as is another run of it.
    late = NOW + s.SchedulerConfig().release_grace_s
    assert [t.run_id for t in s.plan([released], brokers("b1"), [run], late).of(s.Terminate)] == [
        "r"
    ]
    other = s.RunView("r2", "a", generation=3, status="STARTED")
    assert [t.run_id for t in s.plan([released], brokers("b1"), [other], NOW).of(s.Terminate)] == [
        "r2"
    ]
    # A connector still live under its run (the loop has not seen the stop yet): terminated.
    live = replace(released, status=RUNNING)
    assert [t.run_id for t in s.plan([live], brokers("b1"), [run], NOW).of(s.Terminate)] == ["r"]


def test_desired_stopped_without_a_run_settles_as_stopped():
    c = running("a", "b1", hb_age=500, desired=DesiredState.STOPPED)
    assert kinds(s.plan([c], brokers("b1"), [], NOW)) == [("Stop", "a")]


def test_stopped_connector_stays_stopped():
    c = conn("a", desired=DesiredState.STOPPED, status=STOPPED, generation=4)
    for _ in range(3):
        assert s.plan([c], brokers("b1"), [], NOW).decisions == []


# -- errors and restarts -----------------------------------------------------------------


def test_a_run_failed_under_a_live_connector_is_a_crash_relaunched_in_the_same_tick():
    # The connector is still Running: it reported no failure, its process died (kill -9).
    c = running("a", "b1", hb_age=0.5)
    p = s.plan([c], brokers("b1"), [run_of(c, status="FAILURE")], NOW)
    assert kinds(p) == [("Relaunch", "a"), ("Assign", "a")]
    (relaunch,) = p.of(s.Relaunch)
    assert relaunch.restarts == 1 and relaunch.while_run == c.run_id
    assert "relaunched at once" in relaunch.reason
    (assign,) = p.of(s.Assign)
    assert assign.generation == c.generation + 2  # the relaunch fenced the dead run's generation
    assert assign.expected_generation(c.generation) == c.generation + 1


def test_a_live_connector_whose_process_is_gone_is_relaunched_and_its_run_ended():
    # Dagster did not see the death (its run still STARTED): the pid says it.
    c = replace(running("a", "b1", hb_age=0.5), status=DEGRADED)
    dead = run_of(c, pid=77, local=True, process_alive=False)
    p = s.plan([c], brokers("b1"), [dead], NOW)
    assert kinds(p) == [("ReportCanceled", "a"), ("Relaunch", "a"), ("Assign", "a")]
    # alive, unknown (a remote launcher) or canceling: not a crash
    for run in (
        run_of(c, pid=77, local=True, process_alive=True),
        run_of(c, process_alive=None),
    ):
        assert s.plan([c], brokers("b1"), [run], NOW).decisions == []
    canceling = run_of(c, status="CANCELING", canceling_since=NOW, pid=77, process_alive=False)
    assert kinds(s.plan([c], brokers("b1"), [canceling], NOW)) == [("ReportCanceled", "a")]


def test_a_connector_that_failed_itself_waits_the_backoff_not_relaunched_at_once():
    # The op released it as Error before its run failed: a failing connector, not a crash.
    c = conn("a", status=ERROR, run_id="r1", status_since=NOW - 1, last_error="RuntimeError: x")
    failed = s.RunView("r1", "a", generation=0, status="FAILURE")
    assert s.plan([c], brokers("b1"), [failed], NOW).decisions == []
    later = replace(c, status_since=NOW - 10)
    assert kinds(s.plan([later], brokers("b1"), [failed], NOW)) == [
        ("Restart", "a"),
        ("Assign", "a"),
    ]


def test_a_crash_with_no_restart_allowed_is_an_error():
    c = running("a", "b1", max_restarts=0)
    p = s.plan([c], brokers("b1"), [run_of(c, status="FAILURE")], NOW)
    (d,) = p.decisions
    assert isinstance(d, s.MarkError) and d.while_run == c.run_id
    assert "no automatic restart is left" in d.message


class Cluster:
    """One connector under the planner on a fake clock: decisions applied, runs simulated."""

    def __init__(self, cfg: s.SchedulerConfig):
        self.cfg, self.now = cfg, NOW
        self.c = conn("a", status_since=NOW, updated_at=NOW)
        self.run: s.RunView | None = None
        self.log: list[tuple[float, str]] = []

    def tick(self) -> list[s.Decision]:
        runs = [self.run] if self.run else []
        p = s.plan([self.c], brokers("b1"), runs, self.now, self.cfg)
        for d in p.decisions:
            self.log.append((self.now, type(d).__name__))
            if d.change is not None and d.change.status is not None:
                self.c = replace(self.c, status_since=self.now)
            self.c = s._after(self.c, [d])
            if isinstance(d, s.Assign):  # the run starts and claims the connector
                self.run = s.RunView(f"r{d.generation}", "a", d.generation, "STARTED", "b1")
                self.c = replace(
                    self.c, status=RUNNING, run_id=self.run.run_id, status_since=self.now
                )
        if self.c.status == RUNNING:
            self.c = replace(self.c, heartbeat_at=self.now)
        return p.decisions

    def crash(self) -> None:
        assert self.run is not None
        self.run = replace(self.run, status="FAILURE")

    def advance(self, seconds: float) -> None:
        self.now += seconds
        if self.c.status == RUNNING and self.run and self.run.status == "STARTED":
            self.c = replace(self.c, heartbeat_at=self.now)  # a live run keeps heartbeating

    def ticks_until_running(self, every: float = 1.0) -> float:
        """Seconds from now until the connector runs again, ticking every ``every``."""
        start = self.now
        for _ in range(10_000):
            self.tick()
            if self.c.status == RUNNING and self.run and self.run.status == "STARTED":
                return self.now - start
            self.advance(every)
        raise AssertionError("never ran again")


def test_fake_clock_a_crash_relaunches_at_once_and_only_failing_restarts_back_off():
    cfg = s.SchedulerConfig(restart_backoff_s=10, healthy_reset_s=600)
    x = Cluster(cfg)
    assert x.ticks_until_running() == 0
    x.advance(3600)
    x.tick()  # a long healthy stretch: nothing to do
    x.crash()
    assert x.ticks_until_running() == 0  # relaunched in the tick that saw the crash
    assert x.c.restarts == 1
    # It crashes again 30 s later: the restart did not hold -> Error, backoff 20 s (grows)
    x.advance(30)
    x.crash()
    assert x.ticks_until_running() == cfg.restart_backoff(1) == 20
    x.advance(30)
    x.crash()
    assert x.ticks_until_running() == cfg.restart_backoff(2) == 40
    assert x.c.restarts == 3
    # Running a healthy stretch brings the budget back; the next crash is relaunched at once.
    x.advance(cfg.healthy_reset_s + 1)
    x.tick()
    assert x.c.restarts == 0
    x.crash()
    assert x.ticks_until_running() == 0
    # And crashing on every start ends in Error once max_restarts (5) are spent.
    for _ in range(4):
        x.advance(1)
        x.crash()
        x.ticks_until_running()
    x.advance(1)
    x.crash()
    x.tick()
    assert x.c.status == ERROR and x.c.restarts == 5
    x.advance(100_000)
    assert x.tick() == []


def test_error_restarts_with_exponential_backoff_then_gives_up():
    cfg = s.SchedulerConfig(restart_backoff_s=10)
    for restarts, wait in [(0, 10), (1, 20), (2, 40), (3, 80), (4, 160)]:
        c = conn("a", status=ERROR, restarts=restarts, status_since=NOW - wait + 1)
        assert s.plan([c], brokers("b1"), [], NOW, cfg).decisions == [], restarts
        c = replace(c, status_since=NOW - wait)
        (d,) = s.plan([c], brokers("b1"), [], NOW, cfg).of(s.Restart)
        assert d.restarts == restarts + 1
    done = conn("a", status=ERROR, restarts=5, status_since=NOW - 10_000)
    assert s.plan([done], brokers("b1"), [], NOW, cfg).decisions == []


def test_a_data_error_is_not_restarted_but_a_crash_or_outage_is():
    cfg = s.SchedulerConfig(restart_backoff_s=10)
    long_ago = NOW - 10_000
    data = conn(
        "a",
        status=ERROR,
        status_since=long_ago,
        last_error="data error: message t[0]@37 failed (data): value too long",
    )
    limit = conn(
        "b",
        status=ERROR,
        status_since=long_ago,
        last_error="data error: 9 messages in a row failed",
    )
    crash = conn("c", status=ERROR, status_since=long_ago, last_error="RuntimeError: boom")
    outage = conn("d", status=ERROR, status_since=long_ago, last_error="send kept failing for 600s")
    p = s.plan([data, limit, crash, outage], brokers("b1"), [], NOW, cfg)
    assert sorted(d.name for d in p.of(s.Restart)) == ["c", "d"]


def test_restart_budget_comes_back_after_a_healthy_stretch():
    c = running("a", "b1", restarts=3, status_since=NOW - 601)
    assert kinds(s.plan([c], brokers("b1"), [run_of(c)], NOW)) == [("ClearRestarts", "a")]


def test_one_bad_connector_does_not_stop_the_tick():
    class Boom(s.ConnectorView):
        def heartbeat_age(self, now):  # type: ignore[override]
            raise RuntimeError("boom")

    bad = Boom(name="bad", status=RUNNING, broker_id="b1", heartbeat_at=NOW)
    p = s.plan([bad, conn("good")], brokers("b1"), [], NOW)
    assert ("Failed", "bad") in kinds(p)
    assert [a.name for a in p.of(s.Assign)] == ["good"]


# -- drain, down, rebalance ----------------------------------------------------------------


def test_drain_moves_every_connector_off_the_broker():
    cs = [running("a", "b1"), running("b", "b1"), running("c", "b2")]
    bs = [s.BrokerView("b1", 8, draining=True), s.BrokerView("b2", 8)]
    p = s.plan(cs, bs, [run_of(c) for c in cs], NOW)
    assert sorted(m.name for m in p.of(s.Move)) == ["a", "b"]
    assert all(m.run_id for m in p.of(s.Move))


def test_broker_removed_from_the_file_is_marked_gone_once_and_its_connectors_move():
    stored = [s.BrokerView("b1", 8), s.BrokerView("b2", 8), s.BrokerView("b3", 8, gone=True)]
    assert s.gone_brokers(["b2"], stored) == ["b1"]  # b3 is already marked
    assert s.gone_brokers(["b1", "b2", "b3"], stored) == []
    cs = [running("a", "b1"), running("b", "b2")]
    bs = [s.BrokerView("b1", 8, gone=True), s.BrokerView("b2", 8)]
    p = s.plan(cs, bs, [run_of(c) for c in cs], NOW)
    (m,) = p.of(s.Move)
    assert m.name == "a" and "gone from the brokers file" in m.reason and m.run_id
    # next tick, the moved connector is assigned to the remaining broker, never to b1
    after = [conn("a", generation=2, last_moved_at=NOW), cs[1]]
    (a,) = s.plan(after, bs, [run_of(cs[1])], NOW + 5).of(s.Assign)
    assert a.name == "a" and a.broker_id == "b2"


def test_down_endpoint_moves_connectors_only_when_another_broker_has_room():
    cs = [running("a", "b1")]
    bs = [s.BrokerView("b1", 8, endpoint_up=False), s.BrokerView("b2", 8)]
    assert [m.name for m in s.plan(cs, bs, [run_of(cs[0])], NOW).of(s.Move)] == ["a"]
    assert s.plan(cs, bs[:1], [run_of(cs[0])], NOW).of(s.Move) == []


def test_rebalance_moves_one_connector_per_tick_with_cooldown_and_no_flapping():
    cs = [running(f"c{i}", "b1") for i in range(4)]
    runs = [run_of(c) for c in cs]
    p = s.plan(cs, brokers("b1", "b2"), runs, NOW)
    (m,) = p.of(s.Move)
    # cool-down: a move 60 s ago blocks the next one
    moved = [replace(c, last_moved_at=NOW - 60) if c.name == m.name else c for c in cs]
    assert s.plan(moved, brokers("b1", "b2"), runs, NOW).of(s.Move) == []
    # balanced within the threshold: nothing moves
    bal = [running("a", "b1"), running("b", "b1"), running("c", "b2")]
    assert s.plan(bal, brokers("b1", "b2"), [run_of(c) for c in bal], NOW).decisions == []


def test_moved_connector_is_reassigned_to_the_least_loaded_broker_next_tick():
    cs = [running(f"c{i}", "b1") for i in range(4)]
    (m,) = s.plan(cs, brokers("b1", "b2"), [run_of(c) for c in cs], NOW).of(s.Move)
    after = [
        conn(c.name, generation=c.generation + 1, last_moved_at=NOW) if c.name == m.name else c
        for c in cs
    ]
    (a,) = s.plan(
        after, brokers("b1", "b2"), [run_of(c) for c in after if c.name != m.name], NOW + 5
    ).of(s.Assign)
    assert (a.name, a.broker_id) == (m.name, "b2")


# -- properties over random clusters ---------------------------------------------------------

STATUSES = [IDLE, RUNNING, STOPPED, ERROR, DEGRADED]


@st.composite
def clusters(draw):
    nb = draw(st.integers(1, 6))
    bs = [
        s.BrokerView(
            f"b{i}",
            capacity=draw(st.integers(1, 6)),
            draining=draw(st.booleans()),
            endpoint_up=draw(st.booleans()) or draw(st.booleans()),
        )
        for i in range(nb)
    ]
    nc = draw(st.integers(0, 30))
    cs, runs = [], []
    for i in range(nc):
        status = draw(st.sampled_from(STATUSES))
        broker = draw(st.one_of(st.none(), st.sampled_from([b.id for b in bs] + ["gone"])))
        gen = draw(st.integers(0, 20))
        hb = draw(st.one_of(st.none(), st.floats(0, 120)))
        c = conn(
            f"c{i:02d}",
            status=status,
            desired=draw(st.sampled_from(list(DesiredState))),
            broker_id=broker if status in (RUNNING, DEGRADED, IDLE) else None,
            generation=gen,
            run_id=f"r{i}" if draw(st.booleans()) else None,
            heartbeat_at=None if hb is None else NOW - hb,
            msgs_per_s=draw(st.floats(0, 100_000)),
            restarts=draw(st.integers(0, 6)),
            status_since=NOW - draw(st.floats(0, 2000)),
            updated_at=NOW - draw(st.floats(0, 400)),
        )
        cs.append(c)
        if c.run_id:
            runs.append(
                s.RunView(
                    c.run_id,
                    c.name,
                    generation=draw(st.one_of(st.none(), st.integers(0, gen))),
                    status=draw(
                        st.sampled_from(
                            ["QUEUED", "STARTED", "CANCELING", "CANCELED", "FAILURE", "SUCCESS"]
                        )
                    ),
                    broker_id=c.broker_id,
                    pid=1234,
                    local=draw(st.booleans()),
                    canceling_since=NOW - draw(st.floats(0, 200)),
                )
            )
    return cs, bs, runs


def _settled(cs, p):
    by = {c.name: c for c in cs}
    for c in cs:
        by[c.name] = s._after(c, [d for d in p.decisions if d.name == c.name])
    return list(by.values())


@given(clusters())
def test_property_capacity_never_exceeded_by_assignments(cluster):
    cs, bs, runs = cluster
    p = s.plan(cs, bs, runs, NOW)
    after = _settled(cs, p)
    cap = {b.id: b.capacity for b in bs}
    new = Counter(a.broker_id for a in p.of(s.Assign))
    held = Counter(c.broker_id for c in after if s._occupies(c))
    for bid, n in new.items():
        assert held[bid] <= cap[bid], (bid, held[bid], cap[bid])
        assert n >= 1


@given(clusters())
def test_property_never_assigned_to_a_draining_or_down_broker(cluster):
    cs, bs, runs = cluster
    p = s.plan(cs, bs, runs, NOW)
    bad = {b.id for b in bs if b.draining} | p.down_brokers
    assert not any(a.broker_id in bad for a in p.of(s.Assign))


@given(clusters())
def test_property_generations_only_grow_and_each_connector_gets_one_ownership_change(cluster):
    cs, bs, runs = cluster
    p = s.plan(cs, bs, runs, NOW)
    before = {c.name: c.generation for c in cs}
    for c in _settled(cs, p):
        assert c.generation >= before[c.name]
    for a in p.of(s.Assign):
        assert a.generation > before[a.name]
    owners = Counter(
        d.name
        for d in p.decisions
        if isinstance(d, (s.Reset, s.Move, s.Stop, s.Restart, s.Relaunch))
    )
    assert all(n == 1 for n in owners.values())


@given(st.integers(1, 8), st.integers(0, 40))
def test_property_equal_weights_spread_within_one(nb, nc):
    bs = brokers(*[f"b{i}" for i in range(nb)], capacity=100)
    p = s.plan([conn(f"c{i:02d}") for i in range(nc)], bs, [], NOW)
    counts = Counter(a.broker_id for a in p.of(s.Assign))
    per = [counts.get(b.id, 0) for b in bs]
    assert sum(per) == nc
    assert max(per) - min(per) <= 1


@given(st.integers(2, 5), st.integers(2, 20))
def test_property_rebalance_converges_without_flapping(nb, nc):
    """Start with everything on one broker; apply plans tick by tick until quiet."""
    bs = brokers(*[f"b{i}" for i in range(nb)], capacity=100)
    cs = {f"c{i:02d}": running(f"c{i:02d}", "b0") for i in range(nc)}
    now = NOW
    moves: Counter[str] = Counter()
    for _tick in range(200):
        runs = [run_of(c) for c in cs.values() if c.broker_id]
        p = s.plan(list(cs.values()), bs, runs, now)
        if not p.decisions:
            break
        for d in p.decisions:
            c = cs[d.name]
            if isinstance(d, s.Move):
                moves[d.name] += 1
                cs[d.name] = replace(s._after(c, [d]), last_moved_at=now)
            elif isinstance(d, s.Assign):
                cs[d.name] = replace(
                    c,
                    broker_id=d.broker_id,
                    generation=d.generation,
                    status=RUNNING,
                    heartbeat_at=now,
                    run_id=f"r{d.generation}",
                    status_since=now,
                )
        now += 200  # past the cool-down
        cs = {k: replace(v, heartbeat_at=now) if v.status == RUNNING else v for k, v in cs.items()}
    else:
        raise AssertionError("did not settle")
    per = Counter(c.broker_id for c in cs.values())
    assert max(per.values()) - min(per.get(b.id, 0) for b in bs) <= 1
    assert all(n == 1 for n in moves.values()), moves


def test_lost_run_whose_process_is_gone_is_reported_canceled_not_terminated():
    c = running("a", "b1", hb_age=31)
    p = s.plan([c], brokers("b1"), [run_of(c, pid=77, local=True, process_alive=False)], NOW)
    assert ("ReportCanceled", "a") in kinds(p) and p.of(s.Terminate) == []
    stuck = run_of(
        c, status="CANCELING", canceling_since=NOW - 1, pid=77, local=True, process_alive=False
    )
    assert ("ReportCanceled", "a") in kinds(s.plan([c], brokers("b1"), [stuck], NOW))


def test_connector_without_a_job_in_the_code_location_waits_for_a_reload():
    p = s.plan([conn("new", launchable=False), conn("old")], brokers("b1"), [], NOW)
    assert [a.name for a in p.of(s.Assign)] == ["old"]


# -- a connector whose run waits in the run queue ------------------------------------------


def test_an_assigned_connector_whose_run_stays_queued_says_which_limit_holds_it():
    c = conn("a", broker_id="b1", generation=2, updated_at=NOW - 200)
    fresh = s.RunView("q", "a", generation=2, status="QUEUED", status_since=NOW - 5)
    assert s.plan([c], brokers("b1"), [fresh], NOW).decisions == []  # queued 5 s: not yet
    held = replace(
        fresh, status_since=NOW - 45, blocker="tag limit conveyor/broker=b1: 8 of 8 in progress"
    )
    [d] = s.plan([c], brokers("b1"), [held], NOW).decisions
    assert isinstance(d, s.Waiting) and d.run_id == "q"
    assert d.reason == (
        "waiting for a run on b1: run q queued over 30s, "
        "tag limit conveyor/broker=b1: 8 of 8 in progress"
    )
    assert d.reason.startswith(s.WAITING_FOR_A_RUN)
    # The reason is a note: status, broker and generation stay; the store keeps it as the
    # connector's last error and writes it once.
    assert d.change.error == d.reason and d.change.is_recorded(IDLE)
    assert d.change.applied_to(c) == c
    said = replace(c, last_error=d.reason)
    assert s.plan([said], brokers("b1"), [held], NOW).decisions == []
    # Without a blocker (the daemon is not dequeuing), the reason says so.
    [d] = s.plan([c], brokers("b1"), [replace(held, blocker=None)], NOW).decisions
    assert "not dequeued (is dagster-daemon running?)" in d.reason


def test_a_run_launched_but_not_started_is_reported_and_an_old_generation_is_not():
    c = conn("a", broker_id="b1", generation=2, updated_at=NOW - 200)
    starting = s.RunView("r", "a", generation=2, status="STARTING", status_since=NOW - 100)
    [d] = s.plan([c], brokers("b1"), [starting], NOW).decisions
    assert d.reason == "waiting for a run on b1: run r launched, not started after 30s"
    # A configurable bound.
    cfg = s.SchedulerConfig(run_wait_s=120)
    assert s.plan([c], brokers("b1"), [starting], NOW, cfg).decisions == []
    # A running connector's run, or a stopped connector, never waits.
    live = running("a", "b1", gen=2)
    assert not s.plan([live], brokers("b1"), [replace(starting, run_id=live.run_id)], NOW).of(
        s.Waiting
    )
    stopped = replace(c, desired=DesiredState.STOPPED)
    assert not s.plan([stopped], brokers("b1"), [starting], NOW).of(s.Waiting)
