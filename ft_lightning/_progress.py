"""Keep the Trainer's loop progress on committed steps, and carry it to a healing replica group.

Lightning counts attempted optimizer steps: `global_step`, the scheduler progress and step-interval
LR schedulers advance even when the strategy skips `optimizer.step`. These helpers correct that
(through the loops' private progress objects; checked on lightning 2.6), and move a healed
group's progress to its source's: `new = source at step start + (local now - local at step start)`,
which keeps Lightning's own increments made during the step consistent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def _epoch_loop(trainer: Any) -> Any:
    return trainer.fit_loop.epoch_loop


_LEAVES = (int, bool, float, str, type(None))  # the counters' own values, copied as they are
_VALUE, _OWN = "value", "own"  # a plain value; a dataclass with its own state_dict


def _state(progress: Any) -> Any:
    """`progress.state_dict()` (Lightning's: `dataclasses.asdict`), read field by field with each class's
    fields worked out once: the same dict at about a fifth of the cost, which counts as it is taken at
    every step start. A progress class with its own state_dict keeps it."""
    cls = type(progress)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = _kind(cls)
    if kind is _VALUE:
        return progress
    if kind is _OWN:
        return progress.state_dict()
    return {name: value if type(value) in _LEAVES else _state(value)
            for name in kind for value in (getattr(progress, name),)}


def _kind(cls: type) -> Any:
    """_VALUE, _OWN, or the field names of a dataclass whose state_dict is lightning.pytorch's or
    pytorch_lightning's generic _BaseProgress.state_dict (not overridden)."""
    fields = getattr(cls, "__dataclass_fields__", None)
    if fields is None:
        return _VALUE
    if getattr(getattr(cls, "state_dict", None), "__qualname__", "") != "_BaseProgress.state_dict":
        return _OWN
    return tuple(fields)


_KINDS: dict[type, Any] = {}


def snapshot(trainer: Any) -> dict[str, Any]:
    """The fit loop's counters now, as plain ints and bools (cheap; taken at every step start)."""
    fit = trainer.fit_loop
    loop = fit.epoch_loop
    return {
        "epoch": _state(fit.epoch_progress),
        "batch": _state(loop.batch_progress),
        "optim": _state(loop.automatic_optimization.optim_progress),
        "manual_step": _state(loop.manual_optimization.optim_step_progress),
        "scheduler": _state(loop.scheduler_progress),
        "batches_that_stepped": int(loop._batches_that_stepped),
    }


def _shift(source: Any, now: Any, before: Any) -> Any:
    if isinstance(now, bool):
        return now
    if isinstance(now, int):
        return int(source) + (now - int(before))
    if isinstance(now, dict):
        return {k: _shift(source.get(k, v), v, before.get(k, v)) for k, v in now.items()}
    return now


def adopt(trainer: Any, source: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Move this trainer's counters to the source group's: `before` is this group's snapshot at the
    start of the current step, `source` the source's. Returns the counters now in force."""
    new = _shift(source, snapshot(trainer), before)
    fit = trainer.fit_loop
    loop = fit.epoch_loop
    fit.epoch_progress.load_state_dict(new["epoch"])
    loop.batch_progress.load_state_dict(new["batch"])
    loop.automatic_optimization.optim_progress.load_state_dict(new["optim"])
    loop.manual_optimization.optim_step_progress.load_state_dict(new["manual_step"])
    loop.scheduler_progress.load_state_dict(new["scheduler"])
    loop._batches_that_stepped = new["batches_that_stepped"]
    return new


def undo_optimizer_step(trainer: Any) -> None:
    """Called inside `strategy.optimizer_step` when the step was not applied: Lightning marked the step
    `ready` before and will mark it `completed` after; take both back so `global_step` stays put."""
    loop = _epoch_loop(trainer)
    if trainer.lightning_module.automatic_optimization:
        tracker = loop.automatic_optimization.optim_progress.optimizer.step
    else:
        tracker = loop.manual_optimization.optim_step_progress
    for part in (tracker.total, tracker.current):
        part.ready -= 1
        part.completed -= 1


def undo_batches_stepped(trainer: Any) -> None:
    """Once per skipped step: the logger step (`_batches_that_stepped`, bumped after the batch) stays put."""
    _epoch_loop(trainer)._batches_that_stepped -= 1


def undo_scheduler_step(trainer: Any) -> None:
    """Same as `undo_optimizer_step`, for the scheduler progress around a swallowed scheduler step."""
    progress = _epoch_loop(trainer).scheduler_progress
    for part in (progress.total, progress.current):
        part.ready -= 1
        part.completed -= 1


def gate_step_schedulers(trainer: Any, may_step: Callable[[], bool]) -> int:
    """Make every step-interval LR scheduler skip its `step()` when `may_step()` is False.

    The instance's class is swapped for a subclass holding the gate, so `isinstance` checks and the
    scheduler's `state_dict` (its `__dict__`) stay as they were. Returns how many were gated."""
    gated = 0
    for config in trainer.lr_scheduler_configs:
        if config.interval != "step":
            continue
        scheduler = config.scheduler
        cls = type(scheduler)
        if getattr(cls, "_ft_gated", False):
            gated += 1
            continue
        scheduler.__class__ = _gated_class(cls, may_step)
        gated += 1
    return gated


def _gated_class(cls: type, may_step: Callable[[], bool]) -> type:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not may_step():
            return None
        return super(gated, self).step(*args, **kwargs)

    gated = type(cls.__name__, (cls,), {"step": step, "_ft_gated": True, "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return gated
