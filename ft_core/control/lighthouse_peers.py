"""Lighthouses that know each other, so a primary and its standbys never split one job.

With FT_LIGHTHOUSE=primary,standby the groups fail over from one lighthouse to the next; two lighthouses
that know nothing of each other can then each hold part of the job (groups that failed over train on the
standby while a group that rejoins on the primary waits there alone, or both halves train). Each lighthouse
is started with the job's ordered list of lighthouses (`--peers`, FT_LIGHTHOUSE_PEERS: the same list as
FT_LIGHTHOUSE) and asks every one of them for its state every `interval` (a bounded `Peer` call carrying the
job's token). A lighthouse recognises itself in the list by its random id, which also gives its position.

The rule (`choose_active`, pure): a lighthouse stands by for the reachable peer that outranks it, and serves
otherwise. Rank: the higher step held by live members (never lose a committed step), then more live members,
then the earlier position in the list. A peer that does not answer, or itself stands by, is no candidate. So
a lighthouse with no live members whose peer has some sends every member there; when both already have
members (a split happened), the one with the lower rank turns its members away. Standing by, a lighthouse
answers quorum joins, heartbeat streams and heartbeats with UNAVAILABLE and a message naming the active
lighthouse (`redirect_message`); the client (ft_core.control.lighthouse_client) goes there next.
The rule needs the lighthouses to reach each other: two that are cut from each other both serve.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from ft_core.control.proto import ft_pb2
from ft_core.control.rpc import auth_metadata, channel_credentials, tls_config
from ft_core.net import normalize_address

logger = logging.getLogger("ft_core.control.lighthouse")

__all__ = ["PeerState", "PeerView", "PeerWatch", "choose_active", "rank", "redirect_message", "redirect_target"]

PEER_METHOD = "/ftl.LighthouseService/Peer"
PEER_INTERVAL_S = 0.5  # ask every peer this often
PEER_TIMEOUT_S = 1.0  # longest one Peer call may take (a cut host uses all of it)
STALE_ROUNDS = 3  # a peer's last answer counts for this many rounds (plus one call's timeout)
_REDIRECT = re.compile(r"the job's active lighthouse is (\S+) \(")


@dataclass(frozen=True)
class PeerState:
    """What one lighthouse tells another about the job it holds."""

    lighthouse_id: str
    address: str = ""
    live_members: int = 0
    max_step: int = 0
    quorum_id: int = 0
    standing_by_for: str = ""

    def to_pb(self) -> ft_pb2.LighthousePeerState:
        return ft_pb2.LighthousePeerState(lighthouse_id=self.lighthouse_id, address=self.address,
                                          live_members=self.live_members, max_step=self.max_step,
                                          quorum_id=self.quorum_id, standing_by_for=self.standing_by_for)

    @classmethod
    def from_pb(cls, pb: ft_pb2.LighthousePeerState) -> PeerState:
        return cls(pb.lighthouse_id, pb.address, pb.live_members, pb.max_step, pb.quorum_id, pb.standing_by_for)


@dataclass(frozen=True)
class PeerView:
    """One entry of the peer list as last seen: its state (None until it answers), when, and why not."""

    address: str
    position: int
    state: PeerState | None = None
    seen_at: float = float("-inf")  # monotonic time of the last answer
    problem: str = "not asked yet"

    def describe(self, now: float, own_id: str) -> dict[str, Any]:
        """The entry as /status and `ftl status` show it."""
        entry: dict[str, Any] = {"address": self.address, "position": self.position,
                                 "self": self.state is not None and self.state.lighthouse_id == own_id,
                                 "reachable": self.state is not None and not self.problem,
                                 "answer_age_s": None if self.state is None else round(now - self.seen_at, 3),
                                 "problem": self.problem}
        if self.state is not None:
            entry.update(live_members=self.state.live_members, max_step=self.state.max_step,
                         quorum_id=self.state.quorum_id, standing_by_for=self.state.standing_by_for)
        return entry


def rank(state: PeerState, position: int) -> tuple[int, int, int]:
    """Higher is more entitled to serve: step held by live members, then their number, then the earlier position."""
    return (state.max_step if state.live_members > 0 else -1, state.live_members, -position)


def choose_active(own: PeerState, own_position: int, views: list[PeerView], now: float,
                  stale_after_s: float) -> PeerView | None:
    """The peer this lighthouse must stand by for, or None when it serves the job itself.

    Candidates: peers (not this lighthouse) whose answer is younger than `stale_after_s`, with live
    members, not standing by themselves. The best candidate wins only if it outranks `own`."""
    candidates = [v for v in views if v.state is not None and not v.problem and now - v.seen_at <= stale_after_s
                  and v.state.lighthouse_id != own.lighthouse_id and v.state.live_members > 0
                  and not v.state.standing_by_for]
    if not candidates:
        return None
    best = max(candidates, key=lambda v: rank(v.state, v.position))  # type: ignore[arg-type]
    return best if rank(best.state, best.position) > rank(own, own_position) else None  # type: ignore[arg-type]


def redirect_message(own: str, active: PeerView) -> str:
    """What a standing-by lighthouse answers; names the active one (parsed back by `redirect_target`)."""
    state = active.state
    held = f"{state.live_members} live member(s) at step {state.max_step}" if state is not None else "live members"
    return (f"lighthouse {own} is standing by: the job's active lighthouse is {active.address} ({held}); "
            f"connect there (FT_LIGHTHOUSE lists both, so the client goes there next)")


def redirect_target(text: str) -> str | None:
    """The active lighthouse named in a standing-by lighthouse's answer, normalized; None if it names none."""
    found = _REDIRECT.search(text or "")
    return normalize_address(found.group(1)) if found is not None else None


class PeerCore(Protocol):
    """What the watch needs from the lighthouse's core (ft_core.control.lighthouse_state.LighthouseCore)."""

    lighthouse_id: str

    def peer_state(self) -> PeerState: ...

    def set_peer_picture(self, active: PeerView | None, message: str, views: list[dict[str, Any]]) -> None: ...


def _channel(addr: str) -> grpc.aio.Channel:
    target = normalize_address(addr)
    roots = tls_config().client_roots  # TLS as FT_TLS_CA/FT_TLS_CERT say, as every client of the job
    if roots:
        return grpc.aio.secure_channel(target, channel_credentials(roots))
    return grpc.aio.insecure_channel(target)


class PeerWatch:
    """Asks each peer for its state every `interval_s` on the lighthouse's event loop, applies `choose_active`
    and hands the verdict to the core. Owned by the LighthouseServer: `run()` is its task, `close()` ends it."""

    def __init__(self, peers: tuple[str, ...], core: PeerCore, token: str | None,
                 interval_s: float = PEER_INTERVAL_S, timeout_s: float = PEER_TIMEOUT_S) -> None:
        self._peers = peers
        self._core = core
        self._token = token
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._views = [PeerView(addr, i) for i, addr in enumerate(peers)]
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._warned_no_self = False

    @property
    def stale_after_s(self) -> float:
        return STALE_ROUNDS * self._interval_s + self._timeout_s

    def own_position(self) -> int:
        """This lighthouse's index in the list (recognised by its id); after every entry when it is not listed."""
        own_id = self._core.lighthouse_id
        return next((v.position for v in self._views if v.state is not None and v.state.lighthouse_id == own_id),
                    len(self._views))

    async def run(self) -> None:
        """Rounds until cancelled; the first one ends within one call's timeout, as the core waits for it."""
        while True:
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not end the watch, nor hold quorums back; record it
                logger.exception("lighthouse peer round failed; serving the job until a round succeeds")
                self._core.set_peer_picture(None, "", [])
            await asyncio.sleep(self._interval_s)

    async def round(self) -> None:
        """Ask every peer at once (each call bounded by timeout_s), then decide."""
        own = self._core.peer_state()
        self._views = list(await asyncio.gather(*(self._ask(v, own) for v in self._views)))
        now = time.monotonic()
        if not self._warned_no_self and all(v.state is not None for v in self._views):
            self._warned_no_self = True
            if self.own_position() == len(self._views):
                logger.warning("lighthouse %s is not in its own peer list %s: it ranks after every listed one; "
                               "pass each lighthouse the same ordered list as FT_LIGHTHOUSE", own.address,
                               ",".join(self._peers))
        own = self._core.peer_state()
        active = choose_active(own, self.own_position(), self._views, now, self.stale_after_s)
        message = redirect_message(own.address, active) if active is not None else ""
        self._core.set_peer_picture(active, message, [v.describe(now, own.lighthouse_id) for v in self._views])

    async def _ask(self, view: PeerView, own: PeerState) -> PeerView:
        channel = self._channels.get(view.address)
        if channel is None:
            channel = self._channels[view.address] = _channel(view.address)
        call = channel.unary_unary(PEER_METHOD, request_serializer=ft_pb2.LighthousePeerState.SerializeToString,
                                   response_deserializer=ft_pb2.LighthousePeerState.FromString)
        try:
            answer = await call(own.to_pb(), timeout=self._timeout_s, metadata=auth_metadata(self._token))
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            problem = f"{code.name if code else 'error'}: {err.details() if hasattr(err, 'details') else err}"
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and problem != view.problem:
                logger.warning("lighthouse peer %s refused the Peer call (%s): it cannot take part in choosing which "
                               "lighthouse serves; give every lighthouse of the job the same token (FT_TOKEN) and "
                               "version", view.address, problem, extra={"peer": view.address,
                                                                         "event": "lighthouse_peer_refused"})
            elif view.state is not None and not view.problem:
                logger.info("lighthouse peer %s stopped answering (%s)", view.address, problem,
                            extra={"peer": view.address, "event": "lighthouse_peer_lost"})
            if code == grpc.StatusCode.UNAVAILABLE:  # a fresh connection next round (the peer may restart)
                self._channels.pop(view.address, None)
                await channel.close(None)
            return PeerView(view.address, view.position, view.state, view.seen_at, problem)
        return PeerView(view.address, view.position, PeerState.from_pb(answer), time.monotonic(), "")

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(None)
