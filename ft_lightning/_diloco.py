"""`FaultTolerantDiLoCoStrategy`: (Streaming) DiLoCo for the Lightning Trainer, registered as
"fault_tolerant_diloco".

Switching from per-step DDP to DiLoCo is a matter of arguments:

    Trainer(strategy=FaultTolerantDiLoCoStrategy(sync_every=100,
            outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)))

Inside a replica group it is Lightning's DDP (gradients averaged among the group's ranks every
step); across groups nothing is sent per step: the optimizer from `configure_optimizers` is DiLoCo's
inner optimizer, and every `sync_every` inner steps `ft_core.DiLoCo` averages the pseudo-gradients
across the groups (one Manager step, commit-gated) and applies them with the outer optimizer.
`fragments=n` (or a function returning the modules) gives Streaming DiLoCo. Healing is the
per-step strategy's (model, optimizers, schedulers, precision, loop progress, RNG, data position),
received at a sync's quorum, plus DiLoCo's global copy and outer optimizer state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from ft_core import DiLoCo
from ft_core.errors import ConfigError
from ft_lightning import _progress
from ft_lightning._common import capture_rng
from ft_lightning._trainer_strategy import FaultTolerantTrainerMixin

logger = logging.getLogger(__name__)

__all__ = ["DILOCO_STRATEGY_NAME", "FaultTolerantDiLoCoStrategy", "split_fragments"]

DILOCO_STRATEGY_NAME = "fault_tolerant_diloco"


def default_outer_optimizer(params: Any) -> torch.optim.Optimizer:
    """The DiLoCo paper's outer optimizer: Nesterov SGD, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def split_fragments(module: nn.Module, n: int) -> list[nn.Module]:
    """The module's leaf modules that hold parameters, in order, cut into n contiguous fragments."""
    if n == 1:
        return [module]
    leaves = [m for m in module.modules() if not list(m.children()) and any(True for _ in m.parameters(recurse=False))]
    if len(leaves) < n:
        raise ConfigError(f"fragments={n} but the model has only {len(leaves)} modules with parameters; pass fewer "
                          f"fragments or a function returning the fragment modules")
    bounds = [round(i * len(leaves) / n) for i in range(n + 1)]
    groups = [leaves[a:b] for a, b in zip(bounds, bounds[1:])]
    return [g[0] if len(g) == 1 else nn.ModuleList(g) for g in groups]


class FaultTolerantDiLoCoStrategy(FaultTolerantTrainerMixin, DDPStrategy):
    """DiLoCo across replica groups, DDP inside each (see the module docstring).

    Arguments: those of `FaultTolerantDDPStrategy`, plus DiLoCo's (torchft's names):
        sync_every: inner steps between syncs of the whole model (default 100).
        outer_optimizer: a function of the parameters returning the outer optimizer (default Nesterov
            SGD, lr 0.7, momentum 0.9), called once per fragment.
        fragments: number of Streaming DiLoCo fragments, or a function of the LightningModule returning
            the fragment modules (default 1: plain DiLoCo).
        fragment_sync_delay, fragment_update_alpha, use_bucketization, bucket_cap_mb: as in `ft_core.DiLoCo`.
    """

    def __init__(self, lighthouse_addr: str | None = None, *, sync_every: int = 100,
                 outer_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                 fragments: int | Callable[[nn.Module], list[nn.Module]] = 1, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, use_bucketization: bool = True,
                 bucket_cap_mb: float | None = None, **kwargs: Any) -> None:
        if kwargs.get("use_async_quorum"):
            raise ConfigError("fault_tolerant_diloco needs a synchronous quorum (a healing group loads the "
                              "global copy before its pseudo-gradients are computed): drop use_async_quorum=True")
        kwargs["use_async_quorum"] = False
        super().__init__(lighthouse_addr, **kwargs)
        if isinstance(fragments, int) and fragments < 1:
            raise ConfigError(f"fragments must be >= 1 or a function returning the fragment modules, got {fragments}")
        self._diloco_args = dict(sync_every=sync_every, fragment_sync_delay=fragment_sync_delay,
                                 fragment_update_alpha=fragment_update_alpha, use_bucketization=use_bucketization,
                                 bucket_cap_mb=bucket_cap_mb)
        self._outer_factory = outer_optimizer or default_outer_optimizer
        self._fragments = fragments
        self._diloco: DiLoCo | None = None
        self.outer_optimizers: list[torch.optim.Optimizer] = []

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if DILOCO_STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(DILOCO_STRATEGY_NAME, cls,
                                       description="DDP inside one replica group, fault-tolerant DiLoCo across "
                                                   "groups (ft_lightning)")

    @property
    def diloco(self) -> DiLoCo:
        if self._diloco is None:
            raise RuntimeError("DiLoCo is set up when trainer.fit() sets up the strategy")
        return self._diloco

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self._manager is None or trainer.state.fn != "fit":
            return
        if len(self.optimizers) != 1:
            raise ConfigError(f"fault_tolerant_diloco drives one inner optimizer; configure_optimizers returned "
                              f"{len(self.optimizers)}")
        module = self.lightning_module
        fragments = self._fragments(module) if callable(self._fragments) else split_fragments(module, self._fragments)
        self.outer_optimizers = [self._outer_factory(f.parameters()) for f in fragments]
        inner = self.optimizers[0]
        self._diloco = DiLoCo(self._manager, fragments, inner, self.outer_optimizers, **self._diloco_args)
        self._diloco.__enter__()

    def _register_ddp_hooks(self) -> None:
        DDPStrategy._register_ddp_hooks(self)  # inside the group only: nothing crosses groups per step

    # ---- the step: a plain DDP step; DiLoCo's optimizer hook syncs when due ----------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        DDPStrategy.on_train_batch_start(self, batch, batch_idx)
        if self._manager is not None:  # what a healing group adopts if a sync inside this batch heals it
            trainer = self.lightning_module.trainer
            self._window_snapshot = {"loops": _progress.snapshot(trainer), "rng": capture_rng()}

    def pre_backward(self, closure_loss: Any) -> None:
        DDPStrategy.pre_backward(self, closure_loss)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self._last_step_applied = True
        return DDPStrategy.optimizer_step(self, optimizer, closure, model, **kwargs)

    def teardown(self) -> None:
        if self._diloco is not None:
            self._diloco.__exit__(None, None, None)
        super().teardown()
