"""One replica group (one process, or one rank under torchrun) running a plain Accelerate epoch loop,
`for epoch in range(N): for batch in loader:`, with exactly-once data (FaultTolerancePlugin(exactly_once=True)),
writing the ledger of tests/test_data_ledger.py: per step attempt {"kind": "attempt", ...} right after
`accelerator.backward` (the exactly-once check runs there), then {"kind": "outcome", committed}.
`--save DIR` runs `accelerator.save_state(DIR/group<g>/step_N)` every `--save-every` committed steps;
`--resume` loads the newest one at start; `--save-final` saves once more after the loop.
`--kill-in-reduction-at-step N` SIGKILLs the process instead of issuing its cross-group reduction of the
first step from N on that every group of the job takes part in; `--hold STEP:FILE` waits (at most 90 s)
before that Manager step until FILE exists.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys
import time

import torch
from _ledger_common import Indexed, Ledger, fingerprint
from _worker_faults import hold, kill_in_reduction


def newest(directory: str) -> str | None:
    found = sorted(glob.glob(os.path.join(directory, "step_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
    return found[-1] if found else None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ledger", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--size", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--gate", default=None, help="if given, steps sleep only while this file exists (from --gate-epoch on)")
    p.add_argument("--gate-epoch", type=int, default=0)
    p.add_argument("--save", default=None, help="save_state directory root (one step_N folder per save)")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--save-final", action="store_true", help="save_state once more after the loop")
    p.add_argument("--checkpoint-dir", default=None, help="FaultTolerancePlugin(checkpoint_dir=): the job's folders")
    p.add_argument("--kill-in-reduction-at-step", type=int, default=None)
    p.add_argument("--hold", action="append", default=[], metavar="STEP:FILE")
    args = p.parse_args()
    if args.kill_in_reduction_at_step is not None:
        kill_in_reduction(args.kill_in_reduction_at_step, int(os.environ["NUM_REPLICA_GROUPS"]))
    torch.set_num_threads(1)
    # Imported here, not at the top: spawned DataLoader workers re-import this file and need only torch.
    from ft_lightning.accelerate import FaultTolerancePlugin, FaultTolerantAccelerator

    accelerator = FaultTolerantAccelerator(
        ft=FaultTolerancePlugin(exactly_once=True, global_batch_size=args.global_batch_size, timeout=5.0,
                                quorum_timeout=60.0, checkpoint_dir=args.checkpoint_dir), cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    dataset = Indexed(args.size)
    # Workers are spawned, not forked: the Manager's gRPC threads make fork() unsafe.
    extra = {"multiprocessing_context": "spawn", "persistent_workers": True} if args.workers else {}
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                         num_workers=args.workers, **extra)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    sampler = loader.ft_sampler
    save_root = os.path.join(args.save, f"group{accelerator.ft.replica_group_id}") if args.save else None
    if args.resume and save_root and newest(save_root):
        accelerator.load_state(newest(save_root))
    ledger = Ledger(args.ledger.format(rank=rank))
    ledger.write("start", step=accelerator.ft_step, epoch=sampler.epoch, position=fingerprint(sampler))
    for epoch in range(args.epochs):
        for x, idx in loader:
            hold(args.hold, accelerator.ft_step)
            before = fingerprint(sampler)
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)  # the exactly-once check: the loss counts only for the step's assignment
            assert sampler.last_batch is not None
            ledger.attempt(sampler.last_batch, idx.tolist(), before, loop_epoch=epoch)
            optimizer.step()  # votes; applies only on commit
            optimizer.zero_grad()
            committed = not accelerator.optimizer_step_was_skipped
            ledger.write("outcome", committed=committed, step=accelerator.ft_step, after=fingerprint(sampler))
            if save_root and committed and accelerator.ft_step % args.save_every == 0:
                accelerator.save_state(os.path.join(save_root, f"step_{accelerator.ft_step}"))
            gated = args.gate is None or (sampler.epoch >= args.gate_epoch and os.path.exists(args.gate))
            if args.step_sleep and gated:
                time.sleep(args.step_sleep)
        scheduler.step()  # once per epoch, as a typical script does
    if save_root and args.save_final:
        accelerator.save_state(os.path.join(save_root, f"step_{accelerator.ft_step}"))
    weights = hashlib.sha1(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()
    ledger.write("done", step=accelerator.ft_step, epoch=sampler.epoch, position=fingerprint(sampler),
                 lr=scheduler.get_last_lr(), weights=weights)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
