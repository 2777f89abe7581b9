"""One replica group's Fabric training process for tests/test_fabric_strategy.py (run as a script).

The loop is driven by committed steps (`manager.current_step()`), so a restarted group that heals
continues with the same batches as the others. Settings come from the environment.
`--kill-in-reduction-at-step` and `--hold` are tests/_worker_faults.py's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch
from _worker_faults import hold, kill_in_reduction

torch.set_num_threads(1)

from lightning.fabric import Fabric

import ft_lightning  # noqa: F401  (registers "fault_tolerant_ddp")


class EventCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if isinstance(event, dict):
            self.counts[str(event["type"])] = self.counts.get(str(event["type"]), 0) + 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--kill-in-reduction-at-step", type=int, default=None)
    parser.add_argument("--hold", action="append", default=[], metavar="STEP:FILE")
    args = parser.parse_args()
    if args.kill_in_reduction_at_step is not None:
        kill_in_reduction(args.kill_in_reduction_at_step, int(os.environ["NUM_REPLICA_GROUPS"]))
    events = EventCounter()
    logging.getLogger("ft_core.events").setLevel(logging.INFO)
    logging.getLogger("ft_core.events").addHandler(events)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    fabric = Fabric(strategy="fault_tolerant_ddp", accelerator="cpu", devices=1)
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    strategy = fabric.strategy
    strategy.register_state("scheduler", scheduler)
    manager = strategy.manager

    g = torch.Generator().manual_seed(1234 + args.group)  # each group its own data
    xs = torch.randn(args.steps, 4, 8, generator=g)
    ys = xs.sum(dim=2, keepdim=True)
    while manager.current_step() < args.steps:
        step = manager.current_step()
        hold(args.hold, step)
        loss = torch.nn.functional.mse_loss(model(xs[step]), ys[step])  # the forward starts the quorum
        fabric.backward(loss)
        optimizer.step()  # applied only when the step commits
        if strategy.last_step_committed:
            scheduler.step()
        optimizer.zero_grad()
        with open(os.path.join(args.out, f"progress_g{args.group}.jsonl"), "a") as f:
            f.write(json.dumps({"step": manager.current_step(), "pid": os.getpid()}) + "\n")
        if args.kill_at_step is not None and manager.current_step() >= args.kill_at_step:
            os.kill(os.getpid(), 9)

    torch.save(model.module.state_dict() if hasattr(model, "module") else model.state_dict(),
               os.path.join(args.out, f"weights_g{args.group}.pt"))
    torch.save(optimizer.state_dict(), os.path.join(args.out, f"optimizer_g{args.group}.pt"))
    with open(os.path.join(args.out, f"summary_g{args.group}.json"), "w") as f:
        json.dump({"step": manager.current_step(), "events": events.counts,
                   "lr": optimizer.param_groups[0]["lr"], "sampler": strategy.distributed_sampler_kwargs}, f)
    strategy.shutdown()


if __name__ == "__main__":
    main()
