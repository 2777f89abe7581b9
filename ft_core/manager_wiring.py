"""How a Manager joins its replica group: the group's stores, and rank 0's manager server or the other ranks'
client of it (found through the group's store)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ft_core import net
from ft_core.control.manager_client import ManagerClient
from ft_core.control.manager_server import ManagerServer
from ft_core.errors import ConfigError, FTTimeoutError
from ft_core.manager_config import ManagerConfig, env_int
from ft_core.stores import own_store

STORE_PREFIX = "ft_manager"


@dataclass
class GroupWiring:
    store: Any  # the group's TCPStore (a one-rank group's own)
    rendezvous_store: Any  # rank 0 of a group of several ranks: its own store for the cross-group rendezvous
    store_address: str  # host:port the quorum advertises for the cross-group rendezvous
    replica_id: str
    server: ManagerServer | None  # rank 0
    client: ManagerClient | None  # the other ranks


def wire_group(cfg: ManagerConfig, store_addr: str | None, store_port: int | None) -> GroupWiring:
    """Own TCPStore for a one-rank group; else the group's store. Rank 0 hosts the manager server and
    advertises a store of its own on cfg.hostname for the cross-group rendezvous: the group's store
    (MASTER_ADDR) may be reachable from inside the group only (localhost, a name other hosts lack)."""
    rendezvous = None
    if cfg.group_world_size == 1 and store_addr is None:
        group_store = own_store(cfg.hostname, cfg.connect_timeout, cfg.bind_host)
        host, port = cfg.hostname, group_store.port
    else:
        host = store_addr or os.environ.get("MASTER_ADDR")
        port = store_port if store_port is not None else env_int("MASTER_PORT")
        if not host or not port:
            raise ConfigError("a replica group with several ranks needs its TCPStore: pass store_addr= and "
                              "store_port= or run under torchrun (MASTER_ADDR/MASTER_PORT)")
        group_store = dist.TCPStore(host, int(port), is_master=False, timeout=cfg.connect_timeout)
        if cfg.group_rank == 0:
            rendezvous = own_store(cfg.hostname, cfg.connect_timeout, cfg.bind_host)
            host, port = cfg.hostname, rendezvous.port
    address = net.format_host_port(host, int(port))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"{STORE_PREFIX}/{restart}", group_store)
    if cfg.group_rank == 0:
        server = ManagerServer(cfg.replica_id, cfg.lighthouse_addr, hostname=cfg.hostname,
                               bind=net.format_host_port(cfg.bind_host, cfg.port), store_addr=address,
                               world_size=cfg.group_world_size, heartbeat_interval=cfg.heartbeat_interval,
                               connect_timeout=cfg.connect_timeout, quorum_retries=cfg.quorum_retries,
                               token=cfg.token)
        store.multi_set(["replica_id", "manager_addr", "manager_frames_addr"],
                        [cfg.replica_id, server.address(), server.frames_address()])
        return GroupWiring(group_store, rendezvous, address, cfg.replica_id, server, None)
    try:
        store.wait(["manager_addr", "replica_id"], cfg.connect_timeout)
    except Exception as exc:  # torch raises a DistStoreError on timeout
        raise FTTimeoutError(f"group rank {cfg.group_rank}: group rank 0 did not publish its manager "
                             f"server address in the TCPStore {address} within "
                             f"{cfg.connect_timeout.total_seconds():.3g}s ({exc}); is rank 0 running?") from None
    replica_id, addr, frames_addr = (v.decode() for v in store.multi_get(
        ["replica_id", "manager_addr", "manager_frames_addr"]))
    client = ManagerClient(addr, cfg.connect_timeout, token=cfg.token, frames_addr=frames_addr)
    return GroupWiring(group_store, rendezvous, address, replica_id, None, client)
