"""`FaultTolerantDiLoCoStrategy`: (Streaming) DiLoCo for the Lightning Trainer (`lightning.pytorch`),
registered as "fault_tolerant_diloco".

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
The same strategy for `pytorch_lightning` and for Fabric: `ft_lightning._diloco_mixins`.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from ft_lightning._diloco_mixins import (
    DILOCO_STRATEGY_NAME,
    FaultTolerantDiLoCoTrainerMixin,
    default_outer_optimizer,
    split_fragments,
)

__all__ = ["DILOCO_STRATEGY_NAME", "FaultTolerantDiLoCoStrategy", "default_outer_optimizer", "split_fragments"]


class FaultTolerantDiLoCoStrategy(FaultTolerantDiLoCoTrainerMixin, DDPStrategy):
    __doc__ = FaultTolerantDiLoCoTrainerMixin.__doc__


FaultTolerantDiLoCoStrategy.register_strategies(StrategyRegistry)  # "fault_tolerant_diloco"
