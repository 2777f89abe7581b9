"""Recovery plan: from an issued quorum, what one group rank of one replica group does this step.

A pure function of (replica_id, group_rank, quorum, init_sync) so every rule of DESIGN.md
section 6 is checked by table tests; the manager server only moves data to and from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ft_core.errors import QuorumError
from ft_core.control.types import Quorum, QuorumMember


@dataclass(frozen=True)
class QuorumResult:
    """One group rank's view of a quorum: its place in it and whom it heals from or sends to."""

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    recover_src_manager_address: str
    recover_src_replica_rank: int | None  # None when this group does not heal
    recover_dst_replica_ranks: list[int] = field(default_factory=list)
    store_address: str = ""
    max_step: int = 0
    max_replica_rank: int | None = None  # None when this group is behind max_step
    max_world_size: int = 0
    heal: bool = False
    commit_failures: int = 0
    replica_ids: list[str] = field(default_factory=list)


def compute_recovery_plan(replica_id: str, group_rank: int, quorum: Quorum, init_sync: bool) -> QuorumResult:
    """The plan for group rank `group_rank` of replica group `replica_id` in `quorum`.

    Groups at max_step are identical, so healers spread over them by group rank. At max_step 0
    with init_sync they are not identical yet, so every rank of every group heals from one source.
    """
    if group_rank < 0:
        raise ValueError(f"group_rank must be >= 0, got {group_rank}")
    participants = sorted(quorum.participants, key=lambda m: m.replica_id)
    ids = [m.replica_id for m in participants]
    if replica_id not in ids:
        raise QuorumError(f"replica group {replica_id!r} is not in quorum {quorum.quorum_id} "
                          f"(participants {ids}); it will rejoin at its next quorum call")
    replica_rank = ids.index(replica_id)
    sizes = {m.world_size for m in participants}
    if len(sizes) > 1:
        by_size = ", ".join(f"{m.replica_id} has {m.world_size}" for m in participants)
        raise QuorumError(f"quorum {quorum.quorum_id} mixes replica groups of different sizes ({by_size} ranks): "
                          f"every group must run the same number of ranks, since rank r of each group reduces with "
                          f"rank r of the others; restart the odd group with the same number of processes")

    max_step = max(m.step for m in participants)
    # Groups at max_step are identical only if they committed it in the same quorum: a step committed
    # by a group alone (its peers' votes failed) and again by others later is a fork. The latest
    # quorum's fork is the one to keep; groups on an older one heal like groups behind.
    fork = max(m.commit_quorum_id for m in participants if m.step == max_step)
    at_max_step = [m for m in participants if m.step == max_step and m.commit_quorum_id == fork]
    at_max_ids = [m.replica_id for m in at_max_step]
    max_replica_rank = at_max_ids.index(replica_id) if replica_id in at_max_ids else None
    # Rendezvous load is spread over the up-to-date groups' stores; every group computes the same one.
    store_address = at_max_step[group_rank % len(at_max_step)].store_address

    if init_sync and max_step == 0:
        sources: list[QuorumMember] = [participants[0]]
    else:
        sources = at_max_step
    source_ids = {m.replica_id for m in sources}
    healers = [m for m in participants if m.replica_id not in source_ids]

    rank_of = {rid: i for i, rid in enumerate(ids)}
    src: QuorumMember | None = None
    dst_ranks: list[int] = []
    for i, healer in enumerate(healers):
        source = sources[(i + group_rank) % len(sources)]
        if healer.replica_id == replica_id:
            src = source
        if source.replica_id == replica_id:
            dst_ranks.append(rank_of[healer.replica_id])

    return QuorumResult(
        quorum_id=quorum.quorum_id,
        replica_rank=replica_rank,
        replica_world_size=len(participants),
        recover_src_manager_address=src.address if src is not None else "",
        recover_src_replica_rank=rank_of[src.replica_id] if src is not None else None,
        recover_dst_replica_ranks=dst_ranks,
        store_address=store_address,
        max_step=max_step,
        max_replica_rank=max_replica_rank,
        max_world_size=len(at_max_step),
        heal=src is not None,
        commit_failures=max(m.commit_failures for m in participants),
        replica_ids=ids,
    )
