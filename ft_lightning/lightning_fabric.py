"""`FaultTolerantFabricDDPStrategy` for the standalone `lightning_fabric` package (its own registry and
base classes); the same strategies as `ft_lightning.fabric` (per-step and DiLoCo)."""

from __future__ import annotations

from lightning_fabric.strategies import STRATEGY_REGISTRY, DDPStrategy

from ft_lightning._diloco_mixins import FaultTolerantFabricDiLoCoMixin
from ft_lightning._fabric_strategy import FaultTolerantFabricMixin
from ft_lightning._registration import register

__all__ = ["FaultTolerantFabricDDPStrategy", "FaultTolerantFabricDiLoCoStrategy"]


class FaultTolerantFabricDDPStrategy(FaultTolerantFabricMixin, DDPStrategy):
    __doc__ = FaultTolerantFabricMixin.__doc__


class FaultTolerantFabricDiLoCoStrategy(FaultTolerantFabricDiLoCoMixin, DDPStrategy):
    __doc__ = FaultTolerantFabricDiLoCoMixin.__doc__


register("lightning_fabric", FaultTolerantFabricDDPStrategy)
FaultTolerantFabricDiLoCoStrategy.register_strategies(STRATEGY_REGISTRY)  # "fault_tolerant_diloco"
