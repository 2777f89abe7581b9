"""PeerLost notices fanned out from group rank 0 to the other ranks of its replica group.

The lighthouse pushes PeerLost on each member's heartbeat stream, and a group's stream belongs to its
manager server on group rank 0. Every rank holds its own cross-group process group, so every rank must
abort its in-flight collective when a peer of the quorum is lost, not only rank 0 (else ranks > 0 wait
for the collective timeout and the group's commit barrier with them). The server publishes each notice
to a `NoticeHub`; each rank > 0 keeps a `NoticeSubscription` (ManagerService.PeerLostNotices, a server
stream renewed before its deadline) and calls its listeners with the same (quorum_id, replica_id).
Notices are numbered, and the hub keeps the recent ones, so a rank that resubscribes after a broken
stream (or subscribes after a notice) gets what it missed; a stale notice is harmless (a Manager acts
only on its current quorum, ft_core.redo.on_peer_lost).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from ft_core.control.proto import ft_pb2
from ft_core.control.rpc import auth_metadata, backoff_delays, map_rpc_error

__all__ = ["Notice", "NoticeHub", "NoticeSubscription"]

logger = logging.getLogger(__name__)

BACKLOG = 64  # notices a hub keeps for a rank that resubscribes
RENEW_S = 60.0  # a subscription's deadline; it is renewed at once (with the last number seen) when it ends
WARN_AFTER_S = 10.0  # a subscription down this long is logged as a warning (ranks > 0 then fail only at timeouts)
JOIN_S = 2.0  # longest close() waits for the subscription's thread
_FATAL = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)
_CLOSED = object()  # queued by NoticeHub.close(): the subscription ends


@dataclass(frozen=True)
class Notice:
    seq: int
    quorum_id: int
    replica_id: str


class NoticeHub:
    """The notices of one manager server: `publish` from any thread, `subscribe` on the server's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, backlog: int = BACKLOG) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._seq = 0
        self._recent: collections.deque[Notice] = collections.deque(maxlen=backlog)
        self._queues: set[asyncio.Queue] = set()
        self._closed = False

    def publish(self, quorum_id: int, replica_id: str) -> None:
        """A PeerLost listener (ManagerServer registers it on its heartbeat stream): forward to every subscriber."""
        with self._lock:
            self._seq += 1
            notice = Notice(self._seq, quorum_id, replica_id)
            self._recent.append(notice)
            queues = list(self._queues)
        for queue in queues:
            self._put(queue, notice)

    def _put(self, queue: asyncio.Queue, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone, and its subscribers with it
            pass

    def subscribe(self, after_seq: int) -> _Subscriber:
        """On the loop: a subscriber, registered now, that first yields the kept notices numbered above
        `after_seq` (all of them when `after_seq` is from an earlier server, above our latest number)."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._closed:
                queue.put_nowait(_CLOSED)
            else:
                self._queues.add(queue)
            start = after_seq if after_seq <= self._seq else 0
            for notice in self._recent:
                if notice.seq > start:
                    queue.put_nowait(notice)
        return _Subscriber(self, queue, start)

    def _drop(self, queue: asyncio.Queue) -> None:
        with self._lock:
            self._queues.discard(queue)

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._queues)

    def close(self) -> None:
        """End every subscription (the server is shutting down). Idempotent."""
        with self._lock:
            self._closed = True
            queues, self._queues = list(self._queues), set()
        for queue in queues:
            self._put(queue, _CLOSED)


class _Subscriber:
    """One subscription's notices, in order, without repeats; ends when the hub closes."""

    def __init__(self, hub: NoticeHub, queue: asyncio.Queue, after_seq: int) -> None:
        self._hub, self._queue, self._last = hub, queue, after_seq

    def __aiter__(self) -> _Subscriber:
        return self

    async def __anext__(self) -> Notice:
        while True:
            item = await self._queue.get()
            if item is _CLOSED:
                raise StopAsyncIteration
            if item.seq > self._last:  # a notice both replayed and queued comes once
                self._last = item.seq
                return item

    def close(self) -> None:
        self._hub._drop(self._queue)


def to_pb(notice: Notice) -> ft_pb2.PeerLostNotice:
    return ft_pb2.PeerLostNotice(seq=notice.seq, peer_lost=ft_pb2.PeerLost(
        quorum_id=notice.quorum_id, replica_id=notice.replica_id,
        reason="forwarded by group rank 0's manager server"))


class NoticeSubscription:
    """A rank > 0's subscription to its group's manager server, on a named thread: calls each listener with
    (quorum_id, lost_replica_id) for every notice, as the server's own listeners are called. Resubscribes
    when the stream ends (at once after its deadline, else with capped backoff); `close()` ends it.
    `listeners` are registered before the thread starts, so they get the server's kept notices too (a
    listener added later gets the notices that arrive after it)."""

    def __init__(self, stub: Any, addr: str, token: str | None, renew_s: float = RENEW_S,
                 listeners: tuple[Callable[[int, str], None], ...] = ()) -> None:
        self._stub, self._addr, self._token, self._renew_s = stub, addr, token, renew_s
        self._lock = threading.Lock()
        self._listeners: list[Callable[[int, str], None]] = list(listeners)
        self._call: Any = None
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._last_seq = 0
        self._thread = threading.Thread(target=self._run, name=f"ft-notices[{addr}]", daemon=True)
        self._thread.start()

    def add_listener(self, listener: Callable[[int, str], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def wait_subscribed(self, timeout: float) -> bool:
        """True once the server has registered this subscription (notices from then on reach the listeners)."""
        return self._subscribed.wait(timeout)

    def _run(self) -> None:
        delays = backoff_delays(initial=0.1, cap=2.0)
        down_since: float | None = None
        warned = False
        while not self._stop.is_set():
            error: Exception | None = None
            try:
                self._listen()
                renewal = False  # the server ended the stream: it is shutting down
            except grpc.RpcError as err:
                if self._stop.is_set():
                    break
                code = err.code() if hasattr(err, "code") else None
                renewal = code is grpc.StatusCode.DEADLINE_EXCEEDED and self._subscribed.is_set()
                error = map_rpc_error(err, peer=f"manager server {self._addr}", call="PeerLostNotices")
                if code in _FATAL:
                    fix = ("run the same ft-lightning version on every rank" if code is grpc.StatusCode.UNIMPLEMENTED
                           else "set the same FT_TOKEN on every rank")
                    logger.error("PeerLost fan-out from manager server %s refused (%s): this rank's collectives fail "
                                 "only at their timeout when a peer group is lost; %s", self._addr, error, fix)
                    return
            was_up = self._subscribed.is_set()
            self._subscribed.clear()
            if self._stop.is_set():
                break
            if renewal:
                down_since = None
                continue
            now = time.monotonic()
            if was_up:
                delays = backoff_delays(initial=0.1, cap=2.0)
                logger.info("PeerLost subscription to manager server %s ended (%s); resubscribing", self._addr,
                            error or "the server closed it")
            if was_up or down_since is None:
                down_since, warned = now, False
            if not warned and now - down_since > WARN_AFTER_S:
                warned = True
                logger.warning("PeerLost subscription to manager server %s down for %.0f s (%s): until it is back "
                               "this rank's collectives fail only at their timeout when a peer group is lost",
                               self._addr, now - down_since, error or "the server closed it")
            self._stop.wait(next(delays))

    def _listen(self) -> None:
        """One subscription until its deadline, the server's end, or close()."""
        call = self._stub.PeerLostNotices(ft_pb2.PeerLostNoticesRequest(after_seq=self._last_seq),
                                          timeout=self._renew_s, metadata=auth_metadata(self._token))
        with self._lock:
            self._call = call
        if self._stop.is_set():
            call.cancel()
        try:
            call.initial_metadata()  # the server sends it once the subscription is registered
            if call.is_active():
                self._subscribed.set()
            for message in call:
                self._last_seq = max(self._last_seq, message.seq)
                self._deliver(message.peer_lost.quorum_id, message.peer_lost.replica_id)
        finally:
            with self._lock:
                self._call = None

    def _deliver(self, quorum_id: int, replica_id: str) -> None:
        logger.info("replica %s of quorum %d lost (forwarded by manager server %s)", replica_id, quorum_id, self._addr,
                    extra={"replica_id": replica_id, "quorum_id": quorum_id, "event": "peer_lost"})
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(quorum_id, replica_id)
            except Exception:  # one listener's bug must not end the subscription; record it
                logger.exception("peer-lost listener %r failed", listener)

    def close(self) -> None:
        """Cancel the stream and join the thread (bounded). Idempotent."""
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_S)
            if self._thread.is_alive():
                logger.warning("PeerLost subscription thread for %s did not end within %.1f s", self._addr, JOIN_S)
