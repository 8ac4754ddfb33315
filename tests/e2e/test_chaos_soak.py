"""A bounded chaos run under a real ``dagster dev`` (marker ``soak``: not in the default run).

Three connectors (Kafka -> PostgreSQL, plain COPY, no deduplication) run with the
default settings while a producer writes continuously. For ``CONVEYOR_SOAK_S`` seconds
(default 420) a seeded random schedule injects one fault every 30-50 s, each kind once
in every round of four, in a shuffled order:

- ``kill9``: a connector's run process is killed with SIGKILL;
- ``outage``: the sinks' PostgreSQL role may not connect for 20 s (sessions killed);
- ``spark``: the Spark Connect server is stopped and started again on its port;
- ``lock``: a second SQLite connection holds ``BEGIN EXCLUSIVE`` on the meta store 12 s.

Then everything is restored, the producer stops and the test waits until every
connector has caught up. Checked: zero messages lost (every produced id in its table),
duplicates at most one batch per fault, and every fault visible in the affected
connectors' history. The figures are printed and, with ``CONVEYOR_SOAK_REPORT`` set,
written there as JSON (docs/RELIABILITY.md quotes them).

    .venv/bin/python -m pytest -n 0 -m soak tests/e2e/test_chaos_soak.py -s
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from conveyor.core.model import ConnectorStatus
from conveyor.spark.server import start_spark_connect
from tests.e2e.conftest import wait_for
from tests.e2e.test_scheduler_e2e import DevHarness, dev, table_counts  # noqa: F401

pytestmark = [pytest.mark.soak, pytest.mark.e2e, pytest.mark.timeout(3600)]

SOAK_S = float(os.environ.get("CONVEYOR_SOAK_S", "420"))
SEED = int(os.environ.get("CONVEYOR_SOAK_SEED", "15"))
BATCH = 200  # batch.max_records: the duplicate bound per fault
RATE = 40  # messages per second per topic
KEYS = ("a", "b", "c")
FAULTS = ("kill9", "outage", "spark", "lock")


def admin(pg_url: str, sql: str) -> None:
    c = psycopg2.connect(pg_url)
    c.autocommit = True
    with c.cursor() as cur:
        cur.execute(sql)
    c.close()


class SparkServer:
    """This module's Spark Connect server, restartable on its port."""

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        self.server = start_spark_connect(work_dir=work_dir)
        self.port = self.server.port

    @property
    def remote(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def restart(self) -> None:
        self.server.stop()
        self.server = start_spark_connect(port=self.port, work_dir=self.work_dir)

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkServer]:
    s = SparkServer(tmp_path_factory.mktemp("spark_chaos"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def spark_remote(spark: SparkServer) -> str:
    return spark.remote


class Producer(threading.Thread):
    """Writes RATE messages per second to each topic, ids 0, 1, 2... per topic."""

    def __init__(self, bootstrap: str, topics: dict[str, str]):
        super().__init__(daemon=True)
        from kafka import KafkaProducer
        from kafka.admin import KafkaAdminClient, NewTopic

        a = KafkaAdminClient(bootstrap_servers=bootstrap)
        a.create_topics([NewTopic(t, 2, 1) for t in topics.values()])
        a.close()
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks="all")
        self.topics = topics
        self.sent = dict.fromkeys(topics, 0)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            started = time.monotonic()
            for k, topic in self.topics.items():
                for _ in range(RATE // 4):
                    i = self.sent[k]
                    v = json.dumps({"id": i, "name": f"n{i}", "amount": i * 0.5}).encode()
                    self.producer.send(topic, key=str(i).encode(), value=v, partition=i % 2)
                    self.sent[k] = i + 1
            self.producer.flush()
            self.halt.wait(max(0.0, 0.25 - (time.monotonic() - started)))
        self.producer.flush()
        self.producer.close()


def test_chaos_loses_nothing_and_every_fault_is_in_the_history(dev, tansu, pg_url, spark):  # noqa: F811
    schema = f"chaos_{uuid.uuid4().hex[:8]}"
    role = f"conveyor_chaos_{uuid.uuid4().hex[:6]}"
    admin(pg_url, f'CREATE SCHEMA "{schema}"; CREATE ROLE "{role}" LOGIN')
    admin(pg_url, f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
    names = {k: f"chaos_{k}_{uuid.uuid4().hex[:4]}" for k in KEYS}
    topics = {k: f"chaos_{k}_{uuid.uuid4().hex[:8]}" for k in KEYS}
    for k in KEYS:
        admin(
            pg_url,
            f'CREATE TABLE "{schema}".{k} (id BIGINT, name TEXT, amount DOUBLE PRECISION); '
            f'GRANT INSERT, SELECT ON "{schema}".{k} TO "{role}"',
        )
        spec: dict[str, Any] = {
            "name": names[k],
            "source": {"topics": [topics[k]]},
            "batch": {"max_records": BATCH},
            "transform": {"decode": "json", "schema": "id BIGINT, name STRING, amount DOUBLE"},
            "sink": {
                "type": "postgres",
                "url": f"postgresql://{role}@127.0.0.1:5432/test",
                "schema": schema,
                "table": k,
                "connect_timeout_s": 2,
            },
        }
        (dev.home["connectors"] / f"{names[k]}.yaml").write_text(yaml.safe_dump(spec))
    producer = Producer(tansu, topics)
    rng = random.Random(SEED)
    faults: list[dict[str, Any]] = []
    meta_db = Path(dev.home["home"]) / "meta.db"
    locks: list[threading.Thread] = []
    h: DevHarness | None = None
    try:
        h = dev.start()
        store = h.store
        wait_for(
            lambda: all(
                (r := {x.name: x for x in store.list()}).get(n) is not None
                and r[n].status == ConnectorStatus.RUNNING
                for n in names.values()
            ),
            300,
            "three connectors running",
        )
        producer.start()
        began = time.monotonic()
        schedule: list[str] = []
        while time.monotonic() - began < SOAK_S:
            time.sleep(rng.uniform(30, 50))
            if not schedule:
                schedule = rng.sample(FAULTS, len(FAULTS))
            kind = schedule.pop()
            at = time.time()
            fault: dict[str, Any] = {"kind": kind, "at": at, "t": round(time.monotonic() - began)}
            if kind == "kill9":
                k = rng.choice(KEYS)
                row = store.get(names[k])
                fault["connector"] = names[k]
                if row.run_pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(row.run_pid, signal.SIGKILL)
                    fault["pid"] = row.run_pid
                else:
                    fault["skipped"] = "no run"
            elif kind == "outage":
                admin(pg_url, f'ALTER ROLE "{role}" CONNECTION LIMIT 0')
                admin(
                    pg_url,
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    f"WHERE usename = '{role}'",
                )
                time.sleep(20)
                admin(pg_url, f'ALTER ROLE "{role}" CONNECTION LIMIT -1')
            elif kind == "spark":
                spark.restart()
            else:
                locked = threading.Event()

                def hold(locked: threading.Event = locked) -> None:
                    c = sqlite3.connect(meta_db, isolation_level=None, timeout=60)
                    c.execute("BEGIN EXCLUSIVE")
                    locked.set()
                    time.sleep(12)
                    c.execute("COMMIT")
                    c.close()

                t = threading.Thread(target=hold, daemon=True)
                t.start()
                locks.append(t)
                locked.wait(60)
            fault["done"] = time.time()
            faults.append(fault)
            print(f"fault {fault}", flush=True)
        producer.halt.set()
        producer.join(60)
        for t in locks:
            t.join(60)
        sent = dict(producer.sent)
        caught_up = time.monotonic()
        wait_for(
            lambda: all(table_counts(pg_url, schema, k)[1] == sent[k] for k in KEYS),
            900,
            f"every produced message delivered ({sent})",
            interval=2.0,
        )
        catch_up_s = time.monotonic() - caught_up
        counts = {k: table_counts(pg_url, schema, k) for k in KEYS}
        history = {k: store.history(names[k], 2000) for k in KEYS}
        report = {
            "soak_s": SOAK_S,
            "seed": SEED,
            "produced": sent,
            "rows": {k: counts[k][0] for k in KEYS},
            "distinct": {k: counts[k][1] for k in KEYS},
            "duplicates": {k: counts[k][0] - counts[k][1] for k in KEYS},
            "faults": [{x: f[x] for x in f if x not in ("at", "done")} for f in faults],
            "catch_up_s": round(catch_up_s),
            "history": {
                k: [f"{x.to_status}: {x.reason}"[:160] for x in reversed(history[k])] for k in KEYS
            },
        }
        print(json.dumps(report, indent=2), flush=True)
        if os.environ.get("CONVEYOR_SOAK_REPORT"):
            Path(os.environ["CONVEYOR_SOAK_REPORT"]).write_text(json.dumps(report, indent=2))
        # Zero loss: every produced id is in its table.
        assert all(counts[k][1] == sent[k] for k in KEYS), report
        # Duplicates: at most one batch per fault (a fault touches every connector at most once).
        n = len([f for f in faults if not f.get("skipped")])
        assert all(counts[k][0] - counts[k][1] <= BATCH * n for k in KEYS), report
        # Every fault is in the history of the connectors it touched.
        for f in faults:
            if f.get("skipped"):
                continue
            window = [
                (k, x)
                for k in KEYS
                for x in history[k]
                if f["at"] - 1 <= x.at <= f["done"] + 90
                and (f["kind"] != "kill9" or names[k] == f["connector"])
            ]
            if f["kind"] == "kill9":
                # Lost heartbeat, or Dagster saw the run's process die first (run failed).
                seen = any(
                    (x.to_status == "Idle" and "heartbeat" in x.reason)
                    or (x.to_status == "Error" and "failed" in x.reason)
                    for _, x in window
                )
            elif f["kind"] == "lock":
                seen = any("meta store" in x.reason or "locked" in x.reason for _, x in window)
            else:
                seen = any(x.to_status in ("Degraded", "Error") for _, x in window)
            assert seen, (f, [f"{k} {x.to_status}: {x.reason}" for k, x in window])
    finally:
        producer.halt.set()
        with contextlib.suppress(Exception):
            admin(pg_url, f'ALTER ROLE "{role}" CONNECTION LIMIT -1')
        if h is not None:
            for n in names.values():
                h.cli("connector", "stop", n)
        with contextlib.suppress(Exception):
            admin(pg_url, f'DROP SCHEMA "{schema}" CASCADE')
            admin(pg_url, f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
