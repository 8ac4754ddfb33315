"""Where the Spark Connect JVM's CPU goes while it transforms benchmark batches (issue 18).

Runs the connector's transform (``decode: json`` with the benchmark's schema), or the
cast-only floor (``cast``), on batches of ``rows`` rows, ``depth`` at a time, while Java
Flight Recorder samples the server's JVM (``jcmd JFR.start``), then sorts the samples
into categories by their stack (the first category any frame matches)::

    .venv/bin/python -m bench.profile_spark_jvm sc://127.0.0.1:15002 [batches] [depth] [rows] [transform|cast]

Batches from ``ONE_ROW_FROM`` rows (20,000) cross as one row; ``CONVEYOR_BENCH_ONE_ROW_FROM``
sets another threshold for the profile. The
first category is the plan rules walking a ``LocalRelation``'s rows (a mapping over a
sequence argument of a plan node, ``QueryPlan.recursiveTransform``): 48-60% of the samples
of ``30 2 40000 cast`` with every batch crossing as its rows
(``CONVEYOR_BENCH_ONE_ROW_FROM=1000000``; docs/BENCHMARKS.md, "The transform alone: a
large batch as one row").

Needs ``jcmd`` and ``jfr`` from the JDK running the server. Not a test.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CATEGORIES = [
    ("plan rules walking the batch's rows (a LocalRelation's data)", ["ArraySeq.map < org.apache.spark.sql.catalyst.plans.QueryPlan.recursiveTransform"]),
    ("from_json (Jackson parse, row conversion)", ["JacksonParser", "JsonToStructs", "jackson"]),
    ("rest of the query, evaluated by the optimizer (ConvertToLocalRelation)", ["ConvertToLocalRelation"]),
    ("Arrow in (Arrow batch -> rows)", ["ArrowConverters", "transformLocalRelation", "ArrowColumnVector"]),
    ("Arrow out (rows -> Arrow)", ["ArrowBatch", "ArrowWriter", "toArrow", "SparkConnectPlanExecution"]),
    ("analysis", ["Analyzer", "CheckAnalysis", "resolveOperators", "resolveExpressions", "QueryExecution.analyzed"]),
    ("optimizer and physical planning (other rules)", ["Optimizer", "RuleExecutor", "SparkPlanner", "QueryPlanner", "lazyOptimizedPlan", "executedPlan"]),
    ("Spark Connect planner (proto -> plan)", ["SparkConnectPlanner"]),
    ("gRPC, netty, protobuf", ["io.grpc", "netty", "protobuf"]),
]  # fmt: skip


def categorize(jfr_file: Path) -> dict[str, float]:
    """Share of the JVM's execution samples per category."""
    dump = subprocess.run(
        ["jfr", "print", "--json", "--stack-depth", "256", "--events", "jdk.ExecutionSample", str(jfr_file)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    counts: collections.Counter[str] = collections.Counter()
    for e in json.loads(dump)["recording"]["events"]:
        frames = (e["values"]["stackTrace"] or {}).get("frames", [])
        text = " < ".join(
            f["method"]["type"]["name"].replace("/", ".") + "." + f["method"]["name"]
            for f in frames
        )  # innermost first, each frame as package.Class.method
        if text:
            counts[
                next((n for n, keys in CATEGORIES if any(k in text for k in keys)), "other")
            ] += 1
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in counts.most_common()}


def main(
    remote: str, batches: int = 60, depth: int = 2, rows: int = 10_000, query: str = "transform"
) -> None:
    from bench.stack import listening_pid
    from bench.test_bench_transform import batch, floor, one_pass
    from conveyor.spark import transform as tr
    from conveyor.spark.session import spark_session

    if os.environ.get("CONVEYOR_BENCH_ONE_ROW_FROM"):
        tr.ONE_ROW_FROM = int(os.environ["CONVEYOR_BENCH_ONE_ROW_FROM"])
    pid = listening_pid(int(remote.rsplit(":", 1)[1]))
    spark = spark_session(remote)
    transform = floor(spark, decode=False) if query == "cast" else one_pass(spark)
    transform.prepare()
    b = batch(rows)
    for _ in range(20):  # compiled and JIT-warm
        transform(b)
    out = Path(tempfile.mkdtemp()) / "transform.jfr"
    subprocess.run(["jcmd", str(pid), "JFR.start", "name=conveyor", "settings=profile", f"filename={out}"], check=True)  # fmt: skip
    left = [batches]
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not left[0]:
                    return
                left[0] -= 1
            transform(b)

    start = time.monotonic()
    threads = [threading.Thread(target=work) for _ in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    subprocess.run(["jcmd", str(pid), "JFR.stop", "name=conveyor"], check=True, capture_output=True)
    print(f"{batches} batches of {rows:,} rows ({query}), depth {depth}, {wall:.1f} s; JFR: {out}")
    for name, share in categorize(out).items():
        print(f"{share * 100:5.1f}%  {name}")


if __name__ == "__main__":
    args = sys.argv[2:]
    query = args.pop() if args and not args[-1].isdigit() else "transform"
    main(sys.argv[1], *(int(a) for a in args), query=query)  # type: ignore[misc]
