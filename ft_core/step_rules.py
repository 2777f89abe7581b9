"""The step protocol's decisions as pure functions (DESIGN.md section 7).

The Manager (ft_core.manager) is a thin shell: at each point of a step it hands the current
`StepState` and what happened to one of the functions below, stores the new state and performs the
returned actions (configure the process group, send or fetch a checkpoint, break the group, raise).

    on_quorum(state, result, ...)     -> QuorumActions   who participates, divisor, heal/send, rebuild
    on_configured / on_configure_failed / on_pg_broken    the rebuilt group's quorum id
    heal_target(ft_state, expected)   -> HealTarget      a fetched state, checked; adopted only at commit
    contribution(...) / fill_value    -> Contribution    what this group puts into a reduction
    local_vote(...)                   -> bool            this rank's commit vote
    on_vote(state, decision, ...)     -> (StepState, CommitActions)
    can_redo(...) / redo_role(...)    -> bool / RedoRole  redo a step that lost a peer (ft_core.redo)
    survivors_can_commit(...)         -> bool          whether forming the quorum again for a redo is worth it

A healed step is adopted only when the group commits the step it healed in: every rank loaded the
state (a rank whose fetch or load failed votes no, and the group's vote is the AND of its ranks),
so the ranks of a group never disagree on the step, and a group that failed to heal keeps its
pre-heal step and heals again at the next quorum.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed import ReduceOp

from ft_core.control.recovery import QuorumResult
from ft_core.errors import CheckpointError, ConfigError
from ft_core.manager_config import WorldSizeMode

__all__ = [
    "CommitActions", "Contribution", "HealTarget", "QuorumActions", "RedoRole", "StepState", "WorldSizeMode",
    "can_redo", "check_reduce_op", "contribution", "fill_value", "heal_target", "is_participating", "local_vote",
    "on_configure_failed", "on_configured", "on_pg_broken", "on_quorum", "on_vote", "participation", "redo_role",
    "restore", "survivors_can_commit", "unreduced_step", "vote_world_size",
]


@dataclass(frozen=True)
class StepState:
    """What one rank carries from step to step: committed progress and the process group's quorum id
    (-1: the group must be rebuilt at the next quorum, whatever its id)."""

    step: int = 0
    batches_committed: int = 0
    commit_failures: int = 0
    quorum_id: int = -1
    commit_quorum_id: int = 0  # the quorum in which `step` was committed (0: none): which fork it is on


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
class HealTarget:
    """The progress a fetched checkpoint carries: adopted (plus the step committed on top) at commit."""

    step: int
    batches_committed: int
    commit_quorum_id: int = 0


class Contribution(enum.Enum):
    """What a group puts into one cross-group reduction."""

    OWN = "own"  # its tensor, as computed
    IDENTITY = "identity"  # the op's identity (healer, spare): the result is the participants' alone
    BREAK = "break"  # an errored participant: the divisor counts it, so no peer may commit this step


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

    The participants: a healer's load may still fail, and the vote is per group, so a healer is never
    counted (else a lone group could commit step after step beside a group that never heals). At step
    0 with init_sync only the first group contributes, but every group at max_step ends the step in
    sync, so all of them count (else nobody could ever commit the first step). A heal that cannot
    commit for lack of participants still completes: see on_vote's `group_healed`.
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


def heal_target(ft_state: Any, expected_step: int, source: str) -> HealTarget:
    """Check a fetched checkpoint's fault-tolerance part; what the group adopts if it commits."""
    if not isinstance(ft_state, dict) or not isinstance(ft_state.get("step"), int) \
            or not isinstance(ft_state.get("batches_committed"), int):
        raise CheckpointError(f"checkpoint from {source} is malformed: expected {{'user': ..., 'ft': "
                              f"{{step, batches_committed}}}}")
    if ft_state["step"] != expected_step:
        raise CheckpointError(f"checkpoint from {source} is for step {ft_state['step']}, expected {expected_step}; "
                              f"will retry at the next quorum")
    return HealTarget(step=ft_state["step"], batches_committed=ft_state["batches_committed"],
                      commit_quorum_id=int(ft_state.get("commit_quorum_id", 0)))


def restore(state: StepState, saved: dict[str, Any]) -> StepState:
    """Progress loaded from a durable checkpoint (Manager.load_state_dict)."""
    return replace(state, step=int(saved["step"]), batches_committed=int(saved["batches_committed"]),
                   commit_quorum_id=int(saved.get("commit_quorum_id", 0)))


def is_participating(participating_rank: int | None, healing: bool, use_async_quorum: bool) -> bool:
    """Does this group's tensor count in the step's reductions (a healer in async mode does not)?"""
    if participating_rank is None:
        return False
    return not (healing and use_async_quorum)


def contribution(participating: bool, errored: bool) -> Contribution:
    """A participant that already failed this step must not send a stale or partial tensor that the
    divisor counts: it breaks the group instead, so every peer's reduction fails and nobody commits.
    Healers and spares send the identity, whatever their state: the divisor does not count them."""
    if not participating:
        return Contribution.IDENTITY
    return Contribution.BREAK if errored else Contribution.OWN


_SUM_LIKE = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.BOR, ReduceOp.BXOR)


def fill_value(op: ReduceOp, dtype: torch.dtype) -> int | float | bool:
    """The identity of `op` for `dtype`: what a non-participant contributes to a reduction."""
    floating = dtype.is_floating_point or dtype.is_complex
    if dtype == torch.bool:
        low, high = False, True
    elif floating:
        low, high = float("-inf"), float("inf")
    else:
        info = torch.iinfo(dtype)
        low, high = info.min, info.max
    if op in _SUM_LIKE:
        return False if dtype == torch.bool else 0
    if op == ReduceOp.PRODUCT:
        return True if dtype == torch.bool else 1
    if op == ReduceOp.MAX:
        return low
    if op == ReduceOp.MIN:
        return high
    if op == ReduceOp.BAND and not floating:
        return True if dtype == torch.bool else (-1 if info.min < 0 else info.max)
    raise ConfigError(f"allreduce with {op} has no identity for {dtype}, so a healing or spare group cannot take "
                      f"part in it; use SUM, AVG, PRODUCT, MIN, MAX (or BAND/BOR/BXOR on integers)")


def local_vote(vote_world_size: int, min_replica_size: int, errored: bool, heal_loaded: bool = True) -> bool:
    """This rank's vote: enough groups end the step in sync, nothing failed here, and a group that
    heals this step has its healed state loaded."""
    return vote_world_size >= min_replica_size and not errored and heal_loaded


def on_vote(state: StepState, decision: bool, *, local: bool, errored: bool, num_participants: int,
            max_retries: int | None, healed: HealTarget | None = None,
            group_healed: bool = False) -> tuple[StepState, CommitActions]:
    """Advance on a committed step (from the healed step when this step healed the group); count a
    failure otherwise (and break the group unless the step failed merely for too few participants,
    where every peer skipped the same collectives).

    A step that did not commit keeps the pre-heal progress, except when every rank of the group
    loaded the healed state (`group_healed`, the AND of the ranks' bits from the commit barrier):
    the group then holds exactly the source's state of the healed step, so it adopts that step
    (without the one on top). That is how a heal completes when too few groups participate to
    commit the heal step (min_replica_size), without ever counting the healer as a participant."""
    if not decision and healed is not None and group_healed:
        state = replace(state, step=healed.step, batches_committed=healed.batches_committed,
                        commit_quorum_id=healed.commit_quorum_id)
    if decision:
        base = state if healed is None else replace(state, step=healed.step,
                                                    batches_committed=healed.batches_committed)
        new = replace(base, step=base.step + 1, batches_committed=base.batches_committed + num_participants,
                      commit_failures=0, commit_quorum_id=state.quorum_id)
        return new, CommitActions(committed=True, break_pg=False, give_up=False)
    failures = state.commit_failures + 1
    new = replace(state, commit_failures=failures)
    give_up = max_retries is not None and failures > max_retries
    return new, CommitActions(committed=False, break_pg=local or errored, give_up=give_up)


def unreduced_step(groups: int, reductions: int) -> ConfigError | None:
    """Fail closed: a step of several groups that reduced nothing across them would train them apart. Asked
    for clean steps only: after an early error a loop may skip its collectives (test_manager_liveness)."""
    if groups <= 1 or reductions > 0:
        return None
    return ConfigError(f"refusing to commit a step of {groups} replica groups with no cross-group reduction: the "
                       f"gradients were never averaged across groups, so the groups would train apart. Likely cause: "
                       f"the model is not wrapped by ft_core.DistributedDataParallel (or its comm hook was replaced), "
                       f"or the loop does not call manager.allreduce on the gradients")


def check_reduce_op(op: ReduceOp, dtype: torch.dtype, divided_by: int | None = None) -> None:
    """Refuse what no group could take part in: AVG of integers, an op without an identity, an input
    said to be divided already (`divided_by`) for an op other than AVG or by fewer than one group."""
    if op == ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ConfigError(f"allreduce with ReduceOp.AVG needs a floating point tensor, got {dtype}; "
                          f"use ReduceOp.SUM for integers and divide yourself")
    if divided_by is not None and (op != ReduceOp.AVG or isinstance(divided_by, bool)
                                   or not isinstance(divided_by, int) or divided_by < 1):
        raise ConfigError(f"allreduce(divided_by={divided_by!r}) with {op}: divided_by is the number of groups "
                          f"the input was already divided by, an int >= 1, and only for ReduceOp.AVG")
    fill_value(op, dtype)  # raises ConfigError for an op without an identity


# ---- redoing a step that lost a peer (ft_core.redo performs it) --------------------------------------

class RedoRole(enum.Enum):
    """What a group does in the quorum it formed again, for the same step, after losing a peer."""

    REPLAY = "replay"  # every member is a survivor redoing this step: re-issue the recorded reductions
    ABANDON = "abandon"  # someone else is in another step (or heals): fail the step as without redo


def can_redo(*, enabled: bool, redone: bool, errored: bool, peer_errors_only: bool, recoverable: bool,
             participating: bool) -> bool:
    """This rank's `redoable` bit in the commit barrier: its step failed only because a peer was lost
    or a collective failed, it took part with its own gradients, every reduction it issued can be
    issued again with the same input (never sent, or a copy kept), and the step was not redone yet."""
    return enabled and not redone and errored and peer_errors_only and recoverable and participating


def survivors_can_commit(old_replica_ids: tuple[str, ...], lost: frozenset[str] | set[str],
                         min_replica_size: int) -> bool:
    """Worth forming the quorum again: the survivors (the old quorum less the groups known lost, at least
    one) can still reach min_replica_size; else the shrink-only quorum could only wait for its timeout."""
    survivors = set(old_replica_ids) - set(lost)
    return min(len(survivors), len(old_replica_ids) - 1) >= min_replica_size


def redo_role(state: StepState, result: QuorumResult, old_replica_ids: tuple[str, ...],
              attempt_quorum_id: int) -> RedoRole:
    """Replay only when the new quorum is exactly survivors of the old one, all at this step on one fork,
    none healing, and every member redoes this very attempt (`result.redo_quorum_id`, the quorum id every
    member named in its request, is the id of the quorum this group's attempt ran in). A member that gave up
    on the attempt runs a fresh one of the same step: its collectives would pair with our replay, so the
    groups would apply different updates. Failure counts cannot tell them apart (they differ from group to
    group by history). Anything else is abandoned: the step fails as it would without redo, and the next
    quorum heals as usual."""
    survivors = set(result.replica_ids) <= set(old_replica_ids)
    same_step = result.max_step == state.step and result.max_world_size == result.replica_world_size
    same_attempt = attempt_quorum_id > 0 and result.redo_quorum_id == attempt_quorum_id
    if survivors and same_step and same_attempt and not result.heal and result.max_replica_rank is not None:
        return RedoRole.REPLAY
    return RedoRole.ABANDON
