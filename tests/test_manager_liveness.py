"""Liveness of the Manager: a SIGKILLed group never stalls the survivors until their timeout, a group
that skips its collectives releases its peers, and shutdown() leaves no thread or server behind."""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from ft_harness import Group, check_step_digests, commit_gaps, read_jsonl, stop_all, wait_until
from test_manager import run_groups

from ft_core import futures as ft_futures
from ft_core.control.lighthouse import LighthouseServer
from ft_core.manager import Manager
from ft_core.process_groups import ProcessGroupGloo

# The default timeout: a survivor stuck in a collective with the dead group would stall for 60 s.
DEFAULT_TIMEOUT = ["--timeout", "60", "--quorum-timeout", "60", "--step-sleep", "0.02"]


def ft_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("ft-") and t.is_alive()}


def commits_between(group: Group, start: float, end: float) -> list[dict[str, Any]]:
    return [c for c in group.commits() if start <= c["time"] <= end]


@pytest.mark.timeout(300)
def test_survivors_never_wait_for_the_timeout_when_a_group_is_sigkilled(processes, tmp_path):
    """Three groups on Gloo with the 60 s default timeout: kill one at each point of a step. The
    survivors' longest gap between commits stays far under the timeout (under 3 s; the figure, 0.2 s on a quiet machine, is benchmarks/heal.py's), at the death and at the rejoin."""
    with LighthouseServer(min_replicas=1, join_timeout_ms=2000) as lighthouse:
        groups = [Group(processes, str(tmp_path), g, 3, lighthouse.address(),
                        args=["--steps", "1000000", *DEFAULT_TIMEOUT]) for g in range(3)]
        for g in groups:
            g.start()
        wait_until(lambda: all(len(g.commits()) >= 3 for g in groups), 120, "every group committing", groups)
        victim, survivors = groups[1], [groups[0], groups[2]]
        windows = []
        for point in ("forward", "allreduce", "should_commit", "allreduce", "allreduce"):
            start = time.time()
            victim.arm_kill(point)
            assert victim.wait_exit(60) == -9, victim.output()[-2000:]
            assert f"during {point}" in victim.output()
            dead = time.time()
            wait_until(lambda dead=dead: all(len(commits_between(g, dead, 1e12)) >= 3 for g in survivors), 30,
                       f"survivors committing after the kill during {point}", groups)
            victim.start()
            wait_until(lambda: len(victim.commits()) >= 3, 120, f"group 1 rejoining after {point}", groups)
            rejoined = victim.commits()[0]["time"]
            wait_until(lambda t=rejoined: all(len(commits_between(g, t, 1e12)) >= 3 for g in survivors), 30,
                       "survivors committing with the rejoined group", groups)
            windows.append((point, start, time.time()))
        stop_all(groups)

    for point, start, end in windows:
        for g in survivors:
            times = [c["time"] for c in commits_between(g, start, end)]
            gap = max(b - a for a, b in itertools.pairwise(times))
            # far under the 60 s timeout a survivor would wait out; the figure itself is benchmarks/heal.py's
            assert gap < 3.0, f"group {g.group_id}: {gap:.2f}s without a commit around the kill during {point}"


def group0_fails_its_third_step(manager: Manager, i: int, grad: torch.Tensor, asks_next_quorum: bool) -> float:
    """Two steps that both groups commit, then the third quorum. Group 0 fails that step itself (a skipped
    backward: it reports the error and votes), then, with `asks_next_quorum`, asks its next quorum at once, as a
    loop does; group 1 returns at once to issue its reduction. Returns when the third step started."""
    for _ in range(2):
        manager.start_quorum()
        manager.allreduce(grad.clone()).wait()
        assert manager.should_commit()
    manager.start_quorum()
    started = time.monotonic()
    if i == 0:
        manager.wait_quorum()
        manager.report_error(RuntimeError("the loss was NaN; skipping this step's backward"))
        assert not manager.should_commit(), "group 0 failed its own step"
        if asks_next_quorum:
            manager.start_quorum()
    return started


@pytest.mark.timeout(120)
@pytest.mark.parametrize("asks_next_quorum", [True, False], ids=["next-quorum-at-once", "no-quorum-asked"])
def test_a_group_that_skips_its_collectives_releases_its_peers_at_its_failed_commit(asks_next_quorum):
    """Group 0 fails before its allreduce (report_error); group 1 is left waiting in that allreduce.
    Group 0's failed commit aborts its process group, so group 1 fails now, not at its 30 s timeout.
    Group 1 can redo the reduction (its small input is kept: ft_core.redo_log.KEEP_SMALL_BYTES), so it
    forms the quorum again. Group 0 will not redo: its failed commit tells the lighthouse so (quorum rule 11),
    and with min_replicas 2 no redo can form without it, so group 1's redo is answered at once and its step fails,
    whether group 0 asks its next quorum at once or none for a while (before 2026-12-07 the latter held group 1's
    redo until its 30 s quorum timeout)."""
    timeout = timedelta(seconds=30)
    group1_done = threading.Event()  # group 0 stays up (its process group open) until then
    with LighthouseServer(min_replicas=2, join_timeout_ms=5000) as lighthouse:

        def body(manager: Manager, i: int) -> Any:
            grad = torch.ones(4)
            started = group0_fails_its_third_step(manager, i, grad, asks_next_quorum)
            if i == 0:
                group1_done.wait(timeout.total_seconds() + 10)
                return False, time.monotonic() - started
            manager.allreduce(grad).wait()
            group1_done.set()
            return manager.should_commit(), time.monotonic() - started

        results = run_groups(2, lighthouse, body, setup=lambda i: {"pg": ProcessGroupGloo(timeout=timeout)},
                             timeout=timeout, quorum_timeout=timeout)
    (_, _), (committed1, waited1) = results
    assert not committed1
    assert waited1 < timeout.total_seconds() / 3, f"group 1 waited {waited1:.1f}s for a collective group 0 skipped"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("asks_next_quorum", [False, True], ids=["no-quorum-asked", "next-quorum-at-once"])
def test_a_survivor_redoes_its_step_without_a_peer_that_gave_up_that_step(asks_next_quorum):
    """As above with min_replicas 1: group 0 fails its own step; group 1's reduction failed with group 0's
    process group. Group 0's failed commit tells the lighthouse it will not redo that step (quorum rule 11), so
    group 1 redoes it alone at once and commits it, whether group 0 asks no quorum for a while or its next one at
    once (that request waits for the next decision). Before 2026-12-07 group 1's redo waited for group 0: to its
    30 s quorum timeout, or until group 0's next quorum abandoned it; group 1's step failed either way. At the next
    step group 0 heals from group 1, and both hold the same state."""
    timeout = timedelta(seconds=30)
    group1_done = threading.Event()
    together = threading.Barrier(2, timeout=60)
    with LighthouseServer(min_replicas=1, join_timeout_ms=5000) as lighthouse:

        def body(manager: Manager, i: int) -> Any:
            grad = torch.ones(4) * (i + 1)
            # both heartbeat before either asks, so their first quorum is joint
            wait_until(lambda: len(lighthouse.core.status()["members"]) == 2, 30, "both groups heartbeating")
            together.wait()
            started = group0_fails_its_third_step(manager, i, grad, asks_next_quorum)
            if i == 0:
                group1_done.wait(timeout.total_seconds() + 10)
                committed, reduced = False, None
            else:
                reduced = grad.clone()
                manager.allreduce(reduced).wait()
                committed = manager.should_commit()
                group1_done.set()
                # Group 1 alone was the last quorum, so it would get its next one alone at once and run ahead; a
                # loop's group 0 would ask its next quorum before that, as here
                wait_until(lambda: any(m["replica_id"].startswith("r0:") and m["waiting"]
                                       for m in lighthouse.core.status()["members"]), 30, "group 0 asking its quorum")
            waited = time.monotonic() - started
            if i == 1 or not asks_next_quorum:
                manager.start_quorum()  # the next step: group 0 heals from group 1
            manager.allreduce(grad.clone()).wait()
            assert manager.should_commit()
            together.wait()  # group 1 serves group 0's heal until group 0 has it
            return committed, waited, reduced, manager.current_step()

        results = run_groups(2, lighthouse, body, setup=lambda i: {"pg": ProcessGroupGloo(timeout=timeout)},
                             timeout=timeout, quorum_timeout=timeout, min_replica_size=1)
    (_, _, _, step0), (committed1, waited1, reduced1, step1) = results
    assert committed1, "group 1 redid its step alone and committed it"
    assert waited1 < timeout.total_seconds() / 3, f"group 1 waited {waited1:.1f}s for a group that gave up the step"
    assert reduced1.tolist() == [2.0] * 4, "the redone reduction holds group 1's own value alone"
    assert step0 == step1 == 4, "group 0 healed from group 1 and both committed the next step"


@pytest.mark.timeout(120)
def test_shutdown_ends_every_thread_and_server_it_started():
    """After a heal (manager server handlers, heal-source client, transport, timer all used),
    Manager.shutdown() + pg.shutdown() leave no ft-* thread alive."""
    before = ft_threads() - {"ft-timer"}  # e.g. another test's process group still open
    with LighthouseServer(min_replicas=2, join_timeout_ms=5000) as lighthouse:
        models = {i: torch.nn.Linear(4, 2) for i in range(2)}

        def setup(i: int) -> dict[str, Any]:
            return {"load_state_dict": models[i].load_state_dict, "state_dict": models[i].state_dict}

        def body(manager: Manager, i: int) -> int:
            if i == 0:
                manager.load_state_dict({"step": 3, "batches_committed": 3})  # group 1 heals from group 0
            for _ in range(3):
                manager.start_quorum()
                manager.allreduce(torch.ones(3)).wait()
                assert manager.should_commit()
            return manager.current_step()

        assert run_groups(2, lighthouse, body, setup=setup) == [6, 6]
    left = ft_threads() - before
    assert not left, f"threads still alive after shutdown: {sorted(left)}"
    # the timer comes back on demand
    fired = threading.Event()
    ft_futures.schedule(0.01, fired.set)
    assert fired.wait(5)
    assert ft_futures.stop_timer_if_idle(5) and "ft-timer" not in ft_threads()


@pytest.mark.timeout(120)
def test_train_ddp_process_exits_promptly_after_manager_shutdown(processes, tmp_path):
    with LighthouseServer(min_replicas=1, join_timeout_ms=1000) as lighthouse:
        group = Group(processes, str(tmp_path), 0, 1, lighthouse.address(), args=["--steps", "3", "--timeout", "60"])
        proc = group.start()
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        exited = time.time()
    assert proc.returncode == 0, group.output()[-3000:]
    shutdown = [r for r in read_jsonl(group.path("steps.jsonl", rank="0")) if r.get("event") == "shutdown"]
    assert shutdown, group.output()[-3000:]
    # the bound is issue 13's (< 5 s with defaults); it is well under a second on an idle machine (benchmarks)
    assert exited - shutdown[0]["time"] < 5.0, f"exited {exited - shutdown[0]['time']:.2f}s after shutdown"


@pytest.mark.timeout(90)
def test_a_heal_from_a_source_that_died_after_the_quorum_fails_within_the_heal_timeout():
    """The restarted group's heal source was SIGKILLed after the quorum named it: nothing listens at its manager
    server's address. The fetch fails within the heal timeout (5 s here), not the 60 s connect_timeout (the
    manager-processes kill test's restarted group sat out a whole minute this way, 2026-12-02)."""
    from conftest import assert_bounded

    from ft_core.control.recovery import QuorumResult
    from ft_core.errors import FTError
    from ft_core.healing import HealSources
    from ft_core.tools.launcher import free_port

    dead = f"127.0.0.1:{free_port()}"  # nothing listens there: the source is gone
    plan = QuorumResult(quorum_id=5, replica_rank=1, replica_world_size=3, recover_src_manager_address=dead,
                        recover_src_replica_rank=0, max_step=368, heal=True)
    sources = HealSources(connect_timeout=timedelta(seconds=60), token=None)
    started = time.monotonic()
    try:
        with pytest.raises(FTError, match=dead):
            sources.fetch(plan, 0, transport=None, timeout=timedelta(seconds=5))
    finally:
        sources.close()
    assert_bounded(started, 5.0, "a heal from a dead source")  # not the 60 s connect_timeout


@pytest.mark.timeout(90)
def test_a_heal_is_abandoned_when_the_lighthouse_says_a_member_of_its_quorum_is_lost():
    """A PeerLost notice for the heal's quorum ends its wait for the dead source at once (the step fails anyway),
    whether it comes during the connect or before the heal starts; a notice of another quorum changes nothing."""
    from ft_core.control.recovery import QuorumResult
    from ft_core.errors import FTError
    from ft_core.healing import HealSources
    from ft_core.tools.launcher import free_port

    dead = f"127.0.0.1:{free_port()}"  # nothing listens there: the source is gone
    plan = QuorumResult(quorum_id=5, replica_rank=1, replica_world_size=3, recover_src_manager_address=dead,
                        recover_src_replica_rank=0, max_step=368, heal=True, replica_ids=["0:a", "1:b", "2:c"])
    sources = HealSources(connect_timeout=timedelta(seconds=60), token=None)
    try:
        notice = threading.Timer(0.3, sources.lost, args=(5, "0:a"))  # while the fetch retries the connect
        notice.start()
        with pytest.raises(FTError, match="heal source replica group 0:a of quorum 5 was lost"):
            sources.fetch(plan, 0, transport=None, timeout=timedelta(seconds=60))
        notice.join()
        sources.forget(5, "0:a")  # the quorum thread's run that heard it ended
        sources.lost(5, "2:c")  # another member, heard before this run's heal starts
        with pytest.raises(FTError, match="^replica group 2:c of quorum 5 was lost"):
            sources.fetch(plan, 0, transport=None, timeout=timedelta(seconds=60))
        sources.forget(5, "2:c")  # a notice of another quorum leaves the next heal alone
        sources.lost(4, "0:a")
        with pytest.raises(FTError, match=f"could not connect to {dead}"):
            sources.fetch(plan, 0, transport=None, timeout=timedelta(seconds=1))
    finally:
        sources.close()


@pytest.mark.timeout(150)
def test_a_healer_whose_source_dies_before_it_connects_is_released_by_the_notice_and_stalls_no_survivor(
        processes, tmp_path):
    """g1 restarts and heals from g0, which dies just after staging the checkpoint, before g1 (slow to start
    its fetch here, as a restarted process is on a busy machine) connects. The lighthouse's notice that g0 is
    lost ends g1's heal at once. Before, the notice waited for the quorum thread, which retried the dead
    source until the heal timeout; g2's next quorum needs g1 (more than half of the healthy replicas), so g2
    went that long without a commit (full suite, 2026-12-03: 5.20 s with a 5 s timeout). Then g2's redo
    quorum names g2 as g1's source: g2 abandons the redo (g1 heals) but must still stage its state, else g1
    waits for it to the heal timeout a second time (10.9 s in all before)."""
    fast = ["--timeout", "5", "--quorum-timeout", "20", "--step-sleep", "0.02"]
    with LighthouseServer(min_replicas=1, join_timeout_ms=2000) as lighthouse:
        groups = [Group(processes, str(tmp_path), g, 3, lighthouse.address(), args=["--steps", "1000000", *fast])
                  for g in range(3)]
        for g in groups:
            g.start()
        wait_until(lambda: all(len(g.commits()) >= 3 for g in groups), 90, "every group committing", groups)
        g0, g1, g2 = groups
        g1.arm_kill("forward")
        assert g1.wait_exit(30) == -9
        g0.arm_kill("send_checkpoint")
        g1.start(extra=["--heal-delay", "0.5"])
        assert g0.wait_exit(60) == -9, g0.output()[-2000:]
        wait_until(lambda: len(g1.commits()) >= 3, 60, "g1 to heal from g2 and commit", groups)
        stop_all([g1, g2])

    g0_id = g0.events(1)[0]["replica_id"]
    events = g1.events(2)
    errors = [e["message"] for e in events if e["type"] == "error"]
    # The step records its first error only: the notice's, for the heal or (on a busy machine, where g0 dies
    # before g1's process group is built; busy suite, 2026-12-07) for that configure, or (where g0's death
    # fails the step's allreduce before the notice arrives; busy suite, 2026-12-05) that allreduce's. Any
    # way the heal from g0 ends at once, far under the 5 s heal timeout it waited out before.
    assert any((f"heal source replica group {g0_id}" in m and "was lost" in m)
               or (f"replica group {g0_id} of quorum" in m and "was lost while configuring" in m)
               or "ft-gloo allreduce" in m for m in errors[:1]), errors
    quorum_at = next(e["time"] for e in events if e["type"] == "quorum")
    voted_at = next(e["time"] for e in events if e["type"] == "commit")
    assert voted_at - quorum_at < 3.0, f"g1's step with the dead heal source took {voted_at - quorum_at:.2f}s"
    check_step_digests([g1, g2])
    gap = commit_gaps(g2.commits())
    # far under the 5 s heal timeout g2 waited out before (the figure itself is benchmarks/heal.py's)
    assert gap < 3.0, f"group 2: {gap:.2f}s between commits"


@pytest.mark.timeout(120)
def test_a_notice_for_the_quorum_being_configured_releases_the_quorum_thread_at_once():
    """Group 1 is in the quorum but never joins the Gloo rendezvous (its group is a dummy), so group 0's quorum
    thread waits in configure for the 30 s timeout. The lighthouse's notice that group 1 is lost, as
    ft_core.redo.on_peer_lost receives it, ends that configure now: group 0's wait_quorum returns within a few
    seconds of the notice, with the notice as its error, and its step does not commit."""
    from conftest import assert_bounded

    from ft_core import redo
    from ft_core.process_groups import ProcessGroupDummy

    timeout = timedelta(seconds=30)
    managers: dict[int, Manager] = {}
    noticed: list[float] = []
    with LighthouseServer(min_replicas=2, join_timeout_ms=5000) as lighthouse:

        def body(manager: Manager, i: int) -> Any:
            managers[i] = manager
            manager.start_quorum()
            if i == 1:
                manager.wait_quorum()  # the dummy group configures at once
                time.sleep(0.5)  # group 0 is in its rendezvous by now
                noticed.append(time.monotonic())
                redo.on_peer_lost(managers[0], manager._state.quorum_id, "r1")  # the lighthouse's PeerLost notice
                return None
            manager.wait_quorum()
            assert_bounded(noticed[0], 3.0, "group 0's quorum after the notice")  # not the 30 s timeout
            return manager.should_commit(), str(manager.errored())

        pgs = {0: ProcessGroupGloo(timeout=timeout), 1: ProcessGroupDummy()}
        (committed, error), _ = run_groups(2, lighthouse, body, setup=lambda i: {"pg": pgs[i]},
                                           timeout=timeout, quorum_timeout=timeout, init_sync=False)
    assert not committed
    assert "replica group r1 of quorum" in error and "was lost while configuring" in error, error
    assert not [t for t in threading.enumerate() if t.name == "ft-gloo-configure"]
