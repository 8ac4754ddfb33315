"""The rule that keeps a transform's Spark SQL to its batch (conveyor.core.sql_guard), on a
hostile corpus, and the spec validation that applies it (issue 34, C1)."""

from __future__ import annotations

import pydantic
import pytest

from conveyor.core.model import TransformSpec
from conveyor.core.registry import format_validation_error
from conveyor.core.sql_guard import expression_problem, tokenize

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
    "id /* /* nested */ reflect( */ + 1",
    "value:a.b",
    "current_catalog()",
    "input_file_name()",
    "url_decode(name)",
    "xpath_string(name, '/a')",
    "count(*) OVER (PARTITION BY id)",
    "id\u00a0+\u30001",
    "percentile_cont(0.5) WITHIN GROUP (ORDER BY id)",
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
]


@pytest.mark.parametrize("expr", ALLOWED)
def test_allowed_expressions(expr: str) -> None:
    assert expression_problem(expr) is None


@pytest.mark.parametrize("expr", REFUSED)
def test_refused_expressions(expr: str) -> None:
    assert expression_problem(expr) is not None


def test_tokens_match_sparks_lexer() -> None:
    kinds = [(t.kind, t.text) for t in tokenize("R'a\\' `b``c` 'd''e' \"f\\\"g\" -- x\nH")]
    assert kinds == [
        ("string", "a\\"),
        ("name", "b`c"),
        ("string", "d'e"),
        ("string", 'f\\"g'),
        ("word", "h"),
    ]


def test_problem_says_why() -> None:
    assert "Java" in (expression_problem("reflect('a', 'b')") or "")
    assert "subquery" in (expression_problem("(SELECT 1)") or "")
    assert "unterminated" in (expression_problem("'a") or "")


def _error(**transform: object) -> str:
    with pytest.raises(pydantic.ValidationError) as e:
        TransformSpec.model_validate(transform)
    return format_validation_error(e.value, prefix="transform")


def test_spec_names_the_field() -> None:
    msg = _error(select=["id", "name", "java_method('java.lang.System', 'getenv', 'X') AS e"])
    assert msg.startswith("transform.select[2]: function java_method() is not allowed")
    assert _error(filter="(SELECT 1) = 1").startswith("transform.filter: a subquery")
    assert _error(schema="id BIGINT, x STRING) USING 'id").startswith("transform.schema: ")


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
