"""Processes on this host: is one alive (not a zombie awaiting its parent)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie awaiting its parent."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True  # no procfs: trust kill(0)
