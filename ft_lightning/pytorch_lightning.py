"""`FaultTolerantDDPStrategy` for the standalone `pytorch_lightning` package.

`pytorch_lightning` has its own strategy registry and base classes (a `lightning.pytorch` strategy
is rejected by a `pytorch_lightning.Trainer`), so this is the same strategy over its `DDPStrategy`.
`import ft_lightning` registers "fault_tolerant_ddp" here too once `pytorch_lightning` is imported,
and "fault_tolerant_diloco" (`FaultTolerantDiLoCoStrategy`, DiLoCo across groups) with it.
"""

from __future__ import annotations

from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

from ft_lightning._diloco_mixins import FaultTolerantDiLoCoTrainerMixin
from ft_lightning._registration import register
from ft_lightning._trainer_strategy import FaultTolerantTrainerMixin

__all__ = ["FaultTolerantDDPStrategy", "FaultTolerantDiLoCoStrategy"]


class FaultTolerantDDPStrategy(FaultTolerantTrainerMixin, DDPStrategy):
    __doc__ = FaultTolerantTrainerMixin.__doc__


class FaultTolerantDiLoCoStrategy(FaultTolerantDiLoCoTrainerMixin, DDPStrategy):
    __doc__ = FaultTolerantDiLoCoTrainerMixin.__doc__


register("pytorch_lightning", FaultTolerantDDPStrategy)
FaultTolerantDiLoCoStrategy.register_strategies(StrategyRegistry)  # "fault_tolerant_diloco"
