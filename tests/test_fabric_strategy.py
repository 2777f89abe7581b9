"""`Fabric(strategy="fault_tolerant_ddp")`: two real Fabric processes on CPU and a loopback lighthouse;
one group is SIGKILLed and restarted, heals, and both end identical. (tests/_fabric_worker.py)"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess

import pytest
import torch
from conftest import REPO_ROOT, child_env
from ft_harness import healthy_members, wait_until

WORKER = os.path.join(REPO_ROOT, "tests", "_fabric_worker.py")


def start_group(processes, address: str, out, group: int, *args: str, groups: int = 2) -> subprocess.Popen:
    env = child_env(FT_LIGHTHOUSE=address, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS=str(groups),
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


@pytest.mark.timeout(150)
def test_a_group_killed_mid_reduction_costs_the_fabric_survivors_no_step(processes, tmp_path):
    """3 groups (redo on by default for groups of one rank): group 2 is SIGKILLed while the survivors'
    reduction of a step all three take part in waits for its contribution. The survivors redo it without
    the dead group (one redo each, no step left uncommitted); the restarted group heals; all end identical."""
    from ft_core.control.lighthouse import LighthouseServer

    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2_000, heartbeat_timeout_ms=2_000,
                          http_bind=None) as lighthouse:
        # The survivors hold before step 2 until every group is up (all three then take part), and before step 15
        # until the restarted group 2 is up (so they do not finish without it).
        def members(group: int) -> set[str]:
            return healthy_members(lighthouse, f"replica_group_{group}:")

        def group_2_members() -> set[str]:
            return members(2)

        holds = ("--hold", f"2:{tmp_path / 'joined'}", "--hold", f"15:{tmp_path / 'restarted'}")
        survivors = [start_group(processes, lighthouse.address(), tmp_path, g, "--steps", "20", *holds, groups=3)
                     for g in (0, 1)]
        victim = start_group(processes, lighthouse.address(), tmp_path, 2, "--steps", "20",
                             "--kill-in-reduction-at-step", "5", groups=3)
        wait_until(lambda: all(members(g) for g in range(3)), 90, "every group's Manager")
        (tmp_path / "joined").write_text("")
        assert victim.wait(timeout=100) == -9, logs(tmp_path)
        kill_step = int(re.search(r"SIGKILL self in the reduction of step (\d+)",
                                  (tmp_path / "group2.log").read_text()).group(1))
        assert kill_step < 15, logs(tmp_path)
        before = group_2_members()
        restarted = start_group(processes, lighthouse.address(), tmp_path, 2, "--steps", "20", groups=3)
        wait_until(lambda: group_2_members() - before, 90, "the restarted group's Manager")
        (tmp_path / "restarted").write_text("")
        for proc in (*survivors, restarted):
            assert proc.wait(timeout=120) == 0, logs(tmp_path)

    runs = {g: json.loads((tmp_path / f"summary_g{g}.json").read_text()) for g in range(3)}
    for g in (0, 1):
        assert runs[g]["step"] == 20 and runs[g]["events"].get("redo") == 1, runs[g]
        assert "step not committed" not in (tmp_path / f"group{g}.log").read_text(), logs(tmp_path)
    assert runs[2]["step"] == 20 and runs[2]["events"].get("heal") == 1, runs[2]
    weights = [torch.load(tmp_path / f"weights_g{g}.pt") for g in range(3)]
    for other in weights[1:]:
        for name in weights[0]:
            assert torch.equal(weights[0][name], other[name]), name


FABRIC_LEDGER = os.path.join(REPO_ROOT, "tests", "_fabric_ledger_worker.py")


@pytest.mark.timeout(120)
def test_fabric_every_group_killed_at_once_resumes_from_fabric_save(processes, tmp_path):
    """Three Fabric groups with the exactly-once sampler save `fabric.save(path, {model, optimizer})`
    every 4 committed steps (it adds the Manager's step and the sampler's position); all three are
    SIGKILLed at once mid-epoch (each held after committing step 14 of 20, so none can finish first) and
    restarted with `fabric.load`: each resumes at its file's step and position, and the ledger from there
    (tests/test_data_ledger.py's check) loses and repeats nothing."""
    import time

    from test_data_ledger import LedgerGroup, check_ledger

    from ft_core.control.lighthouse import LighthouseServer

    size = 120  # 10 steps an epoch with 3 groups of batch 4
    ckpt, release = tmp_path / "ckpt", tmp_path / "release"
    args = ["--epochs", "2", "--size", str(size), "--step-sleep", "0.02", "--save", str(ckpt), "--save-every", "4",
            "--resume", "--hold", f"14:{release}"]
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=3, join_timeout_ms=5000, http_bind=None) as lighthouse:
        gs = [LedgerGroup(processes, tmp_path, g, 3, lighthouse.address(), args, worker=FABRIC_LEDGER)
              for g in range(3)]
        try:
            for g in gs:
                g.start()
            deadline = time.monotonic() + 80
            while not all(os.path.exists(f"{ckpt}.g{g.group}") and g.last_step() >= 14 for g in gs):
                assert time.monotonic() < deadline, "no fabric.save written: " + gs[0].output()[-3000:]
                assert all(g.proc.poll() is None for g in gs), [g.output()[-2000:] for g in gs]
                time.sleep(0.1)
            for g in gs:
                g.kill()
            release.touch()  # the restarted incarnations pass step 14
            saved = {g.group: torch.load(f"{ckpt}.g{g.group}", weights_only=True) for g in gs}
            for g in gs:
                g.start()
            for g in gs:
                assert g.proc.wait(timeout=80) == 0, g.output()[-3000:]
        finally:
            for g in gs:
                if g.proc is not None and g.proc.poll() is None:
                    g.kill()
    for g in gs:
        file = saved[g.group]
        assert {"model", "optimizer", "ft_manager", "ft_data"} <= set(file), sorted(file)
        assert file["ft_manager"]["step"] >= 4 and file["ft_manager"]["step"] % 4 == 0, file["ft_manager"]
        assert file["ft_data"]["position"]["step"] == file["ft_manager"]["step"]
        start = g._rows("start")[0]  # the restarted incarnation's first line, before its first step
        assert start["step"] == file["ft_manager"]["step"], (start, file["ft_manager"])
        position = hashlib.sha1(json.dumps(file["ft_data"]["position"]).encode()).hexdigest()[:16]
        assert start["position"] == position, "the sampler did not resume at the saved data position"
    verdict = check_ledger(tmp_path, size)
    assert sorted(verdict) == [0, 1], verdict
