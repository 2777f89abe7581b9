"""The lighthouse's state, and the shell that feeds it to the pure quorum decision (ft_core.control.quorum).

Thread-safe and free of I/O: the gRPC service and the HTTP status server call into it. Every input
(a Quorum call joining or leaving, a heartbeat, a heartbeat stream opening or breaking, a tick)
updates the state under one lock and re-decides at once, so waiting calls are answered without
polling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ft_core.errors import ConfigError
from ft_core.control.proto import ft_pb2
from ft_core.control.quorum import Joined, LighthouseState, QuorumConfig, decide, healthy_replicas, prune_heartbeats
from ft_core.control.types import Quorum, QuorumMember

logger = logging.getLogger("ft_core.control.lighthouse")

PRUNE_AFTER_TIMEOUTS = 10  # forget a heartbeat this many heartbeat_timeouts after it expired


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

    def __post_init__(self) -> None:
        checks = [(self.min_replicas >= 1, f"min_replicas must be >= 1, got {self.min_replicas}"),
                  (self.join_timeout_ms >= 0, f"join_timeout_ms must be >= 0, got {self.join_timeout_ms}"),
                  (self.quorum_tick_ms > 0, f"quorum_tick_ms must be > 0, got {self.quorum_tick_ms}"),
                  (self.heartbeat_timeout_ms > 0,
                   f"heartbeat_timeout_ms must be > 0, got {self.heartbeat_timeout_ms}")]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"lighthouse: {message}")

    @property
    def rules(self) -> QuorumConfig:
        return QuorumConfig(self.min_replicas, self.join_timeout_ms, self.heartbeat_timeout_ms)


class Issued:
    """An issued quorum and its response, serialized once for all its participants."""

    __slots__ = ("_lock", "_response", "quorum")

    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum
        self._lock = threading.Lock()
        self._response: bytes | None = None

    def response(self) -> bytes:
        with self._lock:
            if self._response is None:
                self._response = ft_pb2.LighthouseQuorumResponse(quorum=self.quorum.to_pb()).SerializeToString()
            return self._response


class Waiter:
    """One in-flight Quorum call; `wake` is called (under the core's lock) once it has an answer or must end."""

    __slots__ = ("issued", "member", "wake")

    def __init__(self, member: QuorumMember, wake: Callable[[], None]) -> None:
        self.member = member
        self.issued: Issued | None = None
        self.wake = wake


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
            if rid not in self._dead:
                self._heartbeats[rid] = now
                self._expired.discard(rid)
            self._known[rid] = member
            before = self._waiting.get(rid)
            joined_at = before.joined_at if before else now
            self._add_waiting_locked(Joined(member, joined_at))
            self._waiters.setdefault(rid, []).append(waiter)
            if not self._still_waiting_locked(now):
                self._decide_locked(now)

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
                        logger.info("replica %s treated as dead: its quorum call was cancelled and it has no "
                                    "heartbeat stream", rid, extra={"replica_id": rid, "event": "replica_dead"})
                    if not self._closed:
                        self._decide_locked(time.monotonic())

    def heartbeat(self, replica_id: str) -> None:
        """A heartbeat (unary or stream message): the replica is alive now."""
        now = time.monotonic()
        with self._lock:
            self._dead.pop(replica_id, None)
            seen = self._heartbeats.get(replica_id)
            self._heartbeats[replica_id] = now
            revived = seen is None or now - seen >= self._rules.heartbeat_timeout_s
            if not revived:
                return
            self._expired.discard(replica_id)
            waiters = self._waiters.get(replica_id)
            if waiters and replica_id not in self._waiting:  # declared dead while its call still waited
                self._add_waiting_locked(Joined(waiters[-1].member, now))
            if replica_id in self._waiting:
                self._decide_locked(now)

    def stream_opened(self, replica_id: str, token: object) -> None:
        """A heartbeat stream sent its first message: it is now this replica's liveness signal."""
        with self._lock:
            self._streams[replica_id] = token
            self._dead.pop(replica_id, None)
        self.heartbeat(replica_id)

    def stream_closed(self, replica_id: str, token: object, why: str) -> None:
        """A heartbeat stream broke or closed: the replica is dead now, not after heartbeat_timeout."""
        with self._lock:
            if self._closed or self._streams.get(replica_id) is not token:
                return  # shutting down, or a newer stream of the same replica took over
            del self._streams[replica_id]
            self._dead[replica_id] = time.monotonic()
            self._heartbeats.pop(replica_id, None)
            self._waiting.pop(replica_id, None)
            self._expired.discard(replica_id)
            if replica_id not in self._waiters:
                self._known.pop(replica_id, None)
            if self._metrics is not None:
                self._metrics.stream_deaths.inc()
            logger.info("replica %s declared dead: heartbeat stream %s", replica_id, why,
                        extra={"replica_id": replica_id, "event": "replica_dead"})
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
            for rid in prune_heartbeats(self._heartbeats, now, PRUNE_AFTER_TIMEOUTS * timeout):
                del self._heartbeats[rid]
                self._expired.discard(rid)
            for rid in [r for r in self._known if r not in self._heartbeats and r not in self._waiters]:
                del self._known[rid]
            for rid in prune_heartbeats(self._dead, now, PRUNE_AFTER_TIMEOUTS * timeout):
                del self._dead[rid]
            if self._waiting:
                self._decide_locked(now)

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
        return LighthouseState(self._waiting, self._heartbeats, self._prev, self._quorum_id)

    def _decide_locked(self, now: float) -> None:
        decision = decide(self._state_locked(), now, self._rules)
        if decision.reason != self._last_reason:
            self._last_reason = decision.reason
            logger.debug("quorum status: %s", decision.reason)
        if decision.participants is None:
            return
        quorum = Quorum(decision.quorum_id, decision.participants, created_unix_ms=int(time.time() * 1000))
        first_join = min(self._waiting[m.replica_id].joined_at for m in quorum.participants)
        changed = quorum.quorum_id != self._quorum_id or self._prev is None
        self._prev = quorum
        self._quorum_id = quorum.quorum_id
        self._issued += 1
        issued = Issued(quorum)
        for member in quorum.participants:
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
            reason = decide(self._state_locked(), now, self._rules).reason
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
                              "recovering": known is not None and known.step < max_step})
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
                    "token_required": bool(self.config.token), "now_unix_ms": now_ms}
