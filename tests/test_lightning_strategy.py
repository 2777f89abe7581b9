"""`Trainer(strategy="fault_tolerant_ddp")`: real Trainer processes on CPU (one per group rank), a
loopback lighthouse in this process, replica groups configured from the environment only.

The training process is tests/_lightning_worker.py; it records progress, events and weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, child_env
from ft_harness import wait_until

WORKER = os.path.join(REPO_ROOT, "tests", "_lightning_worker.py")


# ---- rules, in-process (no Lightning import) -----------------------------------------------------

def _adam_state() -> dict:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()  # int keys, tuples, tensors


@pytest.mark.parametrize("value", [
    _adam_state(),
    {"python_rng": __import__("random").getstate(), "torch_rng": torch.get_rng_state()},
    {"nested": [(1, 2.5, None), {"a": True, 3: "x"}], "empty": {}, "path": "p"},
    {"__ft_tuple__": "a user key that looks like ours"},
])
def test_transport_encoding_round_trips(value):
    """What a healing group receives equals what was sent, keys and tuples included."""
    from ft_lightning._common import from_transport, to_transport

    encoded = to_transport(value)

    def only_transport_types(obj):
        if isinstance(obj, dict):
            assert all(isinstance(k, str) for k in obj)
            return all(only_transport_types(v) for v in obj.values())
        if isinstance(obj, list):
            return all(only_transport_types(v) for v in obj)
        return isinstance(obj, (torch.Tensor, bool, int, float, str, type(None)))

    assert only_transport_types(encoded)
    decoded = from_transport(encoded)

    def equal(a, b):
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, dict):
            return type(b) is dict and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        return a == b

    assert equal(value, decoded)


def test_transport_encoding_names_what_cannot_be_sent():
    from ft_lightning._common import to_transport

    with pytest.raises(TypeError, match=r"callback X\.fn holds a function"):
        to_transport({"fn": lambda: None}, where="callback X")


@pytest.mark.parametrize("env, kwargs, expected", [
    ({}, {}, {"replica_group_id": 0, "num_replica_groups": 1, "min_replica_size": 1, "backend": "auto",
                  "world_size_mode": "dynamic", "use_async_quorum": True}),
    ({"REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "3"}, {"replica_group_id": 0}, {"replica_group_id": 2}),
    ({"FT_BACKEND": "GLOO", "FT_ASYNC_QUORUM": "0"}, {"cross_group_backend": "nccl"},
     {"backend": "gloo", "use_async_quorum": False}),
    ({"FT_WORLD_SIZE_MODE": "fixed-with-spares", "FT_MIN_REPLICA_SIZE": "2"}, {},
     {"world_size_mode": "fixed_with_spares", "min_replica_size": 2}),
    ({}, {"timeout": 7, "lighthouse_addr": "127.0.0.1:1"}, {"lighthouse_addr": "127.0.0.1:1"}),
])
def test_settings_resolve_environment_over_arguments(monkeypatch, env, kwargs, expected):
    from ft_lightning._common import FTSettings

    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "FT_BACKEND", "FT_ASYNC_QUORUM", "FT_WORLD_SIZE_MODE",
                 "FT_MIN_REPLICA_SIZE", "FT_LIGHTHOUSE", "FT_TIMEOUT_SEC", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = FTSettings.resolve(**kwargs)
    for key, value in expected.items():
        assert getattr(settings, key) == value, key


@pytest.mark.parametrize("env, kwargs, message", [
    ({"REPLICA_GROUP_ID": "2"}, {}, "NUM_REPLICA_GROUPS"),
    ({}, {"cross_group_backend": "mpi"}, "gloo|nccl"),
    ({"NUM_REPLICA_GROUPS": "zero"}, {}, "NUM_REPLICA_GROUPS"),
    ({}, {"min_replica_size": 0}, "FT_MIN_REPLICA_SIZE"),
])
def test_settings_errors_name_the_fix(monkeypatch, env, kwargs, message):
    from ft_core.errors import ConfigError
    from ft_lightning._common import FTSettings

    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "FT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        FTSettings.resolve(**kwargs)


def test_gated_scheduler_skips_and_keeps_its_state_dict():
    """The gate swaps the class (isinstance still holds) and adds nothing to the scheduler's state."""
    from types import SimpleNamespace

    from ft_lightning._progress import gate_step_schedulers

    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    epoch_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    keys = set(scheduler.state_dict())
    allow = [False]
    trainer = SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(interval="step", scheduler=scheduler),
                                                    SimpleNamespace(interval="epoch", scheduler=epoch_scheduler)])
    assert gate_step_schedulers(trainer, lambda: allow[0]) == 1
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and type(epoch_scheduler) is torch.optim.lr_scheduler.StepLR
    optimizer.step()
    scheduler.step()
    assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 1.0
    allow[0] = True
    scheduler.step()
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == 0.5
    assert set(scheduler.state_dict()) == keys


def test_counters_shift_by_what_happened_since_step_start():
    """new = source at step start + (local now - local at step start), bools kept local."""
    from ft_lightning._progress import _shift

    source = {"ready": 11, "completed": 10, "is_last_batch": False, "total": {"ready": 41}}
    before = {"ready": 1, "completed": 0, "is_last_batch": False, "total": {"ready": 1}}
    now = {"ready": 4, "completed": 3, "is_last_batch": True, "total": {"ready": 4}}
    assert _shift(source, now, before) == {"ready": 14, "completed": 13, "is_last_batch": True, "total": {"ready": 44}}


def test_sampler_skip_starts_the_next_pass_k_batches_in_once():
    from torch.utils.data import DataLoader, DistributedSampler

    from ft_lightning._data import _arm_skip

    data = list(range(20))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True,
                                                                       seed=3))
    full = [b.tolist() for b in loader]
    assert _arm_skip(loader, 2)
    assert isinstance(loader.sampler, DistributedSampler)
    assert [b.tolist() for b in loader] == full[2:]
    assert [b.tolist() for b in loader] == full  # one pass only


def test_forget_unscale_lets_a_skipped_step_unscale_again():
    from ft_lightning._common import forget_unscale

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(model(torch.randn(3, 2)).sum()).backward()
    scaler.unscale_(optimizer)  # e.g. gradient clipping, then the step is not committed
    forget_unscale(scaler, optimizer)
    optimizer.zero_grad()
    scaler.scale(model(torch.randn(3, 2)).sum()).backward()
    scaler.unscale_(optimizer)  # would raise "unscale_() has already been called" without it
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 256.0


@pytest.mark.parametrize("rank_zero, per_group, dirpath, checkpoints, root", [
    # the default: one checkpoint folder for the job (not the logger's per-group version folder)
    ("quorum", True, None, "checkpoints", "replica_group_1"),
    ("quorum", True, "ck", "ck", "replica_group_1"),  # an explicit dirpath stays shared
    ("quorum", False, None, "checkpoints", ""),  # per_group_dirs=False: the checkpoints still shared
    # the opt-out: everything per group (no dirpath: Lightning's default under the group's logger)
    ("group", True, "ck", "ck/replica_group_1", "replica_group_1"),
    ("group", True, None, None, "replica_group_1"),
])
def test_checkpoint_and_log_folders_of_each_rank_zero_mode(tmp_path, rank_zero, per_group, dirpath, checkpoints,
                                                            root):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from ft_lightning._dirs import apply_dirs

    base = os.path.realpath(tmp_path)
    callback = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(base, dirpath) if dirpath else None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, default_root_dir=base, logger=CSVLogger(base),
                         callbacks=[callback], enable_progress_bar=False, enable_model_summary=False)
    for _ in range(2):  # idempotent: applied before ckpt_path="last" is resolved, and again at set-up
        apply_dirs(trainer, "replica_group_1", per_group=per_group, shared_checkpoints=rank_zero == "quorum")
    assert callback.dirpath == (os.path.join(base, checkpoints) if checkpoints else None)
    assert trainer.default_root_dir == os.path.normpath(os.path.join(base, root))
    assert trainer.logger.save_dir == os.path.normpath(os.path.join(base, root))  # logs: per group


# ---- real Trainer processes ------------------------------------------------------------------------

@pytest.fixture
def lighthouse():
    from ft_core.control.lighthouse import LighthouseServer

    # min_replicas=2: a step needs both groups, so a killed group's peer waits for its restart
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2_000, heartbeat_timeout_ms=2_000,
                          http_bind=None) as server:
        yield server


def start_group(processes, lighthouse, out: Path, group: int, *args: str, groups: int = 2,
                cuda_device: str | None = None) -> subprocess.Popen:
    env = child_env(FT_LIGHTHOUSE=lighthouse.address(), REPLICA_GROUP_ID=str(group),
                    NUM_REPLICA_GROUPS=str(groups), FT_TIMEOUT_SEC="30", FT_QUORUM_TIMEOUT_SEC="90",
                    FT_CONNECT_TIMEOUT_SEC="30", PYTHONWARNINGS="ignore")
    if cuda_device is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_device
    with open(out / f"group{group}.log", "ab") as log:  # the child keeps its own copy of the descriptor
        return processes.python(WORKER, "--out", str(out), "--group", str(group), *args, env=env, stdout=log,
                                stderr=subprocess.STDOUT)


def wait_all(procs: list[subprocess.Popen], out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"replica group did not finish within {timeout}s; logs:\n{logs(out)}")
    bad = [p.returncode for p in procs if p.returncode != 0]
    assert not bad, f"exit codes {bad}; logs:\n{logs(out)}"


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(out.glob("group*.log")))


def summaries(out: Path) -> dict[tuple[int, int], dict]:
    return {(s["group"], s["rank"]): s for s in (json.loads(p.read_text()) for p in out.glob("summary_*.json"))}


def expected_batch_sum(group: int, epoch: int, batch_idx: int, groups: int = 2, samples: int = 128) -> float:
    """Sum of the inputs of batch `batch_idx` of `epoch` in `group`'s shard (the worker's data and seed)."""
    x = torch.randn(samples, 8, generator=torch.Generator().manual_seed(0))
    sampler = torch.utils.data.DistributedSampler(range(samples), num_replicas=groups, rank=group, shuffle=True,
                                                  seed=0)
    sampler.set_epoch(epoch)
    return float(x[list(sampler)[4 * batch_idx:4 * batch_idx + 4]].sum())


def assert_identical_weights(out: Path, expected: int) -> None:
    files = sorted(out.glob("weights_*.pt"))
    assert len(files) == expected, [f.name for f in files]
    reference = torch.load(files[0])
    for f in files[1:]:
        other = torch.load(f)
        for name, tensor in reference.items():
            assert torch.equal(tensor, other[name]), f"{f.name}: {name} differs from {files[0].name}"


@pytest.mark.timeout(200)
def test_accumulation_failed_step_kill_resume_and_heal(processes, lighthouse, tmp_path):
    """2 groups x 1 device, accumulate_grad_batches=4, 2 epochs of 4 optimizer steps, checkpoints every
    2 steps. Group 1 fails to commit step 2 (nothing changes there; it heals at the next step), then
    is SIGKILLed mid-epoch after step 5 and restarted with `ckpt_path="last"`: it resumes from the job's
    checkpoint (step 4, the Manager's step too), written by group 0 (rank zero) into the one folder the
    groups share, heals to the survivor's step and continues at the same epoch, batch and data. Both end
    identical, with global_step == committed steps; one quorum and one cross-group allreduce per
    optimizer step."""
    args = ("--accumulate", "4", "--epochs", "2", "--samples", "128", "--checkpoint")
    survivor = start_group(processes, lighthouse, tmp_path, 0, *args)
    victim = start_group(processes, lighthouse, tmp_path, 1, *args, "--fail-at-step", "1", "--kill-at-step", "5")
    assert victim.wait(timeout=150) == -9, logs(tmp_path)
    restarted = start_group(processes, lighthouse, tmp_path, 1, *args)
    wait_all([survivor, restarted], tmp_path, timeout=150)

    runs = summaries(tmp_path)
    assert set(runs) == {(0, 0), (1, 0)}
    assert_identical_weights(tmp_path, 2)
    steps = 2 * (128 // 2 // 4) // 4  # epochs * batches per group per epoch / accumulation = 8
    for (group, _), run in runs.items():
        assert run["global_step"] == run["manager_step"] == steps and run["epoch"] == 2, run
        assert run["lr"] == pytest.approx(0.05 * 0.5 ** (steps // 2))  # StepLR stepped on committed steps only
        assert run["samplers"] == {"train": [2, group], "val": [1, 0]}  # validation stays in the group
        assert run["root_dir"].endswith(f"replica_group_{group}")
    survivor_run, restarted_run = runs[(0, 0)], runs[(1, 0)]
    # per optimizer step, not per micro-batch: one quorum, one cross-group allreduce (one chunk), one vote
    assert survivor_run["events"]["quorum"] == survivor_run["events"]["commit"] == steps, survivor_run
    assert survivor_run["allreduces"] == steps and survivor_run["events"].get("heal", 0) == 0, survivor_run
    assert restarted_run["resumed_manager_step"] == 4  # from its checkpoint, before healing
    assert restarted_run["events"]["heal"] == 1 and restarted_run["events"]["quorum"] == steps - 5
    assert restarted_run["allreduces"] == steps - 5

    failed = json.loads((tmp_path / "failed_step_g1.json").read_text())
    before, after = failed["before"], failed["after"]
    assert before["global_step"] == after["global_step"] == 1
    for key in ("lr", "scheduler_epoch", "optimizer", "weights", "batches_stepped"):
        assert before[key] == after[key], key

    def progress(group: int) -> list[dict]:
        return [json.loads(line) for line in (tmp_path / f"progress_g{group}_r0.jsonl").read_text().splitlines()]

    restarted_steps = [p for p in progress(1) if p["pid"] == progress(1)[-1]["pid"]]
    position = [(p["global_step"], p["epoch"], p["batch_idx"]) for p in restarted_steps]
    # healed at the survivor's step 6 (epoch 1, batches 4-7), then in step with it
    assert position[0] == (6, 1, 7), position
    assert position == [(p["global_step"], p["epoch"], p["batch_idx"]) for p in progress(0)][-len(position):]
    for p in restarted_steps[1:]:  # after the healing step it reads its shard's batches of that epoch
        assert p["batch_sum"] == pytest.approx(expected_batch_sum(1, p["epoch"], p["batch_idx"]), abs=1e-4), p
    # one checkpoint folder for the job (no per-group copies); the files carry the Manager's step
    assert not list((tmp_path / "ckpts").glob("replica_group_*")), sorted(os.listdir(tmp_path / "ckpts"))
    saved = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=False)
    assert saved["ft_manager"]["step"] == saved["global_step"] == steps


@pytest.mark.timeout(110)
def test_a_group_restarted_on_a_machine_without_the_checkpoints_heals_from_a_live_peer(processes, lighthouse,
                                                                                       tmp_path):
    """Groups on two machines without a shared filesystem: group 1's checkpoint folder is on its own disk
    (--machine-dir), and group 0 is rank zero at every step, so every checkpoint is on group 0's. Group 1 is
    SIGKILLed after step 3 and restarted with ckpt_path="last": it finds no checkpoint on its disk, says so in
    a warning naming the folder and the shared-filesystem fix (no crash), starts without one and heals from
    group 0; both end identical."""
    machine = tmp_path / "machine_1"
    args = ("--epochs", "2", "--samples", "32", "--checkpoint")
    survivor = start_group(processes, lighthouse, tmp_path, 0, *args)
    victim = start_group(processes, lighthouse, tmp_path, 1, *args, "--machine-dir", str(machine), "--kill-at-step", "3")
    assert victim.wait(timeout=90) == -9, logs(tmp_path)
    restarted = start_group(processes, lighthouse, tmp_path, 1, *args, "--machine-dir", str(machine))
    wait_all([survivor, restarted], tmp_path, timeout=90)

    runs = summaries(tmp_path)
    assert set(runs) == {(0, 0), (1, 0)}
    assert_identical_weights(tmp_path, 2)
    steps = 2 * (32 // 2 // 4)  # epochs * batches per group per epoch = 8
    for run in runs.values():
        assert run["global_step"] == run["manager_step"] == steps, run
    assert runs[(1, 0)]["resumed_manager_step"] == 0 and runs[(1, 0)]["events"]["heal"] == 1, runs[(1, 0)]
    lines = [line for line in (tmp_path / "group1.log").read_text().splitlines()
             if 'fit(ckpt_path="last") found no checkpoint in' in line]
    assert len(lines) == 2, logs(tmp_path)  # its first start and its restart, one line each
    for line in lines:
        assert line.startswith("WARNING") and str(machine / "ckpts") in line and "on a filesystem they share" in line \
            and "heals from a live replica group" in line, line
    assert not list(machine.rglob("*.ckpt"))  # never rank zero: nothing on its disk
    assert torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=False)["ft_manager"]["step"] == steps


@pytest.mark.slow  # ~15 s; the kill test below checks the same 2 x 2 job (weights, samplers) in every suite
@pytest.mark.timeout(150)
def test_two_groups_two_devices_identical_weights(processes, lighthouse, tmp_path):
    """2 groups x 2 devices (gloo inside each group): every rank of every group ends identical."""
    args = ("--devices", "2", "--epochs", "1", "--samples", "32")
    procs = [start_group(processes, lighthouse, tmp_path, g, *args) for g in (0, 1)]
    wait_all(procs, tmp_path, timeout=140)

    runs = summaries(tmp_path)
    assert set(runs) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert_identical_weights(tmp_path, 4)
    for (group, rank), run in runs.items():
        assert run["world_size"] == 2  # Lightning's world is the group
        assert run["global_step"] == run["manager_step"] == 2
        assert run["samplers"] == {"train": [4, group * 2 + rank], "val": [2, rank]}


@pytest.mark.timeout(200)
def test_two_groups_two_devices_a_killed_group_restarts_heals_and_ends_identical(processes, lighthouse, tmp_path):
    """2 groups x 2 devices; both ranks of group 1 are SIGKILLed after step 3 (mid-epoch) and the group is
    started again without a checkpoint: each of its ranks heals once (from a live peer), the survivors never,
    and every rank of both groups ends with the same weights at the same step."""
    args = ("--devices", "2", "--epochs", "2", "--samples", "64", "--sleep", "0.05")
    survivor = start_group(processes, lighthouse, tmp_path, 0, *args)
    victim = start_group(processes, lighthouse, tmp_path, 1, *args, "--kill-at-step", "3")
    assert victim.wait(timeout=150) == -9, logs(tmp_path)
    restarted = start_group(processes, lighthouse, tmp_path, 1, *args)
    wait_all([survivor, restarted], tmp_path, timeout=170)

    runs = summaries(tmp_path)
    assert set(runs) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert_identical_weights(tmp_path, 4)
    steps = 2 * (64 // 2 // 2 // 4)  # epochs * batches per rank per epoch = 8
    for (group, rank), run in runs.items():
        assert run["world_size"] == 2 and run["global_step"] == run["manager_step"] == steps, run
        assert run["samplers"]["train"] == [4, group * 2 + rank], run
    for rank in (0, 1):
        assert runs[(1, rank)]["events"].get("heal", 0) == 1, runs[(1, rank)]
        assert runs[(0, rank)]["events"].get("heal", 0) == 0, runs[(0, rank)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("extra", [(), ("--log-sync",)], ids=["gradients", "a-logged-value-before-them"])
def test_a_group_killed_mid_reduction_costs_the_lightning_survivors_no_step(processes, lighthouse, tmp_path, extra):
    """3 groups x 1 device (redo on by default for groups of one rank): group 2 is SIGKILLed while the
    survivors' gradient reduction of a step all three take part in (step 5 or the first after it) waits for
    its contribution. The survivors redo the reduction without it (one replayed redo each, no step left
    uncommitted) and every group, the restarted one healed from a live peer, ends at the epochs' last step
    with the same weights. With FT_REDO_STEP=0 the survivors' step of the kill fails and they end one step
    short (checked by hand when this test was written). With `self.log(..., sync_dist=True)` in
    training_step the kill lands in that value's reduction, the step's first: the strategy keeps its input,
    so it is reduced again too (until 2026-12-06 nothing kept it and the step was lost)."""
    args = ("--epochs", "2", "--samples", "96", "--sleep", "0.02", *extra)
    # The survivors hold before step 2 until every group trains (all three then take part from about step 3 on),
    # and before step 12 until the restarted group 2 asks for its first quorum (so they do not finish without it).
    survivors = [start_group(processes, lighthouse, tmp_path, g, *args, "--hold", f"2:{tmp_path / 'joined'}",
                             "--hold", f"12:{tmp_path / 'release'}",
                             groups=3) for g in (0, 1)]
    victim = start_group(processes, lighthouse, tmp_path, 2, *args, "--kill-in-reduction-at-step", "5", groups=3)
    wait_until(lambda: all(list(tmp_path.glob(f"train_started_g{g}_*")) for g in range(3)), 90, "every group's start")
    (tmp_path / "joined").write_text("")
    assert victim.wait(timeout=150) == -9, logs(tmp_path)
    kill_step = int(re.search(r"SIGKILL self in the reduction of step (\d+)",
                              (tmp_path / "group2.log").read_text()).group(1))
    assert kill_step < 12, logs(tmp_path)
    restarted = start_group(processes, lighthouse, tmp_path, 2, *args, groups=3)
    # Waiting at the lighthouse, not only started: on a busy machine its first quorum can come after the four steps
    # the released survivors have left, and a group that asks after the job's end is refused (a flake, 2026-12-07)
    wait_until(lambda: any(m["replica_id"].startswith("replica_group_2:") and m["waiting"]
                           for m in lighthouse.core.status()["members"]), 90, "the restarted group's first quorum")
    (tmp_path / "release").write_text("")
    wait_all([*survivors, restarted], tmp_path, timeout=170)

    runs = summaries(tmp_path)
    assert set(runs) == {(0, 0), (1, 0), (2, 0)}
    assert_identical_weights(tmp_path, 3)
    steps = 2 * (96 // 3 // 4)  # epochs * batches per group per epoch = 16
    for g in (0, 1):
        run = runs[(g, 0)]
        assert run["global_step"] == run["manager_step"] == steps, (run, logs(tmp_path))
        assert run["events"].get("redo_replayed") == 1, run
        log = (tmp_path / f"group{g}.log").read_text()
        assert "step not committed" not in log, logs(tmp_path)
        healed_at = [int(step) for step in re.findall(r"ft: healed from group \d+ at step (\d+)", log)]
        assert all(step < kill_step for step in healed_at), healed_at  # at most the start's sync, not after the kill
    assert runs[(2, 0)]["events"].get("heal") == 1 and runs[(2, 0)]["global_step"] == steps, runs[(2, 0)]


@pytest.mark.cuda
@pytest.mark.timeout(200)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (one per replica group; NCCL allows one rank per device)")
def test_two_groups_on_cuda_with_nccl_identical_weights(processes, lighthouse, tmp_path):
    """The CUDA path: each group on its own GPU, NCCL inside and across groups (FT_BACKEND=auto)."""
    procs = []
    for group in (0, 1):
        proc = start_group(processes, lighthouse, tmp_path, group, "--accelerator", "gpu", "--epochs", "1",
                           "--samples", "64", cuda_device=str(group))
        procs.append(proc)
    wait_all(procs, tmp_path, timeout=180)
    assert_identical_weights(tmp_path, 2)
    for run in summaries(tmp_path).values():
        assert run["global_step"] == run["manager_step"] == 64 // 2 // 4

