"""`FaultTolerantFabricDDPStrategy` for the standalone `lightning_fabric` package (its own registry and
base classes); the same strategy as `ft_lightning.fabric`."""

from __future__ import annotations

from lightning_fabric.strategies import DDPStrategy

from ft_lightning._fabric_strategy import FaultTolerantFabricMixin
from ft_lightning._registration import register

__all__ = ["FaultTolerantFabricDDPStrategy"]


class FaultTolerantFabricDDPStrategy(FaultTolerantFabricMixin, DDPStrategy):
    __doc__ = FaultTolerantFabricMixin.__doc__


register("lightning_fabric", FaultTolerantFabricDDPStrategy)
