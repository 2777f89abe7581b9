"""One replica group training with Fabric (`strategy="fault_tolerant_ddp"`) and the exactly-once
sampler, writing the ledger of tests/_data_ledger_worker.py (read by tests/test_data_ledger.py's
`check_ledger`): an "attempt" line per step right after `loss_weight()`, an "outcome" line after the
optimizer step. Every `--save-every` committed steps it writes `fabric.save(path, {model, optimizer})`,
which carries the Manager's step and the sampler's position; `--resume` loads it with `fabric.load`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time

import torch

torch.set_num_threads(1)

from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import ft_lightning  # noqa: F401  (registers "fault_tolerant_ddp")
from ft_core.data import DistributedSampler


class Indexed(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((4,), float(i % 17) / 17.0), i


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ledger", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--size", type=int, default=240)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--save", required=True, help="fabric.save path (the group id is added)")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    group = int(os.environ["REPLICA_GROUP_ID"])

    fabric = Fabric(strategy="fault_tolerant_ddp", accelerator="cpu", devices=1)
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    strategy = fabric.strategy
    manager = strategy.manager
    dataset = Indexed(args.size)
    sampler = DistributedSampler(dataset, replica_rank=group, num_replica_groups=int(os.environ["NUM_REPLICA_GROUPS"]),
                                 seed=7, manager=manager, batch_size=4)
    save_path = f"{args.save}.g{group}"
    if args.resume and os.path.exists(save_path):  # before the loader is set up: applied when it is
        fabric.load(save_path, {"model": model, "optimizer": optimizer})
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_sampler=sampler), use_distributed_sampler=False)
    assert strategy.data_sampler is sampler
    ledger = open(args.ledger.format(rank=0), "a", buffering=1)  # noqa: SIM115 (open until exit)

    def fingerprint() -> str:
        return hashlib.sha1(json.dumps(sampler.state_dict()["position"]).encode()).hexdigest()[:16]

    ledger.write(json.dumps({"kind": "start", "step": manager.current_step(), "epoch": sampler.epoch,
                             "position": fingerprint()}) + "\n")
    while sampler.epoch < args.epochs:
        for x, _idx in loader:
            idx = _idx.cpu()
            before = fingerprint()
            out = model(x)  # starts the quorum
            weight = sampler.loss_weight()
            rec = sampler.last_batch
            if rec.valid:
                assert sorted(idx.tolist()) == sorted(rec.indices), (idx.tolist(), rec.indices)
            ledger.write(json.dumps({"kind": "attempt", "step": rec.step, "epoch": rec.epoch,
                                     "indices": list(rec.indices), "rank": rec.participating_rank,
                                     "n": rec.num_participants, "valid": rec.valid, "held": list(rec.held),
                                     "consumed": list(rec.consumed), "batch": len(idx), "before": before}) + "\n")
            fabric.backward(out.pow(2).mean() * weight)
            optimizer.step()
            optimizer.zero_grad()
            committed = bool(strategy.last_step_committed)
            ledger.write(json.dumps({"kind": "outcome", "committed": committed, "step": manager.current_step(),
                                     "after": fingerprint()}) + "\n")
            if committed and manager.current_step() % args.save_every == 0:
                fabric.save(save_path, {"model": model, "optimizer": optimizer})
            if args.step_sleep:
                time.sleep(args.step_sleep)
    ledger.write(json.dumps({"kind": "done", "step": manager.current_step(), "epoch": sampler.epoch,
                             "position": fingerprint()}) + "\n")
    strategy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
