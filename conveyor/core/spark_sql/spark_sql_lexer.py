"""Spark SQL text cut into tokens as Spark 4's lexer (``SqlBaseLexer.g4``) cuts it.

Only what the expression parser (``conveyor.core.spark_sql.spark_sql_parser``) reads is kept: words,
`backticked` names, string literals, numbers and operators; whitespace and comments are
dropped. Where Spark's lexer and a simpler reading could disagree, the text is refused
(``SqlSyntaxError``) rather than guessed:

- a block comment holding ``/*`` (Spark nests comments, except that ``/*+`` inside one opens
  no nested comment: the bypass of issue 45) and a hint (``/*+``) are refused, as is an
  unterminated comment or literal;
- outside literals and names only ASCII and the whitespace Spark skips may appear
  (``WHITESPACE``; Spark refuses other characters there too);
- a number run into letters (``1a``, ``1e``: a name for Spark) must be written `1a`.

String literals keep their text as written (``'it''s'``, ``r'\\d'``): the parser hands them
to Spark unchanged, so what a literal means is Spark's business, not a second reading here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The characters Spark's WS rule skips (checked against its lexer: U+0085, U+200B and the
# ASCII separators U+001C-U+001F are syntax errors there, though Python counts them as space).
WHITESPACE = frozenset(" \t\n\f\r\u000b\u00a0\u1680\u2028\u202f\u205f\u3000") | frozenset(
    chr(c) for c in range(0x2000, 0x200B)
)
WORD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
# Longest first: the lexer takes the longest operator that matches (Spark's does too).
OPERATORS = (
    "*/",  # a hint's end (HENT_END): a syntax error outside a hint, not '*' then '/'
    ">>>",
    "<=>",
    "<=",
    ">=",
    "<>",
    "!=",
    "==",
    "<<",
    ">>",
    "->",
    "=>",
    "::",
    "||",
    "|>",
    "!<",
    "!>",
    *"()[],.;:+-*/%~&|^<>=!?{}$@#",
)
# A number as Spark's lexer reads one: digits with an optional fraction and exponent, or a
# fraction alone (.5), and the suffixes of its typed literals (10L, 1.5BD, 2.0D...).
_NUMBER = re.compile(
    r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?(?:[bB][dD]|[lLsSyYdDfF])?"
)
_INTEGER_SUFFIX = re.compile(r"[0-9]+[lLsSyY]")


def words(text: str) -> frozenset[str]:
    """The words of ``text`` (a list of keywords or names written as prose)."""
    return frozenset(text.split())


class SqlSyntaxError(ValueError):
    """Text the lexer or parser cannot read as Spark would (or will not guess at)."""


@dataclass(frozen=True)
class Token:
    """``kind``: word (bare identifier, as written), name (`backticked`; ``text`` is the
    name, ``raw`` as written), string (``raw`` the literal as written, prefix included),
    number or op. ``spaced``: whitespace or a comment stands before it."""

    kind: str
    text: str
    raw: str
    pos: int
    spaced: bool

    def is_word(self, *words: str) -> bool:
        """A bare word, one of ``words`` (upper case), whatever case it is written in."""
        return self.kind == "word" and self.text.upper() in words

    def is_op(self, *ops: str) -> bool:
        return self.kind == "op" and self.text in ops


def tokenize(text: str) -> list[Token]:
    """The tokens of ``text`` (SqlSyntaxError for what Spark would not read, or where the
    module's rules refuse to guess)."""
    out: list[Token] = []
    i, n, spaced = 0, len(text), False
    while i < n:
        c = text[i]
        if c in WHITESPACE:
            i, spaced = i + 1, True
        elif text.startswith("--", i):
            i, spaced = _line_comment_end(text, i), True
        elif text.startswith("/*", i):
            i, spaced = _block_comment_end(text, i), True
        else:
            tok = _token(text, i, spaced)
            out.append(tok)
            i, spaced = i + len(tok.raw), False
    return out


def _token(text: str, i: int, spaced: bool) -> Token:
    c = text[i]
    if c in "'\"" or (c in "rR" and text[i + 1 : i + 2] in ("'", '"')):
        raw = _string_raw(text, i)
        return Token("string", raw, raw, i, spaced)
    if c == "`":
        raw, name = _backticked(text, i)
        return Token("name", name, raw, i, spaced)
    number = _NUMBER.match(text, i)
    if number:
        raw = number.group()
        end = number.end()
        if end < len(text) and text[end] in WORD_CHARS or _bad_suffix(raw):
            word = re.match(r"[0-9A-Za-z_.]+", text[i:])
            shown = word.group() if word else raw
            raise SqlSyntaxError(f"{shown!r}: a name that starts with a digit is written `{shown}`")
        return Token("number", raw, raw, i, spaced)
    if c in WORD_CHARS:
        j = i
        while j < len(text) and text[j] in WORD_CHARS:
            j += 1
        return Token("word", text[i:j], text[i:j], i, spaced)
    for op in OPERATORS:
        if text.startswith(op, i):
            return Token("op", op, op, i, spaced)
    raise SqlSyntaxError(f"unexpected character {c!r} outside a quoted literal or `name`")


def _bad_suffix(raw: str) -> bool:
    """A suffix that only whole numbers take (L, S, Y) after a fraction or an exponent."""
    return raw[-1] in "lLsSyY" and not _INTEGER_SUFFIX.fullmatch(raw)


def _line_comment_end(text: str, i: int) -> int:
    """After a -- comment: it ends at CR or LF, unless a backslash stands right before LF."""
    n, j = len(text), i + 2
    while j < n:
        if text[j] == "\\" and j + 1 < n and text[j + 1] == "\n":
            j += 2
        elif text[j] in "\r\n":
            return j
        else:
            j += 1
    return n


def _block_comment_end(text: str, i: int) -> int:
    """After a /* */ comment; one holding /* (nesting, which Spark reads its own way) and a
    hint /*+ are refused."""
    if text.startswith("/*+", i):
        raise SqlSyntaxError("a hint (/*+ ... */) is not allowed in an expression")
    for j in range(i + 2, len(text) - 1):
        if text.startswith("/*", j):  # before its end, as Spark's lexer reads it: nested
            raise SqlSyntaxError("a comment inside a /* comment */ is not allowed")
        if text.startswith("*/", j):
            return j + 2
    raise SqlSyntaxError("unterminated /* comment")


def _string_raw(text: str, i: int) -> str:
    """The literal opened at ``i`` as written. As in Spark's lexer: a backslash escapes the
    next character and a doubled quote stands for one, except in a raw literal (r'...'),
    which ends at its next quote."""
    raw = text[i] in "rR"
    start = i + 1 if raw else i
    quote, j, n = text[start], start + 1, len(text)
    while j < n:
        c = text[j]
        if c == "\\" and not raw:
            j += 2
        elif c == quote:
            if not raw and j + 1 < n and text[j + 1] == quote:
                j += 2
            else:
                return text[i : j + 1]
        else:
            j += 1
    raise SqlSyntaxError(f"unterminated {quote}...{quote} literal")


def _backticked(text: str, i: int) -> tuple[str, str]:
    """The `name` opened at ``i`` as written, and the name (a doubled backtick stands for one)."""
    j, n = i + 1, len(text)
    while j < n:
        if text[j] == "`":
            if j + 1 < n and text[j + 1] == "`":
                j += 2
                continue
            raw = text[i : j + 1]
            return raw, raw[1:-1].replace("``", "`")
        j += 1
    raise SqlSyntaxError("unterminated `name`")


def single_quoted(raw: str) -> str:
    """A string literal as written (``"..."``, ``'...'``, ``r"..."``) in single quotes, with
    the same meaning: Spark reads a double-quoted one as a name when
    ``spark.sql.ansi.doubleQuotedIdentifiers`` is on, a single-quoted one always as text."""
    prefix, body = ("r", raw[2:-1]) if raw[0] in "rR" else ("", raw[1:-1])
    if raw[len(prefix)] == "'":
        return raw
    if prefix:
        if "'" in body:
            raise SqlSyntaxError(f"{raw}: write a raw literal holding ' in single quotes")
        return f"r'{body}'"
    out, j = [], 0
    while j < len(body):
        c = body[j]
        if c == "\\":
            out.append(body[j : j + 2])
            j += 2
            continue
        if c == '"':  # the second of a doubled quote: one " in the value
            j += 1
        out.append("\\'" if c == "'" else c)
        j += 1
    return "'" + "".join(out) + "'"
