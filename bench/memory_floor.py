"""The RSS a connector's run process needs before and outside its data path (issue 18).

Imports what a run imports, in a run's order, printing the RSS each adds; then, against a
Spark Connect server, the Spark session, the transform's analysis and 40,000-record
batches of the benchmark's JSON orders through the transform (``decode: json`` with the
benchmark's schema), printing the RSS after each. No Dagster run, no source, no sink: what
a run holds beyond this is Dagster's run and the pipeline (docs/BENCHMARKS.md, run AZ)::

    .venv/bin/python -m bench.memory_floor                      # starts a local Connect server
    .venv/bin/python -m bench.memory_floor sc://127.0.0.1:15002 [batches]

The allocators are set as a run sets them (``conveyor/dagster/jobs/allocators.py``).
Not a test.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# In a run's order: Dagster's run worker, the code location, then the Spark Connect client.
IMPORTS = [
    "dagster",
    "pyarrow",
    "pyarrow.compute",
    "pandas",
    "confluent_kafka",
    "conveyor.dagster.definitions",
    "pyspark.sql.connect.session",
    "conveyor.dagster.jobs.connector",
]
ROWS = 40_000
SCHEMA = "id BIGINT, name STRING, amount DOUBLE"


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Ledger:
    def __init__(self) -> None:
        self.last = rss_mb()
        print(f"{'interpreter':<44} {self.last:7.1f} MB")

    def mark(self, what: str) -> None:
        now = rss_mb()
        print(f"{what:<44} {now:7.1f} MB  ({now - self.last:+.1f})", flush=True)
        self.last = now


def orders_batch(rows: int) -> object:
    from bench.harness import order
    from conveyor.brokers.confluent import TIMESTAMP_TYPES
    from conveyor.brokers.kafka import columns_to_table

    values: list[bytes | None] = [json.dumps(order(i)).encode() for i in range(rows)]
    return columns_to_table(
        topics=["orders"] * rows,
        partitions=[i % 2 for i in range(rows)],
        offsets=list(range(rows)),
        timestamps=[0] * rows,
        timestamp_types=[1] * rows,
        type_names=TIMESTAMP_TYPES,
        keys=[None] * rows,
        headers=[None] * rows,
        values=values,
    )


def measure(remote: str, batches: int) -> None:
    ledger = Ledger()
    for name in IMPORTS:
        importlib.import_module(name)
        ledger.mark(f"import {name}")
    from conveyor.core.model import TransformSpec
    from conveyor.dagster.jobs.allocators import use_run_allocators
    from conveyor.spark.session import spark_session
    from conveyor.spark.transform import SparkTransformer

    use_run_allocators()  # Arrow's pool and glibc's mmap threshold, as a run sets them
    session = spark_session(remote)
    ledger.mark("Spark Connect session")
    transform = SparkTransformer(
        TransformSpec.model_validate({"decode": "json", "schema": SCHEMA}), session
    )
    transform.prepare()
    ledger.mark("the transform's analysis")
    batch = orders_batch(ROWS)
    ledger.mark(f"one {ROWS:,}-record source batch")
    for i in range(batches):
        out = transform(batch)
        ledger.mark(f"batch {i + 1} through Spark ({out.table.num_rows:,} rows)")
    import pyarrow as pa

    print(f"Arrow's live buffers at the end: {pa.total_allocated_bytes() / 2**20:.1f} MB")


def main(argv: list[str]) -> None:
    batches = int(argv[1]) if len(argv) > 1 else 3
    if argv:
        measure(argv[0], batches)
        return
    # The server is started here and measured from a fresh interpreter, so that starting
    # it imports nothing into the process measured.
    from conveyor.spark.server import start_spark_connect

    with (
        tempfile.TemporaryDirectory() as work,
        start_spark_connect(work_dir=Path(work)) as server,
    ):
        cmd = [sys.executable, "-m", "bench.memory_floor", server.remote, str(batches)]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
