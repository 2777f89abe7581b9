"""The step protocol's decisions (ft_core.step_rules), one row per branch the Manager takes."""

from __future__ import annotations

import pytest
from torch.distributed import ReduceOp

from ft_core import step_rules as rules
from ft_core.control.recovery import QuorumResult
import torch

from ft_core.errors import CheckpointError, ConfigError
from ft_core.step_rules import CommitActions, Contribution, QuorumActions, StepState, WorldSizeMode

D, F = WorldSizeMode.DYNAMIC, WorldSizeMode.FIXED_WITH_SPARES


def result(*, quorum_id: int = 1, replica_rank: int = 0, world: int = 2, max_step: int = 5,
           max_replica_rank: int | None = 0, max_world: int = 2, heal: bool = False,
           send_to: tuple[int, ...] = ()) -> QuorumResult:
    return QuorumResult(quorum_id=quorum_id, replica_rank=replica_rank, replica_world_size=world,
                        recover_src_manager_address="src:1" if heal else "", recover_src_replica_rank=1 if heal else None,
                        recover_dst_replica_ranks=list(send_to), max_step=max_step, max_replica_rank=max_replica_rank,
                        max_world_size=max_world, heal=heal)


def actions(rank, n, vote, reconfigure=False, send_to=(), heal=False) -> QuorumActions:
    return QuorumActions(participating_rank=rank, num_participants=n, vote_world_size=vote, reconfigure=reconfigure,
                         send_to=tuple(send_to), heal=heal)


AT_Q1 = StepState(step=5, batches_committed=10, quorum_id=1)

QUORUM_CASES = [
    # name, state, result, allow_heal, async, init_sync, mode, min_size, expected
    ("up to date, same quorum: no rebuild", AT_Q1, result(), True, True, True, D, 1, actions(0, 2, 2)),
    ("membership changed: rebuild", AT_Q1, result(quorum_id=2), True, True, True, D, 1,
     actions(0, 2, 2, reconfigure=True)),
    ("broken group (-1) is rebuilt even for the same id", StepState(step=5), result(), True, True, True, D, 1,
     actions(0, 2, 2, reconfigure=True)),
    ("source: sends to the healers", AT_Q1, result(send_to=(2,)), True, True, True, D, 1,
     actions(0, 2, 2, send_to=(2,))),
    ("source without healing allowed: sends nothing", AT_Q1, result(send_to=(2,)), False, True, True, D, 1,
     actions(0, 2, 2)),
    ("healer in async mode: fetches, does not participate, is not counted in the vote", StepState(step=2, quorum_id=1),
     result(replica_rank=1, world=3, max_replica_rank=None, max_world=2, heal=True), True, True, True, D, 1,
     actions(None, 2, 2, heal=True)),
    ("min_replica_size 2, one participant + one healer: the source alone cannot commit", AT_Q1,
     result(world=2, max_world=1, send_to=(1,)), True, True, True, D, 2, actions(0, 1, 1, send_to=(1,))),
    ("healer in sync mode: loads first, participates", StepState(step=2, quorum_id=1),
     result(replica_rank=1, world=3, max_replica_rank=None, max_world=2, heal=True), True, False, True, D, 1,
     actions(1, 3, 3, heal=True)),
    ("behind without healing allowed: neither heals nor participates", StepState(step=2, quorum_id=1),
     result(replica_rank=1, world=3, max_replica_rank=None, max_world=2, heal=True), False, True, True, D, 1,
     actions(None, 2, 2)),
    ("init_sync at step 0, first group: sole contributor, everyone counts in the vote", StepState(quorum_id=1),
     result(max_step=0, max_world=3, world=3), True, True, True, D, 1, actions(0, 1, 3)),
    ("init_sync at step 0, other group: heals from the first", StepState(quorum_id=1),
     result(max_step=0, replica_rank=2, world=3, max_replica_rank=2, max_world=3, heal=True), True, True, True, D, 1,
     actions(None, 1, 3, heal=True)),
    ("step 0 without init_sync: everyone contributes", StepState(quorum_id=1),
     result(max_step=0, replica_rank=2, world=3, max_replica_rank=2, max_world=3), True, True, False, D, 1,
     actions(2, 3, 3)),
    ("fixed with spares: a spare beyond min_replica_size", AT_Q1,
     result(replica_rank=2, world=3, max_replica_rank=2, max_world=3), True, True, True, F, 2, actions(None, 2, 2)),
    ("fixed with spares: a contributor", AT_Q1,
     result(replica_rank=1, world=3, max_replica_rank=1, max_world=3), True, True, True, F, 2, actions(1, 2, 2)),
    ("fixed with spares, fewer groups than min: all contribute, the vote fails", AT_Q1,
     result(world=1, max_world=1), True, True, True, F, 2, actions(0, 1, 1)),
]


@pytest.mark.parametrize("name,state,res,allow_heal,use_async,init_sync,mode,min_size,expected", QUORUM_CASES,
                         ids=[c[0] for c in QUORUM_CASES])
def test_on_quorum(name, state, res, allow_heal, use_async, init_sync, mode, min_size, expected):
    assert rules.on_quorum(state, res, allow_heal=allow_heal, use_async_quorum=use_async, init_sync=init_sync,
                           mode=mode, min_replica_size=min_size) == expected


VOTE_CASES = [
    # name, decision, local, errored, n, max_retries, state before, (state after, actions)
    ("committed: step and batches advance, failures reset", True, True, False, 2, None,
     StepState(step=5, batches_committed=10, commit_failures=2, quorum_id=3),
     (StepState(step=6, batches_committed=12, commit_failures=0, quorum_id=3, commit_quorum_id=3),
      CommitActions(True, False, False))),
    ("too few participants: a failure, the group stays (every peer skipped alike)", False, False, False, 1, None,
     AT_Q1, (StepState(step=5, batches_committed=10, commit_failures=1, quorum_id=1), CommitActions(False, False, False))),
    ("local error: a failure and the group is broken", False, False, True, 2, None,
     AT_Q1, (StepState(step=5, batches_committed=10, commit_failures=1, quorum_id=1), CommitActions(False, True, False))),
    ("a peer voted no: a failure and the group is broken", False, True, False, 2, None,
     AT_Q1, (StepState(step=5, batches_committed=10, commit_failures=1, quorum_id=1), CommitActions(False, True, False))),
    ("max_retries exceeded: give up", False, True, False, 2, 1,
     StepState(step=5, commit_failures=1, quorum_id=1),
     (StepState(step=5, commit_failures=2, quorum_id=1), CommitActions(False, True, True))),
    ("max_retries reached, not exceeded: go on", False, True, False, 2, 1,
     StepState(step=5, quorum_id=1), (StepState(step=5, commit_failures=1, quorum_id=1), CommitActions(False, True, False))),
]


@pytest.mark.parametrize("name,decision,local,errored,n,max_retries,before,expected", VOTE_CASES,
                         ids=[c[0] for c in VOTE_CASES])
def test_on_vote(name, decision, local, errored, n, max_retries, before, expected):
    assert rules.on_vote(before, decision, local=local, errored=errored, num_participants=n,
                         max_retries=max_retries) == expected


@pytest.mark.parametrize("vote_world,min_size,errored,expected", [
    (2, 2, False, True), (1, 2, False, False), (3, 2, True, False), (0, 1, False, False),
])
def test_local_vote(vote_world, min_size, errored, expected):
    assert rules.local_vote(vote_world, min_size, errored) is expected


@pytest.mark.parametrize("rank,healing,use_async,expected", [
    (0, False, True, True), (None, False, True, False), (1, True, True, False), (1, True, False, True),
])
def test_is_participating(rank, healing, use_async, expected):
    assert rules.is_participating(rank, healing, use_async) is expected


def test_group_quorum_id_transitions():
    state = StepState(step=3, quorum_id=1)
    assert rules.on_configured(state, 4) == StepState(step=3, quorum_id=4)
    assert rules.on_configure_failed(state) == StepState(step=3, quorum_id=-1)
    assert rules.on_pg_broken(state) == StepState(step=3, quorum_id=-1)


HEALED = rules.HealTarget(step=9, batches_committed=18)
BEHIND = StepState(step=2, batches_committed=4, commit_failures=1, quorum_id=7)

# One row per scenario of issue 13: (name, decision, local, errored, healed, group_healed, expected state after)
HEAL_CASES = [
    ("heal OK: the healed step is adopted at commit, plus the step committed on top", True, True, False, HEALED, True,
     StepState(step=10, batches_committed=19, commit_failures=0, quorum_id=7, commit_quorum_id=7)),  # 1 participant
    ("load failed: the rank votes no, keeps its pre-heal step and heals again", False, False, True, None, False,
     StepState(step=2, batches_committed=4, commit_failures=2, quorum_id=7)),
    ("skipped step (no should_commit): nothing is adopted; the next quorum heals again", None, None, None, None, None,
     BEHIND),
    ("partial heal in a 2-rank group: the loaded rank keeps its step, its peer's load failed", False, True,
     False, HEALED, False, StepState(step=2, batches_committed=4, commit_failures=2, quorum_id=7)),
    ("heal loaded on every rank but too few participants to commit: the healed step is adopted, no step on top",
     False, False, False, HEALED, True, StepState(step=9, batches_committed=18, commit_failures=2, quorum_id=7)),
]


@pytest.mark.parametrize("name,decision,local,errored,healed,group_healed,expected", HEAL_CASES,
                         ids=[c[0] for c in HEAL_CASES])
def test_a_healed_step_is_adopted_only_when_every_rank_of_the_group_loaded_it(name, decision, local, errored, healed,
                                                                              group_healed, expected):
    if decision is None:  # the loop never voted: the state is what the quorum left, untouched
        assert BEHIND == expected
        return
    after, _ = rules.on_vote(BEHIND, decision, local=local, errored=errored, num_participants=1, max_retries=None,
                             healed=healed, group_healed=group_healed)
    assert after == expected


def test_a_rank_that_has_not_loaded_its_heal_votes_no():
    assert rules.local_vote(2, 1, errored=False, heal_loaded=False) is False
    assert rules.local_vote(2, 1, errored=False, heal_loaded=True) is True


def test_a_fetched_checkpoint_for_another_step_or_malformed_is_refused():
    assert rules.heal_target({"step": 4, "batches_committed": 8}, 4, "g1") == rules.HealTarget(4, 8)
    with pytest.raises(CheckpointError, match="for step 3, expected 4"):
        rules.heal_target({"step": 3, "batches_committed": 8}, 4, "g1")
    with pytest.raises(CheckpointError, match="malformed"):
        rules.heal_target({"step": "4"}, 4, "g1")


def test_durable_progress_is_restored():
    assert rules.restore(BEHIND, {"step": 9, "batches_committed": 18}) == \
        StepState(step=9, batches_committed=18, commit_failures=1, quorum_id=7)


@pytest.mark.parametrize("participating,errored,expected", [
    (True, False, Contribution.OWN),
    ("sync-mode healer whose fetch failed (counted in the divisor)", True, Contribution.BREAK),
    (False, False, Contribution.IDENTITY),  # healer or spare
    (False, True, Contribution.IDENTITY),  # async healer whose fetch failed: not counted, peers go on
])
def test_what_a_group_contributes(participating, errored, expected):
    assert rules.contribution(bool(participating), errored) is expected


INF = float("inf")


@pytest.mark.parametrize("op,dtype,identity", [
    (ReduceOp.SUM, torch.float32, 0), (ReduceOp.AVG, torch.float32, 0), (ReduceOp.PRODUCT, torch.float32, 1),
    (ReduceOp.MAX, torch.float32, -INF), (ReduceOp.MIN, torch.float32, INF),
    (ReduceOp.MAX, torch.int64, torch.iinfo(torch.int64).min), (ReduceOp.MIN, torch.int32, torch.iinfo(torch.int32).max),
    (ReduceOp.MAX, torch.uint8, 0), (ReduceOp.BAND, torch.int64, -1), (ReduceOp.BAND, torch.uint8, 255),
    (ReduceOp.BOR, torch.int64, 0), (ReduceOp.BXOR, torch.int64, 0), (ReduceOp.MAX, torch.bool, False),
])
def test_non_participants_send_the_identity_of_the_op(op, dtype, identity):
    value = rules.fill_value(op, dtype)
    assert value == identity
    # MAX of [-5, -7] with a healer beside them is -5, not 0
    if op == ReduceOp.MAX and dtype == torch.float32:
        assert max(-5.0, -7.0, value) == -5.0


def test_an_op_without_an_identity_is_refused():
    with pytest.raises(ConfigError, match="no identity"):
        rules.fill_value(ReduceOp.BAND, torch.float32)


@pytest.mark.parametrize("groups,reductions,refused", [(2, 0, True), (2, 3, False), (1, 0, False), (0, 0, False)])
def test_a_step_of_several_groups_without_a_cross_group_reduction_is_refused(groups, reductions, refused):
    error = rules.unreduced_step(groups, reductions)
    assert (error is not None) is refused
    if refused:
        assert "no cross-group reduction" in str(error) and "DistributedDataParallel" in str(error)


def test_a_commit_records_its_quorum_and_a_heal_adopts_the_source_s_fork():
    """The fork a step is on travels with it: a commit stamps the quorum id, a heal adopts the source's."""
    committed, _ = rules.on_vote(StepState(step=4, quorum_id=12), True, local=True, errored=False, num_participants=2,
                                 max_retries=None)
    assert committed.commit_quorum_id == 12
    target = rules.heal_target({"step": 9, "batches_committed": 18, "commit_quorum_id": 11}, 9, "g1")
    healed_only, _ = rules.on_vote(BEHIND, False, local=False, errored=False, num_participants=1, max_retries=None,
                                   healed=target, group_healed=True)
    assert (healed_only.step, healed_only.commit_quorum_id) == (9, 11)


# ---- redoing a step that lost a peer (ft_core.redo) ---------------------------------------------------

REDO_BIT_CASES = [
    # name, enabled, redone, errored, peer_errors_only, recoverable, participating, expected
    ("a participant that lost a peer and holds every input redoes", True, False, True, True, True, True, True),
    ("redo turned off (FT_REDO_STEP=0): the step fails as before", False, False, True, True, True, True, False),
    ("already redone once this step: no second redo", True, True, True, True, True, True, False),
    ("nothing failed: nothing to redo", True, False, False, True, True, True, False),
    ("another error too (heal load, user error): not redone", True, False, True, False, True, True, False),
    ("a reduction was sent before the loss and no copy was kept", True, False, True, True, False, True, False),
    ("a healer or spare (its inputs were the op's identity): not redone", True, False, True, True, True, False,
     False),
]


@pytest.mark.parametrize("name,enabled,redone,errored,peer_only,recoverable,participating,expected", REDO_BIT_CASES,
                         ids=[c[0] for c in REDO_BIT_CASES])
def test_the_redoable_bit(name, enabled, redone, errored, peer_only, recoverable, participating, expected):
    assert rules.can_redo(enabled=enabled, redone=redone, errored=errored, peer_errors_only=peer_only,
                          recoverable=recoverable, participating=participating) is expected


def redo_result(ids, *, max_step=5, max_world=None, heal=False, commit_failures=0, max_replica_rank=0, redo=1):
    """The redo quorum's result; `redo`: the attempt every member redoes (0: some member does not), where this
    group's attempt ran in quorum 1 (AT_Q1)."""
    res = result(quorum_id=2, world=len(ids), max_step=max_step, max_world=len(ids) if max_world is None else max_world,
                 heal=heal, max_replica_rank=max_replica_rank)
    return QuorumResult(**{**res.__dict__, "replica_ids": list(ids), "commit_failures": commit_failures,
                           "redo_quorum_id": redo})


OLD = ("a", "b", "c")
R, A = rules.RedoRole.REPLAY, rules.RedoRole.ABANDON
REDO_ROLE_CASES = [
    # name, state, new quorum, expected
    ("the survivors, all redoing this attempt at this step: replay", AT_Q1, redo_result(("a", "b")), R),
    ("the same members (a failed collective, nobody lost): replay", AT_Q1, redo_result(OLD), R),
    ("a newcomer (a restarted group has a new id) would pair a fresh step with the replay", AT_Q1,
     redo_result(("a", "b", "c2"), redo=0), A),
    ("a peer committed the step (it is ahead): this group is behind, abandon and heal next quorum",
     AT_Q1, redo_result(("a", "b"), max_step=6, max_world=1, max_replica_rank=None, heal=True, redo=0), A),
    ("a survivor is behind (it was healing): abandon", AT_Q1, redo_result(("a", "b"), max_world=1, redo=0), A),
    ("a survivor counted a failure (it gave up and runs a fresh step): abandon", AT_Q1,
     redo_result(("a", "b"), commit_failures=1, redo=0), A),
    ("everyone redoes this attempt, all with the same older failure count: replay",
     StepState(step=5, commit_failures=2, quorum_id=1), redo_result(("a", "b"), commit_failures=2), R),
    # The bounded chaos run of 2026-12-06 (seed 20793): a group that had failed as often as ours gave up on the
    # attempt and ran a fresh one; the old rule (no member counts more failures than we do) replayed into it.
    ("a survivor gave up and runs a fresh attempt with as many failures as ours (other history): abandon",
     StepState(step=5, commit_failures=2, quorum_id=-1), redo_result(("a", "b"), commit_failures=2, redo=0), A),
    ("a survivor redoes another attempt of this step: abandon", AT_Q1, redo_result(("a", "b"), redo=7), A),
]


@pytest.mark.parametrize("name,state,res,expected", REDO_ROLE_CASES, ids=[c[0] for c in REDO_ROLE_CASES])
def test_the_role_in_the_redo_quorum(name, state, res, expected):
    assert rules.redo_role(state, res, OLD, 1) is expected


def test_a_group_that_redoes_no_attempt_never_replays():
    assert rules.redo_role(AT_Q1, redo_result(("a", "b"), redo=0), OLD, 0) is A


@pytest.mark.parametrize("old, lost, min_size, expected", [
    (("a", "b", "c"), set(), 2, True),  # one of three lost (which one is not known yet): two can commit
    (("a", "b", "c"), {"c"}, 2, True),
    (("a", "b", "c"), {"b", "c"}, 2, False),  # one survivor: the shrink-only quorum could only time out
    (("a", "b"), set(), 2, False),  # two groups, min 2: a loss leaves one
    (("a", "b"), set(), 1, True),
    (("a",), set(), 1, False),  # alone: nobody to redo with
], ids=["3-groups-none-known", "3-groups-one-known", "3-groups-two-lost", "2-groups-min-2", "2-groups-min-1", "alone"])
def test_a_redo_is_tried_only_when_the_survivors_can_commit_the_step(old, lost, min_size, expected):
    assert rules.survivors_can_commit(old, lost, min_size) is expected


def test_a_redone_step_commits_with_the_new_participant_count():
    state, actions = rules.on_vote(AT_Q1, True, local=True, errored=False, num_participants=2, max_retries=None)
    assert (state.step, state.batches_committed, state.commit_failures) == (6, 12, 0) and actions.committed
