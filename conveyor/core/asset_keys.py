"""Asset key parts: the one rule that turns a topic, table or path into a Dagster key part."""

from __future__ import annotations

import re

_NOT_KEY_CHAR = re.compile(r"[^A-Za-z0-9_]")


def key_part(text: str, empty: str = "") -> str:
    """``text`` with every character Dagster refuses in an asset key part replaced by ``_``.

    ``empty`` is returned when nothing is left (callers that need a non-empty part pass one).
    """
    return _NOT_KEY_CHAR.sub("_", text) or empty
