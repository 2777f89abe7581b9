"""Client of the lighthouse: quorum long polls, heartbeats, and a heartbeat stream thread.

Accepts several lighthouse addresses ("a:1,b:2" or a list) and fails over to the next one when
an address refuses or cannot be reached; connection attempts are short so a dead first address
does not eat a call's whole timeout. Deadlines and cancels surface as `FTTimeoutError` (a
TimeoutError); everything else as `RPCError`/`AuthError` naming the peer, the call and the fix.
"""

from __future__ import annotations

import json
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import grpc

from ft_core import settings
from ft_core.errors import ConfigError, FTTimeoutError, RPCError
from ft_core.control.proto import ft_pb2, ft_pb2_grpc
from ft_core.control.rpc import CHANNEL_OPTIONS, auth_metadata, backoff_delays, call, map_rpc_error, open_channel, seconds
from ft_core.control.types import Quorum, QuorumMember
from ft_core.net import split_addresses

logger = logging.getLogger(__name__)

CONNECT_ATTEMPT_S = 1.0  # longest single connection attempt before trying the next address
CLEAN_CLOSE_S = 1.0  # longest stop() waits for the lighthouse to end a half-closed stream (a clean exit)
# Reconnect quickly after a lighthouse restart instead of grpc's default 1 s .. 120 s backoff.
CLIENT_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_CONNECTIVITY = {state.value[0]: state for state in grpc.ChannelConnectivity}
_WAKE = object()  # wakes a stream's request generator (to stop, or to send what was queued)


class StreamUnavailable(RPCError):
    """The heartbeat stream could not carry a quorum request (not open, or it ended before the answer):
    the caller falls back to a unary Quorum call."""


class _StreamPoll:
    """A quorum request sent on the heartbeat stream, waiting for the answer with its request_id."""

    __slots__ = ("done", "response")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.response: ft_pb2.LighthouseHeartbeatResponse | None = None  # None: the stream ended first


def wait_ready(channel: grpc.Channel, timeout_s: float) -> bool:
    """Try to connect; True once READY, False at the first failure (refused, unreachable) or after timeout_s.

    Watches the channel's state from the calling thread (grpc's subscribe() would start a poller
    thread that races with closing the channel).
    """
    raw = getattr(channel, "_channel", None)
    if raw is None or not hasattr(raw, "watch_connectivity_state"):
        try:
            grpc.channel_ready_future(channel).result(timeout=max(timeout_s, 0.0))
            return True
        except grpc.FutureTimeoutError:
            return False
    deadline = time.monotonic() + timeout_s
    try:
        observed = raw.check_connectivity_state(True)
        while True:
            state = _CONNECTIVITY.get(observed)
            if state == grpc.ChannelConnectivity.READY:
                return True
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            raw.watch_connectivity_state(observed, time.time() + min(left, 0.1))
            observed = raw.check_connectivity_state(True)
    except ValueError:  # closed by another thread meanwhile
        return False


@dataclass(frozen=True)
class LighthouseClientConfig:
    """A lighthouse client's settings, resolved once from ft_core.settings (FT_CONNECT_TIMEOUT_SEC and
    FT_TOKEN override the arguments)."""

    addrs: tuple[str, ...]
    connect_timeout: timedelta
    token: str | None = field(default=None, repr=False)


def resolve_client_config(addrs: str | list[str], connect_timeout: timedelta | float | None,
                          token: str | None) -> LighthouseClientConfig:
    parsed = split_addresses(addrs)
    if not parsed:
        raise ConfigError(f"no lighthouse address in {addrs!r}: pass host:port (or several, comma-separated), "
                          f"or set FT_LIGHTHOUSE")
    return LighthouseClientConfig(tuple(parsed), settings.value("FT_CONNECT_TIMEOUT_SEC", connect_timeout),
                                  settings.value("FT_TOKEN", token))


def _encode_data(data: dict[Any, object] | None) -> str:
    if data is None:
        return ""
    if not isinstance(data, dict):
        raise ConfigError(f"quorum data must be a dict (sent as JSON), got {type(data).__name__}")
    try:
        return json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"quorum data must be JSON-serialisable: {exc}") from None


def _decode_data(text: str) -> Any:
    """A participant's data as torchft gives it: the decoded JSON, None when empty (raw text if not JSON)."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


class LighthouseClient:
    """Talks to one lighthouse, or the first reachable of several; a context manager."""

    def __init__(self, addrs: str | list[str] | None = None, connect_timeout: timedelta | float | None = None,
                 token: str | None = None, *, addr: str | list[str] | None = None) -> None:
        # `addr=` is torchft's spelling of the first argument
        if addrs is None:
            addrs = addr
        elif addr is not None:
            raise ConfigError("pass the lighthouse address once: as addrs or as torchft's addr=, not both")
        self.config = resolve_client_config(addrs if addrs is not None else "", connect_timeout, token)
        self._addrs = list(self.config.addrs)
        self._connect_timeout_s = seconds(self.config.connect_timeout)
        self._token = self.config.token
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, ft_pb2_grpc.LighthouseServiceStub] = {}
        self._ready: set[str] = set()
        self._preferred = 0
        self._streams: list[HeartbeatStreamHandle] = []
        self._closed = False

    @property
    def addresses(self) -> list[str]:
        return list(self._addrs)

    # -- channels -----------------------------------------------------------------------------

    def _channel(self, addr: str) -> grpc.Channel:
        with self._lock:
            if self._closed:
                raise RPCError(f"LighthouseClient for {self._addrs} is closed", peer=addr, call="", code="CLOSED")
            channel = self._channels.get(addr)
            if channel is None:
                channel = open_channel(addr, CLIENT_CHANNEL_OPTIONS)  # TLS when FT_TLS_CA/FT_TLS_CERT are set
                self._channels[addr] = channel
            return channel

    def _connected(self, addr: str, timeout_s: float) -> bool:
        if addr in self._ready:
            return True
        if wait_ready(self._channel(addr), timeout_s):
            self._ready.add(addr)
            return True
        self._reset(addr)
        return False

    def _stub(self, addr: str) -> ft_pb2_grpc.LighthouseServiceStub:
        """The stub over `addr`'s channel, built once per channel (building one per call costs a hop's worth)."""
        stub = self._stubs.get(addr)
        if stub is None:
            channel = self._channel(addr)
            with self._lock:
                stub = self._stubs.get(addr)
                if stub is None or self._channels.get(addr) is not channel:
                    stub = ft_pb2_grpc.LighthouseServiceStub(channel)
                    if self._channels.get(addr) is channel:
                        self._stubs[addr] = stub
        return stub

    def _reset(self, addr: str) -> None:
        """Forget a failed channel so the next attempt opens a fresh connection at once."""
        with self._lock:
            self._ready.discard(addr)
            self._stubs.pop(addr, None)
            channel = self._channels.pop(addr, None)
        if channel is not None:
            channel.close()

    def _order(self) -> list[str]:
        start = self._preferred
        return [self._addrs[(start + i) % len(self._addrs)] for i in range(len(self._addrs))]

    def _unary(self, name: str, invoke: Callable[[ft_pb2_grpc.LighthouseServiceStub], Any], request: Any,
               timeout: timedelta | float) -> Any:
        """One call with failover across addresses, all within `timeout`."""
        timeout_s = seconds(timeout)
        deadline = time.monotonic() + timeout_s
        first_failure: float | None = None  # connect_timeout counts from the first failed connection
        delays = backoff_delays(initial=0.05, cap=1.0, jitter=0.05)
        last_problem = "no attempt made"
        while True:
            for addr in self._order():
                now = time.monotonic()
                if now >= deadline:
                    raise FTTimeoutError(f"LighthouseService.{name} to {', '.join(self._addrs)} timed out after "
                                         f"{timeout_s:.3g}s (last problem: {last_problem}); check that a lighthouse "
                                         f"is running there, or raise the timeout")
                if not self._connected(addr, min(CONNECT_ATTEMPT_S, deadline - now)):
                    last_problem = f"could not connect to {addr}"
                    first_failure = first_failure or now
                    continue
                try:
                    response = call(invoke(self._stub(addr)), request,
                                    peer=addr, name=f"LighthouseService.{name}", timeout=deadline - time.monotonic(),
                                    token=self._token)
                except RPCError as exc:
                    if exc.code != "UNAVAILABLE":
                        raise
                    self._reset(addr)
                    last_problem = str(exc)
                    first_failure = first_failure or time.monotonic()
                    continue
                self._preferred = self._addrs.index(addr)
                return response
            now = time.monotonic()
            if first_failure is not None and now - first_failure >= self._connect_timeout_s and now < deadline:
                raise RPCError(f"LighthouseService.{name}: no lighthouse reachable at {', '.join(self._addrs)} "
                               f"within connect_timeout {self._connect_timeout_s:.3g}s ({last_problem}); start one "
                               f"(`ftl lighthouse`) or fix FT_LIGHTHOUSE", peer=",".join(self._addrs),
                               call=f"LighthouseService.{name}", code="UNAVAILABLE")
            time.sleep(max(min(next(delays), deadline - now), 0.0))

    # -- calls --------------------------------------------------------------------------------

    def quorum(self, member: QuorumMember | str | None = None, timeout: timedelta | None = None,
               address: str | None = None, store_address: str | None = None, step: int | None = None,
               world_size: int | None = None, shrink_only: bool | None = None,
               data: dict[Any, object] | None = None, *, replica_id: str | None = None) -> Quorum:
        """Join the next quorum and wait (up to `timeout`) until one containing `member` is issued.

        torchft's keyword form `quorum(replica_id, timeout, address=, store_address=, step=, world_size=,
        shrink_only=, data=dict)` builds the member from its fields; its answer, as torchft's, holds each
        participant's `data` decoded from JSON (a dict, or None when the member sent none).
        """
        if replica_id is not None:
            if member is not None:
                raise ConfigError("pass the member once: a QuorumMember, or torchft's replica_id=, not both")
            member = replica_id
        if member is None or timeout is None:
            raise ConfigError("quorum() needs the member (a QuorumMember or a replica_id) and a timeout")
        torchft_form = isinstance(member, str)
        if torchft_form:
            member = QuorumMember(replica_id=member, address=address or "", store_address=store_address or "",
                                  step=step or 0, world_size=world_size if world_size is not None else 1,
                                  shrink_only=bool(shrink_only), data=_encode_data(data))
        elif any(v is not None for v in (address, store_address, step, world_size, shrink_only, data)):
            raise ConfigError("quorum(member, timeout) takes the member's fields from the QuorumMember; pass "
                              "either a QuorumMember or torchft's replica_id with keyword fields, not both")
        request = ft_pb2.LighthouseQuorumRequest(requester=member.to_pb())
        response = self._unary("Quorum", lambda stub: stub.Quorum, request, timeout)
        quorum = Quorum.from_pb(response.quorum)
        if torchft_form:
            quorum = replace(quorum, participants=tuple(replace(m, data=_decode_data(m.data))
                                                        for m in quorum.participants))
        return quorum

    def heartbeat(self, replica_id: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        """One unary heartbeat."""
        self._unary("Heartbeat", lambda stub: stub.Heartbeat,
                    ft_pb2.LighthouseHeartbeatRequest(replica_id=replica_id), timeout)

    def start_heartbeat_stream(self, replica_id: str,
                               interval: timedelta = timedelta(milliseconds=100)) -> HeartbeatStreamHandle:
        """Keep a HeartbeatStream open from a daemon thread until `.stop()` (or `close()`)."""
        if not replica_id:
            raise ConfigError("start_heartbeat_stream: replica_id must not be empty")
        handle = HeartbeatStreamHandle(self, replica_id, seconds(interval))
        with self._lock:
            self._streams.append(handle)
        handle._start()
        return handle

    def close(self) -> None:
        """Stop every heartbeat stream of this client and close its channels. Idempotent."""
        with self._lock:
            streams, self._streams = self._streams, []
        for handle in streams:
            handle.stop()
        with self._lock:
            self._closed = True
            channels, self._channels = self._channels, {}
            self._stubs.clear()
            self._ready.clear()
        for channel in channels.values():
            channel.close()

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HeartbeatStreamHandle:
    """A named daemon thread keeping one HeartbeatStream open; reconnects and fails over when it breaks.

    While the stream is open the lighthouse counts the replica alive; when this process dies the
    connection drops and the lighthouse drops the replica at once. `.stop()` half-closes the stream
    (the lighthouse logs a clean exit), cancels it if the lighthouse does not end it promptly, and
    joins the thread. PeerLost notices the lighthouse pushes on the stream go to the listeners added
    with `add_peer_lost_listener`, called on this thread.
    """

    def __init__(self, client: LighthouseClient, replica_id: str, interval_s: float) -> None:
        self.replica_id = replica_id
        self._client = client
        self._interval_s = max(interval_s, 0.001)
        self._stale_after_s = max(20 * self._interval_s, 3.0)  # no answer this long: reconnect
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._connected = threading.Event()
        self._listeners: list[Callable[[int, str], None]] = []
        self._outbox: queue.SimpleQueue | None = None  # quorum requests for the open stream (guarded by _lock)
        self._polls: dict[int, _StreamPoll] = {}  # quorum requests of the open stream (guarded by _lock)
        self._request_ids = itertools.count(1)
        self.last_error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name=f"ftl-heartbeat-{replica_id}", daemon=True)

    def _start(self) -> None:
        self._thread.start()

    @property
    def connected(self) -> bool:
        """True while a stream is open and the lighthouse has answered on it."""
        return self._connected.is_set()

    def wait_connected(self, timeout: timedelta | float) -> bool:
        return self._connected.wait(seconds(timeout))

    def add_peer_lost_listener(self, listener: Callable[[int, str], None]) -> None:
        """Call `listener(quorum_id, lost_replica_id)` for each PeerLost notice (on the stream's thread:
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

    def _run(self) -> None:
        delays = backoff_delays(initial=0.05, cap=1.0, jitter=0.05)
        failures = 0
        while not self._stop.is_set():
            addrs = self._client._order()
            addr = addrs[failures % len(addrs)]
            try:
                answered = self._stream_once(addr)
            except Exception as exc:  # keep heartbeating through anything; record it
                logger.exception("heartbeat stream of %s to %s failed", self.replica_id, addr)
                self.last_error = exc
                answered = False
            if self._stop.is_set():
                break
            if answered:
                failures = 0
                delays = backoff_delays(initial=0.05, cap=1.0, jitter=0.05)
            else:
                failures += 1
            self._stop.wait(next(delays))

    def _stream_once(self, addr: str) -> bool:
        """Hold one stream to `addr` until it breaks; True when the lighthouse answered at least once."""
        if not self._client._connected(addr, CONNECT_ATTEMPT_S):
            self.last_error = RPCError(f"HeartbeatStream: could not connect to lighthouse {addr}", peer=addr,
                                       call="LighthouseService.HeartbeatStream", code="UNAVAILABLE")
            return False
        stub = ft_pb2_grpc.LighthouseServiceStub(self._client._channel(addr))
        last_answer = [time.monotonic()]
        request = ft_pb2.LighthouseHeartbeatRequest(replica_id=self.replica_id)
        goodbye = ft_pb2.LighthouseHeartbeatRequest(replica_id=self.replica_id, leaving=True)
        outbox: queue.SimpleQueue = queue.SimpleQueue()

        def requests() -> Any:
            """Heartbeats every interval, and quorum requests as soon as they are queued."""
            yield request
            next_beat = time.monotonic() + self._interval_s
            while True:
                try:
                    item = outbox.get(timeout=max(next_beat - time.monotonic(), 0.0))
                except queue.Empty:
                    item = request
                if self._stop.is_set():
                    yield goodbye  # then end the stream: the lighthouse logs a clean exit, pushes nothing
                    return
                if item is _WAKE:
                    continue
                if item is request:
                    if time.monotonic() - last_answer[0] > self._stale_after_s:
                        logger.warning("lighthouse %s stopped answering %s's heartbeats; reconnecting", addr,
                                       self.replica_id)
                        with self._lock:
                            if self._call is not None:
                                self._call.cancel()
                        return
                # A quorum request counts as a heartbeat at the lighthouse: the next beat is due an interval later.
                next_beat = time.monotonic() + self._interval_s
                yield item

        stream = stub.HeartbeatStream(requests(), metadata=auth_metadata(self._client._token))
        with self._lock:
            self._call = stream
            self._outbox = outbox
        if self._stop.is_set():
            stream.cancel()
        answered = False
        try:
            for response in stream:
                last_answer[0] = time.monotonic()
                if response.request_id:
                    with self._lock:
                        poll = self._polls.pop(response.request_id, None)
                    if poll is not None:
                        poll.response = response
                        poll.done.set()
                if response.HasField("peer_lost"):
                    self._peer_lost(response.peer_lost)
                if not answered:
                    answered = True
                    self._connected.set()
                    if self.last_error is not None:
                        logger.info("heartbeat stream of %s to %s is back", self.replica_id, addr)
                    self.last_error = None
        except grpc.RpcError as err:
            if not self._stop.is_set():
                error = map_rpc_error(err, peer=addr, call="LighthouseService.HeartbeatStream")
                if answered or self.last_error is None:
                    logger.warning("heartbeat stream of %s broke: %s", self.replica_id, error)
                self.last_error = error
                if getattr(error, "code", "") == "UNAVAILABLE":
                    self._client._reset(addr)
        finally:
            self._connected.clear()
            with self._lock:
                self._call = None
                self._outbox = None
                polls, self._polls = self._polls, {}
            outbox.put(_WAKE)
            for poll in polls.values():  # the stream ended: their callers fall back to a unary call
                poll.done.set()
        return answered

    def quorum(self, member: QuorumMember, timeout: timedelta | float) -> Quorum:
        """Join the next quorum over the open stream; wait (up to `timeout`) for one containing `member`.

        Raises StreamUnavailable when the stream is not open or ends before the answer (the caller then
        falls back to LighthouseClient.quorum), FTTimeoutError at the deadline."""
        timeout_s = seconds(timeout)
        poll = _StreamPoll()
        with self._lock:  # registered and queued under the lock the stream's end takes: never orphaned
            outbox = self._outbox if self._connected.is_set() else None
            if outbox is not None:
                request_id = next(self._request_ids)
                self._polls[request_id] = poll
                outbox.put(ft_pb2.LighthouseHeartbeatRequest(
                    replica_id=self.replica_id, request_id=request_id, timeout_ms=max(int(timeout_s * 1000), 1),
                    quorum=ft_pb2.LighthouseQuorumRequest(requester=member.to_pb())))
        if outbox is None:
            raise StreamUnavailable(f"heartbeat stream of {self.replica_id} is not open", peer="lighthouse",
                                    call="LighthouseService.HeartbeatStream", code="UNAVAILABLE")
        # The lighthouse answers by its own deadline (timeout_ms); a little slack covers the way back.
        if not poll.done.wait(timeout_s + 1.0):
            with self._lock:
                self._polls.pop(request_id, None)
            raise FTTimeoutError(f"LighthouseService.Quorum (heartbeat stream of {self.replica_id}) timed out after "
                                 f"{timeout_s:.3g}s; check the lighthouse status page, min_replicas and join_timeout")
        response = poll.response
        if response is None:
            raise StreamUnavailable(f"heartbeat stream of {self.replica_id} ended before the quorum answer",
                                    peer="lighthouse", call="LighthouseService.HeartbeatStream", code="UNAVAILABLE")
        if response.error_code == "DEADLINE_EXCEEDED":
            raise FTTimeoutError(f"{response.error} (after {timeout_s:.3g}s)")
        if response.error_code == "UNAVAILABLE":
            raise StreamUnavailable(response.error, peer="lighthouse", call="LighthouseService.Quorum",
                                    code="UNAVAILABLE")
        if response.error_code:
            raise RPCError(response.error, peer="lighthouse", call="LighthouseService.Quorum",
                           code=response.error_code)
        return Quorum.from_pb(ft_pb2.LighthouseQuorumResponse.FromString(response.quorum_response).quorum)

    def stop(self, timeout: timedelta | float = 5.0) -> None:
        """Close the stream and join the thread. Idempotent.

        The request generator sees the stop and ends, which half-closes the stream: the lighthouse
        answers by ending it, a clean exit. Only if that takes longer than CLEAN_CLOSE_S is it cancelled."""
        self._stop.set()
        with self._lock:
            if self._outbox is not None:
                self._outbox.put(_WAKE)  # the request generator sends the goodbye now, not at the next beat
        own = threading.current_thread() is self._thread
        if self._thread.is_alive() and not own:
            self._thread.join(min(CLEAN_CLOSE_S, seconds(timeout)))
        with self._lock:
            stream = self._call
        if stream is not None:
            stream.cancel()
        if self._thread.is_alive() and not own:
            self._thread.join(seconds(timeout))

    def __enter__(self) -> HeartbeatStreamHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
