"""PostgreSQL sink: the contract suite against the machine's PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest

from tests.conftest import PG_URL
from tests.sinks.contract import SinkContract, closed_port, make_batch, unique

pytestmark = pytest.mark.integration

SCHEMA = "conveyor_contract"


def _exec(sql: str, *args: Any, fetch: bool = False) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(PG_URL)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql, args or None)
            return cur.fetchall() if fetch else []
    finally:
        conn.close()


class TestPostgresContract(SinkContract):
    sink_type = "postgres"
    idempotent = True  # upsert on id
    keeps_keys = keeps_headers = keeps_timestamps = True

    def make_target(self) -> Iterator[str]:
        table = unique("orders")
        _exec(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
        _exec(
            f'CREATE TABLE "{SCHEMA}"."{table}" (id bigint PRIMARY KEY, name text NOT NULL, '
            "amount double precision CHECK (amount >= 0), k bytea, h jsonb, ts timestamptz)"
        )
        yield table
        _exec(f'DROP TABLE IF EXISTS "{SCHEMA}"."{table}"')

    def config(self, target: str) -> dict[str, Any]:
        return {
            "type": "postgres",
            "url": PG_URL,
            "schema": SCHEMA,
            "table": target,
            "columns": {
                "id": "id",
                "name": "name",
                "amount": "amount",
                "k": "$key",
                "h": "$headers",
                "ts": "$timestamp",
            },
            "upsert_keys": ["id"],
        }

    def read_back(self, target: str) -> list[dict[str, Any]]:
        rows = _exec(f'SELECT id, name, k, h, ts FROM "{SCHEMA}"."{target}"', fetch=True)
        return [
            {
                "id": i,
                "name": n,
                "key": bytes(k) if k is not None else None,
                "headers": {a: b.encode() for a, b in (h or {}).items()},
                "timestamp": ts,
            }
            for i, n, k, h, ts in rows
        ]

    def poison_batch(self, target: str):
        # Row 250 violates NOT NULL, row 400 the CHECK constraint.
        return make_batch(500, names={250: None}, amounts={400: -1.0}), {250, 400}

    def outage_config(self, target: str) -> dict[str, Any]:
        return {
            **self.config(target),
            "url": f"postgresql://postgres@127.0.0.1:{closed_port()}/test",
            "connect_timeout_s": 2,
        }

    bad_fields = [
        ({"table": ""}, "table"),
        ({"write_method": "insert"}, "write_method"),
        ({"connect_timeout_s": 0}, "connect_timeout_s"),
        ({"columns": {"id": "$nope"}}, "columns"),
        ({"upsert_keys": ["missing_column"]}, "upsert_keys"),
    ]


class TestPostgresAppendContract(TestPostgresContract):
    """COPY without upsert keys: a replay duplicates rows (documented)."""

    idempotent = False

    def make_target(self) -> Iterator[str]:
        table = unique("orders")
        _exec(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
        _exec(
            f'CREATE TABLE "{SCHEMA}"."{table}" (id bigint, name text NOT NULL, amount double precision CHECK (amount >= 0), k bytea, h jsonb, ts timestamptz)'
        )
        yield table
        _exec(f'DROP TABLE IF EXISTS "{SCHEMA}"."{table}"')

    def config(self, target: str) -> dict[str, Any]:
        cfg = super().config(target)
        del cfg["upsert_keys"]
        return cfg


class TestPostgresCopyTextContract(TestPostgresAppendContract):
    """COPY of columns and message fields only: the batch's COPY text is built by Arrow
    in one buffer (``CopyText``); a refused batch is bisected line by line."""

    keeps_headers = False

    def config(self, target: str) -> dict[str, Any]:
        cfg = super().config(target)
        del cfg["columns"]["h"]
        return cfg


def test_the_copy_text_of_a_batch_is_one_arrow_buffer_and_its_rows_are_lines():
    """Nulls, escapes, several chunks and a sliced batch: the buffer COPY reads is the
    value-by-value text, line by line."""
    import pyarrow as pa

    from conveyor.sinks.postgres import CopyText, _copy_column, _copy_value

    ids = pa.chunked_array([pa.array([1, None], pa.int64()), pa.array([3], pa.int64())])
    names = pa.chunked_array([pa.array(["a\tb", "c\\d", "e\nf"], pa.string())])
    table = pa.table({"id": ids, "name": names}).slice(1)
    text = CopyText.of([_copy_column(table.column(c)) for c in ("id", "name")])
    want = ["\t".join(_copy_value(v) for v in row.values()) for row in table.to_pylist()]
    assert want == ["\\N\tc\\\\d", "3\te\\nf"]
    assert len(text) == 2 and [text[0], text[1]] == want
    assert text.reader().read().decode() == "".join(f"{w}\n" for w in want)
    assert CopyText.of([pa.array([], pa.large_string())]).reader().read() == b""


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_copy_writes_dates_and_timestamps_as_python_values_did(unit, monkeypatch):
    """COPY's text for dates and timestamps is built by Arrow (UTC, another zone, no zone,
    before 1970, null); the rows land as they did from Python's ``isoformat()`` text, and
    where the column keeps the instant (timestamptz, naive, date) as from the row path's
    datetimes."""
    import datetime as dt

    import pyarrow as pa

    from conveyor.sinks import build_sink
    from conveyor.sinks import postgres as pg

    micros = [0, 1_700_000_000_123_456, -1_000_001, None, 4_102_444_799_999_999]
    scale = {"s": 10**-6, "ms": 10**-3, "us": 1, "ns": 1000}[unit]
    raw = pa.array([None if m is None else int(m * scale) for m in micros], pa.int64())

    def ts(tz: str | None) -> pa.Array:
        return raw.cast(pa.timestamp(unit, tz=tz))

    batch = pa.table(
        {
            "id": pa.array(range(len(micros)), pa.int64()),
            "utc": ts("UTC"),
            "ny": ts("America/New_York"),
            "naive": ts(None),
            "ny_wall": ts("America/New_York"),
            "day": pa.array(
                [dt.date(2026, 11, 25), dt.date(1969, 12, 31), None, dt.date(1, 1, 1),
                 dt.date(9999, 12, 31)], pa.date32()
            ),
        }
    )  # fmt: skip
    ddl = (
        "id bigint PRIMARY KEY, utc timestamptz, ny timestamptz, naive timestamp,"
        " ny_wall timestamp, day date"
    )

    def write(**cfg: Any) -> list[tuple[Any, ...]]:
        table = unique("ts")
        _exec(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
        _exec(f'CREATE TABLE "{SCHEMA}"."{table}" ({ddl})')
        try:
            sink = build_sink(
                {"type": "postgres", "url": PG_URL, "schema": SCHEMA, "table": table, **cfg}
            )
            sink.init_sink()
            try:
                assert sink.send_batch(batch).failed == ()
            finally:
                sink.cleanup_sink()
            return _exec(f'SELECT * FROM "{SCHEMA}"."{table}" ORDER BY id', fetch=True)
        finally:
            _exec(f'DROP TABLE IF EXISTS "{SCHEMA}"."{table}"')

    arrow = write()
    rows = write(upsert_keys=["id"])
    with monkeypatch.context() as m:  # every value through Python, as before
        m.setattr(
            pg,
            "_copy_column",
            lambda c: pa.array([pg._copy_value(v) for v in c.to_pylist()], pa.large_string()),
        )
        python = write()
    assert arrow == python
    assert [r[:4] + r[5:] for r in arrow] == [r[:4] + r[5:] for r in rows]
    if unit in ("us", "ns"):
        assert arrow[1][1] == dt.datetime(2023, 11, 14, 22, 13, 20, 123456, tzinfo=dt.timezone.utc)
    assert arrow[3][1:5] == (None,) * 4 and arrow[2][5] is None  # the nulls


def test_invalid_utf8_on_the_copy_text_path_names_the_column_and_byte():
    """Arrow's COPY text would hand invalid UTF-8 to the server, whose refusal names neither
    the column nor the byte: such a batch takes the row path, which does (issue 15)."""
    from conveyor.core.sink import send_isolating
    from conveyor.sinks import build_sink
    from tests.hostile import with_invalid_utf8

    table = unique("utf8")
    _exec(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
    _exec(f'CREATE TABLE "{SCHEMA}"."{table}" (id bigint, name text, amount double precision)')
    try:
        cols = {"id": "id", "name": "name", "amount": "amount"}
        cfg = {"type": "postgres", "url": PG_URL, "schema": SCHEMA, "table": table, "columns": cols}
        sink = build_sink(cfg)
        sink.init_sink()
        try:
            failed = send_isolating(sink, with_invalid_utf8(make_batch(20), "name", {7, 12}))
        finally:
            sink.cleanup_sink()
        assert [(f.index, f.message) for f in failed] == [
            (i, "column 'name' is not valid UTF-8: invalid start byte ff at byte offset 2")
            for i in (7, 12)
        ]
        rows = _exec(f'SELECT id FROM "{SCHEMA}"."{table}" ORDER BY id', fetch=True)
        assert [r[0] for r in rows] == [i for i in range(20) if i not in (7, 12)]
    finally:
        _exec(f'DROP TABLE IF EXISTS "{SCHEMA}"."{table}"')


# -- truncate_enabled: a row with __truncate true truncates the table at its place ------------


def _with_truncates(batch, at: set[int]):
    import pyarrow as pa

    flags = [i in at for i in range(batch.num_rows)]
    return batch.append_column("__truncate", pa.array(flags, pa.bool_()))


@pytest.fixture
def truncate_table() -> Iterator[str]:
    table = unique("trunc")
    _exec(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
    # A deferred unique constraint is checked at COMMIT: a batch breaking it fails whole.
    _exec(
        f'CREATE TABLE "{SCHEMA}"."{table}" (id bigint UNIQUE DEFERRABLE INITIALLY DEFERRED, '
        "name text NOT NULL, amount double precision)"
    )
    yield table
    _exec(f'DROP TABLE IF EXISTS "{SCHEMA}"."{table}"')


def _truncate_sink(table: str, **cfg: Any):
    from conveyor.sinks import build_sink

    cols = {"id": "id", "name": "name", "amount": "amount"}
    sink = build_sink(
        {"type": "postgres", "url": PG_URL, "schema": SCHEMA, "table": table, "columns": cols} | cfg
    )
    sink.init_sink()
    return sink


def _ids(table: str) -> list[int]:
    return [r[0] for r in _exec(f'SELECT id FROM "{SCHEMA}"."{table}" ORDER BY id', fetch=True)]


@pytest.mark.parametrize(
    "cfg",
    [{}, {"write_method": "values"}, {"upsert_keys": ["id"]}],
    ids=["copy", "values", "upsert"],
)
def test_a_truncate_row_truncates_at_its_place_in_the_batch(truncate_table: str, cfg) -> None:
    """Writes, a truncate, writes in one batch: only the rows after the truncate remain; a
    truncate row's other columns (here all null, name NOT NULL) are never written."""
    import pyarrow as pa

    table = truncate_table
    if "upsert_keys" in cfg:  # ON CONFLICT needs a key that is not deferrable
        _exec(f'ALTER TABLE "{SCHEMA}"."{table}" DROP CONSTRAINT "{table}_id_key"')
        _exec(f'ALTER TABLE "{SCHEMA}"."{table}" ADD PRIMARY KEY (id)')
    _exec(f'INSERT INTO "{SCHEMA}"."{table}" VALUES (900, \'before the batch\', 1)')
    batch = _with_truncates(make_batch(10), {4})
    batch = batch.set_column(1, "name", pa.array([None if i == 4 else f"n{i}" for i in range(10)]))
    sink = _truncate_sink(table, truncate_enabled=True, **cfg)
    try:
        assert sink.send_batch(batch).failed == ()
        assert _ids(table) == [5, 6, 7, 8, 9]
        # Two truncates, one at the start and one at the end: the table ends empty.
        assert sink.send_batch(_with_truncates(make_batch(3, start=20), {0, 2})).failed == ()
        assert _ids(table) == []
    finally:
        sink.cleanup_sink()


def test_a_truncate_applies_across_batches(truncate_table: str) -> None:
    table = truncate_table
    sink = _truncate_sink(table, truncate_enabled=True)
    try:
        assert sink.send_batch(make_batch(5)).failed == ()
        assert sink.send_batch(_with_truncates(make_batch(1, start=100), {0})).failed == ()
        assert _ids(table) == []
        assert sink.send_batch(_with_truncates(make_batch(3, start=10), set())).failed == ()
        assert sink.send_batch(_with_truncates(make_batch(4, start=20), {1})).failed == ()
        assert _ids(table) == [22, 23]
    finally:
        sink.cleanup_sink()


@pytest.mark.parametrize("fail_fast", [False, True], ids=["isolating", "fail"])
def test_a_truncate_row_with_truncate_enabled_off_is_a_failed_row(
    truncate_table: str, fail_fast: bool
) -> None:
    """Off (the default): the truncate row fails, nothing is truncated; the other rows are
    written (with the fail policy only those before it)."""
    table = truncate_table
    sink = _truncate_sink(table)
    sink.fail_fast = fail_fast
    try:
        assert sink.send_batch(make_batch(3, start=50)).failed == ()
        result = sink.send_batch(_with_truncates(make_batch(6), {3}))
        assert [(f.index, f.message) for f in result.failed] == [
            (3, "a truncate row (__truncate true) and truncate_enabled is off")
        ]
        assert _ids(table) == ([0, 1, 2] if fail_fast else [0, 1, 2, 4, 5]) + [50, 51, 52]
    finally:
        sink.cleanup_sink()


def test_a_failing_batch_after_a_truncate_leaves_the_table_as_before(truncate_table: str) -> None:
    """The truncate is in the batch's transaction: a batch that fails at COMMIT (a deferred
    unique constraint) truncated nothing and wrote nothing."""
    import pyarrow as pa

    table = truncate_table
    sink = _truncate_sink(table, truncate_enabled=True)
    try:
        assert sink.send_batch(make_batch(3, start=50)).failed == ()
        batch = _with_truncates(make_batch(6), {2})
        batch = batch.set_column(0, "id", pa.array([0, 1, 2, 3, 4, 3], pa.int64()))
        with pytest.raises(psycopg2.errors.UniqueViolation):
            sink.send_batch(batch)
        assert _ids(table) == [50, 51, 52]
        # The sink goes on: the same batch without the duplicate applies.
        assert sink.send_batch(batch.slice(0, 5)).failed == ()
        assert _ids(table) == [3, 4]
    finally:
        sink.cleanup_sink()


def test_a_truncate_column_that_is_not_boolean_is_refused(truncate_table: str) -> None:
    import pyarrow as pa

    from conveyor.core.errors import PermanentSinkError

    table = truncate_table
    sink = _truncate_sink(table, truncate_enabled=True)
    try:
        batch = make_batch(2).append_column("__truncate", pa.array(["false", "true"]))
        with pytest.raises(PermanentSinkError, match="__truncate must be a boolean column"):
            sink.send_batch(batch)
        assert _ids(table) == []
    finally:
        sink.cleanup_sink()


def test_upsert_on_a_deferrable_key_is_a_permanent_error_not_an_outage(truncate_table: str):
    """ON CONFLICT cannot use a deferrable unique constraint (SQLSTATE 55000, which psycopg2
    files as an OperationalError): no retry fixes the table, so it is not a lost connection."""
    from conveyor.core.errors import PermanentSinkError

    sink = _truncate_sink(truncate_table, upsert_keys=["id"])
    try:
        with pytest.raises(PermanentSinkError, match="deferrable|refused the statement"):
            sink.send_batch(make_batch(3))
        assert _ids(truncate_table) == []
    finally:
        sink.cleanup_sink()


def test_a_server_gone_between_connect_and_describe_is_an_outage_not_a_failed_run(
    truncate_table: str,
) -> None:
    """The server closes the sink's connection right after it connected (a restart, here the
    backend terminated by the server): init_sink raises a TransientSinkError, which the loop
    retries (Degraded), not psycopg2's OperationalError, which would fail the run."""
    from conveyor.core.errors import TransientSinkError
    from conveyor.sinks import build_sink

    sink = build_sink(
        {"type": "postgres", "url": PG_URL, "schema": SCHEMA, "table": truncate_table}
    )
    connect = sink._connect

    def connect_then_lose_it() -> Any:
        conn = connect()
        with psycopg2.connect(PG_URL) as admin, admin.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", (conn.get_backend_pid(),))
        return conn

    sink._connect = connect_then_lose_it
    with pytest.raises(TransientSinkError, match="reading the table's columns"):
        sink.init_sink()
    assert sink._conn is None
    sink._connect = connect
    sink.init_sink()  # the retry, the server back
    sink.cleanup_sink()
