"""What every connector operation shares: the store and directory, who asks, the typed errors.

Errors are typed so that each front end maps them once:

- ``NotFoundError``: no such connector (HTTP 404);
- ``ConflictError``: the connector's state forbids it (running, not stopped, declared
  in a file this process must not write) (HTTP 409);
- ``InvalidRequestError`` and ``ConfigError``: the input is wrong, the message names the
  field (HTTP 400).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.config.specs import connectors_dir
from conveyor.core.errors import ConveyorError
from conveyor.store.meta import ConnectorRow, MetaStore, NotStoppedError, UnknownConnectorError


class NotFoundError(ConveyorError):
    """No connector of that name."""


class ConflictError(ConveyorError):
    """The connector's state (or where its spec lives) forbids the operation."""


class InvalidRequestError(ConveyorError):
    """The request itself is malformed; the message says where."""


class InvalidOptionError(InvalidRequestError):
    """A bad value of the CLI option ``option`` (a usage error there)."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


@dataclass
class OperationsContext:
    """The meta store and connectors directory the operations work on.

    ``specs_changed(reason)`` is called after a spec file was written or removed (the API
    reloads the Dagster code location there; the CLI leaves it to the scheduler).
    ``actor`` ends up in the connector's history ("stopped from the CLI").
    """

    store: MetaStore
    directory: Path = field(default_factory=connectors_dir)
    specs_changed: Callable[[str], None] | None = None
    actor: str = "the CLI"

    def row(self, name: str) -> ConnectorRow:
        try:
            return self.store.get(name)
        except UnknownConnectorError:
            raise NotFoundError(f"connector {name!r} not found") from None

    def names(self) -> list[str]:
        return [r.name for r in self.store.list()]

    def rows(self) -> list[ConnectorRow]:
        return self.store.list()

    def notify_specs_changed(self, reason: str) -> None:
        if self.specs_changed is not None:
            self.specs_changed(reason)


class OperationsPart:
    """One concern of the operations, over their shared context (the ``Operations`` facade:
    an ``actor`` or ``specs_changed`` set on it later is the one every part sees)."""

    def __init__(self, context: OperationsContext):
        self.context = context

    @property
    def store(self) -> MetaStore:
        return self.context.store

    @property
    def directory(self) -> Path:
        return self.context.directory

    @property
    def actor(self) -> str:
        return self.context.actor

    def row(self, name: str) -> ConnectorRow:
        return self.context.row(name)


@contextmanager
def found(name: str) -> Iterator[None]:
    """The store's refusals as the front ends' errors: a connector deleted meanwhile is
    not found (404), one that is not stopped is a conflict (409)."""
    try:
        yield
    except UnknownConnectorError:
        raise NotFoundError(f"connector {name!r} not found") from None
    except NotStoppedError as e:
        raise ConflictError(str(e)) from None
