"""The Spark transform alone, side by side on one Spark Connect server (issue 18).

Two questions, each answered by contenders measured in alternating rounds in one run:

1. **What a batch's decoding costs the JVM**: the JSON decoding of ``decode: json`` with
   a schema as it was (a ``from_json`` and a ``try_parse_json`` over every row,
   ``two-pass`` below, the pipeline of commit d486175), one pass with the decoded fields
   taken by ``__d.*`` (``one-pass-star``, commit cd9219f), the current one (one
   ``from_json`` with a corrupt-record column, ``try_parse_json`` only on the rows it
   flags, the fields projected by name), and two floors no transform on Spark Connect
   goes below: the batch's round trip with a cast only, and with a bare ``from_json``.
   Per contender: the Spark JVM's CPU seconds per 100,000 rows and the wall time of one
   10,000-row batch (median), one batch at a time.
2. **Pipeline depth**: ``depth`` batches in Spark at once (threads each transforming
   batches in turn, as the loop's transform stage does), rows/s and JVM CPU per 100,000
   rows per depth.
3. **A large batch as one row** (``test_a_large_batch_as_one_row_vs_as_its_rows``): per
   batch size (``CONVEYOR_BENCH_ONE_ROW_SIZES``), the transform and the cast-only floor
   with the batch crossing as its rows (a ``LocalRelation`` of them) and as one row
   unnested by ``inline`` (``as_one_row``), two batches in Spark at once as the
   connector runs them: JVM and client CPU per 100,000 rows, rows/s.
4. **A batch inside its query or as artifacts**
   (``test_a_batch_inside_its_query_vs_as_artifacts``): the default batch (40,000 rows)
   at the default depth (3) with the session's ``localRelationCacheThreshold`` at 64 MiB
   (the batch inside the ExecutePlan request) and at pyspark's default, 1 MiB (uploaded
   as artifacts first: two more RPCs, which were 29% of a transform thread's wall time in
   the Kafka sink's profile): rows/s, JVM and client CPU per 100,000 rows.

```bash
CONVEYOR_BENCH_OUT=/tmp/transform.json .venv/bin/python -m pytest bench/test_bench_transform.py -m bench -s -n 0
```
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from typing import Any
from urllib.parse import urlparse

import psutil
import pytest

from bench.harness import BATCH, order, synthetic_batch
from bench.stack import listening_pid

pytestmark = [pytest.mark.bench, pytest.mark.timeout(3600)]

SCHEMA = "id BIGINT, name STRING, amount DOUBLE, ts BIGINT"  # as bench_as_users_run_it
BATCHES = int(os.environ.get("CONVEYOR_BENCH_TRANSFORM_BATCHES", "20"))  # per contender, round
ROUNDS = int(os.environ.get("CONVEYOR_BENCH_TRANSFORM_ROUNDS", "3"))
DEPTHS = [int(d) for d in os.environ.get("CONVEYOR_BENCH_DEPTHS", "1,2,3,4").split(",")]
SIZES = [
    int(n) for n in os.environ.get("CONVEYOR_BENCH_ONE_ROW_SIZES", "10000,20000,40000").split(",")
]
OUT = os.environ.get("CONVEYOR_BENCH_OUT")


def batch(n: int = BATCH) -> Any:
    return synthetic_batch(n, "bench", lambda i: {**order(i), "ts": 1_700_000_000_000 + i})


def two_pass(spark: Any) -> Any:
    """The transform as it was: try_parse_json over every row, then from_json."""
    from conveyor.core.model import TransformSpec
    from conveyor.spark import transform as tr

    class TwoPass(tr.SparkTransformer):
        def _pipeline(self, df: Any) -> Any:
            value_str = "CAST(__value AS STRING)"
            tomb = "(__value IS NULL OR length(__value) = 0)"
            invalid = f"(NOT {tomb} AND try_parse_json({value_str}) IS NULL)"
            schema = f"{self.spec.json_schema}, {tr.CORRUPT_COL} STRING"
            opts = f"map('columnNameOfCorruptRecord', '{tr.CORRUPT_COL}')"
            df = df.selectExpr(
                tr.ROW_COL,
                f"{invalid} AS __invalid",
                f"{tomb} AS __tomb",
                f"from_json({value_str}, '{schema}', {opts}) AS __d",
            )
            mismatch = (
                "CASE WHEN NOT `__tomb` AND `__d` IS NULL THEN 'not an object' "
                f"WHEN NOT `__tomb` AND `__d`.{tr.CORRUPT_COL} IS NOT NULL THEN '{tr.MISMATCH}' END"
            )
            return df.selectExpr(
                tr.ROW_COL,
                f"CASE WHEN `__invalid` THEN '{tr.NOT_JSON}' ELSE {mismatch} END AS {tr.BAD_COL}",
                "__d.*",
            ).drop(tr.CORRUPT_COL)

    return TwoPass(TransformSpec(decode="json", schema=SCHEMA), spark)


def one_pass(spark: Any) -> Any:
    from conveyor.core.model import TransformSpec
    from conveyor.spark.transform import SparkTransformer

    return SparkTransformer(TransformSpec(decode="json", schema=SCHEMA), spark)


def one_pass_star(spark: Any) -> Any:
    """One pass with the decoded fields taken by ``__d.*`` and a drop (commit cd9219f),
    not by name."""
    t = one_pass(spark)
    t.prepare = lambda: None  # prepare learns the fields; without it the star stays
    return t


def floor(spark: Any, decode: bool) -> Any:
    """What any transform on Spark Connect costs at least: the batch's round trip with a
    cast only (``decode`` False), or with a bare ``from_json`` and no checks at all."""
    from conveyor.spark import transform as tr

    class Floor(tr.SparkTransformer):
        def _pipeline(self, df: Any) -> Any:
            value = "CAST(__value AS STRING)"
            if not decode:
                return df.selectExpr(tr.ROW_COL, f"CAST(NULL AS STRING) AS {tr.BAD_COL}", value)
            return df.selectExpr(
                tr.ROW_COL,
                f"CAST(NULL AS STRING) AS {tr.BAD_COL}",
                f"from_json({value}, '{SCHEMA}') AS __d",
            ).selectExpr(tr.ROW_COL, tr.BAD_COL, "__d.*")

    return Floor(one_pass(spark).spec, spark)


class Reattachable:
    """``one_pass`` with pyspark's reattachable execution, its default (Conveyor's transform
    runs each batch's query as one stream: ``one_stream_per_query``). Depth 1 only: the
    switch is the session's."""

    def __init__(self, spark: Any):
        self.t, self.client = one_pass(spark), spark.client

    def prepare(self) -> None:
        self.t.prepare()

    def __call__(self, b: Any) -> Any:
        self.client.enable_reattachable_execute()
        try:
            return self.t(b)
        finally:
            self.client.disable_reattachable_execute()


def jvm_cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + getattr(t, "children_user", 0) + getattr(t, "children_system", 0)


def measure(transform: Any, b: Any, proc: psutil.Process, batches: int, depth: int) -> dict:
    """``batches`` batches through ``transform`` by ``depth`` threads at once."""
    times: list[float] = []
    left = [batches]
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            t = time.monotonic()
            assert transform(b).table.num_rows == b.num_rows
            with lock:
                times.append(time.monotonic() - t)

    cpu0, wall0, client0 = jvm_cpu(proc), time.monotonic(), time.process_time()
    threads = [threading.Thread(target=work) for _ in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.monotonic() - wall0, jvm_cpu(proc) - cpu0
    client = time.process_time() - client0  # this process: the Spark Connect client
    rows = batches * b.num_rows
    return {
        "rows_per_s": rows / wall,
        "jvm_cpu_s_per_100k": cpu / rows * 100_000,
        "client_cpu_s_per_100k": client / rows * 100_000,
        "batch_ms_median": statistics.median(times) * 1000,
    }


def jvm_and_session(remote: str) -> tuple[psutil.Process, Any]:
    """The Spark Connect server's JVM process (for its CPU) and a session on it."""
    from conveyor.spark.session import spark_session

    port = urlparse(remote.replace("sc://", "http://")).port
    pid = listening_pid(port) if port else None
    assert pid, "the Spark Connect JVM's pid"
    return psutil.Process(pid), spark_session(remote)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def test_one_pass_vs_two_pass_and_pipeline_depth(warm_spark_remote: str) -> None:
    proc, spark = jvm_and_session(warm_spark_remote)
    b = batch()
    contenders = {
        "two-pass": two_pass(spark),
        "one-pass-star": one_pass_star(spark),
        "one-pass": one_pass(spark),
        "one-pass-reattachable": Reattachable(spark),
        "floor-cast-only": floor(spark, decode=False),
        "floor-from_json-only": floor(spark, decode=True),
    }
    for t in contenders.values():
        t.prepare()
        for _ in range(10):  # this contender's query compiled and JIT-warm
            t(b)
    results: dict[str, Any] = {"commit": os.popen("git rev-parse --short HEAD").read().strip()}
    passes: dict[str, list[dict]] = {k: [] for k in contenders}
    for r in range(ROUNDS):
        order_ = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order_:
            m = measure(contenders[name], b, proc, BATCHES, 1)
            m["load"] = load()
            passes[name].append(m)
            print(f"round {r} {name}: {m}")
    results["passes"] = passes
    for who in ("jvm", "client"):  # each contender's CPU per row against one-pass's, per round
        key = f"{who}_cpu_s_per_100k"
        results[f"vs_one_pass_{who}_cpu"] = {
            name: [m[key] / o[key] for m, o in zip(passes[name], passes["one-pass"], strict=True)]
            for name in contenders
        }
        print(f"{who} CPU per row vs one-pass:", results[f"vs_one_pass_{who}_cpu"])
    results["one_vs_two"] = {
        "jvm_cpu_ratio": [
            o["jvm_cpu_s_per_100k"] / t["jvm_cpu_s_per_100k"]
            for o, t in zip(passes["one-pass"], passes["two-pass"], strict=True)
        ],
        "batch_ms_ratio": [
            o["batch_ms_median"] / t["batch_ms_median"]
            for o, t in zip(passes["one-pass"], passes["two-pass"], strict=True)
        ],
    }
    print("one-pass / two-pass:", results["one_vs_two"])
    depths: dict[int, list[dict]] = {d: [] for d in DEPTHS}
    t = contenders["one-pass"]
    for r in range(ROUNDS):
        for d in DEPTHS if r % 2 == 0 else list(reversed(DEPTHS)):
            m = measure(t, b, proc, BATCHES, d)
            m["load"] = load()
            depths[d].append(m)
            print(f"round {r} depth {d}: {m}")
    results["depths"] = depths
    results["depth_vs_1_rate"] = {
        d: [x["rows_per_s"] / y["rows_per_s"] for x, y in zip(depths[d], depths[1], strict=True)]
        for d in DEPTHS
        if 1 in depths
    }
    print("rate vs depth 1:", results["depth_vs_1_rate"])
    if OUT:
        with open(OUT, "w") as f:
            json.dump(results, f, indent=1)


class Crossing:
    """A transform with its batches crossing to Spark as one row (``one_row``) or as
    their rows, whatever their size (``ONE_ROW_FROM`` set around each call)."""

    def __init__(self, t: Any, one_row: bool):
        self.t, self.one_row = t, one_row

    def prepare(self) -> None:
        self.t.prepare()

    def __call__(self, b: Any) -> Any:
        from conveyor.spark import transform as tr

        tr.ONE_ROW_FROM = 1 if self.one_row else 1 << 62
        return self.t(b)


def test_a_large_batch_as_one_row_vs_as_its_rows(warm_spark_remote: str) -> None:
    from conveyor.spark import transform as tr

    proc, spark = jvm_and_session(warm_spark_remote)
    default = tr.ONE_ROW_FROM
    contenders = {
        f"{name} as {how}": Crossing(make(), how == "one row")
        for name, make in (("one-pass", lambda: one_pass(spark)), ("floor-cast-only", lambda: floor(spark, False)))
        for how in ("rows", "one row")
    }  # fmt: skip
    batches = {n: batch(n) for n in SIZES}
    results: dict[str, Any] = {"commit": os.popen("git rev-parse --short HEAD").read().strip()}
    runs: dict[str, dict[int, list[dict]]] = {k: {n: [] for n in SIZES} for k in contenders}
    try:
        for t in contenders.values():
            t.prepare()
            for b in batches.values():
                for _ in range(5):  # compiled and JIT-warm for this size
                    t(b)
        for r in range(ROUNDS):
            for name in list(contenders) if r % 2 == 0 else list(reversed(contenders)):
                for n, b in batches.items():
                    m = measure(contenders[name], b, proc, max(4, BATCHES * BATCH // n), 2)
                    m["load"] = load()
                    runs[name][n].append(m)
                    print(f"round {r} {name} {n:,} rows: {m}")
    finally:
        tr.ONE_ROW_FROM = default
    results["runs"] = runs
    results["one_row_vs_rows_jvm_cpu"] = {
        f"{base} {n}": [
            o["jvm_cpu_s_per_100k"] / w["jvm_cpu_s_per_100k"]
            for o, w in zip(runs[f"{base} as one row"][n], runs[f"{base} as rows"][n], strict=True)
        ]
        for base in ("one-pass", "floor-cast-only")
        for n in SIZES
    }
    print("JVM CPU per row, one row / its rows:", results["one_row_vs_rows_jvm_cpu"])
    if OUT:
        with open(OUT.replace(".json", "_one_row.json"), "w") as f:
            json.dump(results, f, indent=1)


def cache_threshold(spark: Any, limit: int) -> None:
    """The session's ``localRelationCacheThreshold``: from that many bytes ``createDataFrame``
    uploads a table as artifacts before its query (read again by the next call)."""
    spark.conf.set("spark.sql.session.localRelationCacheThreshold", str(limit))
    spark.client.get_config_dict.cache.clear()  # conveyor.spark.session.ConfCache


def test_a_batch_inside_its_query_vs_as_artifacts(warm_spark_remote: str) -> None:
    proc, spark = jvm_and_session(warm_spark_remote)
    default = spark.conf.get("spark.sql.session.localRelationCacheThreshold")
    t = one_pass(spark)
    t.prepare()
    b = batch(40_000)
    limits = {"inside its query": 64 << 20, "as artifacts": int(default)}
    results: dict[str, Any] = {"commit": os.popen("git rev-parse --short HEAD").read().strip()}
    runs: dict[str, list[dict]] = {k: [] for k in limits}
    try:
        for limit in limits.values():
            cache_threshold(spark, limit)
            for _ in range(5):
                t(b)
        for r in range(ROUNDS):
            for name in list(limits) if r % 2 == 0 else list(reversed(limits)):
                cache_threshold(spark, limits[name])
                m = measure(t, b, proc, max(24, BATCHES * BATCH // b.num_rows), 3)
                m["load"] = load()
                runs[name].append(m)
                print(f"round {r} {name}: {m}")
    finally:
        cache_threshold(spark, int(default))
    results["runs"] = runs
    results["inside_vs_artifacts"] = {
        key: [
            i[key] / a[key]
            for i, a in zip(runs["inside its query"], runs["as artifacts"], strict=True)
        ]
        for key in ("rows_per_s", "jvm_cpu_s_per_100k", "client_cpu_s_per_100k")
    }
    print("inside its query / as artifacts:", results["inside_vs_artifacts"])
    if OUT:
        with open(OUT, "w") as f:
            json.dump(results, f, indent=1)
