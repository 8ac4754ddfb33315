"""The rule that keeps a transform's Spark SQL to its batch (conveyor.core.spark_sql.sql_guard) on a
hostile corpus, the canonical text Spark is given, and the spec validation that applies it
(issues 34 and 45). That Spark's own parser reads each accepted text as the guard did is
tests/integration/test_spark_sql_parse.py's."""

from __future__ import annotations

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.errors import ConfigError
from conveyor.core.model import TransformSpec
from conveyor.core.registry import format_validation_error
from conveyor.core.spark_sql.spark_functions import ALLOWED_FUNCTIONS
from conveyor.core.spark_sql.spark_sql_lexer import SqlSyntaxError, tokenize
from conveyor.core.spark_sql.spark_sql_parser import parse_named
from conveyor.core.spark_sql.sql_guard import expression_problem, guard_transform

# Expressions the existing tests and docs use, and words inside literals or names.
ALLOWED = [
    "id",
    "id * 2 AS doubled",
    "upper(name) AS name",
    "CAST(id AS STRING) AS id",
    "__key",
    "__destination",
    "concat('orders.', region) AS __destination",
    "named_struct('a', id, 'b', name) AS s",
    "to_json(map('a', 1)) AS m",
    "size(map_keys(map('a', 1)))",
    "transform(array(1, 2), x -> x + 1) AS t",
    "filter(array(1, 2), x -> x > 1)",
    "reduce(array(1, 2), 0, (acc, x) -> acc + x)",
    "extract(YEAR FROM __timestamp) AS y",
    "trim(BOTH 'x' FROM name)",
    "substring(name FROM 2 FOR 3)",
    "position('a' IN name)",
    "a IS DISTINCT FROM b",
    "id IN (1, 2, 3)",
    "CASE WHEN id > 1 THEN 'big' ELSE 'small' END",
    "CASE WHEN amount % 2 = 0 THEN 'o.even' ELSE 'o.odd' END AS __destination",
    "coalesce(op = 't', false) AS __truncate",
    "CAST(amount AS DECIMAL(10,2)) AS amount",
    "to_date(CAST(ordered_at AS TIMESTAMP)) AS day",
    "unbase64(after.by) AS by",
    "address.city AS city",
    "'reflect(' AS s",
    "'java_method(x)' AS s",
    '"SELECT * FROM t" AS s',
    "'(SELECT 1)' AS s",
    "'it''s' AS s",
    "'a\\'reflect(' AS s",
    "r'\\' AS s",
    "reflection",
    "reflect_count + 1",
    "`reflect`",
    "`select`",
    "`values` + 1",
    "x'41' AS b",
    "id -- reflect(\n + 1",
    "id /* reflect( */ + 1",
    "current_catalog()",
    "input_file_name()",
    "url_decode(name)",
    "xpath_string(name, '/a')",
    "id\u00a0+\u30001",
    "*",
    "after.*",
    "interval 1 day + __timestamp",
    "dateadd(DAY, 1, __timestamp)",
    "a::int + 1",
    "variant_get(parse_json(value), '$.a', 'int')",
    "explode(array(1, 2)) AS (v)",
]

REFUSED = [
    # the JVM
    "reflect('java.lang.System', 'getenv', 'X')",
    "java_method('java.lang.System', 'getenv', 'X') AS env",
    "try_reflect('java.lang.System', 'getProperty', 'user.home')",
    "REFLECT('java.lang.System', 'getenv', 'X')",
    "Java_Method('java.lang.System', 'getenv', 'X')",
    "`reflect`('java.lang.System', 'getenv', 'X')",
    "`java_method`('java.lang.System', 'getenv', 'X')",
    "reflect ('java.lang.System', 'getenv', 'X')",
    "reflect\n\t('java.lang.System', 'getenv', 'X')",
    "reflect\u00a0('java.lang.System', 'getenv', 'X')",
    "reflect\u3000('java.lang.System', 'getenv', 'X')",
    "reflect\u000b('java.lang.System', 'getenv', 'X')",
    "reflect/**/('java.lang.System', 'getenv', 'X')",
    "reflect /* ( */ ('java.lang.System', 'getenv', 'X')",
    "reflect -- c\n('java.lang.System', 'getenv', 'X')",
    "system.builtin.reflect('java.lang.System', 'getenv', 'X')",
    "builtin.java_method('java.lang.System', 'getenv', 'X')",
    "`system`.`builtin`.`reflect`('java.lang.System', 'getenv', 'X')",
    "`system.builtin.reflect`('java.lang.System', 'getenv', 'X')",
    "upper(coalesce(concat(reflect('java.lang.System', 'getenv', 'X'))))",
    "transform(array(1), x -> java_method('java.lang.System', 'getenv', 'X'))",
    "IDENTIFIER('java_' || 'method')('java.lang.System', 'getenv', 'X')",
    "identifier('reflect')('java.lang.System', 'getenv', 'X')",
    "from_protobuf(__value, 'M', '/etc/passwd')",
    "from_avro(__value, '{}', map('avroSchemaUrl', 'file:///etc/passwd'))",
    # issue 45: Spark's lexer opens no nested comment at /*+; a double-quoted name; XML options
    "/* /*+ */ concat(reflect('java.lang.System','getenv','HOME'), '*/') AS leaked /* ' */",
    "\"reflect\"('java.lang.System', 'getenv', 'HOME')",
    "from_xml('<a>1</a>', 'a INT', map('rowValidationXSDPath', '/etc/passwd'))",
    "schema_of_xml('<a>1</a>', map('rowValidationXSDPath', '/etc/passwd'))",
    "id /* /* nested */ reflect( */ + 1",
    "/*+ hint */ id",
    # whatever is not on the allowlist, and aggregate and window forms
    "my_udf(id)",
    "count(*) OVER (PARTITION BY id)",
    "sum(id)",
    "row_number()",
    "upper(id) OVER ()",
    "count(DISTINCT id)",
    "percentile_cont(0.5) WITHIN GROUP (ORDER BY id)",
    "first(id)",
    "value:a.b",
    "?",
    ":name",
    "mask(str => name)",
    # subqueries: any relation but the batch
    "(SELECT first(value) FROM text.`/etc/passwd`) AS passwd",
    "(select concat_ws('|', collect_list(value)) from text.`/etc/passwd`)",
    "(SeLeCt 1)",
    "( /* hint */ SELECT 1)",
    "(/*+ BROADCAST(t) */ SELECT 1)",
    "((SELECT 1))",
    "EXISTS (SELECT 1)",
    "id IN (SELECT id FROM t)",
    "(TABLE text.`/etc/passwd`)",
    "(VALUES (42))",
    "(WITH t AS (SELECT 1) SELECT * FROM t)",
    "(FROM text.`/etc/passwd` SELECT value)",
    "( ( FROM t SELECT 1 ) )",
    # script transforms: shell commands
    "(FROM (VALUES 1) t MAP a USING 'cat /etc/passwd' AS (b STRING))",
    "(SELECT TRANSFORM(1) USING 'id' AS (b STRING))",
    "x USING 'id'",
    "select",
    # lexer desynchronisation
    "r'\\' || reflect('java.lang.System', 'getenv', 'X') || '\\'",
    "/* /* */ ' */ reflect('java.lang.System', 'getenv', 'X') /* ' */",
    "1 -- x \\\n ' \n + reflect('java.lang.System', 'getenv', 'X') -- '",
    "X'\\' || reflect('java.lang.System', 'getenv', 'X') || '\\'",
    # unterminated or unbalanced, and characters Spark does not accept
    "'abc",
    '"abc',
    "`abc",
    "id /* open",
    "coalesce(id",
    "id) OR (true",
    "reflect\u200b('java.lang.System', 'getenv', 'X')",
    "id\u0000",
    "ｒeflect('java.lang.System', 'getenv', 'X')",
    "1a + 1",
    "(" * 5000 + "1" + ")" * 5000,
    "-" * 5000 + "1",
    "NOT " * 5000 + "a",
    "transform(a, " + "x -> " * 3000 + "x)",
    "CASE WHEN " * 3000 + "a",
    "cast(" * 3000 + "a",
]


@pytest.mark.parametrize("expr", ALLOWED)
def test_allowed_expressions(expr: str) -> None:
    assert expression_problem(expr) is None


@pytest.mark.parametrize("expr", REFUSED)
def test_refused_expressions(expr: str) -> None:
    assert expression_problem(expr) is not None


@pytest.mark.parametrize("expr", ALLOWED)
def test_the_canonical_text_reads_back_as_itself(expr: str) -> None:
    text = parse_named(expr).text
    assert parse_named(text).text == text


def test_spark_is_given_the_canonical_text_not_the_text_as_written() -> None:
    sql = guard_transform(
        'id /* c */ > 1 AND name <> "x"',
        ["upper(name) -- c\n AS name", "'it''s' s", "CAST(a AS array<array<int>>)"],
        'id BIGINT, `values` ARRAY<INT> NOT NULL COMMENT "it\'s"',
    )
    assert sql.filter == "((`id` > 1) AND (`name` <> 'x'))"
    assert sql.select == (
        "`upper`(`name`) AS `name`",
        "'it''s' AS `s`",
        "CAST(`a` AS ARRAY<ARRAY<INT>>)",
    )
    assert sql.schema == "`id` BIGINT, `values` ARRAY<INT> NOT NULL COMMENT 'it\\'s'"


def test_tokens_as_sparks_lexer_cuts_them() -> None:
    toks = tokenize("R'a\\' `b``c` 'd''e' \"f\\\"g\" -- x\nH >>> 1.5e3BD")
    assert [(t.kind, t.text) for t in toks] == [
        ("string", "R'a\\'"),
        ("name", "b`c"),
        ("string", "'d''e'"),
        ("string", '"f\\"g"'),
        ("word", "H"),
        ("op", ">>>"),
        ("number", "1.5e3BD"),
    ]


def test_problem_says_why() -> None:
    assert "Java" in (expression_problem("reflect('a', 'b')") or "")
    assert "subquery" in (expression_problem("(SELECT 1)") or "")
    assert "unterminated" in (expression_problem("'a") or "")
    assert "hint" in (expression_problem("/*+ x */ 1") or "")
    assert "aggregate" in (expression_problem("sum(id)") or "")
    assert "reviewed" in (expression_problem("my_udf(id)") or "")
    assert "backticks" in (expression_problem("select + 1") or "")
    assert "opens a file" in (expression_problem("from_xml(a, 'a INT')") or "").replace(
        "open a file", "opens a file"
    )


def _error(**transform: object) -> str:
    with pytest.raises(pydantic.ValidationError) as e:
        TransformSpec.model_validate(transform)
    return format_validation_error(e.value, prefix="transform")


def test_spec_names_the_field() -> None:
    msg = _error(select=["id", "name", "java_method('java.lang.System', 'getenv', 'X') AS e"])
    assert msg.startswith("transform.select[2]: function java_method() is not allowed")
    assert _error(filter="(SELECT 1) = 1").startswith("transform.filter: a subquery")
    assert _error(schema="id BIGINT, x STRING) USING 'id").startswith("transform.schema: ")
    assert _error(schema="id BIGINT DEFAULT reflect('a', 'b')").startswith("transform.schema: ")
    assert _error(filter="id > 1 AS b").startswith("transform.filter: ")


def test_spec_keeps_legit_transforms() -> None:
    spec = TransformSpec.model_validate(
        {
            "schema": "id BIGINT, name STRING, `values` ARRAY<INT>",
            "filter": "id > 1 AND name <> 'SELECT'",
            "select": ["id", "upper(name) AS name", "'reflect(' AS s", "reflection"],
            "rename": {"name": "reflect"},
        }
    )
    assert spec.select and len(spec.select) == 4


def test_a_spec_copied_past_validation_is_still_guarded_by_the_transformer() -> None:
    from conveyor.spark.transform import SparkTransformer

    spec = TransformSpec().model_copy(update={"select": ["reflect('a', 'b')"]})
    with pytest.raises(ConfigError, match="reflect"):
        SparkTransformer(spec, lambda: None)


# Fragments that desynchronise a lexer that is not Spark's: comment, hint and quote openers
# and closers, escapes, and a call that must never pass.
FRAGMENTS = [
    "/*",
    "*/",
    "/*+",
    "--",
    "\n",
    "\\\n",
    "'",
    '"',
    "`",
    "\\",
    "r'",
    "x'",
    "''",
    "``",
    " ",
    "(",
    ")",
    ",",
    "id",
    "1",
    " AS ",
    "upper(",
    "reflect('java.lang.System', 'getenv', 'HOME')",
    "concat(",
    "'*/'",
    "'/*'",
    "*",
    "-",
    ";",
]


@settings(max_examples=400)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join))
def test_fuzzed_mixes_are_refused_or_canonical_and_never_call_a_refused_function(
    text: str,
) -> None:
    try:
        parsed = parse_named(text)
    except SqlSyntaxError:
        return
    assert parse_named(parsed.text) == parsed  # the text Spark is given reads as judged
    problem = expression_problem(text)
    assert (problem is None) == (set(parsed.calls) <= ALLOWED_FUNCTIONS)
    assert problem is not None or "reflect" not in parsed.calls
