"""One training process of the healthy-path overhead benchmark.

Modes: `ddp` (plain torch DDP over Gloo, the baseline), `ft` (ft_core Manager + DDP + OptimizerWrapper,
one process per replica group), `torchft` (Meta's torchft, same shape, when installed).
Writes {"mode", "rank", "step_times_s"} as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.nn.functional as F

from benchmarks import _models


def _train(model, optimizer, args, before_step=None) -> list[float]:
    times = []
    for step in range(args.warmup + args.steps):
        x, y = _models.batch(args.model, args.batch_size, step)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def run_ddp(args) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.master_port}", rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=60))
    try:
        model = torch.nn.parallel.DistributedDataParallel(_models.build(args.model))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return _train(model, optimizer, args)
    finally:
        dist.destroy_process_group()


def run_ft(args) -> list[float]:
    from ft_core.ddp import DistributedDataParallel
    from ft_core.manager import Manager
    from ft_core.optim import OptimizerWrapper
    from ft_core.process_group import ProcessGroupGloo

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=args.world_size,
                      lighthouse_addr=args.lighthouse, replica_id=f"bench_{args.rank}", rank=0, world_size=1,
                      hostname="127.0.0.1", timeout=timedelta(seconds=30))
    try:
        model = DistributedDataParallel(manager, _models.build(args.model))
        optimizer = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        return _train(model, optimizer, args)
    finally:
        manager.shutdown()


def run_torchft(args) -> list[float]:
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    model = _models.build(args.model)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def load_state(state) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def save_state():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), load_state_dict=load_state,
                      state_dict=save_state, min_replica_size=args.world_size, lighthouse_addr=args.lighthouse,
                      replica_id=f"bench_{args.rank}", rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=store.port, hostname="127.0.0.1", timeout=timedelta(seconds=30))
    try:
        ddp_model = DistributedDataParallel(manager, model)
        return _train(ddp_model, Optimizer(manager, inner), args)
    finally:
        manager.shutdown()


MODES = {"ddp": run_ddp, "ft": run_ft, "torchft": run_torchft}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--master-port", type=int, default=0)
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--model", default="mlp3.7m", choices=sorted(_models.MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times = MODES[args.mode](args)
    with open(args.out, "w") as fh:
        json.dump({"mode": args.mode, "rank": args.rank, "step_times_s": times}, fh)
    os._exit(0)  # skip slow interpreter teardown of gRPC/torch threads; results are on disk


if __name__ == "__main__":
    main()
