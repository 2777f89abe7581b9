"""The typical Accelerate loop, `for epoch in range(N): for batch in loader:` with an epoch-level
scheduler, under a kill and restart: the restarted group heals into the job's epoch and batch (its
loader ends the healed epochs; its scheduler does not step for them) and ends identical to the
survivor, at the same step, instead of re-running every epoch."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from conftest import REPO_ROOT, child_env

from ft_core.control.lighthouse import LighthouseServer

WORKER = os.path.join(REPO_ROOT, "tests", "_accelerate_epochs_worker.py")


def start(processes, tmp_path, lighthouse: str, group: int, name: str, *extra: str) -> subprocess.Popen:
    env = child_env(FT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2",
                    FT_TIMEOUT_SEC="5", FT_QUORUM_TIMEOUT_SEC="60")
    log = open(os.path.join(str(tmp_path), f"{name}.out"), "w")  # noqa: SIM115 (the child keeps it)
    return processes.spawn([sys.executable, WORKER, "--events", os.path.join(str(tmp_path), f"{name}.jsonl"),
                            "--out", os.path.join(str(tmp_path), f"{name}.json"), *extra], env=env, stdout=log,
                           stderr=subprocess.STDOUT)


def text(tmp_path, name: str) -> str:
    with open(os.path.join(str(tmp_path), name)) as f:
        return f.read()


def wait_for_rows(log: pathlib.Path, proc: subprocess.Popen, done: Callable[[list[dict]], bool], what: str,
                  timeout: float = 60.0) -> None:
    """Wait (bounded) until `log`'s complete rows satisfy `done`, failing early if `proc` ended. The last line
    is left out: it may still be being written."""
    deadline = time.monotonic() + timeout
    while True:
        lines = log.read_text().splitlines()[:-1] if log.exists() else []
        if done([json.loads(line) for line in lines if line.strip()]):
            return
        assert proc.poll() is None, f"{log.name}'s process ended before {what}"
        assert time.monotonic() < deadline, f"{log.name}: no {what} after {timeout:.0f}s"
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_plain_epoch_loop_after_kill_and_restart_ends_identical(processes, tmp_path):
    with LighthouseServer(min_replicas=1, join_timeout_ms=500) as lighthouse:
        survivor = start(processes, tmp_path, lighthouse.address(), 0, "survivor", "--sleep", "0.5")
        # The victim starts once the survivor has committed a step: started together on a loaded machine, the
        # victim trained its first steps alone (min_replicas 1), the survivor then healed from it and the kill
        # came mid-heal, so the survivor's first iteration failed and it ended one step short (47 of 48).
        log = tmp_path / "survivor.jsonl"
        wait_for_rows(log, survivor, lambda rows: len(rows) >= 1, "a committed step")
        victim = start(processes, tmp_path, lighthouse.address(), 1, "victim", "--kill-at-step", "10")
        assert victim.wait(timeout=90) == -9, text(tmp_path, "victim.out")[-3000:]
        # Restart once the survivor is past its first epoch, so the heal has epochs to land across
        # (on a loaded machine the victim can die before the survivor got there).
        wait_for_rows(log, survivor, lambda rows: any(r.get("epoch", 0) >= 1 for r in rows), "a step in epoch 1")
        restarted = start(processes, tmp_path, lighthouse.address(), 1, "restarted")
        assert restarted.wait(timeout=90) == 0, text(tmp_path, "restarted.out")[-3000:]
        assert survivor.wait(timeout=60) == 0, text(tmp_path, "survivor.out")[-3000:]
    a = json.loads(text(tmp_path, "survivor.json"))
    b = json.loads(text(tmp_path, "restarted.json"))
    rows = [json.loads(line) for line in text(tmp_path, "restarted.jsonl").splitlines()]
    survivor_epoch = {r["step"]: r["epoch"] for r in map(json.loads, text(tmp_path, "survivor.jsonl").splitlines())}
    # rows[0] is the healing step (still in the restarted loop's epoch 0); from the next step on, the
    # plain loop's `epoch` is the survivor's for the same step
    assert rows[1]["epoch"] >= 1, f"the restarted group should have healed into a later epoch: {rows[:3]}"
    assert all(r["epoch"] == survivor_epoch[r["step"]] for r in rows[1:]), rows
    assert (b["step"], b["lr"], b["digest"]) == (a["step"], a["lr"], a["digest"])
    assert a["step"] == 6 * 8  # 6 epochs of 8 steps (64 samples, 2 groups, batch 4): nothing re-run
