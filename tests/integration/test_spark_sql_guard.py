"""Issue 34, C1, on a real Spark Connect server: the expressions the guard refuses do run
there when nothing stops them (a shell command through a script transform, a Java call,
a file read through a subquery); through a spec they are refused before any Spark call,
and the session Conveyor opens reads no file through SQL even past the guard. Legit
expressions still run, and words inside literals stay literals for Spark as for the
guard (core.spark_sql.sql_guard follows Spark's lexer)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pydantic
import pytest

from conveyor.brokers.kafka import SOURCE_SCHEMA
from conveyor.core.model import TransformSpec
from conveyor.spark.session import spark_session
from conveyor.spark.transform import SparkTransformer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def spark(spark_remote: str) -> Any:
    return spark_session(spark_remote)


@pytest.fixture
def unguarded(spark_remote: str) -> Iterator[Any]:
    """A plain pyspark session on the same server, with Spark's defaults: the control."""
    from pyspark.sql.connect.session import SparkSession

    session = SparkSession(connection=spark_remote)
    try:
        yield session
    finally:
        session.stop()


def hostile(marker: Path, secret: Path) -> list[str]:
    return [
        f"(FROM (SELECT 1 AS a) t MAP a USING 'touch {marker}' AS (b STRING)) AS b",
        "java_method('java.lang.System', 'getProperty', 'user.dir') AS d",
        f"(SELECT first(value) FROM text.`{secret}`) AS s",
        # issue 45: Spark opens no nested comment at /*+, so this is a call of reflect
        "/* /*+ */ concat(reflect('java.lang.System', 'getProperty', 'java.version'), '*/') "
        "AS leaked /* ' */",
    ]


def test_hostile_expressions_run_unguarded_but_a_spec_never_lets_them_reach_spark(
    unguarded: Any, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("HOST-SECRET-3f1c\n")
    marker = tmp_path / "pwned"
    exprs = hostile(marker, secret)
    # The control: each one does what it says on a session nothing restricts.
    row = unguarded.range(1).selectExpr(*exprs).collect()[0]
    assert marker.exists() and row["d"] and row["s"] == "HOST-SECRET-3f1c"
    assert re.fullmatch(r"\d+[.\d]*.*\*/", row["leaked"])  # the JVM's version: a Java call
    marker.unlink()
    for expr in exprs:
        with pytest.raises(pydantic.ValidationError) as e:
            TransformSpec.model_validate({"select": ["id", expr]})
        assert e.value.errors()[0]["ctx"]["error"].field == "select[1]"
        with pytest.raises(pydantic.ValidationError):
            TransformSpec.model_validate({"filter": f"{expr.rsplit(' AS ', 1)[0]} IS NOT NULL"})
    assert not marker.exists()


def test_xml_functions_that_open_host_files_are_refused_and_xpath_expands_no_entity(
    unguarded: Any, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.xsd"
    secret.write_text("HOST-SECRET-3f1c\n")
    opened = f"from_xml('<a>1</a>', 'a INT', map('rowValidationXSDPath', '{secret}')) AS x"
    # The control: Spark opens the file the option names (its content is no XSD).
    with pytest.raises(Exception, match="secret.xsd"):
        unguarded.range(1).selectExpr(opened).collect()
    with pytest.raises(pydantic.ValidationError, match="from_xml"):
        TransformSpec.model_validate({"select": [opened]})
    # xpath stays allowed: an external entity naming the file is not expanded.
    doc = f'<?xml version="1.0"?><!DOCTYPE a [<!ENTITY e SYSTEM "file://{secret}">]><a>&e;</a>'
    expr = f"xpath_string('{doc}', 'a') AS s"
    TransformSpec.model_validate({"select": [expr]})
    assert unguarded.range(1).selectExpr(expr).collect()[0]["s"] == ""


def test_a_transforms_session_reads_no_file_through_sql(spark_remote: str, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("HOST-SECRET-3f1c\n")
    spark = spark_session(spark_remote)
    spark.conf.set("spark.sql.runSQLOnFiles", "true")  # Spark's default, whatever ran before
    SparkTransformer(TransformSpec(), lambda: spark).prepare()  # its first use of the session
    assert spark.conf.get("spark.sql.runSQLOnFiles") == "false"
    with pytest.raises(Exception, match="TABLE_OR_VIEW_NOT_FOUND"):
        spark.range(1).selectExpr(f"(SELECT first(value) FROM text.`{secret}`) AS s").collect()


def batch(docs: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "__topic": "orders",
                "__partition": 0,
                "__offset": i,
                "__timestamp": None,
                "__key": None,
                "__headers": [],
                "__destination": None,
                "__value": json.dumps(d).encode(),
            }
            for i, d in enumerate(docs)
        ],
        schema=SOURCE_SCHEMA,
    )


def test_legit_expressions_run_and_words_in_literals_stay_literals(spark: Any) -> None:
    spec = TransformSpec.model_validate(
        {
            "schema": "id BIGINT, name STRING, `values` ARRAY<INT>, reflection STRING",
            "filter": "name <> 'SELECT' AND id /* reflect( */ > 0",
            "select": [
                "id",
                "'reflect(' AS s",
                '"(SELECT 1 FROM text.`/etc/passwd`)" AS q',
                "'it''s -- java_method(' AS doubled",
                "r'\\' AS raw",
                "reflection",
                "size(`values`) AS n",
                "transform(`values`, x -> x * 2) AS twice",
                "upper(name) -- reflect(\n AS name",
            ],
        }
    )
    t = SparkTransformer(spec, spark)
    t.prepare()
    docs = [
        {"id": 1, "name": "a", "values": [1, 2], "reflection": "r1"},
        {"id": 2, "name": "SELECT", "values": [], "reflection": "r2"},
        {"id": 0, "name": "c", "values": [3], "reflection": "r3"},
    ]
    out = t(batch(docs))
    assert out.filtered == 2 and not out.rejected
    rows = out.table.drop_columns([c for c in out.table.column_names if c.startswith("__")])
    assert rows.to_pylist() == [
        {
            "id": 1,
            "s": "reflect(",
            "q": "(SELECT 1 FROM text.`/etc/passwd`)",
            "doubled": "it's -- java_method(",
            "raw": "\\",
            "reflection": "r1",
            "n": 2,
            "twice": [2, 4],
            "name": "A",
        }
    ]
