"""`broadcast` and `barrier` over the live replica groups (the strategy's default rank_zero="quorum"):
the checked, bounded cross-group mechanism on real Gloo groups, a barrier whose peer is a real process
that hangs or is SIGKILLed, and real Trainer processes whose LightningModule broadcasts a per-group value
at every validation. The Trainer process is tests/_lightning_collectives_worker.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from _trainer_groups import logs, records, start_group
from conftest import REPO_ROOT, assert_bounded, child_env

WORKER = os.path.join(REPO_ROOT, "tests", "_lightning_collectives_worker.py")


class _Step:
    """What LiveQuorum reads from the Manager between steps: the step count (the Manager itself is
    exercised by the Trainer test below)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def current_step(self) -> int:
        return self.step


def _store():
    from torch._C._distributed_c10d import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _two_groups(prefix: str):
    from test_process_group_helpers import run_ranks

    from ft_core.process_groups import ProcessGroupGloo

    store = _store()
    groups = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    run_ranks(lambda r: groups[r].configure(f"127.0.0.1:{store.port}/{prefix}", f"g{r}", r, 2, quorum_id=1), [0, 1])
    return store, groups, run_ranks


def _live(pg, step: int = 7, *, leader_group: bool = False, timeout_s: float = 10.0):
    from ft_lightning._callbacks import LiveQuorum

    live = LiveQuorum(_Step(step), pg, group_rank=0, replica_group_id=0, timeout_s=timeout_s, in_step=lambda: False,
                      at_sync_point=lambda: True)
    live._voted = True  # as after a quorum: the group is configured for these members
    live.leader_group = leader_group
    return live


@pytest.mark.timeout(60)
def test_broadcast_carries_the_leader_groups_json_value_and_keeps_anything_else_in_the_group(caplog):
    """Real Gloo groups of two members, member 1 the leader group: a JSON value (a path, a dict) arrives
    on both exactly; a tuple (not JSON) or two members claiming to lead: both keep their own value, with
    a warning naming why, and the group stays usable; a barrier paired with a reduction is detected and
    the group aborted (the Manager rebuilds it at the next quorum)."""
    _store_, groups, run_ranks = _two_groups("bcast")
    try:
        lives = [_live(groups[r], leader_group=(r == 1)) for r in (0, 1)]
        value = {"path": "/ckpts/epoch=3-step=12.ckpt", "score": 0.25, "top": [1, None, True], "é": "ü"}
        got = run_ranks(lambda r: lives[r].broadcast(value if r == 1 else {"path": "mine"}), [0, 1])
        assert got == [(True, value), (True, value)], got
        assert run_ranks(lambda r: lives[r].broadcast(f"group {r}"), [0, 1]) == [(True, "group 1")] * 2
        big = "x" * 200_000  # more than one fixed-size reduction carries
        assert run_ranks(lambda r: lives[r].broadcast(big if r == 1 else ""), [0, 1]) == [(True, big)] * 2
        assert run_ranks(lambda r: lives[r].barrier(), [0, 1]) == [True, True]
        assert all(lv.fallbacks == 0 for lv in lives)

        with caplog.at_level(logging.WARNING, logger="ft_lightning._callbacks"):
            assert run_ranks(lambda r: lives[r].broadcast(("a", r)), [0, 1]) == [(False, None)] * 2
        assert "tuple is not a JSON value" in caplog.text and "never pickled" in caplog.text
        lives[0].leader_group = True  # both claim rank zero (quorums out of step): nobody's value is taken
        assert run_ranks(lambda r: lives[r].broadcast(r), [0, 1]) == [(False, None)] * 2
        assert all(g.errored() is None for g in groups)  # those were agreed refusals: the group is usable
        lives[0].leader_group = False
        assert run_ranks(lambda r: lives[r].broadcast(r), [0, 1]) == [(True, 1)] * 2

        mixed = run_ranks(lambda r: lives[r].barrier() if r == 0 else lives[r].reduce(torch.tensor(1.0), "sum"),
                          [0, 1])
        assert mixed == [False, None] and all(g.errored() is not None for g in groups)
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.timeout(60)
def test_gather_returns_every_groups_state_and_refuses_states_that_differ():
    """The cross-group gather torchmetrics states go through: uneven first dimensions (a `cat` state),
    scalars and bools come back exactly, in member order; states of another dtype or shape are an agreed
    refusal (both keep their own), after which the group is still usable."""
    _store_, groups, run_ranks = _two_groups("gather")
    try:
        lives = [_live(groups[r]) for r in (0, 1)]
        cats = [torch.arange(3, dtype=torch.float32), torch.tensor([7.5, -0.0])]
        got = run_ranks(lambda r: lives[r].gather(cats[r]), [0, 1])
        for parts in got:
            assert [p.tolist() for p in parts] == [c.tolist() for c in cats] and parts[0].dtype == torch.float32
        got = run_ranks(lambda r: lives[r].gather(torch.tensor(10 * (r + 1), dtype=torch.int64)), [0, 1])
        assert all([p.item() for p in parts] == [10, 20] and parts[0].shape == () for parts in got), got
        flags = [torch.tensor([True, False]), torch.tensor([False])]
        got = run_ranks(lambda r: lives[r].gather(flags[r]), [0, 1])
        assert all([p.tolist() for p in parts] == [[True, False], [False]] for parts in got), got
        odd = [torch.zeros(2, 3), torch.zeros(2, 4)]
        assert run_ranks(lambda r: lives[r].gather(odd[r]), [0, 1]) == [None, None]
        assert all(g.errored() is None for g in groups)
        got = run_ranks(lambda r: lives[r].gather(torch.ones(1) * r), [0, 1])
        assert all([p.item() for p in parts] == [0.0, 1.0] for parts in got), got
    finally:
        for g in groups:
            g.shutdown()


_PEER = """
import sys, time
from datetime import timedelta
import torch
torch.set_num_threads(1)
from ft_core.process_groups import ProcessGroupGloo
pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
pg.configure(sys.argv[1], "peer", 1, 2, quorum_id=1)
print("configured", flush=True)
time.sleep(120)  # hung: never reaches the barrier
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["hung", "killed"])
def test_barrier_with_a_hung_or_killed_peer_returns_within_its_bound(processes, fault):
    """The peer is a real process in the cross-group process group; it never reaches the barrier (hung)
    or is SIGKILLed before it. The barrier returns False within its timeout (fails open, logged) and
    the process group is aborted, so the Manager rebuilds it at the next quorum."""
    from ft_core.process_groups import ProcessGroupGloo

    store = _store()
    addr = f"127.0.0.1:{store.port}/{fault}"
    peer = processes.python("-c", _PEER, addr, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    try:
        pg.configure(addr, "me", 0, 2, quorum_id=1)
        assert peer.stdout.readline().strip() == b"configured"
        if fault == "killed":
            os.killpg(peer.pid, signal.SIGKILL)
            assert peer.wait(timeout=10) == -signal.SIGKILL
        live = _live(pg, timeout_s=3.0)
        started = time.monotonic()
        assert live.barrier() is False
        assert_bounded(started, 3.0, f"a barrier with a {fault} peer")
        assert live.fallbacks == 1 and pg.errored() is not None
    finally:
        pg.shutdown()


# ---- real Trainer processes ---------------------------------------------------------------------

def _start(processes, address: str, out: Path, group: int, groups: int, *args: str) -> subprocess.Popen:
    return start_group(processes, WORKER, address, out, group, groups, *args, quorum_timeout_s=60)


def _run_trainers(processes, tmp_path: Path, groups: int, *args: str) -> list[dict]:
    from ft_core.control.lighthouse import LighthouseServer

    with LighthouseServer(bind="127.0.0.1:0", min_replicas=groups, join_timeout_ms=1_000,
                          heartbeat_timeout_ms=5_000, http_bind=None) as lighthouse:
        procs = [_start(processes, lighthouse.address(), tmp_path, g, groups, *args) for g in range(groups)]
        for proc in procs:
            assert proc.wait(timeout=95) == 0, logs(tmp_path)
    rows = records(tmp_path)
    vals = [r for r in rows if r["kind"] == "val"]
    assert {(r["group"], r["epoch"]) for r in vals} == {(g, e) for g in range(groups) for e in (0, 1)}, logs(tmp_path)
    for r in vals:
        assert r["tuple"] == [r["group"], "own"], r  # not JSON: the group's own value
        assert r["val_seen"] == 4.0, r  # torchmetrics in validation: the group's own (whole) validation set
    epoch_rows = [r for r in rows if r["kind"] == "epoch"]
    assert len(epoch_rows) == groups * 2, epoch_rows
    for r in epoch_rows:  # 24 training samples per epoch, each group saw its shard: Metric sync across the groups
        assert (r["seen"], r["local"]) == (24.0, 24.0 / groups), r  # and a Metric's own dist_sync_fn kept
    summaries = {r["group"]: r for r in rows if r["kind"] == "summary"}
    assert set(summaries) == set(range(groups)) and all(s["fallbacks"] == 0 for s in summaries.values()), summaries
    return rows


@pytest.mark.timeout(110)
def test_trainer_broadcast_and_barrier_span_the_live_groups_at_validation(processes, tmp_path):
    """3 Trainer groups, the default rank_zero="quorum": at every validation each group broadcasts its own path and
    group id (in on_validation_epoch_end) and all end with rank zero's (group 0's), while a tuple stays
    each group's own; a barrier there and ModelCheckpoint's `Trainer.save_checkpoint` barriers are made
    across the groups with no fallback; a torchmetrics Metric logged from training_step sums every
    group's samples at the epoch's end while a validation Metric stays the group's own; the checkpoint
    named by the broadcast value (`tag`) is one file, named the same on every group."""
    rows = _run_trainers(processes, tmp_path, 3)
    for r in (r for r in rows if r["kind"] == "val"):
        assert r["broadcast"] == {"group": 0, "path": str(tmp_path / "replica_group_0" / "artifact.txt")}, r
        assert r["barrier_fallbacks"] == 0 and r["barrier_crossed"] == 1, r
    summaries = [r for r in rows if r["kind"] == "summary"]
    paths = {s["best_model_path"] for s in summaries}
    assert len(paths) == 1 and "tag=0" in paths.pop(), summaries
    files = sorted(p.name for p in (tmp_path / "ckpts").glob("*.ckpt"))
    assert files == sorted({os.path.basename(s["best_model_path"]) for s in summaries}), files


@pytest.mark.timeout(110)
def test_trainer_broadcast_and_barrier_stay_in_the_group_with_rank_zero_group(processes, tmp_path):
    """2 Trainer groups, the opt-out rank_zero="group": each group is its own rank zero, so its broadcast
    is its own value (its own path) and its barrier stays in the group; torchmetrics still sync across
    the groups at the epoch's end; each group's checkpoint is in its own folder, named by its own id."""
    rows = _run_trainers(processes, tmp_path, 2, "--rank-zero", "group")
    for r in (r for r in rows if r["kind"] == "val"):
        g = r["group"]
        assert r["broadcast"] == {"group": g, "path": str(tmp_path / f"replica_group_{g}" / "artifact.txt")}, r
        assert r["barrier_fallbacks"] == 0 and r["barrier_crossed"] == 0, r
    for s in (r for r in rows if r["kind"] == "summary"):
        assert Path(s["best_model_path"]).parent == tmp_path / "ckpts" / f"replica_group_{s['group']}", s
        assert f"tag={s['group']}" in s["best_model_path"] and os.path.exists(s["best_model_path"]), s


def test_json_payload_refuses_what_would_not_come_back_the_same():
    from ft_lightning._callbacks import MAX_BROADCAST_BYTES, json_payload

    for ok in ("a/b.ckpt", 3, 2.5, True, None, [1, "x"], {"k": [None, {"n": 1}]}):
        data, why = json_payload(ok)
        assert data is not None and json.loads(data) == ok and why == ""
    for bad in ((1, 2), Path("/x"), float("nan"), {1: "x"}, torch.tensor(1.0), b"raw", "x" * (MAX_BROADCAST_BYTES + 1)):
        data, why = json_payload(bad)
        assert data is None and why, bad



def test_the_strategys_metric_sync_is_given_only_to_metrics_without_one_and_survives_copy_and_pickle():
    """Every torchmetrics Metric of the module without a dist_sync_fn gets the strategy's; one with its own
    keeps it; a deep copy (Metric.clone, EMA/SWA copies of the module) shares it, and a pickled Metric
    comes back with torchmetrics' own sync rather than a pickled strategy."""
    import copy
    import pickle

    import torchmetrics

    from ft_lightning._metrics import MetricSync, install

    def own(t, group=None):
        return [t]

    module = torch.nn.Module()
    module.seen = torchmetrics.SumMetric()
    module.pair = torchmetrics.MetricCollection({"a": torchmetrics.MeanMetric(), "b": torchmetrics.MaxMetric()})
    module.mine = torchmetrics.SumMetric(dist_sync_fn=own)
    sync = MetricSync(lambda: None, lambda: False)
    assert install(module, sync) == 3
    assert module.seen.dist_sync_fn is sync and module.pair["a"].dist_sync_fn is sync and module.mine.dist_sync_fn is own
    assert copy.deepcopy(module).seen.dist_sync_fn is sync and module.seen.clone().dist_sync_fn is sync
    assert pickle.loads(pickle.dumps(module.seen)).dist_sync_fn is None
    module.seen.update(3.0)
    assert float(module.seen.compute()) == 3.0  # no live quorum: torchmetrics' own (in-group) result


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
