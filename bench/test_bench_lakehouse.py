"""Benchmark (issue 39): the connector into Apache Iceberg as users run it, against the bare
loop a user writes, side by side.

Issue 18's method (bench/test_bench_as_users_run_it.py). Each contender drains the same
backlog (``N`` JSON orders ``id``, ``name``, ``amount``, ``ts`` on 2 partitions of a fresh
tansu topic, produced before the clock starts) into its own Iceberg table (a SQLite SQL
catalog, a warehouse on local disk):

- **conveyor**: a connector spec with default settings (``sink: {type: iceberg, namespace,
  table}``: the default catalog ``$CONVEYOR_HOME/iceberg/catalog.db``, one table commit per
  batch), desired stopped, in a ``dagster dev`` stack; ``conveyor connector start`` starts
  the clock, the scheduler sensor launches the run;
- **librdkafka**: bench/contenders/librdkafka_iceberg.py: ``consume(40000)`` (the connector's
  default batch), ``json.loads``, ``pyarrow`` ``from_pylist``, pyiceberg ``table.append``,
  commit per batch.

Rows are counted every 0.2 s from the table's current snapshot (``total-records``: what a
reader sees). **steady** rows/s is between 20% and 90% of ``N``, **total** from the start
command (the script's start) to the last row; CPU s per 100,000 rows over the steady window
and over the whole drain, per process (Conveyor's run process and the Spark Connect JVM
apart). The small files question: each table's data files (count, mean size) and snapshots
at the end, then the maintenance job's work (``conveyor.dagster.jobs.maintenance``: compaction,
expiry with retention 0, files deleted) on the connector's last table, timed. Every table is
checked: ``N`` rows, ``N`` distinct ids, the amounts' sum.

    CONVEYOR_BENCH_LAKE_N=200000 .venv/bin/python -m pytest bench/test_bench_lakehouse.py -m bench -s -n 0
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from bench.drain import Pids, Result, drain_connector, sample_until_done
from bench.stack import dev_stack, listening_pid
from bench.test_bench_as_users_run_it import SCHEMA, produce
from bench.test_bench_avro import cpu_whole_per_100k
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.bench, pytest.mark.timeout(7200)]

N = int(os.environ.get("CONVEYOR_BENCH_LAKE_N", "200000"))
ROUNDS = int(os.environ.get("CONVEYOR_BENCH_LAKE_ROUNDS", "1"))
BATCH = 40_000  # the connector's default batch.max_records, the loop's consume() size
CONTENDERS = ["conveyor", "librdkafka"]
OUT = os.environ.get("CONVEYOR_BENCH_OUT")  # also write the results as JSON here
ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "bench"


class Lake:
    """One SQL catalog and its warehouse (a contender's), read as a reader would."""

    def __init__(self, catalog_db: Path, warehouse: Path, name: str) -> None:
        from pyiceberg.catalog import load_catalog

        catalog_db.parent.mkdir(parents=True, exist_ok=True)
        warehouse.mkdir(parents=True, exist_ok=True)
        self.uri = f"sqlite:///{catalog_db}"
        self.warehouse = f"file://{warehouse}"
        # A SQL catalog's rows are keyed by its name: the sink's is "conveyor" (its default).
        self.catalog = load_catalog(name, type="sql", uri=self.uri, warehouse=self.warehouse)

    def summary(self, table: str) -> dict[str, str]:
        """The current snapshot's summary ({} while the table or its first snapshot is missing)."""
        from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

        try:
            snap = self.catalog.load_table((NAMESPACE, table)).current_snapshot()
        except (NoSuchTableError, NoSuchNamespaceError):
            return {}
        return dict(snap.summary.additional_properties) if snap is not None else {}

    def rows(self, table: str) -> int:
        return int(self.summary(table).get("total-records", 0))

    def files(self, table: str) -> dict[str, float]:
        """The small files question: data files, their mean size, and snapshots."""
        s = self.summary(table)
        files = int(s.get("total-data-files", 0))
        size = int(s.get("total-files-size", 0))
        snapshots = len(self.catalog.load_table((NAMESPACE, table)).snapshots())
        return {"files": files, "mean_mib": size / max(files, 1) / 2**20, "snapshots": snapshots}

    def check_contents(self, table: str) -> None:
        """``N`` rows, ``N`` distinct ids, the amounts' exact sum (i * 0.5 is exact)."""
        import pyarrow.compute as pc

        data = self.catalog.load_table((NAMESPACE, table)).scan().to_arrow()
        assert data.num_rows == N, table
        assert pc.count_distinct(data.column("id")).as_py() == N, table
        assert pc.sum(data.column("amount")).as_py() == sum(i * 0.5 for i in range(N)), table


def spec(name: str, topic: str) -> dict[str, Any]:
    """What a user writes: defaults everywhere but the source, the decoding and the sink."""
    return {
        "name": name,
        "desired": "stopped",
        "source": {"topics": [topic]},
        "transform": {"decode": "json", "schema": SCHEMA},
        "sink": {"type": "iceberg", "namespace": NAMESPACE, "table": name},
    }


def run_loop(bootstrap: str, topic: str, lake: Lake, table: str, home: Path) -> Result:
    """The librdkafka + pyiceberg loop as its own process, watched until all ``N`` rows are in."""
    result = Result("librdkafka", time.monotonic(), N, sink="iceberg")
    log_path = home / f"librdkafka-{table}.log"
    args = [
        "--bootstrap", bootstrap, "--topic", topic, "--group", f"g_{uuid.uuid4().hex[:8]}",
        "--catalog", lake.uri, "--warehouse", lake.warehouse, "--table", f"{NAMESPACE}.{table}",
        "--n", str(N), "--batch", str(BATCH),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.contenders.librdkafka_iceberg", *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            sample_until_done(result, lambda: lake.rows(table), lambda: {"process": proc.pid})
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert proc.returncode == 0, log_path.read_text()[-2000:]
    return result


def test_iceberg_as_users_run_it_vs_the_librdkafka_pyiceberg_loop(
    tansu: str, warm_spark_remote: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    home = tmp_path / "home"
    jvm = listening_pid(int(warm_spark_remote.rsplit(":", 1)[1]))
    names = [f"lake_conv_r{i}_{tag}" for i in range(ROUNDS)]
    conveyor_lake_paths = (home / "iceberg" / "catalog.db", home / "iceberg" / "warehouse")
    loop_lake = Lake(tmp_path / "loop" / "catalog.db", tmp_path / "loop" / "warehouse", "bench")
    results: dict[str, list[Result]] = {c: [] for c in CONTENDERS}
    files: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
    loads = [("start", os.getloadavg())]
    with dev_stack(home, tansu, warm_spark_remote, [spec(n, f"t_{n}") for n in names]) as stack:
        wait_for(lambda: len(stack.store.list()) == len(names), 120, "specs synced")
        conveyor_lake = Lake(*conveyor_lake_paths, "conveyor")
        for i, name in enumerate(names):
            for contender in CONTENDERS if i % 2 == 0 else list(reversed(CONTENDERS)):
                table = name if contender == "conveyor" else f"lake_loop_r{i}_{tag}"
                lake = conveyor_lake if contender == "conveyor" else loop_lake
                produce(tansu, f"t_{table}", N)
                if contender == "conveyor":
                    res = Result("conveyor", time.monotonic(), N, sink="iceberg")

                    def watch(r: Result, pids: Pids, t: str = table) -> Result:
                        return sample_until_done(r, lambda: conveyor_lake.rows(t), pids)

                    drain_connector(stack, res, table, jvm, watch)
                else:
                    res = run_loop(tansu, f"t_{table}", lake, table, tmp_path)
                lake.check_contents(table)
                results[contender].append(res)
                files[contender].append(lake.files(table))
                loads.append((f"{i + 1} {contender}", os.getloadavg()))
                print(
                    f"round {i + 1} {contender:<10} load {os.getloadavg()}"
                    f" steady {res.steady_rate():>9,.0f} rows/s  total {res.total_rate():>9,.0f}"
                    f"  cpu/100K {res.cpu_per_100k()}  whole drain {cpu_whole_per_100k(res)}"
                    f"  files {files[contender][-1]}"
                )
        compaction = maintain(home, spec(names[-1], "")["sink"])
    report(results, files, loads)
    print(f"maintenance of {names[-1]} (retention 0 h): {compaction}")


def maintain(home: Path, sink: dict[str, Any]) -> dict[str, Any]:
    """The maintenance job's work on the connector's last table, timed: compaction of its
    small files, then every snapshot but the current expired and their files deleted."""
    from conveyor.dagster.jobs.maintenance import MaintenanceConfig, maintain_table
    from conveyor.sinks import build_sink

    before = os.environ.get("CONVEYOR_HOME")
    os.environ["CONVEYOR_HOME"] = str(home)  # where the sink's default catalog lies
    try:
        config = build_sink(sink).config
        start = time.monotonic()
        result = maintain_table(config, MaintenanceConfig(retention_hours=0, compact_min_files=1))
        seconds = time.monotonic() - start
    finally:
        if before is None:
            os.environ.pop("CONVEYOR_HOME")
        else:
            os.environ["CONVEYOR_HOME"] = before
    assert result.rows == N and result.files_after < result.files_before
    on_disk = list((home / "iceberg" / "warehouse" / NAMESPACE / sink["table"]).rglob("*.parquet"))
    size = sum(p.stat().st_size for p in on_disk)
    return {
        "seconds": round(seconds, 1),
        "files_before": result.files_before,
        "files_after": result.files_after,
        "files_on_disk": len(on_disk),
        "mean_mib_on_disk": round(size / max(len(on_disk), 1) / 2**20, 2),
        "snapshots_expired": result.snapshots_expired,
        "files_deleted": result.files_deleted,
    }


def report(
    results: dict[str, list[Result]],
    files: dict[str, list[dict[str, float]]],
    loads: list[tuple[str, Any]],
) -> None:
    """The table for docs/BENCHMARKS.md (markdown, printed; JSON to $CONVEYOR_BENCH_OUT)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"Iceberg as users run it: {N:,} messages, {ROUNDS} round(s), commit {commit}",
        "",
        "| contender | steady rows/s | total rows/s | CPU s per 100K rows, steady window"
        " | CPU s per 100K rows, whole drain | data files | mean file MiB | snapshots |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out: dict[str, Any] = {"n": N, "rounds": ROUNDS, "commit": commit, "loads": loads}
    for c, rs in results.items():
        steady = [r.steady_rate() for r in rs]
        total = [r.total_rate() for r in rs]
        keys = rs[0].cpu_per_100k()
        cpu = {k: statistics.median([r.cpu_per_100k().get(k, 0.0) for r in rs]) for k in keys}
        whole = {
            k: statistics.median([cpu_whole_per_100k(r).get(k, 0.0) for r in rs]) for k in keys
        }
        f = files[c][-1]
        out[c] = {
            "steady": steady,
            "total": total,
            "cpu": cpu,
            "cpu_whole": whole,
            "files": files[c],
        }
        lines.append(
            f"| {c} | {', '.join(f'{x:,.0f}' for x in steady)}"
            f" | {', '.join(f'{x:,.0f}' for x in total)}"
            f" | {', '.join(f'{k} {v:.2f}' for k, v in cpu.items())}"
            f" | {', '.join(f'{k} {v:.2f}' for k, v in whole.items())}"
            f" | {f['files']:.0f} | {f['mean_mib']:.2f} | {f['snapshots']:.0f} |"
        )
    print("\n" + "\n".join(lines) + f"\nload averages: {loads}")
    if OUT:
        Path(OUT).write_text(json.dumps(out, indent=2))
