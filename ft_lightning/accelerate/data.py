"""Exactly-once training data for Accelerate (ft_core.data, docs/data.md), and the fault-tolerance part
of `accelerator.save_state` / `load_state`.

With `FaultTolerancePlugin(exactly_once=True)` (or `global_batch_size=`), a prepared training loader
takes its batches from the exactly-once sampler instead of Accelerate's sharding: the job's committed
data position decides every step's samples, it is healed with the model, and it is written by
`save_state`. Nothing is skipped with `skip_first_batches`: a healed or resumed group's position is
the sampler's. The plain `for epoch in range(N): for batch in loader:` loop stays on the job's
epochs: a pass ends when its epoch is consumed (or a heal moved the job past it), the passes of
epochs the job already finished are empty, and schedulers do not step in between (the restored
schedule already holds those epochs' steps).

A pass while every prepared model is in eval mode is an evaluation pass: it reads the group's static
shard (Accelerate's prepared loader), as without exactly-once.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from ft_core.errors import ConfigError
from ft_lightning._final_checkpoint import newest_at_or_past, read_saved
from ft_lightning.accelerate.state import DelegatingLoader

logger = logging.getLogger(__name__)

STATE_FILE = "fault_tolerance_{rank}.json"  # one per process of the group, next to Accelerate's files
STATE_VERSION = 1


class ExactlyOnceLoader(DelegatingLoader):
    """A prepared training DataLoader over the exactly-once sampler `ft_sampler` (see the module docstring).

    `exact` is Accelerate's loader around `DataLoader(batch_sampler=ft_sampler)`, `static` the group's
    static shard for evaluation passes; every other attribute is `exact`'s.
    """

    def __init__(self, exact: Any, static: Any, sampler: Any, training: Callable[[], bool],
                 groups: int) -> None:
        self._ft_inner = exact
        self._ft_static = static
        self.ft_sampler = sampler
        self._ft_training = training
        self._ft_groups = groups
        self.passes = 0  # passes (epochs) ended
        self.active = False  # a training pass is being iterated
        self._pending = 0  # batches of this pass yielded and not yet weighed by a backward
        self._floor = 0  # passes the restored schedule had ended (healed or resumed into)

    def __len__(self) -> int:
        """Steps of an epoch when every replica group takes part (fewer groups take more steps)."""
        sampler = self.ft_sampler
        per_step = sampler.shape.total(self._ft_groups)
        return (len(sampler.dataset) + per_step - 1) // per_step

    # ---- the accelerator's hooks (as EpochAlignedLoader's) ----

    @property
    def aligning(self) -> bool:
        """Between a pass that ended before the epoch the state holds and that epoch's own pass: a
        scheduler step there was already taken by the restored schedule."""
        return not self.active and 0 < self.passes <= self._floor

    def on_step_start(self) -> None:
        """Nothing to record: the position is the sampler's (healed under its own key)."""

    def state_dict(self) -> dict[str, int]:
        """What a healing group needs besides the sampler's position (healed under its own key): how many
        passes the source's loop had ended, i.e. the epoch-end code (scheduler steps) its state holds."""
        return {"passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._floor = int(state["passes"])

    def checkpoint_state(self) -> dict[str, Any]:
        return {"kind": "exactly_once", "sampler": self.ft_sampler.state_dict(), "passes": self.passes}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "exactly_once":
            raise ConfigError(f"the checkpoint holds a {state.get('kind')} loader position where this script "
                              f"prepared an exactly-once loader; use the same exactly_once setting as when saving")
        self.ft_sampler.load_state_dict(state["sampler"])
        self._floor = int(state["passes"])

    def weigh(self) -> float:
        """The loss weight of the batch this step trains on (1.0: its assignment; 0.0: not), told to the
        other groups; once per yielded batch, in the accelerator's backward."""
        if self._pending != 1:
            if self._pending == 0:
                raise ConfigError("exactly-once data assigns one batch per optimizer step, but this backward has "
                                  "no batch of its own (a second backward for the same batch); call "
                                  "accelerator.backward once per batch, or use exactly_once=False")
            raise ConfigError(f"exactly-once data: {self._pending} batches were taken from the loader since the last "
                              f"backward; every batch must be trained (one accelerator.backward per batch), or "
                              f"its samples would be counted as trained; use exactly_once=False to skip batches")
        self._pending = 0
        return float(self.ft_sampler.loss_weight())

    # ---- iteration ----

    def __iter__(self) -> Iterator[Any]:
        if not self._ft_training():
            yield from self._ft_static  # an evaluation pass: the group's static shard
            return
        sampler = self.ft_sampler
        epoch = sampler.epoch
        if self.passes < epoch:  # an epoch the job had already finished when it was healed or resumed here
            self.passes += 1
            return
        self.active = True
        self._pending = 0
        try:
            while True:
                drew = False
                self._ft_inner.iteration = epoch  # Accelerate's set_epoch(iteration) then keeps the epoch
                it = iter(self._ft_inner)
                try:
                    for batch in it:
                        drew = True
                        self._pending += 1
                        yield batch
                        if sampler.epoch > epoch:  # consumed (or healed past): the pass ends here
                            break
                finally:
                    _close(it, self._ft_inner)
                if sampler.epoch > epoch or not drew:
                    break
                # Batches predicted for this epoch missed (a changed quorum): its samples left come next.
        finally:
            self.active = False
            self._pending = 0
            self.passes += 1


def _close(it: Any, inner: Any) -> None:
    """End a pass over Accelerate's loader, cut short or not (it leaves the gradient state as at an end)."""
    close = getattr(it, "close", None)
    if callable(close):
        close()
    end = getattr(inner, "end", None)
    if callable(end):
        end()


# ---- save_state / load_state --------------------------------------------------------------------

def state_path(directory: str, rank: int) -> str:
    return os.path.join(directory, STATE_FILE.format(rank=rank))


def write_state(directory: str, rank: int, state: dict[str, Any]) -> str:
    """Write this process's fault-tolerance state into an `accelerator.save_state` directory (atomically)."""
    path = state_path(directory, rank)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": STATE_VERSION, **state}, f)
    os.replace(tmp, path)
    return path


def read_state(directory: str, rank: int) -> dict[str, Any] | None:
    """The state `write_state` wrote for `rank` (else rank 0's: the position is the same on every rank);
    None when the directory holds none (a checkpoint written without fault tolerance)."""
    for candidate in (state_path(directory, rank), state_path(directory, 0)):
        if os.path.isfile(candidate):
            try:
                with open(candidate, encoding="utf-8") as f:
                    state = json.load(f)
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"cannot read the fault-tolerance state {candidate}: {exc}; the checkpoint is "
                                  f"damaged, load an earlier one") from exc
            if int(state.get("version", 0)) != STATE_VERSION:
                raise ConfigError(f"{candidate} has fault-tolerance state version {state.get('version')}, this "
                                  f"ft-lightning reads version {STATE_VERSION}")
            return state
    return None


def _saved_step(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return int(json.load(f)["manager"]["step"])


def final_checkpoint(root: str, step: int) -> tuple[str, int] | None:
    """(folder, step) of the `save_state` folder in `root` (or up to two levels below it) that a late group
    resumes from: the highest fault-tolerance step at `step` or later (ft_lightning._final_checkpoint's
    rule, shared with the Lightning strategy); None when there is none."""
    paths = [path for pattern in ("", "*", os.path.join("*", "*"))
             for path in sorted(glob.glob(os.path.join(glob.escape(root), pattern, STATE_FILE.format(rank=0))))]
    found = newest_at_or_past(read_saved(paths, _saved_step), step)
    return None if found is None else (os.path.dirname(found.path), found.step)
