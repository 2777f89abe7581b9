"""HTTPTransport: a healing replica pulls one staged step from a live peer over HTTP, in parallel chunks.

Server side (the source): `send_checkpoint` stages the state for one step. CPU tensors are served
straight from their memory (no copy); the caller must not mutate them until `disallow_checkpoint()`
returns, which the Manager guarantees (it disallows in should_commit, before the optimizer step).
`disallow_checkpoint()` refuses new requests and waits for in-flight chunk responses, so a receiver
gets either every byte from before the mutation or an error: never a torn state. GPU tensors are
copied to pinned host memory on a side CUDA stream (off the critical path) and served from there.

Client side (the healer): fetches the header, then all chunks over several keep-alive connections,
reading straight into the final tensor storage (`readinto`) and checking each chunk's digest
(xxh3_64, or crc32 without xxhash) piece by piece while the bytes are still in cache.
URLs: /checkpoint/{step}/header and /checkpoint/{step}/chunk/{i}; a shared token (argument or FT_TOKEN)
guards both, as an `Authorization: Bearer` header checked in constant time.
"""

from __future__ import annotations

import hmac
import http.client
import logging
import queue
import re
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

import torch

from ft_core.checkpointing import serialization as ser
from ft_core.checkpointing.transport import CheckpointTransport, seconds
from ft_core.env import resolve_str
from ft_core.errors import AuthError, CheckpointError, FTTimeoutError
from ft_core.control.rpc import backoff_delays, client_ssl_context, server_ssl_context, tls_config

logger = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 << 20
PIECE_BYTES = 1 << 20  # hashing granularity: small enough to hash while the piece is in cache
MAX_ERROR_BODY = 4096
_PATH_RE = re.compile(r"^/checkpoint/(-?\d{1,19})/(header|chunk/(\d{1,9}))$")


def parse_bind(bind: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' or 'host' -> (host, port); port 0 lets the OS choose."""
    text = bind.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":") or "0"
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, "0"
    try:
        return host or "127.0.0.1", int(port)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint server bind {bind!r} is not host:port") from exc


@dataclass
class _Staged:
    """The one step being served, and the readers currently streaming from it."""

    step: int
    encoded: ser.Encoded
    header_frame: bytes
    # (CUDA event of the device-to-host copies, the training stream that must wait for them before it
    # mutates the state), one per device; empty for host-only states
    ready: list[tuple[Any, Any]] = field(default_factory=list)
    pinned: list[torch.Tensor] = field(default_factory=list)  # our staging buffers, recycled at disallow
    digests: dict[int, int] = field(default_factory=dict)  # per chunk, computed by the first serve
    readers: int = 0


class _Server(socketserver.TCPServer):
    """A threaded HTTP server whose connection threads are named, tracked and joined at shutdown."""

    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], transport: HTTPTransport) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.transport = transport
        self.connections: dict[threading.Thread, socket.socket] = {}
        self.conn_lock = threading.Lock()
        self.serial = 0
        super().__init__(address, _Handler)

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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

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
                self._send_chunk(transport, staged, int(match.group(3)))
        finally:
            transport.release(staged)

    def _send_chunk(self, transport: HTTPTransport, staged: _Staged, index: int) -> None:
        if index >= staged.encoded.num_chunks:
            self._reply(404, f"step {staged.step} has {staged.encoded.num_chunks} chunks, no chunk {index}")
            return
        for event, _ in staged.ready:
            event.synchronize()  # device-to-host copies of this step are done
        views = staged.encoded.chunk_views(index)
        self._send_bytes(views, staged, index)

    def _send_bytes(self, views: list[memoryview], staged: _Staged | None, index: int | None) -> None:
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


class HTTPTransport(CheckpointTransport[Any]):
    """Serves one staged step over HTTP and fetches peers' steps in parallel chunks (see module doc)."""

    def __init__(self, timeout: timedelta | float = timedelta(seconds=60), num_chunks: int = 0,
                 bind: str = "127.0.0.1:0", token: str | None = None, hostname: str = "127.0.0.1",
                 num_connections: int = 4, chunk_bytes: int | None = None,
                 state_dict: Callable[[], Any] | None = None, checksum: str | None = None) -> None:
        self.timeout_s = seconds(timeout)
        self._checksum = checksum
        self._state_dict = state_dict
        self._num_chunks = num_chunks
        self._chunk_bytes = chunk_bytes
        self._num_connections = max(1, num_connections)
        self._token = resolve_str(token, "FT_TOKEN", None) or None
        self._tls = tls_config()  # FT_TLS_CERT/FT_TLS_KEY: serve https; FT_TLS_CA: verify sources
        self.ssl_context = server_ssl_context(self._tls)
        self._lock = threading.Condition()
        self._staged: _Staged | None = None
        self._pinned: dict[int, list[torch.Tensor]] = {}
        self._side_streams: dict[Any, Any] = {}
        self._closed = False
        try:
            self._server = _Server(parse_bind(bind), self)
        except OSError as exc:
            raise CheckpointError(f"cannot start the checkpoint server on {bind!r}: {exc}; pick a free port "
                                  "(port 0 lets the OS choose)") from exc
        port = self._server.server_address[1]
        self._address = f"{self._tls.http_scheme}://{f'[{hostname}]' if ':' in hostname else hostname}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"ftl-ckpt-http-server-{port}", daemon=True)
        self._thread.start()
        logger.info("checkpoint HTTP server listening", extra={"address": self._address, "auth": bool(self._token)})

    # ------------------------------------------------------------ source side

    def metadata(self) -> str:
        return self._address

    def authorized(self, header: str) -> bool:
        if not self._token:
            return True
        return hmac.compare_digest(header.encode("utf-8", "replace"), f"Bearer {self._token}".encode())

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Stage `state_dict` as step `step` (replacing any staged step) and serve it until disallowed."""
        if self._closed:
            raise CheckpointError("send_checkpoint on a shut down HTTPTransport")
        self.disallow_checkpoint()
        encoded = ser.encode(state_dict, step=step, chunk_bytes=1, checksum=self._checksum)
        encoded.chunk_bytes = self._pick_chunk_bytes(encoded.payload_nbytes)
        encoded.header["chunk_bytes"] = encoded.chunk_bytes
        staged = _Staged(step, encoded, encoded.header_frame())
        self._stage_device_blobs(staged)
        with self._lock:
            self._staged = staged
        logger.info("checkpoint staged", extra={"step": step, "dst_ranks": list(dst_ranks),
                                                "bytes": encoded.payload_nbytes, "chunks": encoded.num_chunks})

    def _pick_chunk_bytes(self, total: int) -> int:
        if self._chunk_bytes:
            return self._chunk_bytes
        if self._num_chunks > 0:
            return max(1, -(-total // self._num_chunks))
        # a few chunks per connection so the parallel fetch stays balanced; big enough to amortise a request
        return max(1 << 20, min(32 << 20, -(-total // (4 * self._num_connections))))

    def _stage_device_blobs(self, staged: _Staged) -> None:
        """Copy device blobs to pinned host memory on a side stream per device; serving waits on the events."""
        by_device: dict[Any, list[ser.Blob]] = {}
        for blob in staged.encoded.blobs:
            if blob.tensor is not None and blob.tensor.device.type != "cpu":
                if blob.tensor.device.type == "cuda":
                    by_device.setdefault(blob.tensor.device, []).append(blob)
                else:  # other accelerators: a plain synchronous copy
                    blob.tensor = blob.tensor.cpu()
        for device, blobs in by_device.items():
            current = torch.cuda.current_stream(device)
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams[device] = torch.cuda.Stream(device)
            side.wait_stream(current)  # copy what the training stream has written so far
            with torch.cuda.stream(side):
                for blob in blobs:
                    host = self._take_pinned(blob.nbytes)
                    staged.pinned.append(host)
                    host.copy_(blob.tensor, non_blocking=True)
                    blob.tensor.record_stream(side)  # keep the device memory alive until the copy ran
                    blob.tensor = host
            event = torch.cuda.Event()
            event.record(side)
            staged.ready.append((event, current))

    def _take_pinned(self, nbytes: int) -> torch.Tensor:
        free = self._pinned.get(nbytes)
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _recycle(self, staged: _Staged) -> None:
        """Reuse our pinned staging buffers for the next step (only ours: never a caller's pinned tensor)."""
        for host in staged.pinned:
            self._pinned.setdefault(host.numel(), []).append(host)
        staged.pinned.clear()

    def acquire(self, step: int) -> tuple[_Staged | None, tuple[int, str]]:
        """Register a reader of `step`, or say why not (HTTP status, message)."""
        with self._lock:
            staged = self._staged
            if staged is None:
                return None, (503, (f"no checkpoint is staged here (step {step} was requested); the source has "
                                    "not staged it yet or has stopped serving it: retry until your deadline"))
            if staged.step != step:
                return None, (400, (f"this source serves step {staged.step}, not step {step}; the quorum "
                                    "and the source disagree, retry at the next quorum"))
            staged.readers += 1
            return staged, (200, "")

    def release(self, staged: _Staged) -> None:
        with self._lock:
            staged.readers -= 1
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving: refuse new requests, let in-flight ones finish (bounded), then return."""
        with self._lock:
            staged, self._staged = self._staged, None
            if staged is None:
                return
            deadline = time.monotonic() + self.timeout_s
            while staged.readers > 0 and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())
            aborted = staged.readers > 0
        if aborted:
            logger.warning("checkpoint readers still streaming at disallow after %.1fs; aborting them",
                           self.timeout_s, extra={"step": staged.step})
            self._server.abort_connections()
            with self._lock:
                self._lock.wait_for(lambda: staged.readers == 0, timeout=5.0)
        for event, stream in staged.ready:
            stream.wait_event(event)  # later writes on the training stream wait for the copies
        self._recycle(staged)

    def shutdown(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            staged, self._staged = self._staged, None
        self._server.shutdown()
        self._server.server_close()
        self._server.abort_connections()
        if wait:
            self._thread.join(self.timeout_s)
            self._server.join_connections(5.0)
        for event, _ in staged.ready if staged is not None else ():
            event.synchronize()
        self._pinned.clear()

    # ------------------------------------------------------------ receiver side

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Fetch step `step` from the source whose `metadata()` is `metadata`; tensors arrive on the CPU."""
        local = self._state_dict() if self._state_dict is not None else None
        return fetch(metadata, step, seconds(timeout), token=self._token, num_connections=self._num_connections,
                     src_rank=src_rank, into=local)


class _Connection(http.client.HTTPConnection):
    """An HTTP connection with large socket buffers set before connect (so TCP window scaling uses them)."""

    ssl_context: Any = None  # set for an https source: the socket is wrapped after connecting

    def connect(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout)
            sock.connect((self.host, self.port))
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _Fetch:
    """One receive: header, then chunks over parallel connections straight into the final buffers."""

    def __init__(self, url: str, step: int, timeout_s: float, token: str | None, num_connections: int,
                 src_rank: int, into: Any = None) -> None:
        self.into = into
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise CheckpointError(f"checkpoint source address {url!r} is not http://host:port (https:// with TLS); "
                                  "pass the source's HTTPTransport.metadata()")
        self.ssl_context = client_ssl_context() if parts.scheme == "https" else None
        if parts.scheme == "https" and self.ssl_context is None:
            raise CheckpointError(f"checkpoint source {url} serves TLS but no CA is configured here; set FT_TLS_CA "
                                  "(or FT_TLS_CERT) to the job's CA certificate")
        self.url, self.host, self.port = url, parts.hostname, parts.port
        self.step, self.timeout_s, self.src_rank = step, timeout_s, src_rank
        self.deadline = time.monotonic() + timeout_s
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.num_connections = num_connections
        self.connections: list[_Connection] = []
        self.conn_lock = threading.Lock()
        self.aborted = threading.Event()
        self.errors: list[BaseException] = []

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.timeout_error("")
        return left

    def timeout_error(self, detail: str) -> FTTimeoutError:
        return FTTimeoutError(f"fetching checkpoint step {self.step} from rank {self.src_rank} at {self.url} took "
                              f"longer than the {self.timeout_s:.3g}s timeout{detail}; raise timeout= or check "
                              "that the source is alive and staging this step")

    def connect(self) -> _Connection:
        conn = _Connection(self.host, self.port, timeout=self.remaining())
        conn.ssl_context = self.ssl_context
        with self.conn_lock:
            if self.aborted.is_set():
                raise CheckpointError("fetch aborted")
            self.connections.append(conn)
        return conn

    def request(self, conn: _Connection, what: str) -> http.client.HTTPResponse:
        conn.timeout = self.remaining()
        if conn.sock is not None:
            conn.sock.settimeout(conn.timeout)
        conn.request("GET", f"/checkpoint/{self.step}/{what}", headers=self.auth)
        return conn.getresponse()

    def refusal(self, resp: http.client.HTTPResponse, what: str) -> Exception:
        message = resp.read(MAX_ERROR_BODY).decode("utf-8", "replace")
        text = f"checkpoint source rank {self.src_rank} at {self.url} refused {what} of step {self.step} " \
               f"(HTTP {resp.status}): {message}"
        return AuthError(text, peer=self.url, call="checkpoint") if resp.status == 401 else CheckpointError(text)

    def header(self) -> tuple[_Connection, ser.Plan]:
        """GET the header, retrying while nothing is staged (the source may stage after we ask)."""
        delays = backoff_delays(initial=0.01, factor=1.5, cap=0.2, jitter=0.005)
        last = ""
        while True:
            conn = None
            try:
                conn = self.connect()
                resp = self.request(conn, "header")
                if resp.status == 200:
                    length = int(resp.getheader("Content-Length") or -1)
                    if not 0 <= length <= ser.MAX_HEADER_BYTES + 64:
                        raise CheckpointError(f"checkpoint header from {self.url} has bad length {length}")
                    frame = resp.read(length)
                    if len(frame) != length:
                        raise CheckpointError(f"checkpoint header from {self.url} was truncated")
                    plan = ser.parse_header_frame(frame)
                    ser.check_step(plan, self.step)
                    return conn, plan
                if resp.status != 503:
                    raise self.refusal(resp, "the header")
                last = f" (last answer: {resp.read(MAX_ERROR_BODY).decode('utf-8', 'replace')})"
                conn.close()
            except (OSError, http.client.HTTPException) as exc:
                if conn is not None:
                    conn.close()
                if isinstance(exc, ConnectionRefusedError):  # its server listens from birth: refused = dead
                    raise CheckpointError(f"checkpoint source rank {self.src_rank} at {self.url} refused the "
                                          f"connection ({exc}); it is gone, retry at the next quorum") from exc
                if isinstance(exc, TimeoutError) or time.monotonic() >= self.deadline:
                    raise self.timeout_error(last or f" (last error: {exc})") from exc
                last = f" (last error: {exc})"
            delay = next(delays)
            if time.monotonic() + delay >= self.deadline:
                time.sleep(max(0.0, self.deadline - time.monotonic()))
                raise self.timeout_error(last)
            time.sleep(delay)

    def chunk(self, conn: _Connection, plan: ser.Plan, buffers: list[Any], index: int) -> None:
        resp = self.request(conn, f"chunk/{index}")
        if resp.status != 200:
            raise self.refusal(resp, f"chunk {index}")
        expected = plan.chunk_nbytes(index) + ser.DIGEST.size
        if resp.getheader("Content-Length") != str(expected):
            raise CheckpointError(f"chunk {index} of step {self.step} from {self.url} has length "
                                  f"{resp.getheader('Content-Length')}, expected {expected}: corrupt or mismatched")
        digest = ser.new_digest(plan.checksum)
        for target in plan.chunk_targets(buffers, index):
            for start in range(0, len(target), PIECE_BYTES):
                piece = target[start:start + PIECE_BYTES]
                got = 0
                while got < len(piece):
                    n = resp.readinto(piece[got:])
                    if not n:
                        raise CheckpointError(f"chunk {index} of step {self.step} from {self.url} was truncated; "
                                              "the source closed the connection")
                    got += n
                digest.update(piece)
        ser.check_crc(digest.intdigest(), resp.read(ser.DIGEST.size),
                      f"chunk {index} of step {self.step} from {self.url}", ser.DIGEST)

    def worker(self, conn: _Connection | None, plan: ser.Plan, buffers: list[Any], todo: queue.SimpleQueue) -> None:
        try:
            while not self.aborted.is_set():
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                if conn is None:
                    conn = self.connect()
                self.chunk(conn, plan, buffers, index)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which raises it
            if not self.aborted.is_set():
                self.errors.append(exc)
            self.abort()

    def abort(self) -> None:
        self.aborted.set()
        with self.conn_lock:
            conns = list(self.connections)
        for conn in conns:
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        with self.conn_lock:
            conns, self.connections = self.connections, []
        for conn in conns:
            conn.close()

    def run(self) -> Any:
        try:
            first, plan = self.header()
            direct, preset, copies = ser.in_place_targets(plan, self.into, host_only=True)
            buffers = plan.allocate(preset)
            todo: queue.SimpleQueue = queue.SimpleQueue()
            for index in range(plan.num_chunks):
                todo.put(index)
            count = min(self.num_connections, plan.num_chunks)
            threads = [threading.Thread(target=self.worker, args=(first if i == 0 else None, plan, buffers, todo),
                                        name=f"ftl-ckpt-fetch-{self.step}-{i}", daemon=True) for i in range(count)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(max(0.0, self.deadline - time.monotonic()))
            if any(thread.is_alive() for thread in threads):
                self.abort()
                for thread in threads:
                    thread.join(5.0)
                raise self.timeout_error(f" ({plan.payload_nbytes} bytes in {plan.num_chunks} chunks)")
            if self.errors:
                raise self._wrap(self.errors[0])
            return plan.build(buffers, ser.fill_copies(plan, buffers, direct, copies))
        finally:
            self.close()

    def _wrap(self, exc: BaseException) -> BaseException:
        if isinstance(exc, (CheckpointError, FTTimeoutError, AuthError)):
            return exc
        if isinstance(exc, (TimeoutError, socket.timeout)):
            return self.timeout_error(f" ({exc})")
        return CheckpointError(f"fetching checkpoint step {self.step} from {self.url} failed: "
                               f"{type(exc).__name__}: {exc}")


def fetch(url: str, step: int, timeout_s: float, *, token: str | None = None, num_connections: int = 4,
          src_rank: int = -1, into: Any = None) -> Any:
    """Fetch step `step` from the HTTPTransport at `url` (its metadata()); raises CheckpointError/TimeoutError.

    With `into` (a state of the same structure), tensors matching by key path, dtype and shape are
    filled in place (straight from the socket when contiguous on the CPU) and returned instead of new ones.
    """
    job = _Fetch(url, step, timeout_s, token, num_connections, src_rank, into)
    try:
        return job.run()
    except Exception as exc:
        wrapped = job._wrap(exc)
        if wrapped is exc:
            raise
        raise wrapped from exc
