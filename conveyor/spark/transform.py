"""A batch's data path on Spark: Arrow in, Spark SQL, Arrow out.

Records become a DataFrame through Arrow (``createDataFrame`` from an Arrow
table), decoding, filters and projections are Spark SQL expressions, and the
result comes back with ``toArrow()``. Undecodable rows are flagged in the same
pass and split off locally, so a batch costs one Spark round trip. Only the
payload and the message columns an expression uses make that trip; the rest
(topic, partition, offset, timestamp, key, headers) are joined back locally by
row number.

A large batch crosses as one row: a single list of its rows, unnested on the server
by ``inline`` (``as_one_row``). Spark's analyser and optimizer walk every row of a
``LocalRelation`` in each rule they apply, which made up most of the server's CPU
for a large batch (48-60% of a cast-only query's samples at 40,000 rows); one row is
walked once, and the batch's rows are then worked on by one compiled task. That task
costs a fixed 10-18 ms of the server's CPU per query, so small batches keep the
plain ``LocalRelation`` (docs/BENCHMARKS.md, "The transform alone: a large batch as
one row").
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from conveyor.core.engine.loop import Rejected, Transformed
from conveyor.core.errors import ConfigError, TransientSinkError
from conveyor.core.model import (
    META_COLUMNS,
    SCHEMA_FORMATS,
    TOMBSTONE_COL,
    TRUNCATE_COL,
    VALUE_COL,
    Decode,
    NullValues,
    TransformSpec,
)
from conveyor.spark.envelopes import (
    OP_COL,
    debezium_json_columns,
    debezium_json_schema,
    debezium_row_fields,
)
from conveyor.spark.session import (
    fetch_arrow,
    is_connect_outage,
)
from conveyor.spark.transform_payloads import (
    BAD_COL,
    ROW_COL,
    LocalDecoding,
    hold_payloadless,
    plain_debezium,
)
from conveyor.spark.transform_session import LazySession

log = logging.getLogger("conveyor.spark")
# pyspark logs every failed analysis as a multi-kilobyte JSON error; we report it ourselves.
logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL)

CORRUPT_COL = "__corrupt"
BATCH_COL = "__batch"
# From this many rows a batch crosses to Spark as one row (``as_one_row``): measured,
# the server's CPU per row is 0.82-0.98x the rows' at 20,000 rows, 0.57-0.70x at 40,000
# and 1.11-1.41x at 10,000 (bench/test_bench_transform.py, one_row). A task
# carries the one row: above ONE_ROW_MAX_BYTES (well under spark.rpc.message.maxSize,
# 128 MiB, on a cluster) the batch keeps the plain relation.
ONE_ROW_FROM = 20_000
ONE_ROW_MAX_BYTES = 64 << 20
NOT_JSON = "undecodable payload: not valid JSON"
MISMATCH = (
    "undecodable payload: a field does not match the schema (transform.on_type_mismatch: fail)"
)


class SparkTransformer:
    """Builds the Spark SQL pipeline of a TransformSpec and applies it per batch."""

    def __init__(self, spec: TransformSpec, session: Any | Callable[[], Any]):
        self.spec = spec
        # What Spark is given: the guard's canonical text of the filter, select and schema,
        # never the spec's text (core.spark_sql.sql_guard). Guarded here too: a spec copied without
        # validation (model_copy) reaches Spark only through this.
        try:
            self._sql = spec.guarded_sql()
        except ValueError as e:
            raise ConfigError(f"transform: {e}", field="transform") from None
        self._spark = LazySession(session)
        self._out_schema: pa.Schema | None = (
            None  # the pipeline's Arrow output, known after one batch
        )
        # The top-level fields ``decode: json`` yields, learnt once by ``check``: each batch
        # then projects them by name, which costs the server less than ``__d.*`` and a drop
        # (about 8% of its CPU per row, bench/test_bench_transform.py).
        self._json_fields: list[str] | None = None
        self._rows: pa.Array | None = None  # the last batch's row numbers (_row_numbers)
        self._payloads = LocalDecoding(spec)  # decode avro/protobuf/json_schema

    @property
    def session(self) -> Any:
        return self._spark.session

    def _pipeline(self, df: Any) -> Any:
        """The Spark SQL plan. Its input holds ``__value``, ``__row`` and the message columns
        the expressions use; its output holds ``__row``, ``__bad`` and the payload columns."""
        spec = self.spec
        used = self._meta_used
        value_str = "CAST(__value AS STRING)"
        # A message without a payload only gets here under null_values: pass (see
        # ``__call__``): it is no decoding error, and its payload columns are null.
        tomb = "(__value IS NULL OR length(__value) = 0)"
        # No DataFrame property that needs the schema (``df.columns``) may be read here: on
        # Spark Connect each is an analysis round trip that uploads the whole batch again.
        if spec.decode in SCHEMA_FORMATS:
            # Decoded here before the trip (``LocalDecoding``): the shipped columns are the
            # payload's fields already, and rows that failed to decode never left.
            df = df.selectExpr("*", f"CAST(NULL AS STRING) AS {BAD_COL}")
        elif spec.decode == Decode.RAW:
            df = df.selectExpr(
                ROW_COL, *used, f"CAST(NULL AS STRING) AS {BAD_COL}", "__value AS value"
            )
        elif spec.decode == Decode.TEXT:
            df = df.selectExpr(
                ROW_COL, *used, f"CAST(NULL AS STRING) AS {BAD_COL}", f"{value_str} AS value"
            )
        else:
            invalid = f"(NOT {tomb} AND try_parse_json({value_str}) IS NULL)"
            if self._sql.schema:
                df = self._decode_json_with_schema(df, used, value_str, tomb)
            else:
                df = df.selectExpr(
                    ROW_COL,
                    *used,
                    f"CASE WHEN {invalid} THEN '{NOT_JSON}' END AS {BAD_COL}",
                    f"CASE WHEN {tomb} THEN NULL ELSE {value_str} END AS value",
                )
        if self._sql.filter:
            df = df.where(f"{BAD_COL} IS NOT NULL OR coalesce(({self._sql.filter}), false)")
        if self._sql.select:
            df = df.selectExpr(ROW_COL, BAD_COL, *self._sql.select)
        elif used or spec.envelope == "debezium":
            # The envelope's __op is for the filter and select, never a column of the target.
            df = df.drop(*used, *([OP_COL] if spec.envelope == "debezium" else []))
        if spec.rename:
            df = df.withColumnsRenamed(dict(spec.rename))
        return df

    def _decode_json_with_schema(self, df: Any, used: list[str], value_str: str, tomb: str) -> Any:
        """decode json with a schema: the payload's fields as columns (the envelope's row
        under envelope: debezium), ``__bad`` set for what cannot be decoded."""
        spec = self.spec
        # One parse per row: from_json in PERMISSIVE mode with a corrupt-record
        # column. A document that is not JSON, not an object, or has a field of the
        # wrong type sets that column (all nulls in the rest); a blank one decodes to
        # NULL. Only those rows, rare, are parsed a second time (try_parse_json,
        # inside the CASE branch, evaluated for them alone) to tell "not valid JSON"
        # from a mismatch: with on_type_mismatch 'fail' (the default) a mismatch is
        # a failed message, never a silent NULL. The options make from_json as
        # strict as try_parse_json (no NaN/Infinity tokens, no single quotes).
        schema = f"{self._json_ddl}, {CORRUPT_COL} STRING"
        opts = (
            f"map('columnNameOfCorruptRecord', '{CORRUPT_COL}', "
            "'allowNonNumericNumbers', 'false', 'allowSingleQuotes', 'false')"
        )
        mismatch = f"'{MISMATCH}'" if spec.on_type_mismatch == "fail" else "NULL"
        df = df.selectExpr(
            ROW_COL,
            *used,
            f"{tomb} AS __tomb",
            f"from_json({value_str}, '{_sql_str(schema)}', {opts}) AS __d",
            "__value",
        )
        bad = (
            f"CASE WHEN `__tomb` THEN NULL WHEN `__d` IS NULL THEN '{NOT_JSON}' "
            f"WHEN `__d`.{CORRUPT_COL} IS NOT NULL THEN CASE WHEN "
            f"try_parse_json({value_str}) IS NULL THEN '{NOT_JSON}' ELSE {mismatch} END "
            "END"
        )
        fields = self._json_fields
        if spec.envelope == "debezium":
            if fields is None:
                raise ConfigError(
                    "envelope: debezium needs the row's fields to differ in more than case",
                    field="schema",
                )
            env = debezium_json_columns("__d", fields)
            why = f"coalesce({bad}, {env.why}) AS {BAD_COL}"
            df = df.selectExpr(ROW_COL, *used, why, *env.columns)
        elif fields is None:
            bad += f" AS {BAD_COL}"
            df = df.selectExpr(ROW_COL, *used, bad, "__d.*").drop(CORRUPT_COL)
        else:
            bad += f" AS {BAD_COL}"
            df = df.selectExpr(
                ROW_COL, *used, bad, *(f"`__d`.{_ident(f)} AS {_ident(f)}" for f in fields)
            )
        return df

    @functools.cached_property
    def _meta_used(self) -> list[str]:
        """The message columns (``__key``, ``__offset``...) the filter or select refer to.

        Only these, with the payload, cross to Spark and back; the others stay here and
        are joined back to each output row by its row number. A mention inside a string
        literal ships a column for nothing, which is harmless.
        """
        text = " ".join([self.spec.filter or "", *(self.spec.select or [])])
        return [
            c
            for c in META_COLUMNS
            if c != TRUNCATE_COL  # set by a select, carried by no message
            # envelope: debezium sets __tombstone itself (d events and payloadless messages)
            and not (c == TOMBSTONE_COL and self.spec.envelope == "debezium")
            and re.search(rf"(?<![A-Za-z0-9_]){c}(?![A-Za-z0-9_])", text)
        ]

    def _shipped(self, batch: pa.Table, tombstones: pa.Array | None = None) -> pa.Table:
        """The columns that go to Spark, with each row's number in the batch."""
        cols = [c for c in (VALUE_COL, *self._meta_used) if c in batch.column_names]
        shipped = batch.select(cols).append_column(ROW_COL, self._row_numbers(batch.num_rows))
        if TOMBSTONE_COL in self._meta_used and TOMBSTONE_COL not in cols:
            mask = tombstones if tombstones is not None else without_payload(batch)
            shipped = shipped.append_column(TOMBSTONE_COL, mask)
        return shipped

    def _input(self, shipped: pa.Table) -> Any:
        """The shipped columns as a DataFrame: a large batch as one row, unnested on the
        server (the module's docstring says why); a small one as its rows."""
        if shipped.num_rows >= ONE_ROW_FROM and shipped.nbytes <= ONE_ROW_MAX_BYTES:
            one = self.session.createDataFrame(as_one_row(shipped))
            return one.selectExpr(f"inline({BATCH_COL})")
        return self.session.createDataFrame(shipped)

    def _row_numbers(self, n: int) -> pa.Array:
        """0..n-1 as int64, kept for the next batch of the same size (most batches are full:
        built per batch it was 3% of the run process's busy time)."""
        rows = self._rows
        if rows is None or len(rows) != n:
            rows = self._rows = pa.array(range(n), pa.int64())
        return rows

    def _collect(self, df: Any) -> pa.Table:
        """The result as Arrow. ``toArrow()`` asks the server for the schema first (an
        analysis RPC that uploads the batch a second time); the output schema never
        changes between batches, so after the first it is reused and the result fetched
        with one RPC (``session.fetch_arrow``)."""
        table = None if self._out_schema is None else fetch_arrow(df)
        if table is None:
            out: pa.Table = df.toArrow()
            self._out_schema = out.schema
            return out
        return table if table.schema.equals(self._out_schema) else table.cast(self._out_schema)

    def check(self, source_schema: pa.Schema) -> list[str]:
        """Analyse the pipeline on an empty batch: bad expressions become ConfigError. Returns output columns."""
        if self.spec.decode in SCHEMA_FORMATS:
            # The payload's columns are the writer schema's fields, known at the first batch:
            # its analysis checks the expressions (``__call__``).
            return []
        # Spark cannot infer a schema from zero rows: analyse a one-row sample instead
        # (analysis only; nothing is executed).
        sample = pa.Table.from_pylist(
            [{f.name: _sample_value(f.type) for f in source_schema}], schema=source_schema
        )
        try:
            if self.spec.decode == Decode.JSON and self._sql.schema:
                # Before the pipeline: envelope: debezium selects the row's fields by name.
                self._json_fields = self._decoded_fields(self._shipped(sample))
            df = self._pipeline(self.session.createDataFrame(self._shipped(sample)))
            # Spark Connect may answer .schema without analysing a Filter's condition;
            # executing on zero rows forces full analysis at negligible cost.
            cols = df.limit(0).toArrow().schema.names
        except Exception as e:
            if is_connect_outage(e):
                self._spark.lost(e)
                raise TransientSinkError(f"Spark Connect unreachable: {_short(e)}") from e
            raise ConfigError(
                f"Spark rejected the transform: {_short(e)}", field="transform"
            ) from None
        return [c for c in cols if c not in (*META_COLUMNS, ROW_COL, BAD_COL)]

    def _decoded_fields(self, shipped: pa.Table) -> list[str] | None:
        """The top-level field names of the JSON schema, as the server reads it (one
        analysis). None when two differ only in case: Spark resolves names ignoring case,
        so only ``__d.*`` can tell them apart."""
        schema = _sql_str(f"{self._json_ddl}, {CORRUPT_COL} STRING")
        df = self.session.createDataFrame(shipped).selectExpr(
            f"from_json(CAST(__value AS STRING), '{schema}') AS __d"
        )
        decoded = df.schema["__d"].dataType
        if self.spec.envelope == "debezium":
            names = debezium_row_fields(decoded)  # the row's, inside before/after
        else:
            names = [f.name for f in decoded.fields if f.name != CORRUPT_COL]
        return None if len({n.lower() for n in names}) < len(names) else names

    @property
    def _json_ddl(self) -> str:
        """decode json: the DDL from_json reads (envelope: debezium: the event's, around the
        row's ``schema``)."""
        ddl = self._sql.schema or ""
        return debezium_json_schema(ddl) if self.spec.envelope == "debezium" else ddl

    def registry_metrics(self) -> dict[str, int] | None:
        """The schema registry lookups of the topics' decoders (None: no registry read)."""
        return self._payloads.registry_metrics()

    def prepare(self) -> None:
        from conveyor.brokers.kafka import SOURCE_SCHEMA

        self.check(SOURCE_SCHEMA)

    def __call__(self, batch: pa.Table) -> Transformed:
        """One Spark round trip for the batch.

        Only the payload (and the message columns the expressions use) goes to Spark;
        the output rows carry their source row number, by which the message columns
        (topic, partition, offset, timestamp, key, headers) are taken back from the
        batch here. A payload column named like a message column (``__destination``
        from a select, say) replaces it.
        """
        import pyarrow.compute as pc

        tombstones = without_payload(batch)
        shipped, held, skipped = hold_payloadless(
            self.spec.null_values, batch, self._shipped(batch, tombstones), tombstones
        )
        if self.spec.envelope == "debezium" and self.spec.decode == Decode.JSON:
            shipped, unreadable = plain_debezium(shipped)
            held += unreadable
        if self.spec.decode in SCHEMA_FORMATS and shipped.num_rows:
            shipped, failed, reshaped = self._payloads.decode(batch, shipped, self._meta_used)
            held += failed
            if reshaped:  # a new writer (or reader) shape: the output schema is learnt again
                self._out_schema = None
        meta = [c for c in META_COLUMNS if c in batch.column_names]
        if shipped.num_rows == 0:
            return Transformed(
                table=batch.select(meta).slice(0, 0), rejected=tuple(held), filtered=skipped
            )
        try:
            out = self._collect(self._pipeline(self._input(shipped)))
        except Exception as e:
            if is_connect_outage(e):
                self._spark.lost(e)
                raise TransientSinkError(f"Spark Connect unreachable: {_short(e)}") from e
            if self.spec.decode in SCHEMA_FORMATS and _is_analysis_error(e):
                # The first batch of a writer shape is where its expressions are analysed.
                raise ConfigError(
                    f"Spark rejected the transform: {_short(e)}", field="transform"
                ) from None
            raise
        bad_mask = pc.is_valid(out.column(BAD_COL))
        bad_out = out.filter(bad_mask)
        bad_rows = zip(
            bad_out.column(ROW_COL).to_pylist(), bad_out.column(BAD_COL).to_pylist(), strict=True
        )
        good = out.filter(pc.invert(bad_mask))
        payload = good.drop_columns([BAD_COL, ROW_COL])
        meta = [c for c in meta if c not in payload.column_names]
        rows = good.column(ROW_COL)
        carried = batch.select(meta).take(rows)
        if self.spec.null_values == NullValues.PASS and TOMBSTONE_COL not in payload.column_names:
            carried = carried.append_column(TOMBSTONE_COL, tombstones.take(rows))
        table = pa.Table.from_arrays(
            [*carried.columns, *payload.columns],
            schema=pa.schema([*carried.schema, *payload.schema]),
        )
        rejected = tuple(
            sorted(
                [*held, *(Rejected(i, why) for i, why in bad_rows)],
                key=lambda r: r.index,
            )
        )
        filtered = skipped + shipped.num_rows - out.num_rows
        return Transformed(table=table, rejected=rejected, filtered=filtered)


def _is_analysis_error(e: BaseException) -> bool:
    from pyspark.errors import AnalysisException, ParseException

    return isinstance(e, (AnalysisException, ParseException))


def as_one_row(table: pa.Table) -> pa.Table:
    """``table`` as one row: a column ``__batch`` holding the list of its rows (structs of
    its columns). No data is copied beyond joining a column's chunks."""
    rows = pa.StructArray.from_arrays(
        [c.combine_chunks() for c in table.columns], fields=list(table.schema)
    )
    offsets = pa.array([0, len(rows)], pa.int32())
    return pa.table({BATCH_COL: pa.ListArray.from_arrays(offsets, rows)})


def without_payload(batch: pa.Table) -> pa.Array:
    """Per row: the message has no payload (a null value, a tombstone; or an empty one)."""
    import pyarrow.compute as pc

    if VALUE_COL not in batch.column_names:
        return pa.array([False] * batch.num_rows, pa.bool_())
    value = batch.column(VALUE_COL).combine_chunks()
    return pc.fill_null(pc.equal(pc.binary_length(value), 0), True)


def _sample_value(t: pa.DataType) -> Any:
    if pa.types.is_string(t):
        return ""
    if pa.types.is_binary(t):
        return b"{}"
    if pa.types.is_integer(t):
        return 0
    return None


def _ident(name: str) -> str:
    """A column or field name quoted for Spark SQL."""
    return "`" + name.replace("`", "``") + "`"


def _sql_str(s: str) -> str:
    return s.replace("\\", "\\\\").replace("'", "\\'")


def _short(e: BaseException, limit: int = 500) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:limit]
