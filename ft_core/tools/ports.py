"""Ports for servers that bind seconds after the port was chosen (a group's rank 0 after its imports, a
restarted lighthouse)."""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A loopback port free now, for a server that binds it seconds later (a group's rank 0 after its imports, a
    restarted lighthouse): one the OS confirms free, below the range it hands to outgoing connections, so none
    of the machine's connections can take it meanwhile. The OS's own pick (port 0) lies in that range: under
    load a chaos run's connection took one, and the group died with EADDRINUSE. That pick is the fallback when
    the range cannot be read or nothing below it is free."""
    low = _ephemeral_start()
    pick = random.SystemRandom()  # not the seeded module state: parallel test workers would draw the same ports
    candidates = [pick.randrange(max(1024, low - 12288), low) for _ in range(64)] if low > 2048 else []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _ephemeral_start() -> int:
    """The first port of the OS's range for outgoing connections (Linux), else 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
