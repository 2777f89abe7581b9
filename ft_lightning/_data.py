"""Training data across replica groups: the sampler's shard, moving a healed group's loader to the
batch its source is at, and the exactly-once loader (ft_core.data, docs/data.md) when enabled.

Sharding: the training sampler spans every process of every replica group (shard
`replica_group_id * group_world_size + group_rank` of `num_replica_groups * group_world_size`,
as `ft_core.data.global_shard`); validation and test stay sharded inside the group only.

Positioning: after healing, the group's fit loop counters say "epoch E, next batch k". The
training loader is re-iterated for epoch E starting at batch k. For a DataLoader with a plain
`BatchSampler`, the skip happens in the sampler (indices only, no data loaded); otherwise the k
batches are drawn and dropped. Iterable datasets cannot be positioned (logged once).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
)

from ft_core.data import global_shard

logger = logging.getLogger(__name__)


def training_shard(num_replica_groups: int, replica_group_id: int, group_world_size: int,
                   group_rank: int) -> dict[str, int]:
    """`DistributedSampler` kwargs for the training loader of one process."""
    rank, world = global_shard(replica_group_id, num_replica_groups, group_rank, group_world_size)
    return {"num_replicas": world, "rank": rank}


def _skipping_class(cls: type) -> type:
    """`cls` whose next `__iter__` skips `_ft_skip` indices, once. A single-base subclass, so the
    instance layout is unchanged and `__class__` can be swapped in place."""
    skip_cls = _skip_classes.get(cls)
    if skip_cls is not None:
        return skip_cls

    def __iter__(self: Any) -> Iterator[Any]:
        skip, self._ft_skip = self._ft_skip, 0
        indices = super(skip_cls, self).__iter__()
        return itertools.islice(indices, skip, None) if skip else indices

    skip_cls = type(cls.__name__, (cls,), {"__iter__": __iter__, "_ft_skip": 0, "_ft_skippable": True,
                                            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    _skip_classes[cls] = skip_cls
    return skip_cls


_skip_classes: dict[type, type] = {}


def _arm_skip(dataloader: Any, batches: int) -> bool:
    """Make the loader's next iteration start `batches` batches in, in the sampler. False if unsupported."""
    if not isinstance(dataloader, DataLoader) or dataloader.batch_size is None:
        return False
    batch_sampler = dataloader.batch_sampler
    if type(batch_sampler) is not BatchSampler or not isinstance(batch_sampler.sampler, Sampler):
        return False
    sampler = batch_sampler.sampler
    if not getattr(type(sampler), "_ft_skippable", False):
        try:
            sampler.__class__ = _skipping_class(type(sampler))
        except TypeError:  # a layout Python will not swap (e.g. __slots__); fall back to drawing batches
            return False
    sampler._ft_skip = batches * dataloader.batch_size
    return True


def _set_epoch(dataloader: Any, epoch: int) -> None:
    for attr in ("sampler", "batch_sampler"):
        sampler = getattr(dataloader, attr, None)
        if sampler is not None and callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


_warned_unsized = False


def reposition(trainer: Any, epoch: int, next_batch: int) -> None:
    """Make the fit loop's next training batch be batch `next_batch` of epoch `epoch`."""
    global _warned_unsized
    fit = trainer.fit_loop
    fetcher = fit._data_fetcher
    combined = fit._combined_loader
    if fetcher is None or combined is None:
        return
    if fetcher.length is None or type(fetcher).__name__ == "_DataLoaderIterDataFetcher":
        if not _warned_unsized:
            _warned_unsized = True
            logger.warning("ft_lightning: the training loader has no length (iterable dataset) or the training step "
                           "takes the iterator; a healed replica group reads on from where its loader is, not from "
                           "its source's batch. Use max_steps to end training.")
        return
    loaders = list(combined.flattened)
    for dl in loaders:
        _set_epoch(dl, epoch)
    if next_batch >= fetcher.length:  # the current batch is the epoch's last; the next epoch starts afresh
        fetcher.done = True
        fit.epoch_loop.batch_progress.is_last_batch = True
        return
    in_sampler = all(_arm_skip(dl, next_batch) for dl in loaders)
    if not in_sampler:  # undo any partial arming, then skip by drawing batches
        for dl in loaders:
            sampler = getattr(getattr(dl, "batch_sampler", None), "sampler", None)
            if getattr(type(sampler), "_ft_skippable", False):
                sampler._ft_skip = 0
    iter(fetcher)  # a fresh iterator over the combined loader (sets fetched=0)
    if not in_sampler:
        for _ in range(next_batch):
            next(fetcher.iterator)
    fetcher.fetched = next_batch
    fetcher.done = next_batch >= fetcher.length
    fit.epoch_loop.batch_progress.is_last_batch = fetcher.done
    logger.info("ft_lightning: training data moved to epoch %d, batch %d (%s)", epoch, next_batch,
                "skipped in the sampler" if in_sampler else "batches drawn and dropped")


# ---- exactly-once training data (ft_core.data, docs/data.md) -------------------------------------

_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def exactly_once_loader(dataloader: Any, sampler: Any) -> Any:
    """The training DataLoader rebuilt around the exactly-once batch sampler `sampler` (same dataset,
    workers and collate function); `dataloader` unchanged when it cannot be (warned once)."""
    dl = dataloader
    kwargs: dict[str, Any] = {
        "batch_sampler": sampler, "num_workers": dl.num_workers, "collate_fn": dl.collate_fn,
        "pin_memory": dl.pin_memory, "timeout": dl.timeout, "worker_init_fn": dl.worker_init_fn,
        "multiprocessing_context": dl.multiprocessing_context, "generator": dl.generator,
        "persistent_workers": dl.persistent_workers, "pin_memory_device": dl.pin_memory_device,
    }
    if dl.num_workers > 0:
        kwargs["prefetch_factor"] = dl.prefetch_factor
    if dl.drop_last:
        _warn_once("drop_last", "ft_lightning: exactly-once data trains every sample once per epoch; the training "
                                "loader's drop_last=True is ignored")
    return DataLoader(dl.dataset, **kwargs)


def exactly_once_unsupported(dataloader: Any) -> str | None:
    """Why this training loader cannot be given the exactly-once sampler, or None."""
    if not isinstance(dataloader, DataLoader):
        return f"the training data is a {type(dataloader).__name__}, not a torch DataLoader"
    if isinstance(dataloader.dataset, IterableDataset):
        return ("the training dataset is an IterableDataset: it has no indices to assign, so each group reads its "
                "own stream (lossy under faults, as without exactly-once); use a map-style dataset")
    if dataloader.batch_size is None:
        return ("the training loader has its own batch_sampler, which chooses the samples itself; pass batch_size= "
                "and sampler= (or shuffle=) instead")
    return None


def sampler_settings(dataloader: Any) -> tuple[bool, int]:
    """(shuffle, seed) of the loader's sampler, as Lightning's injected DistributedSampler has them."""
    sampler = dataloader.sampler
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle), int(sampler.seed)
    return isinstance(sampler, RandomSampler), int(os.environ.get("PL_GLOBAL_SEED", "0"))


def scale_loss(output: Any, weight: float) -> Any:
    """A training_step output with its loss multiplied by `weight` (a batch that must not count: 0)."""
    if weight == 1.0 or output is None:
        return output
    if isinstance(output, torch.Tensor):
        return output * weight
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return {**output, "loss": output["loss"] * weight}
    return output
