"""Backfill requests, shared by the CLI (``conveyor backfill``, ``conveyor backfills``) and the
REST API (``/connectors/{name}/backfills``): one place for each.

A request is a row in the meta store; the backfills sensor (``dagster/sensors/backfills.py``)
launches its run and the run reports back to it. Nothing here talks to Dagster. The range is
checked at the door (by the store, with the parser the job uses: ``parse_backfill_range``, offsets
by ``core.positions``' rule, topics the connector reads only), so a bad range is a 400 or a usage
error, never a failed run. Errors are the operations' own
(``NotFoundError`` 404, ``ConflictError`` 409, ``InvalidRequestError`` 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.control.operations import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    Operations,
    connector_kind,
)
from conveyor.core.errors import ConfigError
from conveyor.store.meta import (
    MAX_POSITION_CHARS,
    MetaStore,
    UnknownBackfillError,
    UnknownConnectorError,
)

BODY_FIELDS = ("start", "end")


@dataclass
class Backfills:
    """Backfill requests on one meta store; ``actor`` is recorded as who asked."""

    store: MetaStore
    actor: str = "the CLI"

    @staticmethod
    def of(ops: Operations) -> Backfills:
        return Backfills(ops.store, ops.actor)

    def request(self, name: str, start: str, end: str = "latest") -> dict[str, Any]:
        """Ask for a backfill of ``start`` .. ``end`` of a sink connector (state requested)."""
        self._sink_connector(name)
        try:  # the store checks the range (parse_backfill_range) before it takes it
            return self.store.request_backfill(name, start, end, requested_by=self.actor).as_json()
        except ConfigError as e:
            raise InvalidRequestError(f"invalid backfill range: {e}") from None
        except UnknownConnectorError:
            raise NotFoundError(f"connector {name!r} not found") from None

    def list(self, name: str, limit: int = 50) -> list[dict[str, Any]]:
        """A connector's backfill requests, newest first."""
        self._row(name)
        return [r.as_json() for r in self.store.backfills(name, limit=limit)]

    def get(self, name: str, backfill_id: int) -> dict[str, Any]:
        self._row(name)
        try:
            r = self.store.backfill(backfill_id)
        except UnknownBackfillError:
            r = None
        if r is None or r.connector != name:
            raise NotFoundError(f"connector {name!r} has no backfill request {backfill_id}")
        return r.as_json()

    def _row(self, name: str) -> Any:
        try:
            return self.store.get(name)
        except UnknownConnectorError:
            raise NotFoundError(f"connector {name!r} not found") from None

    def _sink_connector(self, name: str) -> None:
        row = self._row(name)
        if connector_kind(row) == "source":
            raise ConflictError(
                f"connector {name!r} is a source connector: a backfill reads a sink "
                "connector's topics again into its sink"
            )
        if row.spec_error or row.spec is None:
            raise ConflictError(
                f"connector {name!r} has an invalid spec: {row.spec_error}; fix it first"
            )


def backfill_body(body: Any) -> tuple[str, str]:
    """``{"start": ..., "end": ...}`` (end optional, default latest), checked: an object of
    those fields only, strings of a sane length."""
    if not isinstance(body, dict):
        raise InvalidRequestError('expected {"start": ..., "end": ...}')
    unknown = sorted(str(k)[:40] for k in body if k not in BODY_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown field(s) {unknown}; expected start and end")
    values = []
    for key, default in (("start", None), ("end", "latest")):
        value = body.get(key, default)
        if value is None:
            raise InvalidRequestError(
                f"{key}: missing; expected earliest, an ISO 8601 time or offsets"
            )
        if not isinstance(value, str):
            raise InvalidRequestError(f"{key}: expected a string, got {type(value).__name__}")
        if len(value) > MAX_POSITION_CHARS:
            raise InvalidRequestError(f"{key}: longer than {MAX_POSITION_CHARS} characters")
        values.append(value)
    return values[0], values[1]
