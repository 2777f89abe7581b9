"""One replica group (one process) of `FaultTolerantDiLoCoAccelerator`, for tests/test_accelerate_diloco.py.

A plain Accelerate loop over an endless shuffled stream of batches; it stops at the sync that brings
the job to --syncs committed syncs and writes a summary: steps, cross-group allreduces, votes, and
DiLoCo's global copies and outer optimizer state. --kill-at-step SIGKILLs it after that inner step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch

torch.set_num_threads(1)

from ft_lightning.accelerate import FaultTolerancePlugin
from ft_lightning.accelerate import DiLoCoPlugin, FaultTolerantDiLoCoAccelerator


class Votes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)  # a committed step's event is DEBUG (routine)
        self.votes = 0
        self.heals = 0

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if isinstance(event, dict):
            self.votes += event.get("type") == "commit"
            self.heals += event.get("type") == "heal"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--incarnation", type=int, default=1)
    p.add_argument("--syncs", type=int, default=8)
    p.add_argument("--kill-at-step", type=int, default=None)
    args = p.parse_args()
    votes = Votes()
    events = logging.getLogger("ft_core.events")
    events.setLevel(logging.DEBUG)
    events.addHandler(votes)

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
            print(f"SIGKILL after inner step {steps}", flush=True)
            os.kill(os.getpid(), 9)
    state = manager.healing_state()["user"]
    fragments = {key: {"original_parameters": {n: t.tolist() for n, t in value["original_parameters"].items()},
                       "outer_optimizer": {str(i): {k: v.tolist() for k, v in s.items()}
                                           for i, s in value["outer_optimizer"]["state"].items()}}
                 for key, value in state.items() if key.startswith("StreamingDiLoCoFragment_")}
    summary = {"group": args.group, "steps": steps, "manager_step": manager.current_step(),
               "allreduces": accelerator.ft_stats["cross_group_allreduces"], "votes": votes.votes,
               "heals": votes.heals, "fragments": fragments}
    accelerator.end_training()
    with open(os.path.join(args.out, f"summary_g{args.group}_i{args.incarnation}.json"), "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
