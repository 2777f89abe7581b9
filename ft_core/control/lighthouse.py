"""The lighthouse: one per job, it decides each step which replica groups train together.

A thin shell around `ft_core.control.quorum.decide`: `LighthouseCore` (ft_core.control.lighthouse_state) holds the
state and re-decides on every input; this module serves it over gRPC (grpc.aio on one event loop
in a named thread, so hundreds of open heartbeat streams and long polls cost no thread each) and
over HTTP (ft_core.control.lighthouse_http: status page, /status JSON, /metrics).

Liveness: a Quorum call or a Heartbeat counts as a heartbeat; a HeartbeatStream keeps a member
alive while it is open and declares it dead at once when it breaks (a dead process drops its
connection), so survivors do not wait heartbeat_timeout for a quorum without it; a member that
half-closes its stream has left cleanly. heartbeat_timeout still bounds a member that is alive but
silent (hung, partitioned). When a member of the current quorum dies or goes silent, the others get
a PeerLost notice on their open streams at once, so their managers abort that quorum's collectives.

Quorum long polls travel on the same stream (a `quorum` request answered by its request_id; the
quorum is serialized once and shared by every member's answer); the unary Quorum call stays for
compatibility and as the fallback when no stream is open.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ft_core import settings
from ft_core.errors import ConfigError
from ft_core.control import frames
from ft_core.control.lighthouse_http import LighthouseMetrics, StatusHTTPServer
from ft_core.control.lighthouse_peers import PeerWatch
from ft_core.control.lighthouse_calls import Waiter
from ft_core.control.lighthouse_state import CLEAN_EXIT, LighthouseConfig, LighthouseCore
from ft_core.control.proto import ft_pb2
from ft_core.control.quorum import EXCLUDED_CODE, member_problem, replica_id_problem
from ft_core.control.rpc import SERVER_OPTIONS, TokenCheckingHandler, add_server_port
from ft_core.control.types import QuorumMember
from ft_core.net import bind_problem, dial_host, format_host_port, is_loopback, split_addresses, split_host_port

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_BIND", "DEFAULT_HTTP_BIND", "LighthouseServer", "main"]

DEFAULT_BIND = "127.0.0.1:29510"
DEFAULT_HTTP_BIND = "127.0.0.1:29511"
SERVICE = "ftl.LighthouseService"
_EMPTY = ft_pb2.LighthouseHeartbeatResponse().SerializeToString()
HEARTBEAT_ACK_S = 0.5  # answer a stream's heartbeats at most this often (the client's staleness limit is >= 3 s)


def _raw(response: bytes) -> bytes:
    return response


class _LighthouseService:
    """gRPC shell: validate, hand to the core, wait for the answer within the caller's deadline.

    Runs on the server's event loop. Responses leave as bytes: a quorum is serialized once for
    all its participants.
    """

    def __init__(self, core: LighthouseCore, loop: asyncio.AbstractEventLoop) -> None:
        self._core = core
        self._loop = loop
        self._loop_thread = threading.get_ident()  # built by _start(), on the loop's own thread
        self._outboxes: dict[str, tuple[object, asyncio.Queue]] = {}  # replica_id -> its open stream's outbox
        self.frames_port = 0  # where the same service is served on the frames wire (0: it is not)
        core.set_peer_lost_notifier(self._push)

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
            "Peer": grpc.unary_unary_rpc_method_handler(
                self.Peer, request_deserializer=ft_pb2.LighthousePeerState.FromString, response_serializer=_raw),
        }

    async def Peer(self, request: ft_pb2.LighthousePeerState, context: grpc.aio.ServicerContext) -> bytes:
        """Another lighthouse of the job asks what this one holds (ft_core.control.lighthouse_peers)."""
        return self._core.peer_state().to_pb().SerializeToString()

    def _waker(self, answered: asyncio.Future) -> Callable[[], None]:
        """Wake `answered` from whichever thread the core decides on (nearly always the loop's own)."""
        loop = self._loop

        def settle() -> None:
            if not answered.done():
                answered.set_result(None)

        def wake() -> None:
            if threading.get_ident() == self._loop_thread:
                settle()
            else:
                loop.call_soon_threadsafe(settle)

        return wake

    async def Quorum(self, request: ft_pb2.LighthouseQuorumRequest, context: grpc.aio.ServicerContext) -> bytes:
        member = QuorumMember.from_pb(request.requester) if request.HasField("requester") else None
        problem = member_problem(member)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lighthouse Quorum: {problem}")
        remaining = context.time_remaining()
        if remaining is None or remaining > 10 * 365 * 86400:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "lighthouse Quorum: missing deadline; call it with a timeout (it is a long poll)")
        answered = self._loop.create_future()
        waiter = Waiter(member, self._waker(answered))
        self._core.join(waiter)
        cancelled = False
        try:
            if waiter.refusal is not None:  # the job finished ahead of this group (ft_core.control.job_end)
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, waiter.refusal)
            if waiter.issued is None and waiter.redirect is None and waiter.excluded is None:
                await asyncio.wait((answered,), timeout=max(remaining, 0.0))
            if waiter.issued is None and waiter.refusal is not None:  # refused while it waited: the job finished
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, waiter.refusal)
            if waiter.issued is None and waiter.excluded is not None:  # shrink-only outside the last quorum
                await context.abort(grpc.StatusCode[EXCLUDED_CODE], f"lighthouse Quorum: {waiter.excluded}")
            if waiter.issued is None and waiter.redirect is not None:  # standing by: go to the active lighthouse
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"lighthouse Quorum: {waiter.redirect}")
            if waiter.issued is None:
                code, message = self._no_quorum(member.replica_id)
                await context.abort(code, f"lighthouse Quorum: {message}")
            return waiter.issued.response()
        except asyncio.CancelledError:  # the caller went away: its connection dropped, or it cancelled
            cancelled = True
            raise
        finally:  # answered, deadline, or cancelled
            self._core.leave(waiter, cancelled=cancelled)

    def _no_quorum(self, replica_id: str) -> tuple[grpc.StatusCode, str]:
        """Status and message for a quorum poll that ended unanswered: its deadline passed, or the lighthouse closes."""
        if self._core.closed:
            return grpc.StatusCode.UNAVAILABLE, f"no quorum containing {replica_id} (lighthouse shutting down)"
        older = self._core.refused_by(replica_id)
        why = (f": refused, replica group already has a live member {older}; stop it or wait until it is gone"
               if older else "")
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"no quorum containing {replica_id} before the deadline{why}"

    async def Heartbeat(self, request: ft_pb2.LighthouseHeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> bytes:
        if request.want_frames_port:  # a stream about to open asks where (ft_core.control.frames): no heartbeat
            return ft_pb2.LighthouseHeartbeatResponse(frames_port=self.frames_port).SerializeToString()
        problem = replica_id_problem(request.replica_id)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lighthouse Heartbeat: {problem}")
        if request.finished:  # the group ended its training: recorded, no heartbeat (it is leaving)
            self._core.finished(request.replica_id, request.finished_step, request.finished_quorum_id)
        elif (redirect := self._core.redirect) is not None:  # standing by: the client goes to the active one
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"lighthouse Heartbeat: {redirect}")
        else:
            self._core.heartbeat(request.replica_id)
            if request.gave_up_quorum_id:
                self._core.gave_up(request.replica_id, request.gave_up_quorum_id)
        if request.want_status:
            return ft_pb2.LighthouseHeartbeatResponse(quorum_status=self._core.quorum_status()).SerializeToString()
        return _EMPTY

    def _push(self, recipients: list[str], payload: bytes) -> None:
        """PeerLost notifier of the core: queue `payload` on each recipient's open heartbeat stream."""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self._push, recipients, payload)
            return
        for rid in recipients:
            entry = self._outboxes.get(rid)
            if entry is not None:
                entry[1].put_nowait(payload)

    async def HeartbeatStream(self, requests: AsyncIterator[ft_pb2.LighthouseHeartbeatRequest],
                              context: grpc.aio.ServicerContext) -> None:
        """Heartbeats in, answers and PeerLost notices out. A stream that ends after a `leaving` message is
        a clean exit; any other end (a dropped connection also reads as end-of-stream) is a death.

        Reads with context.read() here and writes from one writer task draining the stream's outbox,
        so a notice for this replica can be queued from any round without racing the answers.
        """
        token = object()
        replica_id: str | None = None
        why = "broke (connection dropped)"
        direct = getattr(context, "direct_outbox", None)  # frames: answers written as queued, no writer task
        outbox: Any = direct() if direct is not None else asyncio.Queue()
        polls: dict[Waiter, asyncio.TimerHandle] = {}  # this stream's quorum polls still waiting -> their deadline
        writer = None if direct is not None else self._loop.create_task(self._write_stream(context, outbox))
        acked = 0.0  # when a heartbeat was last answered (answers only tell the client the stream is alive)
        try:
            # Headers first: a grpc.aio client waits for them before writing, so a write never races the
            # trailers of a rejected call (the client would then see INTERNAL instead of the rejection).
            await context.send_initial_metadata(())
            while True:
                request = await context.read()
                if request is grpc.aio.EOF:
                    break
                problem = replica_id_problem(request.replica_id)
                if problem is None and replica_id is not None and request.replica_id != replica_id:
                    problem = f"one replica per stream: opened by {replica_id}, then got {request.replica_id}"
                if problem is not None:
                    why = "rejected"
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lighthouse HeartbeatStream: {problem}")
                if request.leaving:  # said goodbye: its end of stream is a clean exit, not a death
                    why = CLEAN_EXIT
                    continue
                redirect = self._core.redirect
                if redirect is not None:  # standing by: end the stream; the client goes to the active lighthouse
                    why = "turned away (standing by)"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"lighthouse HeartbeatStream: {redirect}")
                opened = replica_id is None
                if opened:
                    replica_id = request.replica_id
                    self._outboxes[replica_id] = (token, outbox)
                    self._core.stream_opened(replica_id, token)
                if request.HasField("quorum"):  # a long poll on the stream; its join counts as the heartbeat
                    self._stream_quorum(replica_id, request, outbox, polls)
                    continue
                if not opened:
                    self._core.heartbeat(replica_id)
                if request.gave_up_quorum_id:
                    self._core.gave_up(replica_id, request.gave_up_quorum_id)
                now = self._loop.time()
                if opened or now - acked >= HEARTBEAT_ACK_S:
                    acked = now
                    outbox.put_nowait(_EMPTY)
            if writer is not None:
                outbox.put_nowait(None)
                await writer  # flush what is queued, then end the call with OK
        finally:
            # No await in here: a second cancellation must not skip the declaration below. The replica is
            # declared gone first, then its polls are withdrawn (their leave() then finds it gone, so no
            # decision in between sees it as a live straggler).
            if replica_id is not None:
                entry = self._outboxes.get(replica_id)
                if entry is not None and entry[0] is token:
                    del self._outboxes[replica_id]
                self._core.stream_closed(replica_id, token, why)
            for waiter, deadline in list(polls.items()):
                deadline.cancel()
                self._core.leave(waiter, cancelled=True)
                waiter.wake = _no_wake  # (its poll then answers nothing and is freed)
            polls.clear()
            if writer is not None and not writer.done():
                writer.cancel()

    def _stream_quorum(self, replica_id: str, request: ft_pb2.LighthouseHeartbeatRequest, outbox: asyncio.Queue,
                       polls: dict[Waiter, asyncio.TimerHandle]) -> None:
        """One quorum long poll carried on `replica_id`'s heartbeat stream, bounded by its timeout_ms.

        No task per poll: the waiter's wake queues the shared answer on the stream's outbox directly
        (with the request's id), and one timer answers DEADLINE_EXCEEDED if nothing is issued in time.
        A poll withdrawn because its stream ended answers nothing (the replica is gone or falls back)."""
        rid = request.request_id
        member = QuorumMember.from_pb(request.quorum.requester) if request.quorum.HasField("requester") else None
        problem = member_problem(member)
        if problem is None and member.replica_id != replica_id:
            problem = f"a quorum request for {member.replica_id} on the heartbeat stream of {replica_id}"
        if problem is None and request.timeout_ms <= 0:
            problem = "missing deadline: send timeout_ms > 0 (it is a long poll)"
        if problem is not None:
            outbox.put_nowait(_poll_failure(rid, grpc.StatusCode.INVALID_ARGUMENT, problem))
            return
        poll = _StreamPoll(self, rid, outbox, polls)
        waiter = poll.waiter = Waiter(member, poll.wake)
        self._core.join(waiter)  # wakes nothing here: the poll is registered below
        if waiter.refusal is not None:  # the job finished ahead of this group (ft_core.control.job_end)
            poll.end(_refusal(rid, waiter.refusal))
        elif waiter.redirect is not None:  # standing by (ft_core.control.lighthouse_peers)
            poll.end(_poll_failure(rid, grpc.StatusCode.UNAVAILABLE, waiter.redirect))
        elif waiter.excluded is not None:  # shrink-only outside the last quorum: no quorum can include it
            poll.end(_poll_failure(rid, grpc.StatusCode[EXCLUDED_CODE], waiter.excluded))
        elif waiter.issued is not None:  # the last to join: issued at once
            poll.end(waiter.issued.stream_response(rid))
        elif self._core.closed:
            polls[waiter] = self._loop.call_soon(poll.finish)
        else:
            polls[waiter] = self._loop.call_later(request.timeout_ms / 1000.0, poll.finish)

    @staticmethod
    async def _write_stream(context: grpc.aio.ServicerContext, outbox: asyncio.Queue) -> None:
        while True:
            item = await outbox.get()
            if item is None:
                return
            await context.write(item)


def _refusal(rid: int, refusal: str) -> bytes:
    """A stream poll's answer for a group the job finished ahead of (ft_core.control.job_end)."""
    return ft_pb2.LighthouseHeartbeatResponse(request_id=rid, error_code=grpc.StatusCode.OUT_OF_RANGE.name,
                                              error=refusal).SerializeToString()


def _poll_failure(rid: int, code: grpc.StatusCode, message: str) -> bytes:
    return ft_pb2.LighthouseHeartbeatResponse(request_id=rid, error_code=code.name,
                                              error=f"lighthouse Quorum: {message}").SerializeToString()


def _no_wake() -> None:
    """An ended poll's wake: its answer, if any, is already on its stream."""


class _StreamPoll:
    """One quorum long poll on a heartbeat stream: what its wake and deadline need, in one object.

    Its waiter's wake refers back to it; `end` breaks that cycle as the poll ends, so a finished poll is
    freed at once by reference counting. (As closures, each poll left a cycle for the collector: tens of
    thousands of objects a second at a few hundred groups, and a full collection every second.)"""

    __slots__ = ("_service", "_rid", "_outbox", "_polls", "waiter")

    def __init__(self, service: _LighthouseService, rid: int, outbox: Any,
                 polls: dict[Waiter, asyncio.TimerHandle]) -> None:
        self._service = service
        self._rid = rid
        self._outbox = outbox
        self._polls = polls
        self.waiter: Waiter | None = None

    def end(self, answer: bytes | None) -> None:
        """Queue the poll's answer (None: none, its stream is gone) and unlink the poll from its waiter."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            waiter.wake = _no_wake
        if answer is not None:
            self._outbox.put_nowait(answer)

    def finish(self) -> None:
        """The poll ends on the loop: answered, past its deadline, or woken without an answer (lighthouse closing)."""
        waiter = self.waiter
        deadline = self._polls.pop(waiter, None) if waiter is not None else None
        if deadline is None:
            return  # already answered, or withdrawn with its stream
        deadline.cancel()
        if waiter.issued is None:
            self._service._core.leave(waiter)
        if waiter.issued is not None:  # (or issued in the same instant as the leave)
            self.end(waiter.issued.stream_response(self._rid))
        elif waiter.refusal is not None:  # refused while it waited: the job finished ahead of it
            self.end(_refusal(self._rid, waiter.refusal))
        elif waiter.redirect is not None:  # this lighthouse now stands by
            self.end(_poll_failure(self._rid, grpc.StatusCode.UNAVAILABLE, waiter.redirect))
        elif waiter.excluded is not None:  # shrink-only outside the last quorum (rule 2)
            self.end(_poll_failure(self._rid, grpc.StatusCode[EXCLUDED_CODE], waiter.excluded))
        else:
            self.end(_poll_failure(self._rid, *self._service._no_quorum(waiter.member.replica_id)))

    def wake(self) -> None:
        """Under the core's lock: queue the answer, never call back into the core."""
        service, waiter = self._service, self.waiter
        if waiter is None:
            return
        if threading.get_ident() != service._loop_thread:
            service._loop.call_soon_threadsafe(self.finish)
        elif waiter.issued is not None:
            deadline = self._polls.pop(waiter, None)
            if deadline is not None:
                deadline.cancel()
                self.end(waiter.issued.stream_response(self._rid))
        elif waiter in self._polls:
            service._loop.call_soon(self.finish)


class LighthouseServer:
    """The quorum server: gRPC service and tick on an event loop thread, plus HTTP status/metrics.

    A context manager; `shutdown()` ends waiting calls and stops everything it started.
    """

    def __init__(self, bind: str = "127.0.0.1:0", min_replicas: int = 1, join_timeout_ms: int | None = 60_000,
                 quorum_tick_ms: int | None = 100, heartbeat_timeout_ms: int | None = 5_000, token: str | None = None,
                 http_bind: str | None = "127.0.0.1:0", peers: str | list[str] | None = None) -> None:
        # None means the default, as in torchft's LighthouseServer. peers: the job's ordered lighthouse list
        # (this one may be in it), so a standby never splits the job (ft_core.control.lighthouse_peers).
        self.config = LighthouseConfig(bind=bind, http_bind=http_bind, min_replicas=min_replicas,
                                       join_timeout_ms=60_000 if join_timeout_ms is None else join_timeout_ms,
                                       quorum_tick_ms=100 if quorum_tick_ms is None else quorum_tick_ms,
                                       heartbeat_timeout_ms=5_000 if heartbeat_timeout_ms is None else heartbeat_timeout_ms,
                                       token=settings.value("FT_TOKEN", token),
                                       peers=tuple(split_addresses(settings.value(
                                           "FT_LIGHTHOUSE_PEERS", ",".join(peers) if isinstance(peers, list) else peers)
                                           or "")))
        self._host, self._requested_port = split_host_port(bind, "lighthouse bind address", hint="port 0 picks a free one")
        self.metrics = LighthouseMetrics()
        self.core = LighthouseCore(self.config, self.metrics)
        self.metrics.track(self.core)
        self._stopped = False
        self._loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._frames: frames.FrameServer | None = None
        self.frames_port = 0
        self._ticker: asyncio.Task | None = None
        self._peer_watch: PeerWatch | None = None
        self._watcher: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run_loop, name="ftl-lighthouse-grpc", daemon=True)
        self._thread.start()
        self._http: StatusHTTPServer | None = None
        try:
            port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
            if self.config.http_bind:
                self._http = StatusHTTPServer(self.config.http_bind, self.core, self.metrics, self.config.token)
        except BaseException:
            self.shutdown()
            raise
        self._address = format_host_port(dial_host(self._host), port)
        logger.info("lighthouse listening on %s (status %s), %s", self._address, self.http_address() or "off",
                    self.config, extra={"event": "lighthouse_start"})

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _start(self) -> int:
        service = _LighthouseService(self.core, self._loop)
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers((TokenCheckingHandler(SERVICE, service.handlers(), self.config.token),))
        try:
            port = add_server_port(server, format_host_port(self._host, self._requested_port))  # TLS when FT_TLS_CERT/KEY are set
        except RuntimeError as exc:
            raise ConfigError(f"lighthouse could not bind {self.config.bind}: {bind_problem(self.config.bind)}") from exc
        if not port:
            raise ConfigError(f"lighthouse could not bind {self.config.bind}: {bind_problem(self.config.bind)}")
        await server.start()
        self._server = server
        if frames.enabled():  # the heartbeat streams' wire without grpc's thread hops (ft_core.control.frames)
            self._frames = frames.FrameServer(service.handlers(), self.config.token)
            try:
                service.frames_port = await self._frames.start(self._host, settings.value("FT_LIGHTHOUSE_FRAMES_PORT"))
            except OSError as exc:
                self._frames = None
                logger.warning("lighthouse frames port could not be bound (%s); members use gRPC only "
                               "(set FT_LIGHTHOUSE_FRAMES_PORT to a free port, or 0)", exc)
        self.frames_port = service.frames_port
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop(), name="ftl-lighthouse-tick")
        self.core.address = format_host_port(dial_host(self._host), port)
        if self.config.peers:
            self._peer_watch = PeerWatch(self.config.peers, self.core, self.config.token)
            self._watcher = asyncio.get_running_loop().create_task(self._peer_watch.run(), name="ftl-lighthouse-peers")
        return port

    async def _tick_loop(self) -> None:
        interval = self.config.quorum_tick_ms / 1000.0
        while True:
            await asyncio.sleep(interval)
            try:
                self.core.tick()
            except Exception:  # the tick must survive any bug in one round; record it
                logger.exception("lighthouse tick failed")

    async def _stop(self, grace: float) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        if self._peer_watch is not None:
            await self._peer_watch.close()
        if self._frames is not None:
            await self._frames.stop()
        if self._server is not None:
            await self._server.stop(grace)
        # Let every cancelled handler finish before the loop closes (no coroutine left to die at exit).
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.get_running_loop().shutdown_asyncgens()

    def address(self) -> str:
        """The gRPC `host:port` clients dial."""
        return self._address

    def http_address(self) -> str:
        """`http://host:port` of the status page, /status and /metrics ("" when HTTP is off)."""
        return self._http.address() if self._http is not None else ""

    def shutdown(self, grace: float = 0.2) -> None:
        """Stop serving: end waiting calls, stop the tick, the gRPC and the HTTP servers. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.core.close()
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop).result(timeout=grace + 10)
            except Exception:  # keep shutting down the rest; record why this part failed
                logger.exception("lighthouse gRPC server did not stop cleanly")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        if self._http is not None:
            self._http.shutdown()
        logger.info("lighthouse on %s stopped", getattr(self, "_address", self.config.bind))

    def __enter__(self) -> LighthouseServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def frames_port_for(bind: str) -> str:
    """`ftl lighthouse`'s default frames port: its gRPC port + 2 (29512 for 29510), "0" when that is 0."""
    port = split_host_port(bind, "lighthouse bind address")[1]
    return str(port + 2) if port else "0"


def main(argv: list[str]) -> int:
    """`ftl lighthouse`: run the quorum server until SIGINT/SIGTERM."""
    from rich.console import Console
    from rich.logging import RichHandler
    from rich.markup import escape

    parser = argparse.ArgumentParser(prog="ftl lighthouse", description="Run the quorum server (one per job).")
    parser.add_argument("--bind", default=DEFAULT_BIND, help=f"gRPC HOST:PORT (default {DEFAULT_BIND})")
    parser.add_argument("--http-bind", default=DEFAULT_HTTP_BIND,
                        help=f"status page / JSON / metrics HOST:PORT (default {DEFAULT_HTTP_BIND}); 'off' disables")
    parser.add_argument("--frames-port", default=None,
                        help="port of the heartbeat streams' frames wire, on the --bind host (default: the --bind "
                             "port + 2, so 29512, or chosen by the OS when --bind's port is 0; 'off': gRPC only); "
                             "members ask the lighthouse for it")
    parser.add_argument("--min-replicas", type=int, default=1, help="smallest quorum outside the fast path")
    parser.add_argument("--join-timeout-ms", type=int, default=60_000, help="how long to wait for stragglers")
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="re-decide this often")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5_000,
                        help="a silent replica is dead after this long")
    parser.add_argument("--token", default=None, help="shared token required on every call (or FT_TOKEN)")
    parser.add_argument("--peers", default=None,
                        help="the job's ordered lighthouse list, the same as FT_LIGHTHOUSE (or FT_LIGHTHOUSE_PEERS): "
                             "only one of them serves the job, the others send members there")
    parser.add_argument("--tls-cert", default=None,
                        help="PEM certificate: serve gRPC and HTTP over TLS (or FT_TLS_CERT)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (or FT_TLS_KEY)")
    parser.add_argument("--tls-ca", default=None, help="PEM CA that signed the managers' certificates (or FT_TLS_CA)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    opts = parser.parse_args(argv)
    frames_port = None if opts.frames_port == "off" else opts.frames_port or frames_port_for(opts.bind)
    for value, var in ((opts.tls_cert, "FT_TLS_CERT"), (opts.tls_key, "FT_TLS_KEY"), (opts.tls_ca, "FT_TLS_CA"),
                       (frames_port, "FT_LIGHTHOUSE_FRAMES_PORT"), ("0" if frames_port is None else None, "FT_FRAMES")):
        if value:  # this process's TLS settings (an FT_TLS_* variable already set still wins, as everywhere)
            os.environ.setdefault(var, value)
    console = Console(stderr=True)
    if console.is_terminal:
        handler: logging.Handler = RichHandler(console=console, show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:  # a file or a pipe: one plain line per record, never wrapped at the console's width
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=opts.log_level.upper(), handlers=[handler])
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server = LighthouseServer(bind=opts.bind, min_replicas=opts.min_replicas,
                                  join_timeout_ms=opts.join_timeout_ms, quorum_tick_ms=opts.quorum_tick_ms,
                                  heartbeat_timeout_ms=opts.heartbeat_timeout_ms, token=opts.token,
                                  http_bind=None if opts.http_bind == "off" else opts.http_bind, peers=opts.peers)
    except ConfigError as exc:
        console.print(f"[red]ftl lighthouse: {escape(str(exc))}[/red]", soft_wrap=True)
        return 2
    exposed = [a for a in (opts.bind, None if opts.http_bind == "off" else opts.http_bind)
               if a and not is_loopback(split_host_port(a, "bind address")[0])]
    if exposed and not server.config.token:
        logger.warning("listening on %s with no token: anyone who can reach this machine can join the job, read "
                       "its status and kill its groups; set --token or FT_TOKEN", ", ".join(exposed))
    with server:
        http = server.http_address()
        console.print(f"[bold green]lighthouse[/bold green] gRPC [cyan]{server.address()}[/cyan]"
                      + (f" (frames port {server.frames_port})" if server.frames_port else "")
                      + (f"  status [cyan]{http}/[/cyan]  JSON {http}/status  metrics {http}/metrics" if http else "")
                      + ("  [yellow](token required)[/yellow]" if server.config.token else ""))
        console.print(f"min_replicas={opts.min_replicas} join_timeout_ms={opts.join_timeout_ms} "
                      f"heartbeat_timeout_ms={opts.heartbeat_timeout_ms}; Ctrl-C to stop")
        while not stop.wait(1.0):
            pass
        console.print("stopping lighthouse")
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    return 0
