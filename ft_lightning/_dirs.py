"""Per-replica-group output directories for the Trainer.

Every replica group has its own rank-zero process, so groups sharing `default_root_dir` would
write the same log versions and checkpoint files. Before anything is written, each directory the
Trainer writes to gets a `replica_group_<id>` component:
- `default_root_dir` -> `<default_root_dir>/replica_group_<id>`
- built-in file loggers (TensorBoard, CSV): save dir -> `<save_dir>/replica_group_<id>`
  (a logger whose experiment already exists is left alone, with a warning)
- `ModelCheckpoint(dirpath=...)` -> `<dirpath>/replica_group_<id>` (with `rank_zero="quorum"` the
  dirpath stays shared: one process writes each file); without a dirpath it follows the logger or
  `default_root_dir`, already per group.
Other loggers (W&B, MLflow, ...) should put the group id in their run name.

A restarted group (FT_RESTART_COUNT > 0, set by `ftl launch`) continues the run: a file logger
without an explicit version writes on into the group's latest `version_N` instead of a new one, and
`fit(ckpt_path="last")` / `"best"` look inside the group's directory (the directories are rewritten
before Lightning resolves the path).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from ft_core import settings as ft_settings

logger = logging.getLogger(__name__)

_MARK = "_ft_lightning_group_dir"


def is_model_checkpoint(callback: Any) -> bool:
    """ModelCheckpoint of either Lightning namespace (duck-typed by class name)."""
    return any(c.__name__ == "ModelCheckpoint" for c in type(callback).__mro__)


def apply_group_dirs(trainer: Any, name: str, shared_checkpoints: bool = False) -> None:
    """Rewrite the trainer's output directories to per-group ones (idempotent per trainer).
    `shared_checkpoints` (rank_zero="quorum": one writer per event): an explicit ModelCheckpoint
    dirpath stays shared by the groups."""
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
        _continue_version(lg)
    for callback in trainer.callbacks:
        if is_model_checkpoint(callback) and getattr(callback, "dirpath", None) and not shared_checkpoints:
            callback.dirpath = os.path.join(os.fspath(callback.dirpath), name)
    setattr(trainer, _MARK, name)
    logger.info("ft_lightning: this replica group writes under %s", trainer.default_root_dir)


def _continue_version(lg: Any) -> None:
    """A restarted group's file logger writes on into its latest version (not version_N+1)."""
    if ft_settings.value("FT_RESTART_COUNT") <= 0 or getattr(lg, "_version", 0) is not None:
        return
    next_version = getattr(lg, "_get_next_version", None)
    if not callable(next_version):
        return
    try:
        version = int(next_version())
    except (OSError, ValueError, TypeError):
        return
    if version > 0:
        lg._version = version - 1
        logger.info("ft_lightning: restarted group: %s continues in version_%d", type(lg).__name__, version - 1)


def resolve_special_ckpt_paths_per_group(namespace: str, strategy_cls: type) -> None:
    """Make `fit(ckpt_path="last"|"best")` look in the replica group's directory: Lightning resolves it
    before the strategy sets up, so the group directories are applied first (idempotent)."""
    module = importlib.import_module(f"{namespace}.trainer.connectors.checkpoint_connector")
    connector = module._CheckpointConnector
    if getattr(connector, "_ft_group_dirs", False):
        return
    original = connector._parse_ckpt_path

    def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        strategy = self.trainer.strategy
        if ckpt_path in ("last", "best") and isinstance(strategy, strategy_cls) and strategy._per_group_dirs:
            apply_group_dirs(self.trainer, strategy._ft_settings.group_dir_name(),
                             shared_checkpoints=strategy._quorum_rank_zero)
        return original(self, state_fn, ckpt_path, model_provided, model_connected)

    connector._parse_ckpt_path = _parse_ckpt_path
    connector._ft_group_dirs = True
