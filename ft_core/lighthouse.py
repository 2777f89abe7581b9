"""The lighthouse: one per job, it decides each step which replica groups train together.

A thin shell around `ft_core.quorum.decide`: `LighthouseCore` holds the state under one lock
and re-decides on every Quorum call, every change of liveness and every tick; the gRPC
service (`LighthouseService`) and the HTTP status server (`ft_core.lighthouse_http`) only
move data in and out of it.

Liveness: a Quorum call or a Heartbeat counts as a heartbeat; a HeartbeatStream keeps a member
alive while it is open and declares it dead at once when it breaks or closes (a dead process
drops its connection), so survivors do not wait heartbeat_timeout for a quorum without it.
heartbeat_timeout still bounds a member that is alive but silent (hung, partitioned).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Iterator

import grpc

from ft_core.env import resolve_str
from ft_core.errors import ConfigError
from ft_core.proto import ft_pb2
from ft_core.quorum import (Joined, LighthouseState, QuorumConfig, decide, healthy_replicas, member_problem,
                            prune_heartbeats, replica_id_problem)
from ft_core.rpc import SERVER_OPTIONS, TokenAuthInterceptor, normalize_address
from ft_core.types import Quorum, QuorumMember

logger = logging.getLogger(__name__)

DEFAULT_BIND = "127.0.0.1:29510"
DEFAULT_HTTP_BIND = "127.0.0.1:29511"
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
    max_workers: int = 1024

    def __post_init__(self) -> None:
        checks = [(self.min_replicas >= 1, f"min_replicas must be >= 1, got {self.min_replicas}"),
                  (self.join_timeout_ms >= 0, f"join_timeout_ms must be >= 0, got {self.join_timeout_ms}"),
                  (self.quorum_tick_ms > 0, f"quorum_tick_ms must be > 0, got {self.quorum_tick_ms}"),
                  (self.heartbeat_timeout_ms > 0,
                   f"heartbeat_timeout_ms must be > 0, got {self.heartbeat_timeout_ms}"),
                  (self.max_workers >= 8, f"max_workers must be >= 8, got {self.max_workers}")]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"lighthouse: {message}")

    @property
    def rules(self) -> QuorumConfig:
        return QuorumConfig(self.min_replicas, self.join_timeout_ms, self.heartbeat_timeout_ms)


class _Issued:
    """An issued quorum and its response, serialized once for all its participants."""

    __slots__ = ("quorum", "_lock", "_response")

    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum
        self._lock = threading.Lock()
        self._response: bytes | None = None

    def response(self) -> bytes:
        with self._lock:
            if self._response is None:
                self._response = ft_pb2.LighthouseQuorumResponse(quorum=self.quorum.to_pb()).SerializeToString()
            return self._response


class _Waiter:
    """One in-flight Quorum call: woken through its event when a quorum containing it is issued."""

    __slots__ = ("member", "event", "issued")

    def __init__(self, member: QuorumMember) -> None:
        self.member = member
        self.event = threading.Event()
        self.issued: _Issued | None = None


class LighthouseCore:
    """The lighthouse's state and the shell around the pure decision; thread-safe, no I/O."""

    def __init__(self, config: LighthouseConfig, metrics: Any = None) -> None:
        self.config = config
        self._rules = config.rules
        self._metrics = metrics
        self._lock = threading.Lock()
        self._waiting: dict[str, Joined] = {}
        self._waiters: dict[str, list[_Waiter]] = {}
        self._heartbeats: dict[str, float] = {}
        self._streams: dict[str, object] = {}  # replica_id -> token of its current heartbeat stream
        self._known: dict[str, QuorumMember] = {}  # last member info each replica sent
        self._expired: set[str] = set()  # replicas whose heartbeat expiry was already counted
        self._prev: Quorum | None = None
        self._quorum_id = 0
        self._issued = 0
        self._last_reason = ""
        self._closed = False

    # -- inputs -------------------------------------------------------------------------------

    def join(self, member: QuorumMember) -> _Waiter:
        """A Quorum call arrived: upsert the member (counts as a heartbeat) and decide at once."""
        now = time.monotonic()
        waiter = _Waiter(member)
        with self._lock:
            rid = member.replica_id
            self._heartbeats[rid] = now
            self._expired.discard(rid)
            self._known[rid] = member
            before = self._waiting.get(rid)
            self._waiting[rid] = Joined(member, before.joined_at if before else now)
            self._waiters.setdefault(rid, []).append(waiter)
            self._decide_locked(now)
        return waiter

    def leave(self, waiter: _Waiter) -> None:
        """A Quorum call ended (answered, deadline, cancel): stop waiting for it."""
        with self._lock:
            rid = waiter.member.replica_id
            waiters = self._waiters.get(rid)
            if waiters and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[rid]
                    self._waiting.pop(rid, None)
                    if not self._closed:
                        self._decide_locked(time.monotonic())

    def heartbeat(self, replica_id: str) -> None:
        """A heartbeat (unary or stream message): the replica is alive now."""
        now = time.monotonic()
        with self._lock:
            seen = self._heartbeats.get(replica_id)
            self._heartbeats[replica_id] = now
            revived = seen is None or now - seen >= self._rules.heartbeat_timeout_s
            if not revived:
                return
            self._expired.discard(replica_id)
            waiters = self._waiters.get(replica_id)
            if waiters and replica_id not in self._waiting:  # declared dead while its call still waited
                self._waiting[replica_id] = Joined(waiters[-1].member, now)
            if replica_id in self._waiting:
                self._decide_locked(now)

    def stream_opened(self, replica_id: str, token: object) -> None:
        """A heartbeat stream sent its first message: it is now this replica's liveness signal."""
        with self._lock:
            self._streams[replica_id] = token
        self.heartbeat(replica_id)

    def stream_closed(self, replica_id: str, token: object, why: str) -> None:
        """A heartbeat stream broke or closed: the replica is dead now, not after heartbeat_timeout."""
        with self._lock:
            if self._closed or self._streams.get(replica_id) is not token:
                return  # shutting down, or a newer stream of the same replica took over
            del self._streams[replica_id]
            self._heartbeats.pop(replica_id, None)
            self._waiting.pop(replica_id, None)
            self._expired.discard(replica_id)
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
                if rid not in self._waiting:
                    self._known.pop(rid, None)
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
                    waiter.event.set()

    # -- decision -----------------------------------------------------------------------------

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
        issued = _Issued(quorum)
        for member in quorum.participants:
            self._waiting.pop(member.replica_id, None)
            for waiter in self._waiters.pop(member.replica_id, ()):
                waiter.issued = issued
                waiter.event.set()
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


_EMPTY = ft_pb2.LighthouseHeartbeatResponse().SerializeToString()


def _raw(response: bytes) -> bytes:
    return response


class _LighthouseService:
    """gRPC shell: validate, hand to the core, wait for the answer within the caller's deadline.

    Responses leave as bytes: a quorum is serialized once for all its participants.
    """

    SERVICE = "ftl.LighthouseService"

    def __init__(self, core: LighthouseCore) -> None:
        self._core = core

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The service's method handlers (as ft_pb2_grpc registers them, with pass-through serializers)."""
        request = ft_pb2.LighthouseHeartbeatRequest.FromString
        return {
            "Quorum": grpc.unary_unary_rpc_method_handler(
                self.Quorum, request_deserializer=ft_pb2.LighthouseQuorumRequest.FromString,
                response_serializer=_raw),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                self.Heartbeat, request_deserializer=request, response_serializer=_raw),
            "HeartbeatStream": grpc.stream_stream_rpc_method_handler(
                self.HeartbeatStream, request_deserializer=request, response_serializer=_raw),
        }

    def Quorum(self, request: ft_pb2.LighthouseQuorumRequest, context: grpc.ServicerContext) -> bytes:
        member = QuorumMember.from_pb(request.requester) if request.HasField("requester") else None
        problem = member_problem(member)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lighthouse Quorum: {problem}")
        remaining = context.time_remaining()
        if remaining is None or remaining > 10 * 365 * 86400:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "lighthouse Quorum: missing deadline; call it with a timeout (it is a long poll)")
        deadline = time.monotonic() + remaining
        waiter = self._core.join(member)
        context.add_callback(waiter.event.set)  # a cancelled call wakes its waiter at once
        try:
            while waiter.issued is None:
                left = deadline - time.monotonic()
                if left <= 0 or not context.is_active() or self._core.closed:
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED if left <= 0 else grpc.StatusCode.CANCELLED,
                                  f"lighthouse Quorum: no quorum containing {member.replica_id} before the deadline")
                waiter.event.wait(left)
            return waiter.issued.response()
        finally:
            self._core.leave(waiter)

    def Heartbeat(self, request: ft_pb2.LighthouseHeartbeatRequest, context: grpc.ServicerContext) -> bytes:
        problem = replica_id_problem(request.replica_id)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lighthouse Heartbeat: {problem}")
        self._core.heartbeat(request.replica_id)
        return _EMPTY

    def HeartbeatStream(self, request_iterator: Iterator[ft_pb2.LighthouseHeartbeatRequest],
                        context: grpc.ServicerContext) -> Iterator[bytes]:
        token = object()
        replica_id: str | None = None
        why = "closed by the replica"
        try:
            for request in request_iterator:
                problem = replica_id_problem(request.replica_id)
                if problem is None and replica_id is not None and request.replica_id != replica_id:
                    problem = f"one replica per stream: opened by {replica_id}, then got {request.replica_id}"
                if problem is not None:
                    why = "rejected"
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lighthouse HeartbeatStream: {problem}")
                if replica_id is None:
                    replica_id = request.replica_id
                    self._core.stream_opened(replica_id, token)
                else:
                    self._core.heartbeat(replica_id)
                yield _EMPTY
        except grpc.RpcError:
            why = "broke (connection dropped)"
        finally:
            if replica_id is not None:
                self._core.stream_closed(replica_id, token, why)


def split_host_port(addr: str, what: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) into its parts, with a clear error."""
    host, sep, port = normalize_address(addr).rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{what} {addr!r} is not HOST:PORT (e.g. 127.0.0.1:29510; port 0 picks a free one)")
    return host.strip("[]") or "127.0.0.1", int(port)


def client_host(host: str) -> str:
    """The host a client should dial for a server bound to `host`."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


class LighthouseServer:
    """The quorum server: gRPC service + tick thread + HTTP status/metrics; a context manager."""

    def __init__(self, bind: str = "127.0.0.1:0", min_replicas: int = 1, join_timeout_ms: int = 60_000,
                 quorum_tick_ms: int = 100, heartbeat_timeout_ms: int = 5_000, token: str | None = None,
                 http_bind: str | None = "127.0.0.1:0", max_workers: int = 1024) -> None:
        from ft_core.lighthouse_http import LighthouseMetrics, StatusHTTPServer

        self.config = LighthouseConfig(bind=bind, http_bind=http_bind, min_replicas=min_replicas,
                                       join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
                                       heartbeat_timeout_ms=heartbeat_timeout_ms,
                                       token=resolve_str(token, "FT_TOKEN", None), max_workers=max_workers)
        host, port = split_host_port(bind, "lighthouse bind address")
        self.metrics = LighthouseMetrics()
        self.core = LighthouseCore(self.config, self.metrics)
        self.metrics.track(self.core)
        self._stop = threading.Event()
        self._pool = futures.ThreadPoolExecutor(max_workers=self.config.max_workers,
                                                thread_name_prefix="ftl-lighthouse-rpc")
        self._server = grpc.server(self._pool, interceptors=[TokenAuthInterceptor(self.config.token)],
                                   options=SERVER_OPTIONS)
        handlers = _LighthouseService(self.core).handlers()
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_LighthouseService.SERVICE,
                                                                                   handlers),))
        self._server.add_registered_method_handlers(_LighthouseService.SERVICE, handlers)
        try:
            self._port = self._server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        except RuntimeError as exc:
            self._pool.shutdown(wait=False)
            raise ConfigError(f"lighthouse could not bind {bind}: {exc}; is the port in use?") from exc
        if not self._port:
            self._pool.shutdown(wait=False)
            raise ConfigError(f"lighthouse could not bind {bind}; is the port in use?")
        self._address = f"{client_host(host)}:{self._port}"
        self._http: StatusHTTPServer | None = None
        try:
            if self.config.http_bind:
                self._http = StatusHTTPServer(self.config.http_bind, self.core, self.metrics, self.config.token)
            self._server.start()
        except BaseException:
            self._pool.shutdown(wait=False)
            if self._http is not None:
                self._http.shutdown()
            raise
        self._ticker = threading.Thread(target=self._tick_loop, name="ftl-lighthouse-tick", daemon=True)
        self._ticker.start()
        logger.info("lighthouse listening on %s (status %s), %s", self._address, self.http_address() or "off",
                    self.config, extra={"event": "lighthouse_start"})

    def address(self) -> str:
        """The gRPC `host:port` clients dial."""
        return self._address

    def http_address(self) -> str:
        """`http://host:port` of the status page, /status and /metrics ("" when HTTP is off)."""
        return self._http.address() if self._http is not None else ""

    def _tick_loop(self) -> None:
        interval = self.config.quorum_tick_ms / 1000.0
        while not self._stop.wait(interval):
            try:
                self.core.tick()
            except Exception:  # the tick must survive any bug in one round; record it
                logger.exception("lighthouse tick failed")

    def shutdown(self, grace: float = 0.2) -> None:
        """Stop serving: end waiting calls, stop the tick thread and the HTTP server. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.core.close()
        self._server.stop(grace).wait(timeout=grace + 5)
        self._ticker.join(timeout=5)
        if self._http is not None:
            self._http.shutdown()
        self._pool.shutdown(wait=False)
        logger.info("lighthouse on %s stopped", self._address)

    def __enter__(self) -> "LighthouseServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def main(argv: list[str]) -> int:
    """`ftl lighthouse`: run the quorum server until SIGINT/SIGTERM."""
    from rich.console import Console
    from rich.logging import RichHandler

    parser = argparse.ArgumentParser(prog="ftl lighthouse", description="Run the quorum server (one per job).")
    parser.add_argument("--bind", default=DEFAULT_BIND, help=f"gRPC HOST:PORT (default {DEFAULT_BIND})")
    parser.add_argument("--http-bind", default=DEFAULT_HTTP_BIND,
                        help=f"status page / JSON / metrics HOST:PORT (default {DEFAULT_HTTP_BIND}); 'off' disables")
    parser.add_argument("--min-replicas", type=int, default=1, help="smallest quorum outside the fast path")
    parser.add_argument("--join-timeout-ms", type=int, default=60_000, help="how long to wait for stragglers")
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="re-decide this often")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5_000,
                        help="a silent replica is dead after this long")
    parser.add_argument("--token", default=None, help="shared token required on every call (or FT_TOKEN)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    opts = parser.parse_args(argv)
    console = Console(stderr=True)
    logging.basicConfig(level=opts.log_level.upper(), format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server = LighthouseServer(bind=opts.bind, min_replicas=opts.min_replicas,
                                  join_timeout_ms=opts.join_timeout_ms, quorum_tick_ms=opts.quorum_tick_ms,
                                  heartbeat_timeout_ms=opts.heartbeat_timeout_ms, token=opts.token,
                                  http_bind=None if opts.http_bind == "off" else opts.http_bind)
    except ConfigError as exc:
        console.print(f"[red]ftl lighthouse: {exc}[/red]")
        return 2
    with server:
        http = server.http_address()
        console.print(f"[bold green]lighthouse[/bold green] gRPC [cyan]{server.address()}[/cyan]"
                      + (f"  status [cyan]{http}/[/cyan]  JSON {http}/status  metrics {http}/metrics" if http else "")
                      + (f"  [yellow](token required)[/yellow]" if server.config.token else ""))
        console.print(f"min_replicas={opts.min_replicas} join_timeout_ms={opts.join_timeout_ms} "
                      f"heartbeat_timeout_ms={opts.heartbeat_timeout_ms}; Ctrl-C to stop")
        while not stop.wait(1.0):
            pass
        console.print("stopping lighthouse")
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    return 0
