"""The checkpoint source's HTTP server: named connection threads and the request handler for one staged step.

URLs: /checkpoint/{step}/header and /checkpoint/{step}/chunk/{i}. The handler asks its `StepSource`
(the HTTPTransport) to authorize the request and to register it as a reader of the staged step, so the
source can wait for in-flight responses before the state is mutated.
"""

from __future__ import annotations

import logging
import re
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from ft_core.checkpointing import serialization as ser
from ft_core.checkpointing.staging import Staged
from ft_core.checkpointing.wire import PIECE_BYTES, SOCKET_BUFFER_BYTES

logger = logging.getLogger("ft_core.checkpointing.http_transport")

_PATH_RE = re.compile(r"^/checkpoint/(-?\d{1,19})/(header|chunk/(\d{1,9}))$")


class StepSource(Protocol):
    """What the server needs from its owner: auth, the staged step and its readers, TLS and timeout."""

    timeout_s: float
    ssl_context: Any

    def authorized(self, header: str) -> bool: ...

    def acquire(self, step: int) -> tuple[Staged | None, tuple[int, str]]: ...

    def release(self, staged: Staged) -> None: ...


class CheckpointServer(socketserver.TCPServer):
    """A threaded HTTP server whose connection threads are named, tracked and joined at shutdown."""

    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], transport: StepSource) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.transport = transport
        self.connections: dict[threading.Thread, socket.socket] = {}
        self.conn_lock = threading.Lock()
        self.serial = 0
        super().__init__(address, CheckpointHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.conn_lock:
            self.serial += 1
            thread = threading.Thread(target=self._serve_connection, args=(request, client_address),
                                      name=f"ftl-ckpt-http-conn-{self.serial}", daemon=True)
            self.connections[thread] = request
        thread.start()

    def _serve_connection(self, request: socket.socket, client_address: Any) -> None:
        try:
            request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.transport.ssl_context is not None:  # TLS handshake here, not in the accept loop
                request.settimeout(self.transport.timeout_s)
                request = self.transport.ssl_context.wrap_socket(request, server_side=True)
                with self.conn_lock:
                    self.connections[threading.current_thread()] = request
            self.finish_request(request, client_address)
        except OSError as exc:  # the peer went away (e.g. a healer was killed): not the source's problem
            logger.debug("checkpoint connection from %s ended: %s", client_address, exc)
        except Exception:
            logger.exception("checkpoint connection from %s failed", client_address)
        finally:
            self.shutdown_request(request)
            with self.conn_lock:
                self.connections.pop(threading.current_thread(), None)

    def abort_connections(self) -> None:
        with self.conn_lock:
            sockets = list(self.connections.values())
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def join_connections(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.conn_lock:
            threads = list(self.connections)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class CheckpointHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CheckpointServer

    def setup(self) -> None:
        self.timeout = self.server.transport.timeout_s  # idle keep-alive connections end after this
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("checkpoint http %s: " + format, self.address_string(), *args)

    def _reply(self, status: int, message: str) -> None:
        body = message.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        transport = self.server.transport
        if not transport.authorized(self.headers.get("Authorization", "")):
            self._reply(401, "missing or wrong checkpoint token: give both replicas the same FT_TOKEN")
            return
        match = _PATH_RE.match(self.path)
        if match is None:
            self._reply(404, f"unknown path {self.path[:100]!r}; expected /checkpoint/<step>/header|chunk/<i>")
            return
        step = int(match.group(1))
        staged, refusal = transport.acquire(step)
        if staged is None:
            self._reply(*refusal)
            return
        try:
            if match.group(3) is None:
                self._send_bytes([memoryview(staged.header_frame)], staged, None)
            else:
                self._send_chunk(staged, int(match.group(3)))
        finally:
            transport.release(staged)

    def _send_chunk(self, staged: Staged, index: int) -> None:
        if index >= staged.encoded.num_chunks:
            self._reply(404, f"step {staged.step} has {staged.encoded.num_chunks} chunks, no chunk {index}")
            return
        for event, _ in staged.ready:
            event.synchronize()  # device-to-host copies of this step are done
        why = staged.wait_copied(staged.encoded.chunk_last_blob(index), self.server.transport.timeout_s)
        if why is not None:  # the source's snapshot of its host tensors failed or is late
            self._reply(500, f"{why}; retry at the next quorum")
            return
        views = staged.encoded.chunk_views(index)
        self._send_bytes(views, staged, index)
        staged.chunk_sent()

    def _send_bytes(self, views: list[memoryview], staged: Staged | None, index: int | None) -> None:
        """Body = the views, then (for a chunk) its digest, computed while streaming the first time."""
        total = sum(len(v) for v in views)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(total + (ser.DIGEST.size if index is not None else 0)))
        self.end_headers()
        self.wfile.flush()
        sock = self.connection
        if staged is None or index is None:
            for view in views:
                sock.sendall(view)
            return
        known = staged.digests.get(index)
        digest = ser.new_digest(staged.encoded.checksum) if known is None else None
        for view in views:
            if digest is None:
                sock.sendall(view)
                continue
            for start in range(0, len(view), PIECE_BYTES):
                piece = view[start:start + PIECE_BYTES]
                digest.update(piece)
                sock.sendall(piece)
        if digest is not None:
            staged.digests[index] = known = digest.intdigest()
        sock.sendall(ser.DIGEST.pack(known))
