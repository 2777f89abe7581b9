"""Semi-synchronous training: LocalSGD, DiLoCo and Streaming DiLoCo, fault tolerant.

Groups train on their own for `sync_every` inner steps and then synchronize through the Manager,
with commit gating: a sync is one Manager step (start_quorum -> allreduce -> should_commit), so
cross-group traffic falls by a factor of `sync_every` and a group that fails between syncs costs
only its own local progress. Both classes are context managers around the inner loop (they hook
the inner optimizer's `step`), with torchft's names, arguments and state-dict layout:

    with DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=100) as diloco:
        for batch in data:
            inner_opt.zero_grad(); loss(model, batch).backward(); inner_opt.step()

LocalSGD averages the parameters themselves every `sync_every` steps. DiLoCo averages
pseudo-gradients (global copy minus local parameters) and applies them with an outer optimizer
(one for all fragments or one per fragment). Streaming DiLoCo: several fragments, fragment
`manager.current_step() % n` synced every `sync_every / n` inner steps, the allreduce started
`fragment_sync_delay` steps early so it overlaps inner steps, and `fragment_update_alpha` mixing
local progress into the new global parameters (see ft_core.diloco).

Healing a group that joins between syncs: the Manager must use a synchronous quorum (as torchft
requires), so the healed state is loaded at the sync's start_quorum, before the pseudo-gradients
are computed. Each fragment registers its global copy and outer optimizer state
(`StreamingDiLoCoFragment_{i}`); `DiLoCo` registers its schedule position (`DiLoCo`: local step,
sync_every, number of fragments, checked on load); the user registers the model and inner
optimizer as for per-step training.
"""

from __future__ import annotations

import logging
import warnings
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn, optim

from ft_core.checkpointing.dtensor_wire import is_dtensor
from ft_core.ddp import register_reductions
from ft_core.diloco import DiLoCoFragment, extract_local_tensor
from ft_core.errors import ConfigError
from ft_core.managed_work import allreduce_kept

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from ft_core.manager import Manager

logger = logging.getLogger(__name__)

__all__ = ["DiLoCo", "LocalSGD", "extract_local_tensor"]

SCHEDULE_KEY = "DiLoCo"


def _check_sync_every(sync_every: Any) -> int:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(f"sync_every must be an integer >= 1 (inner steps between syncs), got {sync_every!r}")
    return sync_every


class _InnerLoopHooks:
    """Hooks on the inner optimizer: healing may not read the state while `step()` updates it."""

    def __init__(self, manager: "Manager", optimizer: optim.Optimizer) -> None:
        self._manager = manager
        self._optimizer = optimizer
        self._hooks: list[RemovableHandle] = []
        self._reads_blocked = False

    def install(self, post: Any) -> None:
        self._hooks.append(self._optimizer.register_step_pre_hook(self._pre))
        self._hooks.append(self._optimizer.register_step_post_hook(lambda o, a, k: (self._allow(), post())))

    def _pre(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._manager.disallow_state_dict_read()
        self._reads_blocked = True

    def _allow(self) -> None:
        if self._reads_blocked:
            self._reads_blocked = False
            self._manager.allow_state_dict_read()

    def remove(self) -> None:
        self._allow()  # a step that raised between the hooks must not leave healing blocked
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


class LocalSGD:
    """Average the model's parameters across the groups every `sync_every` inner steps.

    A sync is one Manager step; if it does not commit, each group keeps its local parameters and
    tries again after the next `sync_every` steps (torchft's behaviour).
    """

    def __init__(self, manager: "Manager", model: nn.Module, optimizer: optim.Optimizer, sync_every: int) -> None:
        self._manager = manager
        self._model = model
        self._local_optimizer = optimizer
        self._sync_every = _check_sync_every(sync_every)
        self._local_step = 0
        self._hooks = _InnerLoopHooks(manager, optimizer)
        register_reductions(manager, self, list(model.parameters()))  # a peer with another model is refused

    def __enter__(self) -> "LocalSGD":
        self._hooks.install(self._after_inner_step)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._hooks.remove()
        return False

    def _after_inner_step(self) -> None:
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> None:
        """Synchronize now: quorum, average the parameters, commit."""
        self._manager.start_quorum()
        self._perform_sync()
        self._local_step = 0

    def _perform_sync(self) -> None:
        params = list(self._model.parameters())
        averaged = [extract_local_tensor(p) for p in params]
        works = [allreduce_kept(self._manager, t) for t in averaged]  # kept: a lost peer's sync is redone
        for work in works:
            work.wait()
        if self._manager.should_commit():
            with torch.no_grad():
                for p, avg in zip(params, averaged):
                    data = p.data
                    (data.to_local() if is_dtensor(data) else data).copy_(avg)


class DiLoCo:
    """DiLoCo and Streaming DiLoCo over `model_fragments` (one module for plain DiLoCo).

    `sync_every` counts inner steps for the whole model: each of the n fragments is synced every
    `sync_every // n` steps, in turn. `outer_optimizer` is one optimizer over every fragment's
    parameters or a list with one per fragment.
    """

    def __init__(self, manager: "Manager", model_fragments: list[nn.Module], inner_optimizer: optim.Optimizer,
                 outer_optimizer: optim.Optimizer | list[optim.Optimizer], sync_every: int,
                 backup_device: torch.device | None = None, pin_memory: bool = True,
                 use_bucketization: bool = False, bucket_cap_mb: float | None = None,
                 should_quantize: bool = False, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0) -> None:
        if isinstance(model_fragments, nn.Module):
            model_fragments = [model_fragments]
        fragments = list(model_fragments)
        sync_every = _check_sync_every(sync_every)
        if not fragments:
            raise ConfigError("DiLoCo needs at least one model fragment (pass [model] for plain DiLoCo)")
        if isinstance(outer_optimizer, (list, tuple)) and len(outer_optimizer) != len(fragments):
            raise ConfigError(f"{len(outer_optimizer)} outer optimizers for {len(fragments)} model fragments: "
                              f"pass one outer optimizer, or one per fragment")
        if manager.config.use_async_quorum:
            raise ConfigError("DiLoCo needs a synchronous quorum, so that a healing group loads the global "
                              "copy before computing its pseudo-gradients: create the Manager with "
                              "use_async_quorum=False")
        if sync_every < len(fragments) or sync_every % len(fragments):
            raise ConfigError(f"sync_every={sync_every} must be a multiple of the number of fragments "
                              f"({len(fragments)}): one fragment is synced every sync_every/n inner steps")
        self._sync_every = sync_every // len(fragments)  # inner steps between two fragment syncs
        if isinstance(fragment_sync_delay, bool) or not isinstance(fragment_sync_delay, int) or \
                not 0 <= fragment_sync_delay < self._sync_every:
            raise ConfigError(f"fragment_sync_delay={fragment_sync_delay!r} must be an integer in "
                              f"[0, {self._sync_every}) (sync_every / number of fragments): a fragment's "
                              f"allreduce must finish before it is started again")
        if not 0.0 <= float(fragment_update_alpha) <= 1.0:
            raise ConfigError(f"fragment_update_alpha={fragment_update_alpha!r} must be in [0, 1]")
        if should_quantize:
            warnings.warn("should_quantize=True: ft_core has no quantized allreduce; pseudo-gradients are sent "
                          "in full precision", stacklevel=2)
        self.should_quantize = should_quantize
        self._manager = manager
        self._local_optimizer = inner_optimizer
        self._fragment_sync_delay = fragment_sync_delay
        self._total_sync_every = sync_every
        self._local_step = 0
        self._healed_step: int | None = None  # the step a heal loaded in this sync's quorum
        self._syncing: int | None = None  # the fragment prepared for the coming sync
        self._fragments = [
            DiLoCoFragment(manager, fragment, i,
                           outer_optimizer[i] if isinstance(outer_optimizer, (list, tuple)) else outer_optimizer,
                           backup_device=backup_device, pin_memory=pin_memory, use_bucketization=use_bucketization,
                           bucket_cap_mb=bucket_cap_mb, fragment_update_alpha=float(fragment_update_alpha))
            for i, fragment in enumerate(fragments)]
        self._hooks = _InnerLoopHooks(manager, inner_optimizer)
        for fragment in self._fragments:
            fragment.save_parameters()
            fragment.register_state_dict_fn()
        manager.register_state_dict_fn(SCHEDULE_KEY, self._load_schedule, self._schedule)
        logger.info("DiLoCo: %d fragment(s), a fragment sync every %d inner steps (sync_every=%d), delay %d, "
                    "alpha %s, bucketization %s", len(self._fragments), self._sync_every, sync_every,
                    fragment_sync_delay, fragment_update_alpha, use_bucketization)

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> "DiLoCo":
        self._hooks.install(self._after_inner_step)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._hooks.remove()
        return False

    # ------------------------------------------------------------------ schedule

    @property
    def fragments(self) -> list[DiLoCoFragment]:
        return list(self._fragments)

    @property
    def local_step(self) -> int:
        """Inner steps since the last fragment sync."""
        return self._local_step

    def _schedule(self) -> dict[str, int]:
        return {"local_step": self._local_step, "step": self._manager.current_step(),
                "sync_every": self._total_sync_every, "num_fragments": len(self._fragments),
                "fragment_sync_delay": self._fragment_sync_delay}

    def _load_schedule(self, state: dict[str, int]) -> None:
        mine = self._schedule()
        for key in ("sync_every", "num_fragments", "fragment_sync_delay"):
            if int(state[key]) != mine[key]:
                raise ConfigError(f"DiLoCo {key}={mine[key]} here but {state[key]} on the group this one heals "
                                  f"from: every group must use the same sync_every, fragments and delay")
        self._local_step = int(state["local_step"])
        self._healed_step = int(state["step"])

    def _start_quorum(self) -> int:
        """Start the sync's quorum (synchronous: a healing group loads the state now); returns the
        fragment every group syncs: torchft's `manager step % n`, with the healed step for a group that
        just healed (the Manager adopts that step only when the sync commits)."""
        self._healed_step = None
        self._manager.start_quorum()
        step = self._healed_step if self._healed_step is not None else self._manager.current_step()
        self._syncing = step % len(self._fragments)
        return self._syncing

    def _after_inner_step(self) -> None:
        # All groups must prepare and sync the same fragment in the same order, or their
        # allreduces would pair different tensors: the choice depends only on the (healed) step.
        self._local_step += 1
        if self._local_step == self._sync_every - self._fragment_sync_delay:
            fragment = self._start_quorum()
            logger.debug("DiLoCo preparing fragment %d at local step %d", fragment, self._local_step)
            self._fragments[fragment].prepare_sync()
        if self._local_step < self._sync_every:
            return
        fragment = self._syncing if self._syncing is not None else self._start_quorum()
        logger.debug("DiLoCo syncing fragment %d (manager step %d)", fragment, self._manager.current_step())
        self._syncing = None
        self._fragments[fragment].perform_sync()
        self._local_step = 0

    def sync_now(self) -> bool:
        """Prepare (if needed) and perform the current fragment's sync at once; True if it committed.

        For loops that end between syncs and want the last local progress folded in.
        """
        if self._syncing is None:
            self._fragments[self._start_quorum()].prepare_sync()
        fragment, self._syncing = self._fragments[self._syncing], None
        committed = fragment.perform_sync()
        self._local_step = 0
        return committed
