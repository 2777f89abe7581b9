"""The lighthouse's state, and the shell that feeds it to the pure quorum decision (ft_core.control.quorum).

Thread-safe and free of I/O: the gRPC service and the HTTP status server call into it. Every input
(a Quorum call joining or leaving, a heartbeat, a heartbeat stream opening or breaking, a tick)
updates the state under one lock and re-decides at once, so waiting calls are answered without
polling.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ft_core.errors import ConfigError
from ft_core.control.job_end import FinishedGroup, late_group_problem
from ft_core.control.lighthouse_calls import Issued, Waiter
from ft_core.control.lighthouse_peers import PeerState, PeerView
from ft_core.control.proto import ft_pb2
from ft_core.control.quorum import (
    Joined,
    LighthouseState,
    QuorumConfig,
    Reported,
    decide,
    healthy_replicas,
    prune_heartbeats,
    reported_alive,
    reported_members,
)
from ft_core.control.types import Quorum, QuorumMember
from ft_core.net import split_host_port

logger = logging.getLogger("ft_core.control.lighthouse")

PRUNE_AFTER_TIMEOUTS = 10  # forget a heartbeat this many heartbeat_timeouts after it expired
CLEAN_EXIT = "closed by the replica"  # the `why` of a heartbeat stream its replica ended on purpose

# Called (under the core's lock, on whichever thread made the change) with the replica ids to tell
# and the serialized LighthouseHeartbeatResponse carrying the PeerLost notice.
PeerLostNotifier = Callable[[list[str], bytes], None]


@dataclass(frozen=True)
class LighthouseConfig:
    """Everything a lighthouse needs, resolved once (token: argument, then FT_TOKEN)."""

    bind: str = "127.0.0.1:0"
    http_bind: str | None = "127.0.0.1:0"
    min_replicas: int = 1
    join_timeout_ms: int = 60_000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5_000
    token: str | None = field(default=None, repr=False)
    peers: tuple[str, ...] = ()  # the job's ordered lighthouse list (ft_core.control.lighthouse_peers)

    def __post_init__(self) -> None:
        checks = [(self.min_replicas >= 1, f"min_replicas must be >= 1, got {self.min_replicas}"),
                  (self.join_timeout_ms >= 0, f"join_timeout_ms must be >= 0, got {self.join_timeout_ms}"),
                  (self.quorum_tick_ms > 0, f"quorum_tick_ms must be > 0, got {self.quorum_tick_ms}"),
                  (self.heartbeat_timeout_ms > 0,
                   f"heartbeat_timeout_ms must be > 0, got {self.heartbeat_timeout_ms}")]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"lighthouse: {message}")
        for peer in self.peers:  # each one host:port, as in FT_LIGHTHOUSE
            split_host_port(peer, "lighthouse peer address (--peers / FT_LIGHTHOUSE_PEERS)", default_host=None,
                            hint="pass the job's lighthouse list as in FT_LIGHTHOUSE, e.g. 10.0.0.1:29510,10.0.0.2:29510")

    @property
    def rules(self) -> QuorumConfig:
        return QuorumConfig(self.min_replicas, self.join_timeout_ms, self.heartbeat_timeout_ms)


class LighthouseCore:
    """The lighthouse's state and the shell around the pure decision; thread-safe, no I/O."""

    def __init__(self, config: LighthouseConfig, metrics: Any = None) -> None:
        self.config = config
        self._rules = config.rules
        self._metrics = metrics
        self._lock = threading.Lock()
        self._waiting: dict[str, Joined] = {}
        self._waiters: dict[str, list[Waiter]] = {}
        self._heartbeats: dict[str, float] = {}
        self._streams: dict[str, object] = {}  # replica_id -> token of its current heartbeat stream
        self._dead: dict[str, float] = {}  # replica_id -> when its stream broke; cleared when it heartbeats again
        self._known: dict[str, QuorumMember] = {}  # last member info each replica sent
        self._expired: set[str] = set()  # replicas whose heartbeat expiry was already counted
        self._prev: Quorum | None = None
        self._first_join = float("inf")  # earliest join among the waiting (never later than the true one)
        self._straggler: str | None = None  # a previous-quorum member last seen not waiting
        self._quorum_id = 0
        self._issued = 0
        self._last_reason = ""
        self._closed = False
        self._first_seen: dict[str, float] = {}  # replica_id -> when it last came alive (rule 8: oldest wins)
        self._reported: dict[str, Reported] = {}  # members of quorums it never issued (rule 10)
        self._holders: dict[str, int] = {}  # replica_id -> highest step it brought to a quorum issued here (rule 9)
        self._gave_up: dict[str, int] = {}  # replica_id -> the step attempt (quorum id) it will not redo (rule 11)
        self._serving_since = time.monotonic()  # started, or took over from standing by (rule 12)
        self._warned_refused: set[tuple[str, str]] = set()  # (refused, older) pairs already logged
        self._notified: set[tuple[int, str]] = set()  # (quorum_id, lost replica) already pushed
        self._notifier: PeerLostNotifier | None = None
        self._finished: dict[str, FinishedGroup] = {}  # groups that ended training (in memory: this process only)
        self.lighthouse_id = secrets.token_hex(8)  # recognises itself in its peer list (lighthouse_peers)
        self.address = ""  # the address clients dial, set once the server listens
        self._awaiting_peers = bool(config.peers)  # no quorum before the first look at the peers
        self._redirect: str | None = None  # while standing by: the answer naming the active lighthouse
        self._standing_by_for = ""
        self._peer_views: list[dict[str, Any]] = []

    # -- inputs -------------------------------------------------------------------------------

    def join(self, waiter: Waiter) -> None:
        """A Quorum call arrived: upsert the member and decide at once.

        It counts as a heartbeat, except from a replica whose heartbeat stream broke and has not
        reopened: such a call may come from the dead connection, handled after the stream's end.
        """
        now = time.monotonic()
        member = waiter.member
        with self._lock:
            rid = member.replica_id
            if self._redirect is not None:
                waiter.redirect = self._redirect
                waiter.wake()
                return
            if self._finished and self._refuse_late_locked([waiter], now):
                return
            if member.last_quorum_replica_ids:
                if member.last_quorum_id > self._quorum_id:
                    self._learn_reported_locked(member, now)
                member = waiter.member = member.without_last_quorum()
            if rid not in self._dead:
                self._came_alive_locked(rid, now)
                self._heartbeats[rid] = now
                self._expired.discard(rid)
            self._known[rid] = member
            before = self._waiting.get(rid)
            joined_at = before.joined_at if before else now
            self._add_waiting_locked(Joined(member, joined_at))
            self._waiters.setdefault(rid, []).append(waiter)
            if member.shrink_only or not self._still_waiting_locked(now):  # a redo (rare) may be answered now
                self._decide_locked(now)

    def _learn_reported_locked(self, member: QuorumMember, now: float) -> None:
        """Rule 10: `member` took part in a quorum this lighthouse never issued; remember that quorum's members."""
        new = reported_members(self._reported, member, self._quorum_id, now)
        if not new:
            return
        self._reported.update(new)
        pending = sorted(rid for rid in new if rid != member.replica_id and rid not in self._waiting)
        logger.warning("replica %s reports quorum %d, which this lighthouse never issued (its latest is %d: it "
                       "restarted or took over); no quorum until that quorum's members ask for one, or stop "
                       "heartbeating (one never heard from: heartbeat timeout %d ms): %s", member.replica_id,
                       member.last_quorum_id, self._quorum_id, self._rules.heartbeat_timeout_ms, pending or "none",
                       extra={"replica_id": member.replica_id, "quorum_id": member.last_quorum_id,
                              "replica_ids": sorted(new), "event": "quorum_reported"})

    def finished(self, replica_id: str, step: int, quorum_id: int) -> None:
        """`replica_id` ended its training normally at `step`: from now on a group joining behind it alone is refused,
        and so is one already waiting (it joined while the finished group still trained)."""
        with self._lock:
            self._finished[replica_id] = FinishedGroup(replica_id, step, quorum_id, int(time.time() * 1000))
            now = time.monotonic()
            for rid in list(self._waiting):
                waiters = self._waiters.get(rid, [])
                if waiters and self._refuse_late_locked(waiters, now):
                    self._waiting.pop(rid, None)
                    self._waiters.pop(rid, None)
        logger.info("replica %s finished training at step %d (last quorum %d); a group that joins later behind "
                    "step %d with no live peer at it is refused", replica_id, step, quorum_id, step,
                    extra={"replica_id": replica_id, "step": step, "event": "replica_finished"})

    def _refuse_late_locked(self, waiters: list[Waiter], now: float) -> bool:
        """The job finished ahead of these calls of one member and no live group can heal it: answer them with
        the refusal."""
        member = waiters[-1].member
        live = {rid: m.step for rid, m in self._known.items() if rid != member.replica_id
                and rid not in self._finished and now - self._heartbeats.get(rid, -1e18) < self._rules.heartbeat_timeout_s}
        refusal = late_group_problem(member, self._finished, live)
        if refusal is None:
            return False
        logger.warning("replica %s refused: %s", member.replica_id, refusal,
                       extra={"replica_id": member.replica_id, "event": "replica_late"})
        for waiter in waiters:
            waiter.refusal = refusal
            waiter.wake()
        return True

    def quorum_status(self) -> str:
        """Why no quorum is issued now (or that one is), as /status and `ftl status` give it."""
        with self._lock:
            return self._reason_locked(decide(self._state_locked(), time.monotonic(), self._rules).reason)

    def _reason_locked(self, reason: str) -> str:
        if self._redirect is not None:
            return self._redirect
        if self._awaiting_peers:
            return f"asking the peer lighthouses {','.join(self.config.peers)} who serves the job"
        return reason

    # -- peers (ft_core.control.lighthouse_peers) ----------------------------------------------

    @property
    def redirect(self) -> str | None:
        """While this lighthouse stands by: the UNAVAILABLE answer naming the active one; None while it serves."""
        return self._redirect

    def peer_state(self) -> PeerState:
        """What this lighthouse tells its peers: its live members and the highest step they hold."""
        now = time.monotonic()
        with self._lock:
            live = healthy_replicas(self._heartbeats, now, self._rules)
            steps = [self._known[rid].step for rid in live if rid in self._known]
            return PeerState(self.lighthouse_id, self.address, len(live), max(steps, default=0), self._quorum_id,
                             self._standing_by_for)

    def set_peer_picture(self, active: PeerView | None, message: str, views: list[dict[str, Any]]) -> None:
        """The peer watch's verdict: stand by for `active` (turning every member away) or serve (None)."""
        now = time.monotonic()
        with self._lock:
            self._peer_views = views
            first, self._awaiting_peers = self._awaiting_peers, False
            target = active.address if active is not None else ""
            if target == self._standing_by_for:
                self._redirect = message or None
                if first and self._waiting and not self._closed:
                    self._decide_locked(now)
                return
            self._standing_by_for, self._redirect = target, message or None
            if active is None:
                self._serving_since = now
                logger.warning("lighthouse %s serves the job again: no reachable peer lighthouse outranks it",
                               self.address, extra={"event": "lighthouse_active"})
                if self._waiting and not self._closed:
                    self._decide_locked(now)
                return
            turned = sorted(set(self._heartbeats) | set(self._waiting))
            held = active.state
            logger.warning("lighthouse %s stands by for %s, which holds the job (%d live member(s) at step %d); "
                           "turning away %d member(s) %s and every later one, to go there", self.address, target,
                           held.live_members if held else 0, held.max_step if held else 0, len(turned), turned,
                           extra={"event": "lighthouse_redirect", "active": target, "replica_ids": turned})
            for waiters in self._waiters.values():
                for waiter in waiters:
                    waiter.redirect = message
                    waiter.wake()
            for table in (self._waiting, self._heartbeats, self._streams, self._first_seen, self._known, self._dead,
                          self._reported, self._holders, self._gave_up):
                table.clear()
            self._expired.clear()

    def _came_alive_locked(self, rid: str, now: float) -> None:
        """Before a heartbeat is recorded: a replica absent or expired until now is newly alive (rule 8 ages)."""
        seen = self._heartbeats.get(rid)
        if seen is None or now - seen >= self._rules.heartbeat_timeout_s:
            self._first_seen[rid] = now

    def set_peer_lost_notifier(self, notifier: PeerLostNotifier | None) -> None:
        """Where PeerLost notices go (the gRPC service writes them on the members' heartbeat streams)."""
        with self._lock:
            self._notifier = notifier

    def _lost_locked(self, rid: str, reason: str) -> None:
        """`rid` was dropped: if it is in the current quorum, tell the quorum's other members at once, so
        their collectives of that quorum fail now instead of at their timeout (DESIGN.md section 4, Push)."""
        prev = self._prev
        notifier = self._notifier
        if prev is None or notifier is None or self._closed:
            return
        key = (prev.quorum_id, rid)
        if key in self._notified or rid not in prev.replica_ids:
            return
        self._notified.add(key)
        recipients = [p.replica_id for p in prev.participants if p.replica_id != rid and p.replica_id in self._streams]
        if not recipients:
            return
        payload = ft_pb2.LighthouseHeartbeatResponse(peer_lost=ft_pb2.PeerLost(
            quorum_id=prev.quorum_id, replica_id=rid, reason=reason)).SerializeToString()
        logger.info("replica %s lost from quorum %d (%s): telling %d member(s)", rid, prev.quorum_id, reason,
                    len(recipients), extra={"replica_id": rid, "quorum_id": prev.quorum_id, "event": "peer_lost"})
        try:
            notifier(recipients, payload)
        except Exception:  # a notice is an optimisation: the members' own timeouts still bound the step
            logger.exception("PeerLost notice for %s could not be sent", rid)

    def _add_waiting_locked(self, joined: Joined) -> None:
        self._waiting[joined.member.replica_id] = joined
        first = joined.joined_at if len(self._waiting) == 1 else min(self._first_join, joined.joined_at)
        self._first_join = first

    def leave(self, waiter: Waiter, cancelled: bool = False) -> None:
        """A Quorum call ended (answered, deadline, or `cancelled`: the caller went away): stop waiting for it.

        A cancelled call from a replica without an open heartbeat stream also withdraws the heartbeat
        its join counted: the caller's process may have died before its stream connected, and nothing
        else would tell us (survivors would wait heartbeat_timeout for it).
        """
        with self._lock:
            rid = waiter.member.replica_id
            waiters = self._waiters.get(rid)
            if waiters and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[rid]
                    self._waiting.pop(rid, None)
                    if cancelled and rid not in self._streams and self._heartbeats.pop(rid, None) is not None:
                        self._expired.discard(rid)
                        self._first_seen.pop(rid, None)
                        logger.info("replica %s treated as dead: its quorum call was cancelled and it has no "
                                    "heartbeat stream", rid, extra={"replica_id": rid, "event": "replica_dead"})
                        self._lost_locked(rid, "its quorum call was cancelled and it has no heartbeat stream")
                    if not self._closed:
                        self._decide_locked(time.monotonic())

    def heartbeat(self, replica_id: str) -> None:
        """A heartbeat (unary or stream message): the replica is alive now."""
        now = time.monotonic()
        with self._lock:
            if self._redirect is not None:
                return  # standing by: the service turns the member away
            self._dead.pop(replica_id, None)
            seen = self._heartbeats.get(replica_id)
            self._heartbeats[replica_id] = now
            revived = seen is None or now - seen >= self._rules.heartbeat_timeout_s
            if not revived:
                return
            self._first_seen[replica_id] = now
            self._expired.discard(replica_id)
            waiters = self._waiters.get(replica_id)
            if waiters and replica_id not in self._waiting:  # declared dead while its call still waited
                self._add_waiting_locked(Joined(waiters[-1].member, now))
            if replica_id in self._waiting or (replica_id in self._reported and self._waiting):  # rule 10's wait ends
                self._decide_locked(now)

    def gave_up(self, replica_id: str, quorum_id: int) -> None:
        """`replica_id` failed to commit the step it attempted in quorum `quorum_id` and will not redo it: a redo of
        that attempt waiting for it goes on without it (rule 11)."""
        with self._lock:
            if self._redirect is not None or quorum_id <= 0:
                return
            self._gave_up[replica_id] = quorum_id
            logger.info("replica %s gave up its step attempted in quorum %d (its commit failed): a redo of that "
                        "attempt does not wait for it", replica_id, quorum_id,
                        extra={"replica_id": replica_id, "quorum_id": quorum_id, "event": "attempt_given_up"})
            if self._waiting and not self._closed:
                self._decide_locked(time.monotonic())

    def stream_opened(self, replica_id: str, token: object) -> None:
        """A heartbeat stream sent its first message: it is now this replica's liveness signal."""
        with self._lock:
            if self._redirect is not None:
                return
            self._streams[replica_id] = token
            self._dead.pop(replica_id, None)
        self.heartbeat(replica_id)

    def stream_closed(self, replica_id: str, token: object, why: str) -> None:
        """A heartbeat stream broke or closed: the replica is gone now, not after heartbeat_timeout.

        `why` == CLEAN_EXIT: the replica ended its stream itself (a clean exit, logged as such); anything
        else is a death, pushed to the other members of the current quorum."""
        with self._lock:
            if self._closed or self._streams.get(replica_id) is not token:
                return  # shutting down, or a newer stream of the same replica took over
            del self._streams[replica_id]
            self._dead[replica_id] = time.monotonic()
            self._heartbeats.pop(replica_id, None)
            self._first_seen.pop(replica_id, None)
            self._waiting.pop(replica_id, None)
            self._expired.discard(replica_id)
            if replica_id not in self._waiters:
                self._known.pop(replica_id, None)
            if why == CLEAN_EXIT:
                logger.info("replica %s left: it closed its heartbeat stream (clean exit)", replica_id,
                            extra={"replica_id": replica_id, "event": "replica_left"})
            else:
                if self._metrics is not None:
                    self._metrics.stream_deaths.inc()
                logger.info("replica %s declared dead: heartbeat stream %s", replica_id, why,
                            extra={"replica_id": replica_id, "event": "replica_dead"})
                self._lost_locked(replica_id, f"heartbeat stream {why}")
            if self._waiting:
                self._decide_locked(time.monotonic())

    def tick(self) -> None:
        """Periodic: count expired heartbeats, prune long-expired ones, re-decide for waiters."""
        now = time.monotonic()
        timeout = self._rules.heartbeat_timeout_s
        with self._lock:
            for rid, seen in self._heartbeats.items():
                if now - seen >= timeout and rid not in self._expired:
                    self._expired.add(rid)
                    if self._metrics is not None:
                        self._metrics.heartbeats_expired.inc()
                    logger.info("replica %s heartbeat expired (silent for %.2f s)", rid, now - seen,
                                extra={"replica_id": rid, "event": "heartbeat_expired"})
                    self._lost_locked(rid, f"heartbeat expired (silent for {now - seen:.2f} s)")
            for rid in prune_heartbeats(self._heartbeats, now, PRUNE_AFTER_TIMEOUTS * timeout):
                del self._heartbeats[rid]
                self._expired.discard(rid)
                self._first_seen.pop(rid, None)
            if self._warned_refused:
                self._warned_refused = {pair for pair in self._warned_refused
                                        if pair[0] in self._heartbeats and pair[1] in self._heartbeats}
            for rid in [r for r in self._known if r not in self._heartbeats and r not in self._waiters]:
                del self._known[rid]
            for table in (self._holders, self._gave_up):  # rules 9 and 11: only for members still heartbeating
                for rid in [r for r in table if r not in self._heartbeats]:
                    del table[rid]
            for rid in prune_heartbeats(self._dead, now, PRUNE_AFTER_TIMEOUTS * timeout):
                del self._dead[rid]
            if self._reported:  # kept while rule 10 counts them: heartbeating, or within a timeout of the report
                self._reported = {rid: known for rid, known in self._reported.items()
                                  if reported_alive(known, self._heartbeats.get(rid), now, timeout)}
            if self._waiting:
                self._decide_locked(now)

    def refused_by(self, replica_id: str) -> str | None:
        """The older live replica `replica_id` was refused in favour of (rule 8), if it was."""
        with self._lock:
            return next((older for refused, older in self._warned_refused if refused == replica_id), None)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wake every waiting call so the server can stop; later stream closes are ignored."""
        with self._lock:
            self._closed = True
            for waiters in self._waiters.values():
                for waiter in waiters:
                    waiter.wake()

    # -- decision -----------------------------------------------------------------------------

    def _still_waiting_locked(self, now: float) -> bool:
        """A cheap sufficient test that decide() would keep waiting: True only when it surely would.

        While members of the previous quorum are still to join, every join but the last would run an
        O(members) decide() that waits (no fast quorum without them; rule 4 waits for a healthy
        straggler until join_timeout), making a round O(members^2). A healthy member of the previous
        quorum that has not joined, with the earliest join younger than join_timeout, proves the wait.
        """
        prev = self._prev
        if prev is None or now - self._first_join >= self._rules.join_timeout_s:
            return False
        witness = self._straggler
        if witness is None or witness in self._waiting:
            witness = next((m.replica_id for m in prev.participants if m.replica_id not in self._waiting), None)
            self._straggler = witness
        if witness is None:
            return False
        seen = self._heartbeats.get(witness)
        return seen is not None and now - seen < self._rules.heartbeat_timeout_s

    def _state_locked(self) -> LighthouseState:
        return LighthouseState(self._waiting, self._heartbeats, self._prev, self._quorum_id, self._first_seen,
                               self._reported, self._holders, self._gave_up, self._serving_since)

    def _decide_locked(self, now: float) -> None:
        if self._awaiting_peers or self._redirect is not None:
            return  # no quorum before the first look at the peers, nor while standing by
        decision = decide(self._state_locked(), now, self._rules)
        if decision.reason != self._last_reason:
            self._last_reason = decision.reason
            logger.debug("quorum status: %s", decision.reason)
        for refused, older in decision.refused.items():
            if (refused, older) not in self._warned_refused:
                self._warned_refused.add((refused, older))
                logger.warning("replica %s refused: its replica group already has a live member, %s; it may take "
                               "part once %s is gone (stop the old incarnation's processes if it should be)",
                               refused, older, older,
                               extra={"replica_id": refused, "older_replica_id": older, "event": "replica_refused"})
        for rid, answer in decision.excluded.items():  # rule 2: no quorum can include it; answered now
            self._waiting.pop(rid, None)
            logger.warning("replica %s answered at once: %s", rid, answer,
                           extra={"replica_id": rid, "event": "shrink_only_excluded"})
            for waiter in self._waiters.pop(rid, ()):
                waiter.excluded = answer
                waiter.wake()
        if decision.participants is None:
            return
        quorum = Quorum(decision.quorum_id, decision.participants, created_unix_ms=int(time.time() * 1000))
        first_join = min(self._waiting[m.replica_id].joined_at for m in quorum.participants)
        changed = quorum.quorum_id != self._quorum_id or self._prev is None
        if changed:
            self._notified.clear()  # notices concern the current quorum only
        self._prev = quorum
        self._straggler = None  # a witness of the last quorum's wait, maybe not a member of this one
        self._quorum_id = quorum.quorum_id
        if self._reported:  # its own quorum supersedes what members reported of older ones (rule 10)
            self._reported = {rid: known for rid, known in self._reported.items() if known.quorum_id > quorum.quorum_id}
        self._issued += 1
        issued = Issued(quorum)
        for member in quorum.participants:
            if member.step > self._holders.get(member.replica_id, -1):
                self._holders[member.replica_id] = member.step
            self._gave_up.pop(member.replica_id, None)  # rule 11's note has served: it is in a quorum again
            self._waiting.pop(member.replica_id, None)
            for waiter in self._waiters.pop(member.replica_id, ()):
                waiter.issued = issued
                waiter.wake()
        if self._metrics is not None:
            self._metrics.quorum_latency.observe(now - first_join)
            self._metrics.quorums_issued.inc()
        log = logger.info if changed else logger.debug
        log("quorum %d issued with %d participants %s (%s)", quorum.quorum_id, len(quorum.participants),
            quorum.replica_ids, decision.reason,
            extra={"quorum_id": quorum.quorum_id, "replica_ids": quorum.replica_ids, "event": "quorum"})

    # -- reads --------------------------------------------------------------------------------

    def counts(self) -> tuple[int, int, int]:
        """(healthy members, participants of the last quorum, quorum_id) for the metrics gauges."""
        with self._lock:
            healthy = len(healthy_replicas(self._heartbeats, time.monotonic(), self._rules))
            return healthy, len(self._prev.participants) if self._prev else 0, self._quorum_id

    def member_address(self, replica_id: str) -> str | None:
        """The manager address a replica last reported (for the dashboard's Kill)."""
        with self._lock:
            member = self._known.get(replica_id)
            if member is None and self._prev is not None:
                member = next((m for m in self._prev.participants if m.replica_id == replica_id), None)
            return member.address if member is not None and member.address else None

    def status(self) -> dict[str, Any]:
        """The live picture served as /status JSON."""
        now = time.monotonic()
        now_ms = int(time.time() * 1000)
        with self._lock:
            decision = decide(self._state_locked(), now, self._rules)
            reason = self._reason_locked(decision.reason)
            healthy = healthy_replicas(self._heartbeats, now, self._rules)
            steps = [m.step for m in self._known.values()]
            prev = self._prev
            quorum_ids = set(prev.replica_ids) if prev else set()

            def age(rid: str) -> float | None:
                seen = self._heartbeats.get(rid)
                return None if seen is None else round(now - seen, 3)

            def describe(member: QuorumMember) -> dict[str, Any]:
                return {"replica_id": member.replica_id, "step": member.step, "address": member.address,
                        "store_address": member.store_address, "world_size": member.world_size,
                        "shrink_only": member.shrink_only, "commit_failures": member.commit_failures,
                        "data": member.data, "heartbeat_age_s": age(member.replica_id)}

            max_step = max(steps, default=0)
            members = []
            for rid in sorted(set(self._heartbeats) | set(self._waiting)):
                known = self._known.get(rid)
                entry = describe(known) if known else {"replica_id": rid, "step": None, "address": "",
                                                       "store_address": "", "world_size": None,
                                                       "heartbeat_age_s": age(rid)}
                entry.update({"healthy": rid in healthy, "waiting": rid in self._waiting,
                              "stream": rid in self._streams, "in_quorum": rid in quorum_ids,
                              "recovering": known is not None and known.step < max_step,
                              "refused_for": decision.refused.get(rid)})
                members.append(entry)
            quorum = None
            if prev is not None:
                quorum = {"quorum_id": prev.quorum_id, "created_unix_ms": prev.created_unix_ms,
                          "age_s": round((now_ms - prev.created_unix_ms) / 1000.0, 3),
                          "participants": [describe(m) for m in prev.participants]}
            return {"quorum_id": self._quorum_id, "quorum": quorum, "members": members, "max_step": max_step,
                    "reason": reason, "min_replicas": self.config.min_replicas,
                    "join_timeout_ms": self.config.join_timeout_ms,
                    "heartbeat_timeout_ms": self.config.heartbeat_timeout_ms,
                    "quorum_tick_ms": self.config.quorum_tick_ms, "quorums_issued": self._issued,
                    "token_required": bool(self.config.token), "now_unix_ms": now_ms,
                    "peers": list(self._peer_views), "standing_by_for": self._standing_by_for,
                    "finished": [{"replica_id": f.replica_id, "step": f.step, "quorum_id": f.quorum_id,
                                  "at_unix_ms": f.at_unix_ms} for f in self._finished.values()]}
