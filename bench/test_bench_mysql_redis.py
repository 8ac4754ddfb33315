"""Benchmark: the MySQL and Redis sinks' ``send_batch`` vs a bare client loop doing the same writes.

Same run, same servers (the machine's MariaDB and Redis), same messages: 10 batches of
10,000 decoded rows (``tests.sinks.contract.make_batch``: id, name, amount, key, one
header, timestamp). The bare loops start from the same Arrow batch, as a hand-written
consumer would after decoding:

- MySQL: ``cursor.executemany`` of the same INSERT (pymysql turns it into multi-row
  statements) in chunks of 1,000 rows, one commit per batch; the sink with
  ``rows_per_statement: 1000`` (plain INSERT, and upsert on the primary key).
- Redis: one non-transactional pipeline per 1,000 rows of the same ``HSET`` (same
  fields and values); the sink with ``pipeline_size: 1000`` (and MULTI/EXEC).

Each bare loop runs first and again last (into a fresh table / key prefix); the ratio is
against the mean of the two, so warm-up favours neither side. The bare loops pay for
``Table.to_pylist()`` (a dict per row), which the sinks avoid by converting column by
column; that is why the sinks come out ahead.

Only counts are asserted; throughputs and ratios are printed. Run with::

    /work/venv/bin/python -m pytest bench/test_bench_mysql_redis.py -m bench -s -n 0
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable

import pyarrow as pa
import pymysql
import pytest
import redis

from conveyor.sinks import build_sink
from conveyor.sinks.mysql import quote_identifier
from tests.sinks.contract import make_batch

pytestmark = pytest.mark.bench

BATCHES = int(os.environ.get("CONVEYOR_BENCH_BATCHES", "10"))
ROWS = int(os.environ.get("CONVEYOR_BENCH_BATCH", "10000"))
CHUNK = 1000
MYSQL_URL = os.environ.get("CONVEYOR_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
REDIS_HOST = os.environ.get("CONVEYOR_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("CONVEYOR_TEST_REDIS_PORT", "6379"))


def batches() -> list[pa.Table]:
    return [make_batch(ROWS, start=i * ROWS) for i in range(BATCHES)]


def timed(label: str, fn: Callable[[pa.Table], None], data: list[pa.Table]) -> float:
    start = time.perf_counter()
    for b in data:
        fn(b)
    elapsed = time.perf_counter() - start
    rate = BATCHES * ROWS / elapsed
    print(f"  {label:<46} {BATCHES * ROWS:>7} rows in {elapsed:6.2f} s = {rate:>9,.0f} rows/s")
    return rate


def report(title: str, sink_rate: float, bare_rate: float) -> None:
    print(f"  {title}: sink / bare = {sink_rate / bare_rate:.2f}")


def arrow_rows(b: pa.Table) -> list[dict]:
    return b.to_pylist()


# -- MySQL -----------------------------------------------------------------------------------------


def _mysql() -> pymysql.connections.Connection:
    kw = build_sink({"type": "mysql", "url": MYSQL_URL, "table": "x"}).connect_kwargs()  # type: ignore[attr-defined]
    return pymysql.connect(**kw)


def _mysql_exec(sql: str) -> list[tuple]:
    conn = _mysql()
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            rows = list(cur.fetchall())
        conn.commit()
        return rows
    finally:
        conn.close()


DDL = "CREATE TABLE {t} (id BIGINT PRIMARY KEY, name VARCHAR(255) NOT NULL, amount DOUBLE, k VARBINARY(255), h JSON, ts DATETIME(3)) ENGINE=InnoDB"
COLUMNS = {
    "id": "id",
    "name": "name",
    "amount": "amount",
    "k": "$key",
    "h": "$headers",
    "ts": "$timestamp",
}


def test_bench_mysql_sink_vs_bare_executemany() -> None:
    data = batches()
    tables = {
        name: f"bench_{name}_{uuid.uuid4().hex[:8]}"
        for name in ("bare", "insert", "upsert", "bare2")
    }
    for t in tables.values():
        _mysql_exec(DDL.format(t=quote_identifier(t)))
    print(
        f"\nMySQL (MariaDB) at {MYSQL_URL.rsplit('@', 1)[-1]}: {BATCHES} batches x {ROWS} rows, {CHUNK} rows per statement, one commit per batch"
    )
    try:
        conn = _mysql()
        target = {"table": tables["bare"]}

        def bare(b: pa.Table) -> None:
            stmt = f"INSERT INTO {quote_identifier(target['table'])} (id, name, amount, k, h, ts) VALUES (%s, %s, %s, %s, %s, %s)"
            rows = [
                (
                    r["id"],
                    r["name"],
                    r["amount"],
                    r["__key"],
                    json.dumps({h["key"]: h["value"].decode() for h in r["__headers"]}),
                    r["__timestamp"].replace(tzinfo=None),
                )
                for r in arrow_rows(b)
            ]
            with conn.cursor() as cur:
                for i in range(0, len(rows), CHUNK):
                    cur.executemany(stmt, rows[i : i + CHUNK])
            conn.commit()

        rates = {}
        rates["bare"] = timed("bare pymysql executemany (first)", bare, data)
        for mode in ("insert", "upsert"):
            cfg = {
                "type": "mysql",
                "url": MYSQL_URL,
                "table": tables[mode],
                "columns": COLUMNS,
                "rows_per_statement": CHUNK,
            }
            if mode == "upsert":
                cfg["upsert_keys"] = ["id"]
            sink = build_sink(cfg)
            sink.init_sink()

            def via_sink(b: pa.Table, sink=sink) -> None:
                assert sink.send_batch(b).failed == ()

            try:
                rates[mode] = timed(f"MySQLSink.send_batch ({mode})", via_sink, data)
            finally:
                sink.cleanup_sink()
        target["table"] = tables["bare2"]
        try:
            rates["bare2"] = timed("bare pymysql executemany (again, last)", bare, data)
        finally:
            conn.close()
        bare_rate = (
            rates["bare"] + rates["bare2"]
        ) / 2  # before and after the sinks: no warm-up bias
        report("MySQL plain INSERT vs bare", rates["insert"], bare_rate)
        report("MySQL upsert (ON DUPLICATE KEY) vs bare INSERT", rates["upsert"], bare_rate)
        for t in tables.values():
            assert (
                _mysql_exec(f"SELECT COUNT(*) FROM {quote_identifier(t)}")[0][0] == BATCHES * ROWS
            )
        a = _mysql_exec(
            f"SELECT id, name, amount, k, h, ts FROM {quote_identifier(tables['bare'])} ORDER BY id LIMIT 5"
        )
        for t in ("insert", "upsert"):
            assert (
                _mysql_exec(
                    f"SELECT id, name, amount, k, h, ts FROM {quote_identifier(tables[t])} ORDER BY id LIMIT 5"
                )
                == a
            )
    finally:
        for t in tables.values():
            _mysql_exec(f"DROP TABLE IF EXISTS {quote_identifier(t)}")


# -- Redis -----------------------------------------------------------------------------------------


def _count_keys(r: redis.Redis, prefix: str) -> int:
    return sum(1 for _ in r.scan_iter(match=f"{prefix}:*", count=10_000))


def _delete(r: redis.Redis, prefix: str) -> None:
    keys = list(r.scan_iter(match=f"{prefix}:*", count=10_000))
    for i in range(0, len(keys), 1000):
        r.delete(*keys[i : i + 1000])


def test_bench_redis_sink_vs_bare_pipeline() -> None:
    data = batches()
    r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT)
    prefixes = {
        name: f"bench_{name}_{uuid.uuid4().hex[:8]}"
        for name in ("bare", "pipeline", "multi", "bare2")
    }
    target = {"prefix": prefixes["bare"]}
    print(
        f"\nRedis at {REDIS_HOST}:{REDIS_PORT}: {BATCHES} batches x {ROWS} rows, one HSET (6 fields) per row, {CHUNK} rows per pipeline"
    )
    try:

        def bare(b: pa.Table) -> None:
            prefix = target["prefix"]
            rows = arrow_rows(b)
            for i in range(0, len(rows), CHUNK):
                pipe = r.pipeline(transaction=False)
                for row in rows[i : i + CHUNK]:
                    ts = int(row["__timestamp"].timestamp() * 1000)
                    headers = json.dumps(
                        {h["key"]: h["value"].decode() for h in row["__headers"]},
                        separators=(",", ":"),
                    )
                    pipe.execute_command(
                        "HSET",
                        f"{prefix}:{row['id']}",
                        "id",
                        row["id"],
                        "name",
                        row["name"],
                        "key",
                        row["__key"],
                        "ts",
                        ts,
                        "headers",
                        headers,
                        "amount",
                        row["amount"],
                    )
                results = pipe.execute(raise_on_error=False)
                assert not any(isinstance(x, Exception) for x in results)

        rates = {"bare": timed("bare redis-py pipeline (first)", bare, data)}
        for mode in ("pipeline", "multi"):
            template = (
                f"HSET {prefixes[mode]}:${{payload.id}} id ${{payload.id}} name ${{payload.name}} key ${{key}} ts ${{timestamp}} "
                "headers ${headers} amount ${payload.amount}"
            )
            sink = build_sink(
                {
                    "type": "redis",
                    "host": REDIS_HOST,
                    "port": REDIS_PORT,
                    "commands": [template],
                    "pipeline_size": CHUNK,
                    "transaction": mode == "multi",
                }
            )
            sink.init_sink()

            def via_sink(b: pa.Table, sink=sink) -> None:
                assert sink.send_batch(b).failed == ()

            try:
                rates[mode] = timed(
                    f"RedisSink.send_batch ({'MULTI/EXEC' if mode == 'multi' else 'pipeline'})",
                    via_sink,
                    data,
                )
            finally:
                sink.cleanup_sink()
        target["prefix"] = prefixes["bare2"]
        rates["bare2"] = timed("bare redis-py pipeline (again, last)", bare, data)
        bare_rate = (
            rates["bare"] + rates["bare2"]
        ) / 2  # before and after the sinks: no warm-up bias
        report("Redis pipeline vs bare pipeline", rates["pipeline"], bare_rate)
        report("Redis MULTI/EXEC vs bare pipeline", rates["multi"], bare_rate)
        for p in prefixes.values():
            assert _count_keys(r, p) == BATCHES * ROWS
        key = 12345 % (BATCHES * ROWS)
        assert (
            r.hgetall(f"{prefixes['bare']}:{key}")
            == r.hgetall(f"{prefixes['pipeline']}:{key}")
            == r.hgetall(f"{prefixes['multi']}:{key}")
        )
    finally:
        for p in prefixes.values():
            _delete(r, p)
        r.close()


def test_bench_mysql_literals_from_arrow_vs_pymysql_escaping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The MySQL sink's ``send_batch`` with its rows' literals built by Arrow (now) and
    escaped by pymysql value by value (before: ``_literals`` off), alternating rounds,
    this process's CPU per 100,000 rows (the sink runs on the calling thread). The
    connector's orders (id, name, amount, ts as in bench/test_bench_as_users_run_it.py),
    and the same with the message's timestamp."""
    import statistics

    from conveyor.sinks.mysql import MySQLSink

    rounds = int(os.environ.get("CONVEYOR_BENCH_ROUNDS", "6"))
    ts = pa.array(range(1_700_000_000_000, 1_700_000_000_000 + ROWS), pa.int64())
    data = [b.append_column("ts", ts) for b in batches()]
    layouts = {
        "orders": ("ts BIGINT", {"ts": "ts"}),
        "orders-with-time": ("ts BIGINT, sent DATETIME(3)", {"ts": "ts", "sent": "$timestamp"}),
    }
    for layout, (ddl, extra) in layouts.items():

        def drain(how: str, ddl: str = ddl, extra: dict = extra) -> dict:
            table = f"bench_lit_{uuid.uuid4().hex[:8]}"
            _mysql_exec(
                f"CREATE TABLE {table} (id BIGINT, name VARCHAR(255), amount DOUBLE, {ddl}) ENGINE=InnoDB"
            )
            try:
                with monkeypatch.context() as m:
                    if how == "pymysql":
                        m.setattr(MySQLSink, "_literals", lambda self, batch: None)
                    cols = {"id": "id", "name": "name", "amount": "amount", **extra}
                    sink = build_sink({"type": "mysql", "url": MYSQL_URL, "table": table, "columns": cols})  # fmt: skip
                    sink.init_sink()
                    try:
                        cpu, wall = time.process_time(), time.perf_counter()
                        for b in data:
                            assert sink.send_batch(b).failed == ()
                        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                    finally:
                        sink.cleanup_sink()
                assert _mysql_exec(f"SELECT count(DISTINCT id) FROM {table}") == [(BATCHES * ROWS,)]
            finally:
                _mysql_exec(f"DROP TABLE IF EXISTS {table}")
            n = BATCHES * ROWS
            return {"cpu_s_per_100k": cpu / n * 100_000, "rows_per_s": n / wall}

        results: dict[str, list[dict]] = {"arrow": [], "pymysql": []}
        drain("arrow"), drain("pymysql")  # warm
        for r in range(rounds):
            for how in ("arrow", "pymysql") if r % 2 == 0 else ("pymysql", "arrow"):
                results[how].append(drain(how))
        for how, ms in results.items():
            print(
                f"\n{layout} {how}: CPU s per 100K {statistics.median(m['cpu_s_per_100k'] for m in ms):.3f},"
                f" rows/s {statistics.median(m['rows_per_s'] for m in ms):,.0f}"
            )
        pairs = list(zip(results["arrow"], results["pymysql"], strict=True))
        print(f"{layout} arrow / pymysql CPU per row:", [f"{a['cpu_s_per_100k'] / p['cpu_s_per_100k']:.2f}" for a, p in pairs])  # fmt: skip
        print(f"{layout} arrow / pymysql rate:", [f"{a['rows_per_s'] / p['rows_per_s']:.2f}" for a, p in pairs])  # fmt: skip
