"""One replica group running the typical Accelerate loop, `for epoch in range(N): for batch in loader:`
with an epoch-level scheduler (tests/test_accelerate_epochs.py). Writes per committed step a JSON
line to --events and, at the end, the digest of model + optimizer + scheduler to --out."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch

torch.set_num_threads(1)

from ft_lightning.accelerate import FaultTolerantAccelerator


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: object) -> str:
    h = hashlib.sha256()
    for t in list(model.state_dict().values()):
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for state in optimizer.state_dict()["state"].values():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr(scheduler.get_last_lr()).encode())
    return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--kill-at-step", type=int, default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    accelerator = FaultTolerantAccelerator()
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    events = open(args.events, "a", buffering=1)  # noqa: SIM115 (open until exit)
    for epoch in range(args.epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            events.write(json.dumps({"epoch": epoch, "step": accelerator.ft_step,
                                     "skipped": accelerator.optimizer_step_was_skipped}) + "\n")
            if args.kill_at_step is not None and accelerator.ft_step >= args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(args.sleep)
        scheduler.step()  # once per epoch, as a typical script does
    with open(args.out, "w") as f:
        json.dump({"digest": digest(model, optimizer, scheduler), "step": accelerator.ft_step,
                   "lr": scheduler.get_last_lr()}, f)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
