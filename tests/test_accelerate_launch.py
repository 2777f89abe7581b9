"""`ftl accelerate launch` end to end: real replica groups (examples/accelerate_train.py) against a
loopback lighthouse in this process, settings from our config file or from the environment,
one and two processes per group, a group SIGKILLed and restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, Processes, child_env
from proctree import descendants, still_running

from ft_core.control.lighthouse import LighthouseServer
from ft_lightning.accelerate import cli
from ft_lightning.accelerate.plugin import SETTINGS

EXAMPLE = os.path.join(REPO_ROOT, "examples", "accelerate_train.py")
FT_ENV = [s.env for s in SETTINGS] + ["TORCHFT_LIGHTHOUSE", "TORCHFT_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC",
                                      "TORCHFT_CONNECT_TIMEOUT_SEC", "ACCELERATE_USE_CPU"]


@pytest.fixture
def lighthouse() -> str:
    """Quorums need both groups: a survivor waits in the quorum for a restarted peer instead of
    finishing alone first, however slow the restart on a busy machine."""
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, http_bind=None) as server:
        yield server.address()


def group_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A worker environment with no fault-tolerance setting of its own and no Accelerate config."""
    env = child_env(HF_HOME=str(tmp_path / "hf"))
    for name in FT_ENV:
        env.pop(name, None)
    env.update(extra)
    return env


def launch(processes: Processes, tmp_path: Path, name: str, args: list[str], env: dict[str, str]
           ) -> tuple[subprocess.Popen, Path]:
    """`ftl accelerate launch ARGS`, output in tmp_path/NAME.log."""
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        proc = processes.spawn([sys.executable, "-m", "ft_core", "accelerate", "launch", *args], env=env,
                               stdout=out, stderr=subprocess.STDOUT, cwd=str(tmp_path))
    return proc, log


def wait_all(procs: list[tuple[subprocess.Popen, Path]], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    for proc, log in procs:
        try:
            proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{log.name} still running after {deadline_s}s:\n{log.read_text()[-3000:]}")
        assert proc.returncode == 0, f"{log.name} exited {proc.returncode}:\n{log.read_text()[-3000:]}"


def wait_for_line(log: Path, text: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if log.exists() and text in log.read_text():
            return
        time.sleep(0.05)
    pytest.fail(f"{log.name} never printed {text!r}:\n{log.read_text()[-3000:]}")


def results(out: Path) -> dict[str, tuple[dict, dict]]:
    """{"group0_rank0": (stats, final state), ...} as written by the example's --out-dir."""
    found = {}
    for stats_file in sorted(out.glob("*.json")):
        state = torch.load(stats_file.with_suffix(".pt"), weights_only=True)
        found[stats_file.stem] = (json.loads(stats_file.read_text()), state)
    return found


def assert_identical(a, b, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_all_identical(found: dict[str, tuple[dict, dict]]) -> None:
    names = sorted(found)
    for name in names[1:]:
        assert_identical(found[names[0]][1], found[name][1], f"{names[0]} vs {name}")


@pytest.mark.timeout(90)
def test_environment_settings_reach_two_groups_of_two_processes_that_end_identical(tmp_path, processes, lighthouse):
    out = tmp_path / "out"
    out.mkdir()
    groups = []
    for g in (0, 1):
        env = group_env(tmp_path, FT_LIGHTHOUSE=lighthouse, NUM_REPLICA_GROUPS="2", REPLICA_GROUP_ID=str(g),
                        FT_TIMEOUT_SEC="15", FT_QUORUM_TIMEOUT_SEC="30")
        groups.append(launch(processes, tmp_path, f"group{g}",
                             ["--cpu", "--num_processes", "2", "--main_process_port", "0", EXAMPLE, "--steps", "4",
                              "--out-dir", str(out)], env))
    wait_all(groups, 80)
    found = results(out)
    assert sorted(found) == ["group0_rank0", "group0_rank1", "group1_rank0", "group1_rank1"]
    for name, (stats, _) in found.items():
        assert stats["sources"]["lighthouse"] == "env FT_LIGHTHOUSE" and stats["settings"]["timeout"] == 15.0
        assert stats["step"] == 4 and stats["cross_group_allreduces"] == stats["windows"], name
    assert_all_identical(found)


@pytest.mark.timeout(100)
def test_config_file_groups_survive_a_kill_heal_end_identical_and_allreduce_once_per_accumulated_step(
        tmp_path, processes, lighthouse):
    config = tmp_path / "fault_tolerance.yaml"
    assert cli.main(["config", "--no-input", "--config-file", str(config), "--lighthouse", lighthouse,
                     "--num-replica-groups", "2", "--timeout", "15", "--quorum-timeout", "50"]) == 0
    out = tmp_path / "out"
    out.mkdir()
    env = group_env(tmp_path)

    def start(g: int, name: str) -> tuple[subprocess.Popen, Path]:
        return launch(processes, tmp_path, name, ["--ft-config", str(config), "--replica-group-id", str(g), EXAMPLE,
                                                  "--steps", "8", "--grad-accum", "4", "--step-sleep", "0.1",
                                                  "--log-every", "1", "--out-dir", str(out)], env)

    survivor, victim = start(0, "group0"), start(1, "group1")
    wait_for_line(victim[1], "group 1: step 3 ", 60)
    os.killpg(victim[0].pid, signal.SIGKILL)  # the launcher and its worker, mid-run
    victim[0].wait(timeout=10)
    restarted = start(1, "group1_restarted")
    wait_all([survivor, restarted], 80)

    found = results(out)
    assert sorted(found) == ["group0_rank0", "group1_rank0"]
    healed, _ = found["group1_rank0"]
    assert healed["heals"] >= 1 and "healed at step" in restarted[1].read_text()
    samples = {stats["samples"] for stats, _ in found.values()}
    assert len(samples) == 1, f"the registered Progress object was not healed: {samples}"
    for name, (stats, _) in found.items():
        # The config file's settings reached the worker (exported by the launcher as FT_* variables).
        assert stats["settings"]["lighthouse"] == lighthouse and stats["settings"]["timeout"] == 15.0
        assert stats["sources"]["timeout"] == "env FT_TIMEOUT_SEC" and stats["settings"]["quorum_timeout"] == 50.0
        assert stats["step"] == 8, name
        # Gradient accumulation 4: one cross-group allreduce per optimizer step, none per micro-batch.
        assert stats["micro_batches"] == 4 * stats["windows"], name
        assert stats["cross_group_allreduces"] == stats["windows"], name
    assert_all_identical(found)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kill", ["its process group", "the launcher alone"])
def test_a_kill_of_the_launcher_ends_every_worker_it_started(tmp_path, processes, kill):
    # torchrun starts workers in sessions of their own; they must stay in the launcher's process group,
    # or a killed group's workers live on and meet the group's next incarnation in the quorum.
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_bind=None) as server:
        env = group_env(tmp_path, FT_LIGHTHOUSE=server.address(), REPLICA_GROUP_ID="0")
        proc, log = launch(processes, tmp_path, "group0", ["--cpu", "--num_processes", "2", "--main_process_port",
                                                          "0", EXAMPLE, "--steps", "100000", "--step-sleep", "0.05",
                                                          "--log-every", "1"], env)
        wait_for_line(log, "group 0: step 2 ", 60)
        workers = descendants(proc.pid)
        try:
            assert len(workers) >= 2, workers
            groups = {os.getpgid(pid) for pid, _ in still_running(workers)}
            if kill == "its process group":
                os.killpg(proc.pid, signal.SIGKILL)
            else:  # only the launcher: its workers must not outlive it either
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            end = time.monotonic() + 10
            while still_running(workers) and time.monotonic() < end:
                time.sleep(0.05)
            assert groups == {proc.pid}, f"workers in process groups {groups}, not the launcher's {proc.pid}"
            assert still_running(workers) == set(), log.read_text()[-2000:]
        finally:
            for pid, _ in still_running(workers):  # ours (checked by start time): never leave one behind
                os.kill(pid, signal.SIGKILL)
