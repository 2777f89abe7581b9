"""The one staged step a checkpoint source serves, and the staging of its GPU tensors to pinned host memory.

Device tensors are copied to pinned host buffers on a side CUDA stream per device, off the training
stream's critical path; serving waits on the copies' events, and later writes on the training stream
wait for them too (at disallow). The pinned buffers are ours and are freed once the step is no longer
served (a newer step is staged, or the healers' deadline after the source's vote passed), not kept for
the next one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ft_core.checkpointing import serialization as ser


@dataclass
class Staged:
    """The one step being served, and the readers currently streaming from it."""

    step: int
    encoded: ser.Encoded
    header_frame: bytes
    # (CUDA event of the device-to-host copies, the training stream that must wait for them before it
    # mutates the state), one per device; empty for host-only states
    ready: list[tuple[Any, Any]] = field(default_factory=list)
    pinned: list[torch.Tensor] = field(default_factory=list)  # our staging buffers, freed when no longer served
    digests: dict[int, int] = field(default_factory=dict)  # per chunk, computed by the first serve
    readers: int = 0
    # The host blobs are snapshotted after the step is published, in payload order, so the healers' reads
    # overlap the copy: blobs[:copied] are final (device blobs: once `ready`'s events are done).
    copied: int = 1 << 62
    failed: str | None = None  # why the snapshot did not complete
    expected: int = 0  # chunk sends its healers need (chunks x healers): shutdown serves them first (drain)
    sent: int = 0  # chunks sent in full
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def set_copied(self, count: int, failed: str | None = None) -> None:
        with self._cond:
            self.copied, self.failed = count, failed
            self._cond.notify_all()

    def chunk_sent(self) -> None:
        with self._cond:
            self.sent += 1
            self._cond.notify_all()

    def wait_sent(self, until: float) -> bool:
        """Wait until every expected chunk was sent, or the monotonic time `until`; True if they were."""
        self._wait(lambda: self.sent >= self.expected, until)
        return self.sent >= self.expected

    def wait_copied(self, blob: int, timeout_s: float) -> str | None:
        """Wait until blobs[:blob + 1] are final; None, or why they are not (the snapshot failed or is late)."""
        if not self._wait(lambda: self.copied > blob, time.monotonic() + timeout_s):
            return f"the snapshot of step {self.step} is not ready after {timeout_s:.3g}s"
        return self.failed

    def _wait(self, done: Callable[[], bool], until: float) -> bool:
        """Wait until done() or the snapshot failed (True), or the monotonic time `until` (False)."""
        with self._cond:
            while not done() and self.failed is None:
                left = until - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True


class HostStager:
    """Copies a staged step's device blobs to host memory: CUDA on a side stream per device, others in place.

    The pinned buffers live only as long as their step is served: `recycle` (the step no longer served and
    no reader left) frees them and hands the memory back to the system, so a source does not keep a copy
    of the model's size pinned between heals (heals are rare; pinning again costs less than holding it).
    """

    def __init__(self) -> None:
        self._side_streams: dict[Any, Any] = {}
        self.pinned_bytes = 0  # pinned host memory held by staged steps now (tests and logs)

    def stage(self, staged: Staged) -> None:
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
                    host = torch.empty(blob.nbytes, dtype=torch.uint8, pin_memory=True)
                    staged.pinned.append(host)
                    self.pinned_bytes += host.numel()
                    host.copy_(blob.tensor, non_blocking=True)
                    blob.tensor.record_stream(side)  # keep the device memory alive until the copy ran
                    blob.tensor = host
            event = torch.cuda.Event()
            event.record(side)
            staged.ready.append((event, current))

    def recycle(self, staged: Staged) -> None:
        """Free a step's pinned staging buffers once it is disallowed and no reader streams from it, and
        hand torch's cached pinned blocks back (a caller's pinned snapshot of the state lands there too)."""
        mine = {id(host) for host in staged.pinned}
        for blob in staged.encoded.blobs:
            if blob.tensor is not None and id(blob.tensor) in mine:
                blob.tensor = None
        self.pinned_bytes -= sum(host.numel() for host in staged.pinned)
        staged.pinned.clear()
        _release_pinned_cache()

    def clear(self) -> None:
        """Forget the side streams (at shutdown); every staged step was recycled or dropped by then."""
        self._side_streams.clear()
        _release_pinned_cache()


def _release_pinned_cache() -> None:
    """Return torch's cached free pinned blocks to the system (ours were just freed into that cache;
    blocks whose copies are still running stay until they finish). Pinned memory another user caches
    there (a DataLoader's pin_memory) is pinned again on its next use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch._C._host_emptyCache()
