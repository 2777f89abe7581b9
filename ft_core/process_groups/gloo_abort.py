"""Gloo abort: shut down the sockets a Gloo backend opened, so a pending op and every peer's op fail at once.

torch 2.13's Gloo abort() neither wakes a pending op nor tells the peers; shutting the backend's
connected sockets down does both. The sockets are the fds that appeared while the backend was built.
"""

from __future__ import annotations

import os
import socket

__all__ = ["shutdown_sockets", "socket_inodes"]


def socket_inodes() -> dict[int, str]:
    """{fd: "socket:[inode]"} for this process's sockets (empty where /proc is not available)."""
    found: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(name)] = target
    return found


def shutdown_sockets(owned: dict[int, str]) -> int:
    """shutdown(2) each socket still open under the same fd and inode; returns how many.

    Only shutdown, never close: the fds stay owned by the backend, which closes them itself.
    """
    count = 0
    for fd, target in owned.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != target:
                continue  # closed (and maybe reused by someone else): not ours any more
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            # Leave listeners alone: Gloo's accept loop treats a shut-down listener as fatal.
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return count
