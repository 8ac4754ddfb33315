"""The PostgreSQL sink's COPY text: built by Arrow in one buffer vs line by line in Python.

``send_batch`` of 10,000-row batches of the connector's decoded orders into a fresh table:
id, name, amount, ts as in bench/test_bench_as_users_run_it.py (``orders``), and the same
with ``ts`` a timestamp and the message's timestamp in a column (``orders-with-times``), both contenders in alternating rounds in
one run: ``arrow-buffer`` (the sink: ``CopyText``, one buffer from Arrow's string
kernels) and ``python-lines`` (the sink as it was at commit f30090f: each column's text
to Python strings, a line per row joined in Python, written into a ``StringIO``). Per
contender: this process's CPU seconds per 100,000 rows (the sink runs on the calling
thread) and rows/s. Every table is checked for exactly the rows sent.

```bash
.venv/bin/python -m pytest bench/test_bench_pg_copy.py -m bench -s -n 0
```
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import psycopg2
import pyarrow as pa
import pytest

from conveyor.sinks import build_sink
from conveyor.sinks import postgres as pg
from tests.conftest import PG_URL
from tests.sinks.contract import make_batch, unique

pytestmark = pytest.mark.bench

BATCHES = int(os.environ.get("CONVEYOR_BENCH_BATCHES", "20"))
ROWS = int(os.environ.get("CONVEYOR_BENCH_BATCH", "10000"))
ROUNDS = int(os.environ.get("CONVEYOR_BENCH_ROUNDS", "6"))
SCHEMA = "conveyor_bench"


def python_lines(self: Any, batch: pa.Table) -> list[str] | None:
    """``_copy_lines`` as it was: Python strings per value (Arrow's text for numbers,
    booleans and strings, ``_copy_value`` for the rest, timestamps included), a join per
    row."""
    assert self._sources is not None
    columns = []
    for src in self._sources:
        column = batch.column(pg.META_SOURCES.get(src, src) if src.startswith("$") else src)
        t = column.type
        if any(f(t) for f in (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean,
                              pa.types.is_string, pa.types.is_large_string)):  # fmt: skip
            columns.append(pg._copy_column(column).to_pylist())
        else:
            columns.append([pg._copy_value(v) for v in column.to_pylist()])
    return list(map("\t".join, zip(*columns, strict=True)))


def execute(sql: str) -> Any:
    conn = psycopg2.connect(PG_URL)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            return cur.fetchone() if cur.description else None
    finally:
        conn.close()


LAYOUTS = {
    # the orders of the as-users benchmark: numbers and text
    "orders": ("ts bigint", {"ts": "ts"}),
    # the same with the event time as a timestamp and the message's own timestamp
    "orders-with-times": ("ts timestamptz, sent timestamptz", {"ts": "ts", "sent": "$timestamp"}),
}


def drain(
    contender: str, layout: str, data: list[pa.Table], monkeypatch: pytest.MonkeyPatch
) -> dict:
    table = unique("copy")
    ddl, extra = LAYOUTS[layout]
    execute(f'CREATE TABLE "{SCHEMA}"."{table}" (id bigint, name text, amount double precision, {ddl})')  # fmt: skip
    with monkeypatch.context() as m:
        if contender == "python-lines":
            m.setattr(pg.PostgresSink, "_copy_lines", python_lines)
        sink = build_sink({
            "type": "postgres", "url": PG_URL, "schema": SCHEMA, "table": table,
            "columns": {"id": "id", "name": "name", "amount": "amount", **extra},
        })  # fmt: skip
        sink.init_sink()
        try:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for b in data:
                assert sink.send_batch(b).rows == b.num_rows
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        finally:
            sink.cleanup_sink()
    rows = sum(b.num_rows for b in data)
    assert execute(f'SELECT count(DISTINCT id) FROM "{SCHEMA}"."{table}"') == (rows,)
    execute(f'DROP TABLE "{SCHEMA}"."{table}"')
    return {"cpu_s_per_100k": cpu / rows * 100_000, "rows_per_s": rows / wall}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_copy_text_from_arrow_vs_python_lines(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    execute(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
    ts = pa.array(range(1_700_000_000_000, 1_700_000_000_000 + ROWS))
    if layout == "orders-with-times":
        ts = ts.cast(pa.timestamp("ms", tz="UTC")).cast(pa.timestamp("us", tz="UTC"))
    data = [
        b.append_column("ts", ts)
        for b in (make_batch(ROWS, start=i * ROWS) for i in range(BATCHES))
    ]
    contenders = ["arrow-buffer", "python-lines"]
    for c in contenders:  # warm: connections, imports, the server's caches
        drain(c, layout, data[:2], monkeypatch)
    results: dict[str, list[dict]] = {c: [] for c in contenders}
    for r in range(ROUNDS):
        for c in contenders if r % 2 == 0 else contenders[::-1]:
            results[c].append(drain(c, layout, data, monkeypatch))
            print(f"{layout} round {r} {c}: {results[c][-1]} load {os.getloadavg()[0]:.1f}")
    ratios = [
        a["cpu_s_per_100k"] / p["cpu_s_per_100k"]
        for a, p in zip(results["arrow-buffer"], results["python-lines"], strict=True)
    ]
    rates = [
        a["rows_per_s"] / p["rows_per_s"]
        for a, p in zip(results["arrow-buffer"], results["python-lines"], strict=True)
    ]
    for c, ms in results.items():
        print(
            f"{layout} {c}: CPU s per 100K {statistics.median(m['cpu_s_per_100k'] for m in ms):.3f},"
            f" rows/s {statistics.median(m['rows_per_s'] for m in ms):,.0f}"
        )
    print(f"{layout} arrow-buffer / python-lines CPU per row:", [f"{x:.2f}" for x in ratios])
    print(f"{layout} arrow-buffer / python-lines rate:", [f"{x:.2f}" for x in rates])
