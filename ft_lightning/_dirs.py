"""Per-replica-group output directories for the Trainer.

Every replica group has its own rank-zero process, so groups sharing `default_root_dir` would
write the same log versions and checkpoint files. Before anything is written, each directory the
Trainer writes to gets a `replica_group_<id>` component:
- `default_root_dir` -> `<default_root_dir>/replica_group_<id>`
- built-in file loggers (TensorBoard, CSV): save dir -> `<save_dir>/replica_group_<id>`
  (a logger whose experiment already exists is left alone, with a warning)
- `ModelCheckpoint(dirpath=...)` -> `<dirpath>/replica_group_<id>`; without a dirpath it follows
  the logger or `default_root_dir`, already per group.
Other loggers (W&B, MLflow, ...) should put the group id in their run name.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

_MARK = "_ft_lightning_group_dir"


def is_model_checkpoint(callback: Any) -> bool:
    """ModelCheckpoint of either Lightning namespace (duck-typed by class name)."""
    return any(c.__name__ == "ModelCheckpoint" for c in type(callback).__mro__)


def apply_group_dirs(trainer: Any, name: str) -> None:
    """Rewrite the trainer's output directories to per-group ones (idempotent per trainer)."""
    if getattr(trainer, _MARK, None) == name:
        return
    trainer._default_root_dir = os.path.join(os.fspath(trainer._default_root_dir), name)
    for lg in trainer.loggers:
        if getattr(lg, "_experiment", None) is not None:
            logger.warning("ft_lightning: logger %s was used before fit; its directory is not per replica group and "
                           "groups may overwrite each other's logs", type(lg).__name__)
            continue
        for attr in ("_root_dir", "_save_dir"):
            value = getattr(lg, attr, None)
            if isinstance(value, (str, os.PathLike)):
                setattr(lg, attr, os.path.join(os.fspath(value), name))
    for callback in trainer.callbacks:
        if is_model_checkpoint(callback) and getattr(callback, "dirpath", None):
            callback.dirpath = os.path.join(os.fspath(callback.dirpath), name)
    setattr(trainer, _MARK, name)
    logger.info("ft_lightning: this replica group writes under %s", trainer.default_root_dir)
