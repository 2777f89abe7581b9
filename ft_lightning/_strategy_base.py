"""What the Trainer and Fabric fault-tolerant strategies share as an object: argument handling,
the Manager's lifetime, and registration under one name. No Lightning imports here."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from ft_lightning._common import FTSettings
from ft_lightning._registration import STRATEGY_NAME

logger = logging.getLogger("ft_lightning")


class FTStrategyBase:
    """Mixed in before a Lightning or Fabric `DDPStrategy`.

    Arguments (each falls back to its environment variable; a set variable wins):
        lighthouse_addr: FT_LIGHTHOUSE, "host:port" (a comma-separated list fails over).
        replica_group_id / num_replica_groups: REPLICA_GROUP_ID / NUM_REPLICA_GROUPS; they shard the
            training data (default 0 of 1).
        replica_id: the group's name at the lighthouse (default "replica_group_<id>").
        min_replica_size: FT_MIN_REPLICA_SIZE, fewest groups for a step to commit (default 1).
        timeout, quorum_timeout, connect_timeout: FT_TIMEOUT_SEC, FT_QUORUM_TIMEOUT_SEC,
            FT_CONNECT_TIMEOUT_SEC (seconds or timedelta; default 60 s each).
        world_size_mode: FT_WORLD_SIZE_MODE, "dynamic" or "fixed_with_spares".
        token: FT_TOKEN, shared secret for every control-plane call and checkpoint fetch.
        cross_group_backend: FT_BACKEND, "gloo", "nccl" or "auto" (nccl on CUDA, else gloo).
        use_async_quorum: FT_ASYNC_QUORUM, overlap the quorum with the forward pass (default True).
        manager_port: port of this group's manager server (FT_MANAGER_PORT; default OS-chosen).
        host: FT_HOST, the address or name this group advertises to other groups (default: this machine's
            address on the route toward the lighthouse, so groups on other machines need no setting).
        manager_kwargs: any other `ft_core.Manager` argument.
        process_group_timeout: timeout of Lightning's own (intra-group) process group.
        **kwargs: passed to the `DDPStrategy` (accelerator, cluster_environment, ...).
    """

    # Said when `manager` is read before the strategy created it (differs for Trainer and Fabric).
    MANAGER_MISSING = "the fault-tolerant Manager is created when the strategy sets up"

    def __init__(self, lighthouse_addr: str | None = None, *, replica_group_id: int | None = None,
                 num_replica_groups: int | None = None, replica_id: str | None = None,
                 min_replica_size: int | None = None, timeout: timedelta | float | None = None,
                 quorum_timeout: timedelta | float | None = None, connect_timeout: timedelta | float | None = None,
                 world_size_mode: str | None = None, token: str | None = None,
                 cross_group_backend: str | None = None, use_async_quorum: bool | None = None,
                 manager_port: int | None = None, host: str | None = None,
                 manager_kwargs: dict[str, Any] | None = None,
                 process_group_timeout: timedelta | None = None, **kwargs: Any) -> None:
        if process_group_timeout is not None:
            kwargs["timeout"] = process_group_timeout
        super().__init__(**kwargs)  # type: ignore[call-arg]
        self._ft_settings = FTSettings.resolve(
            lighthouse_addr=lighthouse_addr, replica_id=replica_id, replica_group_id=replica_group_id,
            num_replica_groups=num_replica_groups, min_replica_size=min_replica_size, timeout=timeout,
            quorum_timeout=quorum_timeout, connect_timeout=connect_timeout, world_size_mode=world_size_mode,
            token=token, cross_group_backend=cross_group_backend, use_async_quorum=use_async_quorum,
            manager_port=manager_port, host=host)
        self._manager_kwargs = dict(manager_kwargs or {})
        self._manager: Any = None
        self._manager_live = False

    @property
    def manager(self) -> Any:
        """This group's `ft_core.Manager` (kept after training ends so `current_step()` stays readable)."""
        if self._manager is None:
            raise RuntimeError(self.MANAGER_MISSING)
        return self._manager

    @property
    def settings(self) -> FTSettings:
        return self._ft_settings

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(STRATEGY_NAME, cls,
                                       description="DDP inside one replica group, fault tolerant across groups "
                                                   "(ft_lightning)")

    def _stop_manager(self) -> None:
        """Shut the Manager down once (idempotent); a failure is logged, since this also runs while
        another error is already being raised."""
        if self._manager is None or not self._manager_live:
            return
        self._manager_live = False
        try:
            self._manager.shutdown()
        except Exception:
            logger.exception("ft_lightning: Manager shutdown failed")
