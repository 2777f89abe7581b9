"""ft_core: the engine of ft-lightning (no Lightning or Accelerate imports here).

Public names are imported lazily so that `import ft_core` stays cheap for the CLI and servers.
"""

from __future__ import annotations

import gc
import importlib
import warnings
from typing import Any

from ft_core import settings
from ft_core.errors import ConfigError

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


def freeze_startup_objects() -> None:
    """gc.freeze() unless FT_GC_FREEZE=0: the objects made so far (modules, classes, functions of torch and of
    every import) live as long as the process, and each full collection of a starting worker scans them all
    again (five collections of ~65 ms while torch and torch._dynamo import; more on busy cores). Frozen, they
    are no longer scanned; collections find garbage among the objects made after. Called when ft_core is
    imported and again once ft_core.manager (which imports torch) is, so either import order is covered;
    a cheap call (a list splice) that moves only what appeared since."""
    try:
        freeze = settings.value("FT_GC_FREEZE")
    except ConfigError as exc:  # only speed is at stake: say so once (one call site) rather than fail an import
        warnings.warn(f"{exc}; the objects are not frozen")
        return
    if freeze:
        gc.freeze()


freeze_startup_objects()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ft_core' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
