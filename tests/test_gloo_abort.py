"""A Gloo abort shuts down the backend's own connections (so the peers' ops fail at once) and no other
socket: one another thread opened while the backend was being built (a lighthouse stream, a checkpoint
fetch) used to be in the fd diff and was shut down with them."""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch
from conftest import assert_bounded
from torch.distributed import TCPStore

from ft_core.process_groups import ProcessGroupGloo
from ft_core.process_groups.gloo_abort import rendezvous_connections, socket_inodes

TIMEOUT = timedelta(seconds=30)


@pytest.mark.timeout(60)
def test_an_abort_leaves_alone_a_socket_another_thread_opened_while_the_group_was_built():
    """Rank 0 waits 1 s for rank 1 at a real store; meanwhile another thread connects a plain TCP client.
    After rank 0's abort the client still carries bytes, and rank 1's next allreduce fails at once (its
    connection to rank 0 was shut down), not at the 30 s timeout."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(server.accept()[0]))
    acceptor.start()
    client: list[socket.socket] = []
    groups = [ProcessGroupGloo(timeout=TIMEOUT) for _ in range(2)]

    def rank(r: int) -> None:
        if r == 1:
            time.sleep(1.0)  # rank 0's construction is waiting for it meanwhile
        groups[r].configure(f"127.0.0.1:{store.port}/q1", f"g{r}", r, 2, quorum_id=1)

    def other_thread() -> None:
        time.sleep(0.3)
        client.append(socket.create_connection(server.getsockname(), timeout=5))

    threads = [threading.Thread(target=other_thread)] + [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        acceptor.join(5)
        assert client and accepted, "the unrelated connection was not made"
        works = [g.allreduce([torch.ones(2)]) for g in groups]
        for work in works:
            work.wait()
        groups[0].abort()
        started = time.monotonic()
        with pytest.raises(Exception):
            groups[1].allreduce([torch.ones(2)]).wait()
        assert_bounded(started, 10.0, "the peer's allreduce after the abort")  # not the 30 s timeout
        client[0].sendall(b"still here")
        accepted[0].settimeout(5)
        assert accepted[0].recv(16) == b"still here"
    finally:
        for g in groups:
            g.shutdown()
        for sock in client + accepted + [server]:
            sock.close()


def sockaddr_in6(address: str, port: int) -> bytes:
    """Linux's struct sockaddr_in6, as a rendezvous publishes it: family, port, flow info, address, scope."""
    return struct.pack("=H", socket.AF_INET6) + struct.pack("!H", port) + b"\0" * 4 + \
        socket.inet_pton(socket.AF_INET6, address) + b"\0" * 4


@pytest.mark.timeout(30)
def test_connections_are_told_by_an_address_the_rendezvous_exchanged_over_ipv4_and_ipv6():
    """Real sockets in /proc/self/net/tcp and tcp6: a connection to a published listener (its outgoing end),
    the one it accepted (its local end), and a connection to an unpublished server; only the first two count."""
    before = socket_inodes()
    published = socket.create_server(("::1", 0), family=socket.AF_INET6)
    other = socket.create_server(("127.0.0.1", 0))
    out = socket.create_connection(published.getsockname()[:2])
    inbound = published.accept()[0]
    stray = socket.create_connection(other.getsockname())
    stray_in = other.accept()[0]
    try:
        appeared = {fd: t for fd, t in socket_inodes().items() if before.get(fd) != t}
        exchanged = [b"prefix", sockaddr_in6("::1", published.getsockname()[1]) + b"\0" * 8]
        kept = rendezvous_connections(appeared, exchanged)
        assert {out.fileno(), inbound.fileno(), published.fileno()} <= set(kept)
        assert not {stray.fileno(), stray_in.fileno(), other.fileno()} & set(kept)
        assert rendezvous_connections(appeared, []) == appeared  # nothing recorded: the whole diff, as before
    finally:
        for sock in (published, other, out, inbound, stray, stray_in):
            sock.close()


@pytest.mark.timeout(60)
def test_a_collective_still_pending_after_the_abort_is_reported_with_what_the_abort_did(caplog, monkeypatch, capfd):
    """The stall seen once under load (a survivor's allreduce ran to its timeout after the notice aborted it)
    now says where it is: 1 s (SLOW_WAIT_S, 2 s by default) after the abort, a collective still pending is
    logged with what the abort shut down, and every thread's stack goes to stderr. Made here by a group whose
    abort has no connection to shut down (its peer never issues the op)."""
    import logging
    from types import SimpleNamespace

    from ft_core import redo

    monkeypatch.setattr(redo, "SLOW_WAIT_S", 1.0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    groups = [ProcessGroupGloo(timeout=timedelta(seconds=4)) for _ in range(2)]
    threads = [threading.Thread(target=groups[r].configure, args=(f"127.0.0.1:{store.port}/q1", f"g{r}", r, 2),
                                kwargs={"quorum_id": 1}) for r in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        pending = groups[0].allreduce([torch.ones(4)]).get_future()  # rank 1 never issues it
        groups[0]._owned_sockets = {}  # the stall's state: the abort finds nothing of its group to shut down
        caplog.set_level(logging.WARNING, logger="ft_core.redo")
        redo._watch_abort(SimpleNamespace(_pg=groups[0], _prefix=lambda: "[g0]"), [pending])  # as on_peer_lost
        groups[0].abort()  # Gloo's own abort then returns only when the op times out (4 s)
        with pytest.raises(Exception):
            pending.wait()
        warned = [r.getMessage() for r in caplog.records if "still pending" in r.getMessage()]
        assert warned and "shut down 0 of the 0 socket(s) its group opened" in warned[0], warned
        assert "Thread 0x" in capfd.readouterr().err  # faulthandler's dump of every thread
    finally:
        for g in groups:
            g.shutdown()
