"""TCPStores a replica group serves itself (its own, and the rendezvous of its cross-group process group)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = ["own_store"]


def own_store(host: str, timeout: timedelta, bind: str | None = None) -> dist.TCPStore:
    """A TCPStore this process serves, reached at `host` and listening on `bind` only (default `host`;
    torch's own listener would take every interface). Other groups rendezvous in it."""
    bind = host if bind is None else bind
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((bind.strip("[]"), 0))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=sock.detach())  # the store owns the socket from here on
