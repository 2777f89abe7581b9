"""`FaultTolerantFabricDDPStrategy` for Lightning Fabric (`lightning.fabric`).

    import ft_lightning  # registers "fault_tolerant_ddp" for Fabric too
    fabric = Fabric(strategy="fault_tolerant_ddp", accelerator="cpu", devices=1)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    manager = fabric.strategy.manager
    while manager.current_step() < total_steps:
        loss = model(batch_for(manager.current_step()))   # first training forward starts the quorum
        fabric.backward(loss)
        optimizer.step()                                 # applied only when the step commits
        optimizer.zero_grad()
    fabric.strategy.shutdown()

DiLoCo across groups instead of per-step averaging: `Fabric(strategy="fault_tolerant_diloco")` or
`FaultTolerantFabricDiLoCoStrategy(sync_every=H, outer_optimizer=..., fragments=n)`, a plain loop with no
quorum per step (see `ft_lightning._diloco_mixins`).

See `ft_lightning._fabric_strategy` and docs/lightning.md.
"""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy

from ft_lightning._diloco_mixins import FaultTolerantFabricDiLoCoMixin
from ft_lightning._fabric_strategy import FaultTolerantFabricMixin
from ft_lightning._registration import register

__all__ = ["FaultTolerantFabricDDPStrategy", "FaultTolerantFabricDiLoCoStrategy"]


class FaultTolerantFabricDDPStrategy(FaultTolerantFabricMixin, DDPStrategy):
    __doc__ = FaultTolerantFabricMixin.__doc__


class FaultTolerantFabricDiLoCoStrategy(FaultTolerantFabricDiLoCoMixin, DDPStrategy):
    __doc__ = FaultTolerantFabricDiLoCoMixin.__doc__


register("lightning.fabric", FaultTolerantFabricDDPStrategy)
FaultTolerantFabricDiLoCoStrategy.register_strategies(STRATEGY_REGISTRY)  # "fault_tolerant_diloco"
