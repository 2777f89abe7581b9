"""ft_core: the engine of ft-lightning (no Lightning or Accelerate imports here).

Public names are imported lazily so that `import ft_core` stays cheap for the CLI and servers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "FTError": "ft_core.errors",
    "Manager": "ft_core.manager",
    "WorldSizeMode": "ft_core.manager",
    "DistributedDataParallel": "ft_core.ddp",
    "OptimizerWrapper": "ft_core.optim",
    "DistributedSampler": "ft_core.data",
    "LocalSGD": "ft_core.local_sgd",
    "DiLoCo": "ft_core.local_sgd",
    "LighthouseServer": "ft_core.control.lighthouse",
    "LighthouseClient": "ft_core.control.lighthouse_client",
    "ManagerServer": "ft_core.control.manager_server",
    "ManagerClient": "ft_core.control.manager_client",
    "HTTPTransport": "ft_core.checkpointing",
    "PGTransport": "ft_core.checkpointing",
    "ProcessGroupGloo": "ft_core.process_groups",
    "ProcessGroupNCCL": "ft_core.process_groups",
    "ProcessGroupXCCL": "ft_core.process_groups",
    "ProcessGroupBabyGloo": "ft_core.process_groups",
    "ProcessGroupBabyNCCL": "ft_core.process_groups",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ft_core' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
