"""torchmetrics `Metric` sync over the live replica groups, for the Trainer strategy.

A `Metric` syncs its states with its `dist_sync_fn` (torchmetrics' `gather_all_tensors` over
torch.distributed's default world, which is one replica group here) when it computes. The strategy gives
every Metric of the LightningModule that has no `dist_sync_fn` of its own `MetricSync`: the in-group
gather, then, at a training epoch's end (where every live group computes the same metrics in the same
order), each group's states gathered across the live groups through LiveQuorum's checked, bounded
rounds, so an epoch-level training metric covers the data of every live group, as under DDP. In
validation (every group evaluates the whole validation set), inside a step (`dist_sync_on_step`) and
anywhere else, and when the cross-group gather cannot be made, it is the in-group gather.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

try:  # Lightning depends on torchmetrics; without it there is nothing to sync
    from torchmetrics import Metric
    from torchmetrics.utilities.distributed import gather_all_tensors
except ImportError:  # pragma: no cover - torchmetrics not installed
    Metric = None
    gather_all_tensors = None

logger = logging.getLogger(__name__)


class MetricSync:
    """A torchmetrics `dist_sync_fn`: the in-group gather, then across the live groups when `crossing()`."""

    def __init__(self, live: Callable[[], Any], crossing: Callable[[], bool]) -> None:
        self._live = live
        self._crossing = crossing

    def __deepcopy__(self, memo: dict[int, Any]) -> MetricSync:
        return self  # a copied Metric (Metric.clone, an EMA copy of the module) syncs through the same strategy

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _unset, ()  # a pickled Metric comes back with torchmetrics' own sync (no strategy to pickle)

    def __call__(self, result: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        local = gather_all_tensors(result, group)
        live = self._live()
        if live is None or not self._crossing():
            return local
        everyone: list[torch.Tensor] = []
        for state in local:  # one per rank of the group; every group has as many
            gathered = live.gather(state)
            if gathered is None:
                return local
            everyone += gathered
        return everyone


def _unset() -> None:
    return None


def install(module: Any, sync: MetricSync) -> int:
    """Give each torchmetrics Metric in `module` with no `dist_sync_fn` of its own `sync`; how many."""
    if Metric is None or module is None:
        return 0
    count = 0
    for sub in module.modules():
        if isinstance(sub, Metric) and (sub.dist_sync_fn is None or isinstance(sub.dist_sync_fn, MetricSync)):
            sub.dist_sync_fn = sync
            count += 1
    if count:
        logger.info("ft_lightning: %d torchmetrics Metric(s) sync across the live replica groups at a training "
                    "epoch's end", count)
    return count
