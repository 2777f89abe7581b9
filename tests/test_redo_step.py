"""No lost step for the survivors (issue 15): a replica group SIGKILLed inside the survivors' step does
not cost them that step; they form the quorum again, redo the step's reductions without the dead group
and commit it (ft_core/redo.py, docs/guarantees.md "Redone steps").

Three groups of the core API (Manager + DDP + OptimizerWrapper, AdamW; tests/_redo_worker.py) on a
real lighthouse; one is SIGKILLed at a chosen point of a step, restarted, and heals. Checked: the
survivors record no failed commit, their committed steps are consecutive, a redo event says the step
was replayed without the dead group, and every group (the restarted one included) holds the same
parameters and optimizer state after every step it committed and at the end. With FT_REDO_STEP=0 the
same kill fails the survivors' step, as before issue 15. Redo is on by default for groups of one rank, so
the workers run with FT_REDO_STEP unset unless a test sets it.

On main before issue 15 the redo tests fail (the survivors' step at the kill does not commit); the
FT_REDO_STEP=0 test passes there and here. The test of a loop reading reduced values before the vote
fails with the redo at the vote (before the redo moved to the wait): the loss it read was its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from conftest import child_env, run_calls
from ft_harness import read_jsonl
from torch.distributed import ReduceOp

from ft_core import step_rules as rules
from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.manager_client import ManagerClient
from ft_core.control.manager_server import ManagerServer
from ft_core.redo import RedoConfig, Reduction, ReductionLog, _gone, _replay_start, resolve
from ft_core.redo_log import KEEP_SMALL_BYTES
from ft_core.stores import own_store

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_redo_worker.py")
SURVIVORS, VICTIM = (0, 1), 2


def write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class Job:
    """Three groups of the worker (`ranks` processes each); group 2 is killed once and restarted."""

    def __init__(self, processes: Any, workdir: str, lighthouse: str, env: dict[str, str], extra: list[str],
                 ranks: int = 1, place: Any = None, serve_store: Any = None) -> None:
        self.processes, self.workdir, self.lighthouse, self.env, self.extra = processes, workdir, lighthouse, env, extra
        self.ranks = ranks
        self.place = place or (lambda g: processes)  # group -> what spawns its processes (a simulated host's)
        self.serve_store = serve_store or self._store_here  # group -> "host:port" of a new store for its ranks
        self.procs: dict[tuple[int, int], Any] = {}
        self.stores: dict[int, Any] = {}  # group -> the TCPStore its ranks meet in (the latest incarnation's)
        self.incarnation = {g: 0 for g in range(3)}

    def _store_here(self, g: int) -> str:
        self.stores[g] = own_store("127.0.0.1", timedelta(seconds=30))
        return f"127.0.0.1:{self.stores[g].port}"

    def name(self, g: int, inc: int, rank: int = 0) -> str:
        return f"g{g}.i{inc}" if self.ranks == 1 else f"g{g}.r{rank}.i{inc}"

    def start(self, g: int) -> None:
        """Start every rank of group `g` again; several ranks meet in a store of their own, served here."""
        self.incarnation[g] += 1
        store: list[str] = []
        if self.ranks > 1:
            store = ["--store", self.serve_store(g)]
        for rank in range(self.ranks):
            path = os.path.join(self.workdir, self.name(g, self.incarnation[g], rank) + ".out")
            out = open(path, "w")  # noqa: SIM115 (the child keeps it)
            self.procs[g, rank] = self.place(g).spawn(
                [sys.executable, WORKER, "--group", str(g), "--incarnation", str(self.incarnation[g]),
                 "--rank", str(rank), "--ranks", str(self.ranks), *store, "--workdir", self.workdir, *self.extra],
                env=self.child_env(), stdout=out, stderr=out)

    def child_env(self) -> dict[str, str]:
        """The default redo settings (FT_REDO_STEP and FT_REDO_COPY unset) unless the test sets them."""
        env = child_env(FT_LIGHTHOUSE=self.lighthouse, **self.env)
        for name in ("FT_REDO_STEP", "FT_REDO_COPY"):
            if name not in self.env:
                env.pop(name, None)
        return env

    def steps(self, g: int, incarnation: int | None = None, rank: int = 0) -> list[dict[str, Any]]:
        inc = incarnation or self.incarnation[g]
        return read_jsonl(os.path.join(self.workdir, self.name(g, inc, rank) + ".steps.jsonl"))

    def events(self, g: int, rank: int = 0) -> list[dict[str, Any]]:
        return read_jsonl(os.path.join(self.workdir, self.name(g, self.incarnation[g], rank) + ".events.jsonl"))

    def committed(self, g: int, incarnation: int | None = None, rank: int = 0) -> list[dict[str, Any]]:
        return [r for r in self.steps(g, incarnation, rank) if r["committed"]]

    def output(self, g: int, rank: int = 0) -> str:
        with open(os.path.join(self.workdir, self.name(g, self.incarnation[g], rank) + ".out")) as f:
            return f.read()[-3000:]

    def wait(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            for (g, rank), proc in self.procs.items():
                if proc.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"group {g} rank {rank} exited with {proc.returncode}:\n"
                                         f"{self.output(g, rank)}")
            time.sleep(0.05)
        tails = "\n".join(f"--- group {g} rank {rank} ---\n{self.output(g, rank)}" for g, rank in self.procs)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


def run_kill(processes: Any, tmp_path: Any, point: str, *, hold: bool, env: dict[str, str],
             extra: list[str] | None = None, hold_vote: bool = False, ranks: int = 1) -> tuple[Job, int]:
    """Kill group 2 (every rank) at `point` of step S, restart it, let it heal, stop everyone; (job, S)."""
    with LighthouseServer(min_replicas=1, join_timeout_ms=5000) as lighthouse:
        job = Job(processes, str(tmp_path), lighthouse.address(), env, extra or [], ranks)
        return job, kill_and_restart(job, point, hold=hold, hold_vote=hold_vote)


def start_and_arm(job: Job, point: str, *, hold: bool, hold_vote: bool = False, slow_issue: bool = False) -> int:
    """Start every group, wait for them to commit, arm `point` in group 2 a few steps ahead; that step."""
    for g in range(3):
        job.start(g)
    job.wait(lambda: all(len(job.committed(g)) >= 3 for g in range(3)), 90, "every group committing")
    # hold_vote: both sides must arm at the same step, ahead of every group (about 60 steps a second)
    kill_step = max(r["step"] for g in range(3) for r in job.steps(g)) + (40 if hold_vote else 3)
    if hold:
        write(os.path.join(job.workdir, "hold"), str(kill_step))
    if hold_vote:
        write(os.path.join(job.workdir, "hold_vote"), str(kill_step))
    if slow_issue:
        write(os.path.join(job.workdir, "slow_issue"), str(kill_step))
    write(os.path.join(job.workdir, f"g{VICTIM}.kill"), f"{point}:{kill_step}")
    return kill_step


def disarm(job: Job) -> None:
    for name in (f"g{VICTIM}.kill", "hold", "hold_vote", "slow_issue"):  # not for the restarted incarnation
        if os.path.exists(os.path.join(job.workdir, name)):
            os.remove(os.path.join(job.workdir, name))


def stop_job(job: Job) -> None:
    """Every group stops a few steps ahead of the furthest; each process must exit cleanly."""
    write(os.path.join(job.workdir, "stop"), str(max(r["step"] for g in range(3) for r in job.steps(g)) + 3))
    for (g, rank), proc in job.procs.items():
        assert proc.wait(timeout=60) == 0, f"group {g} rank {rank}:\n{job.output(g, rank)}"


def kill_and_restart(job: Job, point: str, *, hold: bool, hold_vote: bool = False, slow_issue: bool = False) -> int:
    """run_kill's steps on a job whose lighthouse is up: start it, kill group 2 at `point` of step S, restart
    it, let it heal, stop everyone; S."""
    start_and_arm(job, point, hold=hold, hold_vote=hold_vote, slow_issue=slow_issue)
    for rank in range(job.ranks):
        assert job.procs[VICTIM, rank].wait(timeout=60) == -signal.SIGKILL, job.output(VICTIM, rank)
    kill_step = int(re.search(r"SIGKILL self at step (\d+)", job.output(VICTIM)).group(1))
    disarm(job)
    job.wait(lambda: all(any(r["step"] >= kill_step for r in job.steps(g)) for g in SURVIVORS), 60,
             "the survivors' vote on the step of the kill")
    job.start(VICTIM)
    job.wait(lambda: len(job.committed(VICTIM)) >= 2, 90, "the restarted group healing and committing")
    stop_job(job)
    return kill_step


def assert_identical(job: Job, by_rank: bool = False) -> None:
    """Every rank of every group that committed step s holds the same state after it; all end identical.
    by_rank: the same rank of every group (BatchNorm: torch DDP makes a group's ranks' buffers identical at
    the start of each forward pass, so after a step each rank holds those its own batch updated)."""
    by_step: dict[tuple[int, int], tuple[str, str]] = {}
    for g in range(3):
        for inc in range(1, job.incarnation[g] + 1):
            for rank in range(job.ranks):
                who = f"group {g}.{inc} rank {rank}"
                for r in job.committed(g, inc, rank):
                    seen = by_step.setdefault((rank if by_rank else 0, r["after"]), (r["digest"], who))
                    assert seen[0] == r["digest"], f"after step {r['after']}: {seen[1]} and {who} differ"
    finals: dict[int, set[tuple[int, str]]] = {}
    for g in range(3):
        for rank in range(job.ranks):
            with open(os.path.join(job.workdir, job.name(g, job.incarnation[g], rank) + ".final.json")) as f:
                final = json.load(f)
            finals.setdefault(rank if by_rank else 0, set()).add((final["step"], final["digest"]))
    assert all(len(ends) == 1 for ends in finals.values()), finals


def assert_reduced_is_the_participants_mean(job: Job, kill_step: int) -> None:
    """Every committed step's reduced gradient (projections) is the mean of the gradients of the groups
    that took part in it: of three before the kill, of the two survivors at the redone step of the kill."""
    committed: dict[int, list[dict[str, Any]]] = {}
    for g in range(3):
        for inc in range(1, job.incarnation[g] + 1):
            for r in job.committed(g, inc):
                committed.setdefault(r["after"] - 1, []).append(r)  # a healer's "step" is where it started
    assert {kill_step - 1, kill_step} <= set(committed), sorted(committed)
    for step, rows in sorted(committed.items()):
        taking_part = [r for r in rows if r["participating"]]
        assert len(taking_part) == rows[0]["participants"], (step, rows)
        mean = [sum(r["local"][k] for r in taking_part) / len(taking_part) for k in range(4)]
        for r in rows:
            assert r["reduced"] == pytest.approx(mean, rel=1e-4, abs=1e-7), (step, r, mean)
    assert len([r for r in committed[kill_step] if r["participating"]]) == 2
    assert len([r for r in committed[kill_step - 1] if r["participating"]]) == 3


def assert_no_step_lost(job: Job, kill_step: int) -> None:
    for g in SURVIVORS:
        failed = [r for r in job.steps(g) if not r["committed"]]
        assert not failed, f"group {g} failed to commit: {failed}\n{job.output(g)}"
        steps = [r["step"] for r in job.committed(g) if r["step"] >= kill_step - 1]  # from before the kill on
        assert steps[:2] == [kill_step - 1, kill_step] and steps == list(range(steps[0], steps[0] + len(steps)))
        redos = [e for e in job.events(g) if e["type"] == "redo"]
        assert [(e["step"], e["replayed"]) for e in redos] == [(kill_step, True)], redos
        row = next(r for r in job.steps(g) if r["step"] == kill_step)
        assert row["committed"] and row["participants"] == 2, row


def assert_kept_with_the_dead_group_s_contribution(job: Job, kill_step: int) -> None:
    """The loss reached the survivors before their vote, and they committed the step with 3 participants, the
    values they held, no redo and no failed step; everyone stays identical."""
    for g in SURVIVORS:
        row = next(r for r in job.steps(g) if r["step"] == kill_step)
        assert row["lost_before_vote"], f"the loss did not reach group {g} before its vote: {row}\n{job.output(g)}"
        assert row["committed"] and row["participants"] == 3, (row, job.output(g))
        assert not [r for r in job.steps(g) if not r["committed"]], job.output(g)
        assert not [e for e in job.events(g) if e["type"] == "redo"], job.output(g)
        steps = [r["step"] for r in job.committed(g) if r["step"] >= kill_step - 1]
        assert steps[:2] == [kill_step - 1, kill_step] and steps == list(range(steps[0], steps[0] + len(steps)))
    rows = [next(r for r in job.steps(g) if r["step"] == kill_step) for g in SURVIVORS]
    assert rows[0]["reduced"] == pytest.approx(rows[1]["reduced"], rel=1e-6) and rows[0]["digest"] == rows[1]["digest"]
    assert_identical(job)


@pytest.mark.timeout(120)
def test_a_group_killed_in_the_survivors_forward_pass_costs_them_no_step(processes, tmp_path) -> None:
    """Default mode: the loss is pushed before any reduction of the step is sent, so nothing is copied."""
    job, kill_step = run_kill(processes, tmp_path, "forward", hold=True, env={})
    assert_no_step_lost(job, kill_step)
    assert_reduced_is_the_participants_mean(job, kill_step)
    assert_identical(job)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env, extra", [({}, []), ({"FT_REDO_COPY": "1"}, []), ({}, ["--plain-backward"]),
                                        ({"FT_ASYNC_QUORUM": "0"}, []), ({}, ["--batchnorm"])],
                         ids=["inputs-rebuilt-from-grads", "copies-kept", "plain-backward", "sync-quorum",
                              "batchnorm-buffers-synced-after"])
def test_a_group_killed_mid_reduction_costs_the_survivors_no_step(processes, tmp_path, env, extra) -> None:
    """The survivors' reductions were in flight with the dead group when it died. Default: the DDP hook
    rebuilds each failed chunk from the gradients DDP has not overwritten yet; FT_REDO_COPY=1: the
    copies are redone. The redone gradients are the two survivors' mean, whether the loss was divided
    for three groups before backward (ddp.backward: the redo rescales by 3/2) or not (loss.backward()).
    The same with a synchronous quorum (the step's quorum done before its forward pass)."""
    job, kill_step = run_kill(processes, tmp_path, "allreduce", hold=False, env=env, extra=extra)
    assert_no_step_lost(job, kill_step)
    assert_reduced_is_the_participants_mean(job, kill_step)
    assert_identical(job)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env, extra", [({}, []), pytest.param({}, ["--plain-backward"], marks=pytest.mark.slow),
                                        pytest.param({"FT_ASYNC_QUORUM": "0"}, [], marks=pytest.mark.slow)],
                         ids=["default", "plain-backward", "sync-quorum"])
def test_a_group_killed_between_two_ddp_chunks_keeps_the_delivered_one_and_redoes_the_other(processes, tmp_path,
                                                                                         env, extra) -> None:
    """Default mode, DDP in two chunks: the dead group sent the first, which every survivor completed and DDP
    delivered (its input, the local gradients, is gone), and never the second, which failed in flight. The
    first stands with the dead group's share and the survivors redo the second alone: each parameter's reduced
    gradient is the mean of three groups' (the first chunk) or of the two survivors' (the second). Before, the
    step was lost: nothing could rebuild the delivered chunk, and the replay had to start at the first.
    The same with a plain loss.backward() (the redo's average divides after the sum) and with a synchronous
    quorum, both in the slow tier (FT_RUN_SLOW=1)."""
    job, kill_step = run_kill(processes, tmp_path, "second-allreduce", hold=False, env=env,
                              extra=[*TWO_CHUNKS, *extra])
    assert_first_chunk_kept_second_redone(job, kill_step)


TWO_CHUNKS = ["--bucket-cap-mb", "0.004"]  # the worker's DDP in two chunks: layers 3 and 2, then layer 1


def assert_first_chunk_kept_second_redone(job: Job, kill_step: int) -> None:
    """No step lost; on each survivor every parameter's reduced gradient (its sum) is the mean of the three
    groups' own in the first chunk and of the two survivors' in the second; one reduction stood; every group
    holds the same state after every step."""
    assert_no_step_lost(job, kill_step)
    with open(os.path.join(job.workdir, f"g{VICTIM}.dying.json")) as f:
        dead = json.load(f)["param_sums"]
    rows = [next(r for r in job.steps(g) if r["step"] == kill_step) for g in SURVIVORS]
    own = [[r["param_sums"][i] for r in rows] for i in range(len(dead))]
    means = [{3: (sum(own[i]) + dead[i]) / 3, 2: sum(own[i]) / 2} for i in range(len(dead))]
    for row in rows:
        shares = [next((n for n, mean in means[i].items() if got == pytest.approx(mean, rel=1e-4, abs=1e-7)), None)
                  for i, got in enumerate(row["reduced_param_sums"])]
        assert shares == [2, 2, 3, 3, 3, 3], (shares, row, means)  # (weight, bias) of layers 1, 2, 3
    for g in SURVIVORS:
        redo = next(e for e in job.events(g) if e["type"] == "redo")
        assert redo["kept"] == 1, redo
    assert_identical(job)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [[], ["--exactly-once"]], ids=["gradients", "the-sampler-s-votes"])
def test_a_reduction_that_fails_before_its_caller_takes_the_next_line_is_still_redone(processes, tmp_path,
                                                                                      extra) -> None:
    """Each survivor's reductions of the step of the kill return to their caller 0.3 s after they were issued,
    so the dead group's loss fails them before the caller's next line: the DDP hook (and the exactly-once
    sampler, whose votes are the step's first reduction) must have said how to rebuild the input already.
    Until 2026-12-07 they said it after issuing, the redo found nothing to rebuild the input from ("not
    redoable") and the survivors lost the step."""
    with LighthouseServer(min_replicas=1, join_timeout_ms=5000) as lighthouse:
        job = Job(processes, str(tmp_path), lighthouse.address(), {}, extra)
        kill_step = kill_and_restart(job, "allreduce", hold=False, slow_issue=True)
    assert_no_step_lost(job, kill_step)
    assert_identical(job)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, env", [([], {}), (["--loss-first"], {}),
                                        pytest.param(["--loss-first"], {"FT_REDO_COPY": "1"}, marks=pytest.mark.slow)],
                         ids=["grads-then-loss", "loss-then-grads", "loss-then-grads-with-copies"])
def test_a_loop_reading_reduced_values_before_the_vote_reads_the_survivors_average(processes, tmp_path, extra,
                                                                                    env) -> None:
    """The redo runs where a reduction is waited on, so what the loop reads before the vote (the averaged
    loss it logs, the reduced gradients it clips) is already the survivors' value: the loss read equals
    the average of the two survivors' losses, and the optimizer applies the clipped gradients (a redo at
    the vote would have overwritten them with unclipped ones). grads-then-loss: the kill lands in the
    gradients' reduction, the loss is reduced after the redo; loss-then-grads: it lands in the loss's
    reduction, the gradients are reduced after the redo. The loss is kept by a copy in every mode (an input
    of at most KEEP_SMALL_BYTES that nothing rebuilds); until 2026-12-07 only with FT_REDO_COPY=1, and the
    default mode lost the step."""
    job, kill_step = run_kill(processes, tmp_path, "allreduce", hold=False, env=env,
                              extra=["--read-reduced", *extra])
    assert_no_step_lost(job, kill_step)
    rows = [next(r for r in job.steps(g) if r["step"] == kill_step) for g in SURVIVORS]
    survivors_mean = (rows[0]["loss"] + rows[1]["loss"]) / 2
    for row in rows:
        assert row["reduced_loss"] == pytest.approx(survivors_mean, rel=1e-5), rows
    for g in SURVIVORS:
        for row in job.committed(g):
            assert row["used_norm"] == pytest.approx(min(row["norm"], 0.05), rel=1e-3), row
    assert_identical(job)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point, env", [("reduced", {}), ("vote", {}), ("reduced", {"FT_REDO_STEP": "0"}),
                                        ("reduced", {"FT_ASYNC_QUORUM": "0"})],
                         ids=["reduced", "vote", "reduced-redo-off", "reduced-sync-quorum"])
def test_a_group_lost_after_the_step_s_reductions_completed_costs_the_survivors_no_step(processes, tmp_path,
                                                                                     point, env) -> None:
    """The dead group's contribution is in every reduced value of the step (it died after its backward pass,
    or after its own commit), and the survivors learn of the loss before their vote: nothing is left to redo,
    and the survivors commit the step with the values they hold (failed until 2026-12-06: the notice of the
    loss failed the step, once in a CI run of tests/test_accelerate_epochs.py). Nothing is redone, so the
    same holds with redo off."""
    job, kill_step = run_kill(processes, tmp_path, point, hold=False, hold_vote=True, env=env)
    assert_kept_with_the_dead_group_s_contribution(job, kill_step)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("point", ["reduced", "vote"])
def test_groups_of_two_ranks_keep_a_step_whose_reductions_completed_before_a_group_was_lost(processes, tmp_path,
                                                                                           point) -> None:
    """The same rule with two ranks per group: each survivor rank decides for itself that its reductions hold
    the dead group's contribution, and the group's commit barrier ANDs its ranks' votes. Both ranks of both
    survivor groups commit the step with 3 participants, redo nothing, and every rank stays identical."""
    job, kill_step = run_kill(processes, tmp_path, point, hold=False, hold_vote=True, env={}, ranks=2)
    assert_two_ranks_kept(job, kill_step)


def assert_two_ranks_kept(job: Job, kill_step: int) -> None:
    """Both ranks of both survivor groups committed the step of the loss with 3 participants, redid nothing
    and failed no step; every rank stays identical."""
    for g in SURVIVORS:
        for rank in range(2):
            row = next(r for r in job.steps(g, rank=rank) if r["step"] == kill_step)
            assert row["lost_before_vote"], f"the loss did not reach group {g} rank {rank} before its vote: {row}"
            assert row["committed"] and row["participants"] == 3, (row, job.output(g, rank))
            assert not [r for r in job.steps(g, rank=rank) if not r["committed"]], job.output(g, rank)
            assert not [e for e in job.events(g, rank) if e["type"] == "redo"], job.output(g, rank)
            steps = [r["step"] for r in job.committed(g, rank=rank) if r["step"] >= kill_step - 1]
            assert steps[:2] == [kill_step - 1, kill_step] and steps == list(range(steps[0], steps[0] + len(steps)))
    assert_identical(job)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("env, extra", [({}, []), ({"FT_REDO_STEP": "1", "FT_REDO_COPY": "1"}, []),
                                        ({"FT_REDO_STEP": "1", "FT_REDO_COPY": "1"}, ["--batchnorm", "--sort-first",
                                                                                    str(VICTIM)])],
                         ids=["default", "redo-at-vote", "redo-at-vote-batchnorm-first-participant-killed"])
def test_groups_of_two_ranks_fail_or_redo_a_step_that_reduced_after_a_group_was_lost(processes, tmp_path, env,
                                                                                      extra) -> None:
    """Two ranks per group; the loss reaches the survivors after the gradients' reductions and before the
    loop averages its loss: no rank may keep the step's values. By default (no redo for groups of several
    ranks) every survivor rank fails the step; with the redo asked for (at the vote, copies kept) every rank
    redoes it without the dead group and commits it with 2 participants. Either way no rank diverges. With
    BatchNorm and the first participant killed, every survivor rank takes the first survivor's buffers (each
    rank those of the same rank there; coverage: the redo at the vote syncs the buffers in the new quorum)."""
    job, kill_step = run_kill(processes, tmp_path, "reduced", hold=False, hold_vote=True, env=env,
                              extra=["--read-reduced", *extra], ranks=2)
    assert_two_ranks_failed_or_redid(job, kill_step, redo=bool(env), by_rank=bool(extra))
    if extra:
        for rank in range(2):
            assert_buffers_are_the_first_participant_s(job, kill_step, rank)


def assert_two_ranks_failed_or_redid(job: Job, kill_step: int, redo: bool, by_rank: bool = False) -> None:
    """Every survivor rank learnt of the loss before its vote and either failed the step (no redo) or redid
    it once and committed it with 2 participants; every rank stays identical (`assert_identical`)."""
    for g in SURVIVORS:
        for rank in range(2):
            row = next(r for r in job.steps(g, rank=rank) if r["step"] == kill_step)
            assert row["lost_before_vote"], row
            redos = [(e["step"], e["replayed"]) for e in job.events(g, rank) if e["type"] == "redo"]
            assert redos == ([(kill_step, True)] if redo else []), (redos, job.output(g, rank))
            assert row["committed"] == redo, (row, job.output(g, rank))
            if redo:
                assert row["participants"] == 2, row
    assert_identical(job, by_rank)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env, first", [({}, False), ({}, True), ({"FT_REDO_COPY": "1"}, True),
                                        ({"FT_ASYNC_QUORUM": "0"}, True)],
                         ids=["default", "default-first-participant-killed", "copies-kept-first-participant-killed",
                              "sync-quorum-first-participant-killed"])
def test_a_peer_lost_before_the_buffers_sync_costs_the_survivors_no_step(processes, tmp_path, env, first) -> None:
    """A model with BatchNorm: before the vote every group takes the first participant's running stats (one
    SUM reduction). The loss reaches the survivors after the gradients' reductions completed and before that
    sync, which cannot pair with the dead group. The survivors redo the step at the wait and commit it with
    2 participants: by default only the sync (the gradients hold the dead group's contribution and stand, as
    they would have without the sync), with FT_REDO_COPY=1 everything. Until 2026-12-07 the buffers' sync was
    not one of the step's recorded reductions: its failure started no redo and the survivors lost the step;
    then, by default, it was redone only with every input (the gradients' were gone), so the step was lost.

    The buffers the survivors take are the first surviving participant's own, also when the dead group was
    the first participant (its replica id sorts first): until 2026-12-07 the replay re-sent the inputs made
    for the old quorum, in which every survivor sent zeros, and the survivors' running stats became zeros.
    The same with a synchronous quorum (coverage)."""
    extra = ["--batchnorm"] + (["--sort-first", str(VICTIM)] if first else [])
    job, kill_step = run_kill(processes, tmp_path, "reduced", hold=False, hold_vote=True, env=env, extra=extra)
    assert_buffers_sync_redone(job, kill_step, kept="FT_REDO_COPY" not in env)


def assert_buffers_sync_redone(job: Job, kill_step: int, kept: bool) -> None:
    """The loss reached every survivor before its vote; each redid the step once (`kept`: the gradients'
    reductions stood, only what came after was replayed) and committed it with 2 participants, holding the
    first survivor's buffers; everyone stays identical."""
    for g in SURVIVORS:
        row = next(r for r in job.steps(g) if r["step"] == kill_step)
        assert row["lost_before_vote"], row
        redos = [(e["step"], e["replayed"], e["kept"] > 0) for e in job.events(g) if e["type"] == "redo"]
        assert redos == [(kill_step, True, kept)], (redos, job.output(g))
        assert row["committed"] and row["participants"] == 2, (row, job.output(g))
    assert_buffers_are_the_first_participant_s(job, kill_step)
    assert_identical(job)


def assert_buffers_are_the_first_participant_s(job: Job, kill_step: int, rank: int = 0) -> None:
    """At the step of the kill every survivor holds group 0's own running stats (the first survivor)."""
    source = next(r for r in job.steps(0, rank=rank) if r["step"] == kill_step)["own_buffers"]
    assert any(abs(v) > 1e-3 for v in source), source
    for g in SURVIVORS:
        row = next(r for r in job.steps(g, rank=rank) if r["step"] == kill_step)
        assert row["buffers"] == pytest.approx(source, rel=1e-5), (g, row, source)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", [{}, {"FT_REDO_COPY": "1"}], ids=["default", "copies-kept"])
def test_a_reduction_issued_after_a_peer_lost_past_the_gradients_is_redone_alone_or_with_them(processes, tmp_path,
                                                                                           env) -> None:
    """The loss reaches the survivors after the gradients' reductions completed and before the loop reduces
    its loss: that reduction cannot pair with the dead group, so the step does not keep its values as they
    are. The survivors redo it: by default only that reduction (the gradients, gone as inputs, hold the dead
    group's contribution and stand), with FT_REDO_COPY=1 every one; the loss read is the two survivors'
    average either way. Until 2026-12-07 the default lost the step (docs/guarantees.md)."""
    job, kill_step = run_kill(processes, tmp_path, "reduced", hold=False, hold_vote=True, env=env,
                              extra=["--read-reduced"])
    rows = [next(r for r in job.steps(g) if r["step"] == kill_step) for g in SURVIVORS]
    assert all(r["lost_before_vote"] for r in rows), rows
    for g, row in zip(SURVIVORS, rows):
        redos = [(e["step"], e["replayed"], e["kept"]) for e in job.events(g) if e["type"] == "redo"]
        assert redos == [(kill_step, True, 0 if env else redos[0][2])] and (env or redos[0][2] > 0), \
            (redos, job.output(g))
        assert row["committed"] and row["participants"] == 2, (row, job.output(g))
    survivors_mean = (rows[0]["loss"] + rows[1]["loss"]) / 2
    assert [r["reduced_loss"] for r in rows] == pytest.approx([survivors_mean] * 2, rel=1e-5), rows
    assert_identical(job)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point, hold", [("forward", True), ("allreduce", False)],
                         ids=["killed-in-the-forward-pass", "killed-in-the-votes-reduction"])
def test_a_redone_step_consumes_the_survivors_batches_and_gives_the_dead_group_s_back(processes, tmp_path, point,
                                                                                      hold) -> None:
    """Exactly-once sampler: the redone step re-sums the held-batch votes without the dead group, so the
    survivors agree that their batches are consumed and the dead group's is not (it is trained later). Killed
    in the step's first reduction (the sampler's votes, in flight with the dead group), the votes are rebuilt
    from what the sampler knows and reduced again (until 2026-12-06 nothing rebuilt them and the step was
    lost without FT_REDO_COPY=1; found by tests/test_accelerate_data.py)."""
    job, kill_step = run_kill(processes, tmp_path, point, hold=hold, env={}, extra=["--exactly-once"])
    assert_no_step_lost(job, kill_step)
    rows_at = [next(r for r in job.steps(g) if r["step"] == kill_step) for g in SURVIVORS]
    assert rows_at[0]["held"] == rows_at[1]["held"] and rows_at[0]["consumed"] == rows_at[1]["consumed"], rows_at
    assert rows_at[0]["held"].count(False) == 1 and len(rows_at[0]["held"]) == 3, rows_at  # the dead one's
    assert_identical(job)


@pytest.mark.timeout(120)
def test_with_redo_off_the_survivors_step_of_the_kill_fails_as_before(processes, tmp_path) -> None:
    job, kill_step = run_kill(processes, tmp_path, "forward", hold=True, env={"FT_REDO_STEP": "0"})
    for g in SURVIVORS:
        failed = [r["step"] for r in job.steps(g) if not r["committed"]]
        assert failed == [kill_step], (failed, job.output(g))
        assert not [e for e in job.events(g) if e["type"] == "redo"]
    assert_identical(job)


def test_what_is_said_before_a_reduction_is_issued_belongs_to_that_reduction_and_to_no_other() -> None:
    log = ReductionLog(RedoConfig(at_wait=True, copy=False))
    grad, votes = torch.arange(4.0), torch.zeros(3)
    write, restore = (lambda: None), (lambda: True)
    log.on_redo(grad, write, restore, next_reduction=True)
    other = log.record(votes, ReduceOp.SUM, broken=False)
    assert other.writers == [] and other.restore is None
    rec = log.record(grad, ReduceOp.AVG, broken=False)
    assert rec.writers == [write] and rec.restore is restore
    assert log.record(grad, ReduceOp.AVG, broken=False).restore is None  # said once: for one reduction
    log.on_redo(votes, write, restore, next_reduction=True)
    log.reset(allow_heal=True)  # a step's registrations end with it
    assert log.record(votes, ReduceOp.SUM, broken=False).restore is None
    keep = log.record(grad, ReduceOp.AVG, broken=False, keep=True)  # keep_input: a copy of this one input
    assert keep.saved is not None and torch.equal(keep.saved, grad) and keep.saved.data_ptr() != grad.data_ptr()


def test_the_reduction_log_keeps_copies_only_of_what_is_sent_in_buffers_reused_every_step() -> None:
    log = ReductionLog(RedoConfig(at_wait=False, at_vote=True, copy=True))
    grad, loss = torch.arange(4.0), torch.ones(1)
    first = log.record(grad, ReduceOp.AVG, broken=False)
    assert first is not None and torch.equal(first.saved, grad) and first.saved.data_ptr() != grad.data_ptr()
    assert log.record(loss, ReduceOp.SUM, broken=True).saved is None  # never sent: the input itself stays intact
    first.intact = False
    assert log.redoable(errored=True, participating=True)  # the copy makes it recoverable
    log.on_redo(grad, lambda: None)
    assert len(first.writers) == 1
    log.reset(allow_heal=True)
    again = log.record(grad * 2, ReduceOp.AVG, broken=False)
    assert again.saved.data_ptr() == first.saved.data_ptr() and torch.equal(again.saved, grad * 2)

    plain = ReductionLog(RedoConfig(at_wait=False, at_vote=True, copy=False))
    big = torch.arange(KEEP_SMALL_BYTES // 4 + 1.0)
    sent = plain.record(big, ReduceOp.AVG, broken=False)
    assert sent.saved is None
    sent.intact = False
    assert not plain.redoable(errored=True, participating=True)  # sent, no copy: cannot be redone
    why = _gone(plain.records)  # the step's error names that reduction and the fix
    assert "reduction 0 of this step (257 torch.float32, " in why and "keep_input=True" in why, why
    small = plain.record(loss, ReduceOp.SUM, broken=False)  # a loss or metric, nothing rebuilds it: copied
    assert small.saved is not None and torch.equal(small.saved, loss) and small.saved.data_ptr() != loss.data_ptr()
    votes = torch.zeros(3)
    plain.on_redo(votes, lambda: None, lambda: True, next_reduction=True)
    assert plain.record(votes, ReduceOp.SUM, broken=False).saved is None  # small, but its integration rebuilds it
    assert ReductionLog(RedoConfig(at_wait=False)).record(grad, ReduceOp.AVG, broken=False) is None
    at_wait = ReductionLog(RedoConfig(at_wait=True, copy=False))
    assert at_wait.record(grad, ReduceOp.AVG, broken=True) is not None
    assert not at_wait.redoable(errored=True, participating=True)  # redone at the wait, never at the vote


@pytest.mark.parametrize("env, ranks, where", [
    (None, 1, "wait"),  # the default: a group of one rank redoes at the wait
    (None, 2, "off"),  # several ranks would have to agree at the wait: not by default
    ("1", 1, "wait"),
    ("1", 2, "vote"),  # asked for: at the vote (values read before the vote are the failed ones)
    ("0", 1, "off"),
    ("0", 2, "off"),
])
def test_where_a_step_that_lost_a_peer_is_redone(monkeypatch, env, ranks, where) -> None:
    if env is None:
        monkeypatch.delenv("FT_REDO_STEP", raising=False)
    else:
        monkeypatch.setenv("FT_REDO_STEP", env)
    cfg = resolve(None, None, ranks)
    assert (cfg.at_wait, cfg.at_vote) == (where == "wait", where == "vote"), cfg
    assert cfg.enabled == (where != "off")


@pytest.mark.timeout(60)
def test_a_redo_replays_only_when_every_member_of_its_quorum_redoes_the_same_attempt() -> None:
    """What the bounded chaos run of 2026-12-06 found (seed 20793, 1 rank, async, skipped steps and failed
    heal loads): group 1 lost its step's collectives and redid it, while groups 0 and 2 had given up on that
    attempt and started a fresh one of the same step. The redo quorum held the same three groups at the same
    step, and no member counted more failures than group 1 (each had failed twice, for other reasons), so
    group 1 replayed its old gradients into their fresh reduction: every group committed the step, group 1
    with other parameters than the others. Each member now names the attempt it redoes in its quorum request,
    and a redo replays only when every member names its own attempt.

    Real lighthouse, two groups of two ranks: rank 0 calls its manager server in process, rank 1 through a
    ManagerClient (the protobuf path a remote rank takes)."""
    timeout = timedelta(seconds=20)
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=30_000,
                          http_bind=None) as lighthouse, \
            ManagerServer("0:a", lighthouse.address(), world_size=2) as group0, \
            ManagerServer("1:b", lighthouse.address(), world_size=2) as group1, \
            ManagerClient(group0.address()) as remote0, ManagerClient(group1.address()) as remote1:
        assert group0.wait_heartbeat_connected(10) and group1.wait_heartbeat_connected(10)

        def round_of(redo0: tuple[int, int], redo1: tuple[int, int], failures: int = 2) -> list[Any]:
            """One quorum round at step 7; redoN: the attempt each rank of group N redoes (0: none)."""
            kw = dict(commit_failures=failures, rebuild=failures > 0)
            calls = [lambda: group0.quorum_local(0, 7, "", redo0[0] > 0, timeout, redo_quorum_id=redo0[0], **kw),
                     lambda: remote0.quorum(1, 7, "", redo0[1] > 0, timeout, redo_quorum_id=redo0[1], **kw),
                     lambda: group1.quorum_local(0, 7, "", redo1[0] > 0, timeout, redo_quorum_id=redo1[0], **kw),
                     lambda: remote1.quorum(1, 7, "", redo1[1] > 0, timeout, redo_quorum_id=redo1[1], **kw)]
            results = [r for r, _ in run_calls(calls)]
            assert all(not isinstance(r, Exception) for r in results), results
            assert len({r.quorum_id for r in results}) == 1 and sorted(results[0].replica_ids) == ["0:a", "1:b"]
            return results

        attempt = round_of((0, 0), (0, 0), failures=0)[0].quorum_id
        ids = ("0:a", "1:b")
        state = rules.StepState(step=7, commit_failures=2, quorum_id=-1)  # both groups have failed twice before

        # Group 0 redoes the attempt; group 1 gave up on it and runs a fresh one, with as many failures.
        mixed = round_of((attempt, attempt), (0, 0))
        assert [r.redo_quorum_id for r in mixed] == [0] * 4, mixed
        assert rules.redo_role(state, mixed[0], ids, attempt) is rules.RedoRole.ABANDON
        assert rules.redo_role(state, mixed[1], ids, attempt) is rules.RedoRole.ABANDON

        # One rank of group 1 does not redo it: the group does not (its ranks would issue other collectives).
        split = round_of((attempt, attempt), (attempt, 0))
        assert [r.redo_quorum_id for r in split] == [0] * 4, split

        # Both groups redo the same attempt: every rank, local or remote, is told so and replays.
        both = round_of((attempt, attempt), (attempt, attempt))
        assert [r.redo_quorum_id for r in both] == [attempt] * 4, both
        assert all(rules.redo_role(state, r, ids, attempt) is rules.RedoRole.REPLAY for r in both)
        assert rules.redo_role(state, both[0], ids, attempt + 1) is rules.RedoRole.ABANDON  # another attempt


def test_a_replay_starts_at_the_first_reduction_that_did_not_complete_only_when_everything_cannot_be_redone() -> None:
    """ft_core.redo._replay_start: every reduction again while it can (a completed input rebuilt, as the
    sampler's votes); else the ones from the first that did not complete: issued after the loss, when it came
    after every sent reduction completed (`kept`), or the first that failed, when it came mid-reduction (then
    only values that cannot be rebuilt stand); a completed input is rebuilt last first, so one that cannot be
    leaves those before untouched."""
    calls: list[str] = []

    def sent(name: str, completed: bool, rebuilds: bool | None) -> Reduction:
        rec = Reduction(torch.zeros(2), ReduceOp.SUM, first=torch.futures.Future(), intact=False, failed=not completed)
        if rebuilds is not None:
            rec.restore = lambda: calls.append(name) or rebuilds
        return rec

    def start(kept: bool, *records: Reduction) -> int | None:
        log = ReductionLog(RedoConfig(at_wait=True, copy=False))
        log.records, log.kept = list(records), kept
        return _replay_start(log)

    skipped = Reduction(torch.zeros(2), ReduceOp.SUM)  # issued after the loss: never sent, intact
    buffers = Reduction(torch.zeros(2), ReduceOp.SUM, intact=False, failed=True, refill=lambda: None)
    delivered = sent("grads", True, False)  # DDP: a delivered chunk cannot be rebuilt
    assert start(True, delivered, buffers) == 1 and calls == ["grads"]
    calls.clear()
    # the loss came mid-reduction: a delivered chunk stands, the failed one after it is redone
    assert start(False, sent("grads", True, False), buffers) == 1 and calls == ["grads"]
    calls.clear()
    # ... but never beside a completed value that can be rebuilt (the sampler's votes)
    assert start(False, sent("votes", True, True), sent("grads", True, False), buffers) is None
    assert sorted(calls) == ["grads", "votes"]
    calls.clear()
    loss = Reduction(torch.zeros(2), ReduceOp.SUM, first=torch.futures.Future(), intact=False)  # nothing rebuilds it
    assert start(False, loss, sent("grads", True, False), buffers) == 2 and calls == ["grads"]
    copied = Reduction(torch.zeros(2), ReduceOp.SUM, saved=torch.zeros(2), first=torch.futures.Future(), intact=False)
    assert start(False, copied, sent("grads", True, False), buffers) == 2  # a small loss's copy: it stands too
    calls.clear()
    assert start(True, sent("votes", True, True), sent("grads", True, False), skipped) == 2
    assert calls == ["grads"]  # the votes were left as they completed
    calls.clear()
    assert start(True, sent("votes", True, True), skipped) == 0 and calls == ["votes"]  # all again, as before
    calls.clear()
    assert start(True, sent("votes", True, False), sent("grads", True, True), skipped) is None  # grads rebuilt
    assert start(True, sent("a", False, True), sent("b", True, False)) is None  # completed after a failure
