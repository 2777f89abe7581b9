"""Settings of one manager server, resolved once from arguments and FT_* variables (ft_core.settings)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

from ft_core import settings
from ft_core.control import rpc
from ft_core.errors import ConfigError

__all__ = ["ManagerServerConfig", "resolve_config"]


@dataclass(frozen=True)
class ManagerServerConfig:
    """Resolved settings of one manager server (ft_core.settings: environment overrides arguments)."""

    replica_id: str
    lighthouse_addrs: tuple[str, ...]
    hostname: str
    bind: str
    store_addr: str
    world_size: int
    heartbeat_interval: timedelta
    connect_timeout: timedelta
    quorum_retries: int
    token: str | None = field(default=None, repr=False)
    allow_kill: bool | None = None
    restarted: bool = False  # a restarted incarnation of its group (quorum rule 12)

    @property
    def kill_allowed(self) -> bool:
        return self.allow_kill if self.allow_kill is not None else bool(self.token)


def resolve_config(replica_id: str, lighthouse_addr: str | list[str] | None, hostname: str, bind: str,
                   store_addr: str, world_size: int, heartbeat_interval: timedelta,
                   connect_timeout: timedelta | float | None, quorum_retries: int | None, token: str | None,
                   allow_kill: bool | None) -> ManagerServerConfig:
    """Validate arguments and apply FT_* overrides; raises ConfigError naming the bad setting."""
    if not replica_id:
        raise ConfigError("ManagerServer needs a non-empty replica_id (the replica group's name)")
    addr_arg = ",".join(lighthouse_addr) if isinstance(lighthouse_addr, (list, tuple)) else lighthouse_addr
    addrs = rpc.split_addresses(settings.value("FT_LIGHTHOUSE", addr_arg) or "")
    if not addrs:
        raise ConfigError("ManagerServer needs a lighthouse address: pass lighthouse_addr='host:port[,host:port]' "
                          "or set FT_LIGHTHOUSE")
    if world_size < 1:
        raise ConfigError(f"ManagerServer world_size must be >= 1 (ranks in the replica group), got {world_size}")
    retries = settings.value("FT_QUORUM_RETRIES", quorum_retries)
    if retries < 0:
        raise ConfigError(f"quorum_retries must be >= 0, got {retries}")
    if rpc.seconds(heartbeat_interval) <= 0:
        raise ConfigError(f"heartbeat_interval must be positive, got {heartbeat_interval}")
    return ManagerServerConfig(
        replica_id=replica_id, lighthouse_addrs=tuple(addrs), hostname=hostname, bind=bind, store_addr=store_addr,
        world_size=world_size, heartbeat_interval=heartbeat_interval,
        connect_timeout=settings.value("FT_CONNECT_TIMEOUT_SEC", connect_timeout), quorum_retries=retries,
        token=settings.value("FT_TOKEN", token) or None, allow_kill=settings.value("FT_ALLOW_KILL", allow_kill),
        restarted=restarted_incarnation())


def restarted_incarnation() -> bool:
    """Whether this process is a restarted incarnation of its replica group, so it joins a job that ran before:
    `ftl launch` (FT_RESTART_COUNT) or torchrun (TORCHELASTIC_RESTART_COUNT) restarted it (quorum rule 12)."""
    elastic = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return settings.value("FT_RESTART_COUNT") > 0 or (elastic.isdigit() and int(elastic) > 0)
