"""Heals beside the step (async quorum, HTTP transport): a healer sends the identity whatever its state, so
the step's collectives wait neither for the source's staging nor for the healer's transfer; each vote waits
for its own part (docs/guarantees.md, "Heals beside the step")."""

from __future__ import annotations

import pytest
from ft_harness import Group, check_step_digests, stop_all, wait_until

from ft_core.control.lighthouse import LighthouseServer

HEAL_DELAY_S = 4.0  # the restarted group's fetch starts this late (as on a busy machine, or a slow link)


@pytest.mark.timeout(150)
def test_the_survivors_step_that_admits_a_healer_commits_without_waiting_for_its_transfer(processes, tmp_path):
    """g1 is killed and restarted; its first heal fetch from g0 is held back HEAL_DELAY_S. g0 commits the step
    of the quorum that admits g1 meanwhile (before, that step's reductions waited for g1's, which waited for
    the fetch, so g0 committed nothing for HEAL_DELAY_S); the next quorum waits for g1's vote, as a quorum
    waits for every healthy member. Then g1 loads what it fetched, commits, and every step has one digest."""
    args = ["--steps", "1000000", "--timeout", "10", "--step-sleep", "0.02"]
    with LighthouseServer(min_replicas=1, join_timeout_ms=2000) as lighthouse:
        g0, g1 = groups = [Group(processes, str(tmp_path), g, 2, lighthouse.address(), args=args) for g in range(2)]
        for g in groups:
            g.start()
        wait_until(lambda: all(len(g.commits()) >= 3 for g in groups), 90, "both groups committing", groups)
        g1.arm_kill("forward")
        assert g1.wait_exit(30) == -9
        g1.start(extra=["--heal-delay", str(HEAL_DELAY_S)])
        wait_until(lambda: len(g1.commits()) >= 3, 90, "g1 to heal and commit", groups)
        stop_all(groups)

    joined = next(e for e in g1.events() if e["type"] == "quorum")
    healed = next(e for e in g1.events() if e["type"] == "heal")
    assert joined["heal"] and healed["healed_step"] == joined["max_step"]
    assert healed["time"] - joined["time"] >= HEAL_DELAY_S - 0.5, "the fetch was not held back"
    admitting = next(c for c in g0.commits() if c["step"] == joined["max_step"] + 1)
    waited = admitting["time"] - joined["time"]
    assert waited < HEAL_DELAY_S / 2, (f"g0 committed the step that admitted g1 {waited:.2f}s after g1 joined, "
                                       f"with g1's transfer held back {HEAL_DELAY_S}s: it waited for the transfer")
    check_step_digests(groups)
