"""Which Spark SQL a spec may hold, and the text Spark is given for it: the rule that keeps a
transform to its batch.

A transform's ``filter``, ``select`` and ``schema`` run on the Spark host, where Spark SQL can
call into the JVM (``reflect``), make the host open files (a subquery over ``text.`/path```,
``from_xml`` with ``rowValidationXSDPath``) or run a shell command (a script transform).
The rule is a decision on a parse, not a search for bad words:

1. the text is parsed (``conveyor.core.spark_sql.spark_sql_parser``, Spark 4's grammar for a subset of
   it: no subquery, no window or aggregate clause, no qualified function name, no
   ``IDENTIFIER(...)``, no parameter, no hint, no comment Spark nests its own way);
2. every function it calls must be on the allowlist (``conveyor.core.spark_sql.spark_functions``):
   Spark's built-in functions reviewed one by one; anything else is refused;
3. Spark is given the parser's canonical text (``GuardedSql``), never the text as written,
   so what runs is what was judged, whatever Spark's settings make of quotes
   (``spark.sql.ansi.doubleQuotedIdentifiers``).

``guard_transform`` is the one entry: the spec's validation calls it (a refused expression is
an error naming its field, ``transform.select[2]``) and so does the transformer
(``conveyor.spark.transform``), which sends only its result. The transform's session also
turns ``spark.sql.runSQLOnFiles`` off (``conveyor.spark.session``). Tests hold the parse to
Spark's own parser on a corpus and on fuzzed comment/hint/quote mixes
(``tests/integration/test_spark_sql_parse.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.core.spark_sql.spark_functions import function_problem
from conveyor.core.spark_sql.spark_sql_lexer import SqlSyntaxError
from conveyor.core.spark_sql.spark_sql_parser import (
    Parsed,
    parse_expression,
    parse_named,
    parse_schema,
)


class SqlGuardError(ValueError):
    """An expression the rule refuses; ``field`` names it (``filter``, ``select[2]``...)."""

    def __init__(self, message: str, *, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GuardedSql:
    """A transform's Spark SQL as Spark is given it (None where the spec has none)."""

    filter: str | None
    select: tuple[str, ...] | None
    schema: str | None


def guard_transform(filter: str | None, select: list[str] | None, schema: str | None) -> GuardedSql:
    """The canonical text of a transform's expressions; SqlGuardError for the first one the
    rule refuses, naming its field."""
    return GuardedSql(
        filter=_checked(filter, parse_expression, "filter"),
        select=None
        if select is None
        else tuple(_need(_checked(e, parse_named, f"select[{i}]")) for i, e in enumerate(select)),
        schema=_checked(schema, parse_schema, "schema"),
    )


def expression_problem(text: str, *, kind: str = "select") -> str | None:
    """Why ``text`` may not run as a select item (``kind="filter"``: as a filter;
    ``"schema"``: as a DDL schema), or None when it may."""
    parse = {"select": parse_named, "filter": parse_expression, "schema": parse_schema}[kind]
    try:
        _checked(text, parse, kind)
    except SqlGuardError as e:
        return str(e)
    return None


def _checked(text: str | None, parse: Callable[[str], Parsed], field: str) -> str | None:
    if text is None:
        return None
    try:
        parsed = parse(text)
    except SqlSyntaxError as e:
        raise SqlGuardError(str(e), field=field) from None
    except RecursionError:  # the parser bounds its nesting; this is the backstop
        raise SqlGuardError("nested too deeply to read", field=field) from None
    for name in parsed.calls:
        problem = function_problem(name)
        if problem is not None:
            raise SqlGuardError(problem, field=field)
    return parsed.text


def _need(text: str | None) -> str:
    assert text is not None
    return text
