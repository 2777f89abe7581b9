"""Frames: the manager service's unary calls on a plain length-prefixed wire, beside its gRPC port.

Why: a grpc.aio unary call costs ~0.3 ms on a 2-core machine before any of our code runs, most of it
hand-offs between grpc's completion-queue poller, its event-engine threads and the asyncio loop. The
per-step calls of a group's ranks (Quorum, ShouldCommit) need none of HTTP/2: here the caller's own
thread writes one frame on a kept-open TCP connection and reads the answer, and the server answers
from its asyncio loop in the same turn that reads the request. The same servicer methods serve both
wires (a small context stands in for grpc's), so the rules, checks and messages are the gRPC ones.

Wire (big-endian): every frame is `u32 length` + body.
- hello, the first frame of a connection: MAGIC + the token (utf-8, empty when none). Sent together
  with the first request; a wrong token is answered UNAUTHENTICATED and the connection is closed.
- request: `u32 timeout_ms` + `u8 len` + method name + the serialized request message.
- reply: `u8 status` (index into CODES, 0 = OK) + `u16 len` + details (utf-8) + the serialized response.
One call at a time per connection; a client keeps a small pool of open connections.

A bidirectional stream (the lighthouse's HeartbeatStream) is a connection whose first request names a
stream method (its payload empty): from then on the client sends one frame per message and an empty
frame to end its side; the server sends `u8 kind` + body frames: STREAM_HEADERS once the stream is
open, STREAM_MESSAGE + a message, and STREAM_END + a reply body (the status) last. Kinds are >= 0xF0,
never a status index, so a refused hello (a plain reply) is told apart from the stream's frames.
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc

from ft_core import settings
from ft_core.control import rpc
from ft_core.errors import FTTimeoutError, RPCError
from ft_core.control.frames_io import _LENGTH, MAX_FRAME, FrameReader, Mailbox, _frame
from ft_core.net import split_host_port

logger = logging.getLogger("ft_core.control.frames")

__all__ = ["MAX_FRAME", "AsyncFrameClient", "FrameClient", "FrameReader", "FrameServer", "FramesUnreachable", "Mailbox",
           "enabled"]

MAGIC = b"FTLF1"
CODES: tuple[grpc.StatusCode, ...] = tuple(grpc.StatusCode)  # index 0 is OK
_CODE_INDEX = {code: i for i, code in enumerate(CODES)}
_REQUEST = struct.Struct("!IB")  # timeout_ms, method name length
_REPLY = struct.Struct("!BH")  # status index, details length
STREAM_MESSAGE, STREAM_END, STREAM_HEADERS = b"\xf0", b"\xf1", b"\xf2"
CONNECT_S = 2.0  # longest a new connection may take before the call fails (a live peer answers in a round trip)
IDLE_KEPT = 4  # open connections a client keeps for later calls
_FIRST_READ = 64 << 10  # a reply's first recv: the whole frame, unless it is longer
HELLO_S = 10.0  # a connection that has not greeted within this long is closed (no idle slot held forever)


def enabled() -> bool:
    """Whether servers open a frames port and clients use one (FT_FRAMES, default on)."""
    return bool(settings.value("FT_FRAMES", None))


def _raw(message: Any) -> Any:
    return message


def hello(token: str | None) -> bytes:
    return _frame(MAGIC + (token or "").encode())


def request_frame(name: str, payload: bytes, timeout_s: float) -> bytes:
    method = name.encode()
    return _frame(_REQUEST.pack(max(int(timeout_s * 1000), 1), len(method)) + method + payload)


def reply_frame(code: grpc.StatusCode, details: str, payload: bytes = b"") -> bytes:
    text = details.encode()[:65535]
    return _frame(_REPLY.pack(_CODE_INDEX[code], len(text)) + text + payload)


def parse_reply(body: bytes) -> tuple[grpc.StatusCode, str, bytes]:
    """(status, details, response payload) of a reply frame's body."""
    index, n = _REPLY.unpack_from(body)
    code = CODES[index] if index < len(CODES) else grpc.StatusCode.UNKNOWN
    return code, body[_REPLY.size:_REPLY.size + n].decode(errors="replace"), body[_REPLY.size + n:]


def status_error(code: grpc.StatusCode, details: str, *, peer: str, call: str, timeout_s: float) -> Exception:
    """The error a non-OK reply raises: exactly what the same status raises over gRPC (rpc.map_status)."""
    return rpc.map_status(code, details, peer=peer, call=call, timeout_s=timeout_s)


class FramesUnreachable(RPCError):
    """No connection to the frames port could be opened: the caller may keep to the service's gRPC port."""


def _broken(exc: BaseException, *, peer: str, call: str, timeout_s: float) -> Exception:
    """A call's connection failed before its answer: no answer in time, or the connection was lost."""
    if isinstance(exc, (TimeoutError, socket.timeout, asyncio.TimeoutError)):
        return status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer on the frames connection",
                            peer=peer, call=call, timeout_s=timeout_s)
    return status_error(grpc.StatusCode.UNAVAILABLE, f"frames connection lost: {exc or 'closed'}",
                        peer=peer, call=call, timeout_s=timeout_s)


def _payload(body: bytes, *, peer: str, call: str, timeout_s: float) -> bytes:
    """The response payload of a reply frame; raises the error of any other status."""
    code, details, response = parse_reply(body)
    if code != grpc.StatusCode.OK:
        raise status_error(code, details, peer=peer, call=call, timeout_s=timeout_s)
    return response


# --------------------------------------------------------------------------- server


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Context:
    """What the servicer methods use of grpc.aio.ServicerContext: the deadline, and abort."""

    __slots__ = ("_deadline",)

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s

    def time_remaining(self) -> float:
        return max(self._deadline - time.monotonic(), 0.0)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Abort(code, details)


class _StreamContext:
    """What a stream method uses of grpc.aio.ServicerContext: read, write, headers, abort."""

    def __init__(self, transport: asyncio.Transport, deserialize: Any, serialize: Any,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._transport: asyncio.Transport | None = transport
        self._deserialize = deserialize or _raw
        self._serialize = serialize or _raw
        self._inbox = Mailbox(loop)  # messages, then grpc.aio.EOF

    def received(self, body: bytes) -> None:
        if not body:
            self._inbox.put_nowait(grpc.aio.EOF)
            return
        try:
            self._inbox.put_nowait(self._deserialize(body))
        except Exception as exc:  # not the method's message: the stream ends INVALID_ARGUMENT when it gets there
            self._inbox.put_nowait(_Abort(grpc.StatusCode.INVALID_ARGUMENT, f"a message that does not parse ({exc})"))

    def ended(self) -> None:  # the connection dropped: the method reads end-of-stream, as over gRPC
        self._transport = None
        self._inbox.put_nowait(grpc.aio.EOF)

    async def read(self) -> Any:
        message = await self._inbox.get()
        if isinstance(message, _Abort):
            raise message
        return message

    async def requests(self) -> Any:
        while (message := await self.read()) is not grpc.aio.EOF:
            yield message

    async def write(self, message: Any) -> None:
        self.put_nowait(message)

    def direct_outbox(self) -> _StreamContext:
        """This context as an outbox whose put_nowait writes at once (None: nothing, finish() ends the stream)."""
        return self

    def put_nowait(self, message: Any) -> None:
        if message is not None and self._transport is not None:
            self._transport.write(_frame(STREAM_MESSAGE + self._serialize(message)))

    async def send_initial_metadata(self, metadata: Any = ()) -> None:
        if self._transport is not None:
            self._transport.write(_frame(STREAM_HEADERS))

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Abort(code, details)

    def finish(self, code: grpc.StatusCode, details: str) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.write(_frame(STREAM_END + reply_frame(code, details)[_LENGTH.size:]))
            transport.close()


class _Connection(FrameReader):
    """One client connection: reads frames as they arrive, answers each call on the loop (or, once a
    stream method is opened, feeds the stream)."""

    def __init__(self, server: FrameServer) -> None:
        super().__init__()
        self._server = server
        self._greeted = False
        self._stream: _StreamContext | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._server._connections.add(self)
        self._hello_timer = asyncio.get_running_loop().call_later(HELLO_S, self._no_hello)

    def _no_hello(self) -> None:
        if not self._greeted and self._transport is not None:
            self._refuse(grpc.StatusCode.DEADLINE_EXCEEDED, f"no hello within {HELLO_S:g}s")

    def connection_lost(self, exc: Exception | None) -> None:
        self._hello_timer.cancel()
        self._server._connections.discard(self)
        self._transport = None
        if self._stream is not None:
            self._stream.ended()

    def frame_received(self, body: bytes) -> None:
        if self._stream is not None:
            self._stream.received(body)
        elif not self._greeted:
            self._greet(body)
        else:
            self._start(body)

    def frame_too_long(self, length: int) -> None:
        self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, f"frame of {length} bytes is over {MAX_FRAME}")

    def _start(self, body: bytes) -> None:
        """A request: a unary call answered by a task, or the opening of a stream method."""
        if len(body) < _REQUEST.size or len(body) < _REQUEST.size + body[_REQUEST.size - 1]:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"a request frame of {len(body)} bytes is cut short")
            return
        timeout_ms, n = _REQUEST.unpack_from(body)
        name = body[_REQUEST.size:_REQUEST.size + n].decode(errors="replace")
        if self._server.stopping:  # its grace is for the calls already in flight
            self._refuse(grpc.StatusCode.UNAVAILABLE, "the server is stopping")
            return
        handler = self._server.handlers.get(name)
        if handler is not None and handler.stream_stream is not None and self._transport is not None:
            self._stream = _StreamContext(self._transport, handler.request_deserializer, handler.response_serializer,
                                          asyncio.get_running_loop())
            work, tasks = self._run_stream(handler, self._stream), self._server._streams
        else:
            work, tasks = self._serve(name, handler, timeout_ms, body[_REQUEST.size + n:]), self._server._calls
        tasks.add(task := asyncio.ensure_future(work))
        task.add_done_callback(tasks.discard)

    def _greet(self, body: bytes) -> None:
        if not body.startswith(MAGIC):
            self._refuse(grpc.StatusCode.UNIMPLEMENTED, "not a frames client (wrong magic)")
            return
        token = body[len(MAGIC):].decode(errors="replace")
        if not rpc.token_matches(self._server.token, rpc.auth_metadata(token)):
            self._refuse(grpc.StatusCode.UNAUTHENTICATED, rpc.TOKEN_REFUSED)
            return
        self._greeted = True
        self._hello_timer.cancel()

    def _refuse(self, code: grpc.StatusCode, details: str) -> None:
        self.stop_reading()
        if self._transport is not None:
            self._transport.write(reply_frame(code, details))
            self._transport.close()

    async def _run_stream(self, handler: grpc.RpcMethodHandler, context: _StreamContext) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            await handler.stream_stream(context.requests(), context)
        except _Abort as exc:
            code, details = exc.code, exc.details
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.UNAVAILABLE, "the server is stopping"
            raise
        except Exception as exc:  # a bug in a handler: the caller gets it as UNKNOWN, the log keeps the trace
            logger.exception("frames stream failed")
            code, details = grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}"
        finally:
            context.finish(code, details)

    async def _serve(self, name: str, handler: grpc.RpcMethodHandler | None, timeout_ms: int, payload: bytes) -> None:
        try:
            if handler is None or handler.unary_unary is None:
                raise _Abort(grpc.StatusCode.UNIMPLEMENTED, f"method {name!r} is not served on the frames port")
            try:
                request = (handler.request_deserializer or _raw)(payload)
            except Exception as exc:  # not the method's message
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: a request that does not parse ({exc})") from None
            response = await handler.unary_unary(request, _Context(timeout_ms / 1000))
            reply = reply_frame(grpc.StatusCode.OK, "", (handler.response_serializer or _raw)(response))
        except _Abort as exc:
            reply = reply_frame(exc.code, exc.details)
        except Exception as exc:  # a bug in a handler: the caller gets it as UNKNOWN, the log keeps the trace
            logger.exception("frames call %s failed", name)
            reply = reply_frame(grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
        if self._transport is not None:
            self._transport.write(reply)


class FrameServer:
    """Serves the unary methods of a gRPC service's `handlers` (name -> grpc.RpcMethodHandler, as
    rpc.servicer_handlers gives them) on its own TCP port, on the running asyncio loop."""

    def __init__(self, handlers: Mapping[str, grpc.RpcMethodHandler], token: str | None,
                 tls: rpc.TLSConfig | None = None) -> None:
        self.handlers = {name.rsplit("/", 1)[-1]: handler for name, handler in handlers.items()}
        self.token = token
        self._ssl = rpc.server_ssl_context(tls)
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_Connection] = set()
        self._streams: set[asyncio.Future] = set()  # open streams
        self._calls: set[asyncio.Future] = set()  # unary calls in flight
        self.stopping = False

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on host:port (0: chosen by the OS); the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host or None, port, ssl=self._ssl,
                                                reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace: float = 0.0) -> None:
        """Stop listening and refuse new calls; give unary calls in flight up to `grace` seconds to answer
        (as grpc.aio's stop does: a group's last commit answer to a remote rank is decided but may not be
        written yet), then close every connection (their callers get UNAVAILABLE) and cancel the rest."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        if grace > 0 and self._calls:
            await asyncio.wait(list(self._calls), timeout=grace)
        for connection in list(self._connections):
            if connection._transport is not None:
                connection._transport.close()
        for task in [*self._streams, *self._calls]:
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()


# --------------------------------------------------------------------------- clients


class FrameClient:
    """Blocking client of a FrameServer: the calling thread writes the request and reads the answer
    itself (no other thread involved). Thread-safe: concurrent calls use separate connections."""

    def __init__(self, address: str, token: str | None, peer: str, tls: rpc.TLSConfig | None = None) -> None:
        self._host, self._port = split_host_port(address, "frames address", default_host=None)
        self._token = token
        self._peer = peer
        self._ssl = rpc.client_ssl_context(tls)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def call(self, name: str, payload: bytes, timeout_s: float) -> bytes:
        """The response payload of `name(payload)`; raises as the same call over gRPC would."""
        deadline = time.monotonic() + timeout_s
        sock, fresh = self._take(name, deadline, timeout_s)
        message = request_frame(name, payload, timeout_s)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(hello(self._token) + message if fresh else message)
            body = _read_frame(sock, deadline)
        except (OSError, EOFError) as exc:  # socket.timeout is an OSError
            sock.close()
            raise _broken(exc, peer=self._peer, call=name, timeout_s=timeout_s) from None
        try:
            response = _payload(body, peer=self._peer, call=name, timeout_s=timeout_s)
        except Exception:
            sock.close()  # the server may have closed it (a refused hello); never reuse after an error
            raise
        self._give_back(sock)
        return response

    def _take(self, name: str, deadline: float, timeout_s: float) -> tuple[socket.socket, bool]:
        """An open connection (reused when one is idle and still open) or a new one: (socket, fresh)."""
        while True:
            with self._lock:
                if self._closed:
                    raise RPCError(f"{name} to {self._peer}: the client is closed", peer=self._peer, call=name,
                                   code="CANCELLED")
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                break
            if _still_open(sock):
                return sock, False
            sock.close()
        try:
            sock = socket.create_connection((self._host, self._port),
                                            timeout=max(min(deadline - time.monotonic(), CONNECT_S), 0.001))
        except OSError as exc:  # refused, unreachable, or no answer within CONNECT_S
            raise FramesUnreachable(f"{name} to {self._peer}: cannot connect to its frames port "
                                    f"({exc or 'timed out'}); open FT_MANAGER_FRAMES_PORT between the hosts, "
                                    f"or set FT_FRAMES=0", peer=self._peer, call=name, code="UNAVAILABLE") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl is not None:
            sock = self._ssl.wrap_socket(sock, server_hostname=self._host)
        return sock, True

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < IDLE_KEPT:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def _still_open(sock: socket.socket) -> bool:
    """False when the server closed an idle connection (restart, shutdown): a call there would be lost.
    An idle connection has nothing to read, so anything readable (the end of the stream, most often) means
    it is done with; one poll, no change of the socket's blocking mode."""
    if isinstance(sock, ssl.SSLSocket):
        return True  # TLS keeps its own buffered records; a closed one fails the call with UNAVAILABLE
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        return not poller.poll(0)
    except OSError:
        return False


def _read_frame(sock: socket.socket, deadline: float) -> bytes:
    """The body of the reply frame, usually from one recv: a reply is the only frame in flight on its
    connection, so reading past it cannot take bytes of another. The socket's timeout is set by the caller;
    it is set again only when the frame needs more reads."""
    data = bytearray()
    chunk = sock.recv(_FIRST_READ)
    while chunk:
        data += chunk
        need = _LENGTH.size
        if len(data) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(data)
            if length > MAX_FRAME:
                raise EOFError(f"frame of {length} bytes is over {MAX_FRAME}")
            need += length
            if len(data) >= need:
                return bytes(data[_LENGTH.size:need])
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(need - len(data))
    raise EOFError("the server closed the connection")


class _ReplyProtocol(FrameReader):
    """An AsyncFrameClient's connection: the reply's frame settles the waiting call's future as it is read."""

    def __init__(self) -> None:
        super().__init__()
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def frame_received(self, body: bytes) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(body)

    def frame_too_long(self, length: int) -> None:
        self._fail(EOFError(f"frame of {length} bytes is over {MAX_FRAME}"))

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc or EOFError("the server closed the connection"))


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


class AsyncFrameClient:
    """A FrameClient for code that runs on an asyncio loop (one connection, one call at a time): the reply
    is read in the protocol and resumes the caller on the next turn of the loop."""

    def __init__(self, address: str, token: str | None, peer: str, tls: rpc.TLSConfig | None = None) -> None:
        self._host, self._port = split_host_port(address, "frames address", default_host=None)
        self._token = token
        self._peer = peer
        self._ssl = rpc.client_ssl_context(tls)
        self._protocol: _ReplyProtocol | None = None
        self._busy = False

    async def call(self, name: str, payload: bytes, timeout_s: float) -> bytes:
        if self._busy:
            raise RPCError(f"{name} to {self._peer}: one call at a time on an AsyncFrameClient", peer=self._peer,
                           call=name, code="FAILED_PRECONDITION")
        self._busy = True
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        deadline = loop.call_later(timeout_s, _expire, waiter)
        try:
            message = request_frame(name, payload, timeout_s)
            protocol = self._protocol
            if protocol is None or protocol.transport is None or protocol.transport.is_closing():
                connect = loop.create_connection(_ReplyProtocol, self._host, self._port, ssl=self._ssl,
                                                 server_hostname=self._host if self._ssl is not None else None)
                _, protocol = await asyncio.wait_for(connect, max(min(timeout_s, CONNECT_S), 0.001))
                self._protocol = protocol
                message = hello(self._token) + message
            protocol.waiter = waiter
            assert protocol.transport is not None
            protocol.transport.write(message)
            body = await waiter
        except (asyncio.TimeoutError, OSError, EOFError) as exc:
            self.close()
            raise _broken(exc, peer=self._peer, call=name, timeout_s=timeout_s) from None
        finally:
            deadline.cancel()
            self._busy = False
        try:
            return _payload(body, peer=self._peer, call=name, timeout_s=timeout_s)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
