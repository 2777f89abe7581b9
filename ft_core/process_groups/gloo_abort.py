"""Gloo abort: shut down the sockets a Gloo backend opened, so a pending op and every peer's op fail at once.

torch 2.13's Gloo abort() neither wakes a pending op nor tells the peers; shutting the backend's
connected sockets down does both. The backend's sockets are those that appeared while it was built
(an fd diff) and, of those, the connections with an end at an address its rendezvous exchanged: a
socket another thread opened meanwhile (a lighthouse stream, a checkpoint fetch) is left alone.
"""

from __future__ import annotations

import os
import socket
import struct

__all__ = ["rendezvous_connections", "shutdown_sockets", "socket_inodes"]

Endpoint = tuple[bytes, int]  # (packed IP address, port)


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


def rendezvous_connections(owned: dict[int, str], exchanged: list[bytes]) -> dict[int, str]:
    """The sockets of `owned` whose local or remote end is an address found in `exchanged` (the values the
    backend's rendezvous set and got: Gloo publishes each rank's listener there as a sockaddr, whose port
    and address bytes lie side by side). `owned` itself when nothing was recorded or /proc cannot say."""
    endpoints = tcp_endpoints()
    if not exchanged or not endpoints:
        return owned
    blob = (b"\xff" * 24).join(exchanged)
    return {fd: target for fd, target in owned.items()
            if any(_published(end, blob) for end in endpoints.get(target, ()))}


def tcp_endpoints() -> dict[str, tuple[Endpoint, Endpoint]]:
    """{"socket:[inode]": (local, remote)} for this network namespace's TCP sockets (/proc/self/net/tcp, tcp6)."""
    found: dict[str, tuple[Endpoint, Endpoint]] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{table}") as rows:
                lines = rows.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9:
                found[f"socket:[{fields[9]}]"] = (_endpoint(fields[1]), _endpoint(fields[2]))
    return found


def _endpoint(text: str) -> Endpoint:
    """"0100007F:8E2D" (the address as 32-bit words in host order, the port in hex) as (packed IP, port)."""
    address, port = text.split(":")
    words = bytes.fromhex(address)
    packed = b"".join(struct.pack("=I", int.from_bytes(words[i:i + 4], "big")) for i in range(0, len(words), 4))
    return packed, int(port, 16)


def _published(end: Endpoint, blob: bytes) -> bool:
    """Whether `blob` holds this endpoint as a sockaddr_in (port, then address) or sockaddr_in6 (port,
    4 bytes of flow info, then address); an IPv4-mapped IPv6 end is looked for as IPv4 too."""
    packed, port = end
    if port == 0:
        return False
    port_bytes = struct.pack("!H", port)
    if len(packed) == 16 and packed[:12] == b"\0" * 10 + b"\xff\xff":
        packed = packed[12:]
    if len(packed) == 4:
        return port_bytes + packed in blob
    at = blob.find(packed)
    while at >= 6:
        if blob[at - 6:at - 4] == port_bytes:
            return True
        at = blob.find(packed, at + 1)
    return False
