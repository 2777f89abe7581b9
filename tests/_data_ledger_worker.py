"""One replica group (one process, or one rank under torchrun) training with the core API and the
exactly-once sampler, writing a ledger line for every step attempt (tests/test_data_ledger.py).

Each line: {"kind": "attempt", step, epoch, indices, rank, n, valid, held, consumed} right after
`loss_weight()` (before the gradient allreduce, so a group killed later in the step still has it),
then {"kind": "outcome", committed, held, consumed} after the vote (held and consumed as of the vote: a
step redone without a lost peer, ft_core/redo.py, re-reads who held its batch). A durable checkpoint (manager + sampler + model)
is written every `--save-every` committed steps when `--save` is given, and loaded at start with `--resume`.
`--hold FILE`: start (imports, torchrun ranks), then join the job only once FILE is removed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _ledger_common import Indexed, Ledger, fingerprint

from ft_core.data import DistributedSampler
from ft_core.ddp import DistributedDataParallel
from ft_core.manager import Manager
from ft_core.optim import OptimizerWrapper
from ft_core.process_groups import ProcessGroupGloo


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ledger", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--size", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--save", default=None, help="durable checkpoint path (rank suffix added)")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-at-step", type=int, default=None, help="exit cleanly once this step is committed")
    p.add_argument("--gate", default=None, help="while this file exists, steps from --gate-epoch on are slow")
    p.add_argument("--gate-epoch", type=int, default=0)
    p.add_argument("--hold", default=None, help="wait (started and imported) until this file is gone, then join")
    p.add_argument("--sync-quorum", action="store_true", help="use_async_quorum=False: the quorum before the forward")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    held_until = time.monotonic() + 300  # the test decides when this group joins the job, within a bound
    while args.hold and os.path.exists(args.hold):
        if time.monotonic() > held_until:
            sys.exit(f"--hold {args.hold} still exists after 300 s: the test never let this group join")
        time.sleep(0.05)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    manager = Manager(ProcessGroupGloo(timeout=timedelta(seconds=5)),
                      load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["optim"])),
                      state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
                      timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=60),
                      replica_id=f"group{group}", rank=rank, world_size=world,
                      use_async_quorum=not args.sync_quorum)
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    dataset = Indexed(args.size)
    sampler = DistributedSampler(dataset, replica_rank=group, num_replica_groups=groups, group_rank=rank,
                                 num_replicas=world, seed=7, manager=manager,
                                 batch_size=None if args.global_batch_size else args.batch_size,
                                 global_batch_size=args.global_batch_size)
    save_path = f"{args.save}.r{rank}" if args.save else None
    if args.resume and save_path and os.path.exists(save_path):
        ckpt = torch.load(save_path, weights_only=True)
        manager.load_state_dict(ckpt["manager"])
        sampler.load_state_dict(ckpt["sampler"])
        model.load_state_dict(ckpt["model"])
        inner.load_state_dict(ckpt["optim"])
    # Workers are spawned, not forked: the Manager's gRPC threads make fork() unsafe.
    extra = {"multiprocessing_context": "spawn", "persistent_workers": True} if args.workers else {}
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=args.workers, **extra)
    ledger = Ledger(args.ledger.format(rank=rank))
    ledger.write("start", step=manager.current_step(), epoch=sampler.epoch, position=fingerprint(sampler))

    def done() -> bool:
        if args.stop_at_step is not None and manager.current_step() >= args.stop_at_step:
            return True
        return sampler.epoch >= args.epochs

    while not done():
        for x, idx in loader:
            optimizer.zero_grad()  # starts the quorum
            before = fingerprint(sampler)
            weight = sampler.loss_weight()
            assert sampler.last_batch is not None
            ledger.attempt(sampler.last_batch, idx.tolist(), before)
            loss = ddp(x).pow(2).mean() * weight
            loss.backward()
            optimizer.step()  # votes; steps only on commit
            final = sampler.last_batch  # a step redone without a lost peer re-reads who held its batch
            ledger.write("outcome", committed=bool(optimizer.committed), step=manager.current_step(),
                         after=fingerprint(sampler), held=list(final.held), consumed=list(final.consumed))
            if save_path and optimizer.committed and manager.current_step() % args.save_every == 0:
                tmp = f"{save_path}.{os.getpid()}.tmp"  # every group writes the same file: one tmp each
                torch.save({"manager": manager.state_dict(), "sampler": sampler.state_dict(),
                            "model": model.state_dict(), "optim": inner.state_dict()}, tmp)
                os.replace(tmp, save_path)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.gate and sampler.epoch >= args.gate_epoch and os.path.exists(args.gate):
                time.sleep(1.0)  # the test is still killing: stay in the epochs where kills are checked
            if done():
                break
    ledger.write("done", step=manager.current_step(), epoch=sampler.epoch, position=fingerprint(sampler))
    manager.shutdown()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
