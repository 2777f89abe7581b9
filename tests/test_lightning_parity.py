"""Lightning behaviour a DDP user expects, with real replica groups (processes on loopback):
`fit(ckpt_path="last")` resumes from the job's checkpoint folder (`<default_root_dir>/checkpoints`, shared
by the groups under the default rank_zero="quorum"), a restarted group continues its checkpoint and its own
log folder, and a group that heals into a later epoch gets its epoch-start hooks."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO_ROOT, child_env
from ft_harness import read_jsonl

from ft_core.control.lighthouse import LighthouseServer

WORKER = os.path.join(REPO_ROOT, "tests", "_lightning_parity_worker.py")


def start(processes, tmp_path, lighthouse: str, group: int, groups: int, name: str, *extra: str,
          restart: int = 0) -> tuple[subprocess.Popen, str]:
    env = child_env(FT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS=str(groups),
                    FT_RESTART_COUNT=str(restart))
    events = os.path.join(str(tmp_path), f"{name}.jsonl")
    log = open(os.path.join(str(tmp_path), f"{name}.out"), "w")  # noqa: SIM115 (the child keeps it)
    proc = processes.spawn([sys.executable, WORKER, "--out", str(tmp_path), "--events", events, *extra], env=env,
                           stdout=log, stderr=subprocess.STDOUT)
    return proc, events


def output(tmp_path, name: str) -> str:
    with open(os.path.join(str(tmp_path), f"{name}.out")) as f:
        return f.read()


@pytest.mark.timeout(120)
def test_restart_resumes_from_last_in_the_job_checkpoint_folder_and_continues_the_run(processes, tmp_path):
    with LighthouseServer(min_replicas=1, join_timeout_ms=500) as lighthouse:
        first, _ = start(processes, tmp_path, lighthouse.address(), 0, 1, "first", "--kill-at-step", "9")
        assert first.wait(timeout=90) == -9, output(tmp_path, "first")[-3000:]
        second, events = start(processes, tmp_path, lighthouse.address(), 0, 1, "second", restart=1)
        assert second.wait(timeout=90) == 0, output(tmp_path, "second")[-3000:]
    group = os.path.join(str(tmp_path), "replica_group_0")
    resumed = read_jsonl(events)
    # ckpt_path="last" found checkpoints/last.ckpt: training went on from step 8 (saved every 2
    # steps; the first batch after it ends at step 9), the Manager's step with it
    assert resumed[0] == {"kind": "train_start", "step": 8, "manager_step": 8}, resumed[:3]
    assert resumed[1] == {"kind": "batch", "epoch": 1, "step": 9}, resumed[:3]
    assert "there is no last checkpoint" not in output(tmp_path, "second")
    assert not glob.glob(os.path.join(group, "**", "*.ckpt"), recursive=True)  # none in the group's own folder
    ckpts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(str(tmp_path), "checkpoints", "*.ckpt")))
    assert not [c for c in ckpts if "-v" in c], ckpts  # no last-v1.ckpt: the run's own last.ckpt was updated
    assert len([c for c in ckpts if c != "last.ckpt"]) == 2, ckpts  # save_top_k=2 holds across the restart
    versions = sorted(os.path.basename(p) for p in glob.glob(os.path.join(group, "lightning_logs", "version_*")))
    assert versions == ["version_0"], versions  # the CSV log continues, no version_1
    with open(os.path.join(group, "lightning_logs", "version_0", "metrics.csv")) as f:
        steps = [line.split(",") for line in f.read().splitlines()[1:]]
    assert len(steps) > 12, "the restarted group appended to the killed run's metrics"


@pytest.mark.timeout(180)
def test_a_group_healing_into_a_later_epoch_gets_its_epoch_start_hooks(processes, tmp_path):
    # The early group is held in its first batch of epoch 2 by a gate file until the late group waits for a
    # quorum with it (the lighthouse waits for the early one, which holds a later step: quorum rule 9), so the
    # late group heals into epoch >= 2 however long its start-up takes on a busy machine.
    gate = tmp_path / "gate"
    gate.write_text("")
    with LighthouseServer(min_replicas=1, join_timeout_ms=500) as lighthouse:
        early, early_events = start(processes, tmp_path, lighthouse.address(), 0, 2, "early", "--epochs", "6",
                                    "--sleep", "0.05", "--gate", str(gate), "--gate-epoch", "2")
        deadline = time.monotonic() + 60
        while not any(r["kind"] == "epoch_start" and r["epoch"] >= 2 for r in read_jsonl(early_events)):
            assert time.monotonic() < deadline and early.poll() is None, output(tmp_path, "early")[-3000:]
            time.sleep(0.1)
        # a new group with no checkpoint to start from (not the early group's: it would resume mid-epoch, where
        # Lightning runs no epoch-start hook)
        late, late_events = start(processes, tmp_path, lighthouse.address(), 1, 2, "late", "--epochs", "6",
                                  "--no-resume")
        deadline = time.monotonic() + 90
        while not any(m["waiting"] and not m["in_quorum"] for m in lighthouse.core.status()["members"]):  # the late one
            assert time.monotonic() < deadline and late.poll() is None, output(tmp_path, "late")[-3000:]
            time.sleep(0.1)
        gate.unlink()
        assert late.wait(timeout=120) == 0, output(tmp_path, "late")[-3000:]
        assert early.wait(timeout=60) == 0, output(tmp_path, "early")[-3000:]
    seen = read_jsonl(late_events)
    started = set()
    for row in seen:
        if row["kind"] == "train_start":
            continue
        if row["kind"] == "epoch_start":
            started.add(row["epoch"])
        else:  # every epoch the late group trained in had its epoch-start hook first
            assert row["epoch"] in started, (row, seen[:5])
    healed_into = min(r["epoch"] for r in seen if r["kind"] == "batch")
    assert healed_into >= 2 and healed_into in started, seen[:5]
