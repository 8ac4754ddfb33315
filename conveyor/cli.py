"""The ``conveyor`` command: dev environment, connectors, brokers, offsets.

Every command exits non-zero with a one-line message on error, never a bare
traceback (set CONVEYOR_DEBUG=1 to see one).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import yaml
from rich.console import Console
from rich.table import Table

from conveyor.core.errors import ConveyorError
from conveyor.core.model import ConnectorStatus, DesiredState, TopicPartition
from conveyor.core.state import StateChange
from conveyor.store.meta import MetaStore, StoreError


class _LazyConsole:
    """A rich Console bound at print time (so redirected stdout is honoured); wide when not a TTY."""

    def __getattr__(self, name: str) -> Any:
        width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "200"))
        return getattr(Console(width=width), name)


console: Any = _LazyConsole()
F = TypeVar("F", bound=Callable[..., Any])


def _fail(msg: str) -> None:
    click.secho(f"error: {msg}", fg="red", err=True)
    sys.exit(1)


def handles_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except (ConveyorError, StoreError) as e:
            if os.environ.get("CONVEYOR_DEBUG"):
                raise
            _fail(str(e))

    return wrapper  # type: ignore[return-value]


def _store(ctx: click.Context) -> MetaStore:
    store = MetaStore(ctx.obj.get("meta_url"))
    store.ensure_schema()
    return store


def _ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    d = dt.datetime.now().timestamp() - ts
    if d < 120:
        return f"{d:.0f}s ago"
    if d < 7200:
        return f"{d / 60:.0f}m ago"
    return f"{d / 3600:.1f}h ago"


@click.group()
@click.option(
    "--meta-url",
    envvar="CONVEYOR_META_URL",
    default=None,
    help="Meta store URL (default: SQLite in $CONVEYOR_HOME).",
)
@click.pass_context
def main(ctx: click.Context, meta_url: str | None) -> None:
    """Conveyor: message connectors on Dagster."""
    ctx.ensure_object(dict)
    ctx.obj["meta_url"] = meta_url


# -- dev ---------------------------------------------------------------------------


@main.command()
@click.option(
    "--home",
    type=click.Path(path_type=Path),
    default=None,
    help="State directory (default: $CONVEYOR_HOME or ./.conveyor).",
)
@click.option("--kafka-port", default=9092, show_default=True, help="Port of the embedded broker.")
@click.option(
    "--spark-port", default=15002, show_default=True, help="Port of the local Spark Connect server."
)
@click.option(
    "--port", "dagster_port", default=3000, show_default=True, help="Port of the Dagster UI."
)
@click.option("--rate", default=50.0, show_default=True, help="Demo producer messages per second.")
@click.option("--no-demo", is_flag=True, help="Do not start the demo producer and connector.")
@click.option(
    "--spark-workers",
    type=click.IntRange(min=0, max=16),
    default=0,
    show_default=True,
    help="Run the broker executor's Spark Connect server in front of a Spark standalone "
    "cluster (a master and this many workers, 1 core each) instead of local[*].",
)
@handles_errors
def dev(
    home: Path | None,
    kafka_port: int,
    spark_port: int,
    dagster_port: int,
    rate: float,
    no_demo: bool,
    spark_workers: int,
) -> None:
    """Start the embedded broker, Spark Connect, a demo, and `dagster dev`."""
    from conveyor.devserver import run_dev

    home = (home or Path(os.environ.get("CONVEYOR_HOME", ".conveyor"))).resolve()
    sys.exit(
        run_dev(
            home=home,
            kafka_port=kafka_port,
            spark_port=spark_port,
            dagster_port=dagster_port,
            producer_rate=rate,
            demo=not no_demo,
            spark_workers=spark_workers,
        )
    )


# -- connectors ----------------------------------------------------------------------


@main.group()
def connector() -> None:
    """Create, inspect, start and stop connectors."""


@connector.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handles_errors
def connector_list(ctx: click.Context, as_json: bool) -> None:
    """State, broker, lag, msgs/s and last error of every connector."""
    rows = _store(ctx).list()
    if as_json:
        click.echo(json.dumps([_row_dict(r) for r in rows], indent=2))
        return
    table = Table(title="connectors")
    for col in (
        "name",
        "state",
        "desired",
        "broker",
        "gen",
        "lag",
        "msgs/s",
        "delivered",
        "heartbeat",
        "last error",
    ):
        table.add_column(col, overflow="fold")
    colors = {
        "Running": "green",
        "Degraded": "yellow",
        "Error": "red",
        "Stopped": "dim",
        "Idle": "blue",
    }
    for r in rows:
        c = r.counters
        table.add_row(
            r.name,
            f"[{colors.get(r.status.value, 'white')}]{r.status.value}[/]",
            r.desired.value,
            r.broker_id or "-",
            str(r.generation),
            "-" if c.get("lag") is None else str(c["lag"]),
            f"{c.get('msgs_per_s', 0):.0f}",
            str(c.get("messages_out", 0)),
            _ago(r.heartbeat_at),
            (r.last_error or "")[:120],
        )
    console.print(table)


def _row_dict(r: Any) -> dict[str, Any]:
    return {
        "name": r.name,
        "status": r.status.value,
        "desired": r.desired.value,
        "broker": r.broker_id,
        "generation": r.generation,
        "run_id": r.run_id,
        "heartbeat_at": r.heartbeat_at,
        "counters": r.counters,
        "last_error": r.last_error,
        "spec_source": r.spec_source,
        "spec_error": r.spec_error,
    }


@connector.command("show")
@click.argument("name")
@click.pass_context
@handles_errors
def connector_show(ctx: click.Context, name: str) -> None:
    """Everything about one connector, with its offsets."""
    store = _store(ctx)
    r = store.get(name)
    d = _row_dict(r)
    d["spec"] = _redacted_spec(r.spec)
    d["offsets"] = {str(tp): off for tp, off in sorted(store.committed_offsets(name).items())}
    click.echo(yaml.safe_dump(d, sort_keys=False))


def _redacted_spec(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """The spec with the sink's secrets masked (through the sink's own config model)."""
    if not spec:
        return spec
    from conveyor.sinks import parse_sink_config

    out = dict(spec)
    try:
        out["sink"] = parse_sink_config(spec["sink"]).redacted()
    except Exception:  # noqa: BLE001 - unparseable: mask every value but the type
        out["sink"] = {
            k: (v if k == "type" else "**********") for k, v in (spec.get("sink") or {}).items()
        }
    return out


@connector.command("apply")
@click.option(
    "-f",
    "--file",
    "path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
)
@click.pass_context
@handles_errors
def connector_apply(ctx: click.Context, path: Path) -> None:
    """Create or update a connector from a spec file (validated first)."""
    from conveyor.specs import load_file

    ls = load_file(path)
    if not ls.ok:
        _fail(ls.error or "invalid spec")
    assert ls.spec is not None
    row = _store(ctx).sync_spec(
        ls.name,
        spec_json=ls.spec_json(),
        spec_hash=ls.spec_hash(),
        source="cli",
        error=None,
        desired=ls.spec.desired,
    )
    click.echo(
        f"connector {row.name} applied ({row.status.value}, desired {row.desired.value}); reload the code location to see its job"
    )


@connector.command("start")
@click.argument("name")
@click.pass_context
@handles_errors
def connector_start(ctx: click.Context, name: str) -> None:
    """Desired state running; the scheduler sensor launches it."""
    r = _store(ctx).set_desired(name, DesiredState.RUNNING, reason="started from the CLI")
    click.echo(f"{name}: desired running (now {r.status.value})")


@connector.command("stop")
@click.argument("name")
@click.pass_context
@handles_errors
def connector_stop(ctx: click.Context, name: str) -> None:
    """Desired state stopped; the run stops itself at its next heartbeat."""
    store = _store(ctx)
    r = store.set_desired(name, DesiredState.STOPPED, reason="stopped from the CLI")
    if r.run_id is None or r.status in (ConnectorStatus.IDLE, ConnectorStatus.ERROR):
        store.apply(name, None, StateChange(status=ConnectorStatus.STOPPED), "stopped from the CLI")
    click.echo(f"{name}: desired stopped (now {r.status.value})")


@connector.command("restart")
@click.argument("name")
@click.pass_context
@handles_errors
def connector_restart(ctx: click.Context, name: str) -> None:
    """Fence the current run and let the scheduler start a fresh one."""
    store = _store(ctx)
    store.set_desired(name, DesiredState.RUNNING, reason="restart from the CLI")
    store.apply(name, None, StateChange.reset(), "restart from the CLI")
    click.echo(f"{name}: restarting (the old run is fenced; the scheduler launches a new one)")


@connector.command("delete")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask.")
@click.pass_context
@handles_errors
def connector_delete(ctx: click.Context, name: str, yes: bool) -> None:
    """Delete a stopped connector and its offsets."""
    store = _store(ctx)
    r = store.get(name)
    if r.status in (ConnectorStatus.RUNNING, ConnectorStatus.DEGRADED):
        _fail(f"{name} is {r.status.value}; stop it first")
    if not yes:
        click.confirm(f"delete connector {name} and its offsets?", abort=True)
    store.delete(name)
    click.echo(f"{name}: deleted")


@connector.command("history")
@click.argument("name")
@click.option("--limit", default=30, show_default=True)
@click.pass_context
@handles_errors
def connector_history(ctx: click.Context, name: str, limit: int) -> None:
    """State transitions and decisions, newest first."""
    store = _store(ctx)
    store.get(name)
    table = Table(title=f"history of {name}")
    for col in ("at", "from", "to", "gen", "run", "reason"):
        table.add_column(col, overflow="fold")
    for h in store.history(name, limit):
        table.add_row(
            dt.datetime.fromtimestamp(h.at).strftime("%Y-%m-%d %H:%M:%S"),
            h.from_status or "-",
            h.to_status,
            str(h.generation if h.generation is not None else "-"),
            (h.run_id or "-")[:8],
            h.reason,
        )
    console.print(table)


# -- offsets ---------------------------------------------------------------------------


@main.group()
def offsets() -> None:
    """Inspect and reset committed offsets."""


@offsets.command("show")
@click.argument("name")
@click.pass_context
@handles_errors
def offsets_show(ctx: click.Context, name: str) -> None:
    """Committed offsets (next offset to read) per partition."""
    store = _store(ctx)
    store.get(name)
    table = Table(title=f"offsets of {name}")
    table.add_column("topic")
    table.add_column("partition", justify="right")
    table.add_column("next offset", justify="right")
    for tp, off in sorted(store.committed_offsets(name).items()):
        table.add_row(tp.topic, str(tp.partition), str(off))
    console.print(table)


@offsets.command("reset")
@click.argument("name")
@click.option(
    "--to",
    "to",
    default=None,
    help="earliest, latest, or TOPIC:PARTITION:OFFSET (repeatable with commas).",
)
@click.option(
    "--to-datetime",
    "to_datetime",
    default=None,
    help="ISO 8601 time (e.g. 2026-11-01T00:00:00Z, naive = UTC): each partition's first record "
    "stamped at or after it (the end when there is none).",
)
@click.option(
    "--from-group",
    "from_group",
    default=None,
    help="Take over the committed offsets of this Kafka consumer group (e.g. connect-<name> of a "
    "Kafka Connect connector); partitions the group has no offset for keep theirs.",
)
@click.pass_context
@handles_errors
def offsets_reset(
    ctx: click.Context, name: str, to: str | None, to_datetime: str | None, from_group: str | None
) -> None:
    """Reset offsets of a STOPPED connector (as Kafka Connect's KIP-875).

    The cluster is reached with the connector's source connection (TLS, SASL).
    """
    store = _store(ctx)
    row = store.get(name)
    if (
        row.status not in (ConnectorStatus.STOPPED, ConnectorStatus.ERROR)
        or row.desired != DesiredState.STOPPED
    ):
        _fail(
            f"{name} is {row.status.value} (desired {row.desired.value}); run `conveyor connector stop {name}` first"
        )
    given = [
        o
        for o, v in (("--to", to), ("--to-datetime", to_datetime), ("--from-group", from_group))
        if v
    ]
    if len(given) != 1:
        _fail("give exactly one of --to, --to-datetime and --from-group")
    spec = row.spec or {}
    new: dict[TopicPartition, int] = {}
    if to is not None and to not in ("earliest", "latest"):
        for item in to.split(","):
            try:
                topic, part, off = item.rsplit(":", 2)
                new[TopicPartition(topic, int(part))] = int(off)
            except ValueError:
                _fail(f"{item!r} is not TOPIC:PARTITION:OFFSET")
    else:
        from conveyor.brokers.kafka import KafkaSource, source_time
        from conveyor.core.model import SourceSpec

        if to_datetime is not None:
            source_time(to_datetime)
        source = KafkaSource(SourceSpec.model_validate(spec["source"]), group_id=name)
        try:
            source.open(store.committed_offsets(name), wait_for_topics_s=5)
            if from_group is not None:
                new = source.group_offsets(from_group)
                if not new:
                    _fail(
                        f"consumer group {from_group!r} has no committed offsets for {name}'s topics"
                    )
            else:
                new = source.offsets_at(to or to_datetime or "earliest")
        finally:
            source.close()
    store.reset_offsets(name, new)
    click.echo(
        f"{name}: offsets reset to " + ", ".join(f"{tp}={o}" for tp, o in sorted(new.items()))
    )


# -- dead letters ------------------------------------------------------------------------


def _dead_letters_of(ctx: click.Context, name: str) -> tuple[Any, Any, str]:
    from conveyor.deadletters import SparkParquetDeadLetters, dead_letter_dir
    from conveyor.resources.conveyor import default_spark_remote
    from conveyor.spark.session import spark_session
    from conveyor.specs import from_store_row

    store = _store(ctx)
    row = store.get(name)
    ls = from_store_row(name, row.spec_json, row.spec_source, row.spec_error)
    if not ls.ok or ls.spec is None:
        _fail(f"{name} has an invalid spec: {ls.error}")
    assert ls.spec is not None
    if ls.spec.failure.dead_letter.store != "parquet":
        _fail(f"{name} dead-letters to the Kafka topic {name}.dlq; read it with any Kafka consumer")
    broker = store.get_broker(row.broker_id) if row.broker_id else None
    remote = broker.spark_remote if broker else default_spark_remote()
    session: dict[str, Any] = {}

    def spark() -> Any:
        if "s" not in session:
            session["s"] = spark_session(remote)
        return session["s"]

    return ls, SparkParquetDeadLetters(dead_letter_dir(ls.spec), spark, connector=name), remote


@main.group("dead-letters")
def dead_letters() -> None:
    """List, inspect and replay dead letters (through Spark)."""


@dead_letters.command("list")
@click.pass_context
@handles_errors
def dead_letters_list(ctx: click.Context) -> None:
    """Pending dead letters per connector."""
    table = Table(title="dead letters")
    for col in ("connector", "store", "pending", "dead-lettered by the current run"):
        table.add_column(col)
    for r in _store(ctx).list():
        spec = r.spec or {}
        policy = (spec.get("failure") or {}).get("policy")
        if policy != "dead_letter":
            continue
        store_kind = ((spec.get("failure") or {}).get("dead_letter") or {}).get("store", "parquet")
        pending = "-"
        if store_kind == "parquet":
            _, dl, _ = _dead_letters_of(ctx, r.name)
            pending = str(dl.count())
        table.add_row(r.name, store_kind, pending, str(r.counters.get("dead_lettered", 0)))
    console.print(table)


@dead_letters.command("show")
@click.argument("name")
@click.option("--limit", default=20, show_default=True)
@click.pass_context
@handles_errors
def dead_letters_show(ctx: click.Context, name: str, limit: int) -> None:
    """The oldest pending dead letters of a connector with their errors."""
    from conveyor.deadletters import sample_rows

    _, dl, _ = _dead_letters_of(ctx, name)
    rows = sample_rows(dl.pending(limit=limit), n=limit)
    table = Table(title=f"dead letters of {name} ({dl.count()} pending)")
    for col in ("where", "class", "attempts", "error", "payload"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["where"], r["error_class"], str(r["attempts"]), r["error"], r["payload"])
    console.print(table)


@dead_letters.command("replay")
@click.argument("name")
@click.option(
    "--batch-size",
    default=1_000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Letters re-sent per batch.",
)
@click.pass_context
@handles_errors
def dead_letters_replay(ctx: click.Context, name: str, batch_size: int) -> None:
    """Re-send pending dead letters through the connector's transform and sink."""
    from rich.progress import Progress

    from conveyor.jobs.replay import replay_dead_letters

    ls, dl, _ = _dead_letters_of(ctx, name)
    # A Progress needs one Console for its whole life (the lazy module console makes a new
    # one per call); stderr keeps stdout for the result line.
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task(f"replaying {name}", total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        result = replay_dead_letters(ls, dl.spark, batch_size=batch_size, progress=update)
    _store(ctx).record(
        name,
        f"dead letters replayed from the CLI: {result.delivered} delivered, {result.failed_again} failed again",
    )
    click.echo(
        f"{name}: {result.attempted} replayed: {result.delivered} delivered, {result.failed_again} failed again, {result.remaining} pending"
    )
    if result.failed_again:
        sys.exit(2)


# -- brokers -------------------------------------------------------------------------


@main.group()
def broker() -> None:
    """Broker executors: list, drain, undrain."""


@broker.command("list")
@click.pass_context
@handles_errors
def broker_list(ctx: click.Context) -> None:
    """Brokers with capacity, load and Spark endpoint."""
    store = _store(ctx)
    rows = store.list()
    table = Table(title="brokers")
    for col in ("id", "capacity", "assigned", "draining", "spark_remote", "run_tags"):
        table.add_column(col)
    for b in store.list_brokers():
        assigned = sum(
            1
            for r in rows
            if r.broker_id == b.id
            and r.status
            in (ConnectorStatus.RUNNING, ConnectorStatus.DEGRADED, ConnectorStatus.IDLE)
            and r.desired == DesiredState.RUNNING
        )
        table.add_row(
            b.id,
            str(b.capacity),
            str(assigned),
            "yes" if b.draining else "no",
            b.spark_remote,
            json.dumps(b.run_tags),
        )
    console.print(table)


@broker.command("drain")
@click.argument("broker_id")
@click.pass_context
@handles_errors
def broker_drain(ctx: click.Context, broker_id: str) -> None:
    """No new assignments; the scheduler moves connectors off it."""
    _store(ctx).set_draining(broker_id, True)
    click.echo(f"broker {broker_id}: draining")


@broker.command("undrain")
@click.argument("broker_id")
@click.pass_context
@handles_errors
def broker_undrain(ctx: click.Context, broker_id: str) -> None:
    """Accept assignments again."""
    _store(ctx).set_draining(broker_id, False)
    click.echo(f"broker {broker_id}: accepting connectors")


# -- metrics ---------------------------------------------------------------------------


@main.group()
def metrics() -> None:
    """Prometheus metrics from the meta store."""


@metrics.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=9464, show_default=True)
@click.pass_context
@handles_errors
def metrics_serve(ctx: click.Context, host: str, port: int) -> None:
    """Serve /metrics and /connectors/<name> until interrupted."""
    from conveyor.metrics import make_server

    server = make_server(_store(ctx), host, port)
    click.echo(f"serving http://{host}:{port}/metrics")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
