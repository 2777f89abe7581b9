"""The recovery plan (DESIGN.md section 6) as tables: who heals from whom, for each group rank."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_core.errors import QuorumError
from ft_core.control.recovery import QuorumResult, compute_recovery_plan
from ft_core.control.types import Quorum, QuorumMember


def make_quorum(steps: list[int], quorum_id: int = 7, commit_failures: list[int] | None = None,
                order: list[int] | None = None) -> Quorum:
    """Replicas replica_0.. at the given steps; manager address m<i>, store s<i>."""
    failures = commit_failures or [0] * len(steps)
    members = [QuorumMember(replica_id=f"replica_{i}", address=f"m{i}", store_address=f"s{i}", step=step,
                            commit_failures=failures[i]) for i, step in enumerate(steps)]
    if order is not None:
        members = [members[i] for i in order]
    return Quorum(quorum_id=quorum_id, participants=tuple(members))


def plans(steps: list[int], group_rank: int, init_sync: bool = True) -> list[QuorumResult]:
    quorum = make_quorum(steps)
    return [compute_recovery_plan(f"replica_{i}", group_rank, quorum, init_sync) for i in range(len(steps))]


# (steps, group_rank, init_sync, {healer: source}, {source: [destinations]})
HEAL_VECTORS = [
    pytest.param([0, 1, 0, 1, 0], 0, True, {0: 1, 2: 3, 4: 1}, {1: [0, 4], 3: [2]}, id="design-vector-rank0"),
    pytest.param([0, 1, 0, 1, 0], 1, True, {0: 3, 2: 1, 4: 3}, {1: [2], 3: [0, 4]}, id="design-vector-rank1"),
    pytest.param([0, 1, 0, 1, 0], 1, False, {0: 3, 2: 1, 4: 3}, {1: [2], 3: [0, 4]},
                 id="no-init-sync-same-when-max-step-positive"),
    pytest.param([0, 0], 0, True, {1: 0}, {0: [1]}, id="two-at-step-0-init-sync-rank0"),
    pytest.param([0, 0], 1, True, {1: 0}, {0: [1]}, id="two-at-step-0-init-sync-rank1-same-source"),
    pytest.param([0, 0], 0, False, {}, {}, id="two-at-step-0-no-init-sync-nobody-heals"),
    pytest.param([0, 0], 1, False, {}, {}, id="two-at-step-0-no-init-sync-rank1"),
    pytest.param([0, 0, 0, 0], 3, True, {1: 0, 2: 0, 3: 0}, {0: [1, 2, 3]}, id="init-sync-one-source-for-all-rank3"),
    pytest.param([0, 0, 0, 0], 6, True, {1: 0, 2: 0, 3: 0}, {0: [1, 2, 3]}, id="init-sync-one-source-for-all-rank6"),
    pytest.param([5, 5, 5], 2, True, {}, {}, id="all-up-to-date"),
    pytest.param([3], 0, True, {}, {}, id="single-group"),
    pytest.param([0], 0, True, {}, {}, id="single-group-at-step-0"),
    pytest.param([4, 2, 4], 0, True, {1: 0}, {0: [1]}, id="one-behind-rank0"),
    pytest.param([4, 2, 4], 1, True, {1: 2}, {2: [1]}, id="one-behind-rank1"),
    pytest.param([4, 2, 4], 2, True, {1: 0}, {0: [1]}, id="one-behind-rank2-wraps"),
    pytest.param([9, 1, 2, 3], 0, True, {1: 0, 2: 0, 3: 0}, {0: [1, 2, 3]}, id="one-ahead-serves-everyone"),
    pytest.param([1, 0, 0], 0, True, {1: 0, 2: 0}, {0: [1, 2]}, id="init-sync-irrelevant-when-max-step-positive"),
]


@pytest.mark.parametrize(("steps", "group_rank", "init_sync", "heals_from", "sends_to"), HEAL_VECTORS)
def test_heal_sources_and_destinations(steps: list[int], group_rank: int, init_sync: bool,
                                       heals_from: dict[int, int], sends_to: dict[int, list[int]]) -> None:
    results = plans(steps, group_rank, init_sync)
    for i, result in enumerate(results):
        if i in heals_from:
            src = heals_from[i]
            assert result.heal is True
            assert result.recover_src_replica_rank == src
            assert result.recover_src_manager_address == f"m{src}"
        else:
            assert result.heal is False
            assert result.recover_src_replica_rank is None
            assert result.recover_src_manager_address == ""
        assert result.recover_dst_replica_ranks == sends_to.get(i, [])


# (steps, group_rank, expected per replica: (replica_rank, max_replica_rank), max_step, max_world_size, store)
PLACE_VECTORS = [
    pytest.param([0, 1, 0, 1, 0], 0, [(0, None), (1, 0), (2, None), (3, 1), (4, None)], 1, 2, "s1", id="mixed-rank0"),
    pytest.param([0, 1, 0, 1, 0], 1, [(0, None), (1, 0), (2, None), (3, 1), (4, None)], 1, 2, "s3", id="mixed-rank1"),
    pytest.param([0, 1, 0, 1, 0], 2, [(0, None), (1, 0), (2, None), (3, 1), (4, None)], 1, 2, "s1", id="mixed-rank2"),
    pytest.param([0, 0], 1, [(0, 0), (1, 1)], 0, 2, "s1", id="step-0-store-spread-by-rank"),
    pytest.param([7, 7, 7], 4, [(0, 0), (1, 1), (2, 2)], 7, 3, "s1", id="all-equal"),
    pytest.param([2, 8], 0, [(0, None), (1, 0)], 8, 1, "s1", id="one-at-max"),
]


@pytest.mark.parametrize(("steps", "group_rank", "places", "max_step", "max_world_size", "store"), PLACE_VECTORS)
def test_ranks_max_step_and_store(steps: list[int], group_rank: int, places: list[tuple[int, int | None]],
                                  max_step: int, max_world_size: int, store: str) -> None:
    results = plans(steps, group_rank)
    for result, (replica_rank, max_replica_rank) in zip(results, places):
        assert result.quorum_id == 7
        assert result.replica_rank == replica_rank
        assert result.replica_world_size == len(steps)
        assert result.max_replica_rank == max_replica_rank
        assert result.max_step == max_step
        assert result.max_world_size == max_world_size
        assert result.store_address == store  # every group of one group rank rendezvous at the same store
        assert result.replica_ids == [f"replica_{i}" for i in range(len(steps))]


def test_participants_are_sorted_by_replica_id_whatever_the_input_order() -> None:
    quorum = make_quorum([0, 1, 0, 1, 0], order=[4, 2, 0, 3, 1])
    result = compute_recovery_plan("replica_1", 0, quorum, True)
    assert result.replica_ids == [f"replica_{i}" for i in range(5)]
    assert result.replica_rank == 1
    assert result.recover_dst_replica_ranks == [0, 4]


def test_commit_failures_is_the_maximum_over_participants() -> None:
    quorum = make_quorum([3, 3, 3], commit_failures=[0, 4, 1])
    assert compute_recovery_plan("replica_0", 0, quorum, True).commit_failures == 4


def test_replica_missing_from_quorum_is_a_quorum_error_naming_it() -> None:
    with pytest.raises(QuorumError, match="replica_9"):
        compute_recovery_plan("replica_9", 0, make_quorum([1, 1]), True)


def test_empty_quorum_is_a_quorum_error() -> None:
    with pytest.raises(QuorumError):
        compute_recovery_plan("replica_0", 0, Quorum(quorum_id=1), True)


def test_negative_group_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match="group_rank"):
        compute_recovery_plan("replica_0", -1, make_quorum([1]), True)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=8),
       group_rank=st.integers(min_value=0, max_value=9), init_sync=st.booleans())
def test_plans_are_consistent_across_groups(steps: list[int], group_rank: int, init_sync: bool) -> None:
    """Every healer has one up-to-date source, and that source lists it as a destination (and nobody else does)."""
    results = plans(steps, group_rank, init_sync)
    max_step = max(steps)
    force = init_sync and max_step == 0
    for i, result in enumerate(results):
        should_heal = steps[i] != max_step or (force and i != 0)
        assert result.heal == should_heal
        if should_heal:
            src = result.recover_src_replica_rank
            assert src is not None and steps[src] == max_step
            assert i in results[src].recover_dst_replica_ranks
            if force:
                assert src == 0
        senders = [j for j, other in enumerate(results) if i in other.recover_dst_replica_ranks]
        assert senders == ([result.recover_src_replica_rank] if should_heal else [])
        assert not (result.heal and result.recover_dst_replica_ranks)  # a healer never serves


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=2, max_value=8), world=st.integers(min_value=1, max_value=8))
def test_init_sync_at_step_0_every_rank_of_a_group_heals_from_the_same_group(n: int, world: int) -> None:
    """The reference's bug: ranks of one group picked different sources at step 0 and diverged."""
    quorum = make_quorum([0] * n)
    for i in range(1, n):
        sources = {compute_recovery_plan(f"replica_{i}", r, quorum, True).recover_src_replica_rank
                   for r in range(world)}
        assert sources == {0}


def test_a_quorum_of_groups_with_different_numbers_of_ranks_is_rejected_naming_them() -> None:
    members = (QuorumMember(replica_id="a", address="m0", store_address="s0", step=3, world_size=2),
               QuorumMember(replica_id="b", address="m1", store_address="s1", step=3, world_size=1))
    with pytest.raises(QuorumError, match=r"a has 2, b has 1"):
        compute_recovery_plan("a", 0, Quorum(quorum_id=4, participants=members), init_sync=True)


def test_a_group_at_max_step_on_an_older_fork_heals_from_the_latest_one() -> None:
    """Issue 13 (found by the chaos matrix): g0 committed step 146 alone in quorum 38 (its peers' votes
    failed); g1 and g2 later committed their own step 146 in quorum 43. Same step, different state:
    the latest fork is up to date, g0 heals like a group behind."""
    members = (QuorumMember(replica_id="g0", address="m0", store_address="s0", step=146, commit_quorum_id=38),
               QuorumMember(replica_id="g1", address="m1", store_address="s1", step=146, commit_quorum_id=43),
               QuorumMember(replica_id="g2", address="m2", store_address="s2", step=146, commit_quorum_id=43))
    quorum = Quorum(quorum_id=44, participants=members)
    g0, g1, g2 = (compute_recovery_plan(rid, 0, quorum, init_sync=True) for rid in ("g0", "g1", "g2"))
    assert g0.heal and g0.max_replica_rank is None and g0.recover_src_manager_address in ("m1", "m2")
    assert not g1.heal and not g2.heal and g1.max_world_size == 2
    assert sorted(g1.recover_dst_replica_ranks + g2.recover_dst_replica_ranks) == [0]


def _plan_by_scanning(replica_id: str, group_rank: int, quorum: Quorum, init_sync: bool) -> dict:
    """The plan's rule (DESIGN.md section 6) spelled as a direct scan of every participant: the reference the
    per-quorum layout (computed once, shared by every group rank) must agree with."""
    parts = sorted(quorum.participants, key=lambda m: m.replica_id)
    ids = [m.replica_id for m in parts]
    max_step = max(m.step for m in parts)
    fork = max(m.commit_quorum_id for m in parts if m.step == max_step)
    at_max = [m for m in parts if m.step == max_step and m.commit_quorum_id == fork]
    sources = [parts[0]] if init_sync and max_step == 0 else at_max
    healers = [m for m in parts if m not in sources]
    src, dst = None, []
    for i, healer in enumerate(healers):
        source = sources[(i + group_rank) % len(sources)]
        src = source if healer.replica_id == replica_id else src
        if source.replica_id == replica_id:
            dst.append(ids.index(healer.replica_id))
    at_max_ids = [m.replica_id for m in at_max]
    return dict(replica_rank=ids.index(replica_id), heal=src is not None,
                recover_src_replica_rank=ids.index(src.replica_id) if src else None, recover_dst_replica_ranks=dst,
                store_address=at_max[group_rank % len(at_max)].store_address, max_step=max_step,
                max_replica_rank=at_max_ids.index(replica_id) if replica_id in at_max_ids else None,
                max_world_size=len(at_max), replica_ids=ids)


@settings(max_examples=300, deadline=None)
@given(members=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=9),
       group_ranks=st.lists(st.integers(0, 9), min_size=1, max_size=4), init_sync=st.booleans(),
       order=st.randoms())
def test_plans_from_the_shared_layout_match_a_direct_scan(members: list[tuple[int, int]], group_ranks: list[int],
                                                          init_sync: bool, order) -> None:
    """Steps and forks (commit quorum ids) at random, participants in any order, several group ranks planned
    from one quorum object (the layout is computed once and reused): each plan is the rule's."""
    parts = [QuorumMember(f"r{i}", address=f"m{i}", store_address=f"s{i}", step=step, commit_quorum_id=fork)
             for i, (step, fork) in enumerate(members)]
    order.shuffle(parts)
    quorum = Quorum(quorum_id=3, participants=tuple(parts))
    for group_rank in group_ranks:
        for member in parts:
            got = compute_recovery_plan(member.replica_id, group_rank, quorum, init_sync)
            want = _plan_by_scanning(member.replica_id, group_rank, quorum, init_sync)
            assert {k: getattr(got, k) for k in want} == want


def test_a_new_quorum_object_is_planned_afresh_even_with_the_same_id() -> None:
    """The layout is kept per quorum object, not per quorum id: a second quorum 7 with other steps (a restarted
    lighthouse reissuing ids) gets its own plan."""
    first = compute_recovery_plan("replica_0", 0, make_quorum([1, 2]), True)
    second = compute_recovery_plan("replica_0", 0, make_quorum([2, 1]), True)
    assert (first.heal, second.heal) == (True, False)


def test_a_quorum_mixing_group_sizes_fails_every_plan_naming_the_sizes() -> None:
    quorum = Quorum(quorum_id=4, participants=(QuorumMember("a", world_size=2), QuorumMember("b", world_size=1)))
    for rid in ("a", "b"):
        with pytest.raises(QuorumError, match="a has 2, b has 1"):
            compute_recovery_plan(rid, 0, quorum, True)


def test_a_quorum_mixing_what_groups_reduce_fails_every_plan_naming_them() -> None:
    """Groups whose fault-tolerant DDP models differ (QuorumMember.reductions, ft_core.ddp.reductions_digest)
    would run collectives of different sizes; a group that has not wrapped a model yet ("") is no mismatch."""
    mixed = Quorum(quorum_id=4, participants=(QuorumMember("a", reductions="33 values (976b7270)"),
                                              QuorumMember("b", reductions="41 values (7d00600f)"),
                                              QuorumMember("c")))
    for rid in ("a", "b", "c"):
        with pytest.raises(QuorumError, match=r"a reduces 33 values \(976b7270\), b reduces 41 values "
                                              r"\(7d00600f\), c reduces \(not known yet\)"):
            compute_recovery_plan(rid, 0, mixed, True)
    alike = Quorum(quorum_id=5, participants=(QuorumMember("a", reductions="33 values (976b7270)"),
                                              QuorumMember("b", reductions="33 values (976b7270)"), QuorumMember("c")))
    assert [compute_recovery_plan(rid, 0, alike, False).replica_rank for rid in ("a", "b", "c")] == [0, 1, 2]


def test_a_quorum_decoded_from_the_lighthouse_bytes_plans_alike_without_participant_objects() -> None:
    """The member side decodes each quorum to its roster (columns of strings and ints) only: plans and
    replica ids come from it, so a kept quorum holds no object per participant for the cycle collector
    (types.Roster); the participants are decoded when something reads them, and equal the issued ones."""
    import gc

    from ft_core.control.proto import ft_pb2

    issued = Quorum(quorum_id=9, created_unix_ms=5, participants=tuple(
        QuorumMember(f"decoded-{i:03d}", address=f"m{i}", store_address=f"s{i}", step=4 if i % 3 else 3,
                     commit_quorum_id=8) for i in range(300)))
    raw = ft_pb2.LighthouseQuorumResponse(quorum=issued.to_pb()).SerializeToString()
    decoded = Quorum.from_response_bytes(raw)
    assert Quorum.from_response_bytes(raw) is decoded, "members of one process share one decoded quorum"
    for group_rank in (0, 1):
        for rid in ("decoded-000", "decoded-001", "decoded-299"):
            assert compute_recovery_plan(rid, group_rank, decoded, True) == \
                compute_recovery_plan(rid, group_rank, issued, True)
    assert decoded.replica_ids == issued.replica_ids
    gc.collect()
    alive = [o for o in gc.get_objects() if type(o) is QuorumMember and o.replica_id.startswith("decoded-")
             and not any(o is m for m in issued.participants)]
    assert alive == [] and "participants" not in decoded.__dict__
    assert not gc.is_tracked(decoded.roster.replica_ids), "the roster's columns are left out of full collections"
    assert decoded.participants == issued.participants and decoded == issued
