"""The one staged step a checkpoint source serves, and the staging of its GPU tensors to pinned host memory.

Device tensors are copied to pinned host buffers on a side CUDA stream per device, off the training
stream's critical path; serving waits on the copies' events, and later writes on the training stream
wait for them too (at disallow). The pinned buffers are ours and are reused for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    pinned: list[torch.Tensor] = field(default_factory=list)  # our staging buffers, recycled at disallow
    digests: dict[int, int] = field(default_factory=dict)  # per chunk, computed by the first serve
    readers: int = 0


class PinnedPool:
    """Pinned host buffers by size, reused across steps (only ours: never a caller's pinned tensor)."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give_back(self, host: torch.Tensor) -> None:
        self._free.setdefault(host.numel(), []).append(host)

    def clear(self) -> None:
        self._free.clear()


class HostStager:
    """Copies a staged step's device blobs to host memory: CUDA on a side stream per device, others in place."""

    def __init__(self) -> None:
        self.pool = PinnedPool()
        self._side_streams: dict[Any, Any] = {}

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
                    host = self.pool.take(blob.nbytes)
                    staged.pinned.append(host)
                    host.copy_(blob.tensor, non_blocking=True)
                    blob.tensor.record_stream(side)  # keep the device memory alive until the copy ran
                    blob.tensor = host
            event = torch.cuda.Event()
            event.record(side)
            staged.ready.append((event, current))

    def recycle(self, staged: Staged) -> None:
        """Reuse our pinned staging buffers for the next step (only ours: never a caller's pinned tensor)."""
        for host in staged.pinned:
            self.pool.give_back(host)
        staged.pinned.clear()

    def clear(self) -> None:
        """Drop the pooled pinned buffers (at shutdown)."""
        self.pool.clear()
