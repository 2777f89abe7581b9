"""The default Trainer strategy (rank_zero="quorum") keeps one checkpoint folder for the whole job:
real Trainer processes on CPU (tests/_lightning_callbacks_worker.py with `ModelCheckpoint` and no
dirpath, `fit(ckpt_path="last")`), loopback lighthouses in this process, real SIGKILLs and restarts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from _trainer_groups import (
    assert_one_writer_per_event,
    logs,
    lr_steps_by_group,
    records,
    start_group,
    wait_until,
)
from conftest import REPO_ROOT

WORKER = os.path.join(REPO_ROOT, "tests", "_lightning_callbacks_worker.py")
GROUPS = 2
# 8 samples per group: 2 steps per epoch, 6 epochs (12 steps); the worker's metric is best at epoch 2
# (top-2: epochs 2 and 3); EarlyStopping never stops; checkpoints at every validation, save_last=True
RUN = ("--samples", "16", "--epochs", "6", "--patience", "100", "--no-dirpath", "--save-last", "--resume-last")


def start(processes, address: str, out: Path, group: int, *args: str, restart: int = 0) -> subprocess.Popen:
    return start_group(processes, WORKER, address, out, group, GROUPS, *RUN, *args, restart=restart)


@pytest.mark.timeout(110)
def test_default_strategy_one_checkpoint_folder_through_a_leader_restart_and_a_whole_job_restart(processes, tmp_path):
    """Group 0 (rank zero) is SIGKILLed at step 3 and restarted with ckpt_path="last" while group 1 trains on
    alone (rank zero now); the restart resumes from group 1's last.ckpt in the one shared folder and heals.
    Then both groups are SIGKILLed at step 9 and restarted (a new lighthouse, as a relaunched job) from
    ckpt_path="last": both resume at step 8, the last checkpoint, and train to the end. Every checkpoint
    file of the run is in <default_root_dir>/checkpoints, each written once, by rank zero of its step."""
    from ft_core.control.lighthouse import LighthouseServer

    def lighthouse(min_replicas: int) -> LighthouseServer:
        return LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=1_000,
                                heartbeat_timeout_ms=2_000, http_bind=None)

    with lighthouse(1) as job, lighthouse(2) as relaunched:
        leader = start(processes, job.address(), tmp_path, 0, "--kill-at-step", "3", "--wait-ready", "1")
        other = start(processes, job.address(), tmp_path, 1, "--kill-at-step", "9", "--wait-start", "started_g0_r0",
                      "--wait-for", "started_g0_r1", "--wait-epoch", "3")
        # started ahead, so a restart costs no import time: each waits for its --go marker
        leader_again = start(processes, job.address(), tmp_path, 0, "--kill-at-step", "9", "--go", "go_1", restart=1)
        finals = [start(processes, relaunched.address(), tmp_path, 0, "--go", "go_all", restart=2),
                  start(processes, relaunched.address(), tmp_path, 1, "--go", "go_all", restart=1)]
        assert leader.wait(timeout=80) == -9, logs(tmp_path)

        def saved_by_group_1() -> bool:  # rank zero while group 0 is away
            assert other.poll() is None, logs(tmp_path)
            return any(r["kind"] == "save" and r["group"] == 1 for r in records(tmp_path))

        wait_until(saved_by_group_1, 60, "group 1 wrote a checkpoint while group 0 was away", tmp_path)
        (tmp_path / "go_1").touch()
        assert other.wait(timeout=80) == -9 and leader_again.wait(timeout=30) == -9, logs(tmp_path)
        (tmp_path / "go_all").touch()
        for proc in finals:
            assert proc.wait(timeout=80) == 0, logs(tmp_path)

    rows = records(tmp_path)
    pids = {}  # (group, restart) -> pid
    starts = {}
    for r in rows:
        if r["kind"] == "start":
            pids[(r["group"], r["restart"])] = r["pid"]
            starts[(r["group"], r["restart"])] = r["step"]
    assert set(pids) == {(0, 0), (1, 0), (0, 1), (0, 2), (1, 1)}, logs(tmp_path)

    # one writer per checkpoint event: rank zero of its step, whichever group that was
    events = assert_one_writer_per_event(rows)
    writer = {step: (save["group"], save["pid"]) for step, save in events.items()}
    assert writer[2] == (0, pids[(0, 0)]) and writer[4] == (1, pids[(1, 0)]), writer
    assert writer[12] == (0, pids[(0, 2)]), writer
    saves = [r for r in rows if r["kind"] == "save"]

    # the restarted leader resumed from a last.ckpt group 1 wrote (the shared folder), then healed
    group1_last = {r["step"] for r in saves if r["group"] == 1 and os.path.basename(r["path"]) == "last.ckpt"}
    assert starts[(0, 1)] in group1_last, (starts[(0, 1)], group1_last)
    # the whole job restarted from the last checkpoint before the kill: step 8, on both groups
    assert max(writer) == 12 and max(s for s in writer if s <= 9) == 8, writer
    assert starts[(0, 2)] == starts[(1, 1)] == 8, starts

    # every checkpoint of the run is in the one shared folder; none in a group's or a logger's folder
    shared = tmp_path / "checkpoints"
    assert {Path(r["path"]).parent for r in saves} == {shared}, {r["path"] for r in saves}
    assert {p.parent for p in tmp_path.rglob("*.ckpt")} == {shared}, sorted(map(str, tmp_path.rglob("*.ckpt")))
    summaries = {r["group"]: r for r in rows if r["kind"] == "summary"}
    assert set(summaries) == {0, 1}, logs(tmp_path)
    for s in summaries.values():
        assert s["step"] == 12 and s["best_k_models"] == summaries[0]["best_k_models"], summaries
        assert s["best_model_path"] == summaries[0]["best_model_path"] == str(shared / "epoch=2-step=6.ckpt")
    on_disk = sorted(str(p) for p in shared.glob("*.ckpt"))
    assert on_disk == sorted([*summaries[0]["best_k_models"], str(shared / "last.ckpt")]), on_disk
    last = torch.load(shared / "last.ckpt", weights_only=False)
    assert last["global_step"] == last["ft_manager"]["step"] == 12

    # logs stay per group: each step's line is written once, by the group that was rank zero then
    steps_by_group = lr_steps_by_group(summaries)
    assert steps_by_group.get(0) and steps_by_group.get(1), steps_by_group
    # the first start of each group found no checkpoint yet, and said so instead of failing
    assert all("found no checkpoint" in (tmp_path / f"group{g}.log").read_text() for g in (0, 1)), logs(tmp_path)
