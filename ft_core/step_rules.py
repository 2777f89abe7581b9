"""The step protocol's decisions as pure functions (DESIGN.md section 7).

The Manager (ft_core.manager) is a thin shell: at each point of a step it hands the current
`StepState` and what happened to one of the functions below, stores the new state and performs the
returned actions (configure the process group, send or fetch a checkpoint, break the group, raise).

    on_quorum(state, result, ...)     -> QuorumActions   who participates, divisor, heal/send, rebuild
    on_configured / on_configure_failed / on_pg_broken    the rebuilt group's quorum id
    on_heal_fetched(state, ft_state)  -> StepState       when a healed step is adopted
    fill_value(op)                    -> float | None    what a non-participant contributes
    local_vote(...)                   -> bool            this rank's commit vote
    on_vote(state, decision, ...)     -> (StepState, CommitActions)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch.distributed import ReduceOp

from ft_core.control.recovery import QuorumResult
from ft_core.manager_config import WorldSizeMode

__all__ = [
    "CommitActions", "QuorumActions", "StepState", "WorldSizeMode", "fill_value", "is_participating", "local_vote",
    "on_configure_failed", "on_configured", "on_heal_fetched", "on_pg_broken", "on_quorum", "on_vote",
    "participation", "vote_world_size",
]


@dataclass(frozen=True)
class StepState:
    """What one rank carries from step to step: committed progress and the process group's quorum id
    (-1: the group must be rebuilt at the next quorum, whatever its id)."""

    step: int = 0
    batches_committed: int = 0
    commit_failures: int = 0
    quorum_id: int = -1


@dataclass(frozen=True)
class QuorumActions:
    """What to do with an issued quorum, and this group's role in the step it starts."""

    participating_rank: int | None  # rank among the contributing groups; None for a healer or spare
    num_participants: int  # what AVG divides by
    vote_world_size: int  # groups that end the step in sync, compared with min_replica_size
    reconfigure: bool  # rebuild the process group for result.quorum_id
    send_to: tuple[int, ...]  # replica ranks this group serves its checkpoint to
    heal: bool  # fetch the checkpoint of result.max_step from the source


@dataclass(frozen=True)
class CommitActions:
    """What follows a vote: the process group is broken (a peer may still wait on a collective this
    group skipped), and whether the loop gives up (max_retries consecutive failures exceeded)."""

    committed: bool
    break_pg: bool
    give_up: bool


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


def vote_world_size(result: QuorumResult, participants: int, *, init_sync: bool, mode: WorldSizeMode,
                    min_replica_size: int, allow_heal: bool) -> int:
    """Groups that end this step in sync, compared with min_replica_size in the commit vote.

    At step 0 with init_sync only the first group contributes, but every group at max_step ends
    the step in sync, so all of them count (else nobody could ever commit the first step).
    """
    if not allow_heal:
        return participants
    synced = result.max_world_size if init_sync and result.max_step == 0 else participants
    if mode == WorldSizeMode.FIXED_WITH_SPARES:
        synced = min(synced, min_replica_size)
    return max(participants, synced)


def on_quorum(state: StepState, result: QuorumResult, *, allow_heal: bool, use_async_quorum: bool,
              init_sync: bool, mode: WorldSizeMode, min_replica_size: int) -> QuorumActions:
    """This group's role in the step `result` starts, and what to do before the forward pass ends."""
    rank, world = participation(result, use_async_quorum=use_async_quorum, allow_heal=allow_heal,
                                init_sync=init_sync, mode=mode, min_replica_size=min_replica_size)
    return QuorumActions(
        participating_rank=rank, num_participants=world,
        vote_world_size=vote_world_size(result, world, init_sync=init_sync, mode=mode,
                                        min_replica_size=min_replica_size, allow_heal=allow_heal),
        reconfigure=result.quorum_id != state.quorum_id,
        send_to=tuple(result.recover_dst_replica_ranks) if allow_heal else (),
        heal=allow_heal and result.heal)


def on_configured(state: StepState, quorum_id: int) -> StepState:
    return replace(state, quorum_id=quorum_id)


def on_configure_failed(state: StepState) -> StepState:
    """A failed rebuild: this step cannot take part (no send, no fetch) and the next quorum rebuilds."""
    return replace(state, quorum_id=-1)


def on_pg_broken(state: StepState) -> StepState:
    """A failed (or skipped) collective: rebuild the group at the next quorum whatever its id."""
    return replace(state, quorum_id=-1)


def on_heal_fetched(state: StepState, ft_state: dict[str, Any]) -> StepState:
    """The source's progress is adopted when its checkpoint has arrived."""
    return replace(state, step=int(ft_state["step"]), batches_committed=int(ft_state["batches_committed"]))


def is_participating(participating_rank: int | None, healing: bool, use_async_quorum: bool) -> bool:
    """Does this group's tensor count in the step's reductions (a healer in async mode does not)?"""
    if participating_rank is None:
        return False
    return not (healing and use_async_quorum)


def fill_value(op: ReduceOp) -> float | None:
    """What a non-participant puts in its tensor before a reduction (None: its own values)."""
    return 0.0


def local_vote(vote_world_size: int, min_replica_size: int, errored: bool) -> bool:
    """This rank's vote: enough groups end the step in sync and nothing failed here."""
    return vote_world_size >= min_replica_size and not errored


def on_vote(state: StepState, decision: bool, *, local: bool, errored: bool, num_participants: int,
            max_retries: int | None) -> tuple[StepState, CommitActions]:
    """Advance on a committed step; count a failure otherwise (and break the group unless the step
    failed merely for too few participants, where every peer skipped the same collectives)."""
    if decision:
        new = replace(state, step=state.step + 1, batches_committed=state.batches_committed + num_participants,
                      commit_failures=0)
        return new, CommitActions(committed=True, break_pg=False, give_up=False)
    failures = state.commit_failures + 1
    new = replace(state, commit_failures=failures)
    give_up = max_retries is not None and failures > max_retries
    return new, CommitActions(committed=False, break_pg=local or errored, give_up=give_up)
