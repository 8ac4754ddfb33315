"""Meta store tables and schema versioning.

Times are epoch seconds (float, UTC): portable across SQLite and PostgreSQL and
cheap to compare in the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

SCHEMA_VERSION = 4

metadata = sa.MetaData()

schema_version = sa.Table(
    "conveyor_schema",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("migrated_at", sa.Float, nullable=False),
)

connectors = sa.Table(
    "conveyor_connectors",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("spec_json", sa.Text, nullable=True),  # None when the spec file does not validate
    sa.Column("spec_hash", sa.String(64), nullable=True),
    sa.Column("spec_source", sa.Text, nullable=True),  # file path, or "cli"
    sa.Column("spec_error", sa.Text, nullable=True),
    sa.Column("desired", sa.String(16), nullable=False, server_default="running"),
    sa.Column("status", sa.String(16), nullable=False, server_default="Idle"),
    sa.Column("status_since", sa.Float, nullable=False),
    sa.Column("broker_id", sa.String(64), nullable=True),
    sa.Column("generation", sa.Integer, nullable=False, server_default="0"),
    sa.Column("run_id", sa.String(64), nullable=True),
    sa.Column("run_pid", sa.Integer, nullable=True),
    sa.Column("run_host", sa.String(255), nullable=True),
    sa.Column("heartbeat_at", sa.Float, nullable=True),
    sa.Column("counters_json", sa.Text, nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("restarts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("next_restart_at", sa.Float, nullable=True),
    sa.Column("last_moved_at", sa.Float, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    # Minted at create (core/positions.py): a target keeps this connector's positions under
    # ``<writer>@<incarnation>``; a connector deleted and created again is a new incarnation.
    sa.Column("incarnation", sa.String(32), nullable=True),
    # Created before positions named their incarnation (migrated from schema 3): its runs may
    # take the positions its target keeps under the bare writer name, once.
    sa.Column("legacy_positions", sa.Boolean, nullable=False, server_default=sa.false()),
)

brokers = sa.Table(
    "conveyor_brokers",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("capacity", sa.Integer, nullable=False),
    sa.Column("spark_remote", sa.Text, nullable=False),
    sa.Column("run_tags_json", sa.Text, nullable=False, server_default="{}"),
    sa.Column("draining", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("updated_at", sa.Float, nullable=False),
    # Set when the broker left the brokers file (kept for the history; cleared if it returns).
    sa.Column("gone_at", sa.Float, nullable=True),
)

offsets = sa.Table(
    "conveyor_offsets",
    metadata,
    sa.Column("connector", sa.String(64), primary_key=True),
    sa.Column("topic", sa.String(255), primary_key=True),
    sa.Column("partition", sa.Integer, primary_key=True),
    sa.Column("next_offset", sa.BigInteger, nullable=False),  # Kafka convention: last processed + 1
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("committed_at", sa.Float, nullable=False),
    # What the position belongs to (core/positions.py); NULL: unknown (schema 3, or an
    # operator's offsets, taken for whatever log is there after a range check).
    sa.Column("log_id", sa.String(255), nullable=True),
    sa.Column("destination", sa.Text, nullable=True),
)

state_history = sa.Table(
    "conveyor_state_history",
    metadata,
    sa.Column("id", sa.Integer, sa.Identity(), primary_key=True),
    sa.Column("connector", sa.String(64), nullable=False, index=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("from_status", sa.String(16), nullable=True),
    sa.Column("to_status", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("run_id", sa.String(64), nullable=True),
    sa.Column("generation", sa.Integer, nullable=True),
)

# -- partition tasks (conveyor/core/planning/tasks.py, conveyor/store/tasks.py) ------------------
# New tables need no migration step: create_all adds them to an existing store.

task_groups = sa.Table(
    "conveyor_task_groups",
    metadata,
    sa.Column("connector", sa.String(64), primary_key=True),
    sa.Column("epoch", sa.Integer, nullable=False, server_default="0"),  # grows at every change
    sa.Column("next_task_id", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_change_at", sa.Float, nullable=True),  # last split or merge (cool-down)
    sa.Column("ceiling", sa.Float, nullable=True),  # measured msgs/s one task carries
    sa.Column("partitions_json", sa.Text, nullable=True),  # every partition, as tasks found them
    sa.Column("updated_at", sa.Float, nullable=False),
)

tasks = sa.Table(
    "conveyor_tasks",
    metadata,
    sa.Column("connector", sa.String(64), primary_key=True),
    sa.Column("task_id", sa.Integer, primary_key=True),
    sa.Column("broker_id", sa.String(64), nullable=True),
    sa.Column("generation", sa.Integer, nullable=False, server_default="1"),
    sa.Column("status", sa.String(16), nullable=False, server_default="Starting"),
    sa.Column("run_id", sa.String(64), nullable=True),
    sa.Column("run_pid", sa.Integer, nullable=True),
    sa.Column("heartbeat_at", sa.Float, nullable=True),
    sa.Column("changed_at", sa.Float, nullable=False),
    sa.Column("samples_json", sa.Text, nullable=False, server_default="[]"),
    sa.Column("created_at", sa.Float, nullable=False),
)

task_partitions = sa.Table(
    "conveyor_task_partitions",
    metadata,
    sa.Column("connector", sa.String(64), primary_key=True),
    sa.Column("topic", sa.String(255), primary_key=True),
    sa.Column("partition", sa.Integer, primary_key=True),
    sa.Column("task_id", sa.Integer, nullable=False),  # the owner: only it commits this partition
    sa.Column("epoch", sa.Integer, nullable=False),  # the group epoch at which it got it
    sa.Column("pending_task_id", sa.Integer, nullable=True),  # handing over to this task
    sa.Column("pending_since", sa.Float, nullable=True),
)


# Version N -> N+1 steps, applied in order inside one transaction each.
def _v1_broker_gone(c: sa.Connection) -> None:
    c.exec_driver_sql("ALTER TABLE conveyor_brokers ADD COLUMN gone_at FLOAT")


# Backfill requests (`conveyor backfill`, POST /connectors/{name}/backfills): written by the CLI
# and the API, launched by the backfills sensor, their end reported by the backfill job.
backfills = sa.Table(
    "conveyor_backfills",
    metadata,
    sa.Column("id", sa.Integer, sa.Identity(), primary_key=True),
    sa.Column("connector", sa.String(64), nullable=False, index=True),
    sa.Column("range_start", sa.Text, nullable=False),  # as given (backfill run config)
    sa.Column("range_end", sa.Text, nullable=False),
    sa.Column("requested_at", sa.Float, nullable=False),
    sa.Column("requested_by", sa.String(255), nullable=False),
    # requested -> launched -> running -> succeeded | failed
    sa.Column("state", sa.String(16), nullable=False, index=True),
    sa.Column("run_id", sa.String(64), nullable=True),
    sa.Column("read", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("delivered", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("failed", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("message", sa.Text, nullable=True),
    sa.Column("updated_at", sa.Float, nullable=False),
)


def _v2_backfills(c: sa.Connection) -> None:
    backfills.create(c, checkfirst=True)


def _v3_positions(c: sa.Connection) -> None:
    """Positions name their log, destination and incarnation (issue 44). Every connector
    of the older store gets an incarnation and may adopt what its target kept under its
    bare name; its offsets keep NULL identities, range-checked on their next start."""
    have = {
        table: {col["name"] for col in sa.inspect(c).get_columns(table)}
        for table in ("conveyor_connectors", "conveyor_offsets")
    }
    for table, column, ddl in (
        ("conveyor_connectors", "incarnation", "VARCHAR(32)"),
        ("conveyor_connectors", "legacy_positions", "BOOLEAN NOT NULL DEFAULT false"),
        ("conveyor_offsets", "log_id", "VARCHAR(255)"),
        ("conveyor_offsets", "destination", "TEXT"),
    ):
        if column not in have[table]:  # a store some columns were added to already
            c.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")
    for (name,) in c.execute(sa.select(connectors.c.name)).all():
        c.execute(
            connectors.update()
            .where(connectors.c.name == name)
            .values(incarnation=new_incarnation(), legacy_positions=True)
        )


def new_incarnation() -> str:
    """A connector's incarnation id: 16 hex digits of a random UUID."""
    import uuid

    return uuid.uuid4().hex[:16]


MIGRATIONS: dict[int, Callable[[sa.Connection], None]] = {
    1: _v1_broker_gone,
    2: _v2_backfills,
    3: _v3_positions,
}

# A source connector's position (an id, an LSN, a sequence number), written in the same
# transaction as the generation check; ``version`` is the source's state format.
source_state = sa.Table(
    "conveyor_source_state",
    metadata,
    sa.Column("connector", sa.String(64), primary_key=True),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("state_json", sa.Text, nullable=False),
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("saved_at", sa.Float, nullable=False),
    # The operator's data-loss escape (`conveyor connector abandon-batch`): the next run
    # stores the position after its first batch without producing it.
    sa.Column("abandon_requested", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("last_abandon_at", sa.Float, nullable=True),
)
