"""The manager server's gRPC shell, on grpc.aio: one event loop for the calls and the heartbeat stream.

The server runs on the process's heartbeat-stream loop (ft_core.control.heartbeat_stream), the same
loop that carries the group's stream to the lighthouse. A ManagerClient's Quorum call that completes
the round (every call of a one-rank group) is therefore handled without a thread hop: the call
arrives on the loop, its quorum request is written on the stream from the loop, and the answer read
there completes the call. Anything that may block (a rank waiting for the others, the commit vote,
a probe of peers after a failed step, the unary fallback) runs on the server's handler threads. The
PeerLostNotices stream (the group's other ranks subscribed to the notices the heartbeat stream gets,
ft_core.control.notices) lives on the loop too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from ft_core import net, settings
from ft_core.control import frames, notices, rpc
from ft_core.control.manager_client import result_to_pb
from ft_core.control.manager_rounds import QuorumRound
from ft_core.control.proto import ft_pb2, ft_pb2_grpc
from ft_core.control.recovery import QuorumResult
from ft_core.control.types import Quorum
from ft_core.errors import FTError, FTTimeoutError, JobFinishedError, RPCError

logger = logging.getLogger("ft_core.control.manager_server")

__all__ = ["open_frames", "start_server", "stop_server"]

NO_DEADLINE_S = 1e9  # grpcio reports "no deadline" as ~9e18 seconds remaining


async def start_server(server: Any, bind: str, token: str | None) -> tuple[grpc.aio.Server, int]:
    """Build and start the aio gRPC server of `server` (a ManagerServer) on the running loop: (server, port).
    Port 0 when `bind` could not be bound."""
    aio = grpc.aio.server(options=rpc.SERVER_OPTIONS)
    name, handlers = rpc.servicer_handlers(ft_pb2_grpc.add_ManagerServiceServicer_to_server, _ManagerServicer(server))
    aio.add_generic_rpc_handlers((rpc.TokenCheckingHandler(name, handlers, token),))
    port = rpc.add_server_port(aio, bind)  # TLS when FT_TLS_CERT/FT_TLS_KEY are set
    if port:
        await aio.start()
    return aio, port


def open_frames(server: Any, loop: asyncio.AbstractEventLoop) -> tuple[frames.FrameServer | None, str]:
    """Serve the same unary calls on the frames wire too (ft_core.control.frames), on the bind host and the
    server's loop: (frame server, its `hostname:port`); (None, "") when FT_FRAMES=0 or the port cannot be
    bound (logged: the group's ranks then keep to gRPC)."""
    if not frames.enabled():
        return None, ""
    cfg = server.config
    host, _ = net.split_host_port(cfg.bind, "manager bind address")
    port = settings.value("FT_MANAGER_FRAMES_PORT", None)
    _, handlers = rpc.servicer_handlers(ft_pb2_grpc.add_ManagerServiceServicer_to_server, _ManagerServicer(server))
    wire = frames.FrameServer(handlers, cfg.token)
    try:
        bound = asyncio.run_coroutine_threadsafe(wire.start(host, port), loop).result(30)
    except OSError as exc:
        logger.warning("replica group %s: frames port %s could not be bound (%s); its ranks use gRPC only "
                       "(set FT_MANAGER_FRAMES_PORT to a free port, or 0)", cfg.replica_id, port, exc)
        return None, ""
    return wire, net.format_host_port(cfg.hostname, bound)


async def stop_server(aio: grpc.aio.Server, grace: float | None, wire: frames.FrameServer | None) -> None:
    """Stop both wires at once; calls in flight on either get `grace` seconds to answer (a commit round's
    decision reaches every rank even when the rank that completed it stops the server right after)."""
    await asyncio.gather(aio.stop(grace), *([wire.stop(grace or 0.0)] if wire is not None else []))


async def quorum_call(server: Any, request: ft_pb2.ManagerQuorumRequest, timeout_s: float) -> QuorumResult:
    """A remote rank's Quorum call, on the loop: joins the round, and runs it here when it is the last to arrive."""
    loop = asyncio.get_running_loop()
    rnd, entry, timeout_s, lead = server._join_round(request.group_rank, request.step, request.checkpoint_metadata,
                                                     request.shrink_only, timeout_s, request.commit_failures,
                                                     request.commit_quorum_id, request.rebuild,
                                                     request.redo_quorum_id)
    if not lead:
        await loop.run_in_executor(server._handlers, server._wait_round, rnd, entry, timeout_s)
    elif not await _run_round_here(server, rnd):
        await loop.run_in_executor(server._handlers, server._run_round, rnd)
    return server._round_plan(rnd, request.group_rank, request.init_sync)


async def _run_round_here(server: Any, rnd: QuorumRound) -> bool:
    """Run the round on the loop when nothing in it blocks: the stream is open and no peer needs probing.
    False (nothing done) otherwise; the caller then runs it on a handler thread."""
    heartbeat = server._heartbeat
    if heartbeat is None or not heartbeat.connected or not server._use_stream or server._needs_probe(rnd):
        return False
    member, error, deadline = server._round_member(rnd, probe=False)
    quorum: Quorum | None = None
    if member is not None:
        server._wait_notes.begin()
        try:
            quorum = await heartbeat.quorum_async(member, max(deadline - time.monotonic(), 0.001))
        except JobFinishedError as exc:
            error = exc
        except FTError:  # the stream could not carry it, or no answer in time: the full path retries/explains
            quorum = None
        finally:
            server._wait_notes.end()
        if quorum is None and error is None:
            loop = asyncio.get_running_loop()
            try:
                quorum = await loop.run_in_executor(server._handlers, server._lighthouse_quorum, member, deadline)
            except FTError as exc:
                error = exc
    server._finish_round(rnd, quorum, error)
    return True


class _ManagerServicer(ft_pb2_grpc.ManagerServiceServicer):
    """gRPC shell: checks the deadline, calls the server's methods, maps errors to status codes."""

    def __init__(self, server: Any) -> None:
        self._server = server

    @staticmethod
    async def _timeout(context: grpc.aio.ServicerContext, call: str) -> float:
        remaining = context.time_remaining()
        if remaining is None or remaining > NO_DEADLINE_S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{call}: missing deadline; every call to the manager server must set a timeout "
                                f"(ManagerClient always does)")
        return remaining

    @staticmethod
    async def _guard(context: grpc.aio.ServicerContext, work: Awaitable[Any]) -> Any:
        try:
            return await work
        except FTTimeoutError as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except RPCError as exc:
            code = getattr(grpc.StatusCode, exc.code, None) if exc.code else None
            await context.abort(code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.ABORTED, str(exc))
        except FTError as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))

    def _threaded(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """`fn(*args)` on one of the server's handler threads (it may block)."""
        return asyncio.get_running_loop().run_in_executor(self._server._handlers, fn, *args)

    async def Quorum(self, request: ft_pb2.ManagerQuorumRequest, context: grpc.aio.ServicerContext) -> Any:
        timeout = await self._timeout(context, "Quorum")
        result = await self._guard(context, quorum_call(self._server, request, timeout))
        return result_to_pb(result)

    async def ShouldCommit(self, request: ft_pb2.ShouldCommitRequest, context: grpc.aio.ServicerContext) -> Any:
        timeout = await self._timeout(context, "ShouldCommit")
        decision, all_healed, all_redoable = await self._guard(context, self._threaded(
            self._server.vote_round_local, request.group_rank, request.step, request.should_commit, request.healed,
            timeout, request.redoable))
        return ft_pb2.ShouldCommitResponse(should_commit=decision, all_healed=all_healed, all_redoable=all_redoable)

    async def CheckpointMetadata(self, request: ft_pb2.CheckpointMetadataRequest,
                                 context: grpc.aio.ServicerContext) -> Any:
        await self._timeout(context, "CheckpointMetadata")
        value = await self._guard(context, self._threaded(self._server.checkpoint_metadata_local, request.group_rank))
        return ft_pb2.CheckpointMetadataResponse(checkpoint_metadata=value)

    async def Kill(self, request: ft_pb2.KillRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._timeout(context, "Kill")
        await self._guard(context, self._threaded(self._server._kill, request.msg))
        return ft_pb2.KillResponse()

    async def PeerLostNotices(self, request: ft_pb2.PeerLostNoticesRequest,
                              context: grpc.aio.ServicerContext) -> AsyncIterator[ft_pb2.PeerLostNotice]:
        """The group's PeerLost notices for another rank of the group, until the call's deadline
        (ft_core.control.notices); the headers go out once the subscription is registered."""
        await self._timeout(context, "PeerLostNotices")
        subscriber = self._server._notices.subscribe(request.after_seq)
        try:
            await context.send_initial_metadata(())
            async for notice in subscriber:
                yield notices.to_pb(notice)
        finally:
            subscriber.close()
