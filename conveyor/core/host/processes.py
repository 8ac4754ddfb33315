"""Processes on this host: is one alive (not a zombie awaiting its parent), its parent and
children, and which ones belong to a directory (what ``conveyor dev`` leaves nothing of)."""

from __future__ import annotations

import os
from pathlib import Path


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


def _proc(pid: int, name: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return None


def cmdline(pid: int) -> list[str]:
    """A process's arguments ([] when gone or not readable)."""
    raw = _proc(pid, "cmdline") or b""
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def parent_of(pid: int) -> int | None:
    """A process's parent pid (None when gone)."""
    raw = _proc(pid, "stat")
    if raw is None:
        return None
    try:
        return int(raw.rsplit(b")", 1)[1].split()[1])
    except (IndexError, ValueError):
        return None


def _pids() -> list[int]:
    try:
        return [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def children_of(pid: int) -> list[int]:
    """The direct children of a process."""
    return [p for p in _pids() if parent_of(p) == pid]


def ancestors_of(pid: int) -> set[int]:
    """A process and its ancestors up to init."""
    out: set[int] = set()
    while pid > 0 and pid not in out:
        out.add(pid)
        pid = parent_of(pid) or 0
    return out


def _under(text: str, home: str) -> bool:
    """``text`` is ``home`` or a path under it, alone or as the value of ``--option=``."""
    value = text.split("=", 1)[1] if text.startswith("-") and "=" in text else text
    return value == home or value.startswith(home + os.sep)


def holds(pid: int, home: Path) -> bool:
    """Whether a process belongs to the directory ``home``: Conveyor's or Dagster's home in its
    environment points there, or an argument names it or a path under it."""
    h = str(home)
    env = (_proc(pid, "environ") or b"").split(b"\0")
    for var in (b"CONVEYOR_HOME=", b"DAGSTER_HOME="):
        for entry in env:
            if entry.startswith(var) and _under(entry[len(var) :].decode(errors="replace"), h):
                return True
    return any(_under(a, h) for a in cmdline(pid))


def processes_holding(home: Path) -> list[int]:
    """The live processes of this host that ``holds`` says belong to ``home`` (absolute), this
    process and its ancestors left out."""
    mine = ancestors_of(os.getpid())
    return [p for p in _pids() if p not in mine and holds(p, home) and pid_alive(p)]
