"""`FaultTolerantDDPStrategy` for the Lightning Trainer (`lightning.pytorch`).

    import ft_lightning  # registers "fault_tolerant_ddp"
    trainer = Trainer(strategy="fault_tolerant_ddp", devices=2)           # settings from FT_* env
    trainer = Trainer(strategy=FaultTolerantDDPStrategy(min_replica_size=2))  # or as arguments

See `ft_lightning._trainer_strategy` for what it does and docs/lightning.md for how to run it.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy

from ft_lightning._diloco import FaultTolerantDiLoCoStrategy
from ft_lightning._registration import register
from ft_lightning._trainer_strategy import FaultTolerantTrainerMixin

__all__ = ["FaultTolerantDDPStrategy", "FaultTolerantDiLoCoStrategy"]  # "fault_tolerant_diloco": see _diloco


class FaultTolerantDDPStrategy(FaultTolerantTrainerMixin, DDPStrategy):
    __doc__ = FaultTolerantTrainerMixin.__doc__


register("lightning.pytorch", FaultTolerantDDPStrategy)
