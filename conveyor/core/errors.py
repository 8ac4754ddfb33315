"""Typed errors shared by the core, the sinks and the Dagster glue.

The loop decides what to do from the *class* of an error, never from its text:

- ``ConfigError``: the spec or a sink's config is wrong. Permanent; the connector
  goes to ``Error`` with the message, which names the field.
- ``PermanentSinkError``: the target refuses us for a reason a retry cannot fix
  (auth refused, table missing, wrong columns). The connector goes to ``Error``.
- ``TransientSinkError``: an outage (connection refused or reset, timeout, server
  shutting down). The whole batch is unacknowledged; the loop retries it with
  backoff and commits nothing meanwhile. Never dead-lettered.
- Data errors are *not* raised: a sink reports them per row in ``SendResult``.
- ``PermanentSourceError``: the log cannot be read and no retry fixes it (auth,
  certificate, unsupported codec). The connector goes to ``Error``.
- ``TransientStoreError``: the meta store is briefly unavailable (SQLite "database is
  locked", a PostgreSQL connection dropped or failing over). Retried with backoff like
  an outage, reported ``Degraded``; never fails the run by itself.
- ``FencedError``: this run lost its assignment (its generation is stale). It must
  stop at once without committing.
"""

from __future__ import annotations


class ConveyorError(Exception):
    """Base class of every error Conveyor raises on purpose."""


class ConfigError(ConveyorError):
    """Bad configuration; ``field`` names the offending field when known."""

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None):
        self.field = field
        self.source = source
        prefix = ""
        if source:
            prefix += f"{source}: "
        if field and not message.startswith(f"{field}:"):
            prefix += f"{field}: "
        super().__init__(prefix + message)


class FieldRuleError(ValueError):
    """A config model's cross-field rule, broken (raised inside a pydantic validator).

    ``field`` is the path of the field it names, relative to the model (``table``,
    ``tls_cert_file``); the validation error's message puts it under the model's section
    (``sink.table: ...``), like pydantic's own errors.
    """

    def __init__(self, message: str, *, field: str):
        super().__init__(message)
        self.field = field


def rule(condition: bool, message: str, *, field: str) -> None:
    """Raise FieldRuleError naming ``field`` unless ``condition`` holds (in a model validator)."""
    if not condition:
        raise FieldRuleError(message, field=field)


class SinkError(ConveyorError):
    """Base class of errors raised by a sink."""


class TransientSinkError(SinkError):
    """The target is unreachable or overloaded; retry the whole batch later."""


class BatchRejected(SinkError):
    """The whole request was rejected for its content; the runtime bisects to find the bad rows."""


class PermanentSinkError(SinkError):
    """The target refuses the connector for a reason a retry cannot fix."""


class SourceError(ConveyorError):
    """The source log cannot be read."""


class TransientSourceError(SourceError):
    """The broker is unreachable; retry later."""


class PermanentSourceError(SourceError):
    """The log cannot be read for a reason a retry cannot fix (credentials refused, a TLS
    certificate rejected, a codec the client lacks, an error the client marks non-retriable)."""


class TransientStoreError(ConveyorError):
    """The meta store is briefly unavailable (locked, connection dropped); retry later."""


# The errors every loop, sink or source, retries as outages (with backoff, under the outage
# budget, reported Degraded): the target, the log or the meta store is briefly unavailable.
OUTAGES: tuple[type[ConveyorError], ...] = (
    TransientSinkError,
    TransientSourceError,
    TransientStoreError,
)


class FencedError(ConveyorError):
    """This run's generation is stale: another run owns the connector now."""


class AlreadyClaimedError(ConveyorError):
    """A live run already holds the connector."""


class DeadLetterLimitError(ConveyorError):
    """Too many messages failed; the connector stops instead of draining the topic."""


class DataPolicyError(ConveyorError):
    """A message failed under the ``fail`` policy: the connector stops, nothing is skipped.

    The rows before it were delivered and committed; nothing after it was committed
    (nor written, by a sink honouring ``fail_fast``), so a restart resumes exactly at it.
    ``topic``/``partition``/``offset`` name the message.
    """

    def __init__(self, message: str, *, topic: str = "", partition: int = -1, offset: int = -1):
        super().__init__(message)
        self.topic, self.partition, self.offset = topic, partition, offset


class OutageBudgetExceeded(ConveyorError):
    """An outage outlasted the retry budget; the run gives up (the scheduler restarts it)."""


class StageHungError(ConveyorError):
    """A stage stayed under way past ``liveness.restart_after_s``: the run restarts itself."""


# A connector stopped by its data (a message under the ``fail`` policy, the dead-letter
# limit) records an error starting with this prefix. The scheduler does not restart such a
# connector automatically: the same message would fail again; a person has to decide
# (fix the target, change the policy, or skip the message with ``offsets reset``).
DATA_ERROR_PREFIX = "data error: "


def is_data_error(error: str | None) -> bool:
    """True when a connector's recorded error is a data error (see ``DATA_ERROR_PREFIX``)."""
    return bool(error) and str(error).startswith(DATA_ERROR_PREFIX)
