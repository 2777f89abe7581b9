"""`FaultTolerantDiLoCoStrategy` ("fault_tolerant_diloco") with two Trainer processes, for `lightning.pytorch`
and the standalone `pytorch_lightning`: Streaming DiLoCo (two fragments, delay 1, alpha 0.5); one group is
SIGKILLed mid-epoch and restarted, heals at a sync, and both end with identical global parameters and outer
optimizer state; every group sends exactly one cross-group allreduce per sync (bucketized pseudo-gradients).
`run_kill_restart` is shared with tests/test_fabric_diloco.py (the same worker, in Fabric), and `kill_restart`
with tests/test_accelerate_diloco.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import child_env

from ft_core.control.lighthouse import LighthouseServer

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lightning_diloco_worker.py")


def start(processes, lighthouse, out, worker: str, group: int, incarnation: int, *args: str) -> subprocess.Popen:
    env = child_env(FT_LIGHTHOUSE=lighthouse.address(), REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2",
                    FT_TIMEOUT_SEC="20", FT_QUORUM_TIMEOUT_SEC="90", FT_CONNECT_TIMEOUT_SEC="30",
                    PYTHONWARNINGS="ignore")
    log = open(os.path.join(out, f"g{group}.i{incarnation}.log"), "w")  # noqa: SIM115 (the child keeps it)
    return processes.python(worker, "--out", str(out), "--group", str(group), "--incarnation", str(incarnation),
                            *args, env=env, stdout=log, stderr=subprocess.STDOUT)


def logs(out) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.glob("*.log")))


def kill_restart(processes: Any, out: Path, worker: str, kill_at_step: int, *args: str) -> tuple[dict, dict]:
    """Two groups of `worker`; group 1 is SIGKILLed after inner step `kill_at_step` and restarted. Checks
    what every DiLoCo integration must give and returns both survivors' summaries."""
    with LighthouseServer(min_replicas=2, join_timeout_ms=2_000, heartbeat_timeout_ms=2_000,
                          http_bind=None) as lighthouse:
        g0 = start(processes, lighthouse, out, worker, 0, 1, *args)
        victim = start(processes, lighthouse, out, worker, 1, 1, *args, "--kill-at-step", str(kill_at_step))
        assert victim.wait(timeout=80) == -9, logs(out)
        g1 = start(processes, lighthouse, out, worker, 1, 2, *args)
        for proc in (g0, g1):
            try:
                proc.wait(timeout=80)
            except subprocess.TimeoutExpired:
                pytest.fail(f"a group did not finish:\n{logs(out)}")
            assert proc.returncode == 0, logs(out)
    s0 = json.loads((out / "summary_g0_i1.json").read_text())
    s1 = json.loads((out / "summary_g1_i2.json").read_text())
    assert s1["heals"] >= 1
    # identical global parameters and outer optimizer state in both groups
    assert s0["fragments"] == s1["fragments"] and len(s0["fragments"]) == 2
    for s in (s0, s1):
        # one cross-group collective per sync and none per inner step (a sync around the kill may fail
        # before its collective is issued, when the group was already broken)
        assert s["votes"] - 1 <= s["allreduces"] <= s["votes"], s
    return s0, s1


def run_kill_restart(processes: Any, out: Path, framework: str) -> tuple[dict, dict]:
    """`kill_restart` of the worker in `framework`, group 1 killed after inner step 5."""
    s0, s1 = kill_restart(processes, out, WORKER, 5, "--framework", framework)
    # 2 epochs x 8 batches per group = 16 inner steps; a fragment sync every 2 of them
    assert s0["global_step"] == s1["global_step"] == 16
    # 8 syncs, less the one the kill may have failed (the victim died with its allreduce in flight)
    assert s0["manager_step"] == s1["manager_step"] and s0["manager_step"] in (7, 8)
    return s0, s1


@pytest.mark.timeout(110)
@pytest.mark.parametrize("framework", [
    "trainer",
    pytest.param("pytorch_lightning", marks=pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None,
                                                               reason="pytorch_lightning is not installed")),
])
def test_diloco_trainer_kill_restart_heals_identical_and_one_allreduce_per_sync(processes, tmp_path, framework):
    run_kill_restart(processes, tmp_path, framework)
