"""Buffers (BatchNorm running statistics and the like) kept identical across replica groups, as DDP's
`broadcast_buffers` keeps them inside a group: before each vote every group takes the buffers of the
first participant. A broadcast is one SUM per dtype in which every other group sends zeros, so it
runs over the fault-tolerant process group like any reduction, errors and vote gating included.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.distributed import ReduceOp

__all__ = ["broadcast_by_sum"]

Reduce = Callable[..., torch.futures.Future]  # reduce(flat, op, refill=...): ft_core.redo.issue for the Manager


def broadcast_by_sum(tensors: list[torch.Tensor], root: Callable[[], bool], reduce: Reduce,
                     succeeded: Callable[[], bool]) -> None:
    """Overwrite `tensors` with the root group's values (the root sends its own, the others zeros). `root()`
    says whether this group is the root in the current quorum; `reduce` gets each input's `refill`, which
    makes it again for the quorum then current: a redo without a lost root has another root."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    pending = []
    for group in by_dtype.values():
        flat = torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, device=group[0].device)
        refill = functools.partial(_fill, flat, group, root)
        refill()
        pending.append((group, flat, reduce(flat, ReduceOp.SUM, refill=refill)))
    for group, flat, fut in pending:
        fut.wait()
        if not succeeded():  # a failed reduction: the step will not commit, keep our own values
            continue
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def _fill(flat: torch.Tensor, group: list[torch.Tensor], root: Callable[[], bool]) -> None:
    """`flat` as this group sends it in the current quorum: its own values at the root, else zeros."""
    if root():
        torch.cat([t.detach().reshape(-1) for t in group], out=flat)
    else:
        flat.zero_()
