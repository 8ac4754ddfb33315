"""Upgrade from the release before issue 44 (its point 4): a meta store, an offsets table, a Redis
offsets hash and a task store written by that release's code open under this one; every
connector resumes where it was, nothing lost, nothing twice.

The state is made by running the previous release (``PREVIOUS_RELEASE``, a git worktree of it)
in subprocesses (``upgrade_previous_release.py``), against one private tansu (it keeps its log
in memory, so it stays up across the upgrade), one meta store (SQLite, in a test home), one
PostgreSQL schema and the machine's Redis:

- ``pg`` (exactly once into PostgreSQL), ``redis`` (exactly once into Redis), ``alo`` (at least
  once into PostgreSQL: its positions live only in the meta store) each run until they have
  committed the first messages, and are stopped; the process ends;
- ``killed`` (exactly once into PostgreSQL) is SIGKILLed mid-stream, its last batch committed
  in the target (rows and offsets-table row) but not in the meta store;
- ``tasks``: a partition-task group written through that release's ``TaskStore``.

Then this checkout's code (this process) produces more and runs each connector again the same
way (its job in process, against the same meta store, schema, Redis and broker).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import redis
import yaml

from conveyor.brokers.embedded import start_embedded_broker
from tests.e2e.conftest import produce
from tests.e2e.upgrade_previous_release import DEADLINE_S, JobThread, committed, live, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

#: The release before issue 44 (the last commit landed before positions named their log,
#: destination and incarnation): the state this test upgrades from is written by its code.
PREVIOUS_RELEASE = "fa1e65f"

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("upgrade_previous_release.py")
SCHEMA = "id BIGINT, name STRING, amount DOUBLE"
FIRST = 200  # produced per topic before the upgrade (killed: KILLED_FIRST)
KILLED_FIRST = 400
MORE = 200  # produced per topic after it
TASK_OFFSET = 50  # the previous release's task 0 committed this in each partition
RAN = ("pg", "redis", "alo")  # stopped by the previous release, each after FIRST
EXACTLY_ONCE_PG = ("pg", "killed")


@dataclass
class Connector:
    name: str
    topic: str
    path: Path
    sink: dict[str, Any]
    first: int = FIRST
    max_records: int = 50

    def write_spec(self, tansu: str) -> None:
        spec = {
            "name": self.name,
            "source": {"topics": [self.topic], "bootstrap_servers": tansu},
            "batch": {"max_records": self.max_records, "max_wait_ms": 200},
            "transform": {"decode": "json", "schema": SCHEMA},
            "sink": self.sink,
        }
        self.path.write_text(yaml.safe_dump(spec, sort_keys=False))

    @property
    def total(self) -> int:
        return self.first + MORE


# -- fixtures: the previous release's checkout, the broker, the Redis keys -------------------


@pytest.fixture
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A git worktree of ``PREVIOUS_RELEASE``, removed afterwards."""
    found = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}"],
        capture_output=True,
    )
    if found.returncode != 0:
        pytest.fail(
            f"the previous release's commit {PREVIOUS_RELEASE} is not in {REPO} (a shallow "
            "clone?): the upgrade test needs the full history (git fetch --unshallow)"
        )
    where = tmp_path_factory.mktemp("previous") / "release"
    git = ["git", "-C", str(REPO), "worktree"]
    subprocess.run([*git, "add", "--detach", str(where), PREVIOUS_RELEASE], check=True)
    try:
        yield where
    finally:
        subprocess.run([*git, "remove", "--force", str(where)], check=False)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[str]:
    """A private tansu, up across the upgrade (its log is in memory)."""
    with start_embedded_broker(log_path=tmp_path / "tansu.log") as tansu:
        yield tansu.bootstrap


@pytest.fixture
def tag() -> str:
    """What makes this test's connector names and Redis keys its own."""
    return uuid.uuid4().hex[:6]


@pytest.fixture
def redis_client(tag: str) -> Iterator[redis.Redis]:
    """The machine's Redis; this test's keys and offsets hashes deleted at the end."""
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        yield client
    finally:
        for pattern in (f"upg_{tag}:*", f"conveyor:offsets:up_*_{tag}*"):
            for key in client.scan_iter(match=pattern):
                client.delete(key)
        client.close()


# -- the previous release, in subprocesses --------------------------------------------------


class Previous:
    """A subprocess running ``upgrade_previous_release.py`` on the previous release's code."""

    def __init__(self, worktree: Path, mode: str, cfg: dict[str, Any], log: Path):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "DAGSTER_"))}
        env |= {"PYTHONPATH": str(worktree), "CONVEYOR_HOME": cfg["home"]}
        self.log, self.stderr = log, log.open("wb")
        self.release_file: str | None = None  # where its conveyor package was imported from
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), mode, json.dumps({**cfg, "worktree": str(worktree)})],
            cwd=worktree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.worktree = worktree

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def event(self, name: str) -> dict[str, Any]:
        """The next event ``name`` it writes (others before it are skipped)."""
        while True:
            try:
                line = self.lines.get(timeout=DEADLINE_S + 60)
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"no {name!r} from the previous release:\n{self.tail()}")
            data = json.loads(line)
            if data["event"] == "conveyor":
                assert Path(data["file"]).is_relative_to(self.worktree.resolve()), data
                self.release_file = data["file"]
            if data["event"] == name:
                assert self.release_file, "the previous release did not say where it runs from"
                return data

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)
        self.stderr.close()


# -- reading the targets and the stores as they are, without this checkout's code ------------


def pg_rows(sql: str, *args: Any) -> list[tuple[Any, ...]]:
    from tests.conftest import PG_URL

    with psycopg2.connect(PG_URL) as conn, conn.cursor() as cur:
        cur.execute(sql, args or None)
        return cur.fetchall()


def pg_ids(schema: str, table: str) -> list[int]:
    return [int(i) for (i,) in pg_rows(f'SELECT id FROM "{schema}"."{table}"')]


def ledger(schema: str) -> dict[str, dict[int, dict[str, Any]]]:
    """The offsets table: writer -> partition -> its row (the claim rows left out)."""
    from tests.conftest import PG_URL

    with psycopg2.connect(PG_URL) as conn, conn.cursor() as cur:
        cur.execute(f'SELECT * FROM "{schema}".conveyor_offsets WHERE "partition" >= 0')
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["writer"], {})[int(r["partition"])] = r
    return out


def meta_rows(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def meta_committed(db: Path, name: str) -> int:
    return int(
        meta_rows(
            db,
            "SELECT COALESCE(SUM(next_offset), 0) FROM conveyor_offsets WHERE connector = ?",
            name,
        )[0][0]
    )


def redis_offsets(client: redis.Redis, writer: str) -> dict[str, int]:
    raw = client.hgetall(f"conveyor:offsets:{writer}")
    return {
        k.decode(): int(v.decode().partition("|")[0])
        for k, v in raw.items()
        if not k.decode().startswith("__")
    }


# -- the test ------------------------------------------------------------------------------


def test_state_of_the_previous_release_resumes_under_this_one(
    previous_release: Path,
    broker: str,
    spark_remote: str,
    pg_url: str,
    pg_schema: str,
    redis_client: redis.Redis,
    tag: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tansu = broker
    home = tmp_path / "home"
    (home / "connectors").mkdir(parents=True)
    meta_db = home / "meta.db"
    conns = connectors(home, pg_url, pg_schema, tag)
    for c in conns.values():
        c.write_spec(tansu)
        produce(tansu, c.topic, c.first)
    cfg = {
        "home": str(home),
        "meta_url": f"sqlite:///{meta_db}",
        "meta_db": str(meta_db),
        "tansu": tansu,
        "spark_remote": spark_remote,
    }
    tasks_before = previous_release_runs(previous_release, cfg, conns, tmp_path)
    killed_at = previous_release_killed(previous_release, cfg, conns["killed"], pg_schema, tmp_path)
    check_previous_state(meta_db, pg_schema, redis_client, conns, killed_at)
    print(f"the previous release's killed run left: {killed_at}; task group: {tasks_before}")

    for c in conns.values():
        produce(tansu, c.topic, MORE, start=c.first)
    monkeypatch.setenv("CONVEYOR_HOME", str(home))
    store, incarnations = migrated(cfg["meta_url"], conns)
    check_task_state_read(store, conns["tasks"], tasks_before)
    run_this_release(store, cfg, conns, pg_schema, redis_client, incarnations, killed_at)

    check_delivered(pg_schema, redis_client, conns)
    check_positions(store, pg_schema, redis_client, conns, incarnations)
    print(f"incarnations {incarnations}; positions {store.stored_positions(conns['pg'].name)}")
    store.close()


def connectors(home: Path, pg_url: str, schema: str, tag: str) -> dict[str, Connector]:
    """The connectors (their names and Redis keys unique to this test: ``tag``)."""
    prefix = f"upg_{tag}"

    def pg(table: str, delivery: str) -> dict[str, Any]:
        return {
            "type": "postgres",
            "url": pg_url,
            "schema": schema,
            "table": table,
            "create_table": True,
            "delivery": delivery,
        }

    sinks = {
        "pg": pg("pg", "exactly_once"),
        "redis": {
            "type": "redis",
            "host": "127.0.0.1",
            "port": 6379,
            "commands": [f"RPUSH {prefix}:ids ${{payload.id}}"],
            "delivery": "exactly_once",
        },
        "alo": pg("alo", "at_least_once"),
        "killed": pg("killed", "exactly_once"),
        "tasks": pg("tasks", "exactly_once"),
    }
    out = {}
    for key, sink in sinks.items():
        name = f"up_{key}_{tag}"
        out[key] = Connector(name, f"t_{name}", home / "connectors" / f"{name}.yaml", sink)
    out["killed"].first, out["killed"].max_records = KILLED_FIRST, 10
    return out


def previous_release_runs(
    worktree: Path, cfg: dict[str, Any], conns: dict[str, Connector], tmp_path: Path
) -> dict[str, Any]:
    """``pg``, ``redis`` and ``alo`` run by the previous release until they committed
    their first messages, then stopped; its task group written. Returns the task group."""
    runs = [{"name": conns[k].name, "path": str(conns[k].path), "produced": FIRST} for k in RAN]
    t = conns["tasks"]
    tasks = {"name": t.name, "path": str(t.path), "topic": t.topic, "partitions": 2}
    prev = Previous(
        worktree,
        "run",
        {**cfg, "connectors": runs, "tasks": {**tasks, "task_offset": TASK_OFFSET}},
        tmp_path / "previous-run.log",
    )
    try:
        task_group = prev.event("tasks")
        stopped = prev.event("stopped")
        assert prev.proc.wait(120) == 0, prev.tail()
    finally:
        prev.kill()
    assert stopped["schema_version"] == 3
    for k in RAN:
        got = stopped["connectors"][conns[k].name]
        assert got == {"success": True, "status": "Stopped", "committed": FIRST}, (k, got)
    return task_group


def previous_release_killed(
    worktree: Path, cfg: dict[str, Any], c: Connector, schema: str, tmp_path: Path
) -> dict[str, int]:
    """``killed`` run by the previous release and SIGKILLed with its target ahead of its meta
    store; returns what each held (``target``, ``meta_store``)."""
    prev = Previous(
        worktree,
        "kill",
        {
            **cfg,
            "connector": {"name": c.name, "path": str(c.path), "produced": c.first},
            "postgres": {"url": c.sink["url"], "schema": schema},
        },
        tmp_path / "previous-kill.log",
    )
    try:
        blocked = prev.event("blocked")
    finally:
        prev.kill()
    assert prev.proc.returncode == -signal.SIGKILL, prev.tail()
    return {"target": blocked["target"], "meta_store": blocked["meta_store"]}


def check_previous_state(
    meta_db: Path,
    schema: str,
    client: redis.Redis,
    conns: dict[str, Connector],
    killed_at: dict[str, int],
) -> None:
    """What the previous release left, read as it is (no code of this checkout opens it)."""
    assert meta_rows(meta_db, "SELECT version FROM conveyor_schema") == [(3,)]
    columns = {r[1] for r in meta_rows(meta_db, "PRAGMA table_info(conveyor_connectors)")}
    assert "incarnation" not in columns and "legacy_positions" not in columns
    held = ledger(schema)
    assert set(held) == {conns[k].name for k in EXACTLY_ONCE_PG}  # bare writer names
    assert all("log_id" not in row for rows in held.values() for row in rows.values())
    pg, killed = conns["pg"], conns["killed"]
    assert sum(r["next_offset"] for r in held[pg.name].values()) == FIRST
    assert sorted(pg_ids(schema, "pg")) == list(range(FIRST))
    # The interrupted run: its last batch is in the target (rows and offsets), not in the
    # meta store, whose connector row still names the dead run.
    assert sum(r["next_offset"] for r in held[killed.name].values()) == killed_at["target"]
    assert len(pg_ids(schema, "killed")) == killed_at["target"]
    assert meta_committed(meta_db, killed.name) == killed_at["meta_store"] < killed_at["target"]
    (status, run_id), *_ = meta_rows(
        meta_db, "SELECT status, run_id FROM conveyor_connectors WHERE name = ?", killed.name
    )
    assert status in ("Running", "Degraded") and run_id, status
    assert sum(redis_offsets(client, conns["redis"].name).values()) == FIRST
    for k in ("alo", "tasks"):  # positions in the meta store only
        assert meta_committed(meta_db, conns[k].name) == (FIRST if k == "alo" else 2 * TASK_OFFSET)


def migrated(meta_url: str, conns: dict[str, Connector]) -> tuple[Any, dict[str, str]]:
    """The meta store opened by this checkout: schema 4, an incarnation for every connector,
    each allowed to take what its target kept under its bare name."""
    from conveyor.store.meta import MetaStore

    store = MetaStore(meta_url)
    store.ensure_schema()
    assert store.schema_version() == 4
    incarnations = {}
    for k, c in conns.items():
        row = store.get(c.name)
        assert row.incarnation and len(row.incarnation) == 16, (k, row.incarnation)
        int(row.incarnation, 16)
        assert row.legacy_positions, k
        incarnations[k] = row.incarnation
    assert len(set(incarnations.values())) == len(conns)
    return store, incarnations


def check_task_state_read(store: Any, c: Connector, before: dict[str, Any]) -> None:
    """The previous release's task group as this checkout's ``TaskStore`` reads it."""
    from conveyor.core.model import TopicPartition
    from conveyor.core.positions import StoredPosition
    from conveyor.store.tasks import TaskStore

    ts = TaskStore(store)
    assert ts.epoch(c.name) == before["epoch"]
    rows = ts.tasks(c.name)
    assert [[r.task_id, r.generation] for r in rows] == before["tasks"]
    assert {str(tp): e for tp, e in rows[0].owned.items()} == before["owned"]
    assert store.stored_positions(c.name) == {
        TopicPartition(c.topic, p): StoredPosition(TASK_OFFSET) for p in range(2)
    }


def run_this_release(
    store: Any,
    cfg: dict[str, Any],
    conns: dict[str, Connector],
    schema: str,
    client: redis.Redis,
    incarnations: dict[str, str],
    killed_at: dict[str, int],
) -> None:
    """Every connector run again by this checkout (``tasks``: its task 0's run, at the
    generation the previous release gave it) until all its messages are committed; stopped."""
    from conveyor.dagster.tags import TAG_TASK, TAG_TASK_GENERATION
    from conveyor.store.tasks import TaskStore

    (task0,) = TaskStore(store).tasks(conns["tasks"].name)
    runs = {k: JobThread(str(conns[k].path), cfg) for k in (*RAN, "killed")}
    task_tags = {TAG_TASK: "0", TAG_TASK_GENERATION: str(task0.generation)}
    runs["tasks"] = JobThread(str(conns["tasks"].path), cfg, tags=task_tags)
    try:
        check_taken_over(store, schema, client, conns, incarnations, killed_at, runs)
        for k, c in conns.items():
            wait_for(
                f"{k}: {c.total} committed by this release",
                lambda k=k, c=c: (
                    committed(store, c.name) >= c.total and (k == "tasks" or live(store, c.name))
                ),
                runs=runs.values(),
            )
    finally:
        for c in conns.values():
            store.stop(c.name, reason="the test stops")
        outcomes = {k: run.join() for k, run in runs.items()}
    assert all(o == {"success": True} for o in outcomes.values()), outcomes


def check_taken_over(
    store: Any,
    schema: str,
    client: redis.Redis,
    conns: dict[str, Connector],
    incarnations: dict[str, str],
    killed_at: dict[str, int],
    runs: dict[str, JobThread],
) -> None:
    """After its first commit under this checkout, a connector's positions kept under its bare
    name in the target are under ``<name>@<incarnation>`` only."""
    floors = {"pg": FIRST, "redis": FIRST, "killed": killed_at["target"]}
    for k, floor in floors.items():
        name = conns[k].name
        wait_for(
            f"{k}: a commit of this release",
            lambda n=name, f=floor: committed(store, n) > f,
            runs=runs.values(),
        )
        if k == "redis":
            assert not client.exists(f"conveyor:offsets:{name}")
            assert redis_offsets(client, f"{name}@{incarnations[k]}")
            continue
        held = ledger(schema)
        assert name not in held, sorted(held)
        assert f"{name}@{incarnations[k]}" in held, sorted(held)


def check_delivered(schema: str, client: redis.Redis, conns: dict[str, Connector]) -> None:
    """Every message in its target: once (exactly once; ``alo`` too: its previous run stopped
    cleanly, so its meta store held exact positions), none missing."""
    for k in EXACTLY_ONCE_PG:
        assert sorted(pg_ids(schema, k)) == list(range(conns[k].total)), k
    prefix = conns["redis"].sink["commands"][0].split()[1]
    in_redis = [int(i) for i in client.lrange(prefix, 0, -1)]
    assert sorted(in_redis) == list(range(conns["redis"].total))
    alo = pg_ids(schema, "alo")
    assert set(range(conns["alo"].total)) - set(alo) == set(), "lost by the upgrade"
    assert len(alo) == len(set(alo)) == conns["alo"].total, "written twice after a clean stop"
    # The task read each partition from the offset the previous release's task committed:
    # ids i sit at offset i // 2 of partition i % 2.
    want = [i for i in range(conns["tasks"].total) if i // 2 >= TASK_OFFSET]
    assert sorted(pg_ids(schema, "tasks")) == want


def check_positions(
    store: Any,
    schema: str,
    client: redis.Redis,
    conns: dict[str, Connector],
    incarnations: dict[str, str],
) -> None:
    """Every stored position names its log and destination now, the target's under the
    writer id of the connector's incarnation; the migrated connectors no longer look under
    their bare names."""
    from conveyor.config.specs import load_file

    held = ledger(schema)
    writers = {f"{conns[k].name}@{incarnations[k]}" for k in EXACTLY_ONCE_PG}
    writers.add(f"{conns['tasks'].name}.task0@{incarnations['tasks']}")
    assert set(held) == writers
    for k, c in conns.items():
        loaded = load_file(c.path)
        assert loaded.sink is not None
        destination = "/".join(loaded.sink.asset_key_path())
        positions = store.stored_positions(c.name)
        assert {tp.partition: p.offset for tp, p in positions.items()} == {
            0: c.total // 2,
            1: c.total // 2,
        }, k
        assert {p.destination for p in positions.values()} == {destination}, k
        log_ids = {tp.partition: p.log_id for tp, p in positions.items()}
        assert all(log_ids.values()), (k, log_ids)  # tansu reports topic ids
        if k == "redis":
            key = f"conveyor:offsets:{c.name}@{incarnations[k]}"
            assert client.hget(key, "__destination").decode() == destination
            assert redis_offsets(client, f"{c.name}@{incarnations[k]}") == {
                f"{c.topic}/{p}": c.total // 2 for p in (0, 1)
            }
        elif k != "alo":
            (rows,) = [r for w, r in held.items() if w.split("@")[0].split(".task")[0] == c.name]
            assert {p: r["next_offset"] for p, r in rows.items()} == {
                0: c.total // 2,
                1: c.total // 2,
            }
            assert {r["destination"] for r in rows.values()} == {destination}, k
            assert {p: r["log_id"] for p, r in rows.items()} == log_ids, k
        if k != "tasks":  # a connector's run clears it; a task's writer takes its own rows
            assert not store.get(c.name).legacy_positions, k
