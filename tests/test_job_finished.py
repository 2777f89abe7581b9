"""A replica group that comes back after the job finished is refused, never retrains it alone; a group
waiting for a quorum says why it is not forming. Real lighthouse, real manager servers, real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
from conftest import REPO_ROOT, child_env, run_calls

from ft_core.control.job_end import (
    FinishedGroup,
    job_finished_error,
    late_group_problem,
)
from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.lighthouse_calls import Waiter
from ft_core.control.lighthouse_client import LighthouseClient
from ft_core.control.lighthouse_state import LighthouseConfig, LighthouseCore
from ft_core.control.manager_server import ManagerClient, ManagerServer
from ft_core.control.types import QuorumMember
from ft_core.errors import JobFinishedError, QuorumError
from ft_core.tools.launcher import free_port
from ft_core.tools.status import finished_line

WORKER = os.path.join(REPO_ROOT, "tests", "_job_end_worker.py")
FINISHED = {"replica_group_1:7": FinishedGroup("replica_group_1:7", 20, 9, 0)}


def member(step: int, last_quorum_id: int = 0, rid: str = "replica_group_0:8") -> QuorumMember:
    return QuorumMember(replica_id=rid, step=step, last_quorum_id=last_quorum_id)


@pytest.mark.parametrize("joiner, finished, live, refused", [
    (member(0), FINISHED, {}, True),  # restarted after the end: alone at step 0
    (member(15, last_quorum_id=4), FINISHED, {}, True),  # long gone, far behind, nobody to heal from
    (member(19, last_quorum_id=9), FINISHED, {}, False),  # in the finished group's last quorum: one step late
    (member(0, last_quorum_id=9), FINISHED, {}, True),  # a healer of that quorum whose heal failed: far behind
    (member(18, last_quorum_id=10), FINISHED, {}, True),  # behind the last quorum's max_step (19): a healer too
    (member(20), FINISHED, {}, False),  # resumed from the final checkpoint
    (member(0), FINISHED, {"replica_group_2:1": 20}, False),  # a live group at the end: heals from it
    (member(0), FINISHED, {"replica_group_2:1": 12}, True),  # a live group as far behind is no source
    (member(0), FINISHED, {"replica_group_0:old": 20}, True),  # its own old incarnation is no source
    (member(0), {}, {}, False),  # nothing finished
])
def test_late_group_rule(joiner, finished, live, refused):
    problem = late_group_problem(joiner, finished, live)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith(f"replica group replica_group_0: the job finished at step 20 (group replica_group_1) "
                                  f"while this group was at step {joiner.step}")
        error = job_finished_error(problem)
        assert (error.finished_step, error.step, error.finished_groups) == (20, joiner.step, ("replica_group_1",))
        assert isinstance(error, QuorumError) and "start a new job" in str(error)


def test_a_group_already_waiting_when_the_job_finishes_ahead_of_it_is_refused_not_issued_a_quorum_alone():
    """The events in the order a real run delivered them (the heal-failed test below, about 3 runs in 4): the
    healer joined its next quorum while the source still trained, the source then finished and closed its
    stream. The late-group rule ran only at the join, so the healer was then issued a quorum alone at step 0
    and trained a step from its initial weights before its next join was refused."""
    core = LighthouseCore(LighthouseConfig(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=30_000))
    streams = {rid: object() for rid in ("source", "healer")}
    for rid, stream in streams.items():
        core.stream_opened(rid, stream)
    first = [Waiter(QuorumMember("source", step=40), lambda: None), Waiter(QuorumMember("healer"), lambda: None)]
    for waiter in first:
        core.join(waiter)
    assert first[1].issued is not None, "the two did not get a quorum together"
    quorum_id = first[1].issued.quorum.quorum_id
    for waiter in first:
        core.leave(waiter)
    woken: list[str] = []
    late = Waiter(QuorumMember("healer", step=0, last_quorum_id=quorum_id), lambda: woken.append("healer"))
    core.join(late)  # its heal failed: it asks again, still at step 0; the source has not asked yet
    assert late.issued is None and late.refusal is None
    core.finished("source", 41, quorum_id)
    core.stream_closed("source", streams["source"], "closed by the client (shutdown)")
    assert late.issued is None, f"issued quorum {late.issued.quorum.replica_ids} to a group the job finished ahead of"
    assert late.refusal is not None and "the job finished at step 41" in late.refusal and woken == ["healer"]


@pytest.mark.timeout(60)
def test_a_unary_quorum_call_waiting_when_the_job_finishes_ahead_of_it_gets_job_finished_error():
    """The same order over a real lighthouse's unary Quorum call (the heartbeat stream's polls are the heal-failed
    test's path): the refusal reaches a call that is already waiting, at once, not at its deadline. (min_replicas 2
    makes the first quorum wait for both.)"""
    with LighthouseServer(min_replicas=2, join_timeout_ms=60_000, http_bind=None) as lighthouse, \
            LighthouseClient(lighthouse.address()) as client:
        first = run_calls([lambda: client.quorum(QuorumMember("replica_group_1:s", step=40), timeout=timedelta(seconds=20)),
                           lambda: client.quorum(QuorumMember("replica_group_0:h"), timeout=timedelta(seconds=20))])
        quorum_id = first[0][0].quorum_id
        assert first[1][0].quorum_id == quorum_id, first
        def finish_once_the_healer_waits() -> list[str]:
            deadline = time.monotonic() + 10  # a busy machine: the notice must come after the join, not before
            while not any(m["replica_id"] == "replica_group_0:h" and m["waiting"]
                          for m in lighthouse.core.status()["members"]):
                assert time.monotonic() < deadline, "the healer's call never waited"
                time.sleep(0.02)
            return client.finished("replica_group_1:s", 41, quorum_id)

        started = time.monotonic()
        waiting = run_calls([lambda: client.quorum(QuorumMember("replica_group_0:h", last_quorum_id=quorum_id),
                                                   timeout=timedelta(seconds=30)),
                             finish_once_the_healer_waits])
        assert waiting[1][0] == [lighthouse.address()], waiting[1]
    error, ended = waiting[0]
    assert isinstance(error, JobFinishedError), error
    assert (error.finished_step, error.step) == (41, 0) and ended - started < 10, (error, ended - started)


@pytest.mark.timeout(60)
def test_every_rank_of_a_late_group_gets_job_finished_error_from_its_quorum():
    with LighthouseServer(min_replicas=2, join_timeout_ms=100, http_bind=None) as lighthouse:
        with LighthouseClient(lighthouse.address()) as client:
            assert client.finished("replica_group_1:1", 20, 5) == [lighthouse.address()]
        assert [f["step"] for f in lighthouse.core.status()["finished"]] == [20]
        with ManagerServer("replica_group_0:2", lighthouse.address(), world_size=2) as server, \
                ManagerClient(server.address()) as rank1:
            results = run_calls([lambda: server.quorum_local(0, 3, "", False, timedelta(seconds=30)),
                                 lambda: rank1.quorum(1, 3, "", False, timedelta(seconds=30))])
    for error, _ in results:  # rank 0 in process, rank 1 over gRPC: the same typed error, not a timeout
        assert isinstance(error, JobFinishedError), error
        assert (error.finished_step, error.step) == (20, 3)
        assert str(error).startswith("replica group replica_group_0: the job finished at step 20")


@pytest.mark.timeout(60)
def test_the_finished_notice_reaches_every_lighthouse_address_a_standby_too():
    with LighthouseServer(http_bind=None) as primary, LighthouseServer(http_bind=None) as standby:
        with LighthouseClient(f"{primary.address()},{standby.address()}") as client:
            assert client.finished("replica_group_1:1", 7, 2) == [primary.address(), standby.address()]
        for lighthouse in (primary, standby):
            assert [(f["replica_id"], f["step"]) for f in lighthouse.core.status()["finished"]] == \
                [("replica_group_1:1", 7)]


@pytest.mark.timeout(60)
def test_the_finished_notice_is_tried_again_when_the_lighthouse_does_not_take_it_at_once():
    """On a loaded machine the notice's first connection could take longer than one try, and the notice was lost
    (busy suite runs, 2026-12-07): here the lighthouse comes up only after the first try's deadline."""
    port = free_port()
    started: list[LighthouseServer] = []
    late = threading.Timer(0.8, lambda: started.append(LighthouseServer(bind=f"127.0.0.1:{port}", http_bind=None)))
    late.start()
    try:
        with LighthouseClient(f"127.0.0.1:{port}") as client:  # the first try ends before the lighthouse is up
            assert client.finished("replica_group_1:1", 7, 2, timeout=0.5, attempts=8) == [f"127.0.0.1:{port}"]
        late.join()
        assert [(f["replica_id"], f["step"]) for f in started[0].core.status()["finished"]] == \
            [("replica_group_1:1", 7)]
    finally:
        late.join()
        for lighthouse in started:
            lighthouse.shutdown()


def _spawn(processes, lighthouse: LighthouseServer, group: int, *args: str) -> subprocess.Popen:
    return processes.spawn([sys.executable, WORKER, "--group", str(group), *args],
                           env=child_env(FT_LIGHTHOUSE=lighthouse.address()),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(110)
def test_a_group_restarted_after_the_other_finished_exits_with_the_reason_instead_of_retraining(processes):
    # The lighthouse runs on its own (no ftl launch): only the engine can know the job has finished. Group 0
    # is gone (lost earlier, not restarted yet) while group 1 trains to the end; then group 0 comes back.
    with LighthouseServer(min_replicas=1, join_timeout_ms=500) as lighthouse:
        g1 = _spawn(processes, lighthouse, 1, "--steps", "8")
        out1 = g1.communicate(timeout=60)[0]
        assert g1.returncode == 0 and "done at step 8" in out1, out1[-3000:]
        final = 8
        shown = finished_line(lighthouse.core.status())  # what `ftl status` prints under its table
        assert shown is not None and shown.startswith("finished: replica_group_1:") and f" at step {final} " in shown, \
            (shown, out1[-3000:])
        restarted = _spawn(processes, lighthouse, 0, "--steps", "8")
        out0 = restarted.communicate(timeout=50)[0]  # its quorum timeout is 60 s: only the refusal ends it sooner
        assert restarted.returncode == 1, out0[-3000:]
        assert f"JobFinishedError: replica group replica_group_0: the job finished at step {final} (group " \
               f"replica_group_1) while this group was at step 0" in out0, out0[-3000:]
        assert "committed step" not in out0 and "done at step" not in out0, out0[-3000:]
        # Resumed from the job's final checkpoint it may go on (here: three more steps of its own).
        resumed = _spawn(processes, lighthouse, 0, "--steps", str(final + 3), "--start-step", str(final))
        out = resumed.communicate(timeout=50)[0]
        assert resumed.returncode == 0 and f"done at step {final + 3}" in out, out[-3000:]


def _read_until(proc: subprocess.Popen, text: str) -> tuple[list[str], threading.Event, threading.Thread]:
    """Collect `proc`'s output lines in a thread (it ends at the output's end); the event is set once a line
    holds `text`."""
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if text in line:
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, seen, reader


@pytest.mark.timeout(120)
def test_a_group_whose_heal_failed_in_the_job_s_last_quorum_is_refused_instead_of_retraining_alone(processes, tmp_path):
    """A restarted group took part in the finished group's last quorum as a healer and its load failed, so it
    kept its step 0. Being in that quorum let it go on (as if one step late): with min_replicas 1 it then
    retrained the whole job alone from its initial weights (found by reading the rule, 2026-12-07)."""
    end = tmp_path / "end"
    with LighthouseServer(min_replicas=1, join_timeout_ms=500) as lighthouse:
        source = _spawn(processes, lighthouse, 1, "--steps", "100000", "--end-file", str(end))
        out1, trained, reader1 = _read_until(source, "committed step 2")
        assert trained.wait(60), "".join(out1)[-3000:]
        healer = _spawn(processes, lighthouse, 0, "--steps", "100000", "--fail-loads")
        out0, failed, reader0 = _read_until(healer, "injected load failure")
        assert failed.wait(60), "".join(out0)[-3000:]
        end.touch()  # the source ends after its current step, with the healer in its quorum
        source.wait(timeout=60)
        reader1.join(timeout=10)  # its last lines
        assert source.returncode == 0 and "done at step" in "".join(out1), "".join(out1)[-3000:]
        final = int("".join(out1).split("done at step ")[-1].split()[0])
        try:
            healer.wait(timeout=50)  # its quorum timeout is 60 s: only the refusal ends it sooner
        except subprocess.TimeoutExpired:
            healer.kill()
            healer.wait(timeout=10)
        reader0.join(timeout=10)
    out0 = "".join(out0)
    assert healer.returncode == 1, out0[-3000:]
    assert f"JobFinishedError: replica group replica_group_0: the job finished at step {final} (group " \
           f"replica_group_1) while this group was at step 0" in out0, out0[-3000:]
    assert "committed step" not in out0 and "done at step" not in out0, out0[-3000:]


@pytest.mark.timeout(90)
def test_a_group_waiting_alone_for_min_replicas_logs_the_lighthouses_reason_then_times_out_with_it(processes):
    with LighthouseServer(min_replicas=2, join_timeout_ms=500) as lighthouse:
        proc = _spawn(processes, lighthouse, 0, "--steps", "5", "--quorum-timeout", "12")
        out = proc.communicate(timeout=80)[0]
    assert proc.returncode == 1, out[-3000:]
    notes = [line for line in out.splitlines() if "ft_core.control.quorum_wait" in line]
    assert notes, out[-3000:]
    assert "replica group replica_group_0:" in notes[0] and "waiting 5 s for a quorum: New quorum not ready, only " \
           "have 1 participants, need min_replicas 2." in notes[0], notes
    error = out.strip().splitlines()[-1]  # the quorum's timeout, with the lighthouse's last reason
    assert error.startswith("ft_core.errors.FTTimeoutError: ") and "the lighthouse said: New quorum not ready, " \
           "only have 1 participants, need min_replicas 2." in error, out[-3000:]


LIGHTNING_WORKER = os.path.join(REPO_ROOT, "tests", "_lightning_job_end_worker.py")


def _lightning_job(processes, tmp_path, *args: str) -> tuple[subprocess.Popen, dict, dict]:
    """Groups 0 and 1 fit together to the end (Trainer, ModelCheckpoint(save_last=True) unless told otherwise),
    then group 2 starts: the late group's process (ended), its output, and the finished groups' results."""
    with LighthouseServer(min_replicas=2, join_timeout_ms=500) as lighthouse:
        def fit(group: int) -> subprocess.Popen:
            env = child_env(FT_LIGHTHOUSE=lighthouse.address(), REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="3",
                            FT_RESTART_COUNT="0")
            return processes.spawn([sys.executable, LIGHTNING_WORKER, "--out", str(tmp_path / "run"), "--result",
                                    str(tmp_path / f"result{group}.pt"), *args], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        finished = [fit(0), fit(1)]
        outs = [proc.communicate(timeout=80)[0] for proc in finished]
        for proc, out in zip(finished, outs):
            assert proc.returncode == 0 and "done global_step=8 manager_step=8 trained=8" in out, out[-3000:]
        assert sorted(f["step"] for f in lighthouse.core.status()["finished"]) == [8, 8], [o[-2000:] for o in outs]
        late = fit(2)
        out = late.communicate(timeout=60)[0]
    results = [torch.load(tmp_path / f"result{g}.pt", weights_only=True) for g in (0, 1)]
    return late, out, results


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(110)
@pytest.mark.parametrize("layout", [
    pytest.param([], id="default rank_zero=quorum, no dirpath: the job's shared checkpoints folder"),
    pytest.param(["--rank-zero", "group"], id="rank_zero=group, default per-group folders: another group's last.ckpt"),
    pytest.param(["--rank-zero", "quorum", "--ckpt-dir", "{tmp}/shared"], id="rank_zero=quorum, shared dirpath"),
])
def test_a_lightning_group_started_after_the_job_finished_resumes_from_its_last_checkpoint(processes, tmp_path, layout):
    args = [a.replace("{tmp}", str(tmp_path)) for a in layout]
    late, out, (r0, r1) = _lightning_job(processes, tmp_path, *args)
    assert late.returncode == 0, out[-3000:]
    assert _same(r0["model"], r1["model"]), "the finished groups differ"
    lines = [line for line in out.splitlines() if "instead of retraining alone" in line]
    assert len(lines) == 1 and "the job finished at step 8" in lines[0], out[-3000:]
    loaded = lines[0].split("loading its checkpoint ", 1)[1].split(" (step 8)", 1)[0]
    assert os.path.basename(loaded) == "last.ckpt" and "replica_group_2" not in loaded, lines[0]
    if not layout:  # the default: one folder for the job, not a group's (nor a logger version's) folder
        assert loaded == str(tmp_path / "run" / "checkpoints" / "last.ckpt"), lines[0]
    if layout[:2] == ["--rank-zero", "group"]:
        assert "replica_group_" in loaded, lines[0]
    final = torch.load(loaded, weights_only=True)  # the finished groups' final checkpoint
    mine = torch.load(tmp_path / "result2.pt", weights_only=True)
    assert _same(mine["model"], final["state_dict"]) and _same(mine["model"], r0["model"])  # bitwise
    momentum = [s["momentum_buffer"] for s in mine["optimizer"]["state"].values()]
    assert all(torch.equal(m, s["momentum_buffer"]) for m, s in zip(momentum, final["optimizer_states"][0]["state"].values()))
    assert (mine["manager_step"], mine["global_step"], mine["epoch"], mine["trained"]) == \
        (8, r0["global_step"], r0["epoch"], 0)  # trained nothing alone; counters as the finished groups'
    assert "done global_step=8 manager_step=8 trained=0" in out and "The dirpath has changed" not in out


@pytest.mark.timeout(110)
def test_a_lightning_group_started_after_the_job_finished_without_a_checkpoint_exits_naming_the_fix(processes, tmp_path):
    late, out, _ = _lightning_job(processes, tmp_path, "--no-checkpointing")
    assert late.returncode != 0, out[-3000:]
    assert "JobFinishedError: replica group replica_group_2: the job finished at step 8 (groups replica_group_0, " \
           "replica_group_1) while this group was at step 0" in out, out[-3000:]
    assert "No Lightning checkpoint saved at step 8 or later was found in " in out and \
           "keep a ModelCheckpoint (save_last=True)" in out, out[-3000:]
    assert "done global_step" not in out


def _ckpt(path, step: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"ft_manager": {"step": step, "batches_committed": step}, "global_step": step,
                "state_dict": {"w": torch.full((2,), float(step))}}, path)


@pytest.mark.parametrize("files, dirs, final, chosen", [
    # rank_zero="group", no dirpath: each group's logger folder (another version of the logger there)
    ({"replica_group_0/lightning_logs/version_1/checkpoints/last.ckpt": 8},
     ["replica_group_2/lightning_logs/version_0/checkpoints"], 8,
     "replica_group_0/lightning_logs/version_1/checkpoints/last.ckpt"),
    # ModelCheckpoint(dirpath=ck), per group: ck/replica_group_<id>
    ({"ck/replica_group_1/last.ckpt": 8, "ck/replica_group_1/epoch=0-step=4.ckpt": 4}, ["ck/replica_group_2"], 8,
     "ck/replica_group_1/last.ckpt"),
    # rank_zero="quorum" with a dirpath: one shared folder
    ({"ck/epoch=1-step=8.ckpt": 8}, ["ck"], 8, "ck/epoch=1-step=8.ckpt"),
    # rank_zero="quorum" (the default) without one: the job's shared <default_root_dir>/checkpoints
    ({"checkpoints/last.ckpt": 8}, ["checkpoints"], 8, "checkpoints/last.ckpt"),
    # a folder written by a group of rank_zero="group" (another group's), found from a group's own folder
    ({"replica_group_0/checkpoints/last.ckpt": 8}, ["replica_group_2/checkpoints"], 8,
     "replica_group_0/checkpoints/last.ckpt"),
    # this group's own stale checkpoint (a killed run) is behind the end: another group's is used
    ({"replica_group_2/checkpoints/last.ckpt": 3, "replica_group_0/checkpoints/last.ckpt": 8},
     ["replica_group_2/checkpoints"], 8, "replica_group_0/checkpoints/last.ckpt"),
    # the highest saved step wins (as in the Accelerate plugin), whatever the file's name
    ({"replica_group_0/checkpoints/last.ckpt": 8, "replica_group_1/checkpoints/epoch=2-step=10.ckpt": 10},
     ["replica_group_2/checkpoints"], 8, "replica_group_1/checkpoints/epoch=2-step=10.ckpt"),
    # nothing at the end or past it, or nothing at all
    ({"replica_group_0/checkpoints/last.ckpt": 6}, ["replica_group_2/checkpoints"], 8, None),
    ({}, ["replica_group_2/checkpoints"], 8, None),
])
def test_the_lightning_checkpoint_a_late_group_resumes_from(tmp_path, files, dirs, final, chosen):
    from ft_lightning._late_resume import final_checkpoint

    for name, step in files.items():
        _ckpt(tmp_path / name, step)
    (tmp_path / "replica_group_0").mkdir(exist_ok=True)
    (tmp_path / "replica_group_0" / "checkpoints").mkdir(exist_ok=True)
    (tmp_path / "replica_group_0" / "checkpoints" / "damaged.ckpt").write_bytes(b"not a checkpoint")  # skipped
    found = final_checkpoint([str(tmp_path / d) for d in dirs], "replica_group_2", final)
    if chosen is None:
        assert found is None
    else:
        assert found is not None and (found.path, found.step) == (str(tmp_path / chosen), files[chosen])


def test_the_integrations_console_shows_the_quorum_wait_line():
    from ft_lightning._events import describe

    event = {"type": "quorum_wait", "replica_id": "0:ab", "group_rank": 0, "seconds": 5.02,
             "reason": "New quorum not ready, only have 1 participants, need min_replicas 2."}
    assert describe(event, None) == "waiting 5 s for a quorum: New quorum not ready, only have 1 participants, " \
                                    "need min_replicas 2."
