"""Downstream within seconds, under ``dagster dev`` with the scheduler and the sensors: a live
stream of click events (30/s over two partitions, record timestamps up to 1.5 s out of order,
a few very late ones) lands in PostgreSQL through a connector with default settings but its
``watermark`` (``allowed_lateness_s: 2``, ``idle_after_s: 10``); a user's minute-partitioned
asset (``tests/e2e/landed_defs.py``) runs under ``landed_through`` with its defaults (it begins
at the first watermark it sees: the partitions definition starts years ago, and nothing before
runs). The stream stops in the middle of a minute.

Checked against what was produced and what Dagster recorded:

- each minute's first run is requested by the sensor's first tick after the first report whose
  watermark passed the minute's end (an event, not a clock: the delays in seconds, which the
  issue bounds at 15 s, are printed for docs/BENCHMARKS.md, since a loaded machine delays the
  daemon's ticks themselves), and never before it;
- that run counts every on-time event of the minute (so it ran after all of them had landed),
  and no more than those and the very late ones (a run launched late on a loaded machine may
  see them); the minute's last run counts exactly the table's rows of that minute (the very
  late events made their minute run again);
- the minute the stream stopped in runs too, once the quiet stream is idle (idle means complete).

The delays (median, max) are printed for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import calendar
import contextlib
import json
import random
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from tests.e2e.conftest import SETTLE_S, DevStack, dagster_dev_workspace, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
RATE = 30.0  # events a second
STREAM_S = 290.0  # nearly five minutes: the stream stops inside a minute
LATENESS_S = 2.0
SENSOR = "landed_through__postgres__{schema}__orders"


def minute_of(ts: float) -> float:
    return float(int(ts // 60) * 60)


def key_of(minute: float) -> str:
    return time.strftime("%Y-%m-%d-%H:%M", time.gmtime(minute))


class Clicks:
    """A live producer: ``RATE`` events a second with record timestamps now minus up to 1.5 s
    (on time: within the lateness), and three very late ones (120 s old) at about 150 s."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.sent: list[tuple[int, float, bool]] = []  # (id, event time, very late)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clicks", daemon=True)

    def create_topic(self) -> None:
        from kafka.admin import KafkaAdminClient, NewTopic
        from kafka.errors import TopicAlreadyExistsError

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap)
        with contextlib.suppress(TopicAlreadyExistsError):
            admin.create_topics([NewTopic(self.topic, 2, 1)])
        admin.close()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        from kafka import KafkaProducer

        rng = random.Random(48)
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5)
        try:
            began, i, late_sent = time.time(), 0, False
            while time.time() - began < STREAM_S:
                now = time.time()
                batch = [(now - rng.uniform(0, 1.5), False)]
                if not late_sent and now - began > 150:
                    batch += [(now - 120, True)] * 3
                    late_sent = True
                for ts, very_late in batch:
                    producer.send(
                        self.topic,
                        value=json.dumps({"id": i}).encode(),
                        partition=i % 2,
                        timestamp_ms=int(ts * 1000),
                    )
                    self.sent.append((i, ts, very_late))
                    i += 1
                time.sleep(max(0.0, began + i / RATE - time.time()))
            producer.flush()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            self.error = e
        finally:
            producer.close()
            self.done.set()

    def per_minute(self, *, on_time_only: bool) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, ts, very_late in self.sent:
            if on_time_only and very_late:
                continue
            k = key_of(minute_of(ts))
            out[k] = out.get(k, 0) + 1
        return out


def downstream_runs(pg_url: str, schema: str) -> dict[str, list[tuple[int, str]]]:
    """Per minute, what each downstream run counted and its run id, in run order."""
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{schema}".per_minute',))
        if cur.fetchone()[0] is None:
            return {}
        cur.execute(f'SELECT minute, n, run_id FROM "{schema}".per_minute ORDER BY at')
        out: dict[str, list[tuple[int, str]]] = {}
        for minute, n, run_id in cur.fetchall():
            out.setdefault(minute, []).append((n, run_id))
        return out


def table_per_minute(pg_url: str, schema: str) -> dict[str, int]:
    with psycopg2.connect(pg_url) as c, c.cursor() as cur:
        cur.execute(
            f"SELECT to_char(date_trunc('minute', event_time AT TIME ZONE 'UTC'), "
            f"'YYYY-MM-DD-HH24:MI'), count(*) FROM \"{schema}\".orders GROUP BY 1"
        )
        return dict(cur.fetchall())


def first_report_past(stack: DevStack, key: list[str]) -> dict[float, float]:
    """Per minute end: when the first report (materialization or observation) whose
    watermark passed it was stored."""
    from dagster import AssetKey

    from conveyor.dagster.assets.checks import watermark_events, watermark_of

    marks: list[tuple[float, float]] = []
    with stack.instance() as instance:
        for e in watermark_events(instance, AssetKey(key), limit=5000):
            wm = watermark_of(e.metadata)
            if wm is not None:
                marks.append((e.timestamp, wm))
    out: dict[float, float] = {}
    best = float("-inf")
    for stored, wm in marks:  # in storage order
        if wm <= best:
            continue
        m = minute_of(best) + 60 if best != float("-inf") else minute_of(wm)
        while m <= wm:
            out.setdefault(m, stored)
            m += 60
        best = wm
    return out


def sensor_ticks(stack: DevStack, name: str) -> list[tuple[float, set[str]]]:
    """(start, run ids requested) of each tick of sensor ``name``, oldest first."""
    from dagster._core.scheduler.instigation import InstigatorType

    with stack.instance() as instance:
        for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
            if state.name == name:
                ticks = instance.get_ticks(
                    state.instigator_origin_id, state.selector_id, limit=10_000
                )
                return sorted((t.timestamp, set(t.run_ids)) for t in ticks)
    return []


def run_requests(stack: DevStack) -> dict[str, list[tuple[float, str, str]]]:
    """Per partition key: (creation time, why, run id) of each run the sensor requested."""
    out: dict[str, list[tuple[float, str, str]]] = {}
    with stack.instance() as instance:
        for r in instance.get_run_records():
            tags = r.dagster_run.tags
            if "conveyor/landed" not in tags:
                continue
            out.setdefault(tags["dagster/partition"], []).append(
                (r.create_timestamp.timestamp(), tags["conveyor/landed"], r.dagster_run.run_id)
            )
    return {k: sorted(v) for k, v in out.items()}


def test_each_minute_runs_within_seconds_of_the_watermark_and_the_last_one_after_the_stop(
    tansu: str, spark_remote: str, pg_url: str, pg_schema: str
) -> None:
    name = f"clicks_{uuid.uuid4().hex[:6]}"
    topic = f"t_{name}"
    spec = {
        "name": name,
        "source": {"topics": [topic]},
        "transform": {
            "decode": "json",
            "schema": "id BIGINT",
            "select": ["id", "__timestamp AS event_time"],
        },
        "sink": {
            "type": "postgres",
            "url": pg_url,
            "schema": pg_schema,
            "table": "orders",
            "create_table": True,
        },
        "watermark": {"allowed_lateness_s": LATENESS_S, "idle_after_s": 10},
    }
    sink_key = ["postgres", pg_schema, "orders"]
    env = {
        "E2E_LANDED_SINK_KEY": json.dumps(sink_key),
        "E2E_LANDED_PG_URL": pg_url,
        "E2E_LANDED_SCHEMA": pg_schema,
        "E2E_LANDED_START": str(1_700_000_000),  # November 2023: a flood, were it not bounded
    }
    clicks = Clicks(tansu, topic)
    clicks.create_topic()
    with dagster_dev_workspace(
        tansu,
        spark_remote,
        spec,
        extra_locations=[
            {"python_file": {"relative_path": str(ROOT / "tests/e2e/landed_defs.py")}}
        ],
        extra_env=env,
        prefix="conveyor-latency-e2e-",
    ) as s:
        # The connector's run is up and its watermark known (the empty topic idle: complete
        # through the clock) before the stream begins.
        wait_for(lambda: first_report_past(s, sink_key), 300 + SETTLE_S, "a first watermark")
        clicks.start()
        clicks.done.wait(STREAM_S + 120)
        assert clicks.error is None, clicks.error
        stopped_at = time.time()
        last_minute = key_of(minute_of(stopped_at))  # the minute the stream stopped in
        wait_for(
            lambda: last_minute in run_requests(s), 60 + 10 + SETTLE_S, "the last minute's run"
        )
        # Every minute's runs have written their counts (the late minute's second run too).
        late_minutes = {key_of(minute_of(ts)) for _, ts, v in clicks.sent if v}
        wait_for(
            lambda: _all_counted(pg_url, pg_schema, run_requests(s)),
            SETTLE_S,
            "every run's count",
        )
        check(s, sink_key, clicks, pg_url, pg_schema, late_minutes, last_minute, stopped_at)


def _all_counted(pg_url: str, schema: str, requests: dict[str, list[Any]]) -> bool:
    counted = {run for runs in downstream_runs(pg_url, schema).values() for _, run in runs}
    return all(run in counted for runs in requests.values() for _, _, run in runs)


def check(
    s: DevStack,
    key: list[str],
    clicks: Clicks,
    pg_url: str,
    schema: str,
    late_minutes: set[str],
    last_minute: str,
    stopped_at: float,
) -> None:
    requests = run_requests(s)
    passed = first_report_past(s, key)
    ticks = sensor_ticks(s, SENSOR.format(schema=schema))
    runs = downstream_runs(pg_url, schema)
    on_time = clicks.per_minute(on_time_only=True)
    every = clicks.per_minute(on_time_only=False)
    table = table_per_minute(pg_url, schema)
    assert table == every, "the table holds every event once"
    # It began with the partition holding the first watermark it saw (the newest of its first
    # tick), never from the definition's start in 2023.
    assert min(requests) >= key_of(min(passed)), (min(requests), min(passed))
    delays, end_to_request = {}, {}
    for minute, reqs in sorted(requests.items()):
        end = calendar.timegm(time.strptime(minute, "%Y-%m-%d-%H:%M")) + 60
        delays[minute] = round(reqs[0][0] - passed[end], 1)
        end_to_request[minute] = round(reqs[0][0] - end, 1)
    gaps = [b[0] - a[0] for a, b in zip(ticks, ticks[1:], strict=False)]
    print(
        f"\nminutes {len(delays)}: requested after the report passing the minute's end "
        f"median {statistics.median(delays.values()):.1f} s, max {max(delays.values()):.1f} s; "
        f"after the minute's end median {statistics.median(end_to_request.values()):.1f} s, "
        f"max {max(end_to_request.values()):.1f} s; sensor ticks {len(ticks)}, "
        f"median gap {statistics.median(gaps):.1f} s, max {max(gaps):.1f} s\n{delays}\n"
        f"{end_to_request}"
    )
    for minute, reqs in sorted(requests.items()):
        created, why, run_id = reqs[0]
        assert why == "watermark", (minute, reqs)
        assert delays[minute] >= 0, f"{minute}: requested before the watermark passed it"
        # Requested by the first tick that began after the report (or one that read it as it
        # was stored): the sensor reacts to the report, not to a clock of its own.
        end = calendar.timegm(time.strptime(minute, "%Y-%m-%d-%H:%M")) + 60
        by = next(t for t, ids in ticks if run_id in ids)
        assert by <= next(t for t, _ in ticks if t >= passed[end]), (minute, by, passed[end])
        counted = dict((r, n) for n, r in runs[minute])
        first = counted[run_id]
        assert on_time.get(minute, 0) <= first <= every.get(minute, 0), (minute, first)
        assert runs[minute][-1][0] == table.get(minute, 0), f"{minute}: its last run counted"
        if minute in late_minutes:
            assert [w for _, w, _ in reqs] == ["watermark", "late data"], reqs
    assert last_minute in requests and requests[last_minute][0][0] > stopped_at
    assert set(on_time) <= set(requests), "a minute with events did not run"
