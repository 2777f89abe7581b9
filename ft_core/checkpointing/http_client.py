"""The healer's side of the HTTP transport: fetch one staged step in parallel chunks over keep-alive connections.

Fetches the header (retrying while the source has not staged the step yet), then all chunks over several
connections, reading straight into the final tensor storage (`readinto`) and checking each chunk's digest
piece by piece while the bytes are still in cache.
"""

from __future__ import annotations

import http.client
import queue
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from ft_core.checkpointing import serialization as ser
from ft_core.checkpointing.wire import MAX_ERROR_BODY, PIECE_BYTES, SOCKET_BUFFER_BYTES
from ft_core.control.rpc import backoff_delays, client_ssl_context
from ft_core.errors import AuthError, CheckpointError, FTTimeoutError

# How long a healer asks again while its source answers with another step (400): a source serves its last
# step to that step's healers for their deadline, so a healer of the next quorum can ask just before its
# source staged the new step. A source that truly serves another step fails the healer after this.
OTHER_STEP_GRACE_S = 2.0


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
        other_step_until: float | None = None
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
                if resp.status == 400 and other_step_until is None:
                    other_step_until = time.monotonic() + OTHER_STEP_GRACE_S
                # 410: the source stopped serving this step, no point retrying. 400: it serves another step; it
                # may be about to stage ours (it still serves its last one to that one's healers), so retry briefly.
                if resp.status != 503 and not (resp.status == 400 and time.monotonic() < other_step_until):
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
