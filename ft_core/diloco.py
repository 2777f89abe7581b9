"""One fragment of (Streaming) DiLoCo: its global copy, pseudo-gradients and outer step.

`ft_core.local_sgd.DiLoCo` splits a model into fragments and drives each through the same cycle on
its own schedule (torchft's `_StreamingDiLoCoFragment` semantics, written here from its behaviour):

    prepare_sync()   pseudo-gradient = global copy - local parameters, averaged across the live
                     groups through `Manager.allreduce` (returns at once; the transfer overlaps
                     the next `fragment_sync_delay` inner steps)
    perform_sync()   wait for it, put the global copy back, vote (`should_commit`); on commit the
                     outer optimizer steps on the averaged pseudo-gradient, the result becomes the
                     new global copy, and the local parameters are mixed back in with
                     `fragment_update_alpha` (p = global + alpha * (local - global))

The global copy and the outer optimizer's state are registered with the Manager under
`StreamingDiLoCoFragment_{i}` as {"original_parameters": {...}, "outer_optimizer": {...}}, so a
group that joins between syncs receives them with its heal.

DTensor parameters (FSDP2) are handled shard by shard: only the local shard is copied, averaged
and restored; no parameter is ever gathered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn, optim

from ft_core.checkpointing.dtensor_wire import is_dtensor
from ft_core.ddp import register_reductions
from ft_core.managed_work import allreduce_kept

if TYPE_CHECKING:
    from ft_core.manager import Manager

logger = logging.getLogger(__name__)

__all__ = ["DiLoCoFragment", "allreduce_tensors", "extract_local_tensor", "fragment_key"]

# torchft's default bucket size for bucketized pseudo-gradient allreduces (1 GiB)
DEFAULT_BUCKET_CAP_BYTES = 1024 * 1024 * 1024


def fragment_key(fragment_id: int) -> str:
    """The state-dict key of a fragment (torchft's layout, so checkpoints carry over)."""
    return f"StreamingDiLoCoFragment_{fragment_id}"


def extract_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached clone of `t`, or of its local shard when `t` is a DTensor."""
    local = t.to_local() if is_dtensor(t) else t
    return local.detach().clone()


def _local_view(p: torch.Tensor) -> torch.Tensor:
    """The tensor this process owns of parameter `p` (its shard for a DTensor), without a copy."""
    data = p.data
    return data.to_local() if is_dtensor(data) else data


def allreduce_tensors(manager: "Manager", tensors: list[torch.Tensor], *, bucket_cap_bytes: int | None
                      ) -> Callable[[], None]:
    """Start averaging `tensors` in place across the groups; returns the call that waits for it.

    With `bucket_cap_bytes`, tensors of one dtype and device are packed into flat buffers of at
    most that size (a larger tensor goes alone), one allreduce per buffer; else one per tensor.
    Never raises for communication errors: the Manager records them and the step will not commit.
    Each input is kept (a copy, `keep_input`): a peer lost mid-reduction is redone without it
    (ft_core.redo), and nothing else could rebuild it once the local parameters moved on.
    """
    if bucket_cap_bytes is None:
        works = [allreduce_kept(manager, t) for t in tensors]

        def wait_each() -> None:
            for work in works:
                work.wait()
        return wait_each

    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        members, size = open_bucket.get(key, ([], 0))
        nbytes = t.numel() * t.element_size()
        if members and size + nbytes > bucket_cap_bytes:
            buckets.append(members)
            members, size = [], 0
        members.append(t)
        open_bucket[key] = (members, size + nbytes)
    buckets.extend(members for members, _ in open_bucket.values() if members)

    pending = []
    for members in buckets:
        flat = torch.cat([t.reshape(-1) for t in members])
        pending.append((allreduce_kept(manager, flat), flat, members))

    def wait_buckets() -> None:
        for work, flat, members in pending:
            work.wait()
            offset = 0
            for t in members:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n
    return wait_buckets


class DiLoCoFragment:
    """A fragment's global copy, outer optimizer and in-flight pseudo-gradient allreduce."""

    def __init__(self, manager: "Manager", model_fragment: nn.Module, fragment_id: int,
                 outer_optimizer: optim.Optimizer, *, backup_device: torch.device | None = None,
                 pin_memory: bool = True, use_bucketization: bool = False, bucket_cap_mb: float | None = None,
                 fragment_update_alpha: float = 0.0) -> None:
        self._manager = manager
        self._model_fragment = model_fragment
        self._fragment_id = fragment_id
        self._outer_optimizer = outer_optimizer
        self._fragment_update_alpha = fragment_update_alpha
        self.use_bucketization = use_bucketization
        self.bucket_cap_mb = (DEFAULT_BUCKET_CAP_BYTES if bucket_cap_mb is None
                              else int(bucket_cap_mb * 1024 * 1024))
        self._grads: dict[str, torch.Tensor] = {}
        self._wait: Callable[[], None] | None = None
        self._local_parameters: dict[str, torch.Tensor] = {}
        # the global copy: what every group agreed on at this fragment's last committed sync
        self.original_parameters: dict[str, torch.Tensor] = {}
        device = backup_device or torch.device("cpu")
        for name, p in model_fragment.named_parameters():
            local = _local_view(p)
            t = torch.empty(local.shape, dtype=local.dtype, device=device)
            if pin_memory and t.device.type == "cpu" and torch.cuda.is_available():
                t = t.pin_memory()
            self.original_parameters[name] = t
        # a peer that splits or packs the model otherwise is refused at the quorum (ft_core.ddp.reductions_digest)
        register_reductions(manager, self, list(model_fragment.parameters()),
                            f"|fragment {fragment_id}|bucket {self.bucket_cap_mb if use_bucketization else 0}")

    @property
    def fragment_id(self) -> int:
        return self._fragment_id

    @property
    def outer_optimizer(self) -> optim.Optimizer:
        return self._outer_optimizer

    # ------------------------------------------------------------------ state for healing

    def state_dict(self) -> dict[str, Any]:
        """What a healing group receives for this fragment (torchft's layout)."""
        return {"outer_optimizer": self._outer_optimizer.state_dict(),
                "original_parameters": {name: t.detach().clone() for name, t in self.original_parameters.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = state["original_parameters"]
        missing = sorted(set(self.original_parameters) - set(params))
        if missing:
            raise ValueError(f"{fragment_key(self._fragment_id)}: healed state lacks parameters {missing}; "
                             f"every group must split the model into the same fragments")
        with torch.no_grad():
            for name, t in self.original_parameters.items():
                t.copy_(params[name])
        self._outer_optimizer.load_state_dict(state["outer_optimizer"])

    def register_state_dict_fn(self) -> None:
        self._manager.register_state_dict_fn(fragment_key(self._fragment_id), self.load_state_dict,
                                             self.state_dict)

    # ------------------------------------------------------------------ parameters

    def save_parameters(self) -> None:
        """The current parameters become the global copy."""
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                self.original_parameters[name].copy_(_local_view(p), non_blocking=True)

    def restore_parameters(self) -> None:
        """Put the global copy back into the parameters (shard by shard for a DTensor)."""
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                _local_view(p).copy_(self.original_parameters[name], non_blocking=False)

    def _merge_parameters(self) -> None:
        """p = global + alpha * (local - global): keep part of the local progress."""
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                _local_view(p).lerp_(self._local_parameters[name], self._fragment_update_alpha)

    # ------------------------------------------------------------------ the sync

    def prepare_sync(self) -> None:
        """Compute the pseudo-gradients and start averaging them; does not wait."""
        if self._wait is not None:
            raise RuntimeError(f"{fragment_key(self._fragment_id)}: prepare_sync while its previous "
                               f"allreduce is still pending; call perform_sync first")
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                local = _local_view(p)
                self._grads[name] = self.original_parameters[name].to(local.device) - local
        cap = self.bucket_cap_mb if self.use_bucketization else None
        self._wait = allreduce_tensors(self._manager, list(self._grads.values()), bucket_cap_bytes=cap)

    def has_pending_sync(self) -> bool:
        return self._wait is not None

    def wait(self) -> None:
        """Wait for the pending pseudo-gradient allreduce, if any."""
        wait, self._wait = self._wait, None
        if wait is not None:
            wait()

    def perform_sync(self) -> bool:
        """Finish the sync started by prepare_sync; True if every group committed it."""
        if self._wait is None:
            raise RuntimeError(f"{fragment_key(self._fragment_id)}: perform_sync without prepare_sync")
        self.wait()
        with torch.no_grad():
            self._local_parameters = {name: extract_local_tensor(p) for name, p in
                                      self._model_fragment.named_parameters()}
        self.restore_parameters()
        committed = self._manager.should_commit()
        if committed:
            self._outer_step()
            self.save_parameters()
            self._merge_parameters()
        else:
            logger.warning("%s not committed: its parameters go back to the last global copy",
                           fragment_key(self._fragment_id))
        self._grads.clear()
        self._local_parameters = {}
        return committed

    def _outer_step(self) -> None:
        """The outer optimizer steps this fragment only.

        An outer optimizer shared by several fragments also holds the other fragments' parameters,
        whose `.grad` still has the last inner gradient: those are set aside for the step (torchft
        steps them too, applying a stale inner gradient as a pseudo-gradient) and put back after.
        """
        mine = {id(p) for p in self._model_fragment.parameters()}
        others = [p for group in self._outer_optimizer.param_groups for p in group["params"]
                  if id(p) not in mine and p.grad is not None]
        stashed = [p.grad for p in others]
        for p in others:
            p.grad = None
        try:
            self._set_grads()
            self._outer_optimizer.step()
        finally:
            for p in self._model_fragment.parameters():
                p.grad = None
            for p, grad in zip(others, stashed):
                p.grad = grad

    def _set_grads(self) -> None:
        for name, p in self._model_fragment.named_parameters():
            grad = self._grads[name]
            if is_dtensor(p):
                from torch.distributed.tensor import DTensor  # loaded already: p is one

                p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            else:
                p.grad = grad.to(p.device)
