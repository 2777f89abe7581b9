"""HTTPTransport: a healing replica pulls one staged step from a live peer over HTTP, in parallel chunks.

Server side (the source): `send_checkpoint` stages a snapshot of the state for one step: CPU tensors
are copied once when staged (buffers such as BatchNorm statistics change in the forward pass while
healers read), GPU tensors are copied to pinned host memory on a side CUDA stream (off the critical
path). Every healer of one step therefore receives identical bytes, and `disallow_checkpoint()`
returns at once: readers still streaming finish from the snapshot, which is freed after the last.
A healer asking for a step this source has stopped serving gets 410 Gone and gives up at once;
503 means "not staged yet", which it retries until its deadline.

Client side (the healer): fetches the header, then all chunks over several keep-alive connections,
reading straight into the final tensor storage (`readinto`) and checking each chunk's digest
(xxh3_64, or crc32 without xxhash) piece by piece while the bytes are still in cache.
URLs: /checkpoint/{step}/header and /checkpoint/{step}/chunk/{i}; a shared token (argument or FT_TOKEN)
guards both, as an `Authorization: Bearer` header checked in constant time.

This module is the shell that composes them: http_server.py (server and handler), staging.py (the staged
step, CUDA staging, pinned pool) and http_client.py (the parallel chunked fetch).
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ft_core.checkpointing import serialization as ser
from ft_core.checkpointing.http_client import fetch
from ft_core.checkpointing.http_server import CheckpointServer
from ft_core.checkpointing.staging import HostStager, Staged
from ft_core.checkpointing.transport import CheckpointTransport, seconds
from ft_core.control.rpc import server_ssl_context, tls_config
from ft_core import settings
from ft_core.errors import CheckpointError
from ft_core.net import format_host_port, split_host_port

__all__ = ["HTTPTransport", "fetch"]

logger = logging.getLogger(__name__)


def _snapshot(encoded: ser.Encoded) -> None:
    """Copy the host bytes of an encoded state once (its owner trains on while healers read; buffers
    such as BatchNorm statistics change in the forward pass); device blobs are staged by copy anyway."""
    for blob in encoded.blobs:
        if blob.tensor is not None and blob.tensor.device.type == "cpu":
            blob.tensor = blob.tensor.clone()
        elif blob.buffer is not None:
            blob.buffer = memoryview(bytearray(blob.buffer))


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
        self._token = settings.value("FT_TOKEN", token) or None
        self._tls = tls_config()  # FT_TLS_CERT/FT_TLS_KEY: serve https; FT_TLS_CA: verify sources
        self.ssl_context = server_ssl_context(self._tls)
        self._lock = threading.Condition()
        self._staged: Staged | None = None
        self._last_served_step = -1  # highest step staged so far: asking for it later gets 410 Gone
        self._retired: list[Staged] = []  # disallowed steps whose readers are still streaming
        self._stager = HostStager()
        self._closed = False
        try:
            self._server = CheckpointServer(split_host_port(bind, "checkpoint server bind", default_port=0), self)
        except OSError as exc:
            raise CheckpointError(f"cannot start the checkpoint server on {bind!r}: {exc}; pick a free port "
                                  "(port 0 lets the OS choose)") from exc
        port = self._server.server_address[1]
        self._address = f"{self._tls.http_scheme}://{format_host_port(hostname, port)}"
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
        _snapshot(encoded)
        encoded.chunk_bytes = self._pick_chunk_bytes(encoded.payload_nbytes)
        encoded.header["chunk_bytes"] = encoded.chunk_bytes
        staged = Staged(step, encoded, encoded.header_frame())
        self._stager.stage(staged)
        with self._lock:
            self._staged = staged
            self._last_served_step = max(self._last_served_step, step)
        logger.info("checkpoint staged", extra={"step": step, "dst_ranks": list(dst_ranks),
                                                "bytes": encoded.payload_nbytes, "chunks": encoded.num_chunks})

    def _pick_chunk_bytes(self, total: int) -> int:
        if self._chunk_bytes:
            return self._chunk_bytes
        if self._num_chunks > 0:
            return max(1, -(-total // self._num_chunks))
        # a few chunks per connection so the parallel fetch stays balanced; big enough to amortise a request
        return max(1 << 20, min(32 << 20, -(-total // (4 * self._num_connections))))

    def acquire(self, step: int) -> tuple[Staged | None, tuple[int, str]]:
        """Register a reader of `step`, or say why not (HTTP status, message)."""
        with self._lock:
            staged = self._staged
            if staged is None and step <= self._last_served_step:
                return None, (410, (f"this source has stopped serving step {step} (its step ended); "
                                    "retry at the next quorum"))
            if staged is None:
                return None, (503, (f"no checkpoint is staged here yet (step {step} was requested): "
                                    "retry until your deadline"))
            if staged.step != step:
                return None, (400, (f"this source serves step {staged.step}, not step {step}; the quorum "
                                    "and the source disagree, retry at the next quorum"))
            staged.readers += 1
            return staged, (200, "")

    def release(self, staged: Staged) -> None:
        with self._lock:
            staged.readers -= 1
            done = staged.readers == 0 and staged in self._retired
            if done:
                self._retired.remove(staged)
            self._lock.notify_all()
        if done:
            self._stager.recycle(staged)

    def disallow_checkpoint(self) -> None:
        """Stop serving new requests and return at once: the served bytes are a snapshot, so the caller
        may mutate its state now; readers still streaming finish from it (bounded by their timeouts)."""
        with self._lock:
            staged, self._staged = self._staged, None
            if staged is None:
                return
            streaming = staged.readers > 0
            if streaming:
                self._retired.append(staged)  # the last reader's release() recycles it
        for event, stream in staged.ready:
            stream.wait_event(event)  # later writes on the training stream wait for the copies
        if not streaming:
            self._stager.recycle(staged)

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
        self._stager.clear()

    # ------------------------------------------------------------ receiver side

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Fetch step `step` from the source whose `metadata()` is `metadata`; tensors arrive on the CPU."""
        local = self._state_dict() if self._state_dict is not None else None
        return fetch(metadata, step, seconds(timeout), token=self._token, num_connections=self._num_connections,
                     src_rank=src_rank, into=local)

