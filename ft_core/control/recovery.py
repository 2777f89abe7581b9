"""Recovery plan: from an issued quorum, what one group rank of one replica group does this step.

A pure function of (replica_id, group_rank, quorum, init_sync) so every rule of DESIGN.md
section 6 is checked by table tests; the manager server only moves data to and from it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ft_core.errors import QuorumError
from ft_core.control.types import Quorum, common_redo_quorum_id


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
    redo_quorum_id: int = 0  # the step attempt every member redoes (ft_core.redo); 0: some member does not


@dataclass(frozen=True)
class _Layout:
    """What every plan of one quorum shares: computed once per quorum (and init_sync), so a plan is O(1)
    per group rank instead of sorting and scanning every participant for each (DESIGN.md section 6).
    Participants are named by their replica rank (their place in replica_id order); only strings, ints
    and tuples of them, so a kept layout gives the cycle collector nothing to carry (types.Roster)."""

    ids: tuple[str, ...]  # replica ids in replica rank order
    rank_of: dict[str, int]
    addresses: tuple[str, ...]  # by replica rank
    store_addresses: tuple[str, ...]
    max_step: int
    at_max_step: tuple[int, ...]  # replica ranks of the up-to-date groups, on the latest fork
    max_rank_of: dict[str, int]
    sources: tuple[int, ...]  # replica ranks healers heal from
    source_index: dict[str, int]
    healers: tuple[int, ...]
    healer_index: dict[str, int]
    commit_failures: int
    redo_quorum_id: int  # every member's redo_quorum_id when they are all equal, else 0
    error: str  # why no group rank can use this quorum ("" when it can)


def _layout_of(quorum: Quorum, init_sync: bool) -> _Layout:
    roster = quorum.roster
    order = sorted(range(len(roster.replica_ids)), key=roster.replica_ids.__getitem__)
    ids = tuple([roster.replica_ids[i] for i in order])
    steps = [roster.steps[i] for i in order]
    forks = [roster.commit_quorum_ids[i] for i in order]
    error = ""
    if len(set(roster.world_sizes)) > 1:
        by_size = ", ".join(f"{ids[r]} has {roster.world_sizes[i]}" for r, i in enumerate(order))
        error = (f"quorum {quorum.quorum_id} mixes replica groups of different sizes ({by_size} ranks): "
                 f"every group must run the same number of ranks, since rank r of each group reduces with "
                 f"rank r of the others; restart the odd group with the same number of processes")
    elif len({d for d in roster.reductions if d}) > 1:
        by_digest = ", ".join(f"{ids[r]} reduces {roster.reductions[i] or '(not known yet)'}"
                              for r, i in enumerate(order))
        error = (f"quorum {quorum.quorum_id} mixes replica groups that reduce different gradients ({by_digest}): "
                 f"their models (or DDP bucket, LocalSGD or DiLoCo fragment settings) differ, so their collectives "
                 f"would not match; start every group with the same model and the same arguments")
    max_step = max(steps, default=0)
    # Groups at max_step are identical only if they committed it in the same quorum: a step committed
    # by a group alone (its peers' votes failed) and again by others later is a fork. The latest
    # quorum's fork is the one to keep; groups on an older one heal like groups behind.
    fork = max((f for s, f in zip(steps, forks) if s == max_step), default=0)
    at_max_step = tuple([r for r in range(len(ids)) if steps[r] == max_step and forks[r] == fork])
    sources = ((0,) if ids else ()) if init_sync and max_step == 0 else at_max_step
    source_set = set(sources)
    healers = tuple([r for r in range(len(ids)) if r not in source_set])
    return _Layout(
        ids=ids, rank_of={rid: r for r, rid in enumerate(ids)},
        addresses=tuple([roster.addresses[i] for i in order]),
        store_addresses=tuple([roster.store_addresses[i] for i in order]), max_step=max_step,
        at_max_step=at_max_step, max_rank_of={ids[r]: i for i, r in enumerate(at_max_step)},
        sources=sources, source_index={ids[r]: i for i, r in enumerate(sources)},
        healers=healers, healer_index={ids[r]: i for i, r in enumerate(healers)},
        commit_failures=max(roster.commit_failures, default=0),
        redo_quorum_id=common_redo_quorum_id(roster.redo_quorum_ids), error=error)


_LAYOUTS: dict[tuple[int, bool], tuple[Quorum, _Layout]] = {}  # by (id(quorum), init_sync); keeps the quorum alive
_LAYOUTS_KEPT = 8
_layouts_lock = threading.Lock()


def _layout(quorum: Quorum, init_sync: bool) -> _Layout:
    """The quorum's layout, from a small per-process cache: every group rank of a group, and every group a
    process hosts (the lighthouse sends them all the same quorum), plans from one quorum object."""
    key = (id(quorum), init_sync)
    with _layouts_lock:
        hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is quorum:
        return hit[1]
    layout = _layout_of(quorum, init_sync)
    with _layouts_lock:
        while len(_LAYOUTS) >= _LAYOUTS_KEPT:
            del _LAYOUTS[next(iter(_LAYOUTS))]
        _LAYOUTS[key] = (quorum, layout)
    return layout


def compute_recovery_plan(replica_id: str, group_rank: int, quorum: Quorum, init_sync: bool) -> QuorumResult:
    """The plan for group rank `group_rank` of replica group `replica_id` in `quorum`.

    Groups at max_step are identical, so healers spread over them by group rank. At max_step 0
    with init_sync they are not identical yet, so every rank of every group heals from one source.
    """
    if group_rank < 0:
        raise ValueError(f"group_rank must be >= 0, got {group_rank}")
    layout = _layout(quorum, init_sync)
    replica_rank = layout.rank_of.get(replica_id)
    if replica_rank is None:
        raise QuorumError(f"replica group {replica_id!r} is not in quorum {quorum.quorum_id} "
                          f"(participants {list(layout.ids)}); it will rejoin at its next quorum call")
    if layout.error:
        raise QuorumError(layout.error)

    # Healer i heals from source (i + group_rank) mod len(sources), so a source serves the healers whose
    # index is congruent to its own minus group_rank.
    sources, healers = layout.sources, layout.healers
    healer = layout.healer_index.get(replica_id)
    src = sources[(healer + group_rank) % len(sources)] if healer is not None else None
    mine = layout.source_index.get(replica_id)
    dst_ranks = [] if mine is None else list(healers[(mine - group_rank) % len(sources)::len(sources)])

    at_max_step = layout.at_max_step
    return QuorumResult(
        quorum_id=quorum.quorum_id,
        replica_rank=replica_rank,
        replica_world_size=len(layout.ids),
        recover_src_manager_address=layout.addresses[src] if src is not None else "",
        recover_src_replica_rank=src,
        recover_dst_replica_ranks=dst_ranks,
        # Rendezvous load is spread over the up-to-date groups' stores; every group computes the same one.
        store_address=layout.store_addresses[at_max_step[group_rank % len(at_max_step)]],
        max_step=layout.max_step,
        max_replica_rank=layout.max_rank_of.get(replica_id),
        max_world_size=len(at_max_step),
        heal=src is not None,
        commit_failures=layout.commit_failures,
        replica_ids=list(layout.ids),
        redo_quorum_id=layout.redo_quorum_id,
    )
