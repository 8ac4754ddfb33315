"""Ports on this host: is one open, which one is free, which process listens on one."""

from __future__ import annotations

import os
import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (any address).

    None when this cannot be known (no procfs): a port accepting connections is not proof
    that a process just started serves it, since a port picked free can be taken by
    another process before ours binds it.
    """
    inodes: set[str] = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    next(f)  # header
                    for line in f:
                        fields = line.split()
                        local, state, inode = fields[1], fields[3], fields[9]
                        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # LISTEN
                            inodes.add(inode)
            except FileNotFoundError:
                if table.endswith("6"):
                    continue  # no IPv6
                raise
        if not inodes:
            return False
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
        return False
    except FileNotFoundError:
        return None if not os.path.isdir("/proc/self") else False
    except (OSError, IndexError, ValueError):
        return None
