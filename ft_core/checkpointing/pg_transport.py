"""PGTransport: stream a state dict over a (rebuilt) c10d process group, optionally into existing tensors.

Per transfer, in this order on both sides (the order matters for NCCL, which ignores tags):
    tag 1: the header frame length (one int64)
    tag 2: the header frame (the same validated JSON header as the HTTP transport, never pickle)
    tag 4+i: the raw bytes of blob i (tensor storages, numpy arrays, bytes), skipping empty blobs
    tag 3: one digest per blob (the header's checksum, as int64; -1 where the sender had the bytes only
           on a device and could not hash them without a copy)
A receiver that finds the wrong step still drains the blobs, so the group stays usable and the
sender does not hang, then raises a CheckpointError.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch

from ft_core.checkpointing import serialization as ser
from ft_core.checkpointing.transport import CheckpointTransport, seconds
from ft_core.errors import CheckpointError, FTTimeoutError

logger = logging.getLogger(__name__)

T = TypeVar("T")

TAG_LENGTH, TAG_HEADER, TAG_DIGEST, TAG_BLOB = 1, 2, 3, 4
NO_DIGEST = -1


def _signed64(value: int) -> int:
    """A u64 digest as the int64 a tensor can carry."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _digest(name: str, t: torch.Tensor) -> int:
    return _signed64(ser.digest_views(name, [memoryview(t.numpy())]))


def _host_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over host bytes, zero-copy when the memory is writable."""
    arr = np.frombuffer(view, dtype=np.uint8)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def _buffer_tensor(buffer: Any) -> torch.Tensor:
    """A uint8 tensor view of a receive buffer made by Plan.allocate (tensor, numpy array or bytearray)."""
    if isinstance(buffer, torch.Tensor):
        return buffer
    if isinstance(buffer, np.ndarray):
        return torch.from_numpy(buffer)
    return torch.frombuffer(buffer, dtype=torch.uint8)


class PGTransport(CheckpointTransport[T]):
    """Sends and receives checkpoints over `pg` (send/recv with tags); see the module doc for the wire order.

    Generic like torchft's (`PGTransport[dict[str, object]](pg, timeout=...)`). DTensors travel as their
    local shards (see dtensor_wire): each group rank sends its own shard, nothing is gathered.
    """

    def __init__(self, pg: Any, timeout: timedelta | float = timedelta(seconds=60),
                 device: torch.device | str = "cpu",
                 state_dict: Callable[[], T] | None = None) -> None:
        self._pg = pg
        self.timeout_s = seconds(timeout)
        self._device = torch.device(device)
        self._state_dict = state_dict

    def metadata(self) -> str:
        return "<n/a>"  # peers reach us through the process group, by rank

    def disallow_checkpoint(self) -> None:
        """Nothing is served between calls: send_checkpoint returns only once the bytes are sent."""

    # ------------------------------------------------------------ helpers

    def _wait(self, work: Any, deadline: float, what: str, peer: int) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise FTTimeoutError(f"checkpoint {what} with rank {peer} did not finish within the timeout; "
                                 "the peer may be dead or slow: raise timeout= or retry at the next quorum")
        try:
            work.wait(timedelta(seconds=max(left, 0.001)))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise FTTimeoutError(f"checkpoint {what} with rank {peer} timed out after {left:.3g}s: {exc}; "
                                     "raise timeout= or check the peer") from exc
            raise CheckpointError(f"checkpoint {what} with rank {peer} failed: {exc}; the process group is "
                                  "broken, retry after it is reconfigured at the next quorum") from exc

    def _comm(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self._device else t.to(self._device)

    # ------------------------------------------------------------ sending

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        """Stream `state_dict` (as step `step`) to every rank in `dst_ranks`; returns when all bytes are sent."""
        deadline = time.monotonic() + seconds(timeout)
        encoded = ser.encode(state_dict, step=step, chunk_bytes=1 << 40)
        frame = encoded.header_frame()
        length = self._comm(torch.tensor([len(frame)], dtype=torch.int64))
        header = self._comm(torch.frombuffer(bytearray(frame), dtype=torch.uint8))
        blobs: list[tuple[int, torch.Tensor]] = []
        for index, blob in enumerate(encoded.blobs):
            if blob.nbytes:
                raw = blob.tensor if blob.tensor is not None else _host_tensor(blob.host_view())
                blobs.append((index, self._comm(raw)))
        works: list[tuple[Any, int, str]] = []
        for dst in dst_ranks:
            works.append((self._pg.send([length], dst, TAG_LENGTH), dst, "header length"))
            works.append((self._pg.send([header], dst, TAG_HEADER), dst, "header"))
            works.extend((self._pg.send([t], dst, TAG_BLOB + i), dst, f"blob {i}") for i, t in blobs)
        digests = torch.full((len(encoded.blobs),), NO_DIGEST, dtype=torch.int64)
        for index, t in blobs:  # hashing runs while the sends are in flight
            if t.device.type == "cpu":
                digests[index] = _digest(encoded.checksum, t)
        digests = self._comm(digests)
        works.extend((self._pg.send([digests], dst, TAG_DIGEST), dst, "checksums") for dst in dst_ranks)
        for work, dst, what in works:
            self._wait(work, deadline, f"send of step {step} ({what})", dst)
        logger.info("checkpoint sent over process group", extra={"step": step, "dst_ranks": list(dst_ranks),
                                                                  "bytes": encoded.payload_nbytes})

    # ------------------------------------------------------------ receiving

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Receive step `step` from `src_rank`. Tensors land on the CPU, or in place in `state_dict()`'s tensors."""
        deadline = time.monotonic() + seconds(timeout)
        what = f"receive of step {step}"
        length = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._wait(self._pg.recv([length], src_rank, TAG_LENGTH), deadline, what + " (header length)", src_rank)
        nbytes = int(length.item())
        if not ser.HEADER_PREFIX_BYTES + ser.CRC.size <= nbytes <= ser.HEADER_PREFIX_BYTES + ser.MAX_HEADER_BYTES \
                + ser.CRC.size:  # the header frame ends with its own crc32
            raise CheckpointError(f"checkpoint header from rank {src_rank} claims {nbytes} bytes: corrupt stream "
                                  "or a peer running another protocol")
        frame = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        self._wait(self._pg.recv([frame], src_rank, TAG_HEADER), deadline, what + " (header)", src_rank)
        plan = ser.parse_header_frame(memoryview(frame.cpu().numpy()))
        right_step = plan.step == step
        local = self._state_dict() if self._state_dict is not None and right_step else None
        overrides, preset, copies = ser.in_place_targets(plan, local)
        buffers = plan.allocate(preset)  # in-place targets (any device) stand in for their blobs
        targets = {index: _buffer_tensor(buffers[index]) for index, size in enumerate(plan.blob_sizes) if size}
        comm: dict[int, torch.Tensor] = {}
        works = []
        for index, target in targets.items():
            on_device = target.device == self._device
            comm[index] = target if on_device else torch.empty(target.numel(), dtype=torch.uint8, device=self._device)
            works.append((index, self._pg.recv([comm[index]], src_rank, TAG_BLOB + index)))
        digests = torch.zeros(len(plan.blob_sizes), dtype=torch.int64, device=self._device)
        digest_work = self._pg.recv([digests], src_rank, TAG_DIGEST)
        actual: dict[int, int] = {}
        for index, work in works:  # hash each blob while the next ones are still arriving
            self._wait(work, deadline, f"{what} (blob {index})", src_rank)
            target = targets[index]
            if comm[index] is not target:
                target.copy_(comm[index])
            if target.device.type == "cpu":
                actual[index] = _digest(plan.checksum, target)
        self._wait(digest_work, deadline, what + " (checksums)", src_rank)
        if not right_step:
            raise CheckpointError(f"rank {src_rank} sent step {plan.step} but step {step} was expected; the quorum "
                                  "and the source disagree, retry at the next quorum")
        expected = digests.cpu().tolist()
        for index, value in actual.items():
            if expected[index] != NO_DIGEST and expected[index] != value:
                raise CheckpointError(f"blob {index} of step {step} from rank {src_rank} fails its checksum "
                                      f"({value:#x} != {expected[index]:#x}); fetch it again")
        return plan.build(buffers, ser.fill_copies(plan, buffers, overrides, copies))

    def shutdown(self, wait: bool = True) -> None:
        """The process group belongs to the caller; nothing to release here."""
