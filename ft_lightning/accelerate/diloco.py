"""`FaultTolerantDiLoCoAccelerator`: (Streaming) DiLoCo across replica groups for Accelerate.

    from ft_lightning.accelerate import DiLoCoPlugin, FaultTolerancePlugin, FaultTolerantDiLoCoAccelerator
    accelerator = FaultTolerantDiLoCoAccelerator(ft=FaultTolerancePlugin(...), diloco=DiLoCoPlugin(sync_every=100))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:                     # the usual Accelerate loop
        loss = ...; accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()

Inside a group it is Accelerate's own data parallelism; across groups nothing is sent per step: the
prepared optimizer is DiLoCo's inner optimizer and `ft_core.DiLoCo` syncs every `sync_every` inner
steps (one Manager step, commit-gated). What heals is the per-step accelerator's (models,
optimizers, schedulers, RNG, registered objects) plus DiLoCo's global copies, outer optimizer state
and schedule, received at a sync's quorum. `ft_stats["cross_group_allreduces"]` counts what crossed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from ft_core import DiLoCo
from ft_core.errors import ConfigError
from ft_lightning._diloco_options import DiLoCoOptions
from ft_lightning.accelerate.accelerator import FaultTolerantAccelerator
from ft_lightning.accelerate.plugin import FaultTolerancePlugin

__all__ = ["DiLoCoPlugin", "FaultTolerantDiLoCoAccelerator"]


class DiLoCoPlugin(DiLoCoOptions):
    """DiLoCo's settings (torchft's names), those of the Lightning strategies (`DiLoCoOptions`):
    `outer_optimizer` maps a fragment's parameters to its outer optimizer (default Nesterov SGD, lr 0.7,
    momentum 0.9); `fragments` is a count (contiguous runs of the model's leaf modules) or a function
    of the unwrapped model returning the fragment modules."""


class FaultTolerantDiLoCoAccelerator(FaultTolerantAccelerator):
    """`FaultTolerantAccelerator` in DiLoCo mode: one model and one optimizer (see the module docstring)."""

    def __init__(self, ft: FaultTolerancePlugin | None = None, diloco: DiLoCoPlugin | None = None,
                 **accelerator_kwargs: Any) -> None:
        ft = dataclasses.replace(ft if ft is not None else FaultTolerancePlugin(), async_quorum=False)
        if ft.async_quorum:
            raise ConfigError("DiLoCo needs a synchronous quorum (a healing group loads the global copy before "
                              "computing its pseudo-gradients): unset FT_ASYNC_QUORUM")
        self.diloco_plugin = diloco if diloco is not None else DiLoCoPlugin()
        self.diloco: DiLoCo | None = None
        self.outer_optimizers: list[torch.optim.Optimizer] = []
        self._diloco_model: nn.Module | None = None
        super().__init__(ft, **accelerator_kwargs)

    def ft_start_step(self) -> None:
        """No per-step quorum in DiLoCo mode: DiLoCo starts one at each sync."""

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        with Accelerator.accumulate(self, *models):
            yield

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        already = getattr(model, "_is_accelerate_prepared", False)
        prepared = Accelerator.prepare_model(self, model, device_placement=device_placement,
                                             evaluation_mode=evaluation_mode)
        if evaluation_mode or already or not any(p.requires_grad for p in prepared.parameters()):
            return prepared
        if self._diloco_model is not None:
            raise ConfigError("FaultTolerantDiLoCoAccelerator drives one model; prepare only one trainable model")
        self._diloco_model = self.unwrap_model(prepared)
        self._ft_register("model", self._diloco_model)
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
                          ) -> torch.optim.Optimizer:
        already = getattr(optimizer, "_is_accelerate_prepared", False)
        prepared = Accelerator.prepare_optimizer(self, optimizer, device_placement=device_placement)
        if already:
            return prepared
        if self.diloco is not None or self._diloco_model is None:
            raise ConfigError("FaultTolerantDiLoCoAccelerator: prepare one model and then its one optimizer "
                              "(accelerator.prepare(model, optimizer, ...))")
        self._ft_register("optimizer", prepared)
        self.diloco, self.outer_optimizers = self.diloco_plugin.build(self.ft_manager, self._diloco_model,
                                                                      prepared.optimizer)
        return prepared

    def ft_shutdown(self) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        super().ft_shutdown()
