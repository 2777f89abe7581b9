"""Exactly-once data under Accelerate: replica groups running the plain `for epoch in range(N): for batch
in loader:` loop with `FaultTolerancePlugin(exactly_once=True)`, killed and restarted while the ledger of
tests/test_data_ledger.py records every step attempt; the same verdict (each complete epoch's committed,
participating batches cover every index exactly once), a constant global batch, and a job resumed from
`accelerator.save_state` after every group died at once."""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import time

import pytest
from conftest import REPO_ROOT, SLOW
from ft_harness import healthy_members, read_jsonl, wait_until
from test_data_ledger import LedgerGroup, check_ledger, read_ledgers
from test_data_ledger import run_with_kills as ledger_run_with_kills

from ft_core.control.lighthouse import LighthouseServer

WORKER = os.path.join(REPO_ROOT, "tests", "_accelerate_data_worker.py")


def loop_epochs_follow_the_data(tmp_path) -> None:
    """The plain loop's `epoch` is the data's epoch at every step a group trained with weight 1 after its
    first (a healing step still belongs to the pass it started in)."""
    for rows in read_ledgers(tmp_path):
        attempts = [r for r in rows if r["kind"] == "attempt"]
        for r in attempts[1:]:
            if r["valid"]:
                assert r["loop_epoch"] == r["epoch"], r


def run_with_kills(processes, tmp_path, *, kills: int, args: list[str], nproc: int = 1,
                   kill_before_epoch: int, restart_after: float = 0.0) -> list[LedgerGroup]:
    """test_data_ledger's driver, with every step slow (`--step-sleep`) only while kills are still to come:
    an Accelerate restart takes seconds (much more on a loaded machine); every group must then finish."""
    return ledger_run_with_kills(processes, tmp_path, kills=kills, args=args, nproc=nproc,
                                 timeout=800.0 if SLOW else 110.0,
                                 kill_before_epoch=kill_before_epoch, gate_epoch=0,
                                 join_before_epoch=kill_before_epoch + 1, worker=WORKER, restart_after=restart_after)


@pytest.mark.timeout(900 if SLOW else 120)
@pytest.mark.parametrize("variant, kills, extra, nproc", [
    # An Accelerate restart takes 10-40 s on a loaded 2-core machine (spawned workers and torchrun ranks more):
    # these counts fit a test's time there; `ftl chaos` makes the long runs.
    ("one process per group", 4, [], 1),
    ("num_workers=2", 2, ["--workers", "2"], 1),
    ("2 ranks per group", 2, [], 2),
    # the acceptance counts (issue 16: at least 10 kills in each configuration), FT_RUN_SLOW=1
    pytest.param("one process per group, 10 kills", 10, [], 1, marks=pytest.mark.slow),
    pytest.param("num_workers=2, 10 kills", 10, ["--workers", "2"], 1, marks=pytest.mark.slow),
    pytest.param("2 ranks per group, 10 kills", 10, [], 2, marks=pytest.mark.slow),
])
def test_accelerate_ledger_three_groups_with_kills(processes, tmp_path, variant, kills, extra, nproc):
    size, epochs = 240, 5
    # Steps are slow only while kills are to come: 10 restarts of 10-40 s each must fit in the first 4 epochs.
    sleep = "0.5" if kills <= 4 else "2.0"
    run_with_kills(processes, tmp_path, kills=kills, nproc=nproc, kill_before_epoch=epochs - 1,
                   args=["--epochs", str(epochs), "--size", str(size), "--step-sleep", sleep, *extra])
    verdict = check_ledger(tmp_path, size, columns=nproc)
    assert sorted(verdict) == list(range(epochs)), verdict
    assert all(v["lost"] == 0 and v["duplicated"] == 0 for v in verdict.values()), verdict
    loop_epochs_follow_the_data(tmp_path)


@pytest.mark.timeout(120)
def test_accelerate_global_batch_size_trains_exactly_g_samples_per_step_through_1_2_3_participants(
        processes, tmp_path):
    size, g = 240, 12
    run_with_kills(processes, tmp_path, kills=3, kill_before_epoch=4, restart_after=2.0,
                   args=["--epochs", "5", "--size", str(size), "--step-sleep", "0.5", "--global-batch-size", str(g)])
    check_ledger(tmp_path, size)
    files = read_ledgers(tmp_path)
    epoch_of = {r["step"]: r["epoch"] for rows in files for r in rows if r["kind"] == "attempt" and r["rank"] is not None}
    seen: collections.Counter = collections.Counter()
    for rows in files:
        pending = None
        for row in rows:
            if row["kind"] == "attempt":
                pending = row
            elif row["kind"] == "outcome" and pending is not None:
                if row["committed"] and pending["rank"] is not None and all(pending["held"]):
                    last_of_epoch = epoch_of.get(pending["step"] + 1, pending["epoch"] + 1) > pending["epoch"]
                    assert len(pending["consumed"]) == g or (last_of_epoch and len(pending["consumed"]) < g), pending
                    seen[pending["n"]] += 1
                pending = None
    assert {1, 2, 3} <= set(seen), f"participants seen in fully held steps: {dict(seen)}"


def saved_steps(tmp_path, group: int) -> list[int]:
    return sorted(int(p.rsplit("_", 1)[1]) for p in glob.glob(os.path.join(str(tmp_path), "ckpt", f"group{group}",
                                                                                "step_*"))
                  if os.path.exists(os.path.join(p, "fault_tolerance_0.json")))


@pytest.mark.timeout(120)
def test_every_group_killed_at_once_resumes_from_save_state(processes, tmp_path):
    """Kill all three groups at once and restart them with `accelerator.load_state` of their newest
    `save_state`: each resumes at that checkpoint's step (its position and schedule included), and the
    job's history from there loses and repeats nothing, in the epoch it resumed in too."""
    size = 240
    args = ["--epochs", "3", "--size", str(size), "--step-sleep", "0.05", "--save", os.path.join(str(tmp_path), "ckpt"),
            "--save-every", "7", "--resume"]
    with LighthouseServer(min_replicas=3, join_timeout_ms=5000) as lighthouse:
        gs = [LedgerGroup(processes, tmp_path, g, 3, lighthouse.address(), args, worker=WORKER) for g in range(3)]
        try:
            for g in gs:
                g.start()
            deadline = time.monotonic() + 60
            while not all(saved_steps(tmp_path, g.group) and g.outcomes() >= 25 for g in gs):
                assert time.monotonic() < deadline, "no save_state written"
                for g in gs:
                    assert g.proc.poll() is None, g.output()[-3000:]
                time.sleep(0.1)
            for g in gs:
                g.kill()
            resumed = {g.group: saved_steps(tmp_path, g.group)[-1] for g in gs}
            for g in gs:
                g.start()
            for g in gs:
                assert g.proc.wait(timeout=90) == 0, g.output()[-3000:]
        finally:
            for g in gs:
                g.kill()
    for g in gs:
        start = g._rows("start")[0]
        assert start["step"] == resumed[g.group], (start, resumed)
        with open(os.path.join(str(tmp_path), "ckpt", f"group{g.group}", f"step_{resumed[g.group]}",
                               "fault_tolerance_0.json")) as f:
            saved = json.load(f)
        assert saved["manager"]["step"] == resumed[g.group]
    verdict = check_ledger(tmp_path, size)
    assert sorted(verdict) == [0, 1, 2], verdict
    loop_epochs_follow_the_data(tmp_path)
    # The epoch-level schedule ends where an uninterrupted run's does: 3 epochs, 3 steps of gamma 0.9.
    done = [row for g in gs for row in g._rows("done")]
    assert all(abs(d["lr"][0] - 0.01 * 0.9 ** 3) < 1e-12 for d in done), done


def done_row(group: LedgerGroup) -> dict:
    rows = group._rows("done")
    assert rows, group.output()[-3000:]
    return rows[-1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_checkpoint", [True, False], ids=["resumes from the final save_state", "refused"])
def test_a_group_restarted_after_the_job_finished_does_not_retrain_alone(processes, tmp_path, with_checkpoint):
    """Group 1 trains to the end (and save_states there); group 0 is killed midway and restarted only after
    that, with nobody live to heal from. With FT_CHECKPOINT_DIR holding the final save_state it resumes from
    it and ends with group 1's step, data position, schedule and weights (it trains nothing alone);
    without one it exits non-zero saying why."""
    ckpt, gate = os.path.join(str(tmp_path), "ckpt"), os.path.join(str(tmp_path), "slow")
    args = ["--epochs", "3", "--size", "240", "--save", ckpt, "--save-every", "1000"]
    args += ["--save-final"] if with_checkpoint else []
    slow = [*args, "--step-sleep", "0.3", "--gate", gate]  # slow until both have trained (a loaded machine)
    open(gate, "w").close()
    with LighthouseServer(min_replicas=1, join_timeout_ms=500) as lighthouse:
        g0, g1 = (LedgerGroup(processes, tmp_path, g, 2, lighthouse.address(), slow, worker=WORKER) for g in range(2))
        try:
            g0.start()
            g1.start()
            deadline = time.monotonic() + 80
            while not (g0.outcomes() >= 3 and g1.outcomes() >= 3):
                assert time.monotonic() < deadline and g0.proc.poll() is None and g1.proc.poll() is None, \
                    g0.output()[-3000:] + g1.output()[-3000:]
                time.sleep(0.1)
            g0.kill()
            os.remove(gate)
            assert g1.proc.wait(timeout=60) == 0, g1.output()[-3000:]
            g0.args = [*args, "--checkpoint-dir", ckpt]  # the job's save_state folders: group 1's final one, or none
            g0.start()
            code = g0.proc.wait(timeout=80)
        finally:
            g0.kill()
            g1.kill()
    out = g0.output()
    if with_checkpoint:
        assert code == 0, out[-3000:]
        a, b = done_row(g1), done_row(g0)
        assert (b["step"], b["position"], b["lr"], b["weights"]) == (a["step"], a["position"], a["lr"], a["weights"])
        assert "resuming from its checkpoint" in out, out[-3000:]
        attempts = g0._rows("attempt")
        assert all(not r["valid"] for r in attempts), attempts  # nothing trained alone
    else:
        assert code != 0, out[-3000:]
        assert "the job finished at step" in out and "holds no accelerator.save_state checkpoint" in out, out[-3000:]


@pytest.mark.timeout(150)
def test_a_group_killed_mid_reduction_costs_the_accelerate_survivors_no_step(processes, tmp_path):
    """3 groups of the plain Accelerate loop with exactly-once data (redo on by default for groups of one
    rank): group 2 is SIGKILLed while the survivors' reduction of a step all three take part in waits for
    its contribution. The survivors commit every step they attempt (the reduction is redone without it),
    the restarted group heals and finishes with them, every group ends with the same weights, and each
    epoch's committed batches still cover the data exactly once (the redone step gave the dead group's
    batch back). With FT_REDO_STEP=0 the survivors' step of the kill fails (checked by hand)."""
    size, epochs = 240, 2
    with LighthouseServer(min_replicas=2, join_timeout_ms=2_000, heartbeat_timeout_ms=2_000,
                          http_bind=None) as lighthouse:
        # The survivors hold before step 3 until every group is up (all three then take part), and before step 30
        # until the restarted group 2 is up (an Accelerate start takes seconds: they must not finish alone).
        joined, restarted = str(tmp_path / "joined"), str(tmp_path / "restarted")
        survivor_args = ["--epochs", str(epochs), "--size", str(size), "--hold", f"3:{joined}",
                         "--hold", f"30:{restarted}"]
        groups = [LedgerGroup(processes, tmp_path, g, 3, lighthouse.address(), survivor_args, worker=WORKER)
                  for g in range(2)]
        victim = LedgerGroup(processes, tmp_path, 2, 3, lighthouse.address(),
                             ["--epochs", str(epochs), "--size", str(size)], worker=WORKER)
        for g in groups:
            g.start()
        victim.start(["--kill-in-reduction-at-step", "5"])
        def members(group: int) -> set[str]:
            return healthy_members(lighthouse, f"{group}:")

        def group_2_members() -> set[str]:
            return members(2)

        # a Manager heartbeats before its first quorum, which needs the held survivors
        wait_until(lambda: all(members(g) for g in range(3)), 90, "every group's Manager")
        open(joined, "w").close()
        assert victim.proc.wait(timeout=90) == -9
        with open(os.path.join(str(tmp_path), "g2.i1.out")) as f:
            kill_step = int(re.search(r"SIGKILL self in the reduction of step (\d+)", f.read()).group(1))
        assert kill_step < 30
        before = group_2_members()
        victim.start()
        wait_until(lambda: group_2_members() - before, 90, "the restarted group's Manager")
        open(restarted, "w").close()
        for g in (*groups, victim):
            assert g.proc.wait(timeout=90) == 0, open(os.path.join(str(tmp_path), f"g{g.group}.i{g.incarnation}.out")).read()[-3000:]
    for g in groups:
        failed = [r for r in read_jsonl(g.ledger(rank=0)) if r.get("kind") == "outcome" and not r["committed"]]
        assert not failed, (g.group, failed)
    done = [r for g in (*groups, victim) for r in read_jsonl(g.ledger(rank=0)) if r.get("kind") == "done"]
    assert len(done) == 3 and len({(r["step"], r["weights"]) for r in done}) == 1, done
    verdict = check_ledger(tmp_path, size)
    assert sorted(verdict) == list(range(epochs)), verdict
    assert all(v["lost"] == 0 and v["duplicated"] == 0 for v in verdict.values()), verdict
