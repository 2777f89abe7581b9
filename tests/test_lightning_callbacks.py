"""Callbacks and metrics over the live quorum (the strategy's default `rank_zero="quorum"`): real
Trainer processes on CPU, a loopback lighthouse in this process, a real SIGKILL and restart of the
group that is rank zero. The training process is tests/_lightning_callbacks_worker.py."""

from __future__ import annotations

import os
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from _trainer_groups import logs, lr_steps_by_group, records, start_group
from conftest import REPO_ROOT

WORKER = os.path.join(REPO_ROOT, "tests", "_lightning_callbacks_worker.py")
GROUPS = 3


def start(processes, address: str, out: Path, group: int, *args: str, restart: int = 0) -> subprocess.Popen:
    return start_group(processes, WORKER, address, out, group, GROUPS, *args, restart=restart)


@pytest.mark.timeout(110)
def test_one_writer_per_checkpoint_same_best_and_same_early_stop_through_a_kill(processes, tmp_path):
    """3 groups, the strategy's default rank_zero ("quorum"); group 0 (rank zero) is SIGKILLed in epoch 1
    and restarted; the others wait for it at epoch 2 (so it heals before the early stop). Each checkpoint
    event writes exactly one file, by group rank 0 of the lowest group that committed that step (group 1
    while group 0 is away, group 0 again after it healed); every group ends with the same top-k, best
    score and EarlyStopping state, at the same step, stopped early by EarlyStopping; `sync_dist` values
    are the same on every group. Two steps per epoch, and the restart is started ahead (its imports done
    while the others train, --go), so a busy 2-core machine spends its time on the run, not on imports."""
    from ft_core.control.lighthouse import LighthouseServer

    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1_000, heartbeat_timeout_ms=2_000,
                          http_bind=None) as lighthouse:
        address = lighthouse.address()
        # group 0 starts training once groups 1 and 2 have their Managers up, they start once group 0 does
        # (it is rank zero from step 0), and they wait at epoch 2's start for its restart (so it heals before
        # the early stop)
        wait = ("--wait-start", "started_g0_r0", "--wait-for", "started_g0_r1", "--wait-epoch", "2")
        data = ("--samples", "24")  # 8 samples per group: 2 steps per epoch
        others = [start(processes, address, tmp_path, g, *data, *wait) for g in (1, 2)]
        victim = start(processes, address, tmp_path, 0, *data, "--kill-at-step", "3", "--wait-ready", "1,2")
        restarted = start(processes, address, tmp_path, 0, *data, "--go", "go_g0_r1", restart=1)
        assert victim.wait(timeout=80) == -9, logs(tmp_path)
        (tmp_path / "go_g0_r1").touch()
        for proc in (*others, restarted):
            assert proc.wait(timeout=90) == 0, logs(tmp_path)
    check_run(tmp_path)


def check_run(tmp_path: Path) -> None:
    rows = records(tmp_path)
    victim_pid = next(r["pid"] for r in rows if r["group"] == 0 and r["kind"] == "start")
    summaries = {r["group"]: r for r in rows if r["kind"] == "summary"}
    assert set(summaries) == {0, 1, 2}, logs(tmp_path)

    # early stop ends every group at the same step, before max_epochs, with the same state
    ends = {(s["step"], s["epoch"]) for s in summaries.values()}
    assert len(ends) == 1, summaries
    for s in summaries.values():
        assert s["should_stop"] and s["stop"]["stopped_epoch"] == 3, s  # best at epoch 2, patience 1
        assert s["stop"] == summaries[1]["stop"], (s["stop"], summaries[1]["stop"])
        assert s["best_model_score"] == summaries[1]["best_model_score"]
        assert s["best_k_models"] == summaries[1]["best_k_models"] and len(s["best_k_models"]) == 2
        assert s["best_model_path"] == summaries[1]["best_model_path"]
    assert summaries[1]["stop"]["best_score"] == pytest.approx(3.0, abs=0.02)

    # the reduced metric is the same on every group at every validation it took part in
    vals: dict[int, set[float]] = defaultdict(set)
    for r in rows:
        if r["kind"] == "val":
            vals[r["epoch"]].add(round(r["val_metric"], 6))
    assert all(len(v) == 1 for v in vals.values()), dict(vals)
    assert vals[3] == {round(BASE_MEAN(3), 6)}, dict(vals)  # epoch 3: all three groups live (offsets cancel)

    # exactly one file per checkpoint event, written by the lowest group that committed that step
    committers: dict[int, set[int]] = defaultdict(set)
    for r in rows:
        if r["kind"] == "commit" and r["participating_rank"] is not None:
            committers[r["step"]].add(r["group"])
    saves = [r for r in rows if r["kind"] == "save"]
    per_step: dict[int, list[dict]] = defaultdict(list)
    for r in saves:
        per_step[r["step"]].append(r)
    assert per_step and all(len(v) == 1 for v in per_step.values()), per_step
    writers = []
    for step, (save,) in sorted(per_step.items()):
        assert save["rank"] == 0 and save["group"] == min(committers[step]), (step, save, committers[step])
        writers.append(save["group"])
    # another group wrote while group 0 was away (group 1, or group 2 when group 1 was itself still joining:
    # a busy machine may start it late, healing at its first step), then group 0 again
    assert any(w != 0 for w in writers) and writers[-1] == 0, writers
    assert any(r["group"] == 0 and r["pid"] != victim_pid for r in saves), "the healed group wrote no checkpoint"
    on_disk = sorted(str(p) for p in (tmp_path / "ckpts").glob("*.ckpt"))
    assert on_disk == sorted(summaries[1]["best_k_models"]), (on_disk, summaries[1]["best_k_models"])
    assert torch.load(summaries[1]["best_model_path"], weights_only=False)["global_step"] > 0

    # each logged step's learning rate is written by one group only (the rank zero of that step)
    steps_by_group = lr_steps_by_group(summaries)
    assert len({g for g, steps in steps_by_group.items() if steps}) >= 2, steps_by_group


# ---- in-process: the checked cross-group reduction on real Gloo groups, and ModelCheckpoint's heal ----

class _Step:
    """The one thing LiveQuorum reads from the Manager between steps: the step count (the Manager
    itself is exercised by the real-process test above)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def current_step(self) -> int:
        return self.step


def _two_groups(prefix: str):
    from datetime import timedelta

    from test_process_group_helpers import run_ranks
    from torch._C._distributed_c10d import TCPStore

    from ft_core.process_groups import ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    groups = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    run_ranks(lambda r: groups[r].configure(f"127.0.0.1:{store.port}/{prefix}", f"g{r}", r, 2, quorum_id=1), [0, 1])
    return store, groups, run_ranks


def _live(pg, step: int, sync: bool = True):
    from ft_lightning._callbacks import LiveQuorum

    live = LiveQuorum(_Step(step), pg, group_rank=0, replica_group_id=0, timeout_s=10.0, in_step=lambda: False,
                      at_sync_point=lambda: sync)
    live._voted = True  # as after a quorum: the group is configured for these two members
    return live


@pytest.mark.timeout(60)
def test_between_steps_reductions_are_checked_and_fall_back_to_the_local_value():
    """Real Gloo groups of two members: matching reductions give the cross-group answer; a decision
    paired with a reduction, or members at different steps, is detected: both answer locally (None) and
    the group is aborted (the Manager rebuilds it); outside a sync point nothing is sent at all."""
    _store, groups, run_ranks = _two_groups("ok")
    try:
        lives = [_live(groups[r], 7) for r in (0, 1)]
        means = run_ranks(lambda r: lives[r].reduce(torch.tensor([1.0, 10.0]) * (r + 1), "mean"), [0, 1])
        assert all(torch.equal(m, torch.tensor([1.5, 15.0])) for m in means), means
        assert run_ranks(lambda r: lives[r].decide(r == 0, all_=True), [0, 1]) == [False, False]
        assert run_ranks(lambda r: lives[r].decide(r == 0, all_=False), [0, 1]) == [True, True]
        assert run_ranks(lambda r: lives[r].reduce(torch.tensor(3 + r), "max"), [0, 1]) == [4, 4]
        assert all(lv.fallbacks == 0 for lv in lives)
        quiet = _live(groups[0], 7, sync=False)
        assert quiet.reduce(torch.tensor(1.0), "sum") is None and quiet.fallbacks == 0  # no collective sent

        mixed = run_ranks(lambda r: lives[r].decide(True, all_=True) if r == 0
                          else lives[r].reduce(torch.tensor(1.0), "max"), [0, 1])
        assert mixed == [None, None] and all(lv.fallbacks == 1 for lv in lives)
        assert all(g.errored() is not None for g in groups)  # aborted: rebuilt at the next quorum
    finally:
        for g in groups:
            g.shutdown()
    _store, groups, run_ranks = _two_groups("steps")
    try:
        lives = [_live(groups[r], 7 + r) for r in (0, 1)]  # one member a step behind
        assert run_ranks(lambda r: lives[r].reduce(torch.tensor(2.0), "sum"), [0, 1]) == [None, None]
    finally:
        for g in groups:
            g.shutdown()


def test_healed_model_checkpoint_state_moves_into_the_own_directory(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ft_lightning._callbacks import checkpoint_state, load_checkpoint_state
    from ft_lightning._common import from_transport, to_transport

    src_dir, own_dir = tmp_path / "replica_group_1", tmp_path / "replica_group_0"
    source = ModelCheckpoint(dirpath=src_dir, monitor="m", save_top_k=2)
    source.best_k_models = {str(src_dir / "a.ckpt"): torch.tensor(1.0), str(src_dir / "b.ckpt"): torch.tensor(2.0)}
    source.best_model_path, source.best_model_score = str(src_dir / "a.ckpt"), torch.tensor(1.0)
    source.kth_best_model_path, source.kth_value = str(src_dir / "b.ckpt"), torch.tensor(2.0)
    source._last_global_step_saved = 12
    healed = ModelCheckpoint(dirpath=own_dir, monitor="m", save_top_k=2)
    load_checkpoint_state(healed, from_transport(to_transport(checkpoint_state(source))))
    assert healed.best_k_models == {str(own_dir / "a.ckpt"): 1.0, str(own_dir / "b.ckpt"): 2.0}
    assert healed.best_model_path == str(own_dir / "a.ckpt") and float(healed.best_model_score) == 1.0
    assert healed.kth_best_model_path == str(own_dir / "b.ckpt") and float(healed.kth_value) == 2.0
    assert healed._last_global_step_saved == 12  # the source's save of that step is not repeated
    shared = ModelCheckpoint(dirpath=src_dir, monitor="m", save_top_k=2)  # rank_zero="quorum": one directory
    load_checkpoint_state(shared, checkpoint_state(source))
    assert shared.best_k_models == source.best_k_models and shared.best_model_path == source.best_model_path


def BASE_MEAN(epoch: int) -> float:
    base = [5.0, 4.0, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5]
    return base[epoch] + sum(0.01 * (g - 1) for g in range(GROUPS)) / GROUPS
