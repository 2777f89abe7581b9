"""DiLoCo mode of the Lightning strategies, written once for every namespace (no Lightning imports).

`FaultTolerantDiLoCoTrainerMixin` (Trainer: `lightning.pytorch`, `pytorch_lightning`) and
`FaultTolerantFabricDiLoCoMixin` (Fabric: `lightning.fabric`, `lightning_fabric`) turn the per-step
fault-tolerant strategies into (Streaming) DiLoCo across replica groups with arguments:

    sync_every=H, outer_optimizer=lambda params: SGD(params, ...), fragments=n

Inside a group it stays the namespace's DDP (gradients averaged among the group's ranks every step);
across groups nothing is sent per step: the user's optimizer is DiLoCo's inner optimizer and
`ft_core.DiLoCo` averages pseudo-gradients every `sync_every` inner steps (one Manager step,
commit-gated) and applies them with the outer optimizer. Healing is the per-step strategy's state
plus DiLoCo's global copies, outer optimizer state and schedule, received at a sync's quorum.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ft_core import DiLoCo
from ft_core.errors import ConfigError
from ft_lightning._diloco_options import (
    DiLoCoOptions,
    default_outer_optimizer,
    split_fragments,
)
from ft_lightning._fabric_strategy import FaultTolerantFabricMixin
from ft_lightning._trainer_strategy import FaultTolerantTrainerMixin, window_state

logger = logging.getLogger(__name__)

__all__ = ["DILOCO_STRATEGY_NAME", "DiLoCoOptions", "FaultTolerantDiLoCoTrainerMixin",
           "FaultTolerantFabricDiLoCoMixin", "default_outer_optimizer", "split_fragments"]

DILOCO_STRATEGY_NAME = "fault_tolerant_diloco"
_DESCRIPTION = "DDP inside one replica group, fault-tolerant DiLoCo across groups (ft_lightning)"


class _DiLoCoStrategyMixin:
    """What both DiLoCo strategies share: the arguments, the DiLoCo object, the name they register."""

    def __init__(self, lighthouse_addr: str | None = None, *, sync_every: int = 100,
                 outer_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                 fragments: int | Callable[[nn.Module], list[nn.Module]] = 1, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, use_bucketization: bool = True,
                 bucket_cap_mb: float | None = None, **kwargs: Any) -> None:
        kwargs = DiLoCoOptions.synchronous_quorum(kwargs, DILOCO_STRATEGY_NAME)
        self._diloco_options = DiLoCoOptions(sync_every, outer_optimizer, fragments, fragment_sync_delay,
                                             fragment_update_alpha, use_bucketization, bucket_cap_mb)
        super().__init__(lighthouse_addr, **kwargs)  # type: ignore[call-arg]
        self._diloco: DiLoCo | None = None
        self.outer_optimizers: list[torch.optim.Optimizer] = []

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if DILOCO_STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(DILOCO_STRATEGY_NAME, cls, description=_DESCRIPTION)

    @property
    def diloco(self) -> DiLoCo:
        """The `ft_core.DiLoCo` driving the syncs (e.g. `diloco.sync_now()` at the end of a loop)."""
        if self._diloco is None:
            raise RuntimeError("DiLoCo is set up with the model and its optimizer (trainer.fit() or fabric.setup())")
        return self._diloco

    def _exit_diloco(self) -> None:
        if self._diloco is not None:
            self._diloco.__exit__(None, None, None)


class FaultTolerantDiLoCoTrainerMixin(_DiLoCoStrategyMixin, FaultTolerantTrainerMixin):
    """DiLoCo across replica groups, DDP inside each, for the Lightning Trainer.

    Arguments: those of `FaultTolerantDDPStrategy`, plus DiLoCo's (torchft's names):
        sync_every: inner steps between syncs of the whole model (default 100).
        outer_optimizer: a function of the parameters returning the outer optimizer (default Nesterov
            SGD, lr 0.7, momentum 0.9), called once per fragment.
        fragments: number of Streaming DiLoCo fragments, or a function of the LightningModule returning
            the fragment modules (default 1: plain DiLoCo).
        fragment_sync_delay, fragment_update_alpha, use_bucketization, bucket_cap_mb: as in `ft_core.DiLoCo`.
    """

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self._manager is None or trainer.state.fn != "fit":
            return
        if len(self.optimizers) != 1:  # type: ignore[attr-defined]
            raise ConfigError(f"{DILOCO_STRATEGY_NAME} drives one inner optimizer; configure_optimizers returned "
                              f"{len(self.optimizers)}")  # type: ignore[attr-defined]
        self._diloco, self.outer_optimizers = self._diloco_options.build(
            self._manager, self.lightning_module, self.optimizers[0])  # type: ignore[attr-defined]

    # The per-step strategy's hooks are skipped (super() past FaultTolerantTrainerMixin: the namespace's
    # DDPStrategy): gradients cross nothing but the group; DiLoCo's optimizer hook syncs when due.

    def _register_ddp_hooks(self) -> None:
        super(FaultTolerantTrainerMixin, self)._register_ddp_hooks()  # type: ignore[misc]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super(FaultTolerantTrainerMixin, self).on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._manager is not None:  # what a healing group adopts if a sync inside this batch heals it
            self._window_snapshot = window_state(self.lightning_module.trainer)  # type: ignore[attr-defined]

    def pre_backward(self, closure_loss: Any) -> None:
        super(FaultTolerantTrainerMixin, self).pre_backward(closure_loss)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self._last_step_applied = True
        return super(FaultTolerantTrainerMixin, self).optimizer_step(optimizer, closure, model,  # type: ignore[misc]
                                                                     **kwargs)

    def teardown(self) -> None:
        self._exit_diloco()
        super().teardown()


class FaultTolerantFabricDiLoCoMixin(_DiLoCoStrategyMixin, FaultTolerantFabricMixin):
    """DiLoCo across replica groups, DDP inside each, for Lightning Fabric: one model and one optimizer.

        fabric = Fabric(strategy=FaultTolerantFabricDiLoCoStrategy(sync_every=100, fragments=2))
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)      # the optimizer is DiLoCo's inner one
        for step in range(steps):                               # a plain Fabric loop: no quorum per step
            loss = ...; fabric.backward(loss); optimizer.step(); optimizer.zero_grad()
        fabric.strategy.shutdown()

    Arguments: those of `FaultTolerantFabricDDPStrategy`, plus DiLoCo's as in
    `FaultTolerantDiLoCoStrategy` (`fragments` as a function receives the unwrapped model). Every
    `optimizer.step()` applies (the inner step); a sync's outer step applies only when the sync commits.
    A group that joins between syncs heals at its first sync: modules, optimizers, precision, RNG,
    `register_state(...)` objects (e.g. the loop's position), the global copies, outer optimizer state
    and schedule; drive the loop from such a registered position so a healed group goes on from its peers'.
    """

    def setup_module(self, module: Any) -> Any:
        if self._ft_modules:
            raise ConfigError(f"{DILOCO_STRATEGY_NAME} for Fabric drives one model; set up only one")
        # Fabric's DDP only (past FaultTolerantFabricMixin): no cross-group comm hook, no quorum per forward.
        ddp = super(FaultTolerantFabricMixin, self).setup_module(module)  # type: ignore[misc]
        self._ft_modules.append(ddp.module)
        return ddp

    def setup_optimizer(self, optimizer: Any) -> Any:
        if self._diloco is not None:
            raise ConfigError(f"{DILOCO_STRATEGY_NAME} for Fabric drives one inner optimizer; set up only one")
        if not self._ft_modules:
            raise ConfigError(f"{DILOCO_STRATEGY_NAME}: set up the model with its optimizer "
                              "(fabric.setup(model, optimizer))")
        prepared = super().setup_optimizer(optimizer)  # recorded for healing
        self._diloco, self.outer_optimizers = self._diloco_options.build(self.manager, self._ft_modules[0], optimizer)
        return prepared

    def start_quorum(self) -> None:
        """No per-step quorum in DiLoCo mode: DiLoCo starts one at each sync."""

    def backward(self, tensor: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        super(FaultTolerantFabricMixin, self).backward(tensor, module, *args, **kwargs)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The inner step, always applied; DiLoCo's hook on the optimizer syncs when one is due."""
        self.last_step_committed = True
        return super(FaultTolerantFabricMixin, self).optimizer_step(optimizer, **kwargs)  # type: ignore[misc]

    def shutdown(self) -> None:
        self._exit_diloco()
        super().shutdown()
