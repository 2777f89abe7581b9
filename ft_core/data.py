"""Data sharding across replica groups and the ranks inside each group.

Policy for a dead group's shard: each process reads only its own shard, so while a group is
down its shard is not trained on for those steps (lossy, like torchft). A restarted group
resumes its own shard at the epoch it is set to; checkpoint the loader per group if the exact
sample order across restarts matters.
"""

from __future__ import annotations

from typing import Sized

import torch.utils.data

from ft_core.errors import ConfigError


def global_shard(replica_rank: int, num_replica_groups: int, group_rank: int, num_replicas: int) -> tuple[int, int]:
    """(shard index, shard count) for a process: groups are contiguous blocks of `num_replicas` shards."""
    if num_replica_groups < 1 or num_replicas < 1:
        raise ConfigError(f"num_replica_groups ({num_replica_groups}) and num_replicas ({num_replicas}) must be >= 1")
    if not 0 <= replica_rank < num_replica_groups:
        raise ConfigError(f"replica_rank {replica_rank} must be in [0, {num_replica_groups}); "
                          f"check REPLICA_GROUP_ID / NUM_REPLICA_GROUPS")
    if not 0 <= group_rank < num_replicas:
        raise ConfigError(f"group_rank {group_rank} must be in [0, {num_replicas})")
    return group_rank + num_replicas * replica_rank, num_replicas * num_replica_groups


class DistributedSampler(torch.utils.data.distributed.DistributedSampler):
    """torch's DistributedSampler over the (replica group, group rank) grid of all processes."""

    def __init__(self, dataset: Sized, replica_rank: int, num_replica_groups: int, group_rank: int = 0,
                 num_replicas: int = 1, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        rank, world = global_shard(replica_rank, num_replica_groups, group_rank, num_replicas)
        self.replica_rank = replica_rank
        self.num_replica_groups = num_replica_groups
        self.group_rank = group_rank
        self.group_world_size = num_replicas
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
