"""One replica group (or one rank of one, under torchrun) running the step protocol on a tiny model,
with faults injected where the step protocol must hold: failed heal loads and fetches, skipped
votes, a MAX/MIN reduction beside the gradient average. Writes one JSON line per step.

The model is one parameter vector `w`; its "gradient" is `w` itself, so a group that reduces with
stale weights visibly moves the average, and groups in sync stay bit-identical.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import time
from datetime import timedelta

import torch
from torch.distributed import ReduceOp

from ft_core.ddp import DistributedDataParallel
from ft_core.errors import ConfigError, FTError
from ft_core.local_sgd import DiLoCo, LocalSGD
from ft_core.manager import Manager
from ft_core.process_groups import ProcessGroupGloo


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--steps", type=int, default=6, help="stop once this step is committed")
    p.add_argument("--start-step", type=int, default=0, help="begin with this much committed progress")
    p.add_argument("--init", type=float, default=1.0, help="initial value of every weight")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--sync", action="store_true", help="use_async_quorum=False")
    p.add_argument("--no-init-sync", action="store_true")
    p.add_argument("--fail-loads", type=int, default=0, help="the first N healed-state loads raise")
    p.add_argument("--fail-fetches", type=int, default=0, help="the first N checkpoint fetches raise")
    p.add_argument("--fail-rank", type=int, default=-1, help="inject only on this group rank (-1: every rank)")
    p.add_argument("--skip-first-vote", action="store_true", help="skip should_commit() in the first step")
    p.add_argument("--skip-vote-at", type=int, default=-1, help="module models: skip should_commit() after the "
                                                                "backward of the first step from this one on, once")
    p.add_argument("--skip-backward-at", type=int, default=-1,
                   help="module models: end the first step from this one on after its forward (no backward), once")
    p.add_argument("--skip-vote-with", type=int, default=0, help="... in a step with at least this many participants")
    p.add_argument("--start-together", type=int, default=0, help="module models: first wait (60 s at most) until "
                                                                  "this many groups have built their Manager")
    p.add_argument("--extreme", default="", choices=("", "max", "min"), help="also reduce [-5 - 2*group]")
    p.add_argument("--vote-then-reduce", action="store_true", help="allreduce after should_commit (must raise)")
    p.add_argument("--model", default="vector",
                   choices=("vector", "batchnorm", "linear", "unwrapped", "localsgd", "diloco"),
                   help="batchnorm: a BatchNorm model under ft_core DDP, each group on other data; linear: the same "
                        "without the BatchNorm (no buffers: nothing is reduced in the vote); "
                        "unwrapped: the same model without the DDP wrapper (nothing reduces its gradients); "
                        "localsgd, diloco: the same model trained with LocalSGD or DiLoCo, a sync every step")
    p.add_argument("--width", type=int, default=4, help="hidden width of the module models (a group given another "
                                                       "width reduces other gradients than its peers)")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=10.0)
    return p.parse_args()


def train_module(args: argparse.Namespace, rank: int) -> int:
    """A model with BatchNorm buffers: after every committed step the buffers must match on every group."""
    torch.manual_seed(0)
    width = args.width
    norm = torch.nn.Identity() if args.model == "linear" else torch.nn.BatchNorm1d(width)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), norm, torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    manager = Manager(pg, load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      min_replica_size=args.min_replicas, replica_id=f"g{args.group}", init_sync=not args.no_init_sync,
                      use_async_quorum=args.model != "diloco", timeout=timedelta(seconds=args.timeout),
                      quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=30))
    net = DistributedDataParallel(manager, model) if args.model in ("batchnorm", "linear") else model
    if args.start_together:  # else a group slow to start (a loaded machine) joins after the others ended
        open(f"{args.out}.ready{args.group}", "w").close()
        deadline = time.monotonic() + 60
        while len(glob.glob(f"{args.out}.ready*")) < args.start_together and time.monotonic() < deadline:
            time.sleep(0.05)
    semi_sync = contextlib.nullcontext()
    if args.model == "localsgd":
        semi_sync = LocalSGD(manager, model, opt, sync_every=1)
    elif args.model == "diloco":
        semi_sync = DiLoCo(manager, [model], opt, torch.optim.SGD(model.parameters(), lr=0.7), sync_every=1)
    gen = torch.Generator().manual_seed(100 + args.group)  # each group sees other data
    out = open(args.out, "a")
    error, skipped = "", ""
    try:
        with semi_sync:
            while manager.current_step() < args.steps:
                if args.model in ("localsgd", "diloco"):  # the sync (quorum, allreduce, vote) runs in opt.step()
                    opt.zero_grad()
                    net(torch.randn(8, 4, generator=gen) * (1 + args.group)).pow(2).mean().backward()
                    opt.step()
                    continue
                manager.start_quorum()
                opt.zero_grad()
                x = torch.randn(8, 4, generator=gen) * (1 + args.group)
                loss = net(x).pow(2).mean()
                attempted = manager.current_step()
                for what, at in (("skipped_backward", args.skip_backward_at), ("skipped_vote", args.skip_vote_at)):
                    if 0 <= at <= attempted and manager.num_participants() >= args.skip_vote_with and not skipped:
                        skipped = what  # once: a heal may jump past the step, a group may start late
                if skipped == "skipped_backward":
                    skipped = "done"
                    out.write(json.dumps({"group": args.group, "rank": rank, "skipped_backward": attempted}) + "\n")
                    continue
                loss.backward()
                if skipped == "skipped_vote":
                    skipped = "done"
                    out.write(json.dumps({"group": args.group, "rank": rank, "skipped_vote": attempted}) + "\n")
                    continue
                committed = manager.should_commit()
                if committed:
                    opt.step()
                buffers = {k: v.tolist() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
                out.write(json.dumps({"group": args.group, "rank": rank, "step": manager.current_step(),
                                      "attempted": attempted, "committed": committed, "buffers": buffers}) + "\n")
                out.flush()
    except FTError as exc:  # the refusal (ConfigError), or a quorum that cannot form once the peer left
        error = f"{type(exc).__name__}: {exc}"
    finally:
        params = [p.detach().reshape(-1).tolist() for p in model.parameters()]
        out.write(json.dumps({"group": args.group, "rank": rank, "final": True, "step": manager.current_step(),
                              "w": params, "error": error}) + "\n")
        out.close()
        manager.shutdown()
        pg.shutdown()
    return 0


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if args.model != "vector":
        return train_module(args, rank)
    inject = args.fail_rank in (-1, rank)
    w = torch.full((4,), args.init)
    loads = {"left": args.fail_loads if inject else 0}

    def load(state: dict) -> None:
        if loads["left"] > 0:
            loads["left"] -= 1
            raise RuntimeError("injected failure while loading the healed state")
        w.copy_(state["w"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    manager = Manager(pg, load_state_dict=load, state_dict=lambda: {"w": w},
                      min_replica_size=args.min_replicas, use_async_quorum=not args.sync,
                      init_sync=not args.no_init_sync, replica_id=f"g{args.group}",
                      timeout=timedelta(seconds=args.timeout), quorum_timeout=timedelta(seconds=30),
                      connect_timeout=timedelta(seconds=30))
    if args.start_step:
        manager.load_state_dict({"step": args.start_step, "batches_committed": args.start_step})
    fetches = {"left": args.fail_fetches if inject else 0}
    transport = manager.checkpoint_transport
    recv = transport.recv_checkpoint

    def failing_recv(*a, **kw):
        if fetches["left"] > 0:
            fetches["left"] -= 1
            raise ConnectionError("injected failure while fetching the checkpoint")
        return recv(*a, **kw)

    transport.recv_checkpoint = failing_recv
    out = open(args.out, "a")
    first = True
    try:
        while manager.current_step() < args.steps:
            manager.start_quorum()
            grad = w.clone()
            manager.allreduce(grad).wait()
            row = {"group": args.group, "rank": rank, "step_before": manager.current_step(), "w_before": w.tolist(),
                   "participating": manager.is_participating(), "participants": manager.num_participants(),
                   "grad": grad.tolist()}
            if args.extreme:
                value = torch.tensor([-5.0 - 2 * args.group])
                manager.allreduce(value, ReduceOp.MAX if args.extreme == "max" else ReduceOp.MIN).wait()
                row["extreme"] = value.item()
            if args.skip_first_vote and first:
                first = False
                row["skipped_vote"] = True
                out.write(json.dumps(row) + "\n")
                out.flush()
                continue
            first = False
            committed = manager.should_commit()
            if committed:
                w.sub_(0.5 * grad)
            if args.vote_then_reduce:
                try:
                    manager.allreduce(torch.ones(1))
                    row["late_reduce"] = "accepted"
                except ConfigError as exc:
                    row["late_reduce"] = str(exc)
            row.update(committed=committed, step=manager.current_step(), w=w.tolist())
            out.write(json.dumps(row) + "\n")
            out.flush()
    finally:
        out.write(json.dumps({"group": args.group, "rank": rank, "final": True, "step": manager.current_step(),
                              "w": w.tolist()}) + "\n")
        out.close()
        manager.shutdown()
        pg.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
