"""One replica group training with Fabric (`strategy="fault_tolerant_ddp"`) and the exactly-once
sampler, writing the ledger of tests/_data_ledger_worker.py (read by tests/test_data_ledger.py's
`check_ledger`): an "attempt" line per step right after `loss_weight()`, an "outcome" line after the
optimizer step. Every `--save-every` committed steps it writes `fabric.save(path, {model, optimizer})`,
which carries the Manager's step and the sampler's position; `--resume` loads it with `fabric.load`.
`--hold STEP:FILE` waits after committing STEP until FILE exists (tests/_worker_faults.py), so a test can
kill the group mid-epoch without racing its end.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

torch.set_num_threads(1)

from _ledger_common import Indexed, Ledger, fingerprint
from _worker_faults import hold
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import ft_lightning  # noqa: F401  (registers "fault_tolerant_ddp")
from ft_core.data import DistributedSampler


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ledger", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--size", type=int, default=240)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--save", required=True, help="fabric.save path (the group id is added)")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--hold", action="append", default=[], help="STEP:FILE: after step STEP, wait for FILE")
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
    ledger = Ledger(args.ledger.format(rank=0))
    ledger.write("start", step=manager.current_step(), epoch=sampler.epoch, position=fingerprint(sampler))
    while sampler.epoch < args.epochs:
        for x, idx in loader:
            before = fingerprint(sampler)
            out = model(x)  # starts the quorum
            weight = sampler.loss_weight()
            ledger.attempt(sampler.last_batch, idx.cpu().tolist(), before)
            fabric.backward(out.pow(2).mean() * weight)
            optimizer.step()
            optimizer.zero_grad()
            committed = bool(strategy.last_step_committed)
            ledger.write("outcome", committed=committed, step=manager.current_step(), after=fingerprint(sampler))
            if committed and manager.current_step() % args.save_every == 0:
                fabric.save(save_path, {"model": model, "optimizer": optimizer})
            if committed:
                hold(args.hold, manager.current_step())
            if args.step_sleep:
                time.sleep(args.step_sleep)
    ledger.write("done", step=manager.current_step(), epoch=sampler.epoch, position=fingerprint(sampler))
    strategy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
