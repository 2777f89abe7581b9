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


def global_shard(replica_group_id: int, num_replica_groups: int, group_rank: int,
                 num_replicas: int) -> tuple[int, int]:
    """(shard index, shard count) for a process: groups are contiguous blocks of `num_replicas` shards."""
    if num_replica_groups < 1 or num_replicas < 1:
        raise ConfigError(f"num_replica_groups ({num_replica_groups}) and num_replicas ({num_replicas}) must be >= 1")
    if not 0 <= replica_group_id < num_replica_groups:
        raise ConfigError(f"replica_group_id {replica_group_id} (torchft's replica_rank) must be in "
                          f"[0, {num_replica_groups}); check REPLICA_GROUP_ID / NUM_REPLICA_GROUPS")
    if not 0 <= group_rank < num_replicas:
        raise ConfigError(f"group_rank {group_rank} must be in [0, {num_replicas})")
    return group_rank + num_replicas * replica_group_id, num_replicas * num_replica_groups


class DistributedSampler(torch.utils.data.distributed.DistributedSampler):
    """torch's DistributedSampler over the (replica group, group rank) grid of all processes.

    `replica_rank` is torchft's name for the replica group's index (`replica_group_id` here; in ft-lightning
    `replica_rank` is a group's position in the quorum); both spellings are accepted.
    """

    def __init__(self, dataset: Sized, replica_rank: int | None = None, num_replica_groups: int | None = None,
                 group_rank: int = 0, num_replicas: int = 1, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, *, replica_group_id: int | None = None) -> None:
        if (replica_rank is None) == (replica_group_id is None) or num_replica_groups is None:
            raise ConfigError("DistributedSampler needs num_replica_groups and the replica group's index: "
                              "replica_group_id= (or torchft's replica_rank=), not both")
        group = replica_group_id if replica_group_id is not None else replica_rank
        assert group is not None
        rank, world = global_shard(group, num_replica_groups, group_rank, num_replicas)
        self.replica_group_id = group
        self.num_replica_groups = num_replica_groups
        self.group_rank = group_rank
        self.group_world_size = num_replicas
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)

    @property
    def replica_rank(self) -> int:
        """torchft's name of `replica_group_id`."""
        return self.replica_group_id
