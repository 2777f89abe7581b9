"""ft_lightning: fault-tolerant strategies for Lightning (Trainer and Fabric) and Accelerate.

`import ft_lightning` makes `Trainer(strategy="fault_tolerant_ddp")` and
`Fabric(strategy="fault_tolerant_ddp")` work: the name is registered in every Lightning namespace
already imported, and in the others as soon as they are imported (see `_registration`). It does
not import Lightning, torch or Accelerate itself; the strategy classes load on first use.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # keep `import ft_lightning` cheap: it may run at interpreter start-up
if TYPE_CHECKING:
    from typing import Any

from ft_lightning._registration import STRATEGY_NAME, install

__all__ = ["STRATEGY_NAME", "FaultTolerantDDPStrategy", "FaultTolerantFabricDDPStrategy"]

_EXPORTS = {
    "FaultTolerantDDPStrategy": "ft_lightning.strategy",
    "FaultTolerantFabricDDPStrategy": "ft_lightning.fabric",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ft_lightning' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


install()
