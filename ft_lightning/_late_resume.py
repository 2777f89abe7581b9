"""A Lightning replica group that starts after the job finished resumes from the job's last checkpoint.

The engine refuses a group that joins behind the job's final step N with nobody live to heal from
(JobFinishedError, ft_core/control/job_end.py). The Trainer strategy waits for the first quorum of a
fit; when it is refused, the group looks for a Lightning checkpoint of the job saved at step N or
later (the rule of ft_lightning/_final_checkpoint.py, shared with the Accelerate plugin), restores
it as `fit(ckpt_path=...)` would (weights, optimizers, LR schedulers, precision, loops, callbacks,
the Manager's step) and ends fit there. Without one it stops with the JobFinishedError, saying how a
late group could resume.

Where the job's checkpoints are (docs/lightning.md, "Directories"): every ModelCheckpoint's dirpath
and `<default_root_dir>/checkpoints`, and, where those paths hold this group's `replica_group_<id>`
component, the same paths of every other group (`replica_group_*`, any logger `version_*` after
it): with the default rank_zero="quorum" the group that was rank zero wrote the file into the one
folder the groups share (a ModelCheckpoint without a dirpath: `<default_root_dir>/checkpoints`, set
by ft_lightning/_dirs.py before this search), and with rank_zero="group" each group saved into its
own folder.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import warnings
from typing import Any

import torch

from ft_core.errors import JobFinishedError
from ft_lightning import _dirs, _progress
from ft_lightning._final_checkpoint import (
    SavedCheckpoint,
    newest_at_or_past,
    read_saved,
)

logger = logging.getLogger(__name__)

_VERSION = re.compile(r"version_\d+")


def checkpoint_dirs(trainer: Any) -> list[str]:
    """The folders this trainer's checkpoints go to: every ModelCheckpoint's dirpath (resolved once fit
    has set up) and `<default_root_dir>/checkpoints`, in that order, without repeats."""
    dirs = [os.fspath(cb.dirpath) for cb in trainer.callbacks
            if _dirs.is_model_checkpoint(cb) and getattr(cb, "dirpath", None)]
    dirs.append(os.path.join(os.fspath(trainer.default_root_dir), "checkpoints"))
    return list(dict.fromkeys(os.path.abspath(d) for d in dirs))


def search_patterns(folder: str, group_dir: str) -> list[str]:
    """Glob patterns for the `.ckpt` files of `folder` and of the same folder of every other replica group:
    the last `group_dir` component becomes `replica_group_*`, and a logger's `version_N` after it
    `version_*` (another group's logger may be at another version)."""
    parts = os.path.abspath(folder).split(os.sep)
    patterns = [os.path.join(glob.escape(folder), "*.ckpt")]
    if group_dir in parts:
        at = len(parts) - 1 - parts[::-1].index(group_dir)
        wild = [glob.escape(p) for p in parts]
        wild[at] = "replica_group_*"
        wild[at + 1:] = ["version_*" if _VERSION.fullmatch(p) else glob.escape(p) for p in parts[at + 1:]]
        patterns.append(os.path.join(os.sep.join(wild) or os.sep, "*.ckpt"))
    return patterns


def saved_step(path: str) -> int:
    """The Manager's step saved in a Lightning checkpoint by the strategy (`checkpoint["ft_manager"]`).
    Read with Lightning's default `weights_only=True`, memory-mapped: the tensors are not read."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for a damaged or foreign file
        raise ValueError(f"not a readable Lightning checkpoint ({type(exc).__name__}: {exc})") from exc
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("ft_manager"), dict):
        raise KeyError("no fault-tolerance step in it (saved without the fault_tolerant_ddp strategy)")
    return int(checkpoint["ft_manager"]["step"])


def final_checkpoint(dirs: list[str], group_dir: str, step: int) -> SavedCheckpoint | None:
    """The checkpoint a late group resumes from: among the `.ckpt` files of `dirs` and of the other groups'
    same folders, the one with the highest saved step at `step` or later (`last.ckpt` or another)."""
    paths = sorted({path for folder in dirs for pattern in search_patterns(folder, group_dir)
                    for path in glob.glob(pattern)})
    return newest_at_or_past(read_saved(paths, saved_step), step)


def refusal(exc: JobFinishedError, dirs: list[str]) -> JobFinishedError:
    """The JobFinishedError a late group stops with when no checkpoint of the job's end was found."""
    final = exc.finished_step if exc.finished_step is not None else 0
    return JobFinishedError(
        f"{exc}. No Lightning checkpoint saved at step {final} or later was found in {', '.join(dirs)} (nor in the "
        f"other replica groups' same folders), so this group stops instead of retraining alone; to let a late "
        f"group resume, keep a ModelCheckpoint (save_last=True) whose folder it can read (docs/lightning.md, "
        f"\"A group that starts after the job finished\")",
        code=exc.code, finished_step=exc.finished_step, step=exc.step, finished_groups=exc.finished_groups)


def resume_finished_job(strategy: Any, trainer: Any, exc: JobFinishedError, group_dir: str) -> SavedCheckpoint:
    """Restore the job's final checkpoint into `trainer` (as fit(ckpt_path=...) restores one) and return it;
    raises `refusal(exc)` when there is none. Group rank 0 chooses the file, every rank of the group loads it."""
    dirs = checkpoint_dirs(trainer)
    final = exc.finished_step if exc.finished_step is not None else 0
    found = final_checkpoint(dirs, group_dir, final) if strategy.global_rank == 0 else None
    chosen = strategy.broadcast(None if found is None else (found.path, found.step, found.mtime))
    if chosen is None:
        raise refusal(exc, dirs) from exc
    found = SavedCheckpoint(*chosen)
    groups = f"group{'s' if len(exc.finished_groups) > 1 else ''} {', '.join(exc.finished_groups) or '?'}"
    logger.log(logging.WARNING if strategy.global_rank == 0 else logging.INFO,  # one line per group
               "replica group %s: the job finished at step %d (%s) while this group was at step %s, with no "
               "live group to heal from; loading its checkpoint %s (step %d) instead of retraining alone, "
               "then ending fit", group_dir, final, groups, exc.step, found.path, found.step)
    with warnings.catch_warnings():  # another group's file, on purpose: Lightning's notice would read as a fault
        warnings.filterwarnings("ignore", message="The dirpath has changed from")
        trainer._checkpoint_connector.restore(found.path)
    for callback in trainer.callbacks:
        if _dirs.is_model_checkpoint(callback):  # the job saved this step already: no copy of it here
            callback._last_global_step_saved = trainer.global_step
            callback._last_checkpoint_saved = found.path
    return found


def settle_loops(trainer: Any, restored: dict[str, Any]) -> None:
    """At the end of the fit: the loop counters back to the checkpoint's (`restored`, taken right after
    loading it; the epoch's end since then counted one more epoch), with `current_epoch` as Lightning
    leaves it when `fit(ckpt_path=...)` resumes a fit that had reached max_epochs."""
    _progress.adopt(trainer, restored, _progress.snapshot(trainer))
    fit = trainer.fit_loop
    if fit.max_epochs is not None and 0 <= fit.max_epochs <= fit.epoch_progress.current.processed:
        fit.epoch_progress.current.completed = fit.epoch_progress.current.processed
