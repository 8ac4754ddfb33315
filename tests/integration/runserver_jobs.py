"""Jobs the run-server tests launch: one that ends at once, one that waits to be interrupted."""

import time
from pathlib import Path

from dagster import OpExecutionContext, in_process_executor, job, op


@op
def finish() -> int:
    return 1


@job(executor_def=in_process_executor)
def quick_job() -> None:
    finish()


@op(config_schema={"marker": str})
def wait_for_interrupt(context: OpExecutionContext) -> None:
    """Writes its marker file, then waits until Dagster's interrupt stops it."""
    print(f"waiting for an interrupt: {context.run_id}", flush=True)
    Path(context.op_config["marker"]).write_text("started")
    while True:
        time.sleep(0.05)


@job(executor_def=in_process_executor)
def waiting_job() -> None:
    wait_for_interrupt()


@op(config_schema={"marker": str, "end": str})
def wait_for_end_file(context: OpExecutionContext) -> None:
    """Writes its marker file, then returns once the end file exists (no interrupt needed)."""
    Path(context.op_config["marker"]).write_text("started")
    while not Path(context.op_config["end"]).exists():
        time.sleep(0.05)


@job(executor_def=in_process_executor)
def ending_job() -> None:
    wait_for_end_file()
