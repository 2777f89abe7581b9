"""A Manager's settings and its participation rule: pure functions of arguments, environment and
a quorum result (DESIGN.md section 7). The Manager (ft_core.manager) only acts on what they return."""

from __future__ import annotations

import enum
import os
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ft_core.env import resolve_int, resolve_seconds, resolve_str
from ft_core.errors import ConfigError
from ft_core.control.recovery import QuorumResult

__all__ = ["ManagerConfig", "WorldSizeMode", "env_int", "participation", "resolve_config", "vote_world_size"]


class WorldSizeMode(enum.Enum):
    """How many groups contribute: all up-to-date ones (DYNAMIC), or exactly min_replica_size."""

    DYNAMIC = "dynamic"
    FIXED_WITH_SPARES = "fixed_with_spares"


@dataclass(frozen=True)
class ManagerConfig:
    """A Manager's settings, resolved once: FT_* environment variables override arguments."""

    replica_id: str
    group_rank: int
    group_world_size: int
    min_replica_size: int
    use_async_quorum: bool
    timeout: timedelta
    quorum_timeout: timedelta
    connect_timeout: timedelta
    world_size_mode: WorldSizeMode
    lighthouse_addr: str | None
    port: int
    hostname: str
    heartbeat_interval: timedelta
    init_sync: bool
    max_retries: int | None
    quorum_retries: int
    token: str | None = field(default=None, repr=False)


def env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; unset it or fix it") from None


def resolve_config(*, replica_id: str | None, rank: int | None, world_size: int | None, min_replica_size: int,
                   use_async_quorum: bool, timeout: Any, quorum_timeout: Any, connect_timeout: Any,
                   world_size_mode: WorldSizeMode, lighthouse_addr: str | list[str] | None, port: int | None,
                   hostname: str, heartbeat_interval: timedelta, init_sync: bool, max_retries: int | None,
                   quorum_retries: int | None, token: str | None) -> ManagerConfig:
    """Arguments, then FT_* overrides; group rank/size and replica name fall back to torchrun's env."""
    group_rank = rank if rank is not None else (env_int("RANK") or 0)
    group_world_size = world_size if world_size is not None else (env_int("WORLD_SIZE") or 1)
    if group_world_size < 1 or not 0 <= group_rank < group_world_size:
        raise ConfigError(f"group rank {group_rank} / group world size {group_world_size} are inconsistent; "
                          f"pass rank= and world_size= (ranks inside one replica group) or set RANK/WORLD_SIZE")
    if min_replica_size < 1:
        raise ConfigError(f"min_replica_size must be >= 1, got {min_replica_size}")
    if max_retries is not None and max_retries < 0:
        raise ConfigError(f"max_retries must be None or >= 0, got {max_retries}")
    base = replica_id if replica_id is not None else os.environ.get("REPLICA_GROUP_ID", "")
    addr = ",".join(lighthouse_addr) if isinstance(lighthouse_addr, (list, tuple)) else lighthouse_addr
    return ManagerConfig(
        replica_id=f"{base}:{uuid.uuid4().hex[:12]}" if base else uuid.uuid4().hex[:12],
        group_rank=group_rank, group_world_size=group_world_size, min_replica_size=min_replica_size,
        use_async_quorum=use_async_quorum,
        timeout=resolve_seconds(timeout, "FT_TIMEOUT_SEC", timedelta(seconds=60)),
        quorum_timeout=resolve_seconds(quorum_timeout, "FT_QUORUM_TIMEOUT_SEC", timedelta(seconds=60)),
        connect_timeout=resolve_seconds(connect_timeout, "FT_CONNECT_TIMEOUT_SEC", timedelta(seconds=60)),
        world_size_mode=WorldSizeMode(world_size_mode), lighthouse_addr=resolve_str(addr, "FT_LIGHTHOUSE", None),
        port=resolve_int(port, "FT_MANAGER_PORT", 0), hostname=hostname, heartbeat_interval=heartbeat_interval,
        init_sync=init_sync, max_retries=max_retries, quorum_retries=resolve_int(quorum_retries, "FT_QUORUM_RETRIES", 0),
        token=resolve_str(token, "FT_TOKEN", None) or None)


def participation(result: QuorumResult, *, use_async_quorum: bool, allow_heal: bool, init_sync: bool,
                  mode: WorldSizeMode, min_replica_size: int) -> tuple[int | None, int]:
    """(participating rank or None, number of participants) for this group in `result`.

    Async (or no healing): only groups at max_step that do not heal contribute; at step 0 with
    init_sync every group but the first heals from it, so the first one alone contributes.
    Sync with healing: healers load before the forward pass and contribute like everyone.
    FIXED_WITH_SPARES: exactly min_replica_size contribute; the rest are spares (None).
    """
    if use_async_quorum or not allow_heal:
        if init_sync and allow_heal and result.max_step == 0:
            rank, world = (0 if result.max_replica_rank == 0 else None), 1
        else:
            rank, world = result.max_replica_rank, result.max_world_size
    else:
        rank, world = result.replica_rank, result.replica_world_size
    if mode == WorldSizeMode.FIXED_WITH_SPARES:
        world = min(world, min_replica_size)
        if rank is not None and rank >= min_replica_size:
            rank = None
    return rank, world


def vote_world_size(result: QuorumResult, participants: int, cfg: ManagerConfig, allow_heal: bool) -> int:
    """Groups that end this step in sync, compared with min_replica_size in the commit vote.

    At step 0 with init_sync only the first group contributes, but every group at max_step ends
    the step in sync, so all of them count (else nobody could ever commit the first step).
    """
    if not allow_heal:
        return participants
    synced = result.max_world_size if cfg.init_sync and result.max_step == 0 else participants
    if cfg.world_size_mode == WorldSizeMode.FIXED_WITH_SPARES:
        synced = min(synced, cfg.min_replica_size)
    return max(participants, synced)
