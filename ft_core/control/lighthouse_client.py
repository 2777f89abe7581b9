"""Client of the lighthouse: quorum long polls, heartbeats, and heartbeat streams (ft_core.control.heartbeat_stream).

Accepts several lighthouse addresses ("a:1,b:2" or a list) and fails over to the next one when
an address refuses or cannot be reached; connection attempts are short so a dead first address
does not eat a call's whole timeout. Deadlines and cancels surface as `FTTimeoutError` (a
TimeoutError); everything else as `RPCError`/`AuthError` naming the peer, the call and the fix.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import grpc

from ft_core import settings
from ft_core.errors import ConfigError, FTError, FTTimeoutError, RPCError
from ft_core.control.lighthouse_peers import redirect_target
from ft_core.control.heartbeat_stream import (  # noqa: F401 - StreamUnavailable is part of this module's API
    CLIENT_CHANNEL_OPTIONS,
    CONNECT_ATTEMPT_S,
    HeartbeatStreamHandle,
    StreamUnavailable,
)
from ft_core.control.proto import ft_pb2, ft_pb2_grpc
from ft_core.control.rpc import backoff_delays, call, open_channel, seconds
from ft_core.control.types import Quorum, QuorumMember
from ft_core.net import split_addresses

logger = logging.getLogger(__name__)

_CONNECTIVITY = {state.value[0]: state for state in grpc.ChannelConnectivity}
EARLY_END_S = 0.25  # a call that "times out" this long before its deadline did not: its channel was closed


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
        self._calls: collections.Counter[grpc.Channel] = collections.Counter()  # calls in flight per channel
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
            return self._channel_locked(addr)

    def _channel_locked(self, addr: str) -> grpc.Channel:
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

    @contextlib.contextmanager
    def _using(self, addr: str) -> Iterator[ft_pb2_grpc.LighthouseServiceStub]:
        """The stub over `addr`'s channel for one call. A reset meanwhile (the heartbeat stream's, from its
        own thread) retires the channel: later calls get a fresh one, and it is closed when its last call ends."""
        with self._lock:
            channel = self._channel_locked(addr)
            stub = self._stubs.get(addr)
            if stub is None:  # built once per channel (building one per call costs a hop's worth)
                stub = self._stubs[addr] = ft_pb2_grpc.LighthouseServiceStub(channel)
            self._calls[channel] += 1
        try:
            yield stub
        finally:
            with self._lock:
                self._calls[channel] -= 1
                last = not self._calls[channel]
                if last:
                    del self._calls[channel]
                retired = last and self._channels.get(addr) is not channel
            if retired:  # reset while this call was on it
                channel.close()

    def _reset(self, addr: str) -> None:
        """Forget a failed channel so the next attempt opens a fresh connection at once. It is closed now, or by
        the last call still on it when that call ends (closing it under a call would cancel the call)."""
        with self._lock:
            self._ready.discard(addr)
            self._stubs.pop(addr, None)
            channel = self._channels.pop(addr, None)
            busy = channel is not None and self._calls[channel] > 0
        if channel is not None and not busy:
            channel.close()

    def _order(self) -> list[str]:
        start = self._preferred
        return [self._addrs[(start + i) % len(self._addrs)] for i in range(len(self._addrs))]

    def follow_redirect(self, addr: str, message: str) -> str | None:
        """`addr` stands by for another lighthouse of the job (ft_core.control.lighthouse_peers): prefer the
        one its answer names, when it is one of our addresses; returns it (None: no usable redirect)."""
        target = redirect_target(message)
        if target is None or target == addr:
            return None
        if target not in self._addrs:
            logger.warning("lighthouse %s sends us to %s, which is not in our lighthouse list %s; add it to "
                           "FT_LIGHTHOUSE (failing over in list order meanwhile)", addr, target, ",".join(self._addrs))
            return None
        if self._addrs[self._preferred] != target:
            logger.info("lighthouse %s stands by for %s: going there", addr, target,
                        extra={"event": "lighthouse_redirect", "peer": addr, "active": target})
        self._preferred = self._addrs.index(target)
        return target

    def _unary(self, name: str, invoke: Callable[[ft_pb2_grpc.LighthouseServiceStub], Any], request: Any,
               timeout: timedelta | float) -> Any:
        """One call with failover across addresses, all within `timeout`."""
        timeout_s = seconds(timeout)
        deadline = time.monotonic() + timeout_s
        first_failure: float | None = None  # connect_timeout counts from the first failed connection
        delays = backoff_delays(initial=0.05, cap=1.0, jitter=0.05)
        last_problem = "no attempt made"
        followed: set[str] = set()  # redirects taken at once in this call (another one waits its backoff)
        while True:
            redirected = False
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
                    with self._using(addr) as stub:
                        response = call(invoke(stub), request, peer=addr, name=f"LighthouseService.{name}",
                                        timeout=deadline - time.monotonic(), token=self._token)
                except FTTimeoutError as exc:
                    if time.monotonic() >= deadline - EARLY_END_S:
                        raise
                    # Ended well before its deadline: not a timeout but a call cancelled under it (a server ending its
                    # calls as it stops): go on on a fresh channel, or the next address, within the deadline.
                    last_problem = str(exc)
                    self._reset(addr)
                    first_failure = first_failure or time.monotonic()
                    continue
                except RPCError as exc:
                    if exc.code != "UNAVAILABLE":
                        raise
                    last_problem = str(exc)
                    target = self.follow_redirect(addr, str(exc))
                    if target is not None and target not in followed:
                        followed.add(target)  # a standing-by lighthouse answered: go to the active one now
                        redirected = True
                        break
                    if target is None:
                        self._reset(addr)
                    first_failure = first_failure or time.monotonic()
                    continue
                self._preferred = self._addrs.index(addr)
                return response
            if redirected:
                continue
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

    def quorum_status(self, replica_id: str, timeout: timedelta | float = 2.0) -> str:
        """The lighthouse's reason why no quorum is issued now (what `ftl status` shows); counts as a heartbeat."""
        response = self._unary("Heartbeat", lambda stub: stub.Heartbeat,
                               ft_pb2.LighthouseHeartbeatRequest(replica_id=replica_id, want_status=True), timeout)
        return response.quorum_status

    def finished(self, replica_id: str, step: int, quorum_id: int, timeout: timedelta | float = 2.0,
                 attempts: int = 2) -> list[str]:
        """Tell every lighthouse address (a standby too) that `replica_id` ended its training at `step`, its
        last quorum being `quorum_id`; returns the addresses that took the notice (failures are logged).

        Each address gets `attempts` tries, each connection and call bounded by `timeout`: this is often the
        first unary call of the client (the heartbeat stream rides its own connection), and on a loaded
        machine its connection took longer than the 1 s a stream's attempt gets, so the notice was lost and a
        late group was not refused (busy suite runs, 2026-12-07). A dead address costs at most
        `attempts * timeout` and the pauses between tries (0.2 s, growing to 1 s)."""
        request = ft_pb2.LighthouseHeartbeatRequest(replica_id=replica_id, finished=True, finished_step=step,
                                                    finished_quorum_id=quorum_id)
        told = []
        for addr in self._addrs:
            delays = backoff_delays(initial=0.2, cap=1.0, jitter=0.05)
            for attempt in range(1, attempts + 1):
                if attempt > 1:
                    time.sleep(next(delays))  # a refused connection fails at once: give the lighthouse a moment
                try:
                    if not self._connected(addr, seconds(timeout)):
                        raise RPCError(f"could not connect to lighthouse {addr} within {seconds(timeout):g}s",
                                       peer=addr, code="UNAVAILABLE")
                    with self._using(addr) as stub:
                        call(stub.Heartbeat, request, peer=addr, name="LighthouseService.Heartbeat", timeout=timeout,
                             token=self._token)
                    told.append(addr)
                    break
                except FTError as exc:  # best effort: a lighthouse that missed it cannot refuse a late group
                    if attempt == attempts:
                        logger.warning("replica %s: lighthouse %s did not take the 'finished at step %d' notice "
                                       "(%d attempts): %s", replica_id, addr, step, attempts, exc)
        return told

    def start_heartbeat_stream(self, replica_id: str,
                               interval: timedelta = timedelta(milliseconds=100)) -> HeartbeatStreamHandle:
        """Keep a HeartbeatStream open on the process's stream loop until `.stop()` (or `close()`)."""
        if not replica_id:
            raise ConfigError("start_heartbeat_stream: replica_id must not be empty")
        handle = HeartbeatStreamHandle(self, replica_id, seconds(interval))
        with self._lock:
            self._streams.append(handle)
        handle._start()
        return handle

    def close(self) -> None:
        """Stop every heartbeat stream of this client and close its channels (retired ones with calls still on
        them too: close() ends every call). Idempotent."""
        with self._lock:
            streams, self._streams = self._streams, []
        for handle in streams:
            handle.stop()
        with self._lock:
            self._closed = True
            channels = {*self._channels.values(), *self._calls}
            self._channels = {}
            self._stubs.clear()
            self._ready.clear()
        for channel in channels:
            channel.close()

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
