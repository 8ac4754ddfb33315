"""A batch's payload columns as JSON objects, column by column (``json_objects``), give
exactly the bytes the per-row encoder gives (``Record.payload_bytes``): the Kafka, and any
sink writing ``payload_values``, must not change what it writes for speed."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.sinks.base import _JSON, iter_records, json_objects, payload_values

HOSTILE_TEXT = [
    "",
    "plain",
    'quote " back \\ slash',
    "nul \x00 tab \t crlf \r\n",
    "é ✓ 🚀",
    "%s %d %%",
    "\u2028\ud7ff",
]


def per_row(table: pa.Table) -> list[bytes]:
    return [_JSON.encode(d).encode() for d in table.to_pylist()]


def test_every_covered_type_with_nulls_and_hostile_names() -> None:
    table = pa.table(
        {
            "i8": pa.array([-128, None, 127, 0, 1, 2, 3], pa.int8()),
            "u64": pa.array([2**64 - 1, 0, None, 1, 2, 3, 4], pa.uint64()),
            "i64": pa.array([-(2**63), 2**63 - 1, 0, None, 5, 6, 7], pa.int64()),
            "f64": pa.array([0.1 + 0.2, 1e20, 5e-324, -0.0, None, 1.7976931348623157e308, 100.0]),
            "f32": pa.array([0.1, 2.5, None, -1e-30, 3.0, 1e30, 7.0], pa.float32()),
            "b": pa.array([True, False, None, True, False, True, False]),
            "s": pa.array(HOSTILE_TEXT),
            "ls": pa.array([None, *HOSTILE_TEXT[1:]], pa.large_string()),
            # text with nothing to escape (Arrow writes it), edges of printable ASCII
            "plain": pa.array(["", None, " !#$", "[]^_`~", "a b", "% %s", "0"]),
            "lplain": pa.array([None, None, None, None, None, None, None], pa.large_string()),
            'we"ird % \\ 名': pa.array(range(7)),
            "void": pa.nulls(7),
        }
    )
    assert json_objects(table) == per_row(table)
    chunked = pa.concat_tables([table.slice(0, 3), table.slice(3)])
    assert json_objects(chunked) == per_row(table)
    # payload_values takes this path for a batch with metadata columns as the source makes.
    batch = table.append_column("__offset", pa.array(range(7), pa.int64()))
    assert payload_values(batch) == [r.payload_bytes() for r in iter_records(batch)]


@pytest.mark.parametrize(
    "column",
    [
        pa.array([1.0, math.nan]),  # the encoder writes NaN
        pa.array([math.inf, 1.0]),
        pa.array([1.5], pa.float16()),
        pa.array([b"bytes"]),
        pa.array([[1, 2]]),
        pa.array([{"a": 1}]),
        pa.array([1], pa.timestamp("ms")),
    ],
    ids=lambda a: str(a.type),
)
def test_other_types_are_left_to_the_per_row_encoder(column: pa.Array) -> None:
    table = pa.table({"id": pa.array([7] * len(column)), "x": column})
    assert json_objects(table) is None
    batch = table.append_column("__offset", pa.array(range(len(column)), pa.int64()))
    assert payload_values(batch) == [r.payload_bytes() for r in iter_records(batch)]


def test_two_columns_with_one_name_are_left_to_the_per_row_encoder() -> None:
    table = pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["a", "a"])
    assert json_objects(table) is None


def test_no_payload_columns() -> None:
    empty = pa.table({"a": [1, 2]}).select([])
    assert json_objects(empty) == per_row(empty)


@settings(max_examples=150, deadline=None)
@given(
    ints=st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), min_size=1, max_size=20),
    floats=st.data(),
    texts=st.data(),
    name=st.text(min_size=1, max_size=8),
)
def test_any_values(ints, floats, texts, name) -> None:  # type: ignore[no-untyped-def]
    n = len(ints)
    fs = floats.draw(
        st.lists(
            st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False)),
            min_size=n,
            max_size=n,
        )
    )
    ts = texts.draw(st.lists(st.one_of(st.none(), st.text()), min_size=n, max_size=n))
    table = pa.table(
        {
            "i": pa.array(ints, pa.int64()),
            "f": pa.array(fs, pa.float64()),
            name + "_": pa.array(ts, pa.string()),
        }
    )
    assert json_objects(table) == per_row(table)


def test_doubles_as_repr_writes_them_over_random_bit_patterns_and_ranges() -> None:
    """Arrow writes the doubles it writes in fixed notation within repr's fixed range; every
    other value is repr's own: the same text for any finite double."""
    import numpy as np

    rng = np.random.default_rng(18)
    bits = rng.integers(0, 2**64, 200_000, dtype=np.uint64).view(np.float64)
    values = np.concatenate(
        [
            bits[np.isfinite(bits)],
            rng.uniform(-1e6, 1e6, 50_000),
            np.round(rng.uniform(-1e6, 1e6, 50_000), 2),
            rng.integers(-(10**17), 10**17, 50_000).astype(np.float64),
            10.0 ** np.arange(-30, 30),
            -(10.0 ** np.arange(-30, 30)),
            [0.0, -0.0, 5e-324, 1e-4, 9.999999999999999e-05, 1e15, 9999999999999998.0, 1e16],
        ]
    )
    column = pa.array(values)
    table = pa.table({"x": column})
    assert json_objects(table) == [f'{{"x":{float.__repr__(v)}}}'.encode() for v in values.tolist()]


def test_sliced_chunked_and_empty_columns() -> None:
    table = pa.table(
        {
            "f": pa.array([1.0, None, 2.5e-7, 3e20, 4.0], pa.float64()),
            "g": pa.array([0.1, None, 1.0, 2.0, None], pa.float32()),
            "b": pa.array([True, None, False, True, None]),
            "s": pa.array(["a", "é", None, "b", "c"], pa.large_string()),
            "n": pa.array([None] * 5, pa.string()),
        }
    )
    for t in (table, table.slice(1, 3), pa.concat_tables([table.slice(0, 2), table.slice(2)])):
        assert json_objects(t) == per_row(t)
    assert json_objects(table.slice(0, 0)) == []
