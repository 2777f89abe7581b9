"""Output directories for the Trainer: per replica group where a group writes alone, one shared
checkpoint folder where the groups take turns being rank zero.

Every replica group runs its own Trainer, so groups sharing `default_root_dir` would otherwise write
the same log versions and checkpoint files. Before anything is written:
- with `per_group_dirs` (the default), each directory a group writes alone gets a `replica_group_<id>`
  component: `default_root_dir` -> `<default_root_dir>/replica_group_<id>`, and built-in file loggers
  (TensorBoard, CSV): save dir -> `<save_dir>/replica_group_<id>` (a logger whose experiment already
  exists is left alone, with a warning). Other loggers (W&B, MLflow, ...) should put the group id in
  their run name;
- with rank_zero="quorum" (the default) one process of the live job writes each checkpoint file, and
  which group that is changes as groups die and heal, so the checkpoints go to ONE folder shared by the
  groups: a ModelCheckpoint without a dirpath saves into `<default_root_dir>/checkpoints` (the
  default_root_dir the user gave, before any `replica_group_<id>`; not under a logger's version
  folder, which is per group), and an explicit dirpath stays as given;
- with rank_zero="group" each group is its own rank zero: an explicit `ModelCheckpoint(dirpath=...)`
  becomes `<dirpath>/replica_group_<id>`, and one without a dirpath follows the group's logger or
  default_root_dir, already per group.

A restarted group (FT_RESTART_COUNT > 0, set by `ftl launch`) continues the run: a file logger without
an explicit version writes on into the group's latest `version_N` instead of a new one, and
`fit(ckpt_path="last")` / `"best"` look in the folders above (the directories are rewritten before
Lightning resolves the path), so with rank_zero="quorum" a restarted group resumes from the newest
`last.ckpt` of the job, whichever group wrote it. That folder must be one the groups share (as for
multi-node DDP): a group on a machine that never wrote it finds nothing there, says so in a warning,
and heals from a live group at its first quorum instead.
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


def shared_checkpoint_dir(root: Any) -> str:
    """The one checkpoint folder of a job with rank_zero="quorum": `<root>/checkpoints`, a local path
    normalized as ModelCheckpoint normalizes its dirpath (a URL is kept as given)."""
    path = os.path.join(os.fspath(root), "checkpoints")
    return path if "://" in path else os.path.realpath(os.path.expanduser(path))


def apply_dirs(trainer: Any, name: str, *, per_group: bool, shared_checkpoints: bool) -> None:
    """Rewrite the trainer's output directories (the module docstring), once per trainer.
    `per_group`: `default_root_dir` and file loggers get the `replica_group_<id>` component `name`;
    `shared_checkpoints` (rank_zero="quorum"): a ModelCheckpoint without a dirpath saves into the shared
    `<default_root_dir>/checkpoints` and an explicit dirpath stays shared; otherwise an explicit dirpath
    gets `name` too (with `per_group`)."""
    if getattr(trainer, _MARK, None) == name:
        return
    root = trainer._default_root_dir
    for callback in trainer.callbacks:
        if not is_model_checkpoint(callback):
            continue
        if shared_checkpoints and not getattr(callback, "dirpath", None):
            callback.dirpath = shared_checkpoint_dir(root)
        elif per_group and not shared_checkpoints and getattr(callback, "dirpath", None):
            callback.dirpath = os.path.join(os.fspath(callback.dirpath), name)
    if per_group:
        trainer._default_root_dir = os.path.join(os.fspath(root), name)
        for lg in trainer.loggers:
            if getattr(lg, "_experiment", None) is not None:
                logger.warning("ft_lightning: logger %s was used before fit; its directory is not per replica group "
                               "and groups may overwrite each other's logs", type(lg).__name__)
                continue
            for attr in ("_root_dir", "_save_dir"):
                value = getattr(lg, attr, None)
                if isinstance(value, (str, os.PathLike)):
                    setattr(lg, attr, os.path.join(os.fspath(value), name))
            _continue_version(lg)
    setattr(trainer, _MARK, name)
    folders = sorted({os.fspath(cb.dirpath) for cb in trainer.callbacks
                      if is_model_checkpoint(cb) and getattr(cb, "dirpath", None)})
    logger.info("ft_lightning: this replica group writes under %s; checkpoints in %s%s", trainer.default_root_dir,
                ", ".join(folders) or "its logger's folder",
                " (shared by the groups: one process writes each file)" if shared_checkpoints else "")


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


def no_last_checkpoint(group: str, folders: list[str], rank_zero_quorum: bool) -> str:
    """The warning of a group whose `fit(ckpt_path="last")` found no checkpoint: where it looked, the likely
    cause, and what happens instead (it is not an error: a live group heals it)."""
    where = ", ".join(folders) or "the ModelCheckpoint folders"
    cause = ("checkpoints are written by the group that is rank zero; with groups on several machines this "
             "folder must be on a filesystem they share, as for multi-node DDP" if rank_zero_quorum else
             "this group saved none there yet")
    return (f"replica group {group}: fit(ckpt_path=\"last\") found no checkpoint in {where} ({cause}); it starts "
            f"without one and heals from a live replica group at its first quorum (with none live, it trains from "
            f"step 0)")


def resolve_special_ckpt_paths_per_group(namespace: str, strategy_cls: type) -> None:
    """Make `fit(ckpt_path="last"|"best")` look in the folders `apply_dirs` sets: Lightning resolves it
    before the strategy sets up, so the directories are applied first (idempotent). A "last" that finds
    nothing is logged once per group (Lightning's own warning is rank zero's only)."""
    module = importlib.import_module(f"{namespace}.trainer.connectors.checkpoint_connector")
    connector = module._CheckpointConnector
    if getattr(connector, "_ft_group_dirs", False):
        return
    original = connector._parse_ckpt_path

    def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        strategy = self.trainer.strategy
        ours = isinstance(strategy, strategy_cls)
        if ckpt_path in ("last", "best") and ours:
            strategy._apply_dirs(self.trainer)
        resolved = original(self, state_fn, ckpt_path, model_provided, model_connected)
        if ckpt_path == "last" and resolved is None and ours:
            folders = [os.fspath(cb.dirpath) for cb in self.trainer.callbacks
                       if is_model_checkpoint(cb) and getattr(cb, "dirpath", None)]
            first = strategy.local_rank == 0 and getattr(strategy, "node_rank", 0) == 0
            logger.log(logging.WARNING if first else logging.INFO, "%s", no_last_checkpoint(
                strategy._ft_settings.group_dir_name(), folders, strategy._quorum_rank_zero))
        return resolved

    connector._parse_ckpt_path = _parse_ckpt_path
    connector._ft_group_dirs = True
