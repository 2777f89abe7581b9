"""Which saved checkpoint a late replica group resumes from: one rule for the Accelerate plugin and the
Lightning strategy.

A group that comes back after the job finished at step N (the engine's JobFinishedError) must not
retrain the job alone; it loads the job's checkpoint at step N or later instead. Among the checkpoints
found, that is the one with the highest saved fault-tolerance step (the newest file among equal
steps). Each integration says where its checkpoints are and how to read the step from one; no
framework imports here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# What reading one checkpoint's step may raise: the file is skipped with a warning, not fatal.
UNREADABLE = (OSError, ValueError, KeyError, TypeError)


@dataclass(frozen=True)
class SavedCheckpoint:
    """One checkpoint file and the fault-tolerance step saved in it."""

    path: str
    step: int
    mtime: float


def newest_at_or_past(found: Iterable[SavedCheckpoint], step: int) -> SavedCheckpoint | None:
    """The checkpoint with the highest saved step at `step` or later (the newest file among equal steps,
    then the greatest path, so the choice is the same on every process); None when there is none."""
    eligible = [c for c in found if c.step >= step]
    if not eligible:
        return None
    return max(eligible, key=lambda c: (c.step, c.mtime, c.path))


def read_saved(paths: Iterable[str], read_step: Callable[[str], int]) -> list[SavedCheckpoint]:
    """Each path's saved step (`read_step`), once per file; a file that cannot be read is skipped with a warning."""
    saved: list[SavedCheckpoint] = []
    seen: set[str] = set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        try:
            saved.append(SavedCheckpoint(path, int(read_step(path)), os.path.getmtime(path)))
        except UNREADABLE as exc:
            logger.warning("skipping checkpoint %s: %s", path, exc)
    return saved
