"""Spark's own SQL parser, for tests: ``SparkSqlParser`` from the pyspark wheel's jars, in a
JVM of its own (pyspark's ``launch_gateway``: the same jars the Spark Connect server runs).

``SparkParser.expression`` returns Spark's parse of an expression as the list of its tree's
nodes (``TreeNode.toJSON``, pre-order), with the per-parse ids of aliases taken out, so two
parses compare equal exactly when Spark built the same tree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_EXPR_ID = re.compile(r'"exprId":\{[^{}]*\},?')
_TREE_ID = re.compile(r"#\d+")
_JAVA_REF = re.compile(r"\[B@[0-9a-f]+")  # a byte array's toJSON is its identity


@dataclass(frozen=True)
class SparkParse:
    """Spark's tree of one expression: ``nodes`` (toJSON, ids out) and ``tree`` (treeString,
    which shows binary literals that toJSON does not)."""

    nodes: tuple[dict[str, Any], ...]
    tree: str

    @property
    def functions(self) -> list[str]:
        """The names of the functions the tree calls (``UnresolvedFunction.nameParts``)."""
        return [
            n["nameParts"].strip("[]")
            for n in self.nodes
            if n["class"].endswith(".UnresolvedFunction")
        ]

    @property
    def classes(self) -> set[str]:
        return {n["class"].rsplit(".", 1)[-1] for n in self.nodes}


class SparkParser:
    """A JVM with Spark's parser; ``close`` ends it."""

    def __init__(self) -> None:
        import subprocess
        from unittest import mock

        from pyspark import java_gateway

        def popen(cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
            # pyspark forks with a preexec_fn (SIGINT ignored in the JVM): a fork() of this
            # multi-threaded test process runs gRPC's fork handlers (a Spark Connect client of an
            # earlier test lives here), and the child can die before it starts the JVM (seen in
            # CI: "Java gateway process exited before sending its port number"). Without it,
            # Python starts the JVM by vfork and exec, running no fork handler; its own session
            # keeps a terminal's Ctrl-C from it as the preexec_fn did.
            kw.pop("preexec_fn", None)
            return subprocess.Popen(cmd, start_new_session=True, **kw)

        with mock.patch.object(java_gateway, "Popen", popen):
            self.gateway = java_gateway.launch_gateway()
        jvm = self.gateway.jvm
        self.jvm = jvm
        self.parser = jvm.org.apache.spark.sql.execution.SparkSqlParser()
        self.conf = jvm.org.apache.spark.sql.internal.SQLConf.get()

    def close(self) -> None:
        proc = self.gateway.proc
        self.gateway.shutdown()
        proc.stdin.close()  # the gateway JVM exits when its stdin closes
        proc.wait(timeout=30)

    def set_conf(self, key: str, value: str) -> None:
        self.conf.setConfString(key, value)

    def expression(self, text: str) -> SparkParse | None:
        """Spark's parse of ``text`` as a select item, or None when Spark refuses it."""
        from py4j.protocol import Py4JJavaError

        try:
            expr = self.parser.parseExpression(text)
        except Py4JJavaError:
            return None
        raw = _JAVA_REF.sub("", _EXPR_ID.sub("", expr.toJSON()))
        return SparkParse(tuple(json.loads(raw)), _TREE_ID.sub("", expr.treeString()))

    def table_schema(self, ddl: str) -> str | None:
        """Spark's reading of a DDL schema as ``from_json`` reads one (its JSON), or None."""
        from py4j.protocol import Py4JJavaError

        try:
            schema: str = self.jvm.org.apache.spark.sql.types.DataType.fromDDL(ddl).json()
        except Py4JJavaError:
            return None
        return schema

    def builtin_functions(self) -> list[tuple[str, str, str]]:
        """Spark's built-in functions: (name, group, implementing class)."""
        registry = self.jvm.org.apache.spark.sql.catalyst.analysis.FunctionRegistry.builtin()
        out = []
        it = registry.listFunction().iterator()
        while it.hasNext():
            fid = it.next()
            info = registry.lookupFunction(fid).get()
            out.append((fid.funcName(), info.getGroup(), info.getClassName()))
        return out

    def is_subclass(self, class_name: str, of: str) -> bool:
        cls = self.jvm.java.lang.Class
        return bool(cls.forName(of).isAssignableFrom(cls.forName(class_name)))
