"""DiLoCo's arguments and fragments, shared by the Lightning strategies and the Accelerate accelerator
(torch and ft_core only: no Lightning or Accelerate imports)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ft_core import DiLoCo
from ft_core.errors import ConfigError

__all__ = ["DiLoCoOptions", "default_outer_optimizer", "split_fragments"]


def default_outer_optimizer(params: Any) -> torch.optim.Optimizer:
    """The DiLoCo paper's outer optimizer: Nesterov SGD, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def split_fragments(module: nn.Module, n: int) -> list[nn.Module]:
    """The module's leaf modules that hold parameters, in order, cut into n contiguous fragments."""
    if n == 1:
        return [module]
    leaves = [m for m in module.modules() if not list(m.children()) and any(True for _ in m.parameters(recurse=False))]
    if len(leaves) < n:
        raise ConfigError(f"fragments={n} but the model has only {len(leaves)} modules with parameters; pass fewer "
                          f"fragments or a function returning the fragment modules")
    bounds = [round(i * len(leaves) / n) for i in range(n + 1)]
    groups = [leaves[a:b] for a, b in zip(bounds, bounds[1:])]
    return [g[0] if len(g) == 1 else nn.ModuleList(g) for g in groups]


@dataclass(frozen=True)
class DiLoCoOptions:
    """DiLoCo's arguments (torchft's names) for a strategy; see `ft_core.DiLoCo`.

    outer_optimizer: a function of a fragment's parameters returning its outer optimizer (default
    Nesterov SGD, lr 0.7, momentum 0.9), called once per fragment. fragments: a count (contiguous runs
    of the model's leaf modules) or a function of the model returning the fragment modules."""

    sync_every: int = 100
    outer_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    fragments: int | Callable[[nn.Module], list[nn.Module]] = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    use_bucketization: bool = True
    bucket_cap_mb: float | None = None

    def __post_init__(self) -> None:
        if not callable(self.fragments) and (isinstance(self.fragments, bool) or not isinstance(self.fragments, int)
                                             or self.fragments < 1):
            raise ConfigError(f"fragments must be >= 1 or a function returning the fragment modules, "
                              f"got {self.fragments!r}")

    @staticmethod
    def synchronous_quorum(kwargs: dict[str, Any], who: str) -> dict[str, Any]:
        """`kwargs` with use_async_quorum=False; a request for an async quorum is an error naming the fix."""
        if kwargs.get("use_async_quorum"):
            raise ConfigError(f"{who} needs a synchronous quorum (a healing group loads the global copy before "
                              "its pseudo-gradients are computed): drop use_async_quorum=True")
        return {**kwargs, "use_async_quorum": False}

    def build(self, manager: Any, model: nn.Module, inner: torch.optim.Optimizer
              ) -> tuple[DiLoCo, list[torch.optim.Optimizer]]:
        """DiLoCo over `model`'s fragments with `inner` as its inner optimizer, entered (its hooks are on)."""
        fragments = list(self.fragments(model)) if callable(self.fragments) else split_fragments(model, self.fragments)
        factory = self.outer_optimizer or default_outer_optimizer
        outer = [factory(f.parameters()) for f in fragments]
        diloco = DiLoCo(manager, fragments, inner, outer, sync_every=self.sync_every,
                        fragment_sync_delay=self.fragment_sync_delay,
                        fragment_update_alpha=self.fragment_update_alpha,
                        use_bucketization=self.use_bucketization, bucket_cap_mb=self.bucket_cap_mb)
        diloco.__enter__()
        return diloco, outer
