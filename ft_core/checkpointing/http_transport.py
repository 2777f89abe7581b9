"""HTTPTransport: a healing replica pulls one staged step from a live peer over HTTP, in parallel chunks.

Server side (the source): `send_checkpoint` stages a snapshot of the state for one step: CPU tensors
are copied once when staged (buffers such as BatchNorm statistics change in the forward pass while
healers read), GPU tensors are copied to pinned host memory on a side CUDA stream (off the critical
path). Every healer of one step therefore receives identical bytes, and `disallow_checkpoint()`
returns at once. The disallowed step is still served for the transport's timeout (the healers'
deadline), so a healer that fetches beside its step's collectives (`heals_during_the_step`) gets it
after its source's step ended; readers still streaming finish from the snapshot, which is freed once
the next step is staged or that window ended, after the last reader. A healer asking for a step this
source no longer serves gets 410 Gone and gives up at once; 503 means "not staged yet", which it
retries until its deadline; 400 means the source serves another step, which it retries for a short
grace (http_client.OTHER_STEP_GRACE_S: a healer of the next quorum may ask just before its source,
still serving its last step, stages the new one).

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
import time
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


def _host_blobs(encoded: ser.Encoded) -> list[int]:
    return [i for i, blob in enumerate(encoded.blobs)
            if blob.buffer is not None or (blob.tensor is not None and blob.tensor.device.type == "cpu")]


def _snapshot(staged: Staged, host: list[int]) -> None:
    """Copy the host bytes of a published step once, blob by blob in payload order (its owner trains on
    while healers read; buffers such as BatchNorm statistics change in the forward pass): a chunk is served
    once the blobs it covers are copied, so the healers' reads overlap the copy. Device blobs are staged
    by copy anyway."""
    blobs = staged.encoded.blobs
    for i in host:
        blob = blobs[i]
        if blob.tensor is not None:
            blob.tensor = blob.tensor.clone()
        else:
            blob.buffer = memoryview(bytearray(blob.buffer))
        staged.set_copied(i + 1)
    staged.set_copied(len(blobs))


class HTTPTransport(CheckpointTransport[Any]):
    """Serves one staged step over HTTP and fetches peers' steps in parallel chunks (see module doc)."""

    heals_during_the_step = True  # no process group; a disallowed step stays served for timeout_s

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
        self._retired: list[Staged] = []  # steps no longer served whose readers are still streaming
        self._kept: Staged | None = None  # the step disallowed last, still served until _kept_until (monotonic)
        self._kept_until = 0.0
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
        encoded.chunk_bytes = self._pick_chunk_bytes(encoded.payload_nbytes)
        encoded.header["chunk_bytes"] = encoded.chunk_bytes
        host = _host_blobs(encoded)  # before the device blobs are staged into host memory
        staged = Staged(step, encoded, encoded.header_frame(), copied=0,
                        expected=encoded.num_chunks * len(dst_ranks))
        self._stager.stage(staged)
        with self._lock:
            self._staged = staged
            self._last_served_step = max(self._last_served_step, step)
            dropped = self._drop_kept_locked(time.monotonic(), replaced=True)
        for old in dropped:
            self._stager.recycle(old)
        try:
            _snapshot(staged, host)
        except BaseException as exc:  # e.g. out of host memory: its healers fail now, and heal again
            staged.set_copied(0, failed=f"the source could not snapshot step {step}: {type(exc).__name__}: {exc}")
            with self._lock:
                if self._staged is staged:
                    self._staged = None
            raise CheckpointError(f"staging step {step} for healers failed: {type(exc).__name__}: {exc}") from exc
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
            kept = self._kept
            if staged is None and kept is not None and step >= kept.step and time.monotonic() < self._kept_until:
                staged = kept  # disallowed, still within its healers' deadline (a later step asked for: 400 below)
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
        """The step ended: return at once (the served bytes are a snapshot, so the caller may mutate its
        state now). The step is still served for timeout_s, to healers fetching beside their step (the
        Manager calls this every step, which also frees a kept step whose window ended)."""
        now = time.monotonic()
        with self._lock:
            staged, self._staged = self._staged, None
            dropped = self._drop_kept_locked(now, replaced=staged is not None)
            if staged is not None:
                self._kept, self._kept_until = staged, now + self.timeout_s
        for event, stream in staged.ready if staged is not None else ():
            stream.wait_event(event)  # later writes on the training stream wait for the copies
        for old in dropped:
            self._stager.recycle(old)

    def drain(self) -> bool:
        """Before a shutdown: the step served last, until its healers have every chunk or their deadline
        passed (a source that ends right after a step that healed a group, the job's last, still serves it:
        its healers fetch beside their step). True when nothing is left to serve."""
        with self._lock:
            held, until = (self._staged, time.monotonic() + self.timeout_s) if self._staged is not None \
                else (self._kept, self._kept_until)
        if held is None or held.wait_sent(time.monotonic()):
            return True
        logger.info("serving step %d to its healers before shutting down (up to %.1fs)", held.step,
                    max(0.0, until - time.monotonic()))
        return held.wait_sent(until)

    def _drop_kept_locked(self, now: float, replaced: bool) -> list[Staged]:
        """Stop serving the kept step once another one replaces it or its window ended; it is returned when
        it can be recycled now (else the last reader's release() recycles it)."""
        kept = self._kept
        if kept is None or (not replaced and now < self._kept_until):
            return []
        self._kept = None
        if kept.readers > 0:
            self._retired.append(kept)
            return []
        return [kept]

    def shutdown(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            staged, self._staged = self._staged, None
            kept, self._kept = self._kept, None
        self._server.shutdown()
        self._server.server_close()
        self._server.abort_connections()
        if wait:
            self._thread.join(self.timeout_s)
            self._server.join_connections(5.0)
        for event, _ in [e for held in (staged, kept) if held is not None for e in held.ready]:
            event.synchronize()
        self._stager.clear()

    # ------------------------------------------------------------ receiver side

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Fetch step `step` from the source whose `metadata()` is `metadata`; tensors arrive on the CPU."""
        local = self._state_dict() if self._state_dict is not None else None
        return fetch(metadata, step, seconds(timeout), token=self._token, num_connections=self._num_connections,
                     src_rank=src_rank, into=local)

