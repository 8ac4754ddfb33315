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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click
import yaml
from rich.console import Console
from rich.table import Table

from conveyor.control.operations import Operations, connector_kind, row_summary
from conveyor.core.errors import ConveyorError
from conveyor.core.model import ConnectorStatus
from conveyor.store.meta import LIVE_STATUSES, MetaStore, StoreError


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
        except (ConveyorError, StoreError) as e:  # incl. NotFound/Conflict/InvalidRequest
            if os.environ.get("CONVEYOR_DEBUG"):
                raise
            _fail(str(e))

    return wrapper  # type: ignore[return-value]


def _table(title: str, columns: Iterable[str]) -> Table:
    """A rich table whose cells wrap (fold) instead of being cut."""
    table = Table(title=title)
    for col in columns:
        table.add_column(col, overflow="fold")
    return table


def _store(ctx: click.Context) -> MetaStore:
    store = MetaStore(ctx.obj.get("meta_url"))
    store.ensure_schema()
    return store


def _ops(ctx: click.Context) -> Operations:
    """The shared operations (conveyor/control/operations.py); the scheduler reloads the code location."""
    from conveyor.config.specs import connectors_dir

    directory = ctx.obj.get("connectors_dir")
    return Operations(_store(ctx), Path(directory).resolve() if directory else connectors_dir())


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
@click.option(
    "--connectors-dir",
    envvar="CONVEYOR_CONNECTORS_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory of connector spec files (default: $CONVEYOR_HOME/connectors).",
)
@click.pass_context
def main(ctx: click.Context, meta_url: str | None, connectors_dir: Path | None) -> None:
    """Conveyor: message connectors on Dagster."""
    ctx.ensure_object(dict)
    ctx.obj["meta_url"] = meta_url
    ctx.obj["connectors_dir"] = connectors_dir


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
@click.option(
    "--api-port", default=8083, show_default=True, help="Port of the REST API (conveyor serve)."
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
@click.option(
    "--defs",
    multiple=True,
    metavar="MODULE|FILE.py",
    help="Your own Dagster definitions, loaded as a code location beside Conveyor's (a module "
    "importable from the current directory, or a .py file); repeat for several.",
)
@handles_errors
def dev(
    home: Path | None,
    kafka_port: int,
    spark_port: int,
    dagster_port: int,
    api_port: int,
    rate: float,
    no_demo: bool,
    spark_workers: int,
    defs: tuple[str, ...],
) -> None:
    """Start the embedded broker, Spark Connect, a demo, the REST API and `dagster dev`."""
    from conveyor.control.devserver import run_dev

    home = (home or Path(os.environ.get("CONVEYOR_HOME", ".conveyor"))).resolve()
    sys.exit(
        run_dev(
            home=home,
            kafka_port=kafka_port,
            spark_port=spark_port,
            dagster_port=dagster_port,
            producer_rate=rate,
            demo=not no_demo,
            api_port=api_port,
            spark_workers=spark_workers,
            defs=defs,
        )
    )


# -- REST API ----------------------------------------------------------------------------


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8083, show_default=True, help="Port (Kafka Connect's default).")
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="File holding the bearer token (default: $CONVEYOR_API_TOKEN_FILE, else $CONVEYOR_API_TOKEN).",
)
@click.option(
    "--no-auth",
    is_flag=True,
    help="Serve without a token (only on a loopback address).",
)
@click.option(
    "--dagster-url",
    envvar="CONVEYOR_DAGSTER_URL",
    default=None,
    help="Dagster webserver to reload when a spec changes (default: $CONVEYOR_DAGSTER_URL).",
)
@click.pass_context
@handles_errors
def serve(
    ctx: click.Context,
    host: str,
    port: int,
    token_file: Path | None,
    no_auth: bool,
    dagster_url: str | None,
) -> None:
    """Serve the REST API (Kafka Connect's shape) until interrupted."""
    import ipaddress

    from conveyor.config.reload import CoalescingReloader
    from conveyor.control.api import TOKEN_ENV, TOKEN_FILE_ENV, load_readonly_token, load_token
    from conveyor.control.api import serve as run_api
    from conveyor.control.api_guard import Access

    token = None if no_auth else load_token(token_file)
    readonly = None if no_auth else load_readonly_token()
    if readonly is not None and readonly == token:
        _fail("the read-only API token must differ from the admin token")
    access = Access.from_environ(token, readonly, bind_host=host)
    if token is None and not no_auth:
        _fail(
            f"no API token: set {TOKEN_ENV} or {TOKEN_FILE_ENV} (or --token-file); "
            "--no-auth serves without one, on a loopback address only"
        )
    if no_auth:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            _fail(f"--no-auth is refused on {host}: bind a loopback address or use a token")
    _store(ctx)  # fail now, with the store's message, rather than on the first request
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    conveyor_log = logging.getLogger("conveyor")
    conveyor_log.addHandler(handler)
    conveyor_log.setLevel(logging.INFO)
    reloader = CoalescingReloader(dagster_url.rstrip("/")) if dagster_url else None
    ops = _ops(ctx)
    ops.actor = "the REST API"
    ops.specs_changed = reloader.request if reloader else None
    click.echo(
        f"serving the REST API on http://{host}:{port} "
        f"({'token required' if token else 'NO authentication'}"
        f"{'; read-only token accepted' if readonly else ''}; connectors in {ops.directory}"
        + (f"; reloads {dagster_url}" if dagster_url else "; no Dagster URL: reload by hand")
        + ")",
        err=True,
    )
    run_api(lambda: ops, host=host, port=port, token=token, access=access)


# -- connectors ----------------------------------------------------------------------


@main.group()
def connector() -> None:
    """Create, inspect, start and stop connectors."""


_MOVING = (ConnectorStatus.RUNNING, ConnectorStatus.DEGRADED)  # a rate shown only for these


def _lag(counters: dict[str, Any]) -> str:
    """Messages behind (a sink connector), or a CDC slot's replication lag and the WAL it
    keeps, in bytes."""
    if counters.get("lag") is not None:
        return str(counters["lag"])
    if counters.get("replication_lag_bytes") is not None:
        out = f"{int(counters['replication_lag_bytes'])} B"
        if counters.get("retained_wal_bytes") is not None:
            out += f", WAL {int(counters['retained_wal_bytes'])} B"
        return out
    return "-"


@connector.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handles_errors
def connector_list(ctx: click.Context, as_json: bool) -> None:
    """State, broker, lag, msgs/s and last error of every connector."""
    rows = _ops(ctx).rows()
    if as_json:
        click.echo(json.dumps([row_summary(r) for r in rows], indent=2))
        return
    table = _table(
        "connectors",
        (
            "name",
            "kind",
            "state",
            "desired",
            "broker",
            "gen",
            "lag",
            "msgs/s",
            "delivered",
            "heartbeat",
            "last error",
        ),
    )
    colors = {
        "Running": "green",
        "Degraded": "yellow",
        "Error": "red",
        "Stopped": "dim",
        "Idle": "blue",
        "Paused": "cyan",
    }
    for r in rows:
        counters = r.counters
        table.add_row(
            r.name,
            connector_kind(r),
            f"[{colors.get(r.status.value, 'white')}]{r.status.value}[/]",
            r.desired.value,
            r.broker_id or (f"{counters['tasks']} tasks" if counters.get("tasks") else "-"),
            str(r.generation),
            _lag(counters),
            # A rate is of a running connector: a stopped or failed one shows none, not its last.
            f"{counters.get('msgs_per_s', 0):.0f}" if r.status in _MOVING else "-",
            str(counters.get("messages_out", 0)),
            _ago(r.heartbeat_at),
            (r.last_error or "")[:120],
        )
    console.print(table)


@connector.command("destinations")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handles_errors
def connector_destinations(ctx: click.Context, name: str, as_json: bool) -> None:
    """A source connector's destinations: produced, breaker state, failures, last error."""
    d = _ops(ctx).destinations(name)
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    table = _table(
        f"destinations of {name}",
        ("topic", "produced", "breaker", "failures", "create ms", "last error"),
    )
    for topic, x in sorted(d["destinations"].items()):
        table.add_row(
            topic,
            str(x.get("routed", 0)),
            str(x.get("breaker", "-")),
            str(x.get("consecutive_failures", 0)),
            "-" if x.get("create_ms") is None else f"{x['create_ms']:.0f}",
            (x.get("last_error") or "")[:120],
        )
    console.print(table)
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(d["rejected"].items())) or "none"
    unmatched = ", ".join(f"{k} {v}" for k, v in sorted(d["unmatched"].items())) or "none"
    click.echo(
        f"routed {d['routed']}; rejected: {rejected}; unmatched: {unmatched}; "
        f"open breakers {d['open_breakers']}; last abandon: {_ago(d['last_abandon_at'])}"
        + ("; abandon-batch requested" if d["abandon_requested"] else "")
    )


@connector.command("reset-state")
@click.argument("name")
@click.pass_context
@handles_errors
def connector_reset_state(ctx: click.Context, name: str) -> None:
    """Forget a STOPPED source connector's stored state (it reads from the beginning again)."""
    r = _ops(ctx).reset_source_state(name)
    click.echo(f"{name}: source state {'reset' if r['reset'] else 'was not stored'}")


@connector.command("abandon-batch")
@click.argument("name")
@click.pass_context
@handles_errors
def connector_abandon_batch(ctx: click.Context, name: str) -> None:
    """DATA LOSS: a STOPPED source connector's next run skips its first batch (one it can never
    deliver), storing the position after it; shown as last_abandon_at."""
    _ops(ctx).abandon_batch(name)
    click.echo(f"{name}: its next run skips its first batch (not produced); start it to apply")


@connector.command("show")
@click.argument("name")
@click.pass_context
@handles_errors
def connector_show(ctx: click.Context, name: str) -> None:
    """Everything about one connector: state, spec (secrets redacted), offsets."""
    ops = _ops(ctx)
    d = ops.summary(name)
    d["spec"] = ops.config(name)
    d["offsets"] = {
        f"{o['partition']['kafka_topic']}[{o['partition']['kafka_partition']}]": o["offset"][
            "kafka_offset"
        ]
        for o in ops.offsets(name)["offsets"]
    }
    click.echo(yaml.safe_dump(d, sort_keys=False))


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
    """Create or update a connector from a spec file (validated, then copied into the
    connectors directory; the scheduler loads it into the code location)."""
    ops = _ops(ctx)
    info, _created = ops.apply_file(path)
    row = ops.row(info["name"])
    click.echo(
        f"connector {row.name} applied ({row.status.value}, desired {row.desired.value}) "
        f"as {row.spec_source}"
    )


def _desired_state_command(verb: str, desired: str, doc: str) -> None:
    """``conveyor connector VERB NAME``: the operation of that name, answered with the desired
    state it set and the connector's status now."""

    @connector.command(verb, help=doc)
    @click.argument("name")
    @click.pass_context
    @handles_errors
    def command(ctx: click.Context, name: str) -> None:
        r = getattr(_ops(ctx), verb)(name)
        click.echo(f"{name}: desired {desired} (now {r.status.value})")


for _verb, _desired, _doc in (
    ("start", "running", "Desired state running; the scheduler sensor launches it."),
    ("stop", "stopped", "Desired state stopped; the run stops itself at its next heartbeat."),
    ("pause", "paused", "Pause: the run keeps its assignment and heartbeats, and reads nothing."),
    ("resume", "running", "Resume a paused connector (its run reads again within a second)."),
):
    _desired_state_command(_verb, _desired, _doc)


@connector.command("restart")
@click.argument("name")
@click.pass_context
@handles_errors
def connector_restart(ctx: click.Context, name: str) -> None:
    """Fence the current run and let the scheduler start a fresh one."""
    _ops(ctx).restart(name)
    click.echo(f"{name}: restarting (the old run is fenced; the scheduler launches a new one)")


@connector.command("delete")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask.")
@click.option(
    "--drop-slot",
    is_flag=True,
    help="Also drop what its source owns: a postgres_cdc replication slot and its managed "
    "publication (PostgreSQL stops keeping WAL for it; unread changes are lost).",
)
@click.pass_context
@handles_errors
def connector_delete(ctx: click.Context, name: str, yes: bool, drop_slot: bool) -> None:
    """Delete a stopped connector: its spec file, its state and its offsets."""
    ops = _ops(ctx)
    r = ops.row(name)
    if r.status in LIVE_STATUSES:
        _fail(f"{name} is {r.status.value}; stop it first")
    if not yes:
        slot = " and its replication slot" if drop_slot else ""
        click.confirm(f"delete connector {name}, its spec file, its offsets{slot}?", abort=True)
    kept = ops.delete(name, drop_slot=drop_slot)
    click.echo(f"{name}: deleted{' (slot dropped)' if drop_slot else ''}")
    for what in kept:
        hint = (
            " (`conveyor connector delete NAME --drop-slot` drops it while the connector exists)"
            if "slot" in what
            else ""
        )
        click.echo(f"warning: {what}{hint}", err=True)


@connector.command("tasks")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handles_errors
def connector_tasks(ctx: click.Context, name: str, as_json: bool) -> None:
    """The partition tasks of a connector (tasks.max > 1): partitions, rate and lag of each."""
    tasks = _ops(ctx).tasks(name)
    if as_json:
        click.echo(json.dumps(tasks, indent=2))
        return
    table = _table(
        f"tasks of {name}",
        ("task", "status", "broker", "gen", "partitions", "msgs/s", "lag", "heartbeat"),
    )
    for t in tasks:
        parts = ", ".join(
            f"{p} ({v['msgs_per_s']:.0f}/s, lag {v['lag'] if v['lag'] is not None else '-'})"
            for p, v in t["by_partition"].items()
        ) or ", ".join(t["partitions"])
        moving = [f"{p} -> task {to}" for p, to in t["releasing"].items()]
        moving += [f"{p} <- handover" for p in t["incoming"]]
        table.add_row(
            str(t["task"]),
            t["status"],
            t["broker"] or "-",
            str(t["generation"]),
            parts + (f" [{'; '.join(moving)}]" if moving else ""),
            "-" if t["msgs_per_s"] is None else f"{t['msgs_per_s']:.0f}",
            "-" if t["lag"] is None else str(t["lag"]),
            "-" if t["heartbeat_age_s"] is None else f"{t['heartbeat_age_s']:.0f}s ago",
        )
    console.print(table)
    if not tasks:
        click.echo(f"{name} runs as one run (tasks.max 1), or its tasks have not started yet")


@connector.command("history")
@click.argument("name")
@click.option("--limit", default=30, show_default=True)
@click.pass_context
@handles_errors
def connector_history(ctx: click.Context, name: str, limit: int) -> None:
    """State transitions and decisions, newest first."""
    table = _table(f"history of {name}", ("at", "from", "to", "gen", "run", "reason"))
    for h in _ops(ctx).history(name, limit):
        table.add_row(
            dt.datetime.fromtimestamp(h["at"]).strftime("%Y-%m-%d %H:%M:%S"),
            h["from"] or "-",
            h["to"],
            str(h["generation"] if h["generation"] is not None else "-"),
            (h["run_id"] or "-")[:8],
            h["reason"],
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
    table = Table(title=f"offsets of {name}")
    table.add_column("topic")
    table.add_column("partition", justify="right")
    table.add_column("next offset", justify="right")
    for o in _ops(ctx).offsets(name)["offsets"]:
        p = o["partition"]
        table.add_row(p["kafka_topic"], str(p["kafka_partition"]), str(o["offset"]["kafka_offset"]))
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
    from conveyor.control.operations import InvalidOptionError

    try:  # a bad --to (core.positions' rule) is a usage error naming the item
        new = _ops(ctx).reset_offsets_to(name, to, to_datetime=to_datetime, from_group=from_group)
    except InvalidOptionError as e:
        raise click.BadParameter(str(e), param_hint=f"'{e.option}'") from None
    click.echo(
        f"{name}: offsets reset to " + ", ".join(f"{tp}={o}" for tp, o in sorted(new.items()))
    )


# -- dead letters ------------------------------------------------------------------------


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
    ops = _ops(ctx)
    for r in ops.rows():
        spec = r.spec or {}
        policy = (spec.get("failure") or {}).get("policy")
        if policy != "dead_letter":
            continue
        store_kind = ((spec.get("failure") or {}).get("dead_letter") or {}).get("store", "parquet")
        pending = "-"
        if store_kind == "parquet":
            _, dl = ops.dead_letter_store(r.name)
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
    from conveyor.spark.deadletters import sample_rows

    _, dl = _ops(ctx).dead_letter_store(name)
    rows = sample_rows(dl.pending(limit=limit), n=limit)
    table = _table(
        f"dead letters of {name} ({dl.count()} pending)",
        ("where", "class", "attempts", "error", "payload"),
    )
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

    from conveyor.config.specs import resolved
    from conveyor.dagster.jobs.replay import replay_dead_letters

    ops = _ops(ctx)
    ls, dl = ops.dead_letter_store(name)
    live = resolved(ls)  # the replay sends: its secrets are resolved here, never shown
    # A Progress needs one Console for its whole life (the lazy module console makes a new
    # one per call); stderr keeps stdout for the result line.
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task(f"replaying {name}", total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        result = replay_dead_letters(live, dl.spark, batch_size=batch_size, progress=update)
    ops.store.record(
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
            and r.status in (*LIVE_STATUSES, ConnectorStatus.IDLE)
            and r.desired.wants_run
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
    from conveyor.control.metrics import make_server

    server = make_server(_store(ctx), host, port)
    click.echo(f"serving http://{host}:{port}/metrics")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# -- backfills -------------------------------------------------------------------------


@main.command("backfill")
@click.argument("name")
@click.option(
    "--start",
    required=True,
    help="Where each partition starts: earliest, an ISO 8601 time (naive = UTC; its first record "
    "stamped at or after it), or TOPIC:PARTITION:OFFSET[,...].",
)
@click.option(
    "--end",
    default="latest",
    show_default=True,
    help="Where each partition ends (excluded): latest (its end when the backfill starts), an "
    "ISO 8601 time, or TOPIC:PARTITION:OFFSET[,...].",
)
@click.pass_context
@handles_errors
def backfill(ctx: click.Context, name: str, start: str, end: str) -> None:
    """Read a range of a sink connector's topics again into its sink, while it runs (a request:
    Dagster's backfills sensor launches the run backfill__NAME)."""
    from conveyor.control.backfills import Backfills
    from conveyor.control.operations import InvalidRequestError

    try:
        r = Backfills.of(_ops(ctx)).request(name, start, end)
    except InvalidRequestError as e:
        raise click.UsageError(str(e)) from None
    click.echo(
        f"backfill {r['id']} of {name} requested: {r['start']} .. {r['end']}; the "
        f"conveyor_backfill_requests sensor launches backfill__{name}. Follow it with "
        f"`conveyor backfills {name} {r['id']}` or GET /connectors/{name}/backfills/{r['id']}"
    )


@main.command("backfills")
@click.argument("name")
@click.argument("backfill_id", required=False, type=int)
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 1000))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handles_errors
def backfills(
    ctx: click.Context, name: str, backfill_id: int | None, limit: int, as_json: bool
) -> None:
    """A connector's backfill requests, newest first (or the one BACKFILL_ID): state, run,
    counts."""
    from conveyor.control.backfills import Backfills

    b = Backfills.of(_ops(ctx))
    rows = [b.get(name, backfill_id)] if backfill_id is not None else b.list(name, limit)
    if as_json:
        click.echo(json.dumps(rows[0] if backfill_id is not None else rows, indent=2))
        return
    table = _table(
        f"backfills of {name}",
        (
            "id",
            "requested",
            "by",
            "range",
            "state",
            "run",
            "read",
            "delivered",
            "failed",
            "message",
        ),
    )
    for r in rows:
        table.add_row(
            str(r["id"]),
            _ago(r["requested_at"]),
            r["requested_by"],
            f"{r['start']} .. {r['end']}",
            r["state"],
            (r["run_id"] or "-")[:8],
            str(r["read"]),
            str(r["delivered"]),
            str(r["failed"]),
            (r["message"] or "")[:120],
        )
    console.print(table)


# -- lakehouse tables ------------------------------------------------------------------


@main.command("maintain-table")
@click.argument("name")
@click.option(
    "--retention-hours",
    default=168,
    show_default=True,
    type=click.IntRange(min=0),
    help="Iceberg: expire snapshots older than this; Delta: vacuum files removed longer ago.",
)
@click.option("--compact/--no-compact", default=True, show_default=True, help="Compact first.")
@click.option(
    "--compact-min-files",
    default=10,
    show_default=True,
    type=click.IntRange(min=1),
    help="Iceberg: compact only a table holding more data files than this.",
)
@click.option(
    "--compact-max-rows",
    default=20_000_000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Iceberg: skip compaction of a larger table (it is rewritten in memory).",
)
@click.option(
    "--delete-files/--keep-files",
    default=True,
    show_default=True,
    help="Iceberg: delete the files only expired snapshots referenced.",
)
@click.pass_context
@handles_errors
def maintain_table_command(
    ctx: click.Context,
    name: str,
    retention_hours: int,
    compact: bool,
    compact_min_files: int,
    compact_max_rows: int,
    delete_files: bool,
) -> None:
    """Compact an Iceberg or Delta connector's table, then expire old snapshots / vacuum: the
    Dagster job maintain_table__NAME, run in this process (safe beside the running connector)."""
    from conveyor.config.specs import load_source, resolved
    from conveyor.core.trust.scrubbing import exception_text, scrub
    from conveyor.dagster.jobs.maintenance import MaintenanceConfig, is_lakehouse, maintain_table

    loaded = load_source(name, _ops(ctx).row(name).spec_source)
    if not is_lakehouse(loaded):
        why = loaded.error or f"its sink is {getattr(loaded.sink, 'type', '?')}"
        raise ConveyorError(f"{name}: no table to maintain ({why}; only iceberg and delta)")
    settings = MaintenanceConfig(
        retention_hours=retention_hours,
        compact=compact,
        compact_min_files=compact_min_files,
        compact_max_rows=compact_max_rows,
        delete_files=delete_files,
    )
    live = resolved(loaded)  # secrets resolved here, never shown
    assert live.sink is not None
    try:
        r = maintain_table(live.sink, settings)
    except Exception as e:  # noqa: BLE001 - one line, never a secret the spec resolved
        error = "; ".join(scrub(exception_text(e)).splitlines())
        raise ConveyorError(f"{name}: table maintenance failed: {error}") from None
    click.echo(
        f"{name}: data files {r.files_before} -> {r.files_after}, {r.rows} rows, "
        f"{'compacted' if r.compacted else 'not compacted'}, {r.snapshots_expired} snapshot(s) "
        f"expired, {r.files_deleted} file(s) deleted"
    )


if __name__ == "__main__":
    main()
