"""A bidirectional stream on the frames wire (ft_core.control.frames), for the lighthouse's HeartbeatStream.

`FrameStreamCall` has the shape of the grpc.aio call the heartbeat stream reads (initial_metadata,
read -> message or grpc.aio.EOF, cancel; a non-OK end raises a grpc.RpcError with code() and details());
its writes go through DirectOutbox (write_nowait, an empty frame to half-close), so the stream's logic (heartbeats, quorum polls, PeerLost, redirects, failover) is the
same on both wires. It runs on the caller's asyncio loop: a frame read is parsed in the protocol's
data_received and handed to the waiting reader in the same turn of the loop; a write is one
transport.write, no thread involved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from ft_core.control import frames, rpc

logger = logging.getLogger("ft_core.control.frames")

__all__ = ["GOODBYE", "DirectOutbox", "FrameRpcError", "FrameStreamCall", "QueuedOutbox"]

GOODBYE = object()  # queued by a stream's stop(): the writer sends `leaving`, then half-closes the stream


class FrameRpcError(grpc.RpcError):
    """A stream on the frames wire ended with a status other than OK (as grpc.aio raises it)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _End:
    __slots__ = ("code", "details")

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details


_CANCELLED = _End(grpc.StatusCode.CANCELLED, "cancelled by the client")


class _StreamProtocol(frames.FrameReader):
    def __init__(self, deserialize: Callable[[bytes], Any]) -> None:
        super().__init__()
        self._deserialize = deserialize
        self.transport: asyncio.Transport | None = None
        loop = asyncio.get_running_loop()
        self.inbox = frames.Mailbox(loop)  # messages, then one _End
        self.headers: asyncio.Future = loop.create_future()
        self.ended = False
        self.handler: Callable[[Any], None] | None = None  # set: messages go to it as they are read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def frame_received(self, body: bytes) -> None:
        if self.ended:
            return
        kind = body[:1]
        if kind == frames.STREAM_MESSAGE:
            self._deliver(self._deserialize(body[1:]))
        elif kind == frames.STREAM_HEADERS:
            self._settle_headers()
        else:  # the status at the stream's end, or a plain reply: the hello was refused
            code, details, _ = frames.parse_reply(body[1:] if kind == frames.STREAM_END else body)
            self.end(code, details)

    def frame_too_long(self, length: int) -> None:
        self.end(grpc.StatusCode.RESOURCE_EXHAUSTED, f"frame of {length} bytes is over {frames.MAX_FRAME}")

    def _deliver(self, message: Any) -> None:
        if self.handler is None:
            self.inbox.put_nowait(message)
            return
        try:
            self.handler(message)
        except Exception:  # a bug in the handler must not take the connection down with it; record it
            logger.exception("frames stream message handler failed")

    def _settle_headers(self) -> None:
        if not self.headers.done():
            self.headers.set_result(())

    def end(self, code: grpc.StatusCode, details: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.stop_reading()
        self.inbox.put_nowait(_End(code, details))
        self._settle_headers()
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.end(grpc.StatusCode.UNAVAILABLE, f"connection to the lighthouse's frames port lost ({exc or 'closed'})")


class FrameStreamCall:
    """One stream method call on a frames port; made by `open`."""

    def __init__(self, protocol: _StreamProtocol) -> None:
        self._protocol = protocol
        self._end: _End | None = None

    @classmethod
    async def open(cls, host: str, port: int, method: str, token: str | None, deserialize: Callable[[bytes], Any],
                   timeout_s: float, tls: rpc.TLSConfig | None = None) -> FrameStreamCall:
        """Connect (within `timeout_s`: OSError or asyncio.TimeoutError otherwise) and open `method`."""
        loop = asyncio.get_running_loop()
        context = rpc.client_ssl_context(tls)
        _, protocol = await asyncio.wait_for(loop.create_connection(
            lambda: _StreamProtocol(deserialize), host, port, ssl=context,
            server_hostname=host if context is not None else None), timeout_s)
        assert protocol.transport is not None
        protocol.transport.write(frames.hello(token) + frames.request_frame(method, b"", timeout_s))
        return cls(protocol)

    def on_message(self, handler: Callable[[Any], None]) -> None:
        """From now on hand each message to `handler` as it is read (on the loop, in the read's own turn);
        messages already read go to it first, in order; read() then returns only the end."""
        protocol = self._protocol
        waiting = []
        while not protocol.inbox.empty():
            waiting.append(protocol.inbox.get_nowait())
        protocol.handler = handler
        for item in waiting:
            if isinstance(item, _End):
                protocol.inbox.put_nowait(item)
            else:
                protocol._deliver(item)

    async def initial_metadata(self) -> tuple:
        """Once the server opened the stream (or ended it: read() then says how)."""
        return await asyncio.shield(self._protocol.headers)

    def write_nowait(self, message: bytes) -> None:
        """Send one message now (the transport buffers it); InvalidStateError once the stream ended."""
        transport = self._protocol.transport
        if self._protocol.ended or transport is None or transport.is_closing():
            raise asyncio.InvalidStateError("the stream has ended")
        transport.write(frames._frame(message))


    async def read(self) -> Any:
        """The next message; grpc.aio.EOF after an OK end; raises FrameRpcError after any other end."""
        if self._end is None:
            item = await self._protocol.inbox.get()
            if not isinstance(item, _End):
                return item
            self._end = item
        if self._end is _CANCELLED:
            raise asyncio.CancelledError()
        if self._end.code == grpc.StatusCode.OK:
            return grpc.aio.EOF
        raise FrameRpcError(self._end.code, self._end.details)

    def cancel(self) -> bool:
        """End the call now: the connection closes (the server reads end of stream); a read raises
        CancelledError, as a cancelled grpc.aio call's does."""
        if self._protocol.ended:
            return False
        self._protocol.ended = True
        self._protocol.inbox.put_nowait(_CANCELLED)
        self._protocol._settle_headers()
        if self._protocol.transport is not None:
            self._protocol.transport.close()
        return True


class QueuedOutbox(asyncio.Queue):
    """A gRPC stream's outbox: its writer task sends what is queued."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self.last_write = loop.time()  # when the writer last sent something (a quorum request is a heartbeat)

    async def drain(self, call: Any, goodbye: bytes) -> None:
        """The writer task: send what is queued on `call`, in order, until GOODBYE or the call ends."""
        try:
            while True:
                item = await self.get()
                if item is GOODBYE:  # then half-close: the lighthouse logs a clean exit, pushes nothing
                    await call.write(goodbye)
                    await call.done_writing()
                    return
                await call.write(item)
                self.last_write = self._loop.time()  # a quorum request counts as a heartbeat at the lighthouse
        except (grpc.RpcError, asyncio.InvalidStateError):
            return  # the call ended: its reader records why


class DirectOutbox:
    """A frames stream's outbox: each message is written as it is queued, on the loop's thread."""

    def __init__(self, call: FrameStreamCall, goodbye: bytes, loop: asyncio.AbstractEventLoop) -> None:
        self._call = call
        self._goodbye = goodbye
        self._loop = loop
        self.last_write = loop.time()

    def put_nowait(self, item: Any) -> None:
        try:
            if item is GOODBYE:  # then half-close: the lighthouse logs a clean exit, pushes nothing
                self._call.write_nowait(self._goodbye)
                self._call.write_nowait(b"")
                return
            self._call.write_nowait(item)
            self.last_write = self._loop.time()
        except asyncio.InvalidStateError:
            pass  # the call ended: its reader records why
