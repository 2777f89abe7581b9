"""A Manager's settings, resolved once from arguments and the FT_* table (ft_core.settings).

The step rules that act on them live in ft_core.step_rules."""

from __future__ import annotations

import enum
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ft_core import net, settings
from ft_core.errors import ConfigError

__all__ = ["ManagerConfig", "WorldSizeMode", "env_int", "resolve_config"]


class WorldSizeMode(enum.Enum):
    """How many groups contribute: all up-to-date ones (DYNAMIC), or exactly min_replica_size."""

    DYNAMIC = "dynamic"
    FIXED_WITH_SPARES = "fixed_with_spares"


@dataclass(frozen=True)
class ManagerConfig:
    """A Manager's settings, resolved once from ft_core.settings: FT_* environment variables override
    arguments, which override the table's defaults. The repr (logged at start) leaves the token out."""

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
    bind_host: str = "127.0.0.1"  # what servers listen on: `hostname`'s address, or a wildcard with FT_BIND_ALL


def env_int(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """An integer torchrun variable (RANK, WORLD_SIZE, MASTER_PORT); None when unset."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; unset it or fix it") from None


def resolve_config(*, replica_id: str | None, rank: int | None, world_size: int | None,
                   min_replica_size: int | None, use_async_quorum: bool | None, timeout: Any, quorum_timeout: Any,
                   connect_timeout: Any, world_size_mode: WorldSizeMode | str | None,
                   lighthouse_addr: str | list[str] | None, port: int | None, hostname: str | None,
                   heartbeat_interval: timedelta, init_sync: bool, max_retries: int | None,
                   quorum_retries: int | None, token: str | None, bind_all: bool | None = None,
                   environ: Mapping[str, str] | None = None) -> ManagerConfig:
    """Arguments, then FT_* overrides (ft_core.settings); group rank/size and the replica name's prefix
    fall back to torchrun's RANK/WORLD_SIZE and the launcher's REPLICA_GROUP_ID. The advertised host is
    FT_HOST / `hostname`, else the local address of the route toward the lighthouse (ft_core.net)."""
    def value(env: str, arg: Any) -> Any:
        return settings.value(env, arg, environ)

    group_rank = rank if rank is not None else (env_int("RANK", environ) or 0)
    group_world_size = world_size if world_size is not None else (env_int("WORLD_SIZE", environ) or 1)
    if group_world_size < 1 or not 0 <= group_rank < group_world_size:
        raise ConfigError(f"group rank {group_rank} / group world size {group_world_size} are inconsistent; "
                          f"pass rank= and world_size= (ranks inside one replica group) or set RANK/WORLD_SIZE")
    min_size = value("FT_MIN_REPLICA_SIZE", min_replica_size)
    if min_size < 1:
        raise ConfigError(f"min_replica_size (FT_MIN_REPLICA_SIZE) must be >= 1, got {min_size}")
    if max_retries is not None and max_retries < 0:
        raise ConfigError(f"max_retries must be None or >= 0, got {max_retries}")
    base = replica_id if replica_id is not None else (settings.lookup("REPLICA_GROUP_ID", environ) or "")
    addr = ",".join(lighthouse_addr) if isinstance(lighthouse_addr, (list, tuple)) else lighthouse_addr
    lighthouse = value("FT_LIGHTHOUSE", addr)
    host = net.advertised_host(value("FT_HOST", hostname), lighthouse)
    return ManagerConfig(
        replica_id=f"{base}:{uuid.uuid4().hex[:12]}" if base else uuid.uuid4().hex[:12],
        group_rank=group_rank, group_world_size=group_world_size, min_replica_size=min_size,
        use_async_quorum=value("FT_ASYNC_QUORUM", use_async_quorum),
        timeout=value("FT_TIMEOUT_SEC", timeout),
        quorum_timeout=value("FT_QUORUM_TIMEOUT_SEC", quorum_timeout),
        connect_timeout=value("FT_CONNECT_TIMEOUT_SEC", connect_timeout),
        world_size_mode=WorldSizeMode(value("FT_WORLD_SIZE_MODE", world_size_mode)),
        lighthouse_addr=lighthouse, port=value("FT_MANAGER_PORT", port), hostname=host,
        bind_host=net.bind_host(host, value("FT_BIND_ALL", bind_all)),
        heartbeat_interval=heartbeat_interval, init_sync=init_sync, max_retries=max_retries,
        quorum_retries=value("FT_QUORUM_RETRIES", quorum_retries), token=value("FT_TOKEN", token) or None)
