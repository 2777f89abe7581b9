"""One replica group (one process) of `FaultTolerantDiLoCoAccelerator`, for tests/test_accelerate_diloco.py.

A plain Accelerate loop over an endless shuffled stream of batches; it stops at the sync that brings
the job to --syncs committed syncs and writes a summary: steps, cross-group allreduces, votes, and
DiLoCo's global copies and outer optimizer state. --kill-at-step SIGKILLs it after that inner step.
"""

from __future__ import annotations

import argparse

import torch

torch.set_num_threads(1)

from _diloco_common import count_votes, kill_self, write_summary

from ft_lightning.accelerate import (
    DiLoCoPlugin,
    FaultTolerancePlugin,
    FaultTolerantDiLoCoAccelerator,
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--incarnation", type=int, default=1)
    p.add_argument("--syncs", type=int, default=8)
    p.add_argument("--kill-at-step", type=int, default=None)
    args = p.parse_args()
    votes = count_votes()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    accelerator = FaultTolerantDiLoCoAccelerator(
        ft=FaultTolerancePlugin(), cpu=True,
        diloco=DiLoCoPlugin(sync_every=4, fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5))
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(100 + args.group)
    manager, diloco = accelerator.ft_manager, accelerator.diloco
    steps = 0
    while not (manager.current_step() >= args.syncs and diloco.local_step == 0):
        x = torch.randn(4, 8, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()  # DiLoCo syncs inside this call when due
        optimizer.zero_grad()
        steps += 1
        if args.kill_at_step is not None and steps >= args.kill_at_step:
            kill_self(steps)
    allreduces = accelerator.ft_stats["cross_group_allreduces"]
    write_summary(args.out, args.group, args.incarnation, manager, votes, steps=steps, allreduces=allreduces)
    accelerator.end_training()


if __name__ == "__main__":
    main()
