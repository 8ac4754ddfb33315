"""PostgreSQL COPY text built column by column equals the value-by-value conversion."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from conveyor.sinks.postgres import _copy_column, _copy_value


@pytest.mark.parametrize(
    "values, typ",
    [
        ([0, -1, 2**62, None], pa.int64()),
        ([7, None], pa.int16()),
        ([True, False, None], pa.bool_()),
        (
            ["plain", "tab\there", "line\nbreak", "cr\rx", "back\\slash", "", None, "é ü"],
            pa.string(),
        ),
        (["a\\tb", None], pa.large_string()),
        ([b"\x00\xff", None], pa.binary()),  # not cast by Arrow: value by value
    ],
)
def test_columnar_copy_text_is_the_value_by_value_text(values, typ):
    col = pa.chunked_array([pa.array(values, typ)])
    assert _copy_column(col).to_pylist() == [_copy_value(v) for v in values]


def test_floats_parse_back_to_the_same_values():
    values = [0.1, 1.5, -0.0, 1e20, 1e-7, 123456789.125, math.inf, -math.inf, math.nan, None]
    got = _copy_column(pa.chunked_array([pa.array(values, pa.float64())])).to_pylist()
    want = [_copy_value(v) for v in values]
    for g, w, v in zip(got, want, values, strict=True):
        if v is None:
            assert g == w == "\\N"
        elif math.isnan(v):
            assert g.lower() == w.lower() == "nan"
        else:
            assert float(g) == float(w) == v
