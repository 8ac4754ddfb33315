"""Which Spark SQL expressions a spec may hold: the rule that keeps them to the batch.

A transform's ``filter``, ``select`` and ``schema`` run on the Spark host. Spark SQL can
call into the JVM there (``reflect``, ``java_method``, ``try_reflect``; a function named
at run time by ``IDENTIFIER('...')(...)``), read any file through a subquery over a file
relation (``(SELECT first(value) FROM text.`/etc/passwd`)``, ``(TABLE ...)``) and run a
shell command through a script transform in a subquery (``(FROM t MAP a USING 'cmd')``,
``SELECT TRANSFORM(...) USING``). ``expression_problem`` refuses all of these before an
expression reaches Spark; the transform's session also turns ``spark.sql.runSQLOnFiles``
off (``conveyor.spark.session``).

The rule works on tokens as Spark's lexer cuts them, so that no word can hide from it and
no quoted text is taken for one: '...' and "..." literals with backslash escapes and
doubled quotes, raw literals r'...' (neither), `backticked` names with doubled
backticks, -- comments (a backslash before the newline continues them) and nested
/* */ comments. Outside literals only ASCII and whitespace may appear (Spark accepts
nothing else there). Words are compared case-insensitively; a call is a name followed by
``(``, whatever whitespace or comments stand between, qualified or not
(``system.builtin.reflect(``). Words inside literals stay allowed (``'reflect(' AS s``).

Spark 4.x's built-in functions were reviewed on the test server (``SHOW FUNCTIONS``):
beyond the JVM calls, ``from_protobuf``/``to_protobuf`` read a descriptor file from the
Spark host and the Avro functions take a schema URL (``avroSchemaUrl``) among their
options; both are refused. ``xpath*``, ``from_xml`` and ``schema_of_xml`` do not expand
external entities (checked: an entity naming a file yields nothing); ``url_decode``,
``parse_url``, ``input_file_name``, ``current_catalog``, ``current_user`` and
``version`` read nothing of the host beyond its user name and Spark's version.
"""

from __future__ import annotations

from dataclasses import dataclass

# Functions that run code on the Spark host or read its files; refused when called.
REFUSED_FUNCTIONS: dict[str, str] = {
    "reflect": "calls Java methods on the Spark host",
    "java_method": "calls Java methods on the Spark host",
    "try_reflect": "calls Java methods on the Spark host",
    "identifier": "names a function at run time (a way around this rule)",
    "from_protobuf": "reads a descriptor file on the Spark host",
    "to_protobuf": "reads a descriptor file on the Spark host",
    "from_avro": "can read a schema from a file or URL on the Spark host",
    "to_avro": "can read a schema from a file or URL on the Spark host",
    "schema_of_avro": "can read a schema from a file or URL on the Spark host",
}
# Words that start a query (a subquery could read any relation); refused after '('.
_QUERY_STARTS = frozenset({"select", "from", "with", "values", "table"})
# Refused anywhere as bare words: a query (SELECT) or a script transform (USING 'command').
_REFUSED_WORDS = frozenset({"select", "using"})
_WORD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


class SqlGuardError(ValueError):
    """An expression the rule refuses, or one it cannot read (unterminated literal...)."""


@dataclass(frozen=True)
class Token:
    """``kind``: word (bare, lower-cased), name (backticked, as written), string or punct."""

    kind: str
    text: str


def expression_problem(text: str) -> str | None:
    """Why the Spark SQL expression ``text`` may not run, or None when it may."""
    try:
        check_tokens(tokenize(text))
    except SqlGuardError as e:
        return str(e)
    return None


def check_tokens(tokens: list[Token]) -> None:
    """Raise SqlGuardError for a refused call, subquery, script transform or bad nesting."""
    depth = 0
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if tok.kind == "word" and tok.text in _REFUSED_WORDS:
            raise SqlGuardError(
                f"{tok.text.upper()} is not allowed: an expression reads only the batch (no "
                "subquery, no script); a column of that name is written in backticks"
            )
        if tok.kind in ("word", "name") and nxt == Token("punct", "("):
            name = tok.text.lower().rsplit(".", 1)[-1]
            if name in REFUSED_FUNCTIONS:
                raise SqlGuardError(
                    f"function {name}() is not allowed: it {REFUSED_FUNCTIONS[name]}"
                )
        if tok == Token("punct", "("):
            depth += 1
            if nxt is not None and nxt.kind == "word" and nxt.text in _QUERY_STARTS:
                raise SqlGuardError(
                    f"a subquery ('({nxt.text.upper()} ...') is not allowed: an expression "
                    "reads only the batch; a column of that name is written in backticks"
                )
        elif tok == Token("punct", ")"):
            depth -= 1
            if depth < 0:
                raise SqlGuardError("unbalanced parentheses: ')' without its '('")
    if depth:
        raise SqlGuardError("unbalanced parentheses: '(' without its ')'")


def tokenize(text: str) -> list[Token]:
    """Spark SQL tokens of ``text``, comments and whitespace dropped (SqlGuardError when a
    literal or comment is unterminated or a character is one Spark does not accept)."""
    out: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("--", i):
            i = _line_comment_end(text, i)
        elif text.startswith("/*", i):
            i = _block_comment_end(text, i)
        elif c in "'\"":
            raw = bool(out) and out[-1] in (Token("word", "r"),) and _adjacent(text, i)
            if raw:
                out.pop()
            hexa = bool(out) and out[-1] == Token("word", "x") and _adjacent(text, i)
            i, body = _string_end(text, i, raw=raw)
            if hexa and "\\" in body:
                raise SqlGuardError("a hex literal X'...' holds hex digits only")
            out.append(Token("string", body))
        elif c == "`":
            i, body = _quoted_end(text, i)
            out.append(Token("name", body))
        elif c in _WORD_CHARS:
            j = i
            while j < n and text[j] in _WORD_CHARS:
                j += 1
            out.append(Token("word", text[i:j].lower()))
            i = j
        elif " " <= c <= "~":
            out.append(Token("punct", c))
            i += 1
        else:
            raise SqlGuardError(f"unexpected character {c!r} outside a quoted literal")
    return out


def _adjacent(text: str, i: int) -> bool:
    """The word before position ``i`` ends right there (a literal's prefix, as r'...')."""
    return i > 0 and text[i - 1] in _WORD_CHARS


def _line_comment_end(text: str, i: int) -> int:
    """After a -- comment: Spark ends it at CR or LF, unless a backslash stands before LF."""
    n = len(text)
    j = i + 2
    while j < n:
        if text[j] == "\\" and j + 1 < n and text[j + 1] == "\n":
            j += 2
        elif text[j] in "\r\n":
            return j
        else:
            j += 1
    return n


def _block_comment_end(text: str, i: int) -> int:
    """After a /* */ comment; Spark nests them (/* /* */ */ is one comment)."""
    depth, j, n = 0, i, len(text)
    while j < n:
        if text.startswith("/*", j):
            depth += 1
            j += 2
        elif text.startswith("*/", j):
            depth -= 1
            j += 2
            if depth == 0:
                return j
        else:
            j += 1
    raise SqlGuardError("unterminated /* comment")


def _string_end(text: str, i: int, *, raw: bool) -> tuple[int, str]:
    """After the literal opened at ``i`` and its text. As in Spark's lexer: a backslash
    escapes the next character and a doubled quote stands for one, except in a raw
    literal, which ends at the next quote."""
    quote, j, n = text[i], i + 1, len(text)
    body: list[str] = []
    while j < n:
        c = text[j]
        if c == "\\" and not raw:
            if j + 1 >= n:
                break
            body.append(text[j : j + 2])
            j += 2
        elif c == quote:
            if not raw and j + 1 < n and text[j + 1] == quote:
                body.append(quote)
                j += 2
            else:
                return j + 1, "".join(body)
        else:
            body.append(c)
            j += 1
    raise SqlGuardError(f"unterminated {quote}...{quote} literal")


def _quoted_end(text: str, i: int) -> tuple[int, str]:
    """After the `name` opened at ``i`` and the name (a doubled backtick stands for one)."""
    j, n = i + 1, len(text)
    body: list[str] = []
    while j < n:
        if text[j] == "`":
            if j + 1 < n and text[j + 1] == "`":
                body.append("`")
                j += 2
                continue
            return j + 1, "".join(body)
        body.append(text[j])
        j += 1
    raise SqlGuardError("unterminated `name`")
