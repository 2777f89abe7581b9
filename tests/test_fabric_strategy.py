"""`Fabric(strategy="fault_tolerant_ddp")`: two real Fabric processes on CPU and a loopback lighthouse;
one group is SIGKILLed and restarted, heals, and both end identical. (tests/_fabric_worker.py)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from conftest import REPO_ROOT, child_env

WORKER = os.path.join(REPO_ROOT, "tests", "_fabric_worker.py")


def start_group(processes, address: str, out, group: int, *args: str) -> subprocess.Popen:
    env = child_env(FT_LIGHTHOUSE=address, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2",
                    FT_TIMEOUT_SEC="30", FT_QUORUM_TIMEOUT_SEC="90", FT_CONNECT_TIMEOUT_SEC="30",
                    PYTHONWARNINGS="ignore")
    with open(out / f"group{group}.log", "ab") as log:
        return processes.python(WORKER, "--out", str(out), "--group", str(group), *args, env=env, stdout=log,
                                stderr=subprocess.STDOUT)


def logs(out) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(out.glob("group*.log")))


@pytest.mark.timeout(150)
def test_fabric_killed_group_heals_to_identical_weights(processes, tmp_path):
    from ft_core.control.lighthouse import LighthouseServer

    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2_000, heartbeat_timeout_ms=2_000,
                          http_bind=None) as lighthouse:
        survivor = start_group(processes, lighthouse.address(), tmp_path, 0, "--steps", "10")
        victim = start_group(processes, lighthouse.address(), tmp_path, 1, "--steps", "10", "--kill-at-step", "4")
        assert victim.wait(timeout=100) == -9, logs(tmp_path)
        restarted = start_group(processes, lighthouse.address(), tmp_path, 1, "--steps", "10")
        for proc in (survivor, restarted):
            assert proc.wait(timeout=120) == 0, logs(tmp_path)

    runs = {g: json.loads((tmp_path / f"summary_g{g}.json").read_text()) for g in (0, 1)}
    for group, run in runs.items():
        assert run["step"] == 10
        assert run["lr"] == pytest.approx(0.05 * 0.5 ** 3)  # the registered scheduler healed with the rest
        assert run["sampler"] == {"num_replicas": 2, "rank": group}
    assert runs[1]["events"]["heal"] == 1
    assert runs[0]["events"].get("heal", 0) == 0
    w0, w1 = (torch.load(tmp_path / f"weights_g{g}.pt") for g in (0, 1))
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name
    restarted_steps = [json.loads(line)["step"] for line in (tmp_path / "progress_g1.jsonl").read_text().splitlines()]
    assert restarted_steps[:4] == [1, 2, 3, 4] and restarted_steps[4] >= 5  # healed forward, not from 0
