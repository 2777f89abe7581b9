"""Fault tolerance for Hugging Face Accelerate: one object added to a script, or settings from launch.

    from ft_lightning.accelerate import FaultTolerantAccelerator, FaultTolerancePlugin
    accelerator = FaultTolerantAccelerator(ft=FaultTolerancePlugin(lighthouse="127.0.0.1:29510"))

Importing this package never imports Lightning; Accelerate itself is imported only when the
accelerator is used (the plugin and the config helpers work without it).
"""

from __future__ import annotations

import importlib
from typing import Any

from ft_lightning.accelerate.plugin import FaultTolerancePlugin

_LAZY = {
    "FaultTolerantAccelerator": "ft_lightning.accelerate.accelerator",
    "FaultTolerantOptimizer": "ft_lightning.accelerate.accelerator",
    "DiLoCoPlugin": "ft_lightning.accelerate.diloco",
    "FaultTolerantDiLoCoAccelerator": "ft_lightning.accelerate.diloco",
}

__all__ = ["DiLoCoPlugin", "FaultTolerancePlugin", "FaultTolerantAccelerator", "FaultTolerantDiLoCoAccelerator",
           "FaultTolerantOptimizer"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ft_lightning.accelerate' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
