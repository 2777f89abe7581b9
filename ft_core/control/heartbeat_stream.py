"""A replica's long-lived HeartbeatStream to the lighthouse, on grpc.aio.

Every stream of a process runs on one event loop thread ("ftl-heartbeat-streams"), so a process with
many members (a benchmark, a launcher) costs one thread, not two per member, and a quorum request sent
on the stream costs one hop from the caller's thread to the loop and one back: the loop writes the
request, reads the answer and wakes the caller. Heartbeats go out on a timer of the loop, a quorum
request counting as one. The thread starts with the first stream or manager server that holds the
loop and ends with the last one's `stop()`/`shutdown()`.

While the stream is open the lighthouse counts the replica alive; when this process dies the
connection drops and the lighthouse drops the replica at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc

from ft_core.control import frames
from ft_core.control.frames_stream import GOODBYE, DirectOutbox, FrameStreamCall, QueuedOutbox
from ft_core.control.job_end import FINISHED_CODE, job_finished_error
from ft_core.control.proto import ft_pb2
from ft_core.control.rpc import CHANNEL_OPTIONS, auth_metadata, backoff_delays, channel_credentials, map_rpc_error, seconds, tls_config
from ft_core.control.types import Quorum, QuorumMember
from ft_core.errors import FTTimeoutError, RPCError
from ft_core.net import normalize_address, split_host_port

logger = logging.getLogger("ft_core.control.lighthouse_client")

__all__ = ["HeartbeatStreamHandle", "StreamUnavailable", "release_stream_loop", "stream_loop"]

# Reconnect quickly after a lighthouse restart instead of grpc's default 1 s .. 120 s backoff.
CLIENT_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
CONNECT_ATTEMPT_S = 1.0  # longest single connection attempt before trying the next address
CLEAN_CLOSE_S = 1.0  # longest stop() waits for the lighthouse to end a half-closed stream (a clean exit)
HEADERS_WAIT_S = 1.0  # longest a new stream waits for the lighthouse's headers before writing anyway
LATE_S = 1.0  # a heartbeat timer this late means the stream loop itself stalled: no silence is judged at that beat
LOOP_STOP_S = 2.0  # longest the stream loop's last tasks get to end once its last holder released it
_METHOD = "/ftl.LighthouseService/HeartbeatStream"
_HEARTBEAT = "/ftl.LighthouseService/Heartbeat"


class StreamUnavailable(RPCError):
    """The heartbeat stream could not carry a quorum request (not open, or it ended before the answer):
    the caller falls back to a unary Quorum call."""


class _StreamPoll:
    """A quorum request sent on the heartbeat stream, waiting for the answer with its request_id."""

    __slots__ = ("done", "settled", "future", "response", "outbox")

    def __init__(self, future: asyncio.Future | None = None) -> None:
        # quorum() waits on a thread Event; quorum_async (on the loop) on `future`, and needs no Event
        self.done = threading.Event() if future is None else None
        self.settled = False
        self.future = future
        self.response: ft_pb2.LighthouseHeartbeatResponse | None = None  # None: the stream ended first
        self.outbox: asyncio.Queue | None = None  # the stream it was sent on

    def settle(self) -> None:
        self.settled = True
        if self.done is not None:
            self.done.set()
        if self.future is not None and not self.future.done():
            self.future.set_result(None)


def _expire(future: asyncio.Future) -> None:
    """A stream poll's deadline passed: wake its coroutine, which finds the poll unsettled."""
    if not future.done():
        future.set_result(None)


def stream_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for heartbeat streams (and the manager servers' gRPC), started on first use.
    Each call holds the loop until a matching `release_stream_loop()`; the last release ends its thread."""
    return _StreamLoop.acquire()


def release_stream_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Give back a hold on `loop` taken by `stream_loop()`; the last one stops it and joins its thread (bounded)."""
    _StreamLoop.release(loop)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class _StreamLoop:
    """The process's event loop thread for heartbeat streams: started by the first hold, ended by the last."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _holds = 0

    @classmethod
    def acquire(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._thread is None or not cls._thread.is_alive():  # none yet, or forked
                loop = asyncio.new_event_loop()
                cls._thread = threading.Thread(target=cls._run, args=(loop,), name="ftl-heartbeat-streams",
                                               daemon=True)
                cls._thread.start()
                cls._loop, cls._holds = loop, 0
            cls._holds += 1
            return cls._loop

    @classmethod
    def release(cls, loop: asyncio.AbstractEventLoop) -> None:
        with cls._lock:
            if loop is not cls._loop or cls._thread is None:
                return  # a loop already ended, or one of the parent process (forked)
            cls._holds -= 1
            if cls._holds > 0:
                return
            thread = cls._thread
            cls._loop = cls._thread = None
        loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(LOOP_STOP_S + 1.0)
            if thread.is_alive():
                logger.warning("the heartbeat stream loop did not stop within %.1f s", LOOP_STOP_S + 1.0)

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:  # tasks still running (a stream stopped from its own listener) end before the loop closes
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=LOOP_STOP_S))
            loop.close()


def _aio_channel(addr: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
    """A grpc.aio channel to `addr` (TLS as FT_TLS_CA/FT_TLS_CERT say, as rpc.open_channel does)."""
    target = normalize_address(addr)
    roots = tls_config().client_roots
    if roots:
        return grpc.aio.secure_channel(target, channel_credentials(roots), options=options)
    return grpc.aio.insecure_channel(target, options=options)


class HeartbeatStreamHandle:
    """One HeartbeatStream kept open on the process's stream loop; reconnects and fails over when it breaks.

    `.stop()` half-closes the stream (the lighthouse logs a clean exit), cancels it if the lighthouse does
    not end it promptly, and waits for the stream's task. PeerLost notices the lighthouse pushes on the
    stream go to the listeners added with `add_peer_lost_listener`, called on the loop's thread.
    """

    def __init__(self, client: Any, replica_id: str, interval_s: float) -> None:
        self.replica_id = replica_id
        self._client = client  # the LighthouseClient: addresses in failover order, token, channel options
        self._interval_s = max(interval_s, 0.001)
        self._stale_after_s = max(20 * self._interval_s, 3.0)  # no answer this long: reconnect
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._connected = threading.Event()
        self._listeners: list[Callable[[int, str], None]] = []
        self._outbox: asyncio.Queue | None = None  # what the open stream's writer sends (guarded by _lock)
        self._polls: dict[int, _StreamPoll] = {}  # quorum requests of the open stream (guarded by _lock)
        self._answered_id = 0  # highest quorum id the open stream's lighthouse answered (guarded by _lock)
        self._request_ids = itertools.count(1)
        self._loop = _StreamLoop.acquire()  # given back by stop()
        self._holds_loop = True
        self._channels: dict[str, grpc.aio.Channel] = {}  # used on the loop only
        self._frames_ports: dict[str, int] = {}  # lighthouse address -> its frames port, 0: none (on the loop only)
        self._stopped: asyncio.Event | None = None  # the loop's view of _stop (made on the loop)
        self._task: concurrent.futures.Future | None = None
        self._redirected = False  # the last stream was turned away by a standing-by lighthouse (lighthouse_peers)
        self.last_error: Exception | None = None

    def _start(self) -> None:
        self._task = asyncio.run_coroutine_threadsafe(self._run(), self._loop)

    @property
    def connected(self) -> bool:
        """True while a stream is open and the lighthouse has answered on it."""
        return self._connected.is_set()

    def wait_connected(self, timeout: timedelta | float) -> bool:
        return self._connected.wait(seconds(timeout))

    def add_peer_lost_listener(self, listener: Callable[[int, str], None]) -> None:
        """Call `listener(quorum_id, lost_replica_id)` for each PeerLost notice (on the stream loop's thread:
        keep it short and non-blocking)."""
        with self._lock:
            self._listeners.append(listener)

    def _peer_lost(self, notice: ft_pb2.PeerLost) -> None:
        logger.info("lighthouse: replica %s of quorum %d lost (%s)", notice.replica_id, notice.quorum_id,
                    notice.reason, extra={"replica_id": notice.replica_id, "quorum_id": notice.quorum_id,
                                          "event": "peer_lost"})
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(notice.quorum_id, notice.replica_id)
            except Exception:  # one listener's bug must not end the heartbeats; record it
                logger.exception("peer-lost listener %r failed", listener)

    # -- the stream, on the loop ------------------------------------------------------------------

    async def _run(self) -> None:
        self._stopped = asyncio.Event()
        if self._stop.is_set():
            self._stopped.set()
        delays = backoff_delays(initial=0.05, cap=1.0, jitter=0.05)
        failures = 0
        try:
            while not self._stop.is_set():
                addrs = self._client._order()
                addr = addrs[failures % len(addrs)]
                try:
                    answered = await self._stream_once(addr)
                except Exception as exc:  # keep heartbeating through anything; record it
                    logger.exception("heartbeat stream of %s to %s failed", self.replica_id, addr)
                    self.last_error = exc
                    answered = False
                if self._stop.is_set():
                    break
                if self._redirected:  # the client now prefers the active lighthouse: try it first (after a backoff)
                    self._redirected, failures = False, 0
                elif answered:
                    failures = 0
                    delays = backoff_delays(initial=0.05, cap=1.0, jitter=0.05)
                else:
                    failures += 1
                try:
                    await asyncio.wait_for(self._stopped.wait(), next(delays))
                except asyncio.TimeoutError:
                    pass
        finally:
            channels, self._channels = list(self._channels.values()), {}
            for channel in channels:
                await channel.close(None)

    async def _drop_channel(self, addr: str) -> None:
        channel = self._channels.pop(addr, None)
        if channel is not None:
            await channel.close(None)

    async def _ready_channel(self, addr: str) -> grpc.aio.Channel | None:
        """The gRPC channel to `addr` once connected (None, with last_error set, if not within CONNECT_ATTEMPT_S)."""
        channel = self._channels.get(addr)
        if channel is None:
            channel = self._channels[addr] = _aio_channel(addr, CLIENT_CHANNEL_OPTIONS)
        try:
            await asyncio.wait_for(channel.channel_ready(), CONNECT_ATTEMPT_S)
        except asyncio.TimeoutError:
            self.last_error = RPCError(f"HeartbeatStream: could not connect to lighthouse {addr}", peer=addr,
                                       call="LighthouseService.HeartbeatStream", code="UNAVAILABLE")
            await self._drop_channel(addr)
            return None
        return channel

    async def _frames_port(self, addr: str) -> int | None:
        """The port where `addr` serves the stream on the frames wire, asked once per lighthouse (0: none, or
        FT_FRAMES=0; None: `addr` cannot be reached now). The asking channel is closed after: no idle
        HTTP/2 connection is kept beside the stream."""
        if not frames.enabled():
            return 0
        if addr not in self._frames_ports:
            channel = await self._ready_channel(addr)
            if channel is None:
                return None
            ask = ft_pb2.LighthouseHeartbeatRequest(replica_id=self.replica_id, want_frames_port=True)
            try:
                answer = await channel.unary_unary(_HEARTBEAT, request_serializer=None,
                                                   response_deserializer=ft_pb2.LighthouseHeartbeatResponse.FromString)(
                    ask.SerializeToString(), timeout=CONNECT_ATTEMPT_S, metadata=auth_metadata(self._client._token))
                self._frames_ports[addr] = answer.frames_port
            except grpc.RpcError:  # a wrong token, say: the gRPC stream below reports it as it always did
                self._frames_ports[addr] = 0
            if self._frames_ports[addr]:
                await self._drop_channel(addr)
        return self._frames_ports[addr]

    async def _open_call(self, addr: str) -> Any:
        """A HeartbeatStream call to `addr`: on the lighthouse's frames port when it serves one, else gRPC.
        None when `addr` cannot be reached within CONNECT_ATTEMPT_S (last_error says why)."""
        port = await self._frames_port(addr)
        if port is None or self._stop.is_set():
            return None
        if port:
            try:
                return await FrameStreamCall.open(split_host_port(addr, "lighthouse address")[0], port,
                                                  "HeartbeatStream", self._client._token,
                                                  ft_pb2.LighthouseHeartbeatResponse.FromString, CONNECT_ATTEMPT_S)
            except (OSError, asyncio.TimeoutError) as exc:  # a firewall between, say: keep to gRPC for this lighthouse
                logger.warning("lighthouse %s: its frames port %d cannot be reached (%s); the heartbeat stream of %s "
                               "uses gRPC (open FT_LIGHTHOUSE_FRAMES_PORT too, or set FT_FRAMES=0)", addr, port,
                               exc or "timed out", self.replica_id)
                self._frames_ports[addr] = 0
        channel = await self._ready_channel(addr)
        if channel is None or self._stop.is_set():
            return None
        return channel.stream_stream(_METHOD, request_serializer=None,
                                     response_deserializer=ft_pb2.LighthouseHeartbeatResponse.FromString)(
            metadata=auth_metadata(self._client._token))

    async def _stream_once(self, addr: str) -> bool:
        """Hold one stream to `addr` until it breaks; True when the lighthouse answered at least once."""
        call = await self._open_call(addr)
        if call is None:
            return False
        if self._stop.is_set():
            call.cancel()
            return False
        loop = asyncio.get_running_loop()
        request = ft_pb2.LighthouseHeartbeatRequest(replica_id=self.replica_id).SerializeToString()
        goodbye = ft_pb2.LighthouseHeartbeatRequest(replica_id=self.replica_id, leaving=True).SerializeToString()
        # frames: written as queued (no writer task, no turn of the loop); gRPC: a writer task drains a queue
        outbox: Any = DirectOutbox(call, goodbye, loop) if isinstance(call, FrameStreamCall) else QueuedOutbox(loop)
        # the oldest heartbeat sent since the last answer: a stall of this loop sends none, so no silence is read
        unanswered_since: float | None = loop.time()
        outbox.put_nowait(request)

        def beat() -> None:
            nonlocal timer, unanswered_since
            now = loop.time()
            late = now - timer.when() > LATE_S  # this loop stalled: answers may wait unread behind this call
            if unanswered_since is not None and now - unanswered_since > self._stale_after_s and not late:
                logger.warning("lighthouse %s stopped answering %s's heartbeats; reconnecting", addr, self.replica_id)
                call.cancel()
                return
            due = outbox.last_write + self._interval_s
            if now >= due:
                outbox.put_nowait(request)
                unanswered_since = now if unanswered_since is None else unanswered_since
                due = now + self._interval_s
            timer = loop.call_later(due - now, beat)

        with self._lock:
            self._call = call
            self._outbox = outbox
            self._answered_id = 0  # maybe another lighthouse, or the same one restarted: it knows no quorum of ours
        if self._stop.is_set():
            outbox.put_nowait(GOODBYE)
        timer = loop.call_later(self._interval_s, beat)
        answered = False
        writer: asyncio.Task | None = None
        try:
            try:  # the lighthouse sends its headers at once, or rejects the call (token): writes start after
                await asyncio.wait_for(call.initial_metadata(), HEADERS_WAIT_S)
            except asyncio.TimeoutError:
                pass  # an older lighthouse sends them with its first answer: write anyway
            def handle(response: ft_pb2.LighthouseHeartbeatResponse) -> None:
                nonlocal unanswered_since, answered
                unanswered_since = None
                if response.request_id:
                    with self._lock:
                        poll = self._polls.pop(response.request_id, None)
                    if poll is not None:
                        poll.response = response
                        poll.settle()
                if response.HasField("peer_lost"):
                    self._peer_lost(response.peer_lost)
                if not answered:
                    answered = True
                    self._connected.set()
                    if self.last_error is not None:
                        logger.info("heartbeat stream of %s to %s is back", self.replica_id, addr)
                    self.last_error = None

            if isinstance(outbox, QueuedOutbox):
                writer = loop.create_task(outbox.drain(call, goodbye))
            else:  # frames: each answer is handled as its bytes are read, no turn of the loop to this task
                call.on_message(handle)
            while True:
                try:
                    response = await call.read()
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                        raise  # the task itself is cancelled (the process is going down)
                    break  # the call was cancelled: stale, or stop() did not get a clean close in time
                if response is grpc.aio.EOF:
                    break
                handle(response)
        except grpc.RpcError as err:
            if not self._stop.is_set():
                error = map_rpc_error(err, peer=addr, call="LighthouseService.HeartbeatStream")
                follow = getattr(self._client, "follow_redirect", None)  # a standing-by lighthouse names the active one
                self._redirected = (getattr(error, "code", "") == "UNAVAILABLE" and follow is not None
                                    and follow(addr, err.details() or "") is not None)
                if self._redirected:
                    logger.info("heartbeat stream of %s turned away by %s: %s", self.replica_id, addr, err.details())
                elif answered or self.last_error is None:
                    logger.warning("heartbeat stream of %s broke: %s", self.replica_id, error)
                self.last_error = error
                if getattr(error, "code", "") == "UNAVAILABLE" and not self._redirected:
                    self._client._reset(addr)
                    self._frames_ports.pop(addr, None)  # a restarted lighthouse has another frames port
                    await self._drop_channel(addr)
        finally:
            timer.cancel()
            if writer is not None:
                writer.cancel()
            call.cancel()
            self._connected.clear()
            with self._lock:
                self._call = None
                self._outbox = None
                polls, self._polls = self._polls, {}
            for poll in polls.values():  # the stream ended: their callers fall back to a unary call
                poll.settle()
        return answered

    def _send(self, outbox: asyncio.Queue, message: bytes) -> None:
        """On the loop: queue `message` on the stream it was meant for, if that stream is still open."""
        if self._outbox is outbox:
            outbox.put_nowait(message)

    def _on_stop(self) -> None:
        """On the loop: say goodbye on the open stream, and end any backoff wait."""
        if self._stopped is not None:
            self._stopped.set()
        with self._lock:
            outbox = self._outbox
        if outbox is not None:
            outbox.put_nowait(GOODBYE)

    # -- the caller's side ------------------------------------------------------------------------

    def _register(self, member: QuorumMember, timeout_s: float,
                  poll: _StreamPoll) -> tuple[asyncio.Queue, int, bytes]:
        """Register `poll` on the open stream: (its outbox, request id, the request to send)."""
        with self._lock:  # registered under the lock the stream's end takes: never orphaned
            outbox = self._outbox if self._connected.is_set() else None
            if outbox is not None:
                request_id = next(self._request_ids)
                self._polls[request_id] = poll
                poll.outbox = outbox
                answered_id = self._answered_id
        if outbox is None:
            raise StreamUnavailable(f"heartbeat stream of {self.replica_id} is not open", peer="lighthouse",
                                    call="LighthouseService.HeartbeatStream", code="UNAVAILABLE")
        if member.last_quorum_replica_ids and member.last_quorum_id <= answered_id:
            # Rule 10's report is news only to a lighthouse that never issued that quorum; this stream's lighthouse
            # answered it (or a later one), so the report (one id per member: O(N) per member per round) stays home.
            member = member.without_last_quorum()
        message = ft_pb2.LighthouseHeartbeatRequest(
            replica_id=self.replica_id, request_id=request_id, timeout_ms=max(int(timeout_s * 1000), 1),
            quorum=ft_pb2.LighthouseQuorumRequest(requester=member.to_pb())).SerializeToString()
        return outbox, request_id, message

    def gave_up(self, quorum_id: int) -> None:
        """Tell the lighthouse, on the open stream (never blocks; a stream down now drops it), that this group failed
        to commit the step it attempted in quorum `quorum_id` and will not redo it (quorum rule 11)."""
        message = ft_pb2.LighthouseHeartbeatRequest(replica_id=self.replica_id, gave_up_quorum_id=quorum_id)
        with self._lock:
            outbox = self._outbox if self._connected.is_set() else None
        with contextlib.suppress(RuntimeError):  # the loop is gone (interpreter shutdown)
            if outbox is not None:
                self._loop.call_soon_threadsafe(self._send, outbox, message.SerializeToString())

    def _timed_out(self, request_id: int, timeout_s: float) -> FTTimeoutError:
        with self._lock:
            self._polls.pop(request_id, None)
        return FTTimeoutError(f"LighthouseService.Quorum (heartbeat stream of {self.replica_id}) timed out after "
                              f"{timeout_s:.3g}s; check the lighthouse status page, min_replicas and join_timeout")

    def _answer(self, poll: _StreamPoll, timeout_s: float) -> Quorum:
        """The quorum in the lighthouse's answer, or the error it carries."""
        response = poll.response
        if response is None:
            raise StreamUnavailable(f"heartbeat stream of {self.replica_id} ended before the quorum answer",
                                    peer="lighthouse", call="LighthouseService.HeartbeatStream", code="UNAVAILABLE")
        if response.error_code == "DEADLINE_EXCEEDED":
            raise FTTimeoutError(f"{response.error} (after {timeout_s:.3g}s)")
        if response.error_code == FINISHED_CODE:
            raise job_finished_error(response.error, peer="lighthouse", call="LighthouseService.Quorum")
        if response.error_code == "UNAVAILABLE":
            raise StreamUnavailable(response.error, peer="lighthouse", call="LighthouseService.Quorum",
                                    code="UNAVAILABLE")
        if response.error_code:
            raise RPCError(response.error, peer="lighthouse", call="LighthouseService.Quorum",
                           code=response.error_code)
        quorum = Quorum.from_response_bytes(response.quorum_response)
        with self._lock:
            if poll.outbox is self._outbox and quorum.quorum_id > self._answered_id:
                self._answered_id = quorum.quorum_id
        return quorum

    def quorum(self, member: QuorumMember, timeout: timedelta | float) -> Quorum:
        """Join the next quorum over the open stream; wait (up to `timeout`) for one containing `member`.

        Raises StreamUnavailable when the stream is not open or ends before the answer (the caller then
        falls back to LighthouseClient.quorum), FTTimeoutError at the deadline."""
        timeout_s = seconds(timeout)
        poll = _StreamPoll()
        outbox, request_id, message = self._register(member, timeout_s, poll)
        try:
            self._loop.call_soon_threadsafe(self._send, outbox, message)
        except RuntimeError:  # the loop is gone (interpreter shutdown)
            with self._lock:
                self._polls.pop(request_id, None)
            raise StreamUnavailable(f"heartbeat stream of {self.replica_id} is closed", peer="lighthouse",
                                    call="LighthouseService.HeartbeatStream", code="UNAVAILABLE") from None
        # The lighthouse answers by its own deadline (timeout_ms); a little slack covers the way back.
        assert poll.done is not None
        if not poll.done.wait(timeout_s + 1.0):
            raise self._timed_out(request_id, timeout_s)
        return self._answer(poll, timeout_s)

    async def quorum_async(self, member: QuorumMember, timeout_s: float) -> Quorum:
        """`quorum()` for a coroutine on the stream loop itself (the manager server's): no thread hop at all.

        The stream's reader settles the poll's future and this coroutine resumes on the next turn of the
        loop; its deadline is a timer on that same future (asyncio.wait_for would add a waiter future and
        a done callback: two more turns of the loop per round)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        poll = _StreamPoll(future)
        outbox, request_id, message = self._register(member, timeout_s, poll)
        self._send(outbox, message)
        # The lighthouse answers by its own deadline (timeout_ms); a little slack covers the way back.
        deadline = loop.call_later(timeout_s + 1.0, _expire, future)
        try:
            await future
        except asyncio.CancelledError:
            with self._lock:
                self._polls.pop(request_id, None)
            raise
        finally:
            deadline.cancel()
        if not poll.settled:
            raise self._timed_out(request_id, timeout_s)
        return self._answer(poll, timeout_s)

    def stop(self, timeout: timedelta | float = 5.0) -> None:
        """Close the stream, wait for its task and give back the stream loop. Idempotent.

        The writer sends a goodbye and half-closes the stream: the lighthouse answers by ending it, a
        clean exit. Only if that takes longer than CLEAN_CLOSE_S is it cancelled."""
        self._stop.set()
        try:
            self._end_task(seconds(timeout))
        finally:
            with self._lock:
                holds, self._holds_loop = self._holds_loop, False
            if holds:
                _StreamLoop.release(self._loop)

    def _end_task(self, timeout_s: float) -> None:
        task = self._task
        if task is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._on_stop)
        except RuntimeError:  # the loop is gone (interpreter shutdown)
            return
        if _on_loop(self._loop):
            return  # stopped from a listener on the loop itself: the task ends on its own
        for wait_s, then in ((min(CLEAN_CLOSE_S, timeout_s), "cancel the call"), (timeout_s, "cancel the task")):
            try:
                task.result(wait_s)
                return
            except concurrent.futures.TimeoutError:
                pass
            except (concurrent.futures.CancelledError, Exception):  # ended, one way or another
                return
            with self._lock:
                call = self._call
            if then == "cancel the call" and call is not None:
                self._loop.call_soon_threadsafe(call.cancel)
            elif then == "cancel the task":
                task.cancel()

    def __enter__(self) -> HeartbeatStreamHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

