"""Spark SQL expressions and types, parsed and written back in one canonical form.

``parse_named`` (a select item), ``parse_expression`` (a filter) and ``parse_schema`` (the
DDL ``from_json`` reads) follow the grammar of Spark 4's parser (``SqlBaseParser.g4``) for a
subset of it: literals, columns and fields, operators with Spark's precedence, the
predicates, CASE, CAST and ``::``, calls of a function by its plain name (lambdas among the
arguments), ``struct(...)`` and the keyword forms of a few functions (``trim(BOTH ...)``,
``extract(YEAR FROM ...)``, ``dateadd(DAY, ...)``...). Whatever lies outside the subset is a
``SqlSyntaxError``: subqueries, window and aggregate clauses (OVER, FILTER, WITHIN GROUP,
DISTINCT), qualified function names, ``IDENTIFIER(...)``, parameters, hints.

The result is the text Spark is given (``Parsed.text``), never the text as written: every
compound expression in parentheses, every column and field name in backticks, string
literals in single quotes, no comments. Spark reads that text as the parser did, whatever
its settings (``spark.sql.ansi.doubleQuotedIdentifiers``...), and ``Parsed.calls`` lists
every function it calls. Tests check both against Spark's own parser
(``tests/integration/test_spark_sql_parse.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.core.spark_sql.spark_sql_lexer import (
    SqlSyntaxError,
    Token,
    single_quoted,
    tokenize,
    words,
)

# Bare words that are never a column, field, alias or function name here (write them in
# backticks): Spark's keywords that start or continue a clause an expression may hold.
RESERVED = words(
    """ALL AND ANY AS BETWEEN BOTH CASE CAST COLLATE DISTINCT DIV ELSE END ESCAPE EXISTS FALSE
    FOR FROM IDENTIFIER IGNORE ILIKE IN INTERVAL IS LEADING LIKE NOT NULL NULLS OR OVER
    PLACING REGEXP RESPECT RLIKE SELECT SOME TABLE THEN TRAILING TRUE TRY_CAST UNKNOWN USING
    VALUES WHEN WITH WITHIN"""
)
# After '(' these start a query: a subquery, refused.
QUERY_STARTS = frozenset({"SELECT", "FROM", "WITH", "VALUES", "TABLE"})
# Keywords Spark reads as a call of the function of that name when written alone.
CURRENT_LIKE = frozenset(
    {"CURRENT_DATE", "CURRENT_TIMESTAMP", "CURRENT_USER", "USER", "SESSION_USER", "CURRENT_TIME"}
)
TYPED_LITERALS = frozenset({"DATE", "TIMESTAMP", "TIMESTAMP_NTZ", "TIMESTAMP_LTZ", "TIME", "X"})
AGGREGATE_FORMS = frozenset({"FIRST", "LAST", "ANY_VALUE", "PERCENTILE_CONT", "PERCENTILE_DISC"})
CALL_CLAUSES = frozenset({"OVER", "FILTER", "WITHIN", "IGNORE", "RESPECT"})
DATETIME_UNITS = words(
    """YEAR QUARTER MONTH WEEK DAY DAYOFYEAR HOUR MINUTE SECOND MILLISECOND
    MICROSECOND"""
)
UNIT_FORMS = frozenset(
    {"TIMESTAMPADD", "DATEADD", "DATE_ADD", "TIMESTAMPDIFF", "DATEDIFF", "DATE_DIFF", "TIMEDIFF"}
)
INTERVAL_UNITS = frozenset(
    f"{u}{s}"
    for u in words("NANOSECOND MICROSECOND MILLISECOND SECOND MINUTE HOUR DAY WEEK MONTH YEAR")
    for s in ("", "S")
)
INTERVAL_TO_UNITS = frozenset({"SECOND", "MINUTE", "HOUR", "DAY", "MONTH", "YEAR"})
PRIMITIVE_TYPES = words(
    """BOOLEAN TINYINT BYTE SMALLINT SHORT INT INTEGER BIGINT LONG FLOAT REAL DOUBLE DATE
    TIMESTAMP TIMESTAMP_NTZ TIMESTAMP_LTZ STRING CHAR CHARACTER VARCHAR BINARY DECIMAL DEC
    NUMERIC VOID VARIANT TIME"""
)
# Binary operators of a value expression, by precedence (Spark's valueExpression rule).
BINARY_LEVELS: dict[str, int] = {
    **dict.fromkeys(("=", "==", "<>", "!=", "<", "<=", ">", ">=", "<=>"), 1),
    "|": 2,
    "^": 3,
    "&": 4,
    **dict.fromkeys(("<<", ">>", ">>>"), 5),
    **dict.fromkeys(("+", "-", "||"), 6),
    **dict.fromkeys(("*", "/", "%", "DIV"), 7),
}
# An interval's value: digits, with a fraction or not (no exponent, no type suffix).
_PLAIN_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
MAX_NESTING = 40  # parentheses, calls, CASE, subscripts and types, one inside another


@dataclass(frozen=True)
class Parsed:
    """What Spark is given (``text``) and the functions it calls (lower case, as named)."""

    text: str
    calls: tuple[str, ...]


def parse_named(text: str) -> Parsed:
    """A select item: an expression with an optional alias, or ``*`` / ``name.*``."""
    return _Parser(text).whole(lambda p: p.named())


def parse_expression(text: str) -> Parsed:
    """A boolean or value expression (a filter): no alias, no star."""
    return _Parser(text).whole(lambda p: p.expression())


def parse_schema(text: str) -> Parsed:
    """A schema in DDL (``id BIGINT, name STRING NOT NULL COMMENT '...'``)."""
    return _Parser(text).whole(lambda p: p.schema())


def quoted_name(name: str) -> str:
    """A column, field or alias name in backticks."""
    return "`" + name.replace("`", "``") + "`"


class _Cursor:
    """The tokens and a position in them; names as Spark reads them."""

    def __init__(self, text: str):
        self.toks = tokenize(text)
        self.i = 0
        self.calls: list[str] = []
        self.depth = 0
        self.pending_gt = 0  # '>' still owed by a '>>' or '>>>' that closed a type

    # -- tokens ---------------------------------------------------------------------------

    def peek(self, k: int = 0) -> Token | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def take(self) -> Token:
        tok = self.peek()
        if tok is None:
            raise SqlSyntaxError("the expression ends too early")
        self.i += 1
        return tok

    def word_at(self, k: int, *words: str) -> bool:
        tok = self.peek(k)
        return tok is not None and tok.is_word(*words)

    def op_at(self, k: int, *ops: str) -> bool:
        tok = self.peek(k)
        return tok is not None and tok.is_op(*ops)

    def accept_word(self, *words: str) -> Token | None:
        return self.take() if self.word_at(0, *words) else None

    def accept_op(self, *ops: str) -> bool:
        if self.op_at(0, *ops):
            self.i += 1
            return True
        return False

    def expect_word(self, *words: str) -> Token:
        tok = self.accept_word(*words)
        if tok is None:
            raise SqlSyntaxError(f"expected {' or '.join(words)}, found {self._shown(self.peek())}")
        return tok

    def expect_op(self, op: str) -> None:
        if not self.accept_op(op):
            raise SqlSyntaxError(f"expected '{op}', found {self._shown(self.peek())}")

    @staticmethod
    def _shown(tok: Token | None) -> str:
        return "the end" if tok is None else repr(tok.raw)

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise SqlSyntaxError(f"nested deeper than {MAX_NESTING} levels")

    # -- names ----------------------------------------------------------------------------

    def is_name(self, k: int = 0) -> bool:
        """A column/field/alias name: `backticked`, or a bare word that is not reserved."""
        tok = self.peek(k)
        if tok is None:
            return False
        return tok.kind == "name" or (tok.kind == "word" and tok.text.upper() not in RESERVED)

    def name(self) -> str:
        tok = self.take()
        if tok.kind == "name" or (tok.kind == "word" and tok.text.upper() not in RESERVED):
            return quoted_name(tok.text)
        if tok.kind == "word":
            raise SqlSyntaxError(
                f"{tok.text.upper()} is a keyword here: a column or name spelled so is "
                f"written in backticks (`{tok.text}`)"
            )
        raise SqlSyntaxError(f"expected a name, found {tok.raw!r}")

    def string_literal(self) -> str:
        tok = self.take()
        if tok.kind != "string":
            raise SqlSyntaxError(f"expected a string literal, found {tok.raw!r}")
        return single_quoted(tok.raw)


class _Types(_Cursor):
    """Data types (CAST, ``::``) and DDL schemas, written back canonically."""

    def schema(self) -> str:
        fields = [self.column()]
        while self.accept_op(","):
            fields.append(self.column())
        return ", ".join(fields)

    def column(self) -> str:
        name = self.name()
        return f"{name} {self.full_type()}{self.column_options()}"

    def column_options(self) -> str:
        out = ""
        if self.accept_word("NOT"):
            self.expect_word("NULL")
            out += " NOT NULL"
        if self.accept_word("COMMENT"):
            out += f" COMMENT {self.string_literal()}"
        return out

    def full_type(self) -> str:
        """A data type that ends where it should (no '>' of a '>>' left over)."""
        out = self.data_type()
        if self.pending_gt:
            raise SqlSyntaxError(f"unexpected '>' after {out}")
        return out

    def data_type(self) -> str:
        tok = self.take()
        upper = tok.text.upper() if tok.kind == "word" else ""
        self.nest()
        if upper in ("ARRAY", "MAP") and self.accept_op("<"):
            inner = [self.data_type()]
            if upper == "MAP":
                self.expect_op(",")
                inner.append(self.data_type())
            self.close_angle()
            out = f"{upper}<{', '.join(inner)}>"
        elif upper == "STRUCT" and (self.op_at(0, "<") or self.op_at(0, "<>")):
            out = self.struct_type()
        elif upper == "INTERVAL":
            start = self.expect_word(*INTERVAL_TO_UNITS).text.upper()
            out = f"INTERVAL {start}"
            if self.accept_word("TO"):
                out += f" TO {self.expect_word(*INTERVAL_TO_UNITS).text.upper()}"
        elif upper in PRIMITIVE_TYPES:
            out = upper + self.type_parameters()
        else:
            raise SqlSyntaxError(f"{tok.raw!r} is not a Spark data type")
        self.depth -= 1
        return out

    def struct_type(self) -> str:
        if self.accept_op("<>"):
            return "STRUCT<>"
        self.expect_op("<")
        fields: list[str] = []
        if not self.accept_close_angle():
            while True:
                name = self.name()
                self.accept_op(":")
                fields.append(f"{name}: {self.data_type()}{self.column_options()}")
                if not self.accept_op(","):
                    break
            self.close_angle()
        return f"STRUCT<{', '.join(fields)}>"

    def type_parameters(self) -> str:
        if not self.accept_op("("):
            return ""
        params = []
        while True:
            tok = self.take()
            if tok.kind != "number" or not tok.text.isdigit():
                raise SqlSyntaxError(f"a type's parameters are whole numbers, not {tok.raw!r}")
            params.append(tok.text)
            if not self.accept_op(","):
                break
        self.expect_op(")")
        return f"({','.join(params)})"

    def accept_close_angle(self) -> bool:
        if self.pending_gt:
            self.pending_gt -= 1
            return True
        tok = self.peek()
        if tok is not None and tok.is_op(">", ">>", ">>>"):
            self.take()
            self.pending_gt = len(tok.text) - 1
            return True
        return False

    def close_angle(self) -> None:
        if not self.accept_close_angle():
            raise SqlSyntaxError(f"expected '>', found {self._shown(self.peek())}")


class _Calls(_Types):
    """Calls of a function by its plain name, lambdas among their arguments, and the keyword
    forms of a few functions (``trim(BOTH ... FROM ...)``), written back canonically."""

    def expression(self) -> str:
        raise NotImplementedError  # _Parser's

    def value(self, min_level: int = 1) -> str:
        raise NotImplementedError  # _Parser's

    def named(self) -> str:
        raise NotImplementedError  # _Parser's

    def special_call(self, tok: Token) -> str:
        """A bare word followed by '(': a keyword form Spark parses its own way, or a call."""
        upper = tok.text.upper()
        if upper == "IDENTIFIER":
            raise SqlSyntaxError(
                "IDENTIFIER(...) is not allowed: it names a function or column at run time"
            )
        if upper in AGGREGATE_FORMS:
            raise SqlSyntaxError(
                f"{tok.text}(): aggregates are not allowed (an expression reads one message)"
            )
        if upper == "EXISTS" and self.word_at(1, *QUERY_STARTS):
            raise _subquery()
        form = self.keyword_form(upper)
        if form is not None:
            self.nest()
            out = form(tok.text)
            self.depth -= 1
            return out
        if upper in RESERVED and upper != "EXISTS":
            raise SqlSyntaxError(
                f"{tok.text}(...): a keyword; a function spelled so is called as `{tok.text}`(...)"
            )
        return self.call(tok.text, quoted_name(tok.text))

    def keyword_form(self, upper: str) -> Callable[[str], str] | None:
        """The reader of the keyword form ``upper(...)`` starts here, or None for a plain
        call: decided on the tokens ahead, as Spark's grammar tells them apart (a FROM,
        IN or PLACING inside the parentheses, a unit first), never by trying one reading
        and then the other (whose cost would double at each nested call)."""
        if upper in ("CAST", "TRY_CAST"):
            return self.cast
        if upper == "STRUCT":
            return self.struct
        if upper in UNIT_FORMS:
            unit = self.word_at(1, *DATETIME_UNITS) and self.op_at(2, ",")
            return self.unit_form if unit else None
        marker = {
            "EXTRACT": "FROM",
            "POSITION": "IN",
            "SUBSTR": "FROM",
            "SUBSTRING": "FROM",
            "TRIM": "FROM",
            "OVERLAY": "PLACING",
        }.get(upper)
        if marker is None or not self.in_call(marker):
            return None
        forms: dict[str, Callable[[str], str]] = {
            "EXTRACT": self.extract,
            "POSITION": self.position,
            "SUBSTR": self.substring,
            "SUBSTRING": self.substring,
            "TRIM": self.trim,
            "OVERLAY": self.overlay,
        }
        return forms[upper]

    def in_call(self, word: str) -> bool:
        """Whether the bare ``word`` stands inside the parentheses opening here, outside any
        nested ones (``trim(BOTH 'x' FROM s)``; not ``trim(f(a FROM b))``)."""
        depth = 0
        for tok in self.toks[self.i :]:
            if tok.is_op("(", "["):
                depth += 1
            elif tok.is_op(")", "]"):
                depth -= 1
                if depth == 0:
                    return False
            elif depth == 1 and tok.is_word(word):
                return True
        return False

    def cast(self, written: str) -> str:
        self.expect_op("(")
        expr = self.expression()
        self.expect_word("AS")
        dtype = self.full_type()
        self.expect_op(")")
        return f"{written.upper()}({expr} AS {dtype})"

    def struct(self, written: str) -> str:
        self.expect_op("(")
        items: list[str] = []
        if not self.accept_op(")"):
            items.append(self.named_member())
            while self.accept_op(","):
                items.append(self.named_member())
            self.expect_op(")")
        return f"{written}({', '.join(items)})"

    def named_member(self) -> str:
        if self.op_at(0, "*") or (self.is_name() and self.op_at(1, ".") and self.op_at(2, "*")):
            raise SqlSyntaxError("'*' is allowed only as a whole select item")
        return self.named()

    def extract(self, written: str) -> str:
        self.expect_op("(")
        field = self.take()
        if field.kind != "word":
            raise SqlSyntaxError("not EXTRACT(field FROM ...)")
        self.expect_word("FROM")
        source = self.value()
        self.expect_op(")")
        return f"{written}({field.text} FROM {source})"

    def position(self, written: str) -> str:
        self.expect_op("(")
        sub = self.value()
        self.expect_word("IN")
        within = self.value()
        self.expect_op(")")
        return f"{written}({sub} IN {within})"

    def substring(self, written: str) -> str:
        self.expect_op("(")
        source = self.value()
        sep = "FROM" if self.accept_word("FROM") else None
        if sep is None:
            self.expect_op(",")
            sep = ","
        pos = self.value()
        length = ""
        if self.accept_word("FOR"):
            length = f" FOR {self.value()}"
        elif self.accept_op(","):
            length = f", {self.value()}"
        self.expect_op(")")
        return f"{written}({source}{' FROM' if sep == 'FROM' else ','} {pos}{length})"

    def trim(self, written: str) -> str:
        self.expect_op("(")
        option = self.accept_word("BOTH", "LEADING", "TRAILING")
        chars = "" if self.word_at(0, "FROM") else self.value()
        self.expect_word("FROM")
        source = self.value()
        self.expect_op(")")
        parts = [option.text.upper() if option else "", chars, "FROM", source]
        return f"{written}({' '.join(p for p in parts if p)})"

    def overlay(self, written: str) -> str:
        self.expect_op("(")
        source = self.value()
        self.expect_word("PLACING")
        replace = self.value()
        self.expect_word("FROM")
        pos = self.value()
        length = f" FOR {self.value()}" if self.accept_word("FOR") else ""
        self.expect_op(")")
        return f"{written}({source} PLACING {replace} FROM {pos}{length})"

    def unit_form(self, written: str) -> str:
        self.expect_op("(")
        unit = self.take()
        if not (unit.is_word(*DATETIME_UNITS) and self.op_at(0, ",")):
            raise SqlSyntaxError("not the unit form")
        self.expect_op(",")
        first = self.value()
        self.expect_op(",")
        second = self.value()
        self.expect_op(")")
        return f"{written}({unit.text}, {first}, {second})"

    def call(self, name: str, shown: str) -> str:
        """``name(args)``: a call of a function by its plain name (args may be lambdas)."""
        self.expect_op("(")
        self.nest()
        if self.word_at(0, "DISTINCT", "ALL"):
            raise SqlSyntaxError(f"{name}(DISTINCT/ALL ...): aggregates are not allowed")
        args: list[str] = []
        if not self.accept_op(")"):
            args.append(self.argument())
            while self.accept_op(","):
                args.append(self.argument())
            self.expect_op(")")
        self.depth -= 1
        clause = self.peek()
        if clause is not None and clause.is_word(*CALL_CLAUSES):
            raise SqlSyntaxError(
                f"{name}(...) {clause.text.upper()}: window and aggregate clauses are not allowed"
            )
        self.calls.append(name.lower())
        return f"{shown}({', '.join(args)})"

    def argument(self) -> str:
        if self.op_at(0, "*"):
            raise SqlSyntaxError("'*' is allowed only as a whole select item")
        if self.is_name() and self.op_at(1, "=>"):
            raise SqlSyntaxError("named arguments (name => value) are not allowed")
        return self.expression()

    def lambda_params(self) -> str | None:
        """``x ->`` or ``(x, y) ->`` (read), else None with nothing read."""
        if self.is_name() and self.op_at(1, "->"):
            name = self.name()
            self.take()
            return name
        if not self.op_at(0, "("):
            return None
        j, names = 1, []
        while self.is_name(j):
            names.append(self.peek(j))
            if not self.op_at(j + 1, ","):
                break
            j += 2
        if len(names) < 2 or not self.op_at(j + 1, ")") or not self.op_at(j + 2, "->"):
            return None
        self.i += j + 3
        return "(" + ", ".join(quoted_name(t.text) for t in names if t) + ")"


class _Parser(_Calls):
    """Recursive descent over the tokens; each method returns the canonical text of what it
    read and leaves ``i`` after it."""

    def whole(self, rule: Callable[[_Parser], str]) -> Parsed:
        if not self.toks:
            raise SqlSyntaxError("empty expression")
        out = rule(self)
        if self.i < len(self.toks):
            raise SqlSyntaxError(f"unexpected {self._shown(self.peek())}")
        return Parsed(out, tuple(self.calls))

    # -- select items and expressions -------------------------------------------------------

    def named(self) -> str:
        star = self.star()
        if star is not None:
            return star
        expr = self.expression()
        if self.accept_word("AS"):
            if self.accept_op("("):
                names = [self.name()]
                while self.accept_op(","):
                    names.append(self.name())
                self.expect_op(")")
                return f"{expr} AS ({', '.join(names)})"
            return f"{expr} AS {self.name()}"
        if self.is_name():
            return f"{expr} AS {self.name()}"
        return expr

    def star(self) -> str | None:
        """``*`` or ``a.b.*`` (a whole select item), else None with nothing read."""
        j, parts = 0, []
        while self.is_name(j) and self.op_at(j + 1, "."):
            parts.append(self.peek(j))
            j += 2
        if not self.op_at(j, "*") or self.peek(j + 1) is not None:
            return None
        self.i += j + 1
        return ".".join([*(quoted_name(t.text) for t in parts if t), "*"])

    def expression(self) -> str:
        left = self.conjunction()
        while self.accept_word("OR"):
            left = f"({left} OR {self.conjunction()})"
        return left

    def conjunction(self) -> str:
        left = self.negation()
        while self.accept_word("AND"):
            left = f"({left} AND {self.negation()})"
        return left

    def negation(self) -> str:
        if self.accept_word("NOT"):
            self.nest()
            operand = self.negation()
            self.depth -= 1
            return f"(NOT {operand})"
        if self.word_at(0, "EXISTS") and self.op_at(1, "(") and self.word_at(2, *QUERY_STARTS):
            raise _subquery()
        return self.predicated()

    def predicated(self) -> str:
        value = self.value()
        negated = self.word_at(0, "NOT") and self.word_at(
            1, "BETWEEN", "IN", "LIKE", "ILIKE", "RLIKE", "REGEXP"
        )
        not_ = "NOT " if negated and self.take() else ""
        if self.accept_word("BETWEEN"):
            low = self.value()
            self.expect_word("AND")
            return f"({value} {not_}BETWEEN {low} AND {self.value()})"
        if self.accept_word("IN"):
            return f"({value} {not_}IN ({self.expressions_in_parens()}))"
        kind = self.accept_word("RLIKE", "REGEXP", "LIKE", "ILIKE")
        if kind is not None:
            return f"({value} {not_}{self.like(kind)})"
        if self.accept_word("IS"):
            return f"({value} IS {self.is_predicate()})"
        return value

    def like(self, kind: Token) -> str:
        op = kind.text.upper()
        if op in ("LIKE", "ILIKE"):
            quantifier = self.accept_word("ANY", "SOME", "ALL")
            if quantifier is not None:
                items = self.expressions_in_parens()
                return f"{op} {quantifier.text.upper()} ({items})"
            pattern = self.value()
            if self.accept_word("ESCAPE"):
                return f"{op} {pattern} ESCAPE {self.string_literal()}"
            return f"{op} {pattern}"
        return f"{op} {self.value()}"

    def is_predicate(self) -> str:
        not_ = "NOT " if self.accept_word("NOT") else ""
        if self.accept_word("DISTINCT"):
            self.expect_word("FROM")
            return f"{not_}DISTINCT FROM {self.value()}"
        kind = self.expect_word("NULL", "TRUE", "FALSE", "UNKNOWN")
        return f"{not_}{kind.text.upper()}"

    def expressions_in_parens(self) -> str:
        self.expect_op("(")
        if self.word_at(0, *QUERY_STARTS):
            raise _subquery()
        self.nest()
        items = [self.expression()]
        while self.accept_op(","):
            items.append(self.expression())
        self.expect_op(")")
        self.depth -= 1
        return ", ".join(items)

    # -- value expressions: operators by precedence -----------------------------------------

    def binary_level(self) -> int:
        tok = self.peek()
        if tok is None:
            return 0
        if tok.kind == "op":
            return BINARY_LEVELS.get(tok.text, 0)
        return BINARY_LEVELS["DIV"] if tok.is_word("DIV") else 0

    def value(self, min_level: int = 1) -> str:
        """Precedence climbing over ``BINARY_LEVELS``; every operator is left-associative."""
        left = self.unary()
        while (level := self.binary_level()) >= min_level:
            tok = self.take()
            op = tok.text.upper()
            if op in ("!<", "!>"):
                raise SqlSyntaxError(f"{op}: write >= or <=")
            right = self.value(level + 1)
            left = f"({left} {op} {right})"
        return left

    def unary(self) -> str:
        tok = self.peek()
        if tok is not None and tok.is_op("-", "+", "~"):
            self.take()
            nxt = self.peek()
            if tok.text == "-" and nxt is not None and nxt.kind == "number":
                self.take()  # Spark reads -1 as a literal, not as -(1)
                return self.postfix(f"-{nxt.text}")
            self.nest()
            operand = self.unary()
            self.depth -= 1
            return f"({tok.text}({operand}))"
        if tok is not None and tok.is_op("!"):
            raise SqlSyntaxError("'!': write NOT")
        return self.postfix(self.primary())

    def postfix(self, base: str) -> str:
        while True:
            if self.op_at(0, "[", ".") and not base.endswith(("`", ")", "]")):
                base = f"({base})"  # a literal's text could run into what follows (1. is 1.0)
            if self.accept_op("["):
                self.nest()
                index = self.expression()
                self.expect_op("]")
                self.depth -= 1
                base = f"{base}[{index}]"
            elif self.op_at(0, ".") and self.peek(1) is not None:
                self.take()
                base = f"{base}.{self.name()}"
            elif self.accept_op("::"):
                base = f"({base})::{self.full_type()}"
            elif self.op_at(0, "("):
                raise SqlSyntaxError(
                    "only a function's plain name may be called (not a qualified name)"
                )
            elif self.op_at(0, ":"):
                raise SqlSyntaxError("':' (a variant path) is not allowed: use variant_get")
            elif self.word_at(0, "COLLATE"):
                raise SqlSyntaxError("COLLATE is not allowed in an expression: use collate()")
            else:
                return base

    # -- primary expressions ----------------------------------------------------------------

    def primary(self) -> str:
        params = self.lambda_params()  # Spark's grammar has lambdas among its primaries
        if params is not None:
            self.nest()
            body = self.expression()
            self.depth -= 1
            return f"{params} -> {body}"
        tok = self.take()
        if tok.kind == "number":
            return tok.text
        if tok.kind == "string":
            parts = [single_quoted(tok.raw)]
            while (nxt := self.peek()) is not None and nxt.kind == "string":
                parts.append(single_quoted(self.take().raw))
            return " ".join(parts)
        if tok.kind == "name":
            if self.op_at(0, "("):
                return self.call(tok.text, quoted_name(tok.text))
            return quoted_name(tok.text)
        if tok.is_op("("):
            return self.parenthesized()
        if tok.kind == "word":
            return self.word(tok)
        if tok.is_op("?", ":"):
            raise SqlSyntaxError("parameters (? or :name) are not allowed")
        if tok.is_op("*"):
            raise SqlSyntaxError("'*' is allowed only as a whole select item")
        raise SqlSyntaxError(f"unexpected {tok.raw!r}")

    def parenthesized(self) -> str:
        if self.word_at(0, *QUERY_STARTS):
            raise _subquery()
        self.nest()
        inner = self.expression()
        if self.op_at(0, ","):
            raise SqlSyntaxError("a row (a, b) is not allowed: use struct(a, b)")
        self.expect_op(")")
        self.depth -= 1
        return inner

    def word(self, tok: Token) -> str:
        upper = tok.text.upper()
        nxt = self.peek()
        if upper in ("NULL", "TRUE", "FALSE"):
            return upper
        if upper == "CASE":
            return self.case()
        if upper == "INTERVAL":
            return self.interval()
        if nxt is not None and nxt.kind == "string":
            if upper not in TYPED_LITERALS:
                raise SqlSyntaxError(f"{tok.text} {nxt.raw}: not a typed literal Spark knows")
            return f"{upper} {single_quoted(self.take().raw)}"
        if upper in CURRENT_LIKE and not (nxt is not None and nxt.is_op("(")):
            return tok.text
        if upper in CURRENT_LIKE and not self.op_at(1, ")"):
            # Spark reads current_date(x) as current_date AS (x), a column and its aliases
            raise SqlSyntaxError(f"{tok.text}(...): arguments are written `{tok.text}`(...)")
        if nxt is not None and nxt.is_op("("):
            return self.special_call(tok)
        if upper in RESERVED:
            self.i -= 1
            return self.name()  # raises, naming the keyword
        return quoted_name(tok.text)

    def case(self) -> str:
        self.nest()
        subject = "" if self.word_at(0, "WHEN") else f" {self.expression()}"
        whens = []
        while self.accept_word("WHEN"):
            cond = self.expression()
            self.expect_word("THEN")
            whens.append(f" WHEN {cond} THEN {self.expression()}")
        if not whens:
            raise SqlSyntaxError("CASE needs a WHEN")
        other = f" ELSE {self.expression()}" if self.accept_word("ELSE") else ""
        self.expect_word("END")
        self.depth -= 1
        return f"CASE{subject}{''.join(whens)}{other} END"

    def interval(self) -> str:
        """INTERVAL 'text', INTERVAL <value> <unit>..., or INTERVAL <value> <unit> TO <unit>."""
        nxt, after = self.peek(), self.peek(1)
        if (
            nxt is not None
            and nxt.kind == "string"
            and not (after is not None and after.is_word(*INTERVAL_UNITS))
        ):
            return f"INTERVAL {single_quoted(self.take().raw)}"
        parts: list[str] = []
        while parts == [] or self.interval_value_ahead():
            value = self.interval_value()
            unit = self.expect_word(*INTERVAL_UNITS).text.upper()
            parts.append(f"{value} {unit}")
            if len(parts) == 1 and self.accept_word("TO"):
                if unit not in INTERVAL_TO_UNITS:
                    raise SqlSyntaxError(f"INTERVAL ... {unit} TO: not a unit range")
                return f"INTERVAL {parts[0]} TO {self.expect_word(*INTERVAL_TO_UNITS).text.upper()}"
        return "INTERVAL " + " ".join(parts)

    def interval_value_ahead(self) -> bool:
        k = 1 if self.op_at(0, "+", "-") else 0
        tok = self.peek(k)
        return (
            tok is not None
            and tok.kind in ("number", "string")
            and self.word_at(k + 1, *INTERVAL_UNITS)
        )

    def interval_value(self) -> str:
        sign = self.take().text if self.op_at(0, "+", "-") else ""
        tok = self.take()
        if tok.kind == "number" and _PLAIN_NUMBER.fullmatch(tok.text):
            return f"{sign}{tok.text}"
        if tok.kind == "string":
            return f"{sign}{single_quoted(tok.raw)}"
        raise SqlSyntaxError(
            f"INTERVAL: expected a whole or decimal number or a string, found {tok.raw!r}"
        )


def _subquery() -> SqlSyntaxError:
    return SqlSyntaxError(
        "a subquery is not allowed: an expression reads only its message (a column named "
        "like a keyword is written in backticks)"
    )
