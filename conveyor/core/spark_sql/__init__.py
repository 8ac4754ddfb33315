"""The Spark SQL a spec may hold: Spark 4's lexer and expression parser, the function allowlist and the guard that gives Spark its text."""
