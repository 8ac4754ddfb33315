"""The sink loop's destination rules (``destinations``: admission, cap, breakers) applied to a
batch whose rows choose their destination (``__destination``): refused rows leave the batch as
failed messages for the failure policy, and each destination's outcome feeds its breaker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pyarrow as pa

from conveyor.core.engine.batches import Rejected, Transformed, all_coords
from conveyor.core.engine.failure import FailedMessage
from conveyor.core.engine.routing import DestinationGate, DestinationRulesSpec
from conveyor.core.model import DESTINATION_COL


class DestinationScreen:
    """The connector's ``DestinationGate`` over the loop's batches (no rules: lets all pass)."""

    def __init__(self, rules: DestinationRulesSpec | None, clock: Callable[[], float]):
        self.gate = DestinationGate(rules) if rules else None
        self.clock = clock

    def screen(self, source: pa.Table, tr: Transformed) -> Transformed:
        """Rows whose destination the connector's rules refuse leave the batch as failed
        messages (reason cap, denylist, unknown or circuit_open), for the failure policy."""
        if (
            self.gate is None
            or tr.table.num_rows == 0
            or DESTINATION_COL not in tr.table.schema.names
        ):
            return tr
        reasons = self.gate.screen(tr.table.column(DESTINATION_COL).to_pylist(), self.clock())
        if not any(reasons):
            return tr
        position = {c: i for i, c in enumerate(all_coords(source))}
        dests = tr.table.column(DESTINATION_COL).to_pylist()
        refused = [
            Rejected(
                position[c],
                f"destination {d!r} refused ({r.value}) by the connector's destinations rules",
                "destination",
            )
            for c, d, r in zip(all_coords(tr.table), dests, reasons, strict=True)
            if r is not None
        ]
        keep = pa.array([r is None for r in reasons], pa.bool_())
        return replace(tr, table=tr.table.filter(keep), rejected=(*tr.rejected, *refused))

    def record(self, table: pa.Table, failed: list[FailedMessage]) -> None:
        """Each destination's outcome in this batch, for its breaker."""
        if self.gate is None or table.num_rows == 0 or DESTINATION_COL not in table.schema.names:
            return
        errors = {(f.topic, f.partition, f.offset): f.error for f in failed}
        results: dict[str, str | None] = {}
        for c, d in zip(all_coords(table), table.column(DESTINATION_COL).to_pylist(), strict=True):
            if not d:
                continue
            error = errors.get(c)
            if error is None:
                results[d] = None  # one delivered row: the destination answers
            elif d not in results:
                results[d] = error
        self.gate.record(results, self.clock())
