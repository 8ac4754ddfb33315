"""Connector operations, shared by the CLI and the REST API: one place for each.

Every operation works on the meta store and the connector spec files; none talks to
Dagster except through the reload hook (a new or changed file must reach the code
location). Errors are typed so that each front end maps them once
(``control/operation_context.py``): ``NotFoundError`` (HTTP 404), ``ConflictError``
(409), ``InvalidRequestError`` and ``ConfigError`` (400, the message names the field).

Everything returned is safe to show: specs are redacted (``LoadedSpec.display``),
secrets never leave the file they are written in.

``Operations`` is the facade the front ends call; each operation is written once, in the
part of its concern: reading (``control/reads.py``), the lifecycle (``control/lifecycle.py``),
offsets and a source's state (``control/offsets.py``), dead letters
(``control/dead_letters.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from conveyor.control.dead_letters import ConnectorDeadLetters
from conveyor.control.lifecycle import COMPONENT_FILES, ConnectorLifecycle, create_spec_file
from conveyor.control.offsets import (
    OFFSETS_ALTERED,
    OFFSETS_RESET,
    ConnectorOffsets,
    parse_kip875,
)
from conveyor.control.operation_context import (
    ConflictError,
    InvalidOptionError,
    InvalidRequestError,
    NotFoundError,
    OperationsContext,
)
from conveyor.control.reads import (
    KAFKA_CONNECT_STATE,
    ConnectorReads,
    connector_kind,
    row_summary,
    status_of,
)
from conveyor.store.facade import Delegate

# The names callers import from here, wherever they are written now.
__all__ = [
    "COMPONENT_FILES",
    "KAFKA_CONNECT_STATE",
    "OFFSETS_ALTERED",
    "OFFSETS_RESET",
    "ConflictError",
    "InvalidOptionError",
    "InvalidRequestError",
    "NotFoundError",
    "Operations",
    "connector_kind",
    "create_spec_file",
    "env_flag",
    "parse_kip875",
    "row_summary",
    "status_of",
]


@dataclass
class Operations(OperationsContext):
    """The operations on one meta store and connectors directory.

    ``specs_changed(reason)`` is called after a spec file was written or removed (the API
    reloads the Dagster code location there; the CLI leaves it to the scheduler).
    ``actor`` ends up in the connector's history ("stopped from the CLI").
    """

    def __post_init__(self) -> None:
        # Each part reads the store, the directory and the actor from this object, so a
        # front end may set ``actor`` or ``specs_changed`` after making it.
        self.reads = ConnectorReads(self)
        self.lifecycle = ConnectorLifecycle(self)
        self.offset_changes = ConnectorOffsets(self)
        self.dead_letter_reads = ConnectorDeadLetters(self)

    # -- reading (control/reads.py; row, names and rows: control/operation_context.py) ---------

    config = Delegate("reads", ConnectorReads.config)
    info = Delegate("reads", ConnectorReads.info)
    status = Delegate("reads", ConnectorReads.status)
    summary = Delegate("reads", ConnectorReads.summary)
    history = Delegate("reads", ConnectorReads.history)
    tasks = Delegate("reads", ConnectorReads.tasks)
    offsets = Delegate("reads", ConnectorReads.offsets)
    destination = Delegate("reads", ConnectorReads.destination)
    destinations = Delegate("reads", ConnectorReads.destinations)

    # -- specs and state (control/lifecycle.py) -------------------------------------------------

    validate = Delegate("lifecycle", ConnectorLifecycle.validate)
    put_config = Delegate("lifecycle", ConnectorLifecycle.put_config)
    apply_file = Delegate("lifecycle", ConnectorLifecycle.apply_file)
    delete = Delegate("lifecycle", ConnectorLifecycle.delete)
    start = Delegate("lifecycle", ConnectorLifecycle.start)
    resume = Delegate("lifecycle", ConnectorLifecycle.resume)
    pause = Delegate("lifecycle", ConnectorLifecycle.pause)
    stop = Delegate("lifecycle", ConnectorLifecycle.stop)
    restart = Delegate("lifecycle", ConnectorLifecycle.restart)

    # -- offsets (KIP-875) and a source's state (control/offsets.py) ----------------------------

    alter_offsets = Delegate("offset_changes", ConnectorOffsets.alter_offsets)
    reset_offsets = Delegate("offset_changes", ConnectorOffsets.reset_offsets)
    reset_offsets_to = Delegate("offset_changes", ConnectorOffsets.reset_offsets_to)
    reset_source_state = Delegate("offset_changes", ConnectorOffsets.reset_source_state)
    abandon_batch = Delegate("offset_changes", ConnectorOffsets.abandon_batch)

    # -- dead letters (control/dead_letters.py) -------------------------------------------------

    dead_letter_store = Delegate("dead_letter_reads", ConnectorDeadLetters.dead_letter_store)
    dead_letters = Delegate("dead_letter_reads", ConnectorDeadLetters.dead_letters)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
