"""Replica groups as real processes (examples/train_ddp.py) on loopback, CPU, Gloo: SIGKILL at every
point of a step, restart, heal from a live peer, and bitwise-identical state everywhere."""

from __future__ import annotations

import pytest
from ft_harness import Group, check_step_digests, commit_gaps, stop_all, wait_until

from ft_core.control.lighthouse import LighthouseServer

FAST = ["--timeout", "5", "--quorum-timeout", "20", "--step-sleep", "0.02"]


def started_groups(processes, tmp_path, lighthouse, n: int, args: list[str], nproc: int = 1) -> list[Group]:
    groups = [Group(processes, str(tmp_path), g, n, lighthouse.address(), nproc=nproc,
                    args=["--steps", "1000000", *FAST, *args]) for g in range(n)]
    for g in groups:
        g.start()
    wait_until(lambda: all(g.last_step() >= 3 for g in groups), 90, "every group committing", groups)
    return groups


def restart_after_kill(group: Group, point: str, groups: list[Group]) -> None:
    group.arm_kill(point)
    assert group.wait_exit(30) == -9, group.output()[-2000:]
    group.start()
    wait_until(lambda: len(group.commits()) >= 3, 60, f"group {group.group_id} to heal and commit", groups)


def assert_final_state_identical(groups: list[Group], ranks: int = 1) -> None:
    digests = [d for g in groups for d in g.digests()]
    assert len(digests) == len(groups) * ranks
    assert len({d["digest"] for d in digests}) == 1, digests
    assert len({d["step"] for d in digests}) == 1, digests
    check_step_digests(groups, ranks)


@pytest.mark.timeout(150)
def test_sigkill_at_every_point_of_a_step_then_restart_heals_identical(processes, tmp_path):
    with LighthouseServer(min_replicas=1, join_timeout_ms=2000) as lighthouse:
        groups = started_groups(processes, tmp_path, lighthouse, 3, [])
        g0, g1, g2 = groups
        # forward: g1 dies. When it comes back, g0 (its heal source: the first up-to-date replica id)
        # dies while sending it the checkpoint; g1 then heals from g2, and g0 later from a live peer.
        g1.arm_kill("forward")
        assert g1.wait_exit(30) == -9
        # g0 dies when g1's fetch reaches it, not after a fixed sleep: a fetch of this small state could
        # finish within the sleep, and g1 would heal from g0 before it died
        g0.arm_kill("serve_checkpoint")
        g1.start()
        assert g0.wait_exit(60) == -9, g0.output()[-2000:]
        assert "during serve_checkpoint" in g0.output()
        g0.start()
        wait_until(lambda: len(g0.commits()) >= 3 and len(g1.commits()) >= 3, 60, "g0 and g1 healed", groups)
        # allreduce, then should_commit: g2 dies having issued its allreduce, then g0 dies in its vote; g1
        # carries on alone, then both come back and heal. g0 is armed only once g2 is dead: armed together,
        # g0 could die voting on a step that g2, not yet at its kill point, then committed alone, and g2 die
        # at its next allreduce; that step, held by no live group, is trained again on another history (gap
        # 2, docs/chaos.md; full suite beside nothing else, 2026-12-07: "step 21 differs").
        g2.arm_kill("allreduce")
        assert g2.wait_exit(30) == -9
        g0.arm_kill("should_commit")
        assert g0.wait_exit(30) == -9
        assert "during allreduce" in g2.output() and "during should_commit" in g0.output()
        g0.start()
        g2.start()
        wait_until(lambda: len(g0.commits()) >= 3 and len(g2.commits()) >= 3, 60, "g0 and g2 healed", groups)
        stop_all(groups)

    assert_final_state_identical(groups)
    for g in groups:
        for inc, commits in enumerate(g.all_commits(), start=1):
            steps = [c["step"] for c in commits]
            assert steps == list(range(steps[0], steps[0] + len(steps))), f"group {g.group_id} skipped a step"
            if inc > 1:  # every restart healed from a live peer before its first commit
                assert any(e["type"] == "heal" for e in g.events(inc)), f"group {g.group_id} inc {inc} never healed"
            gap = commit_gaps(commits)
            # well under the 10 s collective timeout a survivor would otherwise wait out; the figure itself
            # (0.2 s quiet) is measured in benchmarks/heal.py, not asserted here (1.35 s seen at load ~8)
            assert gap < 3.0, f"group {g.group_id} incarnation {inc}: {gap:.2f}s between commits"
    # the restarted g1 first failed to heal (its source died mid-transfer), then healed from g2
    assert any(e["type"] == "error" for e in g1.events(2)), "g1 should have seen its heal source die"


@pytest.mark.timeout(120)
def test_two_groups_of_two_ranks_sync_quorum_without_init_sync_stay_identical(processes, tmp_path):
    with LighthouseServer(min_replicas=2, join_timeout_ms=30000) as lighthouse:
        groups = started_groups(processes, tmp_path, lighthouse, 2, ["--sync-quorum", "--no-init-sync"], nproc=2)
        stop_all(groups, extra_steps=4)
    assert_final_state_identical(groups, ranks=2)
    for g in groups:
        for rank in range(2):
            assert all(c["participants"] == 2 for c in g.commits(rank=rank))


@pytest.mark.timeout(120)
def test_fixed_with_spares_keeps_the_spare_in_sync(processes, tmp_path):
    with LighthouseServer(min_replicas=3, join_timeout_ms=30000) as lighthouse:
        groups = started_groups(processes, tmp_path, lighthouse, 3, ["--spares", "--min-replicas", "2"])
        stop_all(groups, extra_steps=4)
    assert_final_state_identical(groups)
    quorums = [e for g in groups for e in g.events() if e["type"] == "quorum" and e["max_step"] > 0]
    assert quorums and all(e["num_participants"] == 2 for e in quorums)
    # step 1 came from the init_sync source alone; from then on exactly 2 contribute, the spare follows
    assert all(c["participants"] == 2 for g in groups for c in g.commits() if c["step"] > 1)
