"""The guard's parse against Spark's own (issue 45): ``SparkSqlParser`` from the pyspark
wheel's jars, the parser the Spark Connect server runs (tests/spark_parser.py).

For every text the guard accepts, Spark parses the text as written and the canonical text
the guard hands it into the same tree, whatever ``spark.sql.ansi.doubleQuotedIdentifiers``
says, and that tree calls only allowlisted functions, one plain name each, with no subquery
or parameter in it. The bypasses of the issue are refused, though Spark reads a call of
``reflect`` (or ``from_xml``) in each. A fuzzed corpus of comment, hint and quote mixes
holds to the same: each text is refused, or parsed by Spark as the guard said. The
allowlist places every function of Spark's registry.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.spark_sql.spark_functions import (
    AGGREGATE_FUNCTIONS,
    ALLOWED_FUNCTIONS,
    REFUSED_FUNCTIONS,
    WINDOW_FUNCTIONS,
)
from conveyor.core.spark_sql.spark_sql_parser import parse_named, parse_schema
from conveyor.core.spark_sql.sql_guard import expression_problem
from tests.spark_parser import SparkParse, SparkParser
from tests.unit.test_sql_guard import ALLOWED, FRAGMENTS

pytestmark = pytest.mark.integration

DOUBLE_QUOTED = "spark.sql.ansi.doubleQuotedIdentifiers"
# Node classes that would mean a relation, a run-time name or a parameter in the tree.
FOREIGN_NODES = {
    "ScalarSubquery",
    "Exists",
    "ListQuery",
    "InSubquery",
    "LateralSubquery",
    "ExpressionWithUnresolvedIdentifier",
    "UnresolvedTableValuedFunction",
    "NamedParameter",
    "PosParameter",
}

# Beyond the unit corpus: the grammar's corners, each of which Spark must read as the guard.
CORPUS = [
    *ALLOWED,
    "a >> b",
    "a >>> 2 << 1",
    "cast(a as array<array<int>>)",
    "CAST(a AS MAP<STRING, ARRAY<STRUCT<x: INT, `y z` STRING NOT NULL COMMENT 'c'>>>)",
    "CAST(a AS DECIMAL(10, 2))",
    "CAST(a AS INTERVAL DAY TO SECOND)",
    "try_cast(a AS INT)",
    "a::array<int>",
    "struct(a, b AS c)",
    "struct()",
    "date_add(day, 1, a)",
    "datediff(HOUR, a, b)",
    "timestampdiff(MINUTE, a, b)",
    "date_add(a, 1)",
    "dateadd(DAY, -1, a)",
    "date_add(day, 1, x -> x)",
    "-1",
    "- 1",
    "-(1)",
    "-(2147483648)",
    "-2147483648",
    "a -1",
    "2 - -1",
    "- -a",
    "-a*b",
    "NOT a = b AND c",
    "NOT NOT a",
    "a.b[0].c",
    "(a).b",
    "(a.b).c",
    "1 .b",
    "x'41'",
    "X '4142'",
    "'a' 'b' \"c\"",
    '"a""b"',
    '"it\'s"',
    '"a\\"b"',
    "r'a\\'",
    "R'a\\d'",
    'r"a\\"',
    "'\\n\\t\\u0041'",
    "'/* not a comment */'",
    "'-- not a comment'",
    "1e5",
    "1.e5",
    "1.5E-3",
    "10L",
    ".5",
    "1.5f",
    "1Y + 1S",
    "1BD",
    "2.0D",
    "interval 1 day",
    "interval '1 day'",
    "interval 1 day 2 hours",
    "interval '1 02' day to hour",
    "interval -1 minutes",
    "current_date",
    "current_timestamp - interval 1 day",
    "current_date()",
    "user",
    "a = b IS NULL",
    "a IS NOT TRUE",
    "a IS UNKNOWN",
    "a LIKE ANY ('x', 'y')",
    "a NOT ILIKE ALL ('x')",
    "a NOT BETWEEN 1 AND 2",
    "a BETWEEN b + 1 AND c * 2",
    "a b",
    "a AS (b, c)",
    "a.*",
    "CASE a WHEN 1 THEN 'x' ELSE 'y' END",
    "CASE WHEN a THEN CASE WHEN b THEN 1 END END",
    "trim(a)",
    "trim(LEADING FROM a)",
    "trim('x' FROM a)",
    "substring(a, 1)",
    "substr(a FROM 2)",
    "overlay(a PLACING 'x' FROM 1 FOR 2)",
    "position('a', b)",
    "extract(dayofweek FROM a)",
    "date '2020-01-01'",
    "timestamp_ntz '2020-01-01 00:00'",
    "a <=> b",
    "a == b",
    "a != b",
    "a <> b",
    "a || b || c",
    "a & b | c ^ d",
    "~a",
    "+a",
    "a % b div c",
    "1 = 1 = true",
    "a IS NOT DISTINCT FROM b",
    "a not like 'x' escape '!'",
    "a rlike 'x'",
    "a NOT regexp 'x'",
    "a NOT IN (1, 2)",
    "named_struct('a', 1).a",
    "`weird``name`",
    "`a b`.c",
    "map('a', 1)['a']",
    "array(1)[0]",
    "exists(array(1), x -> x > 0)",
    "zip_with(a, b, (x, y) -> x + y)",
    "aggregate(a, 0, (acc, x) -> acc + x, acc -> acc * 2)",
    "if(a > 1, 'x', 'y')",
    "`if`(a, b, c)",
    "left(a, 2)",
    "UPPER(a) AS Upper",
    "a\n--c\\\nstill comment\n+ 1",
    "a /* ' \" ` */ + /**/ 1",
    "a --c\r+ 1",
    "order + range AS limit",
    "after.order",
    "date + timestamp",
    "a to",
    "a where",
]

SCHEMAS = [
    "id BIGINT",
    "id BIGINT, name STRING, amount DOUBLE, ordered_at STRING",
    "id BIGINT, `values` ARRAY<INT>",
    "op STRING, after STRUCT<id: INT, name STRING>",
    "a DECIMAL(10,2) NOT NULL COMMENT 'x', b MAP<STRING, ARRAY<STRUCT<c INT>>>",
    '`we``ird` STRING COMMENT "it\'s"',
    "t TIMESTAMP_NTZ, d DATE, v VARIANT, b BINARY",
]


@pytest.fixture(scope="module")
def spark_parser() -> Iterator[SparkParser]:
    parser = SparkParser()
    try:
        yield parser
    finally:
        parser.close()


def spark(parser: SparkParser, text: str, *, double_quoted: bool = False) -> SparkParse | None:
    parser.set_conf(DOUBLE_QUOTED, "true" if double_quoted else "false")
    try:
        return parser.expression(text)
    finally:
        parser.set_conf(DOUBLE_QUOTED, "false")


def assert_spark_reads_as_the_guard(parser: SparkParser, text: str) -> None:
    """``text`` (accepted) parses in Spark as the canonical text does, in both quoting
    modes, into a tree that calls allowlisted functions only (or Spark refuses both)."""
    canonical = parse_named(text)
    as_written = spark(parser, text)
    given_ = spark(parser, canonical.text)
    # Spark reads the text as written as the canonical text, whenever it can read it (it
    # cannot read a few texts the guard accepts, x -> x >> 1 for one: the canonical text,
    # which is what Spark is given, is held to the rest below).
    if as_written is not None:
        assert as_written == given_, (text, canonical.text)
    assert spark(parser, canonical.text, double_quoted=True) == given_, (text, canonical.text)
    if given_ is None:
        assert as_written is None, (text, canonical.text)
        return  # a literal Spark's parser refuses (x'zz', a bad interval): so it does both
    # Every call the guard judged is one in Spark's tree, and Spark's tree calls nothing
    # else that is off the list (the keyword forms, extract(... FROM ...), are calls there).
    functions = {f.lower() for f in given_.functions}
    assert set(canonical.calls) <= functions
    assert functions <= ALLOWED_FUNCTIONS
    assert not given_.classes & FOREIGN_NODES


def test_every_accepted_text_of_the_corpus_is_read_by_spark_as_the_guard_said(
    spark_parser: SparkParser,
) -> None:
    for text in CORPUS:
        assert expression_problem(text) is None, text
        assert spark(spark_parser, text) is not None, text
        assert_spark_reads_as_the_guard(spark_parser, text)


# The bypasses of issue 45, each with what Spark's own parser reads in it (and the setting
# under which it does): the call the guard must refuse.
BYPASSES = [
    (
        "/* /*+ */ concat(reflect('java.lang.System','getenv','HOME'), '*/') AS leaked /* ' */",
        "reflect",
        False,
    ),
    ("\"reflect\"('java.lang.System', 'getenv', 'HOME')", "reflect", True),
    (
        "from_xml('<a>1</a>', 'a INT', map('rowValidationXSDPath', '/etc/passwd'))",
        "from_xml",
        False,
    ),
    ("/* /* */ ' */ reflect('java.lang.System', 'getenv', 'X') /* ' */", "reflect", False),
    ("`system`.`builtin`.`reflect`('a', 'b')", "system.builtin.reflect", False),
]


@pytest.mark.parametrize(("text", "call", "double_quoted"), BYPASSES)
def test_the_bypasses_are_refused_though_spark_reads_a_call_in_each(
    spark_parser: SparkParser, text: str, call: str, double_quoted: bool
) -> None:
    parsed = spark(spark_parser, text, double_quoted=double_quoted)
    assert parsed is not None and call in [f.replace(", ", ".") for f in parsed.functions]
    assert expression_problem(text) is not None


# Texts the guard accepts, with comments, quotes and keywords mixed in where they are legal.
_SPACE = st.sampled_from(
    [" ", "\n", "\t", "/**/", "/* ' */", '/* " */', "/* ` */", "/* -- */", "-- ' \n", "--\\\n\n"]
)
_LITERAL = st.lists(
    st.sampled_from(["a", "'", "\\'", "''", '"', "\\\\", "/*", "*/", "--", "`", "\\n", " "]),
    max_size=6,
).map(lambda parts: "'" + "".join(p if p != "'" else "''" for p in parts) + "'")
_NAME = st.sampled_from(["id", "`a b`", "`x``y`", "order", "`select`", "name", "date"])


@st.composite
def _accepted(draw: st.DrawFn) -> str:
    sp = [draw(_SPACE) for _ in range(6)]
    operand = draw(st.one_of(_LITERAL, _NAME, st.sampled_from(["1", "-1", "1.5", "NULL"])))
    call = draw(st.sampled_from(["upper", "concat", "coalesce", "md5"]))
    alias = draw(_NAME)
    return f"{sp[0]}{call}{sp[1]}({sp[2]}{operand}{sp[3]}){sp[4]}AS{sp[5]}{alias}"


# Pieces of syntax to drop into the corpus's texts: each mutant is refused, or Spark reads it
# as the guard does (found this way: `current_date(x)`, a unit form with a lambda, '*/').
PIECES = [
    *FRAGMENTS,
    *"abx.[]=<>+",
    "::",
    "int",
    "CASE",
    "WHEN",
    "THEN",
    "END",
    "NOT",
    "IS",
    "NULL",
    "IN",
    ">>",
    "<>",
    "||",
    "'x'",
    '"y"',
    "`z`",
    "->",
    "struct(",
    "cast(",
    "interval",
    "day",
    "1e5",
    ".5",
    "-1",
    "date",
    "user",
    "current_date",
    "trim(",
    "FROM",
    "BOTH",
    "order",
    "between",
    "like",
    "escape",
]


@st.composite
def _mutant(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(CORPUS))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(PIECES)) + text[at:]
    return text


# Fuzzed texts, three ways: comment/hint/quote fragments strung together; comments and
# literals where they are legal around a call (mostly accepted); the corpus with syntax
# dropped in. Each text is refused, or Spark reads it as the guard said. The default run
# draws the profile's cases (60); CI's slow run draws 3,000 of each.
FUZZ = {
    "mixes": st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
    "legal": _accepted(),
    "mutants": _mutant(),
}


def fuzz(parser: SparkParser, kind: str, examples: int | None) -> None:
    extra = {} if examples is None else {"max_examples": examples}

    @settings(suppress_health_check=[HealthCheck.too_slow], database=None, **extra)
    @given(FUZZ[kind])
    def check(text: str) -> None:
        problem = expression_problem(text)
        if kind == "legal":
            assert problem is None or "keyword" in problem, (text, problem)
        if problem is None:
            assert_spark_reads_as_the_guard(parser, text)

    check()


@pytest.mark.parametrize("kind", sorted(FUZZ))
def test_fuzzed_texts_are_refused_or_read_by_spark_as_the_guard_said(
    spark_parser: SparkParser, kind: str
) -> None:
    fuzz(spark_parser, kind, None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FUZZ))
def test_thousands_of_fuzzed_texts_are_refused_or_read_by_spark_as_the_guard_said(
    spark_parser: SparkParser, kind: str
) -> None:
    fuzz(spark_parser, kind, 3_000)


def test_schemas_read_by_spark_as_the_guard_gives_them(spark_parser: SparkParser) -> None:
    for ddl in SCHEMAS:
        canonical = parse_schema(ddl).text
        assert spark_parser.table_schema(ddl) is not None, ddl
        assert spark_parser.table_schema(canonical) == spark_parser.table_schema(ddl), ddl


def test_the_allowlist_places_every_function_of_sparks_registry(
    spark_parser: SparkParser,
) -> None:
    placed = ALLOWED_FUNCTIONS | set(REFUSED_FUNCTIONS) | AGGREGATE_FUNCTIONS | WINDOW_FUNCTIONS
    registry = spark_parser.builtin_functions()
    names = {name for name, _, _ in registry}
    unplaced = sorted(n for n in names if n not in placed and n.replace("_", "").isalnum())
    assert not unplaced, f"review these functions of this Spark and place them: {unplaced}"
    assert not ALLOWED_FUNCTIONS - names, sorted(ALLOWED_FUNCTIONS - names)
    folding = [
        "org.apache.spark.sql.catalyst.expressions.aggregate.AggregateFunction",
        "org.apache.spark.sql.catalyst.expressions.WindowFunction",
    ]
    for name, group, cls in registry:
        if name in ALLOWED_FUNCTIONS:
            assert group not in ("agg_funcs", "window_funcs"), name
            assert not any(spark_parser.is_subclass(cls, of) for of in folding), name
