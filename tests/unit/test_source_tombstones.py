"""A source that builds tombstones on purpose (postgres_cdc, format debezium) has them pass the
transform unless the spec sets null_values; a row marked a tombstone leaves as a null value."""

from __future__ import annotations

import pyarrow as pa

from conveyor.core.engine.source_loop import table_records
from conveyor.core.model import NullValues
from conveyor.core.source_connector import SourceConnectorSpec
from conveyor.sources import build_source


def spec(**transform) -> SourceConnectorSpec:
    data = {"name": "c", "kind": "source", "source": {"type": "postgres_cdc", "url": "x"}}
    return SourceConnectorSpec.model_validate({**data, "transform": transform})


def cdc(**fields) -> bool:
    return build_source({"type": "postgres_cdc", "url": "x", **fields}).config.builds_tombstones()


def test_tombstones_pass_by_default_only_for_a_source_that_builds_them():
    assert cdc(format="debezium") and not cdc() and not cdc(tombstones_on_delete=False)
    assert not cdc(format="debezium", tombstones_on_delete=False)
    assert spec().transform_for(True).null_values == NullValues.PASS
    assert spec().transform_for(False).null_values == NullValues.SKIP
    # Said in the spec: kept, whatever the source.
    assert spec(null_values="skip").transform_for(True).null_values == NullValues.SKIP
    assert spec(null_values="fail").transform_for(True).null_values == NullValues.FAIL
    assert spec(decode="text").transform_for(True).decode == spec(decode="text").transform.decode


def test_a_tombstone_row_leaves_with_a_null_value_whatever_its_payload_columns():
    out = pa.table(
        {
            "__key": [b'{"id":1}', b'{"id":1}'],
            "__tombstone": [False, True],
            "op": ["d", None],
            "id": [1, None],
        }
    )
    first, second = table_records(out)
    assert first.value == b'{"op":"d","id":1}'
    assert second.value is None and second.key == b'{"id":1}'
