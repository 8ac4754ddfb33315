"""Where Conveyor keeps its state: ``$CONVEYOR_HOME`` (the meta store's SQLite file, dead
letters, connector specs and the secrets directory by default)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = ".conveyor"


def conveyor_home() -> Path:
    """``$CONVEYOR_HOME`` (default ``.conveyor`` in the working directory), absolute."""
    return Path(os.environ.get("CONVEYOR_HOME", DEFAULT_HOME)).resolve()
